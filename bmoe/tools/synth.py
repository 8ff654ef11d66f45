"""bmoe-synth: write random-weight Mixture-of-Experts GGUF models that llama.cpp loads and runs.

The models exist to exercise expert streaming at any scale: every tensor llama.cpp's loader
requires for the architecture is present, activations stay finite, and the router picks different
experts for different tokens. The text they generate is noise, but it is noise made of real word
pieces, so prompts tokenize and output detokenizes.

`--like NAME` writes a published model's byte shape (its tensor table at Q4_K_M: names, shapes and
the types llama.cpp's quantizer gives them), so streaming reads what it would read from the real
file; `--like TRACE.csv` takes the shape from a route_trace v1 header.
"""

from __future__ import annotations

import argparse
import itertools
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.gguf_writer import WriterState

from bmoe.base import positive_float, positive_int
from bmoe.streaming import Trace

ARCHES: tuple[str, ...] = ("qwen3moe", "qwen2moe", "llama", "olmoe", "gpt-oss")
# Expert types; q4_k_m is llama.cpp's Q4_K_M recipe applied to every matrix of the model.
QUANTS: tuple[str, ...] = ("f16", "q8_0", "q4_0", "mxfp4", "q4_k", "q5_k", "q6_k", "q4_k_m")
ROUTER_TYPES: tuple[str, ...] = ("f32", "f16", "q8_0")

_GGML_TYPE = {
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
_FILE_TYPE = {
    "f16": LlamaFileType.MOSTLY_F16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q4_0": LlamaFileType.MOSTLY_Q4_0,
    "mxfp4": LlamaFileType.MOSTLY_MXFP4_MOE,
    "q4_k": LlamaFileType.MOSTLY_Q4_K_S,
    "q5_k": LlamaFileType.MOSTLY_Q5_K_S,
    "q6_k": LlamaFileType.MOSTLY_Q6_K,
    "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
}
# (elements per block, bytes per block); f16/f32 are "blocks" of one element.
_BLOCK = {name: GGML_QUANT_SIZES[t] for name, t in _GGML_TYPE.items()}
_K_QUANTS = ("q4_k", "q5_k", "q6_k")
# The types files written before K-quants had: their bytes come from PCG64 as they always did,
# so an old command still writes the same file. Everything newer draws from SFC64, 7x faster.
_PCG64_QUANTS = ("f16", "q8_0", "q4_0", "mxfp4")

_GB = 1_000_000_000
_CONTEXT_LENGTH = 4096
_RMS_EPS = 1e-6
_SLIDING_WINDOW = 128  # gpt-oss: every other layer uses sliding-window attention
_SELF_PENALTY = 5.0  # how strongly output.weight discourages repeating the current token

# --- tokenizer -----------------------------------------------------------------------------

_SPACE = "\u2581"  # SentencePiece's "▁" word-start marker
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 5, 6  # gguf.TokenType values
_SPECIALS = (
    ("<unk>", _TT_UNKNOWN),
    ("<s>", _TT_CONTROL),
    ("</s>", _TT_CONTROL),
    ("<|im_start|>", _TT_CONTROL),
    ("<|im_end|>", _TT_CONTROL),  # end of a chat turn: written as the EOT (end-of-generation) id
)
_UNK, _BOS, _EOS, _IM_END = 0, 1, 2, 4

_WORDS = """
the of and to in a is that for it as was with be by on not he I this are or his from at which
but have an they you were her she there been one all we their has would when if so no will more
can out up who them some into its only time other then than do could my like him new what about
over also any these after first two may most well where way even back much our through year make
before good people just those many man how world long day still own same each great might state
should part life work found down under here never while last since right place against both used
school old house year off home high things both public little small set number too being world
must great again need show give old thought children went say said every day three night home
point water room mother area money story fact month lot study book eye job word business issue
side kind head far black long both little hand really family system program question government
during without again open seem together next white begin walk example ease paper group always
music those both mark often letter until mile river car feet care second enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green quick develop ocean
warm free minute strong special mind behind clear tail produce street inch multiply nothing course
stay wheel full force blue object decide surface deep moon island foot system busy test record
boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape equate
hot miss brought heat snow tire bring yes distant fill east paint language among
"""
_SUFFIXES = ("s", "ed", "ing", "er", "ly", "est", "ion", "al", "ful", "ness")
_CHARS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    ".,!?;:'\"-()[]/&%$#@*+=<>_"
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class _Vocab(NamedTuple):
    tokens: list[str]
    scores: list[float]
    types: list[int]
    word_ids: list[int]  # whole words: the only normal tokens the model is made to emit


def _vocab() -> _Vocab:
    """SPM vocab: specials, 256 byte-fallback tokens, then word pieces with all their prefixes.

    llama.cpp's SPM tokenizer only builds a piece by merging adjacent pieces that are themselves
    in the vocab, so every prefix of a word must be a token too; anything else falls back to
    single characters or bytes, which is why any text tokenizes and round-trips.
    """
    tokens = [tok for tok, _ in _SPECIALS]
    types = [tt for _, tt in _SPECIALS]
    scores = [0.0] * len(_SPECIALS)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(_TT_BYTE)
        scores.append(0.0)

    pieces: dict[str, float] = {}

    def add(piece: str, score: float) -> None:
        pieces[piece] = max(pieces.get(piece, score), score)

    add(_SPACE, -1.0)
    for ch in _CHARS:
        add(ch, -2.0)
        add(_SPACE + ch, -1.5)
    words = list(dict.fromkeys(_WORDS.split()))
    whole = set()
    for rank, word in enumerate(words):
        for form in (word, word.capitalize()):
            full = _SPACE + form
            whole.add(full)
            for n in range(2, len(full) + 1):
                # Whole words score higher than the prefixes that lead to them.
                add(full[:n], (1.0 if n == len(full) else 0.0) - rank / len(words) - 3.0 / n)
    for suffix in _SUFFIXES:
        for n in range(1, len(suffix) + 1):
            add(suffix[:n], -1.0 - 1.0 / n)
    for piece, score in pieces.items():
        tokens.append(piece)
        types.append(_TT_NORMAL)
        scores.append(score)
    word_ids = [i for i, tok in enumerate(tokens) if tok in whole and len(tok) > 2]
    return _Vocab(tokens, scores, types, word_ids)


_VOCAB = _vocab()


# --- model shape ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: `shape` is numpy order (GGUF/ggml `ne` is the reverse)."""

    name: str
    shape: tuple[int, ...]
    qtype: str  # key of _BLOCK
    fill: str  # "ones", "normal" or "output"
    std: float = 0.0

    @property
    def nbytes(self) -> int:
        per_block, block_bytes = _BLOCK[self.qtype]
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
        return self.vocab or len(_VOCAB.tokens)

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
    if ncols % _BLOCK[qtype][0] == 0:
        return qtype
    fallback = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}.get(qtype, qtype)
    return fallback if ncols % _BLOCK[fallback][0] == 0 else "f16"


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


