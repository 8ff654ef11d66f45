"""What bmoe-synth writes, computed without writing: a model's Shape, every Tensor with the type
llama.cpp's loader expects (Q4_K_M's typing rules included), and the Plan of them all. Which
tensors an architecture has is its module's (bmoe.tools.archs, through synth_archs)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from bmoe.tools.synth_vocab import VOCAB

# Expert types; q4_k_m is llama.cpp's Q4_K_M recipe applied to every matrix of the model.
QUANTS: tuple[str, ...] = ("f16", "q8_0", "q4_0", "mxfp4", "q4_k", "q5_k", "q6_k", "q4_k_m")
ROUTER_TYPES: tuple[str, ...] = ("f32", "f16", "q8_0")

GGML_TYPE = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "i32": GGMLQuantizationType.I32,  # deepseek4's token -> expert table
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q5_0": GGMLQuantizationType.Q5_0,  # Q4_K's stand-in for rows that are not whole 256-blocks
    "q5_1": GGMLQuantizationType.Q5_1,  # Q5_K's
    "mxfp4": GGMLQuantizationType.MXFP4,
    "q4_k": GGMLQuantizationType.Q4_K,
    "q5_k": GGMLQuantizationType.Q5_K,
    "q6_k": GGMLQuantizationType.Q6_K,
}
# (elements per block, bytes per block); f16/f32/i32 are "blocks" of one element.
BLOCK = {name: GGML_QUANT_SIZES[t] for name, t in GGML_TYPE.items()}
K_QUANTS = ("q4_k", "q5_k", "q6_k")



@dataclass(frozen=True)
class Tensor:
    """One tensor to write: `shape` is numpy order (GGUF/ggml `ne` is the reverse).

    `fill` says what its values are: "ones" (norms), "normal" (std `std`), "output" (the output
    projection, synth_blocks), "negative" (a recurrent layer's decay, -exp of a normal of std
    `std`), "positive" (a scale, exp of a normal of std `std`: each element its own) or
    "expert_ids" (deepseek4's token -> expert table: distinct experts per row)."""

    name: str
    shape: tuple[int, ...]
    qtype: str  # key of BLOCK
    fill: str
    std: float = 0.0

    @property
    def nbytes(self) -> int:
        per_block, block_bytes = BLOCK[self.qtype]
        return math.prod(self.shape) // per_block * block_bytes


@dataclass(frozen=True)
class Recurrent:
    """The recurrent layers' widths: Gated DeltaNet (qwen35moe, qwen3next, qwen4exp: `head_dim` is
    ssm.state_size, `k_heads` ssm.group_count, `v_heads` ssm.time_step_rank), Kimi delta attention
    (bailingmoe3: `head_dim` is kda.head_dim, one head per attention head) or a short convolution
    (lfm2moe: only `conv`, shortconv.l_cache)."""

    conv: int
    head_dim: int = 0
    k_heads: int = 0
    v_heads: int = 0


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention (deepseek2, glm-dsa, bailingmoe3's attention layers)."""

    q_lora: int  # 0: a plain attn_q
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int


@dataclass(frozen=True)
class Indexer:
    """A sparse attention's indexer: glm-dsa's DSA (`full`: the layers that compute their own top-k,
    the others reuse it), qwen4exp's QSA and deepseek4's compressed attention (`ratios`: each
    layer's compress ratio, 0 = dense)."""

    heads: int
    head_dim: int
    top_k: int
    full: tuple[bool, ...] = ()
    ratios: tuple[int, ...] = ()


@dataclass(frozen=True)
class Ple:
    """qwen4exp's n-gram hash embeddings on one recurrent layer: a `rows` x `dim` table
    (per_layer_token_embd, read lazily by llama.cpp) of which each token gathers one row per head,
    (ngram - 1) x heads_per_ngram heads of `dim` that together span embd."""

    rows: int
    dim: int
    layer: int
    ngram: int
    heads_per_ngram: int
    conv: int

    @property
    def heads(self) -> int:
        return (self.ngram - 1) * self.heads_per_ngram


@dataclass(frozen=True)
class Dsv4:
    """deepseek4's attention and routing widths besides its indexer."""

    q_lora: int
    o_groups: int
    o_lora: int
    window: int
    hash_layers: int  # the first layers route by a token -> expert table (ffn_gate_tid2eid)


@dataclass(frozen=True)
class Shape:
    """A model's shape. Zero means derived: heads from `embd`, the synth's own vocabulary.

    `ff` is one routed expert's width. The other fields are what some architectures add (each says
    which); synth_archs.defaults fills them for a small model of an architecture."""

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
    # Dense FFNs: gemma4's beside the experts in every layer; the leading dense layers' (deepseek2,
    # glm4moe, glm-dsa, lfm2moe, bailingmoe2/3) and llama4's interleaved dense layers'.
    dense_ff: int = 0
    # Every `full_every`-th layer attends to the whole context; the others are sliding-window (gemma4,
    # where the full ones have `full_head_dim`-wide heads and `full_kv_heads` KV heads) or recurrent
    # (qwen35moe, qwen3next, qwen4exp, lfm2moe, bailingmoe3).
    full_every: int = 0
    full_head_dim: int = 0
    full_kv_heads: int = 0
    name: str = ""  # the published model it is shaped like
    fused: bool = False  # experts' gate and up as one ffn_gate_up_exps (the loaders that take either)
    shared_ff: int = 0  # the shared expert(s)' width, 0: none
    dense_lead: int = 0  # leading dense layers
    moe_every: int = 1  # llama4: every moe_every-th layer is MoE, the others dense
    mtp: int = 0  # trailing multi-token-prediction (NextN) layers
    rope_dims: int = 0  # rotated dimensions of a head (0: all)
    recurrent: Recurrent | None = None
    mla: Mla | None = None
    indexer: Indexer | None = None
    hyper: int = 0  # hyper-connection streams (qwen4exp, deepseek4)
    hyper_rank: int = 0  # qwen4exp's low-rank hyper-connection mixer
    ple: Ple | None = None
    dsv4: Dsv4 | None = None

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
        """A published gemma4 shape reads its output projection from token_embd, as the real model
        does. A small model has its own (the loaders take either): an output tied to the embeddings
        makes a random model's greedy text one token repeated (synth_blocks' "output" fill)."""
        return self.arch == "gemma4" and bool(self.name)

    @property
    def all_layers(self) -> int:
        """block_count: the trunk's layers and the MTP layers after them."""
        return self.layers + self.mtp

    def is_full(self, layer: int) -> bool:
        return bool(self.full_every) and (layer + 1) % self.full_every == 0

    def is_moe(self, layer: int) -> bool:
        """Whether `layer` routes to experts (the others have a dense FFN)."""
        return layer >= self.dense_lead and (layer + 1) % self.moe_every == 0


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


# Roles of a tensor (synth_parts.Table), for the types its matrices get: "" is F32 (norms, vectors, the
# weights llama.cpp's quantizer and the converters keep in F32); "f16" a matrix llama-quant keeps as
# converted; "i32" integers; "router" the router (`--router`); "matrix" any other matrix.
_ATTN_V = "attn_v"  # attn_v, attn_qkv, attn_kv_b: llama-quant's attention-v-like tensors
_DOWNS = ("ffn_down", "exps_down")


def _q4_k_m(s: Shape, role: str, layer: int, n_down: int, v_index: tuple[int, int]) -> str:
    """The type llama.cpp's Q4_K_M gives a matrix (src/llama-quant.cpp, llama_tensor_get_type_impl,
    no imatrix), before the fallback for row lengths. `v_index` is (this tensor's place among the
    attention-v-like tensors, their count), as llama-quant counts them in file order.

    One difference from the pinned llama.cpp, on purpose, for the architectures whose files keep
    their bytes (synth_parts.Arch.kept_bytes): a layer's ffn_down is placed among `n_down` = the
    number of ffn_down tensors, as the llama.cpp that made the published files did; the pinned one
    counts layers (`n_down` is the layer count for the others: synth_archs.n_down). It matters only
    where a layer has two (gemma4's dense FFN and its experts), and the gemma-4 trace's expert_bytes
    show the published file was made this way.
    """
    if s.arch == "gpt-oss" and role.startswith("exps_"):
        return "mxfp4"  # gpt-oss ships its experts in MXFP4 and Q4_K_M files keep them so
    if role == "output" or (role == "token_embd" and s.tied):
        return "q6_k"
    if role == _ATTN_V:
        return "q8_0" if s.experts == 8 else "q6_k" if _more_bits(*v_index) else "q4_k"
    if role == "attn_k":
        return "q8_0" if s.experts == 8 else "q4_k"
    if role == "attn_output":
        return "q5_k" if s.experts == 8 else "q4_k"
    if role in _DOWNS:
        return "q6_k" if _more_bits(layer, n_down) else "q4_k"
    return "q4_k"


def matrix_type(s: Shape, role: str, layer: int, ncols: int, n_down: int, v_index: tuple[int, int]) -> str:
    """The type a tensor of `role` gets in a file of `s.quant` (see the roles above)."""
    if role in ("", "f16", "i32"):
        return role or "f32"
    if role == "router":
        return s.router
    if s.quant == "q4_k_m":
        return _fit(_q4_k_m(s, role, layer, n_down, v_index), ncols)
    return s.quant if role.startswith("exps_") else "f16"


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
