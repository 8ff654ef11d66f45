"""Generations on the engine: the one generation loop (`driver`), one request's life on a KV sequence
(`request_life`: its prefix reuse, telemetry and KV), what a request takes and gives back (`records`),
its text as the tokens come (`answer_text`: UTF-8 and stop strings), its logprobs (`logprobs`), the
prompt cache (`prompt_cache`) and embeddings (`embedding`). They drive
bmoe.coordinator's Engine; nothing below imports them.
"""

from bmoe.generation.logprobs import log_softmax
from bmoe.generation.request_life import Generation, Slot