def _tensors(s: Shape) -> list[Tensor]:
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


# --- published shapes ----------------------------------------------------------------------


@dataclass(frozen=True)
class Like:
    """A published model's shape at Q4_K_M and the real GGUF it is checked against.

    `real_bytes` is that file's size and `source` says where the number and the shape come from.
    `runs_here` is False when bmoe cannot stream the architecture (the pinned llama.cpp may still
    load it with --no-stream).
    """

    shape: Shape
    real_bytes: int
    source: str
    runs_here: bool = True


LIKES: dict[str, Like] = {
    "qwen3-30b-a3b": Like(
        Shape("qwen3moe", layers=48, experts=128, top_k=8, embd=2048, ff=768, quant="q4_k_m",
              n_head=32, n_head_kv=4, head_dim=128, vocab=151936, rope_base=1e6, name="qwen3-30b-a3b"),
        real_bytes=18_554_258_719,
        source="shape: Qwen/Qwen3-30B-A3B config.json (hidden 2048, 48 layers, 32 heads, 4 KV heads of "
               "128, 128 experts of 768, top-8, vocab 151936, rope_theta 1e6); size: 17.28 GiB, the "
               "'original Q4_K_M (17.28 GB)' of huface.ru/GOBA-AI-Labs/PrunedHub-Qwen3-30B-A3B-EN-80pct-"
               "MxMoE, read as GiB as llama.cpp prints sizes (as 1e9-byte GB the synth would be 7.4 % "
               "over)",
    ),
    "gemma-4-26b-a4b": Like(
        Shape("gemma4", layers=30, experts=128, top_k=8, embd=2816, ff=704, quant="q4_k_m",
              n_head=16, n_head_kv=8, head_dim=256, vocab=262144, rope_base=1e6, sliding_window=1024,
              dense_ff=2112, full_every=6, full_head_dim=512, full_kv_heads=2, name="gemma-4-26b-a4b"),
        real_bytes=17_019_202_680,
        source="shape: google/gemma-4-26B-A4B-it config.json text_config (hidden 2816, 30 layers, 16 "
               "heads, 8 KV heads of 256 on sliding layers and 2 of 512 on every 6th (full-attention) "
               "layer, dense FFN 2112, 128 experts of 704, top-8, vocab 262144, tied embeddings, "
               "sliding window 1024); size: the route trace of google_gemma-4-26B-A4B-it-Q4_K_M.gguf "
               "(../shared/traces): its layers' expert and dense bytes, 16.414 GB, plus a Q6_K "
               "token_embd, 0.606 GB. The table's expert bytes equal the trace's at every layer; its "
               "dense bytes are 4-8 MB a layer short of the trace's, which this table cannot explain "
               "from the config and llama.cpp's rules (ggml-org's Q4_K_M of the model is 16.80 GB on "
               "its Hugging Face page, 0.1 % from this table)",
        runs_here=False,
    ),
    "gpt-oss-20b": Like(
        Shape("gpt-oss", layers=24, experts=32, top_k=4, embd=2880, ff=2880, quant="q4_k_m",
              n_head=64, n_head_kv=8, head_dim=64, vocab=201088, rope_base=150000.0, name="gpt-oss-20b"),
        real_bytes=11_600_000_000,
        source="shape: openai/gpt-oss-20b config.json (hidden 2880, 24 layers, 64 heads, 8 KV heads of "
               "64, 32 experts of 2880, top-4, vocab 201088, sliding window 128, rope_theta 150000); "
               "size: gpt-oss-20b-Q4_K_M.gguf, 11.6 GB, huggingface.co/unsloth/gpt-oss-20b-GGUF/tree/main",
    ),
    "gpt-oss-120b": Like(
        Shape("gpt-oss", layers=36, experts=128, top_k=4, embd=2880, ff=2880, quant="q4_k_m",
              n_head=64, n_head_kv=8, head_dim=64, vocab=201088, rope_base=150000.0, name="gpt-oss-120b"),
        real_bytes=62_770_947_031,
        source="shape: openai/gpt-oss-120b config.json (as gpt-oss-20b, 36 layers of 128 experts); "
               "size: unsloth/gpt-oss-120b-GGUF Q4_K_M, 58.46 GiB (ailocalcheck.com's listing; its "
               "F16 60.88 matches the 60.87 GiB llama-bench prints for that repository's F16). The "
               "table gives the trace's (../shared/traces) expert and dense bytes at every layer",
    ),
}


