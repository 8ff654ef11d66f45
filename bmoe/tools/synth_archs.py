"""Each architecture bmoe-synth writes: the metadata and the tensors the pinned llama.cpp's loader asks
for (src/models/<arch>.cpp, load_arch_hparams and load_arch_tensors), in the order a table is
written, and the shape of a small model of it.

A table is built in the loader's terms (`_Table`): names, numpy-order shapes and a role per tensor;
the types come last, in file order, as llama-quant counts its attention-v tensors
(synth_shape.matrix_type). Values are chosen so a random model of every architecture runs finite
and routes different tokens to different experts: sharp routers, decays below zero, norms at one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from gguf import GGUFValueType, GGUFWriter

from bmoe.base import GB
from bmoe.tools.synth_shape import (
    ARCHES,
    K_QUANTS,
    QUANTS,
    ROUTER_TYPES,
    SYNTH_ARCHES,
    Dsv4,
    Indexer,
    Mla,
    Ple,
    Recurrent,
    Shape,
    Tensor,
    matrix_type,
    n_down,
)

# The loaders that take either expert layout (create_tensor_gate_up_exps, or gemma4's own).
FUSED_ARCHES: tuple[str, ...] = ("gemma4", "qwen35moe", "qwen3next", "qwen4exp", "deepseek2")
# The loaders with an optional trailing multi-token-prediction layer (nextn_predict_layers).
MTP_ARCHES: tuple[str, ...] = ("qwen35moe", "qwen3next", "glm4moe", "glm-dsa", "deepseek2", "deepseek4",
                               "bailingmoe2", "bailingmoe3")
# The norm weights llama.cpp applies to the router's input (src/models/<arch>.cpp; the predictor's own table
# is bmoe.workers.routers.ROUTER_NORM): written with a spread for the architectures bmoe-synth added in issue
# 39 (the older ones keep their bytes), see _Table.add
SCALED_NORMS = {
    "qwen35moe": "post_attention_norm.weight", "qwen3next": "post_attention_norm.weight",
    "glm4moe": "post_attention_norm.weight", "glm-dsa": "ffn_norm.weight", "deepseek2": "ffn_norm.weight",
    "llama4": "ffn_norm.weight", "lfm2moe": "ffn_norm.weight", "bailingmoe2": "ffn_norm.weight",
    "bailingmoe3": "ffn_norm.weight", "minimax-m2": "ffn_norm.weight",
}
# grovemoe's chunk experts: one per GROVE_GROUP routed experts, GROVE_CHUNK_FF wide
GROVE_GROUP, GROVE_CHUNK_FF = 2, 64
# llama_expert_gating_func_type (src/llama-hparams.h)
_SOFTMAX, _SIGMOID, _SQRT_SOFTPLUS = 1, 2, 4
_CONTEXT_LENGTH = 4096
_RMS_EPS = 1e-6


class _Table:
    """Tensors in file order, each with the role that types it (synth_shape's roles)."""

    def __init__(self, s: Shape) -> None:
        self.s = s
        self.rows: list[tuple[str, tuple[int, ...], str, int, str, float]] = []

    def add(self, name: str, shape: tuple[int, ...], role: str = "", layer: int = -1, fill: str = "normal",
            std: float = 0.0) -> None:
        if fill == "ones" and layer >= 0 and name.endswith("." + SCALED_NORMS.get(self.s.arch, "-")):
            # the norm before the router: a trained model's scales each channel its own way, and at one
            # everywhere the spec-gate's norm swap (bmoe.workers.routers) would be an identity
            fill, std = "positive", 0.3
        self.rows.append((name, shape, role, layer, fill, std))

    def block(self, i: int) -> Callable[..., None]:
        """`add` for layer `i`'s tensors, named blk.i.<name>."""
        def t(name: str, shape: tuple[int, ...], role: str = "", fill: str = "normal", std: float = 0.0) -> None:
            self.add(f"blk.{i}.{name}", shape, role, i, fill, std)
        return t

    def tensors(self) -> list[Tensor]:
        s, nd = self.s, n_down(self.s)
        n_v = sum(row[2] == "attn_v" for row in self.rows)
        out, i_v = [], 0
        for name, shape, role, layer, fill, std in self.rows:
            qtype = matrix_type(s, role, layer, shape[-1], nd, (i_v, n_v))
            i_v += role == "attn_v"
            out.append(Tensor(name, shape, qtype, fill, std))
        return out


# --- the tensors ------------------------------------------------------------------------------------

def _experts(t: Callable[..., None], s: Shape, *, probs_bias: bool = False, shared: str = "") -> None:
    """A MoE FFN: the router, the routed experts (gate and up, or fused gate_up, then down), with
    `probs_bias` the selection bias exp_probs_b, and `shared` experts of width s.shared_ff:
    "plain" (added), "gated" (scaled by the sigmoid of their own one-row gate, ffn_gate_inp_shexp)."""
    e, f = s.embd, s.ff
    # Router logits with std ~2 make top-k sharp yet token-dependent.
    t("ffn_gate_inp.weight", (s.experts, e), "router", std=2.0 * e**-0.5)
    if probs_bias:
        t("exp_probs_b.bias", (s.experts,), std=0.1)
    if s.fused:
        t("ffn_gate_up_exps.weight", (s.experts, 2 * f, e), "exps_gate", std=e**-0.5)
    else:
        t("ffn_gate_exps.weight", (s.experts, f, e), "exps_gate", std=e**-0.5)
        t("ffn_up_exps.weight", (s.experts, f, e), "exps_up", std=e**-0.5)
    t("ffn_down_exps.weight", (s.experts, e, f), "exps_down", std=f**-0.5)
    if shared == "gated":
        t("ffn_gate_inp_shexp.weight", (e,), std=e**-0.5)
    if shared:
        _ffn(t, e, s.shared_ff, "_shexp")


def _ffn(t: Callable[..., None], e: int, f: int, suffix: str = "") -> None:
    """A dense SwiGLU FFN (ffn_gate, ffn_up, ffn_down, with a suffix: the shared experts')."""
    t(f"ffn_gate{suffix}.weight", (f, e), "ffn_gate", std=e**-0.5)
    t(f"ffn_up{suffix}.weight", (f, e), "ffn_up", std=e**-0.5)
    t(f"ffn_down{suffix}.weight", (e, f), "ffn_down", std=f**-0.5)


def _ffn_or_experts(t: Callable[..., None], s: Shape, i: int, **kw: object) -> None:
    if s.is_moe(i):
        _experts(t, s, **kw)  # type: ignore[arg-type]  # the keywords of _experts
    else:
        _ffn(t, s.embd, s.dense_ff)


def _qkvo(t: Callable[..., None], s: Shape, *, gated: bool = False, q_dim: int = 0) -> None:
    """Attention's q, k, v and output of s.n_head query heads (`q_dim` wide if given) and s.n_head_kv
    KV heads of s.head_dim; a `gated` q holds [q | gate] per head, twice as wide."""
    e, q_dim = s.embd, q_dim or s.n_head * s.head_dim
    kv_dim = s.n_head_kv * s.head_dim
    t("attn_q.weight", ((2 if gated else 1) * q_dim, e), "attn_q", std=e**-0.5)
    t("attn_k.weight", (kv_dim, e), "attn_k", std=e**-0.5)
    t("attn_v.weight", (kv_dim, e), "attn_v", std=e**-0.5)
    t("attn_output.weight", (e, q_dim), "attn_output", std=q_dim**-0.5)


def _nextn(t: Callable[..., None], s: Shape) -> None:
    """An MTP layer's own tensors (its shared head and embedding default to the model's)."""
    t("nextn.eh_proj.weight", (s.embd, 2 * s.embd), "matrix", std=(2 * s.embd) ** -0.5)
    t("nextn.enorm.weight", (s.embd,), fill="ones")
    t("nextn.hnorm.weight", (s.embd,), fill="ones")


def _gdn(t: Callable[..., None], s: Shape, *, fused_ba: bool) -> None:
    """A Gated DeltaNet layer (qwen35moe, qwen4exp; qwen3next with beta and alpha fused)."""
    r, e = s.recurrent, s.embd
    assert r is not None
    key_dim, value_dim = r.head_dim * r.k_heads, r.head_dim * r.v_heads
    t("attn_qkv.weight", (2 * key_dim + value_dim, e), "attn_v", std=e**-0.5)
    t("attn_gate.weight", (value_dim, e), "matrix", std=e**-0.5)
    t("ssm_conv1d.weight", (2 * key_dim + value_dim, r.conv), std=0.5)
    t("ssm_dt.bias", (r.v_heads,), std=0.5)
    t("ssm_a", (r.v_heads,), fill="negative", std=0.5)
    if fused_ba:
        t("ssm_ba.weight", (2 * r.v_heads, e), "matrix", std=e**-0.5)
    else:
        t("ssm_beta.weight", (r.v_heads, e), "matrix", std=e**-0.5)
        t("ssm_alpha.weight", (r.v_heads, e), "matrix", std=e**-0.5)
    t("ssm_norm.weight", (r.head_dim,), fill="ones")
    t("ssm_out.weight", (e, value_dim), "matrix", std=value_dim**-0.5)


def _mla(t: Callable[..., None], s: Shape, *, split_kv_b: bool = True) -> None:
    """Multi-head latent attention, as the converters write it for MLA (attn_k_b and attn_v_b)."""
    m, e, h = s.mla, s.embd, s.n_head
    assert m is not None
    qk = m.qk_nope + m.qk_rope
    if m.q_lora:
        t("attn_q_a_norm.weight", (m.q_lora,), fill="ones")
    t("attn_kv_a_norm.weight", (m.kv_lora,), fill="ones")
    if m.q_lora:
        t("attn_q_a.weight", (m.q_lora, e), "matrix", std=e**-0.5)
        t("attn_q_b.weight", (h * qk, m.q_lora), "matrix", std=m.q_lora**-0.5)
    else:
        t("attn_q.weight", (h * qk, e), "attn_q", std=e**-0.5)
    t("attn_kv_a_mqa.weight", (m.kv_lora + m.qk_rope, e), "matrix", std=e**-0.5)
    assert split_kv_b
    t("attn_k_b.weight", (h, m.kv_lora, m.qk_nope), "matrix", std=m.qk_nope**-0.5)
    t("attn_v_b.weight", (h, m.v_head, m.kv_lora), "matrix", std=m.kv_lora**-0.5)
    t("attn_output.weight", (e, h * m.v_head), "attn_output", std=(h * m.v_head) ** -0.5)


def _table_old(s: Shape, tb: _Table) -> None:
    """qwen3moe, qwen2moe, llama, olmoe, gpt-oss and gemma4, in the order bmoe-synth always wrote them
    (a file of these keeps its bytes), and grovemoe (qwen3moe's with chunk experts)."""
    e = s.embd
    gpt_oss, gemma = s.arch == "gpt-oss", s.arch == "gemma4"
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", fill="normal", std=1.0)
    if gemma:  # proportional RoPE of the full-attention layers: one table for all of them
        tb.add("rope_freqs.weight", (s.full_head_dim // 2,), fill="ones")
    for i in range(s.layers):
        t = tb.block(i)
        hd = s.full_head_dim if s.is_full(i) else s.head_dim
        q_dim = s.n_head * hd
        kv_dim = (s.full_kv_heads if s.is_full(i) else s.n_head_kv) * hd
        t("attn_norm.weight", (e,), fill="ones")
        t("attn_q.weight", (q_dim, e), "attn_q", std=e**-0.5)
        t("attn_k.weight", (kv_dim, e), "attn_k", std=e**-0.5)
        t("attn_v.weight", (kv_dim, e), "attn_v", std=e**-0.5)
        t("attn_output.weight", (e, q_dim), "attn_output", std=q_dim**-0.5)
        if s.arch in ("qwen2moe", "gpt-oss"):
            t("attn_q.bias", (q_dim,), std=0.02)
            t("attn_k.bias", (kv_dim,), std=0.02)
            t("attn_v.bias", (kv_dim,), std=0.02)
        if s.arch in ("qwen3moe", "gemma4", "grovemoe"):
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
            t("ffn_gate_inp.scale", (e,), fill="positive", std=0.3)
            t("pre_ffw_norm_2.weight", (e,), fill="ones")
            t("post_ffw_norm_1.weight", (e,), fill="ones")
            t("post_ffw_norm_2.weight", (e,), fill="ones")
        # Router logits with std ~2 make top-k sharp yet token-dependent.
        t("ffn_gate_inp.weight", (s.experts, e), "router", std=2.0 * e**-0.5)
        if gemma and s.fused:
            t("ffn_gate_up_exps.weight", (s.experts, 2 * s.ff, e), "exps_gate", std=e**-0.5)
        else:
            t("ffn_gate_exps.weight", (s.experts, s.ff, e), "exps_gate", std=e**-0.5)
            t("ffn_up_exps.weight", (s.experts, s.ff, e), "exps_up", std=e**-0.5)
        t("ffn_down_exps.weight", (s.experts, e, s.ff), "exps_down", std=s.ff**-0.5)
        if s.arch == "grovemoe":  # the chunk experts: one per experts_per_group (2) routed experts
            ch = s.experts // GROVE_GROUP
            t("ffn_gate_chexps.weight", (ch, GROVE_CHUNK_FF, e), "exps_gate", std=e**-0.5)
            t("ffn_up_chexps.weight", (ch, GROVE_CHUNK_FF, e), "exps_up", std=e**-0.5)
            t("ffn_down_chexps.weight", (ch, e, GROVE_CHUNK_FF), "exps_down", std=GROVE_CHUNK_FF**-0.5)
        if gemma:  # the per-expert scale of the down projection (its generic .scale slot): each expert its
            # own, so that reading another expert's scale changes the output
            t("ffn_down_exps.scale", (s.experts,), fill="positive", std=0.3)
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


def _head(s: Shape, tb: _Table, norm: str = "output_norm.weight") -> None:
    """The final norm and the output projection (none where it is tied to token_embd)."""
    tb.add(norm, (s.embd,), fill="ones")
    if not s.tied:
        tb.add("output.weight", (s.n_vocab, s.embd), "output", fill="output", std=3.0 * s.embd**-0.5)


def _table_qwen_gdn(s: Shape, tb: _Table) -> None:
    """qwen35moe and qwen3next (src/models/qwen35moe.cpp, qwen3next.cpp): Gated DeltaNet layers and
    every full_every-th a gated full attention, each with routed experts and a gated shared expert;
    an MTP layer is a full-attention layer with the nextn tensors."""
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.all_layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        t("post_attention_norm.weight", (e,), fill="ones")
        if s.is_full(i) or i >= s.layers:
            _qkvo(t, s, gated=True)
            t("attn_q_norm.weight", (s.head_dim,), fill="ones")
            t("attn_k_norm.weight", (s.head_dim,), fill="ones")
        else:
            _gdn(t, s, fused_ba=s.arch == "qwen3next")
        _experts(t, s, shared="gated")
        if i >= s.layers:
            _nextn(t, s)
    _head(s, tb)


def _table_qwen4exp(s: Shape, tb: _Table) -> None:
    """qwen4exp (src/models/qwen4exp.cpp): qwen35moe's layers with hyper-connections in place of every
    norm (two mixers a layer and one before the output), an indexer on the attention layers, and
    n-gram hash embeddings (Ple) on one recurrent layer."""
    e, hc, lr, ix, ple = s.embd, s.hyper, s.hyper_rank, s.indexer, s.ple
    assert ix is not None
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    tb.add("output_hc_norm.weight", (hc, e), fill="ones")
    tb.add("output_hc_down.weight", (lr, hc * e), "matrix", std=(hc * e) ** -0.5)
    tb.add("output_hc_up.weight", (hc * e, lr), "matrix", std=lr**-0.5)
    if ple:  # a token embedding table by name (llama-quant types it as one)
        tb.add("per_layer_token_embd.weight", (ple.rows, ple.dim), "token_embd", std=1.0)
    for i in range(s.layers):
        t = tb.block(i)
        if ple and i == ple.layer:
            t("ple_key.weight", (hc * e, e), "matrix", std=e**-0.5)
            t("ple_value.weight", (e, e), "matrix", std=e**-0.5)
            for part in ("key", "query", "conv"):
                t(f"ple_norm_{part}.weight", (hc, e), fill="ones")
            t("ple_conv1d.weight", (hc * e, ple.conv), std=0.5)
        for part in ("attn", "ffn"):
            t(f"hc_{part}_norm.weight", (hc, e), fill="ones")
            t(f"hc_{part}_down.weight", (lr, hc * e), "matrix", std=(hc * e) ** -0.5)
            t(f"hc_{part}_up.weight", (hc * e, lr), "matrix", std=lr**-0.5)
            t(f"hc_{part}_inject.weight", (hc, hc * e), "matrix", std=(hc * e) ** -0.5)
        if s.is_full(i):
            _qkvo(t, s, gated=True)
            t("attn_q_norm.weight", (s.head_dim,), fill="ones")
            t("attn_k_norm.weight", (s.head_dim,), fill="ones")
            t("indexer.q_proj.weight", (ix.heads * ix.head_dim, e), "f16", std=e**-0.5)
            t("indexer.k_proj.weight", (ix.head_dim, e), "f16", std=e**-0.5)
            t("indexer.q_norm.weight", (ix.head_dim,), fill="ones")
            t("indexer.k_norm.weight", (ix.head_dim,), fill="ones")
        else:
            _gdn(t, s, fused_ba=False)
        _experts(t, s, shared="gated")
    tb.add("output.weight", (s.n_vocab, e), "output", fill="output", std=3.0 * e**-0.5)


def _table_glm4moe(s: Shape, tb: _Table) -> None:
    """glm4moe (src/models/glm4-moe.cpp): biased q/k/v with q/k norms, leading dense layers, sigmoid
    routing with a selection bias and shared experts."""
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.all_layers):
        t = tb.block(i)
        q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
        t("attn_norm.weight", (e,), fill="ones")
        _qkvo(t, s)
        t("attn_q.bias", (q_dim,), std=0.02)
        t("attn_k.bias", (kv_dim,), std=0.02)
        t("attn_v.bias", (kv_dim,), std=0.02)
        t("attn_q_norm.weight", (s.head_dim,), fill="ones")
        t("attn_k_norm.weight", (s.head_dim,), fill="ones")
        t("post_attention_norm.weight", (e,), fill="ones")
        _ffn_or_experts(t, s, i, probs_bias=True, shared="plain")
        if i >= s.layers:
            _nextn(t, s)
    _head(s, tb)


def _table_deepseek2(s: Shape, tb: _Table) -> None:
    """deepseek2 (src/models/deepseek2.cpp, DeepSeek-V3's layout): MLA, leading dense layers, experts
    with a selection bias and shared experts."""
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.all_layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        _mla(t, s)
        t("ffn_norm.weight", (e,), fill="ones")
        _ffn_or_experts(t, s, i, probs_bias=True, shared="plain")
        if i >= s.layers:
            _nextn(t, s)
    _head(s, tb)


def _table_glm_dsa(s: Shape, tb: _Table) -> None:
    """glm-dsa (src/models/glm-dsa.cpp): deepseek2's MLA layers with a DSA indexer on the layers that
    compute their own top-k (Indexer.full), sigmoid routing with a selection bias."""
    e, m, ix = s.embd, s.mla, s.indexer
    assert m is not None and ix is not None
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.all_layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        _mla(t, s)
        t("ffn_norm.weight", (e,), fill="ones")
        if i >= s.layers or ix.full[i]:
            t("indexer.k_norm.weight", (ix.head_dim,), fill="ones")
            t("indexer.k_norm.bias", (ix.head_dim,), std=0.02)
            t("indexer.proj.weight", (ix.heads, e), "matrix", std=e**-0.5)
            t("indexer.attn_k.weight", (ix.head_dim, e), "matrix", std=e**-0.5)
            t("indexer.attn_q_b.weight", (ix.heads * ix.head_dim, m.q_lora), "matrix", std=m.q_lora**-0.5)
        _ffn_or_experts(t, s, i, probs_bias=True, shared="plain")
        if i >= s.layers:
            _nextn(t, s)
    _head(s, tb)


def _table_deepseek4(s: Shape, tb: _Table) -> None:
    """deepseek4 (src/models/deepseek4.cpp): hyper-connections (4 streams), single-KV-head attention
    with a low-rank grouped output, compressed attention (ratio 4 with an indexer, 128 without) on
    some layers, hash-routed first layers (ffn_gate_tid2eid: a token's experts, no bias), the others
    sqrt-softplus routing with a selection bias; shared experts everywhere."""
    e, d, ix, hc = s.embd, s.dsv4, s.indexer, s.hyper
    assert d is not None and ix is not None
    hd, mix = s.head_dim, (2 + hc) * hc
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    tb.add("output_norm.weight", (e,), fill="ones")
    tb.add("output.weight", (s.n_vocab, e), "output", fill="output", std=3.0 * e**-0.5)
    tb.add("output_hc_fn.weight", (hc, hc * e), "matrix", std=(hc * e) ** -0.5)
    tb.add("output_hc_base.weight", (hc,), std=0.1)
    tb.add("output_hc_scale.weight", (1,), fill="ones")
    for i in range(s.all_layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        t("attn_sinks.weight", (s.n_head,), std=1.0)
        t("attn_q_a.weight", (d.q_lora, e), "matrix", std=e**-0.5)
        t("attn_q_a_norm.weight", (d.q_lora,), fill="ones")
        t("attn_q_b.weight", (s.n_head * hd, d.q_lora), "matrix", std=d.q_lora**-0.5)
        t("attn_kv.weight", (hd, e), "matrix", std=e**-0.5)
        t("attn_kv_a_norm.weight", (hd,), fill="ones")
        group_in = s.n_head * hd // d.o_groups
        t("attn_output_a.weight", (d.o_groups * d.o_lora, group_in), "matrix", std=group_in**-0.5)
        t("attn_output_b.weight", (e, d.o_groups * d.o_lora), "matrix", std=(d.o_groups * d.o_lora) ** -0.5)
        for part in ("attn", "ffn"):
            t(f"hc_{part}_fn.weight", (mix, hc * e), "matrix", std=(hc * e) ** -0.5)
            t(f"hc_{part}_base.weight", (mix,), std=0.1)
            t(f"hc_{part}_scale.weight", (3,), fill="ones")
        ratio = ix.ratios[i]
        if ratio:
            coff = 2 if ratio == 4 else 1
            t("attn_compressor_kv.weight", (coff * hd, e), "matrix", std=e**-0.5)
            t("attn_compressor_gate.weight", (coff * hd, e), "matrix", std=e**-0.5)
            t("attn_compressor_ape.weight", (ratio, coff * hd), std=0.02)
            t("attn_compressor_norm.weight", (hd,), fill="ones")
        if ratio == 4:
            t("indexer.proj.weight", (ix.heads, e), "matrix", std=e**-0.5)
            t("indexer.attn_q_b.weight", (ix.heads * ix.head_dim, d.q_lora), "matrix", std=d.q_lora**-0.5)
            t("indexer_compressor_kv.weight", (2 * ix.head_dim, e), "matrix", std=e**-0.5)
            t("indexer_compressor_gate.weight", (2 * ix.head_dim, e), "matrix", std=e**-0.5)
            t("indexer_compressor_ape.weight", (ratio, 2 * ix.head_dim), std=0.02)
            t("indexer_compressor_norm.weight", (ix.head_dim,), fill="ones")
        t("ffn_gate_inp.weight", (s.experts, e), "router", std=2.0 * e**-0.5)
        if i < d.hash_layers:
            t("ffn_gate_tid2eid.weight", (s.n_vocab, s.top_k), "i32", fill="expert_ids")
        else:
            t("exp_probs_b.bias", (s.experts,), std=0.1)
        t("ffn_norm.weight", (e,), fill="ones")
        t("ffn_gate_exps.weight", (s.experts, s.ff, e), "exps_gate", std=e**-0.5)
        t("ffn_down_exps.weight", (s.experts, e, s.ff), "exps_down", std=s.ff**-0.5)
        t("ffn_up_exps.weight", (s.experts, s.ff, e), "exps_up", std=e**-0.5)
        _ffn(t, e, s.shared_ff, "_shexp")
        if i >= s.layers:
            _nextn(t, s)


def _table_llama4(s: Shape, tb: _Table) -> None:
    """llama4 (src/models/llama4.cpp): every moe_every-th layer MoE (sigmoid of the chosen logits,
    applied to the input before the experts) with a shared expert, the others dense."""
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        _qkvo(t, s)
        t("ffn_norm.weight", (e,), fill="ones")
        _ffn_or_experts(t, s, i, shared="plain")
    _head(s, tb)


def _table_lfm2moe(s: Shape, tb: _Table) -> None:
    """lfm2moe (src/models/lfm2moe.cpp): short-convolution layers and every full_every-th attention,
    leading dense layers, sigmoid routing with a selection bias; the output is tied, its norm is
    named token_embd_norm."""
    e, r = s.embd, s.recurrent
    assert r is not None
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.layers):
        t = tb.block(i)
        t("ffn_norm.weight", (e,), fill="ones")
        if s.is_moe(i):
            t("ffn_gate_inp.weight", (s.experts, e), "router", std=2.0 * e**-0.5)
            t("ffn_gate_exps.weight", (s.experts, s.ff, e), "exps_gate", std=e**-0.5)
            t("ffn_down_exps.weight", (s.experts, e, s.ff), "exps_down", std=s.ff**-0.5)
            t("ffn_up_exps.weight", (s.experts, s.ff, e), "exps_up", std=e**-0.5)
            t("exp_probs_b.bias", (s.experts,), std=0.1)
        else:
            _ffn(t, e, s.dense_ff)
        t("attn_norm.weight", (e,), fill="ones")
        if s.is_full(i):
            t("attn_q_norm.weight", (s.head_dim,), fill="ones")
            t("attn_k_norm.weight", (s.head_dim,), fill="ones")
            _qkvo(t, s, q_dim=e)
        else:
            t("shortconv.conv.weight", (e, r.conv), std=0.5)
            t("shortconv.in_proj.weight", (3 * e, e), "matrix", std=e**-0.5)
            t("shortconv.out_proj.weight", (e, e), "matrix", std=e**-0.5)
    _head(s, tb, norm="token_embd_norm.weight")


def _table_bailingmoe2(s: Shape, tb: _Table) -> None:
    """bailingmoe2 (src/models/bailingmoe2.cpp): fused qkv with q/k norms, leading dense layers,
    sigmoid group-limited routing with a selection bias, shared experts; an MTP layer is kept in the
    file and skipped by the loader."""
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.all_layers):
        t = tb.block(i)
        kv_dim = s.n_head_kv * s.head_dim
        t("attn_norm.weight", (e,), fill="ones")
        t("attn_qkv.weight", (e + 2 * kv_dim, e), "attn_v", std=e**-0.5)
        t("attn_output.weight", (e, e), "attn_output", std=e**-0.5)
        t("attn_q_norm.weight", (s.head_dim,), fill="ones")
        t("attn_k_norm.weight", (s.head_dim,), fill="ones")
        t("ffn_norm.weight", (e,), fill="ones")
        _ffn_or_experts(t, s, i, probs_bias=True, shared="plain")
        if i >= s.layers:
            _nextn(t, s)
            t("layer_output_norm.weight", (e,), fill="ones")
    _head(s, tb)


def _table_bailingmoe3(s: Shape, tb: _Table) -> None:
    """bailingmoe3 (src/models/bailingmoe3.cpp): Kimi delta attention layers and every full_every-th
    a gated MLA, leading dense layers, sigmoid routing with a selection bias and shared experts."""
    e, r = s.embd, s.recurrent
    assert r is not None
    d_inner = r.head_dim * s.n_head
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.all_layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        if s.is_full(i) or i >= s.layers:
            _mla(t, s)
            t("attn_gate.weight", (s.n_head, e), "matrix", std=e**-0.5)
        else:
            for part in ("q", "k", "v"):
                t(f"ssm_conv1d_{part}.weight", (1, d_inner, 1, r.conv), std=0.5)
            t("attn_q.weight", (d_inner, e), "attn_q", std=e**-0.5)
            t("attn_k.weight", (d_inner, e), "attn_k", std=e**-0.5)
            t("attn_v.weight", (d_inner, e), "attn_v", std=e**-0.5)
            t("ssm_f_a.weight", (d_inner, e), "matrix", std=e**-0.5)
            t("ssm_beta.weight", (s.n_head, e), "matrix", std=e**-0.5)
            t("ssm_a", (s.n_head, 1), std=0.5)
            t("ssm_dt.bias", (d_inner,), std=0.5)
            t("ssm_g_a.weight", (d_inner, e), "matrix", std=e**-0.5)
            t("ssm_norm.weight", (r.head_dim,), fill="ones")
            t("attn_output.weight", (e, d_inner), "attn_output", std=d_inner**-0.5)
        t("ffn_norm.weight", (e,), fill="ones")
        _ffn_or_experts(t, s, i, probs_bias=True, shared="plain")
        if i >= s.layers:
            _nextn(t, s)
            t("layer_output_norm.weight", (e,), fill="ones")
    _head(s, tb)


def _table_minimax_m2(s: Shape, tb: _Table) -> None:
    """minimax-m2 (src/models/minimax-m2.cpp): q/k norms over all heads, sigmoid routing with a
    selection bias; the experts' width is feed_forward_length."""
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.layers):
        t = tb.block(i)
        q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
        _qkvo(t, s)
        t("attn_norm.weight", (e,), fill="ones")
        t("attn_q_norm.weight", (q_dim,), fill="ones")
        t("attn_k_norm.weight", (kv_dim,), fill="ones")
        t("ffn_norm.weight", (e,), fill="ones")
        _experts(t, s, probs_bias=True)
    _head(s, tb)


