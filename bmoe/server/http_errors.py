"""Every error bmoe-server tells apart, and each as the OpenAI error object a client receives.

The scheduler raises QueueFull, ShuttingDown and GenerationFailed; a route raises ServeError with
its HTTP status; `serve_error`, `http_error` and `validation_error` turn the others into one. A
request field's own error (a bmoe.base.FieldError) becomes a 400 naming that field. A server error
(`internal`: the engine failed, or a bug) tells the client what failed and an error id, never the
exception's text, which can name the model's files and other paths: that goes to the server's
stderr under the same id.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from bmoe.base import ConfigError, ContextTooLong, FieldError
from bmoe.edges import console


class QueueFull(Exception):
    """`ahead` requests are running or waiting and the queue holds `size`."""

    def __init__(self, ahead: int, size: int) -> None:
        super().__init__(f"{ahead} requests are ahead and the queue holds {size}")
        self.ahead, self.size = ahead, size


class ShuttingDown(Exception):
    """The scheduler stopped: a waiting job never runs, a running one was cancelled."""


class GenerationFailed(Exception):
    """The engine failed mid-generation (a lane, the model file): nothing more can run."""


class ServeError(Exception):
    """An error answered as an OpenAI error object with its HTTP status (`extra`: more fields of the error object)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def shutting_down() -> ServeError:
    return ServeError(503, "the server is shutting down; send the request again when it is back",
                      "server_error", "shutting_down")


def internal(what: str, e: BaseException | str) -> ServeError:
    """A 500 saying `what` failed and an error id; `e` itself (its text may name the model's files) is
    logged on the server's stderr under that id, not sent."""
    ref = secrets.token_hex(4)
    console.notice(f"error {ref}: {what}: {e}")
    return ServeError(500, f"{what} (error {ref}; the details are in the server's log)", "server_error",
                      "internal_error")


def context_too_long(e: ContextTooLong, param: str) -> ServeError:
    """A prompt too long for the context: OpenAI's code (its clients read it) and llama-server's type, prompt and
    context sizes (its clients and web UI read those)."""
    return ServeError(400, str(e), "exceed_context_size_error", "context_length_exceeded", param,
                      {"n_prompt_tokens": e.n_prompt, "n_ctx": e.n_ctx})


def serve_error(e: Exception) -> ServeError:
    """What a request hears of a scheduler's exception (bmoe.server.scheduler)."""
    if isinstance(e, ShuttingDown):
        return shutting_down()
    if isinstance(e, QueueFull):
        return ServeError(429, f"the server is busy: {e}; send it again later", "rate_limit_error", "queue_full")
    if isinstance(e, ConfigError):
        return ServeError(400, str(e))
    assert isinstance(e, GenerationFailed), e
    return internal("generation failed", e)


def http_error(exc: HTTPException) -> ServeError:
    code = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}
    return ServeError(exc.status_code, str(exc.detail), "server_error" if exc.status_code >= 500
                      else "invalid_request_error", code.get(exc.status_code))


def validation_error(exc: RequestValidationError) -> ServeError:
    return invalid(exc.errors(), skip=1)


def invalid(errors: Sequence[Any], skip: int = 0) -> ServeError:
    """The 400 of pydantic's `errors` (the first named; `skip`: leading parts of its location that are
    not the body's fields, fastapi's "body")."""
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):  # a check of several fields, or of one the body does not declare
        return ServeError(400, str(cause), param=cause.param)
    where = ".".join(str(x) for x in first.get("loc", ())[skip:])
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return ServeError(400, f"the body is not valid JSON ({detail}); send a JSON object", code="invalid_json")
    msg = f"{where}: {first.get('msg')}" if where else f"the body: {first.get('msg')}"
    more = len(errors) - 1
    return ServeError(400, msg + (f" (and {more} more)" if more else ""), param=where or None)


def renamed(e: ServeError | FieldError, names: Sequence[tuple[str, str]]) -> ServeError:
    """`e` (a FieldError: its 400), which names a field of the chat request another API's request was
    translated into, naming it as that API does: the first of `names` (a pattern of the chat request's
    name, the other API's name, as re.sub takes them) that matches the start of its param, in the param
    and the message."""
    if isinstance(e, FieldError):
        e = ServeError(400, str(e), param=e.param)
    if e.param is None:
        return e
    for pattern, name in names:
        param, n = re.subn("^" + pattern, name, e.param, count=1)
        if n:
            message = re.sub("^" + pattern, name, e.message, count=1)
            return ServeError(e.status, message, e.type, e.code, param, e.extra)
    return e