def _like_name(model: str) -> str | None:
    """The LIKES entry a trace's model file is a quantization of, if any (by its file name)."""
    base = Path(model).name.lower()
    return next((name for name in LIKES if name in base), None)


def shape_from_trace(path: str | Path) -> Shape:
    """The shape a trace's routing ran on, from its header (route_trace v1, or bmoe's own with
    expert bytes). A known model (by the file name in the header) keeps its published table with
    the trace's top-k, checked against the header's expert_bytes; any other gets a shape whose
    experts have exactly the header's bytes at every layer."""
    trace = Trace.read(path)
    h, expert_bytes = trace.header, trace.expert_bytes
    if not expert_bytes:
        raise ValueError(f"{path}: the trace's header gives no expert bytes per layer (route_trace v1's "
                         f"'# layer=L expert_bytes=B' lines)")
    layers = max(expert_bytes) + 1
    if sorted(expert_bytes) != list(range(layers)):
        raise ValueError(f"{path}: bmoe-synth needs every layer to be a MoE layer; the header lists "
                         f"{len(expert_bytes)} of {layers}")
    name = _like_name(h.get("model", ""))
    if name is not None:
        shape = replace(LIKES[name].shape, top_k=h["top_k"])
        wrong = [(layer, b, _one_expert_bytes(shape, layer)) for layer, b in sorted(expert_bytes.items())
                 if layer >= shape.layers or b != _one_expert_bytes(shape, layer)]
        if (shape.layers, shape.experts) != (layers, h["n_expert"]) or wrong:
            raise ValueError(f"{path}: its model {Path(h['model']).name} is {name} by name, but the header "
                             f"({layers} layers of {h['n_expert']} experts; layer, its expert bytes, the "
                             f"table's: {wrong[:3]}) differs from {name}'s table")
        return shape
    return _derive_shape(h.get("arch", ""), h["n_expert"], h["top_k"], expert_bytes, path)


def _one_expert_bytes(s: Shape, layer: int) -> int:
    """One expert's bytes at `layer` (gate, up, down), without building the whole table."""
    return sum(Tensor("", shape, _matrix_type(s, role, layer, shape[-1], _n_down(s)), "normal").nbytes
               for role, shape in (("exps_gate", (s.ff, s.embd)), ("exps_up", (s.ff, s.embd)),
                                   ("exps_down", (s.embd, s.ff))))


def _derive_shape(trace_arch: str, n_expert: int, top_k: int, expert_bytes: dict[int, int],
                  path: str | Path) -> Shape:
    """A shape whose one-expert bytes equal the header's at every layer: the first architecture and
    expert type, then the hidden size closest to 3x the expert width (as real MoEs are), that solve
    them all. qwen2moe comes second: its shared expert is a second ffn_down a layer, which moves
    Q4_K_M's wider down layers as a dense FFN beside the experts does (gemma4)."""
    first, layers = expert_bytes[0], len(expert_bytes)
    arches = dict.fromkeys((trace_arch if trace_arch in ARCHES else "qwen3moe", "qwen2moe"))
    for arch, quant in itertools.product(arches, ("q4_k_m", "q8_0", "q4_0", "mxfp4", "q6_k", "q5_k", "q4_k", "f16")):
        found: list[Shape] = []
        for embd in range(256 if quant in _K_QUANTS else 64, 16385, 256 if quant in _K_QUANTS else 32):
            for probe in (256, 32):  # the down rows' fallback type depends on ff: try both
                shape = Shape(arch, layers, n_expert, top_k, embd, probe, quant)
                ff, rest = divmod(first * probe, _one_expert_bytes(shape, 0))
                if rest or ff < 32 or ff % (256 if quant in _K_QUANTS else 32):
                    continue
                shape = replace(shape, ff=ff)
                if all(_one_expert_bytes(shape, layer) == b for layer, b in expert_bytes.items()):
                    found.append(shape)
        if found:
            return min(found, key=lambda x: abs(math.log(x.embd / (3 * x.ff))))
    raise ValueError(f"{path}: no expert type and hidden size give experts of the header's bytes at "
                     f"every layer ({first} at layer 0); name a known model with --like ({', '.join(LIKES)})")


