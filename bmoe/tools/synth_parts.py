"""What bmoe-synth's architectures are made of (each is a module of bmoe.tools.archs): the `Arch` a
module registers, the `Table` its tensors are written into, and the parts several share: a MoE FFN,
attention of several kinds, MTP layers, recurrent layers, the output head, and their metadata keys.

A table is built in the loader's terms (`Table`): names, numpy-order shapes and a role per tensor;
the types come last, in file order, as llama-quant counts its attention-v tensors
(synth_shape.matrix_type). Values are chosen so a random model of every architecture runs finite
and routes different tokens to different experts: sharp routers, decays below zero, norms at one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from gguf import GGUFWriter

from bmoe.tools.synth_shape import Mla, Recurrent, Shape, Tensor, matrix_type

# llama_expert_gating_func_type (src/llama-hparams.h)
SOFTMAX, SIGMOID, SQRT_SOFTPLUS = 1, 2, 4


@dataclass(frozen=True)
class Arch:
    """One architecture bmoe-synth writes, as its module in bmoe.tools.archs registers it."""

    name: str  # llama.cpp's (general.architecture)
    listed: int  # its place in bmoe-synth's lists (--help, an unknown --arch's error, the tests' order)
    table: Callable[[Shape, Table], None]  # its tensors in file order, the output head included
    keys: Callable[[GGUFWriter, Shape, str], None]  # its `<arch>.*` keys between the expert counts and the norm epsilon
    small: Callable[[Shape], Shape] | None = None  # what a small model of it adds to the flags' shape (None: nothing)
    streamed: bool = True  # False: bmoe refuses to stream it (written so that the refusal is tested on a real graph)
    fused: bool = False  # its loader also takes the experts' gate and up as one ffn_gate_up_exps
    mtp: bool = False  # its loader has a trailing multi-token-prediction (NextN) layer
    # its files keep the bytes bmoe-synth wrote before the architectures had modules of their own: a
    # layer's ffn_down placed among the model's ffn_down tensors (as the llama.cpp that made the
    # published files did; synth_shape._q4_k_m), its router norm at one
    kept_bytes: bool = False
    shared_down: bool = False  # (kept_bytes) every layer has a shared expert's ffn_down besides the experts'
    experts_ff: bool = False  # feed_forward_length is the experts' width (its loader reads them from it)
    check: Callable[[Shape], None] | None = None  # raises ValueError for a shape its loader cannot take


REGISTERED: dict[str, Arch] = {}


def register(arch: Arch) -> None:
    """Add an architecture (its module calls this once; bmoe.tools.synth_archs imports every module)."""
    if arch.name in REGISTERED:
        raise ValueError(f"two modules register the architecture {arch.name!r}")
    REGISTERED[arch.name] = arch


class Table:
    """Tensors in file order, each with the role that types it (synth_shape's roles)."""

    def __init__(self, s: Shape, n_down: int, scaled_norm: str | None = None) -> None:
        self.s = s
        self.n_down = n_down  # synth_shape.matrix_type's: how llama-quant places a layer's ffn_down
        self.scaled_norm = scaled_norm  # the norm before the router, written with a spread (below)
        self.rows: list[tuple[str, tuple[int, ...], str, int, str, float]] = []

    def add(self, name: str, shape: tuple[int, ...], role: str = "", layer: int = -1, fill: str = "normal",
            std: float = 0.0) -> None:
        if fill == "ones" and layer >= 0 and self.scaled_norm and name.endswith("." + self.scaled_norm):
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
        s, nd = self.s, self.n_down
        n_v = sum(row[2] == "attn_v" for row in self.rows)
        out, i_v = [], 0
        for name, shape, role, layer, fill, std in self.rows:
            qtype = matrix_type(s, role, layer, shape[-1], nd, (i_v, n_v))
            i_v += role == "attn_v"
            out.append(Tensor(name, shape, qtype, fill, std))
        return out


# --- the tensors architectures share ------------------------------------------------------------

def experts(t: Callable[..., None], s: Shape, *, probs_bias: bool = False, shared: str = "") -> None:
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
        ffn(t, e, s.shared_ff, "_shexp")


def ffn(t: Callable[..., None], e: int, f: int, suffix: str = "") -> None:
    """A dense SwiGLU FFN (ffn_gate, ffn_up, ffn_down, with a suffix: the shared experts')."""
    t(f"ffn_gate{suffix}.weight", (f, e), "ffn_gate", std=e**-0.5)
    t(f"ffn_up{suffix}.weight", (f, e), "ffn_up", std=e**-0.5)
    t(f"ffn_down{suffix}.weight", (e, f), "ffn_down", std=f**-0.5)


def ffn_or_experts(t: Callable[..., None], s: Shape, i: int, **kw: object) -> None:
    if s.is_moe(i):
        experts(t, s, **kw)  # type: ignore[arg-type]  # the keywords of experts
    else:
        ffn(t, s.embd, s.dense_ff)


def qkvo(t: Callable[..., None], s: Shape, *, gated: bool = False, q_dim: int = 0, biased: bool = False) -> None:
    """Attention's q, k, v and output of s.n_head query heads (`q_dim` wide if given) and s.n_head_kv
    KV heads of s.head_dim, then, `biased`, q, k and v's biases; a `gated` q holds [q | gate] per head,
    twice as wide."""
    e, q_dim = s.embd, q_dim or s.n_head * s.head_dim
    kv_dim = s.n_head_kv * s.head_dim
    t("attn_q.weight", ((2 if gated else 1) * q_dim, e), "attn_q", std=e**-0.5)
    t("attn_k.weight", (kv_dim, e), "attn_k", std=e**-0.5)
    t("attn_v.weight", (kv_dim, e), "attn_v", std=e**-0.5)
    t("attn_output.weight", (e, q_dim), "attn_output", std=q_dim**-0.5)
    if biased:
        t("attn_q.bias", (q_dim,), std=0.02)
        t("attn_k.bias", (kv_dim,), std=0.02)
        t("attn_v.bias", (kv_dim,), std=0.02)


def nextn(t: Callable[..., None], s: Shape) -> None:
    """An MTP layer's own tensors (its shared head and embedding default to the model's)."""
    t("nextn.eh_proj.weight", (s.embd, 2 * s.embd), "matrix", std=(2 * s.embd) ** -0.5)
    t("nextn.enorm.weight", (s.embd,), fill="ones")
    t("nextn.hnorm.weight", (s.embd,), fill="ones")


def gdn(t: Callable[..., None], s: Shape, *, fused_ba: bool) -> None:
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


def mla(t: Callable[..., None], s: Shape, *, split_kv_b: bool = True) -> None:
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


def head(s: Shape, tb: Table, norm: str = "output_norm.weight") -> None:
    """The final norm and the output projection (none where it is tied to token_embd)."""
    tb.add(norm, (s.embd,), fill="ones")
    if not s.tied:
        tb.add("output.weight", (s.n_vocab, s.embd), "output", fill="output", std=3.0 * s.embd**-0.5)



# --- the keys architectures share ---------------------------------------------------------------

def rope_sections(rope_dims: int) -> list[int]:
    """Qwen3.5's interleaved M-RoPE split of the rotated pairs into (time, height, width, -): 11, 11,
    10 of 32 (rope.dimension_sections)."""
    pairs = rope_dims // 2
    base, rest = divmod(pairs, 3)
    return [base + (rest > 0), base + (rest > 1), base, 0]


def routing(w: GGUFWriter, a: str, gating: int, *, norm: bool = True, scale: float = 1.0, groups: int = 0,
             groups_used: int = 0) -> None:
    w.add_uint32(f"{a}.expert_gating_func", gating)
    w.add_bool(f"{a}.expert_weights_norm", norm)
    w.add_float32(f"{a}.expert_weights_scale", scale)
    if groups:
        w.add_uint32(f"{a}.expert_group_count", groups)
        w.add_uint32(f"{a}.expert_group_used_count", groups_used)


def heads(w: GGUFWriter, s: Shape, a: str, kv: int | list[int] | None = None) -> None:
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    if isinstance(kv, list):
        w.add_array(f"{a}.attention.head_count_kv", kv)
    else:
        w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv if kv is None else kv)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)


