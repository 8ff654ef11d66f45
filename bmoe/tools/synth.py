"""bmoe-synth: write random-weight Mixture-of-Experts GGUF models that llama.cpp loads and runs.

The models exist to exercise expert streaming at any scale: every tensor llama.cpp's loader
requires for the architecture is present, activations stay finite, and the router picks different
experts for different tokens. The text they generate is noise, but it is noise made of real word
pieces, so prompts tokenize and output detokenizes.

`--like NAME` writes a published model's byte shape (its tensor table at Q4_K_M: names, shapes and
the types llama.cpp's quantizer gives them), so streaming reads what it would read from the real
file; `--like TRACE.csv` takes the shape from a route_trace v1 header.

This module is the command and the file (metadata, `write_model`); what goes in it comes from
synth_archs (each architecture's tensor table and metadata, one module each in bmoe.tools.archs),
synth_shape (shape, tensor types), synth_like (published shapes), synth_vocab (tokenizer) and
synth_blocks (tensor bytes).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType

from bmoe.base import GB, positive_float, positive_int
from bmoe.tools.synth_archs import (
    FUSED_ARCHES,
    MTP_ARCHES,
    REFUSED_ARCHES,
    STREAMED_ARCHES,
    SYNTH_ARCHES,
    add_arch_metadata,
    feed_forward_length,
    rope_dims,
    shape_from_flags,
    tensor_table,
)
from bmoe.tools.synth_blocks import ChunkWriter, tensor_data
from bmoe.tools.synth_like import LIKES, shape_from_like
from bmoe.tools.synth_shape import GGML_TYPE, K_QUANTS, QUANTS, ROUTER_TYPES, Plan, Shape
from bmoe.tools.synth_vocab import CHAT_TEMPLATE, add_tokenizer

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
_CONTEXT_LENGTH = 4096
_RMS_EPS = 1e-6


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
    fused: bool = False,
    mtp: bool = False,
) -> Plan:
    """The tensors `write_model` writes for these arguments, without writing anything.

    `like` is a LIKES name or a route_trace v1 CSV path; it sets the whole shape and the other
    shape arguments are ignored, but `mtp`, which adds the MTP layer the model's MTP variant has.
    """
    shape = shape_from_like(like, mtp) if like is not None else shape_from_flags(
        arch=arch, layers=layers, experts=experts, top_k=top_k, embd=embd, ff=ff, quant=quant,
        size_gb=size_gb, router=router, fused=fused, mtp=mtp)
    return Plan(shape, tuple(tensor_table(shape)))


def _add_metadata(w: GGUFWriter, s: Shape, seed: int, chat_template: str) -> None:
    a = s.arch
    w.add_string("general.name", f"bmoe-synth {s.name}-like seed{seed}" if s.name else
                 f"bmoe-synth {a} L{s.layers} E{s.experts}x{s.ff} {s.quant} seed{seed}")
    w.add_uint32("general.file_type", _FILE_TYPE[s.quant])
    w.add_uint32("general.quantization_version", 2)
    w.add_uint32(f"{a}.context_length", _CONTEXT_LENGTH)
    w.add_uint32(f"{a}.embedding_length", s.embd)
    w.add_uint32(f"{a}.block_count", s.all_layers)
    w.add_uint32(f"{a}.feed_forward_length", feed_forward_length(s))
    w.add_uint32(f"{a}.expert_count", s.experts)
    w.add_uint32(f"{a}.expert_used_count", s.top_k)
    add_arch_metadata(w, s)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", _RMS_EPS)
    w.add_uint32(f"{a}.rope.dimension_count", rope_dims(s))
    w.add_float32(f"{a}.rope.freq_base", s.rope_base)
    add_tokenizer(w, s.n_vocab, chat_template)


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
    fused: bool = False,
    mtp: bool = False,
    chat_template: str = CHAT_TEMPLATE,
    progress: bool = False,
    sparse: bool = False,
) -> Path:
    """Write a random-weight MoE GGUF that llama.cpp can load and run; return its path.

    Same arguments give a byte-identical file. With `size_gb`, `ff` is ignored and chosen so
    the file is about that many GB. With `like` (a LIKES name or a route_trace v1 CSV) the shape
    and every tensor's type are a published model's at Q4_K_M and the other shape arguments are
    ignored but `mtp` (see plan_model). With `splits` > 1 the model is written as llama.cpp split
    shards `<stem>-0000i-of-0000N.gguf` beside `path`, and the first shard's path is returned.
    Expert tensors (`*_exps.weight`) use `quant` (q4_k_m: every matrix as llama.cpp's Q4_K_M
    recipe types it); the router uses `router` (F32 by default: a quantized router is what real
    files sometimes ship, and what --spec-gate cannot use); norms are F32, other matrices F16.
    `chat_template` is the jinja template stored (ChatML by default; another model's, e.g.
    Qwen3's, to test what it renders and parses). `fused` writes the experts' gate and up as one
    ffn_gate_up_exps (the loaders of FUSED_ARCHES take either layout); `mtp` adds the trailing
    multi-token-prediction layer of MTP_ARCHES. Tensors are generated and written in chunks of
    whole rows, so memory stays at about 64 MiB (one f16 matrix for the small f16 models).
    `sparse` writes the metadata and tensor table but no tensor data: a sparse file of the full
    size whose weights are all zero, a few MB on disk, for checking that llama.cpp loads a table
    too large to write (its text is meaningless).
    """
    if seed < 0:
        raise ValueError("seed must be >= 0")
    if splits < 1:
        raise ValueError("splits must be >= 1")
    plan = plan_model(like=like, arch=arch, layers=layers, experts=experts, top_k=top_k, embd=embd,
                      ff=ff, quant=quant, size_gb=size_gb, router=router, fused=fused, mtp=mtp)
    shape, tensors = plan.shape, plan.tensors
    total = plan.tensor_bytes

    path = Path(path)
    if progress:
        print(f"bmoe-synth: {path} {shape.name + '-like ' if shape.name else ''}{shape.arch} "
              f"layers={shape.layers} experts={shape.experts} top_k={shape.top_k} embd={shape.embd} "
              f"ff={shape.ff} {shape.quant}: {total / 1e6:.1f} MB", file=sys.stderr)
    # Write into a scratch folder beside the target and rename at the end, so an interrupted
    # run never leaves a truncated file (or shard) under a final name.
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".bmoe-synth-", dir=path.parent))
    w = ChunkWriter(scratch / path.name, shape.arch,
                    split_max_tensors=-(-len(tensors) // splits) if splits > 1 else 0)
    try:
        _add_metadata(w, shape, seed, chat_template)
        for t in tensors:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes,
                              raw_dtype=GGML_TYPE[t.qtype])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        start = last = time.monotonic()
        done = 0

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

        if sparse:
            for _ in tensors:
                w.skip_tensor_data()
        for chunks in () if sparse else tensor_data(shape, tensors, seed):
            w.write_tensor_chunks(counted(chunks))
        w.close()
        written = sorted(scratch.iterdir())
        finals = [path.with_name(p.name) for p in written]
        for src, dst in zip(written, finals):
            src.replace(dst)
    finally:
        w.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return finals[0]


_ARCH_NOTE = (
    "--arch NAME writes a small model of any of {arches}: the metadata and tensors the pinned llama.cpp's "
    "loader asks for, with each architecture's own parts (shared experts and their gates, leading dense "
    "layers, selection biases and sigmoid or group-limited routing, recurrent layers, hyper-connections, "
    "sparse-attention indexers, hash-routed layers), sized from --embd, --ff and --layers. bmoe streams "
    "{streamed}; it refuses {refused}, which plain llama.cpp runs (bmoe-cli --no-stream), and "
    "docs/architectures.md says why.\n--fused-gate-up writes the experts' gate and up as one ffn_gate_up_exps "
    "({fused}); --mtp adds a trailing multi-token-prediction layer ({mtp})."
)
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
  bmoe-synth --like qwen3.6-35b-a3b --mtp -o q36-mtp.gguf  # as its MTP variant: one more layer, the MTP one
  bmoe-synth --arch qwen35moe -o q35.gguf               # Gated DeltaNet + attention, shared expert
  bmoe-synth --arch deepseek2 --fused-gate-up --mtp -o ds2.gguf   # fused gate_up experts, an MTP layer

--size-gb X keeps --layers/--experts/--embd and picks the expert FFN width (--ff) so the file is
about X GB (1 GB = 1e9 bytes); pass a realistic --layers/--experts/--embd with it.

--like NAME writes a published model's byte shape at Q4_K_M: its layers, experts, top-k, hidden
size, expert width, heads and vocabulary, every tensor named, shaped and typed as in the real GGUF
(llama.cpp's Q4_K_M rules: Q6_K output and every few layers' ffn_down and attn_v, 32-weight
fallbacks for rows that are not whole 256-blocks; gpt-oss keeps its experts in MXFP4), within 2 %
of the real file's size where one was published (--plan prints the file it is compared with). The
weights are random and the tokenizer is bmoe-synth's own, padded with unused tokens to the real
vocabulary size. Known: {names}.
gemma-4-26b-a4b, qwen3.6-35b-a3b, qwen3.8-flash-next, glm-5.2 and deepseek-v4-flash are written
with their real architectures' tables.
--like TRACE.csv takes the shape from a route_trace v1 header: a known model (by the file name in
the header) with the trace's top-k, else a shape whose experts have the header's bytes per layer.

{arch_note}
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
    for layer in range(plan.shape.all_layers):
        print(f"layer={layer} expert_bytes={plan.expert_bytes(layer)} dense_bytes={plan.dense_bytes(layer)}")
    print(f"tensor bytes: {plan.tensor_bytes:,} ({plan.tensor_bytes / GB:.2f} GB)")
    if like in LIKES:
        real, recipe = LIKES[like].real_bytes, LIKES[like].real_recipe
        size = (f"real {recipe} file: {real:,} ({real / GB:.2f} GB, {100 * (plan.tensor_bytes / real - 1):+.2f} %)"
                if real else f"real file: {recipe}")
        print(f"{size}; {LIKES[like].source}")
    _warn_if_not_streamed(plan.shape.arch)


def _warn_if_not_streamed(arch: str) -> None:
    if arch in REFUSED_ARCHES:
        print(f"bmoe-synth: note: bmoe cannot stream {arch}; plain llama.cpp runs it (bmoe-cli --no-stream); "
              f"docs/architectures.md says why", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Console entry point of `bmoe-synth`."""
    ap = argparse.ArgumentParser(
        prog="bmoe-synth",
        description="Write a random-weight Mixture-of-Experts GGUF model that llama.cpp can run.",
        epilog=_EPILOG.format(names=", ".join(LIKES), arch_note="\n".join(
            textwrap.fill(part, 100) for part in _ARCH_NOTE.format(
                arches=", ".join(SYNTH_ARCHES), streamed=", ".join(STREAMED_ARCHES),
                refused=", ".join(REFUSED_ARCHES), fused=", ".join(FUSED_ARCHES),
                mtp=", ".join(MTP_ARCHES)).split("\n"))),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--like", metavar="NAME|TRACE.csv", default=None,
                    help=f"a published model's shape and types at Q4_K_M ({', '.join(LIKES)}), or the "
                         "shape in a route_trace v1 header; sets every shape flag")
    ap.add_argument("--plan", action="store_true",
                    help="print the tensors (name, type, ggml shape, bytes) and sizes instead of writing")
    ap.add_argument("--arch", choices=SYNTH_ARCHES, default=None, metavar="ARCH",
                    help="llama.cpp architecture (default qwen3moe; the others are listed below)")
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
    ap.add_argument("--fused-gate-up", dest="fused", action="store_true", default=None,
                    help="the experts' gate and up as one ffn_gate_up_exps tensor (loaders that take either)")
    ap.add_argument("--mtp", action="store_true", default=None,
                    help="add a trailing multi-token-prediction (NextN) layer (loaders that have one)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    ap.add_argument("--size-gb", type=positive_float, default=None,
                    help="target file size in GB: chooses --ff (cannot be combined with --ff)")
    ap.add_argument("--splits", type=positive_int, default=1,
                    help="write N llama.cpp split shards (<stem>-0000i-of-0000N.gguf) instead of one file")
    ap.add_argument("--chat-template", metavar="FILE", default=None,
                    help="store this jinja chat template (default: ChatML without tools)")
    ap.add_argument("-o", "--output", help="output .gguf path (required unless --plan)")
    args = ap.parse_args(argv)
    shape_flags = {"arch": "--arch", "layers": "--layers", "experts": "--experts", "top_k": "--top-k",
                   "embd": "--embd", "ff": "--ff", "quant": "--quant", "router": "--router", "size_gb": "--size-gb",
                   "fused": "--fused-gate-up"}
    if args.like is not None:
        given = [flag for f, flag in shape_flags.items() if getattr(args, f) is not None]  # --mtp goes with it
        if given:
            ap.error(f"--like sets the shape; drop {', '.join(given)}")
    if args.size_gb is not None and args.ff is not None:
        ap.error("--size-gb chooses --ff; give one of them")
    if args.output is None and not args.plan:
        ap.error("the following arguments are required: -o/--output")
    k_quant = args.quant in K_QUANTS
    shape = dict(arch=args.arch or "qwen3moe", layers=args.layers or 4, experts=args.experts or 8,
                 top_k=args.top_k or 2, embd=args.embd or (256 if k_quant else 128),
                 ff=args.ff or 256, quant=args.quant or "q8_0", size_gb=args.size_gb,
                 router=args.router or "f32", fused=bool(args.fused), mtp=bool(args.mtp))
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
    _warn_if_not_streamed(shape_from_like(args.like).arch if args.like else str(shape["arch"]))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
