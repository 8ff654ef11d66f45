"""bmoe: run Mixture-of-Experts GGUF models larger than RAM by streaming routed experts from flash.

The Python API (bmoe.api): `bmoe.load(path, **settings)` gives a `Model` with `generate`,
`stream`, `chat`, `chat_stream` and `stats`. Importing bmoe loads no llama.cpp; `load` does.
The module map is in docs/architecture.md.

The API's names load on first use: a worker process (`python -m bmoe.workers.io_lane`) imports
this package first, and bmoe.api would make each lane import numpy and the engine for nothing
(bench/reports/2026-12-01-fast-start-ab-2/ measured what that cost a start). This is the one lazy
surface; every package below imports what it exposes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bmoe.api import *  # noqa: F403 - the type checker sees the API's names; __all__ says which are bmoe's

__all__ = ["Ask", "Chunk", "Completion", "ConfigError", "GenerationStats", "Model", "ModelClosed", "ModelStats",
           "load", "setting_names"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("bmoe.api"), name)
    raise AttributeError(f"module 'bmoe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