def plan_model(
    *,
    like: str | None = None,
    arch: str = "qwen3moe",
    layers: int = 4,
    experts: int = 8,
    top_k: int = 2,
    embd: int = 128,
    ff: int = 256,
    quant: str = "q8_0",
    size_gb: float | None = None,
    router: str = "f32",
) -> Plan:
    """The tensors `write_model` writes for these arguments, without writing anything.

    `like` is a LIKES name or a route_trace v1 CSV path; it sets the whole shape and the other
    shape arguments are ignored.
    """
    if like is not None:
        if like in LIKES:
            shape = LIKES[like].shape
        elif Path(like).is_file():
            shape = shape_from_trace(like)
        else:
            raise ValueError(f"--like {like}: neither a known model ({', '.join(LIKES)}) nor a "
                             f"trace file (route_trace v1 .csv)")
        return Plan(shape, tuple(_tensors(shape)))
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
    if quant in _K_QUANTS and (embd % 256 or (size_gb is None and ff % 256)):
        raise ValueError(f"{quant} blocks hold 256 weights: embd and ff must be multiples of 256 "
                         f"(q4_k_m falls back to 32-weight blocks where they are not)")
    if router not in ROUTER_TYPES:
        raise ValueError(f"unknown router type {router!r}; choose from {', '.join(ROUTER_TYPES)}")
    shape = Shape(arch, layers, experts, top_k, embd, ff, quant, router)
    if size_gb is not None:
        shape = replace(shape, ff=_resolve_ff(shape, size_gb))
    return Plan(shape, tuple(_tensors(shape)))


def _add_metadata(w: GGUFWriter, s: Shape, seed: int, chat_template: str) -> None:
    a = s.arch
    w.add_string("general.name", f"bmoe-synth {s.name}-like seed{seed}" if s.name else
                 f"bmoe-synth {a} L{s.layers} E{s.experts}x{s.ff} {s.quant} seed{seed}")
    w.add_uint32("general.file_type", _FILE_TYPE[s.quant])
    w.add_uint32("general.quantization_version", 2)
    w.add_uint32(f"{a}.context_length", _CONTEXT_LENGTH)
    w.add_uint32(f"{a}.embedding_length", s.embd)
    w.add_uint32(f"{a}.block_count", s.layers)
    w.add_uint32(f"{a}.feed_forward_length", s.dense_ff or s.ff)
    w.add_uint32(f"{a}.expert_count", s.experts)
    w.add_uint32(f"{a}.expert_used_count", s.top_k)
    if a in ("qwen3moe", "qwen2moe", "gpt-oss", "gemma4"):
        w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    if a == "qwen2moe":
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.ff)
    if a in ("gpt-oss", "gemma4"):
        w.add_uint32(f"{a}.attention.sliding_window", s.sliding_window)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    if a == "gemma4":  # per-layer head shapes: sliding layers, then every full_every-th
        full = [s.is_full(i) for i in range(s.layers)]
        w.add_array(f"{a}.attention.head_count_kv", [s.full_kv_heads if f else s.n_head_kv for f in full])
        w.add_array(f"{a}.attention.sliding_window_pattern", [not f for f in full])
        w.add_uint32(f"{a}.attention.key_length", s.full_head_dim)
        w.add_uint32(f"{a}.attention.value_length", s.full_head_dim)
        w.add_uint32(f"{a}.attention.key_length_swa", s.head_dim)
        w.add_uint32(f"{a}.attention.value_length_swa", s.head_dim)
        w.add_uint32(f"{a}.attention.shared_kv_layers", 0)
        w.add_uint32(f"{a}.embedding_length_per_layer_input", 0)
        w.add_uint32(f"{a}.rope.dimension_count_swa", s.head_dim)
        w.add_float32(f"{a}.rope.freq_base_swa", 10000.0)
        w.add_float32(f"{a}.final_logit_softcapping", 30.0)
    else:
        w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
        w.add_uint32(f"{a}.attention.key_length", s.head_dim)
        w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", _RMS_EPS)
    w.add_uint32(f"{a}.rope.dimension_count", s.full_head_dim or s.head_dim)
    w.add_float32(f"{a}.rope.freq_base", s.rope_base)

    pad = s.n_vocab - len(_VOCAB.tokens)  # unused tokens up to a real model's vocabulary size
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", _VOCAB.tokens + [f"<unused{i}>" for i in range(pad)])
    w.add_array("tokenizer.ggml.scores", _VOCAB.scores + [0.0] * pad)
    w.add_array("tokenizer.ggml.token_type", _VOCAB.types + [_TT_UNUSED] * pad)
    w.add_uint32("tokenizer.ggml.unknown_token_id", _UNK)
    w.add_uint32("tokenizer.ggml.bos_token_id", _BOS)
    w.add_uint32("tokenizer.ggml.eos_token_id", _EOS)
    w.add_uint32("tokenizer.ggml.eot_token_id", _IM_END)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    w.add_string("tokenizer.chat_template", chat_template)