_TABLES: dict[str, Callable[[Shape, _Table], None]] = {
    "qwen35moe": _table_qwen_gdn, "qwen3next": _table_qwen_gdn, "qwen4exp": _table_qwen4exp,
    "glm4moe": _table_glm4moe, "deepseek2": _table_deepseek2, "glm-dsa": _table_glm_dsa,
    "deepseek4": _table_deepseek4, "llama4": _table_llama4, "lfm2moe": _table_lfm2moe,
    "bailingmoe2": _table_bailingmoe2, "bailingmoe3": _table_bailingmoe3, "minimax-m2": _table_minimax_m2,
}


def tensor_table(s: Shape) -> list[Tensor]:
    """Every tensor llama.cpp's loader requires for `s.arch` (see src/models/<arch>.cpp), with
    the type `s.quant` gives it."""
    tb = _Table(s)
    if s.arch in _TABLES:
        _TABLES[s.arch](s, tb)
    else:
        _table_old(s, tb)
        _head(s, tb)
    return tb.tensors()


# --- the metadata -----------------------------------------------------------------------------------

def _rope_sections(rope_dims: int) -> list[int]:
    """Qwen3.5's interleaved M-RoPE split of the rotated pairs into (time, height, width, -): 11, 11,
    10 of 32 (rope.dimension_sections)."""
    pairs = rope_dims // 2
    base, rest = divmod(pairs, 3)
    return [base + (rest > 0), base + (rest > 1), base, 0]


