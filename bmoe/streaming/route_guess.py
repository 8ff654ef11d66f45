"""Guesses at the next layer's routing, learned from the routing seen so far.

A layer's misses are known only when its router runs, and the flash idles while the layer before
computes. What the run has routed so far says something about what comes next: experts of one
layer go with certain experts of the next (a token's path through the layers), so after layer l
routes S, expert j of layer l+1 is routed with the share of the times S's experts were followed by
j: P(j | S) = Σ_{i∈S} C_l[i, j] / Σ_{i∈S} N_l[i], where C_l counts, over the tokens seen, each
expert i routed at l followed by j routed at l+1, and N_l[i] how often i was routed at l. A guess is
an expert with P at least `threshold` (--guess P); bmoe.replay.guesses scores thresholds on recorded
routing (`bmoe-bench policies --guesses`: what share of the misses a guess names in time, and the
guessed bytes the layer does not route) and bmoe.streaming.readahead reads the guesses that the
cache lacks when a lane is idle. On the shared traces and live it did not pay (docs/levers.md), so
it is off by default.

Counts are kept per MoE layer pair in the model's cycle (the last layer's successor is the first
layer of the next token), int32, n_expert² each: 48 layers × 128² × 4 bytes = 3 MiB.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

WARMUP = 8  # tokens seen before any guess: the counts of a few tokens say little
LEARN_ROWS = 64  # a prompt's rows counted per layer (its last ones): bounded work in a long prefill


class RouteGuess:
    """Counts of which experts follow which from one MoE layer to the next, and guesses from them."""

    def __init__(self, layers: Sequence[int], n_expert: int, threshold: float) -> None:
        self.layers = list(layers)
        self.prev = {b: a for a, b in zip(self.layers[-1:] + self.layers, self.layers)}  # the cycle: first after last
        self.threshold = threshold
        self.follow = {layer: np.zeros((n_expert, n_expert), dtype=np.int32) for layer in self.layers}
        self.seen = {layer: np.zeros(n_expert, dtype=np.int32) for layer in self.layers}
        self.last: dict[int, np.ndarray] = {}  # each layer's rows in the last decode that reached it
        self.tokens = 0  # tokens whose routing was counted at the first layer

    def observe(self, layer: int, ids: np.ndarray) -> None:
        """A decode's routing at `layer`: [rows, k] ids, one row per token in token order (a layer that
        computes fewer rows has the last ones); layers come in cycle order. Each row is counted against
        the same token's row at the layer before; a prompt counts its last LEARN_ROWS rows."""
        rows = ids[-LEARN_ROWS:]
        prev = self.prev[layer]
        before = self.last.get(prev)
        if before is not None:
            follow, seen = self.follow[prev], self.seen[prev]
            for b, r in zip(before[-len(rows):], rows[-len(before):]):
                b, r = np.unique(b[b >= 0]), np.unique(r[r >= 0])  # (lossy routing's dropped positions: -1)
                follow[np.ix_(b, r)] += 1
                seen[b] += 1
        if layer == self.layers[0]:
            self.tokens += len(ids)
        self.last[layer] = rows

    def guess(self, layer: int) -> list[tuple[int, float]]:
        """After `layer` routed (its last observed row), the next layer's experts likely to follow, with
        P(j | S) ≥ the threshold, likeliest first."""
        rows = self.last.get(layer)
        if rows is None or self.tokens < WARMUP or not len(rows):
            return []
        routed = np.unique(rows[-1][rows[-1] >= 0])
        n = int(self.seen[layer][routed].sum())
        if n == 0:
            return []
        p = self.follow[layer][routed].sum(axis=0) / n
        picked = np.flatnonzero(p >= self.threshold)
        return sorted(((int(j), float(p[j])) for j in picked), key=lambda x: -x[1])
