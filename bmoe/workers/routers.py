"""MoE routers read from the GGUF, and the recipe that lets layer l's router input predict layer l+1.

Every streamed architecture routes with `choose(gate(W_l · x_l + b_l))`, where x_l is the layer's
hidden state after an RMS norm scaled by a learned per-channel weight g_l (gemma4: an unweighted RMS
norm scaled by the router's own `ffn_gate_inp.scale`), `gate` is the model's gating (softmax, sigmoid,
sqrt of softplus; bmoe.streaming.gating reads it from the graph) and `choose` the top-k of the gated
scores plus a selection bias (`exp_probs_b`) where the model has one, within the best groups where it
limits them. Layer l+1's router sees x_{l+1}, which we do not have yet; the recipe predicts it from
x_l by swapping the norm weight: x_l ⊙ g_{l+1} / g_l (the residual stream changes little from one
layer to the next, the norm weights can differ a lot), then gates and chooses as layer l+1 does.
The spec-gate worker and the offline recall in `bmoe-bench routes` use this same code.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np

from bmoe.base.gguf_table import TensorInfo, read_table

# the weights that scale each arch's router input (llama.cpp's build_norm call before the router, in
# src/models/<arch>.cpp; gemma4's router scale); an arch missing here gets no spec-gate
ROUTER_NORM = {
    "llama": "ffn_norm.weight",
    "qwen3moe": "ffn_norm.weight",
    "qwen2moe": "ffn_norm.weight",
    "olmoe": "ffn_norm.weight",
    "gpt-oss": "post_attention_norm.weight",
    "gemma4": "ffn_gate_inp.scale",
    "qwen35moe": "post_attention_norm.weight",
    "qwen3next": "post_attention_norm.weight",
    "glm4moe": "post_attention_norm.weight",
    "glm-dsa": "ffn_norm.weight",
    "deepseek2": "ffn_norm.weight",
    "llama4": "ffn_norm.weight",
    "lfm2moe": "ffn_norm.weight",
    "bailingmoe2": "ffn_norm.weight",
    "bailingmoe3": "ffn_norm.weight",
    "minimax-m2": "ffn_norm.weight",
}
GATINGS = ("softmax", "sigmoid", "sqrt_softplus", "logits")  # bmoe.streaming.gating's names
_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)


class RouterError(ValueError):
    """The routers cannot be used for prediction (quantized, missing, unknown arch)."""


@dataclass
class Router:
    weight: np.ndarray  # [n_expert, n_embd]
    bias: np.ndarray | None
    norm: np.ndarray | None  # the RMS-norm weight applied to this router's input
    select_bias: np.ndarray | None = None  # exp_probs_b: added to the gated scores for the choice only


def load_routers(paths: list[str | Path], arch: str, layers: list[int]) -> dict[int, Router]:
    """Each layer's router as F32 arrays, from the model file(s) (any shard). Only the tensor
    table is parsed (bmoe.base.gguf_table): gguf.GGUFReader would parse every field, the tokenizer's
    arrays included, which took seconds of the spec-gate's start on the 64-expert demo model."""
    tensors: dict[str, tuple[Path, TensorInfo]] = {}
    for p in paths:
        for t in read_table(Path(p)).tensors:
            tensors[t.name] = (Path(p), t)
    norm_name = ROUTER_NORM.get(arch)
    out = {}
    for layer in layers:
        w = tensors.get(f"blk.{layer}.ffn_gate_inp.weight")
        if w is None:
            raise RouterError(f"layer {layer} has no router tensor blk.{layer}.ffn_gate_inp.weight")
        if w[1].type not in _FLOAT_TYPES:
            raise RouterError(f"layer {layer}'s router is {gguf.GGMLQuantizationType(w[1].type).name}, not F32/F16")
        b = tensors.get(f"blk.{layer}.ffn_gate_inp.bias")
        n = tensors.get(f"blk.{layer}.{norm_name}") if norm_name else None
        sb = tensors.get(f"blk.{layer}.exp_probs_b.bias")
        out[layer] = Router(_f32(w).reshape(-1, int(w[1].shape[0])),
                            None if b is None else _f32(b),
                            None if n is None or n[1].type not in _FLOAT_TYPES else _f32(n),
                            None if sb is None else _f32(sb))
    return out


def _f32(where: tuple[Path, TensorInfo]) -> np.ndarray:
    path, t = where
    with open(path, "rb") as f:
        f.seek(t.offset)
        data = f.read(t.nbytes)
    dtype = np.float32 if t.type == gguf.GGMLQuantizationType.F32 else np.float16
    return np.frombuffer(data, dtype=dtype).astype(np.float32)


class Prediction(NamedTuple):
    layer: int  # the layer predicted for
    ids: np.ndarray  # its top-k experts, most probable first
    probs: np.ndarray  # their router softmax probabilities over all experts: how sure each guess is


class Predictor:
    """Layer l's router input → the top-k experts layer `next_of[l]` will probably route."""

    def __init__(self, routers: dict[int, Router], top_k: int, rescale: bool = True, gating: str = "softmax",
                 groups: tuple[int, int] = (0, 0)) -> None:
        self.routers = routers
        self.top_k = top_k
        self.gating = gating
        self.groups = groups
        layers = sorted(routers)
        self.next_of = dict(itertools.pairwise(layers))
        self.scale: dict[int, np.ndarray | None] = {}
        for layer, nxt in self.next_of.items():
            g0, g1 = routers[layer].norm, routers[nxt].norm
            if not rescale or g0 is None or g1 is None:
                self.scale[layer] = None
            else:
                safe = np.where(np.abs(g0) > 1e-6, g0, 1.0)
                self.scale[layer] = np.where(np.abs(g0) > 1e-6, g1 / safe, 0.0).astype(np.float32)

    def predict(self, layer: int, x: np.ndarray) -> Prediction | None:
        """The next MoE layer's probable experts, or None after the last MoE layer."""
        nxt = self.next_of.get(layer)
        if nxt is None:
            return None
        s = self.scale[layer]
        r = self.routers[nxt]
        logits = r.weight @ (x if s is None else x * s)
        if r.bias is not None:
            logits = logits + r.bias
        probs = self._gate(logits)
        score = probs if r.select_bias is None else probs + r.select_bias
        if self.groups[0] > 1:
            score = _within_groups(score, *self.groups)
        k = min(self.top_k, logits.size)
        top = np.argpartition(-score, k - 1)[:k]
        top = top[np.argsort(-score[top], kind="stable")]
        return Prediction(nxt, top, probs[top] / max(float(probs.sum()), 1e-30))

    def _gate(self, logits: np.ndarray) -> np.ndarray:
        """The layer's gated scores of every expert, each >= 0 (a softmax for the logits' own order)."""
        if self.gating == "sigmoid":
            return 1.0 / (1.0 + np.exp(-logits))
        if self.gating == "sqrt_softplus":
            return np.sqrt(np.logaddexp(0.0, logits))
        e = np.exp(logits - logits.max())
        return e / e.sum()


def _within_groups(score: np.ndarray, n_groups: int, used: int) -> np.ndarray:
    """build_moe_ffn's group limit: each group scored by the sum of its two best, the best `used` groups
    kept, every other expert at -inf."""
    groups = score.reshape(n_groups, -1)
    best2 = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
    keep = np.argsort(-best2, kind="stable")[:used]
    out = np.full_like(groups, -np.inf)
    out[keep] = groups[keep]
    return out.reshape(-1)
