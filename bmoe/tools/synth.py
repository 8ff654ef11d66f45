"""bmoe-synth: write random-weight Mixture-of-Experts GGUF models that llama.cpp loads and runs.

The models exist to exercise expert streaming at any scale: every tensor llama.cpp's loader
requires for the architecture is present, activations stay finite, and the router picks different
experts for different tokens. The text they generate is noise, but it is noise made of real word
pieces, so prompts tokenize and output detokenizes.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType

from bmoe.base import positive_float, positive_int

ARCHES: tuple[str, ...] = ("qwen3moe", "qwen2moe", "llama", "olmoe", "gpt-oss")
QUANTS: tuple[str, ...] = ("f16", "q8_0", "q4_0", "mxfp4")
ROUTER_TYPES: tuple[str, ...] = ("f32", "f16", "q8_0")

_GGML_TYPE = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "mxfp4": GGMLQuantizationType.MXFP4,
}
_FILE_TYPE = {
    "f16": LlamaFileType.MOSTLY_F16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q4_0": LlamaFileType.MOSTLY_Q4_0,
    "mxfp4": LlamaFileType.MOSTLY_MXFP4_MOE,
}
# (elements per block, bytes per block); f16/f32 are "blocks" of one element.
_BLOCK = {name: GGML_QUANT_SIZES[t] for name, t in _GGML_TYPE.items()}

_GB = 1_000_000_000
_CONTEXT_LENGTH = 4096
_RMS_EPS = 1e-6
_SLIDING_WINDOW = 128  # gpt-oss: every other layer uses sliding-window attention
_SELF_PENALTY = 5.0  # how strongly output.weight discourages repeating the current token

# --- tokenizer -----------------------------------------------------------------------------

_SPACE = "\u2581"  # SentencePiece's "▁" word-start marker
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_BYTE = 1, 2, 3, 6  # gguf.TokenType values
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
class _Tensor:
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
class _Shape:
    arch: str
    layers: int
    experts: int
    top_k: int
    embd: int
    ff: int
    quant: str
    router: str = "f32"

    @property
    def head_dim(self) -> int:
        return 64 if self.embd >= 256 and self.embd % 64 == 0 else 32

    @property
    def n_head(self) -> int:
        return self.embd // self.head_dim

    @property
    def n_head_kv(self) -> int:
        # OLMoE's k-norm spans n_embd, so it needs as many KV heads as query heads.
        if self.arch == "olmoe" or self.n_head % 2:
            return self.n_head
        return self.n_head // 2


def _tensors(s: _Shape) -> list[_Tensor]:
    """Every tensor llama.cpp's loader requires for `s.arch` (see src/models/<arch>.cpp)."""
    e, v = s.embd, len(_VOCAB.tokens)
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    gpt_oss = s.arch == "gpt-oss"
    out = [_Tensor("token_embd.weight", (v, e), "f16", "normal", 1.0)]
    for i in range(s.layers):
        p = f"blk.{i}."

        def t(name: str, shape: tuple[int, ...], qtype: str = "f32", fill: str = "normal",
              std: float = 0.0) -> None:
            out.append(_Tensor(p + name, shape, qtype, fill, std))  # noqa: B023 - called only in this iteration

        t("attn_norm.weight", (e,), fill="ones")
        t("attn_q.weight", (q_dim, e), "f16", std=e**-0.5)
        t("attn_k.weight", (kv_dim, e), "f16", std=e**-0.5)
        t("attn_v.weight", (kv_dim, e), "f16", std=e**-0.5)
        t("attn_output.weight", (e, q_dim), "f16", std=q_dim**-0.5)
        if s.arch in ("qwen2moe", "gpt-oss"):
            t("attn_q.bias", (q_dim,), std=0.02)
            t("attn_k.bias", (kv_dim,), std=0.02)
            t("attn_v.bias", (kv_dim,), std=0.02)
        if s.arch == "qwen3moe":
            t("attn_q_norm.weight", (s.head_dim,), fill="ones")
            t("attn_k_norm.weight", (s.head_dim,), fill="ones")
        if s.arch == "olmoe":
            t("attn_q_norm.weight", (q_dim,), fill="ones")
            t("attn_k_norm.weight", (kv_dim,), fill="ones")
        if gpt_oss:
            t("attn_output.bias", (e,), std=0.02)
            t("attn_sinks.weight", (s.n_head,), std=1.0)
            t("post_attention_norm.weight", (e,), fill="ones")
        else:
            t("ffn_norm.weight", (e,), fill="ones")
        # Router logits with std ~2 make top-k sharp yet token-dependent.
        t("ffn_gate_inp.weight", (s.experts, e), s.router, std=2.0 * e**-0.5)
        t("ffn_gate_exps.weight", (s.experts, s.ff, e), s.quant, std=e**-0.5)
        t("ffn_up_exps.weight", (s.experts, s.ff, e), s.quant, std=e**-0.5)
        t("ffn_down_exps.weight", (s.experts, e, s.ff), s.quant, std=s.ff**-0.5)
        if gpt_oss:
            t("ffn_gate_inp.bias", (s.experts,), std=0.1)
            t("ffn_gate_exps.bias", (s.experts, s.ff), std=0.02)
            t("ffn_up_exps.bias", (s.experts, s.ff), std=0.02)
            t("ffn_down_exps.bias", (s.experts, e), std=0.02)
        if s.arch == "qwen2moe":
            t("ffn_gate_inp_shexp.weight", (e,), std=e**-0.5)
            t("ffn_gate_shexp.weight", (s.ff, e), "f16", std=e**-0.5)
            t("ffn_up_shexp.weight", (s.ff, e), "f16", std=e**-0.5)
            t("ffn_down_shexp.weight", (e, s.ff), "f16", std=s.ff**-0.5)
    out.append(_Tensor("output_norm.weight", (e,), "f32", "ones"))
    out.append(_Tensor("output.weight", (v, e), "f16", "output", 3.0 * e**-0.5))
    return out


