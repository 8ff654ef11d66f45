"""One generation's state in the engine (`EngineSequence`, what bmoe.coordinator's Engine.begin hands out and
step and end take)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bmoe.engine.drafts import Drafter
from bmoe.seam import llama


@dataclass
class EngineSequence:
    """One generation's state in the engine (Engine.begin/step/end): its KV sequence and sampler."""

    seq: int
    sampler: llama.Sampler | None
    next: int = -1  # the token sampled from its last logits, decoded at its next step
    prefill_s: float = 0.0
    lossless: bool = False  # no lossy routing for this sequence's tokens (bmoe.streaming.lossy)
    forced: list[int] = field(default_factory=list)  # tokens decoded next instead of sampled (teacher forcing)
    keep_logits: bool = False
    logits: np.ndarray | None = None  # with keep_logits: the distribution `next` was chosen from
    kept: bool = False  # `logits` is the sampler chain's after its last sampler (log p), not the model's
    left: int = 0  # tokens it may still generate (drafts stay within them)
    drafter: Drafter | None = None  # --draft: its drafts and their gate (bmoe.engine.drafts)