def _routing(w: GGUFWriter, a: str, gating: int, *, norm: bool = True, scale: float = 1.0, groups: int = 0,
             groups_used: int = 0) -> None:
    w.add_uint32(f"{a}.expert_gating_func", gating)
    w.add_bool(f"{a}.expert_weights_norm", norm)
    w.add_float32(f"{a}.expert_weights_scale", scale)
    if groups:
        w.add_uint32(f"{a}.expert_group_count", groups)
        w.add_uint32(f"{a}.expert_group_used_count", groups_used)


def _heads(w: GGUFWriter, s: Shape, a: str, kv: int | list[int] | None = None) -> None:
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    if isinstance(kv, list):
        w.add_array(f"{a}.attention.head_count_kv", kv)
    else:
        w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv if kv is None else kv)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)


def _mla_keys(w: GGUFWriter, s: Shape, a: str) -> None:
    """MLA's heads as llama.cpp's absorbed attention reads them: one KV head of kv_lora + rope, the
    decompressed widths in the _mla keys."""
    m = s.mla
    assert m is not None
    if m.q_lora:
        w.add_uint32(f"{a}.attention.q_lora_rank", m.q_lora)
    w.add_uint32(f"{a}.attention.kv_lora_rank", m.kv_lora)
    w.add_uint32(f"{a}.attention.key_length_mla", m.qk_nope + m.qk_rope)
    w.add_uint32(f"{a}.attention.value_length_mla", m.v_head)