def _add_metadata(w: GGUFWriter, s: _Shape, seed: int, chat_template: str) -> None:
    a = s.arch
    w.add_string("general.name",
                 f"bmoe-synth {a} L{s.layers} E{s.experts}x{s.ff} {s.quant} seed{seed}")
    w.add_uint32("general.file_type", _FILE_TYPE[s.quant])
    w.add_uint32("general.quantization_version", 2)
    w.add_uint32(f"{a}.context_length", _CONTEXT_LENGTH)
    w.add_uint32(f"{a}.embedding_length", s.embd)
    w.add_uint32(f"{a}.block_count", s.layers)
    w.add_uint32(f"{a}.feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_count", s.experts)
    w.add_uint32(f"{a}.expert_used_count", s.top_k)
    if a in ("qwen3moe", "qwen2moe", "gpt-oss"):
        w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    if a == "qwen2moe":
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.ff)
    if a == "gpt-oss":
        w.add_uint32(f"{a}.attention.sliding_window", _SLIDING_WINDOW)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", _RMS_EPS)
    w.add_uint32(f"{a}.rope.dimension_count", s.head_dim)
    w.add_float32(f"{a}.rope.freq_base", 10000.0)

    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", _VOCAB.tokens)
    w.add_array("tokenizer.ggml.scores", _VOCAB.scores)
    w.add_array("tokenizer.ggml.token_type", _VOCAB.types)
    w.add_uint32("tokenizer.ggml.unknown_token_id", _UNK)
    w.add_uint32("tokenizer.ggml.bos_token_id", _BOS)
    w.add_uint32("tokenizer.ggml.eos_token_id", _EOS)
    w.add_uint32("tokenizer.ggml.eot_token_id", _IM_END)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    w.add_string("tokenizer.chat_template", chat_template)


# --- tensor data ---------------------------------------------------------------------------