# --- tensor data ---------------------------------------------------------------------------

# Each type's codes are uniform random bits; these set the scales so a weight has the tensor's
# std and mean ~0. rms/mean of the code values: int8 73.9; 4-bit c-8 4.64; 5-bit c-16 9.25;
# 4-bit c 4.61 (mean 7.5); 5-bit c 9.23 (mean 15.5); 6-bit c-32 18.48; e2m1 2.93.
_K_SCALE = 36  # every sub-block's 6-bit scale (and min): above 15, so the packing's top bits count


def _pack_k_scales(scale: int, minimum: int) -> bytes:
    """block_q4_K/q5_K `scales[12]` (ggml-common.h) for eight sub-blocks of one scale and min:
    bytes 0-3 hold scales 0-3 (6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for
    the mins, bytes 8-11 the low 4 bits of scales 4-7 and (high nibble) of mins 4-7."""
    q = bytearray(12)
    for j in range(4):
        q[j] = (scale & 63) | ((scale >> 4) << 6)
        q[j + 4] = (minimum & 63) | ((minimum >> 4) << 6)
        q[j + 8] = (scale & 0xF) | ((minimum & 0xF) << 4)
    return bytes(q)


def _f16(x: float) -> np.ndarray:
    return np.frombuffer(np.float16(x).tobytes(), np.uint8)


def _set_scales(blocks: np.ndarray, qtype: str, std: float) -> None:
    """Overwrite the scale fields of random `blocks` so the weights have std `std`, mean ~0."""
    if qtype == "q8_0":  # f16 d, 32 x int8: d*c
        blocks[:, :2] = _f16(std / 73.9)
    elif qtype == "q4_0":  # f16 d, 32 x 4-bit: d*(c-8)
        blocks[:, :2] = _f16(std / 4.64)
    elif qtype == "q5_0":  # f16 d, qh[4], qs[16]: d*(c-16)
        blocks[:, :2] = _f16(std / 9.25)
    elif qtype == "q5_1":  # f16 d, f16 m, qh[4], qs[16]: d*c + m
        d = std / 9.23
        blocks[:, :2], blocks[:, 2:4] = _f16(d), _f16(-15.5 * d)
    elif qtype in ("q4_k", "q5_k"):  # f16 d, f16 dmin, scales[12], (qh[32]), qs: d*sc*c - dmin*m
        rms, mean = (4.61, 7.5) if qtype == "q4_k" else (9.23, 15.5)
        d = std / (_K_SCALE * rms)
        blocks[:, :2], blocks[:, 2:4] = _f16(d), _f16(mean * d)  # dmin*m = mean*d*sc: mean 0
        blocks[:, 4:16] = np.frombuffer(_pack_k_scales(_K_SCALE, _K_SCALE), np.uint8)
    elif qtype == "q6_k":  # ql[128], qh[64], int8 scales[16], f16 d: d*sc*(c-32)
        blocks[:, 192:208] = _K_SCALE
        blocks[:, 208:210] = _f16(std / (_K_SCALE * 18.48))
    elif qtype == "mxfp4":  # E8M0 exponent e, 32 x e2m1: 2^(e-127) * {0, ±.5, .., ±6}
        blocks[:, 0] = 127 + round(math.log2(std / 2.93))
    else:
        raise ValueError(f"no random blocks for {qtype}")


def _zero_blocks(blocks: np.ndarray, qtype: str, which: np.ndarray) -> None:
    """Make the blocks `which` selects decode to zeros: their scales become 0."""
    if qtype == "q6_k":
        blocks[which, 208:210] = 0
    elif qtype == "mxfp4":
        blocks[which] = 0  # an all-zero code is 0 whatever the exponent
    else:
        blocks[which, :4 if qtype in ("q5_1", "q4_k", "q5_k") else 2] = 0


_CHUNK_BYTES = 64 << 20  # what one write holds: a 0.5 GB expert tensor is never whole in memory