def mla_keys(w: GGUFWriter, s: Shape, a: str) -> None:
    """MLA's heads as llama.cpp's absorbed attention reads them: one KV head of kv_lora + rope, the
    decompressed widths in the mla keys."""
    m = s.mla
    assert m is not None
    if m.q_lora:
        w.add_uint32(f"{a}.attention.q_lora_rank", m.q_lora)
    w.add_uint32(f"{a}.attention.kv_lora_rank", m.kv_lora)
    w.add_uint32(f"{a}.attention.key_length_mla", m.qk_nope + m.qk_rope)
    w.add_uint32(f"{a}.attention.value_length_mla", m.v_head)


def gdn_keys(w: GGUFWriter, s: Shape, a: str) -> None:
    r = s.recurrent
    assert r is not None
    w.add_uint32(f"{a}.ssm.conv_kernel", r.conv)
    w.add_uint32(f"{a}.ssm.inner_size", r.head_dim * r.v_heads)
    w.add_uint32(f"{a}.ssm.state_size", r.head_dim)
    w.add_uint32(f"{a}.ssm.time_step_rank", r.v_heads)
    w.add_uint32(f"{a}.ssm.group_count", r.k_heads)
    w.add_uint32(f"{a}.full_attention_interval", s.full_every)


# --- what a family of architectures shares -----------------------------------------------------------

