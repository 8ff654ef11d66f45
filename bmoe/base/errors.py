"""What can go wrong, as types: the edges tell errors apart by class, never by their words.

A `BmoeError`'s message is complete for the user (it names the problem and the fix), so an edge
prints it alone; anything else is a bug or the system's and is printed with its class name.
"""

from __future__ import annotations


class BmoeError(Exception):
    """A problem the user can fix; the message says how."""


class ConfigError(BmoeError, ValueError):
    """A setting or request that cannot work (alone, or with this model); the message names the fix."""


class FieldError(ConfigError):
    """One field of a request that cannot work; `param` names it (the server's 400 says which)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class GrammarError(FieldError):
    """A schema or grammar that cannot be enforced; the message names the part and the fix."""


class ContextTooLong(ConfigError):
    """The prompt plus the tokens to generate do not fit the context (an OpenAI client's
    `context_length_exceeded`): the prompt's tokens and the context's, which llama-server's clients read."""

    def __init__(self, message: str, n_prompt: int, n_ctx: int) -> None:
        super().__init__(message)
        self.n_prompt, self.n_ctx = n_prompt, n_ctx


class ModelError(BmoeError):
    """The model file cannot be run as asked: missing, truncated, not MoE enough, changed since the load."""


class LaneError(BmoeError, RuntimeError):
    """An I/O lane kept failing: expert bytes cannot be read."""


class Cancelled(Exception):
    """A cancel stopped the generation; the engine stays usable (not an error to report)."""


class ModelClosed(BmoeError, RuntimeError):
    """The model was closed (Model.close, the interpreter's exit, a server's shutdown) while a
    generation ran or before it began: what it held is freed, so nothing more runs on it."""
