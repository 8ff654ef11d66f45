"""bmoe-synth's architectures: the registry of the modules in bmoe.tools.archs (one each, as
mlx-lm's models/), and what the rest of bmoe-synth asks of them: the tensor table and metadata of a
shape, a small model's shape, the flags' checks and the lists --help and the tests read.

Adding an architecture is one new module in bmoe/tools/archs/ that registers its `Arch`
(bmoe.tools.synth_parts), plus its router norm in bmoe.workers.routers.ROUTER_NORM (the line the
spec-gate's predictor reads, which also gives its small model a spread router norm here) and its row
in docs/architectures.md.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import replace
from pathlib import Path

from gguf import GGUFWriter

from bmoe.base import GB
from bmoe.tools.synth_parts import REGISTERED, Arch, Table
from bmoe.tools.synth_shape import K_QUANTS, QUANTS, ROUTER_TYPES, Shape, Tensor, matrix_type
from bmoe.workers import routers

for _module in pkgutil.iter_modules([str(Path(__file__).with_name("archs"))]):  # each registers its Arch
    importlib.import_module(f"bmoe.tools.archs.{_module.name}")
REGISTRY: dict[str, Arch] = dict(sorted(REGISTERED.items(), key=lambda kv: kv[1].listed))

STREAMED_ARCHES: tuple[str, ...] = tuple(a for a, x in REGISTRY.items() if x.streamed)
# attention and experts only (a small model of them is the flags' shape): most tests run over these
ARCHES: tuple[str, ...] = tuple(a for a in STREAMED_ARCHES if REGISTRY[a].small is None)
# those with parts of their own besides (dense and shared FFNs, recurrent layers, MLA, hyper-connections,
# indexers, ...): docs/architectures.md says what each needed; the lossless gate runs over all of them
PARTS_ARCHES: tuple[str, ...] = tuple(a for a in STREAMED_ARCHES if REGISTRY[a].small is not None)
# those the pinned llama.cpp runs that bmoe refuses to stream, written so that the refusal is tested on a real graph
REFUSED_ARCHES: tuple[str, ...] = tuple(a for a, x in REGISTRY.items() if not x.streamed)
SYNTH_ARCHES: tuple[str, ...] = STREAMED_ARCHES + REFUSED_ARCHES
# the loaders that take either expert layout (create_tensor_gate_up_exps, or gemma4's own)
FUSED_ARCHES: tuple[str, ...] = tuple(a for a, x in REGISTRY.items() if x.fused)
# the loaders with an optional trailing multi-token-prediction layer (nextn_predict_layers)
MTP_ARCHES: tuple[str, ...] = tuple(a for a, x in REGISTRY.items() if x.mtp)


def check_mtp(arch: str) -> None:
    """--mtp's rule: only a loader with an MTP layer takes one (ValueError naming those that do)."""
    if arch not in MTP_ARCHES:
        raise ValueError(f"the {arch} loader has no MTP layer; --mtp is for {', '.join(MTP_ARCHES)}")


# the norm weights llama.cpp applies to the router's input (the predictor's ROUTER_NORM), written with a
# spread (Table.add) where the files need not keep their bytes
SCALED_NORMS: dict[str, str] = {a: n for a, n in routers.ROUTER_NORM.items()
                                if a in REGISTRY and not REGISTRY[a].kept_bytes}


def arch_of(s: Shape) -> Arch:
    try:
        return REGISTRY[s.arch]
    except KeyError:
        raise ValueError(f"unknown arch {s.arch!r}") from None


def n_down(s: Shape) -> int:
    """The `n_down` of synth_shape.matrix_type: how many ffn_down matrices the model has where its files
    keep their bytes (Arch.kept_bytes), its layer count (block_count) for the others."""
    a = arch_of(s)
    if a.kept_bytes:
        return s.layers * (2 if s.dense_ff or a.shared_down else 1)
    return s.all_layers


def one_expert_bytes(s: Shape, layer: int) -> int:
    """One expert's bytes at `layer` (gate, up, down), without building the whole table."""
    return sum(Tensor("", shape, matrix_type(s, role, layer, shape[-1], n_down(s), (0, 1)), "normal").nbytes
               for role, shape in (("exps_gate", (s.ff, s.embd)), ("exps_up", (s.ff, s.embd)),
                                   ("exps_down", (s.embd, s.ff))))


def tensor_table(s: Shape) -> list[Tensor]:
    """Every tensor llama.cpp's loader requires for `s.arch` (see src/models/<arch>.cpp), with
    the type `s.quant` gives it."""
    tb = Table(s, n_down(s), SCALED_NORMS.get(s.arch))
    arch_of(s).table(s, tb)
    return tb.tensors()


def add_arch_metadata(w: GGUFWriter, s: Shape) -> None:
    """The `<arch>.*` keys between the expert counts and the norm epsilon (synth.write_model writes
    the rest)."""
    arch_of(s).keys(w, s, s.arch)
    if s.mtp:
        w.add_uint32(f"{s.arch}.nextn_predict_layers", s.mtp)


def feed_forward_length(s: Shape) -> int:
    """`<arch>.feed_forward_length`: the dense FFNs' width, or the experts' where none is dense
    (Arch.experts_ff: the loader reads its experts' width from it)."""
    return s.ff if arch_of(s).experts_ff else s.dense_ff or s.ff


def rope_dims(s: Shape) -> int:
    """`<arch>.rope.dimension_count`."""
    return s.rope_dims or s.full_head_dim or s.head_dim


def defaults(s: Shape) -> Shape:
    """`s` (from bmoe-synth's flags) with what its architecture adds, sized from its embd, ff and
    layers: a small model with every part of the real one."""
    small = arch_of(s).small
    return small(s) if small is not None else s


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
    if mtp:
        check_mtp(arch)
    shape = Shape(arch, layers, experts, top_k, embd, ff, quant, router, fused=fused, mtp=int(mtp))
    check = REGISTRY[arch].check
    if check is not None:
        check(shape)
    if size_gb is not None:
        shape = replace(shape, ff=_resolve_ff(shape, size_gb))
    return defaults(shape)