def gdn_hybrid(s: Shape, tb: Table, *, fused_ba: bool) -> None:
    """qwen35moe's and qwen3next's tensors (src/models/qwen35moe.cpp, qwen3next.cpp): Gated DeltaNet
    layers and every full_every-th a gated full attention, each with routed experts and a gated shared
    expert; an MTP layer is a full-attention layer with the nextn tensors."""
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.all_layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        t("post_attention_norm.weight", (e,), fill="ones")
        if s.is_full(i) or i >= s.layers:
            qkvo(t, s, gated=True)
            t("attn_q_norm.weight", (s.head_dim,), fill="ones")
            t("attn_k_norm.weight", (s.head_dim,), fill="ones")
        else:
            gdn(t, s, fused_ba=fused_ba)
        experts(t, s, shared="gated")
        if i >= s.layers:
            nextn(t, s)
    head(s, tb)


def gdn_hybrid_keys(w: GGUFWriter, s: Shape, a: str) -> None:
    """The expert widths, heads and Gated DeltaNet keys of qwen35moe, qwen3next and qwen4exp."""
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.shared_ff)
    heads(w, s, a)
    gdn_keys(w, s, a)


def gdn_hybrid_small(s: Shape) -> Shape:
    """A small qwen35moe, qwen3next or qwen4exp: a shared expert, every 4th layer attention, the others
    Gated DeltaNet."""
    hd, f = s.head_dim, s.ff
    return replace(s, shared_ff=f, full_every=4, rope_dims=hd // 4,
                   recurrent=Recurrent(conv=4, head_dim=hd, k_heads=2, v_heads=4))


def mla_moe_keys(w: GGUFWriter, s: Shape, a: str, *, groups: int = 0, groups_used: int = 0) -> None:
    """deepseek2's and glm-dsa's keys but the indexer's: shared experts, leading dense layers, sigmoid
    routing (group-limited with `groups`), MLA's heads."""
    m = s.mla
    assert m is not None
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_shared_count", s.shared_ff // s.ff)
    w.add_uint32(f"{a}.leading_dense_block_count", s.dense_lead)
    routing(w, a, SIGMOID, scale=2.5, groups=groups, groups_used=groups_used)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", 1)
    w.add_uint32(f"{a}.attention.key_length", m.kv_lora + m.qk_rope)
    w.add_uint32(f"{a}.attention.value_length", m.kv_lora)
    mla_keys(w, s, a)


def mla_moe_small(s: Shape) -> Shape:
    """A small deepseek2 or glm-dsa: shared experts, one leading dense layer, MLA."""
    hd, f = s.head_dim, s.ff
    return replace(s, shared_ff=f, dense_lead=1, dense_ff=2 * f, n_head_kv=1,
                   mla=Mla(q_lora=s.embd // 2, kv_lora=s.embd // 2, qk_nope=hd, qk_rope=hd // 2, v_head=hd),
                   rope_dims=hd // 2)