def _quantized_chunks(t: Tensor, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """`t`'s blocks, whole rows at a time: uniformly random codes under the scales of `t.std`.

    Drawing raw bits is far cheaper than quantizing float noise, which matters for GB-size files.
    Chunks hold a multiple of 8 rows, so every chunk but the last is whole 64-bit draws and the
    bytes do not depend on the chunk size. For `output` only whole words and the end tokens get a
    non-zero row, so generated text reads as words (the f16 path says why).
    """
    per_block, block_bytes = _BLOCK[t.qtype]
    blocks_per_row = t.shape[-1] // per_block
    row_bytes = blocks_per_row * block_bytes
    rows = math.prod(t.shape[:-1])
    step = max(8, _CHUNK_BYTES // row_bytes // 8 * 8)
    keep = None
    if t.fill == "output":
        keep = np.zeros(rows, bool)
        keep[[*_VOCAB.word_ids, _EOS, _IM_END]] = True
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        raw = rng.bit_generator.random_raw((n * row_bytes + 7) // 8)
        blocks = raw.view(np.uint8)[: n * row_bytes].reshape(n * blocks_per_row, block_bytes)
        _set_scales(blocks, t.qtype, t.std)
        if keep is not None:
            _zero_blocks(blocks, t.qtype, np.repeat(~keep[r0:r0 + n], blocks_per_row))
        yield blocks


def _float_data(t: Tensor, rng: np.random.Generator, token_embd: np.ndarray | None) -> np.ndarray:
    if t.fill == "ones":
        return np.ones(t.shape, np.float32)
    data = rng.standard_normal(t.shape, np.float32)
    data *= t.std
    if t.fill == "output":
        assert token_embd is not None, "an f16 output.weight is derived from an f16 token_embd"
        # The residual stream is dominated by the current token's embedding; subtracting the
        # embeddings from the output rows makes that token unlikely to follow itself, so greedy
        # decoding does not settle on one token repeated forever.
        data -= (_SELF_PENALTY / t.shape[1]) * token_embd.astype(np.float32)
        # Only whole words and the end tokens get an output row, so generated text reads as
        # words; prompts can still use every piece and the byte fallback.
        keep = np.zeros(t.shape[0], bool)
        keep[[*_VOCAB.word_ids, _EOS, _IM_END]] = True
        data[~keep] = 0.0
        # End tokens stay possible but rare, so a test's 32-token generation is not cut short.
        data[[_EOS, _IM_END]] *= 0.25
    return data.astype(np.float16 if t.qtype == "f16" else np.float32)


class _Writer(GGUFWriter):
    """GGUFWriter that takes a tensor's bytes in pieces (its write_tensor_data, chunked)."""

    def write_tensor_chunks(self, chunks: Iterable[np.ndarray]) -> None:
        assert self.fout is not None and self.state in (WriterState.TI_DATA, WriterState.WEIGHTS)
        file_id = next(i for i, tensors in enumerate(self.tensors) if tensors)
        fout = self.fout[file_id]
        info = self.tensors[file_id].pop(next(iter(self.tensors[file_id])))
        self.write_padding(fout, fout.tell())
        written = 0
        for chunk in chunks:
            chunk.tofile(fout)
            written += chunk.nbytes
        assert written == info.nbytes, (written, info.nbytes)
        self.write_padding(fout, written)
        self.state = WriterState.WEIGHTS


def _resolve_ff(base: Shape, size_gb: float) -> int:
    """Expert FFN width that makes the file about `size_gb` GB (1 GB = 1e9 bytes).

    File size is linear in ff, so two trial shapes give the exact slope; ff is rounded to a
    multiple of one quant block (32 weights, 256 for the K-quants).
    """
    step = 256 if base.quant in _K_QUANTS else 32

    def total(ff: int) -> int:
        return sum(t.nbytes for t in _tensors(replace(base, ff=ff)))

    smallest = total(step)
    slope = total(2 * step) - smallest
    ff = step + round((size_gb * _GB - smallest) / slope) * step
    if ff < step:
        raise ValueError(
            f"--size-gb {size_gb} is below the size of the non-expert tensors plus the smallest "
            f"experts ({smallest / _GB:.3f} GB); use fewer layers or a smaller --embd"
        )
    return ff


def write_model(
    path: str | Path,
    *,
    like: str | None = None,
    arch: str = "qwen3moe",
    layers: int = 4,
    experts: int = 8,
    top_k: int = 2,
    embd: int = 128,
    ff: int = 256,
    quant: str = "q8_0",
    seed: int = 0,
    size_gb: float | None = None,
    splits: int = 1,
    router: str = "f32",
    chat_template: str = CHAT_TEMPLATE,
    progress: bool = False,
) -> Path:
    """Write a random-weight MoE GGUF that llama.cpp can load and run; return its path.

    Same arguments give a byte-identical file. With `size_gb`, `ff` is ignored and chosen so
    the file is about that many GB. With `like` (a LIKES name or a route_trace v1 CSV) the shape
    and every tensor's type are a published model's at Q4_K_M and the other shape arguments are
    ignored (see plan_model). With `splits` > 1 the model is written as llama.cpp split
    shards `<stem>-0000i-of-0000N.gguf` beside `path`, and the first shard's path is returned.
    Expert tensors (`*_exps.weight`) use `quant` (q4_k_m: every matrix as llama.cpp's Q4_K_M
    recipe types it); the router uses `router` (F32 by default: a quantized router is what real
    files sometimes ship, and what --spec-gate cannot use); norms are F32, other matrices F16.
    `chat_template` is the jinja template stored (ChatML by default; another model's, e.g.
    Qwen3's, to test what it renders and parses). Tensors are generated and written in chunks of
    whole rows, so memory stays at about 64 MiB (one f16 matrix for the small f16 models).
    """
    if seed < 0:
        raise ValueError("seed must be >= 0")
    if splits < 1:
        raise ValueError("splits must be >= 1")
    plan = plan_model(like=like, arch=arch, layers=layers, experts=experts, top_k=top_k, embd=embd,
                      ff=ff, quant=quant, size_gb=size_gb, router=router)
    shape, tensors = plan.shape, plan.tensors
    total = plan.tensor_bytes
    # Files of the types bmoe-synth always had keep their bytes (PCG64); newer ones use SFC64.
    bit_generator = np.random.PCG64 if shape.quant in _PCG64_QUANTS and not shape.name else np.random.SFC64

    path = Path(path)
    if progress:
        print(f"bmoe-synth: {path} {shape.name + '-like ' if shape.name else ''}{shape.arch} "
              f"layers={shape.layers} experts={shape.experts} top_k={shape.top_k} embd={shape.embd} "
              f"ff={shape.ff} {shape.quant}: {total / 1e6:.1f} MB", file=sys.stderr)
    # Write into a scratch folder beside the target and rename at the end, so an interrupted
    # run never leaves a truncated file (or shard) under a final name.
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".bmoe-synth-", dir=path.parent))
    w = _Writer(scratch / path.name, shape.arch,
                split_max_tensors=-(-len(tensors) // splits) if splits > 1 else 0)
    try:
        _add_metadata(w, shape, seed, chat_template)
        for t in tensors:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes,
                              raw_dtype=_GGML_TYPE[t.qtype])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        start = last = time.monotonic()
        done = 0
        token_embd = None  # an f16 output.weight is derived from the f16 token_embd

        def counted(chunks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
            nonlocal done, last
            for chunk in chunks:
                yield chunk
                done += chunk.nbytes
                now = time.monotonic()
                if progress and (now - last >= 1.0 or done == total):
                    last = now
                    print(f"bmoe-synth: {done / 1e6:.0f}/{total / 1e6:.0f} MB ({100 * done / total:.0f}%) "
                          f"{now - start:.1f}s", file=sys.stderr)

        for index, t in enumerate(tensors):
            # One stream per tensor: the bytes of a tensor depend only on (seed, its index).
            rng = np.random.Generator(bit_generator([seed, index]))
            if t.qtype in ("f16", "f32"):
                data = _float_data(t, rng, token_embd)
                if t.name == "token_embd.weight":
                    token_embd = data
                w.write_tensor_chunks(counted([data]))
            else:
                w.write_tensor_chunks(counted(_quantized_chunks(t, rng)))
        w.close()
        written = sorted(scratch.iterdir())
        finals = [path.with_name(p.name) for p in written]
        for src, dst in zip(written, finals):
            src.replace(dst)
    finally:
        w.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return finals[0]


_EPILOG = """\
examples:
  bmoe-synth -o tiny.gguf                          # qwen3moe, 4 layers, 8 experts, top-2, q8_0
  bmoe-synth --arch gpt-oss --quant mxfp4 -o oss.gguf
  bmoe-synth --arch qwen2moe --layers 2 --experts 16 --top-k 4 --seed 7 -o q2.gguf
  bmoe-synth --layers 24 --experts 64 --top-k 8 --embd 1024 --size-gb 4 -o bench4g.gguf
  bmoe-synth --embd 256 --ff 512 --quant q4_k_m -o mixed.gguf   # a small Q4_K_M-typed model
  bmoe-synth --chat-template qwen3.jinja -o think.gguf   # another model's chat template
  bmoe-synth --like qwen3-30b-a3b -o ~/.cache/bmoe/synth/qwen3-30b-a3b-like-q4_k_m.gguf
  bmoe-synth --like ../shared/traces/gpt-oss-120b-q4_k_m.route.csv -o oss120.gguf
  bmoe-synth --like gemma-4-26b-a4b --plan               # its tensor table and size, no file

--size-gb X keeps --layers/--experts/--embd and picks the expert FFN width (--ff) so the file is
about X GB (1 GB = 1e9 bytes); pass a realistic --layers/--experts/--embd with it.

--like NAME writes a published model's byte shape at Q4_K_M: its layers, experts, top-k, hidden
size, expert width, heads and vocabulary, every tensor named, shaped and typed as in the real GGUF
(llama.cpp's Q4_K_M rules: Q6_K output and every few layers' ffn_down and attn_v, 32-weight
fallbacks for rows that are not whole 256-blocks; gpt-oss keeps its experts in MXFP4), within 2 %
of the real file's size. The weights are random and the tokenizer is bmoe-synth's own, padded with
unused tokens to the real vocabulary size. Known: {names}.
gemma-4-26b-a4b (arch gemma4) is written with its real table and the pinned llama.cpp runs it
(bmoe-cli --no-stream), but bmoe does not stream gemma4 yet.
--like TRACE.csv takes the shape from a route_trace v1 header: a known model (by the file name in
the header) with the trace's top-k, else a shape whose experts have the header's bytes per layer.
"""


def _read_template(ap: argparse.ArgumentParser, path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        ap.error(f"--chat-template {path}: {e.strerror}")


def _print_plan(plan: Plan, like: str) -> None:
    """--plan: every tensor with its ggml shape and type, then per-layer and total bytes."""
    for t in plan.tensors:
        print(f"{t.name:36} {t.qtype:6} {list(reversed(t.shape))!s:22} {t.nbytes:>13,}")
    for layer in range(plan.shape.layers):
        print(f"layer={layer} expert_bytes={plan.expert_bytes(layer)} dense_bytes={plan.dense_bytes(layer)}")
    print(f"tensor bytes: {plan.tensor_bytes:,} ({plan.tensor_bytes / _GB:.2f} GB)")
    if like in LIKES:
        real = LIKES[like].real_bytes
        print(f"real Q4_K_M file: {real:,} ({real / _GB:.2f} GB, {100 * (plan.tensor_bytes / real - 1):+.2f} %); "
              f"{LIKES[like].source}")
    _warn_if_not_streamed(like)


def _warn_if_not_streamed(like: str | None) -> None:
    if like in LIKES and not LIKES[like].runs_here:
        print(f"bmoe-synth: note: bmoe does not stream {LIKES[like].shape.arch} yet; plain llama.cpp runs "
              f"it (bmoe-cli --no-stream)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Console entry point of `bmoe-synth`."""
    ap = argparse.ArgumentParser(
        prog="bmoe-synth",
        description="Write a random-weight Mixture-of-Experts GGUF model that llama.cpp can run.",
        epilog=_EPILOG.format(names=", ".join(LIKES)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--like", metavar="NAME|TRACE.csv", default=None,
                    help=f"a published model's shape and types at Q4_K_M ({', '.join(LIKES)}), or the "
                         "shape in a route_trace v1 header; sets every shape flag")
    ap.add_argument("--plan", action="store_true",
                    help="print the tensors (name, type, ggml shape, bytes) and sizes instead of writing")
    ap.add_argument("--arch", choices=ARCHES, default=None, help="llama.cpp architecture (default qwen3moe)")
    ap.add_argument("--layers", type=positive_int, default=None, help="transformer blocks (default 4)")
    ap.add_argument("--experts", type=positive_int, default=None, help="experts per layer (default 8)")
    ap.add_argument("--top-k", type=positive_int, default=None, help="experts used per token (default 2)")
    ap.add_argument("--embd", type=positive_int, default=None,
                    help="hidden size, multiple of 32 (default 128; 256 for K-quants)")
    ap.add_argument("--ff", type=positive_int, default=None,
                    help="expert FFN width, multiple of 32 (default 256; 256 for K-quants; set by --size-gb)")
    ap.add_argument("--quant", choices=QUANTS, default=None,
                    help="type of the expert tensors (default q8_0); q4_k_m types every matrix as "
                         "llama.cpp's Q4_K_M does")
    ap.add_argument("--router", choices=ROUTER_TYPES, default=None,
                    help="type of the router tensors (default f32; q8_0 makes a model --spec-gate refuses)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    ap.add_argument("--size-gb", type=positive_float, default=None,
                    help="target file size in GB: chooses --ff (cannot be combined with --ff)")
    ap.add_argument("--splits", type=positive_int, default=1,
                    help="write N llama.cpp split shards (<stem>-0000i-of-0000N.gguf) instead of one file")
    ap.add_argument("--chat-template", metavar="FILE", default=None,
                    help="store this jinja chat template (default: ChatML without tools)")
    ap.add_argument("-o", "--output", help="output .gguf path (required unless --plan)")
    args = ap.parse_args(argv)
    shape_flags = ("arch", "layers", "experts", "top_k", "embd", "ff", "quant", "router", "size_gb")
    if args.like is not None:
        given = [f"--{f.replace('_', '-')}" for f in shape_flags if getattr(args, f) is not None]
        if given:
            ap.error(f"--like sets the shape; drop {', '.join(given)}")
    if args.size_gb is not None and args.ff is not None:
        ap.error("--size-gb chooses --ff; give one of them")
    if args.output is None and not args.plan:
        ap.error("the following arguments are required: -o/--output")
    k_quant = args.quant in _K_QUANTS
    shape = dict(arch=args.arch or "qwen3moe", layers=args.layers or 4, experts=args.experts or 8,
                 top_k=args.top_k or 2, embd=args.embd or (256 if k_quant else 128),
                 ff=args.ff or 256, quant=args.quant or "q8_0", size_gb=args.size_gb,
                 router=args.router or "f32")
    try:
        if args.plan:
            _print_plan(plan_model(like=args.like, **shape), args.like or "")
            return 0
        path = write_model(
            args.output, like=args.like, seed=args.seed, splits=args.splits, progress=True,
            chat_template=CHAT_TEMPLATE if args.chat_template is None else _read_template(ap, args.chat_template),
            **shape,
        )
    except ValueError as exc:
        ap.error(str(exc))
    _warn_if_not_streamed(args.like)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
