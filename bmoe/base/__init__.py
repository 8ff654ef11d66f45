"""The base every other package stands on: what a run is asked (settings, their argument types),
the error types the edges tell apart, units, the telemetry contract's lines, and a GGUF's table and
files. It imports nothing of bmoe above it.
"""

from bmoe.base.argtypes import nonneg_int, number, positive_float, positive_int
from bmoe.base.errors import BmoeError, Cancelled, ConfigError, ContextTooLong, FieldError, ModelError
from bmoe.base.gguf_table import read_table
from bmoe.base.model_files import EXPERT_TENSOR, shard_paths
from bmoe.base.settings import (
    FLAGS,
    N_PREDICT,
    SAMPLING_FIELDS,
    SCHEMA,
    Entry,
    Settings,
    StreamSettings,
    build,
    check_sampling,
    logit_bias_of,
    schema_of,
    setting,
    validate,
)
from bmoe.base.units import GB, MiB
