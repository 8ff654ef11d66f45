"""What the server's one answer loop (bmoe.server.app.Endpoints.answer, whole or streamed) asks of an
API's shapes: `AnswerShape`, written once per API, in its `*_wire` module (OpenAI's chunks
`OpenAIShape`, the Responses API's events `ResponsesShape`, Anthropic's events `AnthropicShape`,
Ollama's JSON lines `OllamaShape`, llama-server's `LlamaShape`). The loop owns the queue, the
reading of a chat answer into reasoning, content and calls (bmoe.chat.output), errors and cancelling;
a shape only turns what it is handed into the bytes or the object its clients read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.sse import format_sse_event

from bmoe.api import Chunk, GenerationStats, Request
from bmoe.chat import Delta, Reply
from bmoe.server.http_errors import ServeError

SSE = "text/event-stream"


@dataclass(frozen=True)
class Finished:
    """A whole answer as the loop hands it to a shape: its text, stats, the stop string that ended
    it (if one did), every chunk (their logprobs) and how many requests were ahead at admission."""

    req: Request
    text: str
    stats: GenerationStats
    stop: str | None
    chunks: Sequence[Chunk]
    ahead: int

    @property
    def reply(self) -> Reply:
        """The answer read into reasoning, content and tool calls (all content when it is not read)."""
        return self.req.reading.read(self.text) if self.req.reading is not None else Reply(self.text, "", ())


class AnswerShape(Protocol):
    """One request's answer in one API's shapes. Streamed, the loop sends `start`, then for each token
    `token`, then `finish` (what reading a chat answer still held back) and `end`, or `error` where
    it fails, then `close`; `comment` says where the request is in the queue, `progress` how far the prompt's
    prefill is (before the first token). A method that has
    nothing to send returns b""."""

    media_type: str  # of a streamed answer

    def whole(self, done: Finished) -> dict[str, Any]:
        """The answer as one JSON object."""

    def comment(self, text: str) -> bytes:
        """A note clients skip (the queue position), where the format has one."""

    def start(self) -> bytes: ...

    def token(self, c: Chunk, d: Delta | None) -> bytes:
        """A generated token; `d`: what reading the answer hands out with it (None: the answer is not read)."""

    def progress(self, c: Chunk) -> bytes:
        """A report on the prompt's prefill (`c.progress`; asked for by llama-server's `return_progress`)."""

    def finish(self, d: Delta) -> bytes:
        """What reading the answer held back to its end."""

    def end(self, s: GenerationStats, stop: str | None, ahead: int) -> bytes: ...

    def error(self, e: ServeError) -> bytes: ...

    def close(self) -> bytes: ...


def sse_comment(text: str) -> bytes:
    """A server-sent events comment line (`: text`), which every SSE client skips."""
    return format_sse_event(comment=text)
