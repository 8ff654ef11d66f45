"""MoE routers read from the GGUF, and the recipe that lets layer l's router input predict layer l+1.

Every supported architecture routes with `top-k(W_l · x_l + b_l)`, where x_l is the
layer's hidden state after an RMS norm scaled by a learned per-channel weight g_l.
Layer l+1's router sees x_{l+1}, which we do not have yet; the recipe predicts it
from x_l by swapping the norm weight: x_l ⊙ g_{l+1} / g_l (the residual stream
changes little from one layer to the next, the norm weights can differ a lot).
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

# the norm applied to the hidden state right before each arch's router (llama.cpp's build_norm call)
ROUTER_NORM = {
    "llama": "ffn_norm",
    "qwen3moe": "ffn_norm",
    "qwen2moe": "ffn_norm",
    "olmoe": "ffn_norm",
    "gpt-oss": "post_attention_norm",
}
_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)


class RouterError(ValueError):
    """The routers cannot be used for prediction (quantized, missing, unknown arch)."""


@dataclass
class Router:
    weight: np.ndarray  # [n_expert, n_embd]
    bias: np.ndarray | None
    norm: np.ndarray | None  # the RMS-norm weight applied to this router's input


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
        n = tensors.get(f"blk.{layer}.{norm_name}.weight") if norm_name else None
        out[layer] = Router(_f32(w).reshape(-1, int(w[1].shape[0])),
                            None if b is None else _f32(b),
                            None if n is None or n[1].type not in _FLOAT_TYPES else _f32(n))
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

    def __init__(self, routers: dict[int, Router], top_k: int, rescale: bool = True) -> None:
        self.routers = routers
        self.top_k = top_k
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
        k = min(self.top_k, logits.size)
        top = np.argpartition(-logits, k - 1)[:k]
        top = top[np.argsort(-logits[top], kind="stable")]
        e = np.exp(logits - logits[top[0]])
        return Prediction(nxt, top, e[top] / e.sum())