def _gdn_keys(w: GGUFWriter, s: Shape, a: str) -> None:
    r = s.recurrent
    assert r is not None
    w.add_uint32(f"{a}.ssm.conv_kernel", r.conv)
    w.add_uint32(f"{a}.ssm.inner_size", r.head_dim * r.v_heads)
    w.add_uint32(f"{a}.ssm.state_size", r.head_dim)
    w.add_uint32(f"{a}.ssm.time_step_rank", r.v_heads)
    w.add_uint32(f"{a}.ssm.group_count", r.k_heads)
    w.add_uint32(f"{a}.full_attention_interval", s.full_every)


def _keys_old(w: GGUFWriter, s: Shape, a: str) -> None:
    """The keys of the architectures bmoe-synth always wrote, in their order (their files keep their bytes)."""
    if a in ("qwen3moe", "qwen2moe", "gpt-oss", "gemma4", "grovemoe"):
        w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    if a == "grovemoe":
        w.add_uint32(f"{a}.expert_chunk_feed_forward_length", GROVE_CHUNK_FF)
        w.add_float32(f"{a}.expert_group_scale", 0.5)
        w.add_uint32(f"{a}.experts_per_group", GROVE_GROUP)
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


def _keys_qwen_gdn(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.shared_ff)
    _heads(w, s, a)
    _gdn_keys(w, s, a)
    if a != "qwen3next":  # interleaved M-RoPE
        w.add_array(f"{a}.rope.dimension_sections", _rope_sections(s.rope_dims))
    if a == "qwen4exp":
        ix = s.indexer
        assert ix is not None
        w.add_uint32(f"{a}.hyper_connection.count", s.hyper)
        w.add_uint32(f"{a}.hyper_connection.low_rank", s.hyper_rank)
        w.add_uint32(f"{a}.attention.indexer.head_count", ix.heads)
        w.add_uint32(f"{a}.attention.indexer.key_length", ix.head_dim)
        w.add_uint32(f"{a}.attention.indexer.top_k", ix.top_k)
        w.add_array(f"{a}.attention.compress_ratios", list(ix.ratios))
        if s.ple:
            _ple_keys(w, s.ple, s.n_vocab, a)


