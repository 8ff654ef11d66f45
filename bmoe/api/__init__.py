"""The Python API: `load` (and `open_model` for an edge that has Settings) gives a `Model`.

Every edge (bmoe-cli, the session, bmoe-server, bmoe-bench) gets its Model here. `model.py`
holds Model and its request types; `source.py` decides which file a run uses (a path, `-hf`
via `hub.py`, or the demo model, built on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bmoe.base.surface import lazy

if TYPE_CHECKING:
    from bmoe.api.model import (
        TOP_LOGPROBS_MAX,
        Alternative,
        Ask,
        Chunk,
        Completion,
        ConfigError,
        ContentTokens,
        ContextTooLong,
        GenerationStats,
        Model,
        ModelStats,
        Request,
        StopText,
        TokenLogprob,
        content_logprobs,
        load,
        open_model,
        setting_names,
    )
    from bmoe.api.source import resolve
    from bmoe.coordinator import EngineStats

__getattr__, __all__ = lazy(
    __name__,
    {
        "bmoe.api.model": [
            "TOP_LOGPROBS_MAX",
            "Alternative",
            "Ask",
            "Chunk",
            "Completion",
            "ConfigError",
            "ContentTokens",
            "ContextTooLong",
            "GenerationStats",
            "Model",
            "ModelStats",
            "Request",
            "StopText",
            "TokenLogprob",
            "content_logprobs",
            "load",
            "open_model",
            "setting_names",
        ],
        "bmoe.api.source": ["resolve"],
        "bmoe.coordinator": ["EngineStats"],
    },
)
