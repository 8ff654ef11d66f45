"""What bmoe-synth writes, computed without writing: a model's Shape, every Tensor with the type
llama.cpp's loader expects (Q4_K_M's typing rules included), and the Plan of them all."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from bmoe.base import GB
from bmoe.tools.synth_vocab import VOCAB

ARCHES: tuple[str, ...] = ("qwen3moe", "qwen2moe", "llama", "olmoe", "gpt-oss")
# Expert types; q4_k_m is llama.cpp's Q4_K_M recipe applied to every matrix of the model.
QUANTS: tuple[str, ...] = ("f16", "q8_0", "q4_0", "mxfp4", "q4_k", "q5_k", "q6_k", "q4_k_m")
ROUTER_TYPES: tuple[str, ...] = ("f32", "f16", "q8_0")

GGML_TYPE = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q5_0": GGMLQuantizationType.Q5_0,  # Q4_K's stand-in for rows that are not whole 256-blocks
    "q5_1": GGMLQuantizationType.Q5_1,  # Q5_K's
    "mxfp4": GGMLQuantizationType.MXFP4,
    "q4_k": GGMLQuantizationType.Q4_K,
    "q5_k": GGMLQuantizationType.Q5_K,
    "q6_k": GGMLQuantizationType.Q6_K,
}
# (elements per block, bytes per block); f16/f32 are "blocks" of one element.
BLOCK = {name: GGML_QUANT_SIZES[t] for name, t in GGML_TYPE.items()}
K_QUANTS = ("q4_k", "q5_k", "q6_k")



@dataclass(frozen=True)
class Tensor:
    """One tensor to write: `shape` is numpy order (GGUF/ggml `ne` is the reverse)."""

    name: str
    shape: tuple[int, ...]
    qtype: str  # key of BLOCK
    fill: str  # "ones", "normal" or "output"
    std: float = 0.0

    @property
    def nbytes(self) -> int:
        per_block, block_bytes = BLOCK[self.qtype]
        return math.prod(self.shape) // per_block * block_bytes


@dataclass(frozen=True)
class Shape:
    """A model's shape. Zero means derived: heads from `embd`, the synth's own vocabulary."""

    arch: str
    layers: int
    experts: int
    top_k: int
    embd: int
    ff: int
    quant: str
    router: str = "f32"
    n_head: int = 0
    n_head_kv: int = 0
    head_dim: int = 0
    vocab: int = 0  # a real model's vocabulary size: the synth's tokens padded with unused ones
    rope_base: float = 10000.0
    sliding_window: int = 128  # gpt-oss: every other layer; gemma4: all but the full-attention ones
    # gemma4 only: a dense FFN beside the experts, and every `full_every`-th layer attends to the
    # whole context with wider heads and fewer KV heads.
    dense_ff: int = 0
    full_every: int = 0
    full_head_dim: int = 0
    full_kv_heads: int = 0
    name: str = ""  # the published model it is shaped like

    def __post_init__(self) -> None:
        def derive(attr: str, value: int) -> None:
            if not getattr(self, attr):
                object.__setattr__(self, attr, value)  # frozen: fill the derived defaults once

        derive("head_dim", 64 if self.embd >= 256 and self.embd % 64 == 0 else 32)
        derive("n_head", self.embd // self.head_dim)
        # OLMoE's k-norm spans n_embd, so it needs as many KV heads as query heads.
        derive("n_head_kv", self.n_head if self.arch == "olmoe" or self.n_head % 2 else self.n_head // 2)

    @property
    def n_vocab(self) -> int:
        return self.vocab or len(VOCAB.tokens)

    @property
    def tied(self) -> bool:
        """gemma4 reads its output projection from token_embd, as the real model does."""
        return self.arch == "gemma4"

    def is_full(self, layer: int) -> bool:
        return bool(self.full_every) and (layer + 1) % self.full_every == 0


def _more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's use_more_bits: which layers a Q4_K_M file gives a wider type."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fit(qtype: str, ncols: int) -> str:
    """llama-quant.cpp's tensor_type_fallback: a 256-block type on rows that are not whole blocks
    (gpt-oss's 2880, gemma4's 704 and 2112) becomes the 32-block type of about the same size."""
    if ncols % BLOCK[qtype][0] == 0:
        return qtype
    fallback = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}.get(qtype, qtype)
    return fallback if ncols % BLOCK[fallback][0] == 0 else "f16"


def _q4_k_m(s: Shape, role: str, layer: int, n_down: int) -> str:
    """The type llama.cpp's Q4_K_M gives a matrix (src/llama-quant.cpp, llama_tensor_get_type_impl,
    no imatrix), before the fallback for row lengths.

    One difference from the pinned llama.cpp, on purpose: a layer's ffn_down is placed among
    `n_down` = the number of ffn_down tensors, as the llama.cpp that made the published files did;
    the pinned one counts layers. It matters only where a layer has two (gemma4's dense FFN and its
    experts), and the gemma-4 trace's expert_bytes show the published file was made this way.
    """
    if s.arch == "gpt-oss" and role.startswith("exps_"):
        return "mxfp4"  # gpt-oss ships its experts in MXFP4 and Q4_K_M files keep them so
    if role == "output" or (role == "token_embd" and s.tied):
        return "q6_k"
    if role == "attn_v":
        return "q8_0" if s.experts == 8 else "q6_k" if _more_bits(layer, s.layers) else "q4_k"
    if role == "attn_k":
        return "q8_0" if s.experts == 8 else "q4_k"
    if role == "attn_output":
        return "q5_k" if s.experts == 8 else "q4_k"
    if role in ("ffn_down", "exps_down"):
        return "q6_k" if _more_bits(layer, n_down) else "q4_k"
    return "q4_k"


def _matrix_type(s: Shape, role: str, layer: int, ncols: int, n_down: int) -> str:
    if role == "router":
        return s.router
    if s.quant == "q4_k_m":
        return _fit(_q4_k_m(s, role, layer, n_down), ncols)
    return s.quant if role.startswith("exps_") else "f16"


def _n_down(s: Shape) -> int:
    """How many ffn_down matrices the model has (see _q4_k_m)."""
    return s.layers * (2 if s.dense_ff or s.arch == "qwen2moe" else 1)


def tensor_table(s: Shape) -> list[Tensor]:
    """Every tensor llama.cpp's loader requires for `s.arch` (see src/models/<arch>.cpp), with
    the type `s.quant` gives it."""
    e, v = s.embd, s.n_vocab
    gpt_oss, gemma = s.arch == "gpt-oss", s.arch == "gemma4"
    n_down = _n_down(s)
    out: list[Tensor] = []

    def add(name: str, shape: tuple[int, ...], role: str = "", layer: int = -1, fill: str = "normal",
            std: float = 0.0) -> None:
        qtype = _matrix_type(s, role, layer, shape[-1], n_down) if role else "f32"
        out.append(Tensor(name, shape, qtype, fill, std))

    add("token_embd.weight", (v, e), "token_embd", fill="normal", std=1.0)
    if gemma:  # proportional RoPE of the full-attention layers: one table for all of them
        add("rope_freqs.weight", (s.full_head_dim // 2,), fill="ones")
    for i in range(s.layers):
        p = f"blk.{i}."
        hd = s.full_head_dim if s.is_full(i) else s.head_dim
        q_dim = s.n_head * hd
        kv_dim = (s.full_kv_heads if s.is_full(i) else s.n_head_kv) * hd

        def t(name: str, shape: tuple[int, ...], role: str = "", fill: str = "normal",
              std: float = 0.0) -> None:
            add(p + name, shape, role, i, fill, std)  # noqa: B023 - called only in this iteration

        t("attn_norm.weight", (e,), fill="ones")
        t("attn_q.weight", (q_dim, e), "attn_q", std=e**-0.5)
        t("attn_k.weight", (kv_dim, e), "attn_k", std=e**-0.5)
        t("attn_v.weight", (kv_dim, e), "attn_v", std=e**-0.5)
        t("attn_output.weight", (e, q_dim), "attn_output", std=q_dim**-0.5)
        if s.arch in ("qwen2moe", "gpt-oss"):
            t("attn_q.bias", (q_dim,), std=0.02)
            t("attn_k.bias", (kv_dim,), std=0.02)
            t("attn_v.bias", (kv_dim,), std=0.02)
        if s.arch in ("qwen3moe", "gemma4"):
            t("attn_q_norm.weight", (hd,), fill="ones")
            t("attn_k_norm.weight", (hd,), fill="ones")
        if s.arch == "olmoe":
            t("attn_q_norm.weight", (q_dim,), fill="ones")
            t("attn_k_norm.weight", (kv_dim,), fill="ones")
        if gpt_oss:
            t("attn_output.bias", (e,), std=0.02)
            t("attn_sinks.weight", (s.n_head,), std=1.0)
            t("post_attention_norm.weight", (e,), fill="ones")
        else:
            t("ffn_norm.weight", (e,), fill="ones")
        if gemma:
            t("post_attention_norm.weight", (e,), fill="ones")
            t("layer_output_scale.weight", (1,), fill="ones")
            t("ffn_gate.weight", (s.dense_ff, e), "ffn_gate", std=e**-0.5)
            t("ffn_up.weight", (s.dense_ff, e), "ffn_up", std=e**-0.5)
            t("ffn_down.weight", (e, s.dense_ff), "ffn_down", std=s.dense_ff**-0.5)
            t("post_ffw_norm.weight", (e,), fill="ones")
            t("ffn_gate_inp.scale", (e,), fill="ones")
            t("pre_ffw_norm_2.weight", (e,), fill="ones")
            t("post_ffw_norm_1.weight", (e,), fill="ones")
            t("post_ffw_norm_2.weight", (e,), fill="ones")
        # Router logits with std ~2 make top-k sharp yet token-dependent.
        t("ffn_gate_inp.weight", (s.experts, e), "router", std=2.0 * e**-0.5)
        t("ffn_gate_exps.weight", (s.experts, s.ff, e), "exps_gate", std=e**-0.5)
        t("ffn_up_exps.weight", (s.experts, s.ff, e), "exps_up", std=e**-0.5)
        t("ffn_down_exps.weight", (s.experts, e, s.ff), "exps_down", std=s.ff**-0.5)
        if gemma:
            t("ffn_down_exps.scale", (s.experts,), fill="ones")
        if gpt_oss:
            t("ffn_gate_inp.bias", (s.experts,), std=0.1)
            t("ffn_gate_exps.bias", (s.experts, s.ff), std=0.02)
            t("ffn_up_exps.bias", (s.experts, s.ff), std=0.02)
            t("ffn_down_exps.bias", (s.experts, e), std=0.02)
        if s.arch == "qwen2moe":
            t("ffn_gate_inp_shexp.weight", (e,), std=e**-0.5)
            t("ffn_gate_shexp.weight", (s.ff, e), "ffn_gate", std=e**-0.5)
            t("ffn_up_shexp.weight", (s.ff, e), "ffn_up", std=e**-0.5)
            t("ffn_down_shexp.weight", (e, s.ff), "ffn_down", std=s.ff**-0.5)
    out.append(Tensor("output_norm.weight", (e,), "f32", "ones"))
    if not s.tied:
        add("output.weight", (v, e), "output", fill="output", std=3.0 * e**-0.5)
    return out


def one_expert_bytes(s: Shape, layer: int) -> int:
    """One expert's bytes at `layer` (gate, up, down), without building the whole table."""
    return sum(Tensor("", shape, _matrix_type(s, role, layer, shape[-1], _n_down(s)), "normal").nbytes
               for role, shape in (("exps_gate", (s.ff, s.embd)), ("exps_up", (s.ff, s.embd)),
                                   ("exps_down", (s.embd, s.ff))))


