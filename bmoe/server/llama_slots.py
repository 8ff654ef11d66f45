"""llama-server's `/slots` on bmoe-server: what each of its `--parallel` KV sequences (llama-server's
slots) is doing, for the monitors and load balancers written for llama-server.

GET lists each sequence: `id`, `n_ctx` (`-c`: each sequence has it whole), `is_processing`, `speculative`
(true when the server drafts, `--draft`, as llama-server's is when it has a draft) and `kv_tokens` (the tokens
its KV holds, bmoe's own field). Unlike llama-server's it shows no prompt, answer or request settings: those
are the clients' and stay theirs. `?fail_on_no_slot=1` answers 503 when every sequence is busy, as
llama-server's. `--no-slots` turns the route off (501, as llama-server's).

Saving, restoring or erasing a slot by file (`POST /slots/{id}?action=save|restore|erase`,
llama-server's `--slot-save-path`) is a 501 naming the action: bmoe keeps prompts' KV across restarts
with `--prompt-cache`, keyed by the tokens themselves, and a request finds its KV by its prompt, not by
a slot's number.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request as HttpRequest

from bmoe.api import Model
from bmoe.server.http_errors import ServeError

ACTIONS = ("save", "restore", "erase")


def not_served(what: str, flag: str) -> Callable[[], Awaitable[None]]:
    """A route the server was started without: 501, as llama-server's when its flag is off."""
    async def off() -> None:
        raise ServeError(501, f"this server does not serve {what}: it was started with {flag}",
                         "not_supported_error", "not_supported")
    return off


class Slots:
    """`/slots` over `model`'s KV sequences."""

    def __init__(self, model: Model) -> None:
        self.model = model

    async def get(self, request: HttpRequest) -> list[dict[str, Any]]:
        slots = self.model.slots
        if request.query_params.get("fail_on_no_slot") and all(s.busy for s in slots):
            raise ServeError(503, "no slot available: every KV sequence is generating", "unavailable_error",
                             "no_slot_available")
        n_ctx, drafts = self.model.stats.n_ctx, self.model.settings.draft.mode != "none"
        return [{"id": s.seq, "n_ctx": n_ctx, "speculative": drafts, "is_processing": s.busy,
                 "kv_tokens": len(s.kv_tokens)} for s in slots]

    async def act(self, request: HttpRequest) -> None:
        """llama-server's slot files: refused, naming the action (see the module notes)."""
        action = request.query_params.get("action", "")
        if action not in ACTIONS:
            raise ServeError(400, f"action: {action!r} is not one of {', '.join(ACTIONS)}", param="action")
        raise ServeError(501, f"action={action}: bmoe-server does not {action} slots by file; it keeps prompts' KV "
                         "across restarts with --prompt-cache DIR, found again by the prompt's tokens",
                         "not_supported_error", "not_supported", "action")
