"""What the request bodies of bmoe-server's five APIs share (OpenAI's chat and completions, OpenAI's
Responses, Anthropic's Messages, Ollama's, llama-server's native one): the sampling fields bounded by
the settings' own declarations, bmoe's `"bmoe": {...}` extension, OpenAI's `metadata` within OpenAI's bounds and the
refusal of a field bmoe does not implement unless it asks for nothing. Each API's own bodies are in its
`*_wire` module.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from bmoe.base import SAMPLING_FIELDS, FieldError, check_sampling, logit_bias_of


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 and 1.0 are the same, false and 0 are not."""
    return a is b if isinstance(a, bool) or isinstance(b, bool) else a == b


class BmoeOptions(BaseModel):
    """bmoe's extension of a request body, `"bmoe": {...}` (the openai client's `extra_body`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lossless: bool = False  # plain llama.cpp's output whatever lossy routing the server loaded with


class SamplingFields(BaseModel):
    """A request's sampling fields, by bmoe.base.settings.SAMPLING_FIELDS' names (a test holds the two
    together); None takes the server's flag. Bounded by the settings' own declarations."""

    model_config = ConfigDict(extra="ignore", strict=True)

    temperature: float | None = Field(None, le=2)  # OpenAI's own cap; the bounds below are the settings'
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None  # an extension, as llama-server's
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repeat_penalty: float | None = None  # an extension, as llama-server's
    repeat_last_n: int | None = None  # an extension, as llama-server's
    logit_bias: dict[str, float] | None = None

    @field_validator("*")
    @classmethod
    def _in_bounds(cls, v: Any, info: ValidationInfo) -> Any:
        return in_bounds(v, info)


def in_bounds(v: Any, info: ValidationInfo) -> Any:
    """A body's field `v`: when it is a sampling field, within its setting's own bounds
    (bmoe.base.settings.check_sampling), not a copy of them."""
    if v is not None and info.field_name in SAMPLING_FIELDS:
        check_sampling(info.field_name, logit_bias_of(v) if info.field_name == "logit_bias" else v)
    return v


# OpenAI's bounds on `metadata` (the chat and Responses routes): keys, characters of a key, of a value
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def metadata_in_bounds(v: dict[str, str]) -> dict[str, str]:
    """A body's `metadata` (string keys and values, pydantic has checked): within OpenAI's bounds, else a
    FieldError naming `metadata` (too many keys) or `metadata.<key>` (a key or its value too long)."""
    if len(v) > METADATA_KEYS:
        raise FieldError(f"metadata: at most {METADATA_KEYS} keys (it has {len(v)})", param="metadata")
    for key, value in v.items():
        if len(key) > METADATA_KEY_CHARS:
            raise FieldError(f"metadata.{key}: a key of at most {METADATA_KEY_CHARS} characters (it has "
                             f"{len(key)})", param=f"metadata.{key}")
        if len(value) > METADATA_VALUE_CHARS:
            raise FieldError(f"metadata.{key}: a value of at most {METADATA_VALUE_CHARS} characters (it has "
                             f"{len(value)})", param=f"metadata.{key}")
    return v


# `metadata` as OpenAI defines it: at most 16 keys of at most 64 characters, string values of at most 512
Metadata = Annotated[dict[str, str], AfterValidator(metadata_in_bounds)]


def sampling_of(body: BaseModel) -> dict[str, Any]:
    """The sampling fields a body declares (of SAMPLING_FIELDS), as bmoe.api.Ask and ChatBody take them."""
    return {name: getattr(body, name) for name in SAMPLING_FIELDS if name in type(body).model_fields}


def implemented(data: Any, unimplemented: dict[str, tuple[Any, ...]], prefix: str = "") -> Any:
    """`data` (a body, or one of its objects at `prefix`), whose fields of `unimplemented` ask for
    nothing (one of the values listed with each); else a FieldError naming the first that asks for more."""
    if isinstance(data, dict):
        for name, nothing in unimplemented.items():
            if name in data and not any(_same(data[name], v) for v in nothing):
                raise FieldError(f"{prefix}{name}: bmoe-server does not implement it; leave it out "
                                 f"(or send {json.dumps(nothing[-1])})", param=prefix + name)
    return data


def unasked(fix: str) -> str:
    """A too-long prompt's `fix` (the route's words) for a request that sent no max_tokens: lowering a field it
    never sent is no fix."""
    return re.sub(r", lower [\w.]+, or ", " or ", fix)


# Fields OpenAI, Anthropic or llama-server document that bmoe-server takes although they change no text here,
# with why (docs/server.md lists them by route; tests/test_server_fields.py walks every documented field).
NO_EFFECT: dict[str, str] = {
    "user": "an end user's id for the provider's abuse monitoring; bmoe monitors no one",
    "safety_identifier": "an end user's id for the provider's abuse monitoring; bmoe monitors no one",
    "service_tier": "one tier: this server's", "access_programs": "a provider's access policy",
    "store": "chat completions are stored nowhere (the Responses route honours it)",
    "prompt_cache_key": "bmoe's KV reuse and prompt cache key on the tokens themselves",
    "prompt_cache_retention": "bmoe's KV reuse and prompt cache key on the tokens themselves",
    "prompt_cache_options": "bmoe's KV reuse and prompt cache key on the tokens themselves",
    "cache_prompt": "bmoe always reuses the KV prefix a request shares, and the reuse is exact",
    "n_keep": "bmoe shifts no context (an answer ends at the context's end)",
    "n_discard": "bmoe shifts no context (an answer ends at the context's end)",
    **dict.fromkeys(("dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers"),
                    "read only by dry_multiplier, which bmoe refuses"),
    **dict.fromkeys(("mirostat_tau", "mirostat_eta"), "read only by mirostat, which bmoe refuses"),
    "xtc_threshold": "read only by xtc_probability, which bmoe refuses",
    "dynatemp_exponent": "read only by dynatemp_range, which bmoe refuses",
    "adaptive_decay": "read only by adaptive_target, which bmoe refuses",
    **dict.fromkeys(("reasoning_budget_message", "reasoning_budget_start_tag", "reasoning_budget_end_tags"),
                    "read only by reasoning_budget_tokens, which bmoe refuses"),
    "backend_sampling": "where llama.cpp samples (on a GPU backend), not what",
    "stream_options": "the Responses route's include_obfuscation: bmoe pads no events (the chat and completions "
                      "routes honour include_usage)",
}


def known_fields(body: type[BaseModel], no_effect: dict[str, str] = NO_EFFECT) -> frozenset[str]:
    """What a route takes: its body's declared fields (honoured) and the documented ones that change no text."""
    return frozenset(body.model_fields) | frozenset(no_effect)