def _random_blocks(rng: np.random.Generator, n_blocks: int, qtype: str, std: float) -> np.ndarray:
    """Quantized blocks with uniformly random codes and one fixed scale giving weight std `std`.

    Drawing raw bits is far cheaper than quantizing float noise, which matters for GB-size files.
    """
    block_bytes = _BLOCK[qtype][1]
    raw = rng.bit_generator.random_raw((n_blocks * block_bytes + 7) // 8)
    blocks = raw.view(np.uint8)[: n_blocks * block_bytes].reshape(n_blocks, block_bytes)
    if qtype == "q8_0":  # f16 scale, 32 x int8 uniform in [-128, 127] (rms 73.9)
        blocks[:, :2] = np.frombuffer(np.float16(std / 73.9).tobytes(), np.uint8)
    elif qtype == "q4_0":  # f16 scale, 32 x 4-bit code c, value (c - 8) (rms 4.64)
        blocks[:, :2] = np.frombuffer(np.float16(std / 4.64).tobytes(), np.uint8)
    else:  # mxfp4: E8M0 exponent e, 32 x e2m1 code; value 2^(e-127) * {0, ±.5, .., ±6} (rms 2.93)
        blocks[:, 0] = 127 + round(math.log2(std / 2.93))
    return blocks


def _tensor_data(t: _Tensor, rng: np.random.Generator, token_embd: np.ndarray | None) -> np.ndarray:
    if t.fill == "ones":
        return np.ones(t.shape, np.float32)
    if t.qtype in ("q8_0", "q4_0", "mxfp4"):
        return _random_blocks(rng, t.nbytes // _BLOCK[t.qtype][1], t.qtype, t.std)
    data = rng.standard_normal(t.shape, np.float32)
    data *= t.std
    if t.fill == "output":
        assert token_embd is not None
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


def _resolve_ff(base: _Shape, size_gb: float) -> int:
    """Expert FFN width that makes the file about `size_gb` GB (1 GB = 1e9 bytes).

    File size is linear in ff, so two trial shapes give the exact slope; ff is rounded to a
    multiple of 32 (one quant block).
    """
    def total(ff: int) -> int:
        return sum(t.nbytes for t in _tensors(replace(base, ff=ff)))

    smallest = total(32)
    slope = total(64) - smallest
    ff = 32 + round((size_gb * _GB - smallest) / slope) * 32
    if ff < 32:
        raise ValueError(
            f"--size-gb {size_gb} is below the size of the non-expert tensors plus the smallest "
            f"experts ({smallest / _GB:.3f} GB); use fewer layers or a smaller --embd"
        )
    return ff


def write_model(
    path: str | Path,
    *,
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
    the file is about that many GB. With `splits` > 1 the model is written as llama.cpp split
    shards `<stem>-0000i-of-0000N.gguf` beside `path`, and the first shard's path is returned.
    Expert tensors (`*_exps.weight`) use `quant`; the router uses `router` (F32 by default: a
    quantized router is what real files sometimes ship, and what --spec-gate cannot use); norms
    are F32, other matrices F16. `chat_template` is the jinja template stored (ChatML by default;
    another model's, e.g. Qwen3's, to test what it renders and parses). Tensors are generated
    and written one at a time, so memory stays at about one expert tensor.
    """
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
    if seed < 0:
        raise ValueError("seed must be >= 0")
    if router not in ROUTER_TYPES:
        raise ValueError(f"unknown router type {router!r}; choose from {', '.join(ROUTER_TYPES)}")
    if splits < 1:
        raise ValueError("splits must be >= 1")

    shape = _Shape(arch, layers, experts, top_k, embd, ff, quant, router)
    if size_gb is not None:
        shape = replace(shape, ff=_resolve_ff(shape, size_gb))
    tensors = _tensors(shape)
    total = sum(t.nbytes for t in tensors)

    path = Path(path)
    if progress:
        print(f"bmoe-synth: {path} {arch} layers={layers} experts={experts} top_k={top_k} "
              f"embd={embd} ff={shape.ff} {quant}: {total / 1e6:.1f} MB", file=sys.stderr)
    # Write into a scratch folder beside the target and rename at the end, so an interrupted
    # run never leaves a truncated file (or shard) under a final name.
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".bmoe-synth-", dir=path.parent))
    w = GGUFWriter(scratch / path.name, arch, split_max_tensors=-(-len(tensors) // splits) if splits > 1 else 0)
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
        token_embd = None  # the first tensor; output.weight is derived from it
        for index, t in enumerate(tensors):
            # One stream per tensor: the bytes of a tensor depend only on (seed, its index).
            rng = np.random.Generator(np.random.PCG64([seed, index]))
            data = _tensor_data(t, rng, token_embd)
            if token_embd is None:
                token_embd = data
            w.write_tensor_data(data)
            done += t.nbytes
            now = time.monotonic()
            if progress and (now - last >= 1.0 or done == total):
                last = now
                print(f"bmoe-synth: {done / 1e6:.0f}/{total / 1e6:.0f} MB "
                      f"({100 * done / total:.0f}%) {now - start:.1f}s", file=sys.stderr)
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
  bmoe-synth --chat-template qwen3.jinja -o think.gguf   # another model's chat template

--size-gb X keeps --layers/--experts/--embd and picks the expert FFN width (--ff) so the file is
about X GB (1 GB = 1e9 bytes); pass a realistic --layers/--experts/--embd with it.
"""


def _read_template(ap: argparse.ArgumentParser, path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        ap.error(f"--chat-template {path}: {e.strerror}")


def main(argv: list[str] | None = None) -> int:
    """Console entry point of `bmoe-synth`."""
    ap = argparse.ArgumentParser(
        prog="bmoe-synth",
        description="Write a random-weight Mixture-of-Experts GGUF model that llama.cpp can run.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--arch", choices=ARCHES, default="qwen3moe", help="llama.cpp architecture")
    ap.add_argument("--layers", type=positive_int, default=4, help="transformer blocks (default 4)")
    ap.add_argument("--experts", type=positive_int, default=8, help="experts per layer (default 8)")
    ap.add_argument("--top-k", type=positive_int, default=2, help="experts used per token (default 2)")
    ap.add_argument("--embd", type=positive_int, default=128,
                    help="hidden size, multiple of 32 (default 128)")
    ap.add_argument("--ff", type=positive_int, default=None,
                    help="expert FFN width, multiple of 32 (default 256; set by --size-gb)")
    ap.add_argument("--quant", choices=QUANTS, default="q8_0",
                    help="type of the expert tensors (default q8_0)")
    ap.add_argument("--router", choices=ROUTER_TYPES, default="f32",
                    help="type of the router tensors (default f32; q8_0 makes a model --spec-gate refuses)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    ap.add_argument("--size-gb", type=positive_float, default=None,
                    help="target file size in GB: chooses --ff (cannot be combined with --ff)")
    ap.add_argument("--splits", type=positive_int, default=1,
                    help="write N llama.cpp split shards (<stem>-0000i-of-0000N.gguf) instead of one file")
    ap.add_argument("--chat-template", metavar="FILE", default=None,
                    help="store this jinja chat template (default: ChatML without tools)")
    ap.add_argument("-o", "--output", required=True, help="output .gguf path")
    args = ap.parse_args(argv)
    if args.size_gb is not None and args.ff is not None:
        ap.error("--size-gb chooses --ff; give one of them")
    try:
        path = write_model(
            args.output, arch=args.arch, layers=args.layers, experts=args.experts,
            top_k=args.top_k, embd=args.embd, ff=256 if args.ff is None else args.ff,
            quant=args.quant, seed=args.seed, size_gb=args.size_gb, splits=args.splits, router=args.router,
            chat_template=CHAT_TEMPLATE if args.chat_template is None else _read_template(ap, args.chat_template),
            progress=True,
        )
    except ValueError as exc:
        ap.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
