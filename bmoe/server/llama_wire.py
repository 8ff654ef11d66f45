"""llama-server's native API as bmoe-server speaks it, on the same port: the bodies of `POST /completion`
(and `/completions`, which llama-server serves the same), `/tokenize`, `/detokenize`, and the answer in
llama-server's shapes (`LlamaShape`: one object with `content`, `stop_type`, `timings`, ...; or
server-sent events, one `{"content", "tokens", "stop": false}` per piece of text and a last
`"stop": true` with the rest), for the one answer loop (bmoe.server.app's Endpoints.answer), so the
engine, scheduler, grammars, limits and errors are the other APIs'. The routes are
bmoe.server.llama_routes'.

What is taken and what is not (docs/server.md says the same for users):
- `prompt`: one prompt or several, each a string, token ids (generated from as they are), token ids with strings
  among them, or llama-server's `{"prompt_string": ...}` object without media (bmoe.server.completion_prompts);
  several are answered as a list. `n_cmpl` (or `n`): completions of each prompt, each with the request's seed
  plus its index (bmoe.server.answer_loop). Media (`multimodal_data`: bmoe loads no projector) is a 400.
- `n_predict` (or `max_tokens`): -1 or left out takes the server's `-n`; either is cut to the room the prompt
  leaves in the context, as llama-server cuts it (`truncated` when the answer ran to the context's end); 0 is a
  400 (bmoe generates at least one token). `stream`, `stop`, the sampling fields (`temperature`, `top_k`, `top_p`,
  `min_p`, `seed` (-1: the server's), `repeat_penalty`, `repeat_last_n`, `presence_penalty`,
  `frequency_penalty`, `logit_bias` as llama-server's `[[id, bias], ...]` or OpenAI's map, a text for an id biasing each
  of its tokens),
  `grammar`, `json_schema`, `response_format`, `return_tokens`, `n_probs` (bmoe's logprobs as
  `completion_probabilities`; with `post_sampling_probs`, the sampler chain's probabilities after its last
  sampler), `ignore_eos` (every end-of-generation token banned, as llama-server does).
  `cache_prompt` either way (bmoe reuses a KV prefix where the answer stays a full prefill's) and
  `n_keep` (bmoe never shifts the context: nothing to keep).
- `timings_per_token`: each streamed piece carries the `timings` so far (bmoe.server.timings); `return_progress`:
  a stream reports the prompt's prefill (`prompt_progress`) when it starts and after each decode call.
- NATIVE_UNIMPLEMENTED (other samplers, slots, LoRA, ...) is a 400
  naming the field unless it asks for nothing; fields read only by a sampler that is off (DRY's,
  XTC's threshold, mirostat's tau and eta) change nothing and are taken. Any other unknown field is
  ignored, as on the other routes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ModelWrapValidatorHandler, PrivateAttr, model_validator

from bmoe.api import TOP_LOGPROBS_MAX, Chunk, GenerationStats, TokenLogprob
from bmoe.base import SAMPLING_FIELDS, ConfigError, FieldError, check_sampling, logit_bias_of
from bmoe.chat import STOP_STRINGS_MAX, Delta
from bmoe.server.answer_shape import SSE, Finished, sse_comment
from bmoe.server.http_errors import ServeError
from bmoe.server.openai_wire import LLAMA_UNIMPLEMENTED, choices_of, prompt_progress, sse
from bmoe.server.request_base import BmoeOptions, SamplingFields, implemented
from bmoe.server.timings import TimingsSoFar, final_timings

LLAMA_TOO_LONG_FIX = "shorten the prompt, lower n_predict, or restart bmoe-server with a larger -c"
# llama-server's /completion fields bmoe does not implement, each with the values that ask for nothing
NATIVE_UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {**LLAMA_UNIMPLEMENTED, "dynatemp_exponent": (None, 1)}
# a /completion's field as the chat and completions requests' checks name it, renamed to llama-server's
LLAMA_FIELD_NAMES = ((r"response_format\.json_schema\.schema", "json_schema"), (r"max_tokens", "n_predict"))


class LlamaCompletionBody(SamplingFields):
    """`POST /completion`'s body (see the module notes); unknown fields are ignored."""

    prompt: str | list[Any] | dict[str, Any]  # one prompt or several (bmoe.server.completion_prompts)
    n_predict: int | None = None
    max_tokens: int | None = None  # llama-server reads it when n_predict is left out
    stream: bool = False
    stop: list[str] | str | None = Field(None, max_length=STOP_STRINGS_MAX)
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    cache_prompt: bool = True
    return_tokens: bool = False
    n_probs: int = Field(0, ge=0, le=TOP_LOGPROBS_MAX)  # each token's log-probability and its n likeliest
    post_sampling_probs: bool = False  # n_probs' probabilities after the sampler chain, not the model's
    n_keep: int | None = None
    timings_per_token: bool = False  # every streamed piece carries the timings so far
    ignore_eos: bool = False  # no end of generation: the answer runs to n_predict or a stop string
    n_cmpl: int | None = Field(None, ge=1)  # completions of each prompt, each its own generation (`n` too)
    n: int = Field(1, ge=1)
    return_progress: bool = False  # a stream reports the prompt's prefill as it goes (`prompt_progress`)
    id_slot: int | None = Field(None, ge=-1)  # the KV sequence to run on (/slots' id; -1: any)
    model: str | None = None
    bmoe: BmoeOptions = BmoeOptions()
    model_config = ConfigDict(extra="ignore", strict=True)

    _text_bias: list[tuple[str, float]] = PrivateAttr(default_factory=list)  # biases of text, tokenized by the route

    @model_validator(mode="wrap")
    @classmethod
    def _native(cls, data: Any, handler: ModelWrapValidatorHandler[LlamaCompletionBody]) -> LlamaCompletionBody:
        """UNIMPLEMENTED refused; llama-server's random seed (-1); logit_bias as [[id or text, bias], ...] or a map of
        ids or texts: the ids as the sampler takes them, the texts kept for the route to tokenize."""
        data = implemented(data, NATIVE_UNIMPLEMENTED)
        texts: list[tuple[str, float]] = []
        if isinstance(data, dict):
            data = dict(data)
            if data.get("seed") == -1 and not isinstance(data.get("seed"), bool):
                data["seed"] = None
            bias = data.get("logit_bias")
            if isinstance(bias, list):
                if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], int | str) for p in bias):
                    raise FieldError("logit_bias: [[token id or text, bias], ...]", param="logit_bias")
                bias = {str(tok) if isinstance(tok, int) else tok: b for tok, b in bias}
            if isinstance(bias, dict):
                texts = [(k, b) for k, b in bias.items() if not k.lstrip("-").isdigit()]
                data["logit_bias"] = {k: b for k, b in bias.items() if k.lstrip("-").isdigit()}
        for text, b in texts:  # a text's bias within the bounds of a token's
            try:
                check_sampling("logit_bias", logit_bias_of({"0": b}))
            except ConfigError as e:
                raise FieldError(f"logit_bias: the bias of {text!r}: {e}", param="logit_bias") from None
        return handler(data).biased(texts)

    def biased(self, texts: list[tuple[str, float]]) -> LlamaCompletionBody:
        """This body with the biases of texts its logit_bias gave (`bias_texts` tokenizes them)."""
        self._text_bias = texts
        return self

    @property
    def choices(self) -> int:
        """The completions of each prompt: `n_cmpl`, or `n` (llama-server's alias; both sent: the same or a 400)."""
        return choices_of(self.n, self.n_cmpl)

    @property
    def to_context_end(self) -> bool:
        """llama-server's n_predict past the context generates to the context's end (`truncated`), not a 400."""
        return True

    @property
    def n_tokens(self) -> int | None:
        """The tokens to generate at most; None: the server's -n."""
        n = self.n_predict if self.n_predict is not None else self.max_tokens
        if n is None or n == -1:
            return None
        if n < 1:
            name = "n_predict" if self.n_predict is not None else "max_tokens"
            raise ServeError(400, f"{name}: {n} tokens; bmoe-server generates at least 1 (-1: its -n)", param=name)
        return n

    def bias_texts(self, tokenize: Callable[[str], list[int]]) -> None:
        """The biases given to texts, as llama-server takes them: on every token of the text (`tokenize`: without
        BOS), added to logit_bias."""
        for text, b in self._text_bias:
            self.logit_bias = {**(self.logit_bias or {}), **{str(t): b for t in tokenize(text)}}

    @property
    def format(self) -> dict[str, Any] | None:
        """`json_schema` as the response_format the chat request's grammars hold an answer to."""
        if self.json_schema is not None:
            if self.response_format is not None:
                raise ServeError(400, "json_schema: give it or response_format, not both", param="json_schema")
            return {"type": "json_schema", "json_schema": {"name": "output", "schema": self.json_schema}}
        return self.response_format


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False

    @model_validator(mode="before")
    @classmethod
    def _parsed(cls, data: Any) -> Any:
        return implemented(data, {"parse_special": (None, True)})  # bmoe's tokenizer always parses them


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    tokens: list[int] = Field(default_factory=list)


