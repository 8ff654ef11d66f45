"""bmoe: run Mixture-of-Experts GGUF models larger than RAM by streaming routed experts from flash.

The Python API (bmoe.api): `bmoe.load(path, **settings)` gives a `Model` with `generate`,
`stream`, `chat`, `chat_stream` and `stats`. Importing bmoe loads no llama.cpp; `load` does.
The module map is in docs/architecture.md.
"""

from bmoe.api import Chunk, Completion, ConfigError, GenerationStats, Model, ModelStats, load, setting_names

__all__ = ["Chunk", "Completion", "ConfigError", "GenerationStats", "Model", "ModelStats", "load", "setting_names"]
