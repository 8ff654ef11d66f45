"""The engine: the load and its parts (`load`), `Engine` itself (bmoe.coordinator: KV sequences,
decode), what an edge prints about the load (`engine_stats`), the one generation loop (`driver`),
one request's life on a KV sequence (`generation`, with its `logprobs`) and the prompt cache.
"""

from bmoe.engine.generation import Completion, Generation
from bmoe.engine.logprobs import log_softmax
