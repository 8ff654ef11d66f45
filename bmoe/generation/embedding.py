"""Embeddings on the one engine, as llama-server --embedding computes them: each input is decoded alone,
from an empty KV sequence, in one llama_decode (one ubatch, so mean and cls pooling see the whole
input), its experts streamed as a prefill's; a pooled vector is then normalized as llama-server's
`embd_normalize` asks (common_embd_normalize; L2 by default), per-token vectors (pooling none) are not.

The decodes hold the driver's turn, so they run between generations' steps, never inside one; the
sequence they use is a Slot the caller took (bmoe.server.scheduler gives a free one, as to a
generation), whose KV and what it held are gone afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from bmoe.base.errors import Cancelled, ConfigError
from bmoe.generation.request_life import Slot

if TYPE_CHECKING:
    from bmoe.coordinator import Engine
    from bmoe.generation.driver import Driver

L2 = 2  # llama-server's default embd_normalize: euclidean
NORMS = "-1 (none), 0 (max absolute, to int16's range), 2 (euclidean) or another p above 0 (p-norm)"


def normalized(v: np.ndarray, norm: int) -> np.ndarray:
    """`v` (float32) as llama.cpp's common_embd_normalize writes it: float products summed in double,
    the norm's inverse taken as a float, every element multiplied by it."""
    x = v.astype(np.float64)
    if norm == -1:
        total = 1.0
    elif norm == 0:
        total = float(np.max(np.abs(x), initial=0.0)) / 32760.0
    elif norm == L2:
        total = float(np.sqrt(np.sum((v * v).astype(np.float64))))
    else:
        total = float(np.sum(np.abs(x) ** norm) ** (1.0 / norm))
    return v * np.float32(1.0 / total if total > 0.0 else 0.0)


def check_norm(norm: int) -> None:
    """ConfigError for a normalization llama.cpp does not define (a negative p other than -1)."""
    if norm < -1:
        raise ConfigError(f"embd_normalize: {norm}; give {NORMS}")


def check_inputs(inputs: Sequence[Sequence[int]], width: int, name: str = "input") -> None:
    """ConfigError naming (as `name`[i]) the first input that is empty or too large for one decode of `width`
    tokens ("too large", as llama-server says it)."""
    if not inputs:
        raise ConfigError(f"{name}: no inputs; give at least one")
    for i, toks in enumerate(inputs):
        if not toks:
            raise ConfigError(f"{name}[{i}]: no tokens; give it some text")
        if len(toks) > width:
            raise ConfigError(f"{name}[{i}]: the input ({len(toks)} tokens) is too large to process: an input is one "
                              f"decode of at most {width} tokens (the context's batch; load it with a larger -c, up "
                              "to 2048 tokens an input, or shorten it)")


def check(engine: Engine, inputs: Sequence[Sequence[int]], norm: int, name: str = "input") -> None:
    """ConfigError when `engine` cannot embed `inputs` (by `name`[i]) normalized by `norm`."""
    facts = engine.embedding_facts()
    if facts is None:
        raise ConfigError("this model was loaded without embeddings; load it with embedding=True "
                          "(bmoe-server --embedding)")
    check_norm(norm)
    check_inputs(inputs, facts.width, name)
    engine.check_lossless("load it without them for embeddings")


def embed(driver: Driver, engine: Engine, slot: Slot, inputs: Sequence[Sequence[int]], norm: int = L2,
          cancelled: Callable[[], bool] = lambda: False) -> list[np.ndarray]:
    """Each input's embedding on `slot`'s KV sequence (the caller holds the slot): a pooled vector normalized
    by `norm`, or per-token rows (pooling none) as computed. `cancelled` is asked before each input and
    by Driver.interrupt_alone during its decode (Cancelled when it says so)."""
    check(engine, inputs, norm)
    out: list[np.ndarray] = []
    with driver.driving():
        slot.kv_tokens, slot.messages, slot.lossy = [], [], False  # what the sequence held goes now
        for toks in inputs:
            if cancelled():
                raise Cancelled()
            v = driver.decode_alone(partial(engine.embed, slot.seq, list(toks)), cancelled)
            out.append(normalized(v, norm) if v.ndim == 1 else v)
    return out
