"""Lossy routing, opt-in: read fewer experts by changing which experts a token uses.

Off by default, and exact when off (bmoe.base.settings.LossySettings). At each layer's routing node
(`ffn_moe_weights-L`, before any expert matmul and before the layer normalises its weights) the
eval hook hands `Lossy.reroute` the routed ids, which it may rewrite in place, and the node, whose
gathered weights it may rewrite in place:

- `--experts-per-token K`: the ids come ranked (llama.cpp's top-k is an argsort, best first); the
  ranks from K on are dropped.
- `--cache-routing D`: a routed expert that would have to be read (absent from the cache) is
  replaced by the cached expert of the layer with the best router probability among those the
  token does not use, when that probability is at least (1 - D) times the absent one's. D is
  relative because router probabilities scale with the number of experts and with how sure the
  router is (1/64 is a typical probability on a 64-expert layer, 0.5 on an 8-expert one); for a
  softmax router it is a fixed logit gap, -ln(1 - D). The substitute's weight is its own router
  weight, as if the router had chosen it.
- `--drop-cold F`: a routed expert that would have to be read and carries less than F of the
  token's routing weight (its share after the model's own normalisation, among the experts kept)
  is dropped; the token's best expert never is.

A dropped position keeps its place in the ids (the graph's shape is fixed) but reads the pool's
spare slot (`DROPPED` here, mapped by bmoe.streaming.graph_stops): a slot no expert ever takes, all zeros, so the
matmul reads nothing from flash and nothing stale. Its weight becomes what the layer's own
normalisation ignores: 0 before a sum or as-is weighting, -inf before a softmax. The normalisation
then runs as the model's graph has it, over what is left, so K by this hook computes what
llama.cpp computes with the model's `expert_used_count` set to K (tests/test_seam.py checks it per
architecture). An expert another token of the same batch reads anyway is neither dropped nor
substituted: it would save no read. Rows of a request that asked for lossless output are left
alone (`begin`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bmoe import seam
from bmoe.base.settings import LossySettings
from bmoe.streaming.expert_cache import ABSENT, RESIDENT, ExpertCache

DROPPED = -1  # a dropped position's id after reroute: it reads the spare slot


@dataclass
class RowCounts:
    """One batch row's lossy changes over the layers of one decode: experts dropped by --drop-cold,
    substituted by --cache-routing, and the share of routing weight changed (summed over layers:
    per layer, the part of the model's own top-k weight not computed as the router chose, the
    --experts-per-token cut included)."""

    dropped: int = 0
    substituted: int = 0
    moved: float = 0.0


class Lossy:
    """The lossy modes of one loaded model (see the module notes)."""

    def __init__(self, s: LossySettings, top_k: int, norms: dict[int, str], cache: ExpertCache) -> None:
        self.top_k = top_k
        self.k = s.experts_per_token or top_k
        self.drop_cold = s.drop_cold
        self.cache_routing = s.cache_routing
        self.norms = norms
        self.cache = cache
        self.mask = np.zeros(0, dtype=bool)  # rows of the decode under way that may be changed
        self.rows: list[RowCounts] = []
        self._states = {layer: [np.frombuffer(cache.state[ri], dtype=np.uint8) for ri in idxs]
                        for layer, idxs in cache.by_layer.items()}  # live views of each slice's state

    @property
    def cuts(self) -> bool:
        """Whether every layer is changed, cached or not (--experts-per-token below the top-k)."""
        return self.k < self.top_k

    def begin(self, lossy_rows: list[bool]) -> None:
        """A llama_decode is about to run: which of its rows (tokens, in batch order) may be changed."""
        self.mask = np.array(lossy_rows, dtype=bool)
        self.rows = [RowCounts() for _ in lossy_rows]

    @property
    def active(self) -> bool:
        return bool(self.mask.any())

    def take(self) -> list[RowCounts]:
        """The changes made to each row of the decode just run."""
        rows, self.rows = self.rows, []
        return rows

    def _on(self, n: int) -> np.ndarray:
        """Per routed row: may it be changed. A prefill's rows are one request's, and its last layer may
        route only the rows whose logits are asked for: a mask of another length is uniform."""
        if len(self.mask) == n:
            return self.mask
        return np.full(n, bool(self.mask.all()))

    def reroute(self, layer: int, ids: np.ndarray, node: int) -> None:
        """Apply the lossy modes to one layer's routing: `ids` ([n_tokens, top_k], best first) are
        rewritten in place (DROPPED, or a substitute's id); so are the weights at `node`."""
        n = ids.shape[0]
        on = self._on(n)
        if not on.any() or not n:
            return
        w = seam.moe_weights(node)
        softmax = self.norms.get(layer, seam.NORM_NONE) == seam.NORM_SOFTMAX
        v = np.exp(w - w.max(axis=1, keepdims=True)) if softmax else w.astype(np.float64)
        full = v / np.maximum(v.sum(axis=1, keepdims=True), 1e-30)  # each expert's share of the top-k's weight
        gone = np.zeros(ids.shape, dtype=bool)
        gone[:, self.k:] = True
        gone &= on[:, None]
        sub = np.full(ids.shape, -1, dtype=np.int64)
        if self.drop_cold or self.cache_routing:
            states = self._states[layer]
            absent = np.logical_or.reduce([s == ABSENT for s in states])
            miss = on[:, None] & ~gone & absent[ids]
            if miss.any() and self.cache_routing:
                resident = np.logical_and.reduce([s == RESIDENT for s in states])
                self._substitute(ids, miss, gone, resident, seam.router_scores(node), softmax, sub)
            if miss.any() and self.drop_cold:
                kept = np.where(gone, 0.0, v)
                share = kept / np.maximum(kept.sum(axis=1, keepdims=True), 1e-30)
                cold = miss & (sub < 0) & (share < self.drop_cold)
                cold[:, 0] = False  # the token's best expert stays
                gone |= cold
            # an expert that some row reads anyway is neither dropped nor substituted: no read saved
            read = ids[~gone & (sub < 0)]
            anyway = np.isin(ids, read[absent[read]]) & ~(np.arange(ids.shape[1]) >= self.k)[None, :]
            gone &= ~(anyway & on[:, None])
            sub[anyway] = -1
        if not gone.any() and not (sub >= 0).any():
            return
        moved = np.where(gone | (sub >= 0), full, 0.0).sum(axis=1)
        is_sub = sub >= 0
        if is_sub.any():
            scores = seam.router_scores(node)
            rows_, cols = np.nonzero(is_sub)
            w[rows_, cols] = scores[rows_, sub[rows_, cols]]
            ids[rows_, cols] = sub[rows_, cols]
        w[gone] = -np.inf if softmax else 0.0
        ids[gone] = DROPPED
        counted = self.rows if len(self.rows) == n else None
        for r in np.nonzero(on)[0]:
            c = counted[r] if counted is not None else None
            if c is None:
                continue
            c.dropped += int((gone[r, :self.k]).sum())
            c.substituted += int(is_sub[r].sum())
            c.moved += float(moved[r])

    def _substitute(self, ids: np.ndarray, miss: np.ndarray, gone: np.ndarray, resident: np.ndarray,
                    scores: np.ndarray, softmax: bool, sub: np.ndarray) -> None:
        """Per row, each missing expert (best first) may take the best-scored resident expert the row
        does not use yet, when its router probability is within the relative distance D."""
        floor = 1.0 - self.cache_routing
        for r in np.nonzero(miss.any(axis=1))[0]:
            p = scores[r].astype(np.float64)
            if softmax:  # logits: the probabilities over every expert
                p = np.exp(p - p.max())
                p /= p.sum()
            free = resident.copy()
            free[ids[r][~gone[r]]] = False
            for j in np.nonzero(miss[r])[0]:
                if not free.any():
                    return
                best = int(np.argmax(np.where(free, p, -1.0)))
                if p[best] >= floor * p[ids[r, j]]:
                    sub[r, j] = best
                    free[best] = False