@dataclass(frozen=True)
class Plan:
    """What `write_model` would write: the shape and every tensor, computed without writing."""

    shape: Shape
    tensors: tuple[Tensor, ...]

    @property
    def tensor_bytes(self) -> int:
        """The tensors' bytes: the file less its metadata and alignment (well under 0.1 %)."""
        return sum(t.nbytes for t in self.tensors)

    def _layer(self, layer: int, experts: bool) -> int:
        p = f"blk.{layer}."
        return sum(t.nbytes for t in self.tensors
                   if t.name.startswith(p) and t.name.endswith("_exps.weight") == experts)

    def expert_bytes(self, layer: int) -> int:
        """One expert's bytes across gate, up and down at `layer` (route_trace v1's expert_bytes)."""
        return self._layer(layer, True) // self.shape.experts

    def dense_bytes(self, layer: int) -> int:
        """The layer's other tensors, expert biases included (route_trace v1's dense_bytes)."""
        return self._layer(layer, False)


def _resolve_ff(base: Shape, size_gb: float) -> int:
    """Expert FFN width that makes the file about `size_gb` GB (1 GB = 1e9 bytes).

    File size is linear in ff, so two trial shapes give the exact slope; ff is rounded to a
    multiple of one quant block (32 weights, 256 for the K-quants).
    """
    step = 256 if base.quant in K_QUANTS else 32

    def total(ff: int) -> int:
        return sum(t.nbytes for t in tensor_table(replace(base, ff=ff)))

    smallest = total(step)
    slope = total(2 * step) - smallest
    ff = step + round((size_gb * GB - smallest) / slope) * step
    if ff < step:
        raise ValueError(
            f"--size-gb {size_gb} is below the size of the non-expert tensors plus the smallest "
            f"experts ({smallest / GB:.3f} GB); use fewer layers or a smaller --embd"
        )
    return ff


