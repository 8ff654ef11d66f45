"""The Python API: `load` (and `open_model` for an edge that has Settings) gives a `Model`.

Every edge (bmoe-cli, the session, bmoe-server, bmoe-bench) gets its Model here. `model.py`
holds Model and its request types; `source.py` decides which file a run uses (a path, `-hf`
via `hub.py`, or the demo model, built on first use).
"""

from bmoe.api.model import (
    TOP_LOGPROBS_MAX,
    Ask,
    Chunk,
    Completion,
    ConfigError,
    ContentTokens,
    GenerationStats,
    Model,
    ModelClosed,
    ModelStats,
    PrefillProgress,
    Request,
    TokenLogprob,
    content_logprobs,
    load,
    open_model,
    setting_names,
)
from bmoe.engine.engine_stats import EngineStats
