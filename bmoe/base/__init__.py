"""The base every other package stands on: what a run is asked (settings, their argument types),
the error types the edges tell apart, units, the telemetry contract's lines, and a GGUF's table and
files. It imports nothing of bmoe above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bmoe.base.surface import lazy

if TYPE_CHECKING:
    from bmoe.base import telemetry
    from bmoe.base.argtypes import nonneg_int, number, percent, positive_float, positive_int
    from bmoe.base.errors import (
        BmoeError,
        Cancelled,
        ConfigError,
        ContextTooLong,
        FieldError,
        GrammarError,
        LaneError,
        ModelError,
    )
    from bmoe.base.gguf_table import read_table
    from bmoe.base.model_files import shard_paths
    from bmoe.base.settings import (
        FLAGS,
        KEYWORDS,
        N_PREDICT,
        SAMPLING_FIELDS,
        SCHEMA,
        Entry,
        Naming,
        SamplerSettings,
        Settings,
        StreamSettings,
        build,
        check_sampling,
        from_keywords,
        logit_bias_of,
        schema_of,
        setting,
        validate,
    )
    from bmoe.base.units import MiB

__getattr__, __all__ = lazy(
    __name__,
    {
        "bmoe.base.errors": [
            "BmoeError",
            "Cancelled",
            "ConfigError",
            "ContextTooLong",
            "FieldError",
            "GrammarError",
            "LaneError",
            "ModelError",
        ],
        "bmoe.base.units": ["MiB"],
        "bmoe.base.settings": [
            "FLAGS",
            "KEYWORDS",
            "N_PREDICT",
            "SAMPLING_FIELDS",
            "SCHEMA",
            "Entry",
            "SamplerSettings",
            "Settings",
            "StreamSettings",
            "Naming",
            "build",
            "check_sampling",
            "from_keywords",
            "logit_bias_of",
            "schema_of",
            "setting",
            "validate",
        ],
        "bmoe.base.argtypes": ["nonneg_int", "number", "percent", "positive_float", "positive_int"],
        "bmoe.base.gguf_table": ["read_table"],
        "bmoe.base.model_files": ["shard_paths"],
        "bmoe.base.telemetry": ["telemetry"],
    },
)