def shape_from_flags(
    *,
    arch: str,
    layers: int,
    experts: int,
    top_k: int,
    embd: int,
    ff: int,
    quant: str,
    size_gb: float | None,
    router: str,
) -> Shape:
    """The shape bmoe-synth's flags ask for, checked against what llama.cpp and the block sizes allow;
    with `size_gb`, `ff` is chosen so the file is about that many GB."""
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHES)}")
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; choose from {', '.join(QUANTS)}")
    if not 1 <= layers <= 512:
        raise ValueError("layers must be in 1..512 (llama.cpp's LLAMA_MAX_LAYERS)")
    if not 2 <= experts <= 1024:
        raise ValueError("experts must be in 2..1024 (llama.cpp's LLAMA_MAX_EXPERTS)")
    if not 1 <= top_k <= experts:
        raise ValueError("top_k must be in 1..experts")
    if embd < 64 or embd % 32:
        raise ValueError("embd must be a multiple of 32 and at least 64 (one quant block per row)")
    if size_gb is None and (ff < 32 or ff % 32):
        raise ValueError("ff must be a positive multiple of 32 (one quant block per row)")
    if quant in K_QUANTS and (embd % 256 or (size_gb is None and ff % 256)):
        raise ValueError(f"{quant} blocks hold 256 weights: embd and ff must be multiples of 256 "
                         f"(q4_k_m falls back to 32-weight blocks where they are not)")
    if router not in ROUTER_TYPES:
        raise ValueError(f"unknown router type {router!r}; choose from {', '.join(ROUTER_TYPES)}")
    shape = Shape(arch, layers, experts, top_k, embd, ff, quant, router)
    if size_gb is not None:
        shape = replace(shape, ff=_resolve_ff(shape, size_gb))
    return shape