def _ple_keys(w: GGUFWriter, ple: Ple, n_vocab: int, a: str) -> None:
    """qwen4exp's n-gram hash constants: head h reads rows offset[h] + hash % vocab[h] of the table
    (the rows split evenly between the heads)."""
    u32, u64 = GGUFValueType.UINT32, GGUFValueType.UINT64
    per_head = ple.rows // ple.heads
    w.add_key_value(f"{a}.ple.layers", [ple.layer], GGUFValueType.ARRAY, sub_type=u32)
    w.add_uint32(f"{a}.ple.ngram_size", ple.ngram)
    w.add_uint32(f"{a}.ple.heads_per_ngram", ple.heads_per_ngram)
    w.add_uint32(f"{a}.ple.conv_kernel", ple.conv)
    w.add_uint32(f"{a}.ple.eos_token_id", 2)
    w.add_uint32(f"{a}.embedding_length_per_layer_input", ple.dim)
    w.add_key_value(f"{a}.ple.layer_multipliers", [1 + 2 * n for n in range(ple.ngram)], GGUFValueType.ARRAY,
                    sub_type=u64)
    w.add_key_value(f"{a}.ple.head_offsets", [h * per_head for h in range(ple.heads)], GGUFValueType.ARRAY,
                    sub_type=u64)
    w.add_key_value(f"{a}.ple.head_vocab_sizes", [per_head] * ple.heads, GGUFValueType.ARRAY, sub_type=u64)


