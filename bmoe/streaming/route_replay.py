"""`--replay-routes TRACE`: run the live system on another run's routing (a benchmark mode).

A trace (bmoe's own or route_trace v1: bmoe.streaming.route_trace) says, per token and MoE layer,
which experts a model routed to and with what share of the token's top-k weight. With this mode on,
at each layer's routing node (`ffn_moe_weights-L`, before any expert matmul and before the layer
normalises its weights: the seam lossy routing uses) the routed ids and the gathered weights of
every row are overwritten with the trace's, so the lanes, the cache and its policy, overlap,
prefetch, the spec-gate and the memory budget run exactly the traced model's reads, at this model's
size. The output is not the model's own (unless the trace is this model's, on this prompt).

Which trace row a token takes: the tokens the engine decodes, in order from the load (the prompt's
rows, one batch row each, then each decoded token), take the trace's rows in order (its prompt rows,
then its decode rows), wrapping around when the run is longer than the trace.

Weights are written so that what the layer applies after its own normalisation is the trace's
share: the log of the share before a softmax (NORM_SOFTMAX), the share before a division by the sum
(NORM_SUM) or as it is (NORM_NONE). A trace with fewer experts per token than the model's top-k
fills the other positions with the pool's spare slot (`DROPPED`, as lossy routing does: weight 0, or
-inf before a softmax); one with more keeps its best top-k. A trace row without a layer (a v1
prompt row at the last layer, which llama.cpp computed only for the logits' row) leaves that
layer's routing as the model chose it.
"""

from __future__ import annotations

import numpy as np

from bmoe import seam
from bmoe.streaming.lossy import DROPPED
from bmoe.streaming.route_trace import TokenRoutes, Trace, Weights


class ReplayError(ValueError):
    """A trace that cannot be replayed on this model; the message says why and what fits."""


class RouteReplay:
    """One trace, laid out per model layer as the ids and weights each row's routing node gets."""

    def __init__(self, trace: Trace, name: str, layers: list[int], n_expert: int, top_k: int,
                 norms: dict[int, str]) -> None:
        """`layers` are the model's MoE layers (the trace's are matched to them in order); `norms`
        each layer's normalisation (bmoe.seam.Capture.norms). ReplayError when the trace does not fit."""
        rows: list[TokenRoutes] = trace.prompt + trace.routes
        none: Weights = {}
        weights: list[Weights] = (list(trace.prompt_weights or [none] * len(trace.prompt))
                                  + list(trace.weights or [none] * len(trace.routes)))
        if not any(rows):
            raise ReplayError(f"{name} records no routing (no prompt or decode rows); record one with "
                              "bmoe-cli --route-trace PATH.csv")
        if len(trace.layers) != len(layers):
            raise ReplayError(
                f"{name} routes {len(trace.layers)} MoE layers and this model has {len(layers)}: a replay sets "
                f"each MoE layer's routing to the trace's layer of the same rank; use a model of the trace's "
                f"shape (bmoe-synth --like TRACE writes one) or a trace of this model")
        self.name = name
        self.top_k = top_k
        self.n = len(rows)
        self.weighted = any(w for w in weights if w)
        self.trace_k = trace.header.get("top_k", 0)
        self.ids: dict[int, np.ndarray] = {}  # model layer -> [rows, top_k] int32, DROPPED where the trace has fewer
        self.w: dict[int, np.ndarray] = {}  # model layer -> [rows, top_k] float32, as the weights node must hold them
        self.has: dict[int, np.ndarray] = {}  # model layer -> [rows] bool: the trace row routes this layer
        for tl, layer in zip(trace.layers, layers):
            ids = np.full((self.n, top_k), DROPPED, dtype=np.int32)
            share = np.zeros((self.n, top_k), dtype=np.float64)
            has = np.zeros(self.n, dtype=bool)
            for i, (r, w) in enumerate(zip(rows, weights)):
                ex = r.get(tl)
                if not ex:
                    continue
                bad = [e for e in ex if not 0 <= e < n_expert]
                if bad:
                    where = f"prompt row {i}" if i < len(trace.prompt) else f"decode token {i - len(trace.prompt)}"
                    raise ReplayError(f"{name}: {where} routes layer {tl} to expert {bad[0]}, and this model has "
                                      f"{n_expert} experts per layer (0-{n_expert - 1}); replay it on a model of "
                                      f"the trace's shape (n_expert={trace.header.get('n_expert')})")
                k = min(len(ex), top_k)
                ws = w.get(tl) or []
                s = np.array(ws[:k] if len(ws) >= k else [1.0] * k, dtype=np.float64)
                if not s.sum() > 0:  # no weights recorded (or all 0): equal shares, the reads are the same
                    s = np.ones(k)
                ids[i, :k] = ex[:k]
                share[i, :k] = s / s.sum() if len(ex) <= top_k else s
                has[i] = True
            softmax = norms.get(layer, seam.NORM_NONE) == seam.NORM_SOFTMAX
            with np.errstate(divide="ignore"):
                self.w[layer] = (np.log(share) if softmax else share).astype(np.float32)
            self.ids[layer], self.has[layer] = ids, has
        self.cursor = 0  # trace rows taken by the decodes before this one
        self.base = 0  # the trace row of this decode's first token (before wrapping)

    def describe(self) -> str:
        """What the run will replay, for the start-up notice."""
        k = f"top-{self.trace_k}" if self.trace_k else "its top-k"
        fill = (f"; its top-{self.trace_k} is below the model's {self.top_k}: the other positions read nothing"
                if self.trace_k and self.trace_k < self.top_k else
                f"; the best {self.top_k} of its top-{self.trace_k} are kept" if self.trace_k > self.top_k else "")
        weights = "" if self.weighted else "; it records no router weights: each expert gets an equal share"
        return (f"replaying the routing of {self.name} ({self.n} token rows, {k}) instead of the model's own: "
                f"the output is not the model's{fill}{weights}")

    def begin(self, n_tokens: int) -> None:
        """A llama_decode of `n_tokens` tokens starts: they take the next trace rows."""
        self.base = self.cursor
        self.cursor += n_tokens

    def reroute(self, layer: int, ids: np.ndarray, node: int, at: np.ndarray) -> None:
        """Overwrite the ids ([n_tokens, top_k], in place) and the weights at `node` with the trace rows
        of the decode's tokens `at`."""
        tab = self.ids.get(layer)
        if tab is None or not len(at):
            return
        idx = (self.base + at) % self.n
        on = self.has[layer][idx]
        if not on.any():
            return
        w = seam.moe_weights(node)
        ids[on] = tab[idx[on]]
        w[on] = self.w[layer][idx[on]]