def piece_of(piece: bytes) -> str | list[int]:
    """A token's piece as /tokenize shows it: its text, or its bytes where they are not whole UTF-8."""
    try:
        return piece.decode()
    except UnicodeDecodeError:
        return list(piece)


# ---- the answer ------------------------------------------------------------------------------------


def stop_type(s: GenerationStats, stop: str | None) -> str:
    if s.finish_reason == "length":
        return "limit"
    return "word" if stop is not None else "eos"


class LlamaShape:
    """One /completion answer in llama-server's shapes for the answer loop (bmoe.server.answer_shape).
    `prompt`: the prompt as text (what the answer's `prompt` says); `settings`: its generation_settings;
    `return_tokens`: a whole answer lists its token ids (a streamed piece always lists those it completes);
    `probs`: the request asked for n_probs (each answer lists its tokens' `completion_probabilities`; `post`:
    with post_sampling_probs, as probabilities after the sampler chain, `prob` and `top_probs` as llama-server
    names them, the tokens the chain dropped left out);
    `per_token`: timings_per_token, each streamed piece has the `timings` so far (`prompt_tokens`: the prompt's);
    `index`: the answer's, of several (several prompts, n_cmpl). `truncated`: the answer ran to the context's end
    (settings' n_ctx), as llama-server says when it stops there."""

    media_type = SSE

    def __init__(self, model: str, prompt: str, settings: dict[str, Any], return_tokens: bool = False,
                 probs: bool = False, prompt_tokens: int = 0, per_token: bool = False, index: int = 0,
                 post: bool = False) -> None:
        self.model, self.prompt, self.settings, self.return_tokens = model, prompt, settings, return_tokens
        self.probs, self.index, self.prompt_tokens, self.post = probs, index, prompt_tokens, post
        self.so_far = TimingsSoFar(prompt_tokens) if per_token else None
        self.predicted = 0
        self.pending: list[int] = []  # streamed: ids of tokens whose text is held back (a possible stop string)
        self.pending_probs: list[TokenLogprob] = []  # streamed: the log-probabilities not yet sent

    def _last(self, content: str, tokens: list[int], s: GenerationStats, stop: str | None, ahead: int,
              probs: list[TokenLogprob]) -> dict[str, Any]:
        full = s.finish_reason == "length" and s.prompt_tokens + s.completion_tokens >= self.settings["n_ctx"]
        return {"index": self.index, "content": content, "tokens": tokens, "stop": True, "model": self.model,
                **self._probs(probs), "tokens_predicted": s.completion_tokens, "tokens_evaluated": s.prompt_tokens,
                "generation_settings": self.settings, "prompt": self.prompt, "has_new_line": "\n" in content,
                "truncated": full, "stop_type": stop_type(s, stop), "stopping_word": stop or "",
                "tokens_cached": s.prompt_tokens - s.prefill_tokens, "timings": final_timings(s),
                "bmoe": {**dataclasses.asdict(s), "queue_position": ahead}}

    # -- AnswerShape --

    def whole(self, done: Finished) -> dict[str, Any]:
        ids = [c.token_id for c in done.chunks if c.token_id is not None] if self.return_tokens else []
        probs = [t for c in done.chunks for t in c.logprobs]
        return self._last(done.text, ids, done.stats, done.stop, done.ahead, probs)

    def comment(self, text: str) -> bytes:
        return sse_comment(text)

    def start(self) -> bytes:
        return b""

    def token(self, c: Chunk, d: Delta | None) -> bytes:
        if self.so_far is not None:
            self.so_far.add(c)
        if c.token_id is not None:
            self.predicted += 1
            self.pending.append(c.token_id)
        self.pending_probs += c.logprobs
        if not c.text:
            return b""
        (tokens, self.pending), (probs, self.pending_probs) = (self.pending, []), (self.pending_probs, [])
        return sse({"index": self.index, "content": c.text, "tokens": tokens, "stop": False,
                    "tokens_predicted": self.predicted, **self._probs(probs),
                    **({"timings": self.so_far.now()} if self.so_far is not None else {})})

    def progress(self, c: Chunk) -> bytes:
        """A report on the prefill: llama-server's piece with no content and `prompt_progress` (and the timings so far
        with timings_per_token)."""
        assert c.progress is not None
        timings: dict[str, Any] = {}
        if self.so_far is not None:
            self.so_far.add(c)
            timings = {"timings": self.so_far.now()}
        return sse({"index": self.index, "content": "", "tokens": [], "stop": False, "tokens_predicted": 0,
                    "tokens_evaluated": self.prompt_tokens, **timings, "prompt_progress": prompt_progress(c.progress)})

    def finish(self, d: Delta) -> bytes:
        return b""  # a plain prompt's answer is not read

    def end(self, s: GenerationStats, stop: str | None, ahead: int) -> bytes:
        return sse(self._last("", self.pending, s, stop, ahead, self.pending_probs))

    def error(self, e: ServeError) -> bytes:
        return sse(e.body())

    def close(self) -> bytes:
        return b""

    def _probs(self, tokens: list[TokenLogprob]) -> dict[str, Any]:
        """llama-server's `completion_probabilities` of these tokens (`token`: the answer's text each
        completes, so that they join into it), when the request asked for them."""
        if not self.probs:
            return {}
        if self.post:  # probabilities, of the tokens the chain kept
            return {"completion_probabilities": [
                {"id": t.id, "token": t.text, "bytes": list(t.bytes), "prob": math.exp(t.logprob),
                 "top_probs": [{"id": a.id, "token": a.text, "bytes": list(a.bytes), "prob": math.exp(a.logprob)}
                               for a in t.top if a.logprob > -math.inf]} for t in tokens]}
        return {"completion_probabilities": [
            {"id": t.id, "token": t.text, "bytes": list(t.bytes), "logprob": t.logprob,
             "top_logprobs": [{"id": a.id, "token": a.text, "bytes": list(a.bytes), "logprob": a.logprob}
                              for a in t.top]} for t in tokens]}


def sampling_settings(sampler: Any) -> dict[str, Any]:
    """The sampling settings by their request names (`sampler`: a bmoe.base SamplerSettings), logit_bias as
    llama-server's [{"bias", "token"}, ...] (a token banned by ignore_eos: bias null, JSON's -inf)."""
    out = {name: getattr(sampler, field) for name, field in SAMPLING_FIELDS.items()}
    out["logit_bias"] = [{"bias": bias if math.isfinite(bias) else None, "token": tok}
                         for tok, bias in out["logit_bias"]]
    return out


def generation_settings(n_ctx: int, n_predict: int, sampler: Any, stop: tuple[str, ...]) -> dict[str, Any]:
    """What a request ran with, by llama-server's names (`sampler`: its bmoe.base SamplerSettings)."""
    out = {"n_ctx": n_ctx, "n_predict": n_predict, "stop": list(stop), **sampling_settings(sampler)}
    return json.loads(json.dumps(out, default=str))