def _keys_glm4moe(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_shared_count", s.shared_ff // s.ff)
    w.add_uint32(f"{a}.leading_dense_block_count", s.dense_lead)
    _routing(w, a, _SIGMOID, scale=2.5)
    _heads(w, s, a)


def _keys_deepseek2(w: GGUFWriter, s: Shape, a: str) -> None:
    m = s.mla
    assert m is not None
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_shared_count", s.shared_ff // s.ff)
    w.add_uint32(f"{a}.leading_dense_block_count", s.dense_lead)
    if a == "deepseek2":  # DeepSeek-V3's group-limited top-k: the experts of the best groups only
        _routing(w, a, _SIGMOID, scale=2.5, groups=4, groups_used=2)
    else:
        _routing(w, a, _SIGMOID, scale=2.5)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", 1)
    w.add_uint32(f"{a}.attention.key_length", m.kv_lora + m.qk_rope)
    w.add_uint32(f"{a}.attention.value_length", m.kv_lora)
    _mla_keys(w, s, a)
    if a == "glm-dsa":
        ix = s.indexer
        assert ix is not None
        w.add_uint32(f"{a}.attention.indexer.head_count", ix.heads)
        w.add_uint32(f"{a}.attention.indexer.key_length", ix.head_dim)
        w.add_uint32(f"{a}.attention.indexer.top_k", ix.top_k)
        w.add_array(f"{a}.attention.indexer.types", [int(f) for f in ix.full])


def _keys_deepseek4(w: GGUFWriter, s: Shape, a: str) -> None:
    d, ix = s.dsv4, s.indexer
    assert d is not None and ix is not None
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_shared_count", s.shared_ff // s.ff)
    _routing(w, a, _SQRT_SOFTPLUS, scale=1.5)
    w.add_float32(f"{a}.swiglu_clamp_exp", 10.0)
    _heads(w, s, a, kv=1)
    w.add_uint32(f"{a}.attention.q_lora_rank", d.q_lora)
    w.add_uint32(f"{a}.attention.sliding_window", d.window)
    w.add_uint32(f"{a}.attention.output_group_count", d.o_groups)
    w.add_uint32(f"{a}.attention.output_lora_rank", d.o_lora)
    w.add_float32(f"{a}.attention.compress_rope_freq_base", 160000.0)
    w.add_array(f"{a}.attention.compress_ratios", list(ix.ratios))
    w.add_uint32(f"{a}.attention.indexer.head_count", ix.heads)
    w.add_uint32(f"{a}.attention.indexer.key_length", ix.head_dim)
    w.add_uint32(f"{a}.attention.indexer.top_k", ix.top_k)
    w.add_uint32(f"{a}.hyper_connection.count", s.hyper)
    w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", 20)
    w.add_float32(f"{a}.hyper_connection.epsilon", 1e-6)
    w.add_uint32(f"{a}.hash_layer_count", d.hash_layers)


def _keys_llama4(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.interleave_moe_layer_step", s.moe_every)
    _heads(w, s, a)


def _keys_lfm2moe(w: GGUFWriter, s: Shape, a: str) -> None:
    r = s.recurrent
    assert r is not None
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.leading_dense_block_count", s.dense_lead)
    _routing(w, a, _SIGMOID)
    w.add_uint32(f"{a}.shortconv.l_cache", r.conv)
    _heads(w, s, a, kv=[s.n_head_kv if s.is_full(i) else 0 for i in range(s.layers)])


def _keys_bailingmoe2(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_shared_count", s.shared_ff // s.ff)
    w.add_uint32(f"{a}.leading_dense_block_count", s.dense_lead)
    _routing(w, a, _SIGMOID, scale=2.5, groups=4, groups_used=2)
    _heads(w, s, a)


def _keys_bailingmoe3(w: GGUFWriter, s: Shape, a: str) -> None:
    r, m = s.recurrent, s.mla
    assert r is not None and m is not None
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_shared_count", s.shared_ff // s.ff)
    w.add_uint32(f"{a}.leading_dense_block_count", s.dense_lead)
    _routing(w, a, _SIGMOID, scale=2.5)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_array(f"{a}.attention.head_count_kv",
                [1 if s.is_full(i) or i >= s.layers else 0 for i in range(s.all_layers)])
    w.add_uint32(f"{a}.attention.key_length", m.kv_lora + m.qk_rope)
    w.add_uint32(f"{a}.attention.value_length", m.kv_lora)
    _mla_keys(w, s, a)
    w.add_uint32(f"{a}.ssm.conv_kernel", r.conv)
    w.add_uint32(f"{a}.kda.head_dim", r.head_dim)
    w.add_bool(f"{a}.kda.safe_gate", True)
    w.add_float32(f"{a}.kda.gate_lower_bound", -5.0)


def _keys_minimax_m2(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    _routing(w, a, _SIGMOID)
    _heads(w, s, a)


_KEYS: dict[str, Callable[[GGUFWriter, Shape, str], None]] = {
    "qwen35moe": _keys_qwen_gdn, "qwen3next": _keys_qwen_gdn, "qwen4exp": _keys_qwen_gdn,
    "glm4moe": _keys_glm4moe, "deepseek2": _keys_deepseek2, "glm-dsa": _keys_deepseek2,
    "deepseek4": _keys_deepseek4, "llama4": _keys_llama4, "lfm2moe": _keys_lfm2moe,
    "bailingmoe2": _keys_bailingmoe2, "bailingmoe3": _keys_bailingmoe3, "minimax-m2": _keys_minimax_m2,
}


def add_arch_metadata(w: GGUFWriter, s: Shape) -> None:
    """The `<arch>.*` keys between the expert counts and the norm epsilon (synth.write_model writes
    the rest)."""
    a = s.arch
    (_KEYS.get(a) or _keys_old)(w, s, a)
    if s.mtp:
        w.add_uint32(f"{a}.nextn_predict_layers", s.mtp)


def feed_forward_length(s: Shape) -> int:
    """`<arch>.feed_forward_length`: the dense FFNs' width, or the experts' where none is dense
    (minimax-m2 reads its experts' width from it)."""
    return s.ff if s.arch == "minimax-m2" else s.dense_ff or s.ff


def rope_dims(s: Shape) -> int:
    """`<arch>.rope.dimension_count`."""
    return s.rope_dims or s.full_head_dim or s.head_dim


# --- a small model of each architecture -------------------------------------------------------------

def defaults(s: Shape) -> Shape:
    """`s` (from bmoe-synth's flags) with what its architecture adds, sized from its embd, ff and
    layers: a small model with every part of the real one."""
    a, hd, f = s.arch, s.head_dim, s.ff
    if a in ARCHES or a == "grovemoe":
        return s
    if a == "gemma4":
        return replace(s, dense_ff=f, full_every=2, full_head_dim=2 * hd, full_kv_heads=1)
    if a in ("qwen35moe", "qwen3next", "qwen4exp"):
        s = replace(s, shared_ff=f, full_every=4, rope_dims=hd // 4,
                    recurrent=Recurrent(conv=4, head_dim=hd, k_heads=2, v_heads=4))
        if a == "qwen4exp":  # n-gram embeddings of 4 heads on layer 0, 4 x 32 rows per head
            s = replace(s, hyper=4, hyper_rank=8, indexer=Indexer(
                heads=2, head_dim=hd, top_k=2048, ratios=tuple(4 if s.is_full(i) else 0 for i in range(s.layers))),
                ple=Ple(rows=4 * 4 * 32, dim=s.embd // 4, layer=0, ngram=3, heads_per_ngram=2, conv=4))
        return s
    if a == "glm4moe":
        return replace(s, shared_ff=f, dense_lead=1, dense_ff=2 * f, rope_dims=hd // 2)
    if a in ("deepseek2", "glm-dsa"):
        s = replace(s, shared_ff=f, dense_lead=1, dense_ff=2 * f, n_head_kv=1,
                    mla=Mla(q_lora=s.embd // 2, kv_lora=s.embd // 2, qk_nope=hd, qk_rope=hd // 2, v_head=hd),
                    rope_dims=hd // 2)
        if a == "glm-dsa":  # GLM-5.2's indexer types: layers 0-2 and then every 4th compute their own
            s = replace(s, indexer=Indexer(heads=4, head_dim=64, top_k=2048,
                                           full=tuple(i < 3 or i % 4 == 2 for i in range(s.layers))))
        return s
    if a == "deepseek4":  # heads of 64 (llama.cpp's own test model's)
        ratios = tuple((0, 0, 4, 128)[i % 4] for i in range(s.all_layers))
        return replace(s, shared_ff=f, hyper=4, head_dim=64, n_head=s.embd // 64, n_head_kv=1, rope_dims=32,
                       dsv4=Dsv4(q_lora=s.embd // 4, o_groups=2, o_lora=s.embd // 8, window=128, hash_layers=1),
                       indexer=Indexer(heads=8, head_dim=64, top_k=2048, ratios=ratios))
    if a == "llama4":
        return replace(s, shared_ff=f, moe_every=2, dense_ff=2 * f)
    if a == "lfm2moe":
        return replace(s, dense_lead=1, dense_ff=2 * f, full_every=2, recurrent=Recurrent(conv=3))
    if a == "bailingmoe2":
        return replace(s, shared_ff=f, dense_lead=1, dense_ff=2 * f, rope_dims=hd // 2)
    if a == "bailingmoe3":
        return replace(s, shared_ff=f, dense_lead=1, dense_ff=2 * f, full_every=2, n_head_kv=1, rope_dims=hd // 2,
                       recurrent=Recurrent(conv=4, head_dim=hd),
                       mla=Mla(q_lora=0, kv_lora=s.embd // 2, qk_nope=hd, qk_rope=hd // 2, v_head=hd))
    if a == "minimax-m2":
        return replace(s, rope_dims=hd // 2)
    raise ValueError(f"unknown arch {a!r}")


def _resolve_ff(base: Shape, size_gb: float) -> int:
    """Expert FFN width that makes the file about `size_gb` GB (1 GB = 1e9 bytes).

    File size is linear in ff, so two trial shapes give the exact slope; ff is rounded to a
    multiple of one quant block (32 weights, 256 for the K-quants).
    """
    step = 256 if base.quant in K_QUANTS else 32

    def total(ff: int) -> int:
        return sum(t.nbytes for t in tensor_table(defaults(replace(base, ff=ff))))

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
    fused: bool = False,
    mtp: bool = False,
) -> Shape:
    """The shape bmoe-synth's flags ask for, checked against what llama.cpp and the block sizes allow,
    with the parts its architecture adds (`defaults`); with `size_gb`, `ff` is chosen so the file
    is about that many GB."""
    if arch not in SYNTH_ARCHES:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(SYNTH_ARCHES)}")
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
    if fused and arch not in FUSED_ARCHES:
        raise ValueError(f"the {arch} loader takes only separate gate and up experts; the fused "
                         f"ffn_gate_up_exps is for {', '.join(FUSED_ARCHES)}")
    if mtp and arch not in MTP_ARCHES:
        raise ValueError(f"the {arch} loader has no MTP layer; --mtp is for {', '.join(MTP_ARCHES)}")
    if arch == "grovemoe" and experts % GROVE_GROUP:
        raise ValueError(f"grovemoe's experts come in groups of {GROVE_GROUP}: give an even --experts")
    if arch == "deepseek4" and experts < 2 * top_k:
        raise ValueError("deepseek4's hash layers need at least 2 x top_k experts")
    shape = Shape(arch, layers, experts, top_k, embd, ff, quant, router, fused=fused, mtp=int(mtp))
    if size_gb is not None:
        shape = replace(shape, ff=_resolve_ff(shape, size_gb))
    return defaults(shape)
