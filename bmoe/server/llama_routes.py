"""llama-server's native API on bmoe-server: `/completion` (and `/completions`, which llama-server
serves the same), `/tokenize`, `/detokenize`, `/apply-template` and `/props` (bodies and shapes in
bmoe.server.llama_wire). A completion goes through bmoe.server.app's Endpoints (`prepare` and the one
answer loop `answer`, handed in), behind the same key, Host/Origin checks and limits as the `/v1`
routes, and is counted under its own path in /metrics.

Errors on these routes carry llama-server's error types (`authentication_error`, `not_found_error`,
`exceed_context_size_error`, ...: LLAMA_ERROR_TYPES), which its clients, its web UI among them, tell
errors apart by; the object is otherwise the OpenAI one every route answers.

`/completions` is llama-server's native completion, not OpenAI's: llama-server's route table says
so (its OpenAI completions are only `/v1/completions`), and scripts written for it send native fields
there and read `content`. The OpenAI routes llama-server also serves without `/v1` (`/chat/completions`,
`/models`, `/responses`) are bmoe.server.app's, registered under both prefixes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response

from bmoe.api import Model, Request
from bmoe.base import ConfigError, FieldError
from bmoe.server.answer_loop import Choices, choice_requests
from bmoe.server.answer_shape import AnswerShape
from bmoe.server.completion_prompts import check_choices, prompts_of, tokens_of
from bmoe.server.embeddings import EMBEDDING_PATHS
from bmoe.server.http_errors import ServeError, renamed
from bmoe.server.llama_slots import Slots, not_served
from bmoe.server.llama_wire import (
    LLAMA_FIELD_NAMES,
    LLAMA_TOO_LONG_FIX,
    DetokenizeBody,
    LlamaCompletionBody,
    LlamaShape,
    TokenizeBody,
    generation_settings,
    piece_of,
    sampling_settings,
)
from bmoe.server.openai_wire import ChatBody

Prepare = Callable[..., Awaitable[Request]]  # Endpoints.prepare: a body as the engine's checked request
AnswerCall = Callable[[HttpRequest, Choices, bool, str], Awaitable[Response]]  # AnswerLoop.answer: the one answer loop

NATIVE_PATHS = ("/completion", "/completions", "/tokenize", "/detokenize", "/apply-template", "/props", "/slots")
# llama-server's error type of each status bmoe answers (llama-server's server-common.h), where it is not OpenAI's
LLAMA_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                     501: "not_supported_error", 503: "unavailable_error"}


def is_native_path(path: str) -> bool:
    """A route of llama-server's own API, whose errors carry its types (embeddings' native routes too)."""
    return path in NATIVE_PATHS or path in EMBEDDING_PATHS or path.startswith("/slots/")


def llama_error(e: ServeError) -> JSONResponse:
    """`e` as llama-server types it (a prompt past the context: `exceed_context_size_error`), its other fields kept."""
    kind = "exceed_context_size_error" if e.code == "context_length_exceeded" else LLAMA_ERROR_TYPES.get(e.status)
    return ServeError(e.status, e.message, kind or e.type, e.code, e.param, e.extra).response()


class LlamaEndpoints:
    """llama-server's native routes over one server's model (named `model_id`, its -n `n_predict`, its
    --parallel `slots`), its Endpoints' `prepare` and the answer loop's `answer`; `slots_route` and
    `metrics_route`: whether /slots and /metrics are served (--no-slots, --no-metrics)."""

    def __init__(self, model: Model, model_id: str, n_predict: int, slots: int, prepare: Prepare,
                 answer: AnswerCall, slots_route: bool = True, metrics_route: bool = True) -> None:
        self.model, self.model_id, self.n_predict, self.slots = model, model_id, n_predict, slots
        self.prepare, self.answer = prepare, answer
        self.slots_route, self.metrics_route = slots_route, metrics_route
        self._facts: dict[str, Any] | None = None

    async def completion(self, body: LlamaCompletionBody, request: HttpRequest) -> Response:
        """Plain prompts (each a text, token ids or both: bmoe.server.completion_prompts), each answered as its
        `n_cmpl` completions in llama-server's shapes through the answer loop (one object, or a list of them)."""
        reqs: list[Request] = []
        shapes: list[AnswerShape] = []
        named = "n_cmpl" if body.n_cmpl is not None else "n"
        try:
            prompts, n = prompts_of(body.prompt), body.choices
            check_choices(len(prompts), n, named)
            await asyncio.to_thread(body.bias_texts, lambda text: self.model.vocab_tokens(text, False))
            for p in prompts:
                prompt = await asyncio.to_thread(tokens_of, p, self.model.vocab_tokens)
                req = await self.prepare(body, body.n_tokens, LLAMA_TOO_LONG_FIX, prompt=prompt,
                                         response_format=body.format, grammar=body.grammar,
                                         logprobs=body.n_probs or None, ignore_eos=body.ignore_eos,
                                         post_sampling=body.post_sampling_probs)
                text = prompt if isinstance(prompt, str) else await asyncio.to_thread(self.model.detokenize, prompt)
                for r in choice_requests(req, n):
                    settings = generation_settings(self.model.stats.n_ctx, r.max_tokens, r.sampler, r.stop)
                    shapes.append(LlamaShape(self.model_id, text, settings, body.return_tokens, bool(body.n_probs),
                                             len(r.tokens), body.timings_per_token, len(reqs),
                                             body.post_sampling_probs))
                    reqs.append(r)
        except (ServeError, FieldError) as e:
            raise renamed(e, LLAMA_FIELD_NAMES) from None
        return await self.answer(request, Choices(reqs, shapes), body.stream, named)

    async def tokenize(self, body: TokenizeBody) -> dict[str, Any]:
        model = self.model
        tokens = await asyncio.to_thread(model.vocab_tokens, body.content, body.add_special)
        if not body.with_pieces:
            return {"tokens": tokens}
        return {"tokens": [{"id": t, "piece": piece_of(model.piece(t))} for t in tokens]}

    async def detokenize(self, body: DetokenizeBody) -> dict[str, str]:
        try:
            tokens = self.model.token_ids(body.tokens)
        except ConfigError as e:
            raise ServeError(400, str(e).replace("prompt", "tokens", 1), param="tokens") from None
        return {"content": await asyncio.to_thread(self.model.detokenize, tokens)}

    async def apply_template(self, body: ChatBody) -> dict[str, str]:
        """The conversation as the chat route renders it with the model's template (and its add_generation_prompt
        and continue_final_message), not generated from."""
        fmt, opts = self.model.chat_format, body.template_options()
        try:
            parts = await asyncio.to_thread(
                fmt.parts, [m.as_dict() for m in body.messages], body.thinks, tools=body.tools,
                tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls,
                response_format=body.response_format, grammar=body.grammar, verify=False,
                prompt=opts["add_generation_prompt"], continued=opts["continue_final_message"])
        except FieldError as e:
            raise ServeError(400, str(e), param=e.param) from None
        except ConfigError as e:
            raise ServeError(400, str(e), param="messages") from None
        return {"prompt": parts.text}

    async def props(self) -> dict[str, Any]:
        """What llama-server's /props tells, as it is on this server (-c, --parallel, -m, --alias, -n, the
        sampling flags, the GGUF's chat template); bmoe has no slots, props or LoRA endpoints. Asleep
        (bmoe.server.sleep) it answers without waking the model, from `facts` as read before it slept."""
        return {**self.facts(), "is_sleeping": self.model.asleep}

    def facts(self) -> dict[str, Any]:
        """/props' fields but is_sleeping, read from the loaded model once: a wake loads the same."""
        if self._facts is None:
            self._facts = self._read_facts()
        return self._facts

    def _read_facts(self) -> dict[str, Any]:
        model = self.model
        params = {**sampling_settings(model.settings.sampler), "n_predict": self.n_predict}
        bos, eos = model.marker_texts()
        template = model.chat_format.renderer.template
        return {"default_generation_settings": {"n_ctx": model.stats.n_ctx, "params": params},
                "total_slots": self.slots, "model_alias": self.model_id, "model_path": str(model.settings.model),
                "modalities": {"vision": False, "video": False, "audio": False},
                "chat_template": (template or b"").decode(errors="replace"),
                "bos_token": bos, "eos_token": eos,
                "build_info": f"bmoe {metadata.version('bmoe')}", "endpoint_slots": self.slots_route,
                "endpoint_props": False,
                "endpoint_metrics": self.metrics_route}


def add_llama_routes(app: FastAPI, native: LlamaEndpoints, key: list[Depends], awake: list[Depends]) -> None:
    """llama-server's native routes, behind `key` as the /v1 routes are (`/slots` a 501 with --no-slots); those
    that need the model loaded behind `awake` (bmoe.server.sleep), /props not."""
    for path in ("/completion", "/completions"):
        app.post(path, dependencies=awake)(native.completion)
    app.post("/tokenize", dependencies=awake)(native.tokenize)
    app.post("/detokenize", dependencies=awake)(native.detokenize)
    app.post("/apply-template", dependencies=awake)(native.apply_template)
    app.get("/props", dependencies=key)(native.props)
    by_slot = Slots(native.model)
    app.get("/slots", dependencies=awake)(by_slot.get if native.slots_route else not_served("/slots", "--no-slots"))
    app.post("/slots/{id_slot}", dependencies=awake)(by_slot.act)
