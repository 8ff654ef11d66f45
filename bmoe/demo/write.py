"""The demo's GGUF file: SmolLM2's tensors copied, each dense FFN written as signed Q8_0 experts.

The output is a `llama`-arch MoE (Mixtral layout). Each expert is the layer's dense FFN (Q4_1
dequantized, requantized to Q8_0) whose down projection carries the expert's signature
(`bmoe.demo.router_fit.signature_gain`) in its Q8_0 block scales. llama.cpp's llama arch
renormalises the top-k routing weights (`build_moe_ffn(..., norm_w = true, ...)` in
src/models/llama.cpp), so any routing yields the dense FFN up to the signature.

Everything else (attention, norms, embeddings, tokenizer, chat template, metadata) is copied from
the source file. Same arguments give the same bytes. Tensors are streamed to disk one expert at
a time, so memory stays at one layer's FFN whatever the file size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import BinaryIO

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from bmoe.base.gguf_table import read_table
from bmoe.base.units import GB
from bmoe.demo.router_fit import signature_gain

ARCH = "llama"
RECIPE = 2  # bump whenever the bytes a given (experts, top_k) produce change (it is in the file name)
MAX_EXPERTS = 1024  # llama.cpp's LLAMA_MAX_EXPERTS
Q8 = QT.Q8_0
Q8_BLOCK, Q8_BYTES = gguf.GGML_QUANT_SIZES[Q8]


def _q8(weights: np.ndarray) -> np.ndarray:
    """Quantize float rows to Q8_0 blocks: uint8 [rows, row_bytes]."""
    return gguf.quants.quantize(weights.astype(np.float32), Q8)


def sign_down(down_q8: np.ndarray, layer: int, expert: int, top_k: int) -> np.ndarray:
    """Expert `expert`'s down projection: every Q8_0 block scale times `signature_gain`."""
    out = down_q8.copy()
    blocks = out.reshape(-1, Q8_BYTES)
    scales = blocks[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)
    gain = np.float32(signature_gain(layer, expert, top_k))
    blocks[:, :2] = (scales * gain).astype(np.float16)[:, None].view(np.uint8)
    return out


class _ExpertStream:
    """Duck-typed array for GGUFWriter.write_tensor_data: writes one expert slice at a time."""

    def __init__(self, nbytes: int, n_expert: int, piece: Callable[[int], np.ndarray],
                 tick: Callable[[int], None]) -> None:
        self.nbytes = nbytes
        self._n, self._piece, self._tick = n_expert, piece, tick

    def tofile(self, f: BinaryIO) -> None:
        for e in range(self._n):
            data = self._piece(e)
            data.tofile(f)
            self._tick(data.nbytes)


def _same(x: np.ndarray, expert: int) -> np.ndarray:
    """Expert `expert`'s gate or up projection: the dense one, whatever the expert."""
    return x


def _expert_tensor_bytes(n_embd: int, n_ff: int) -> int:
    return n_embd * n_ff // Q8_BLOCK * Q8_BYTES


def _int_field(reader: gguf.GGUFReader, key: str) -> int:
    """The integer metadata value `key` (ValueError naming the key when the file lacks it)."""
    field = reader.get_field(key)
    if field is None:
        raise ValueError(f"the source model has no {key} field")
    return int(field.contents())


def experts_for_size(size_gb: float, src: Path) -> int:
    """Experts per layer that make the demo file built from `src` about `size_gb` GB (1 GB = 1e9 bytes).

    Reads the header only (bmoe.base.gguf_table): gguf's reader also parses the 49k-entry tokenizer
    arrays, seconds for three numbers and a sum."""
    table = read_table(src)

    def field(key: str) -> int:
        value = table.fields.get(key)
        if not isinstance(value, int):
            raise ValueError(f"the source model has no {key} field")
        return value

    n_layer, n_embd, n_ff = (field(f"{ARCH}.{k}") for k in ("block_count", "embedding_length", "feed_forward_length"))
    dense = sum(t.nbytes for t in table.tensors if t.name.split(".")[-2] in ("ffn_gate", "ffn_up", "ffn_down"))
    rest = os.path.getsize(src) - dense
    per_expert = 3 * n_layer * _expert_tensor_bytes(n_embd, n_ff) + n_layer * n_embd * 4
    n = round((size_gb * GB - rest) / per_expert)
    if n < 2:
        raise ValueError(f"--size-gb {size_gb:g} is too small: two experts already make "
                         f"{(rest + 2 * per_expert) / GB:.2f} GB")
    if n > MAX_EXPERTS:
        raise ValueError(f"--size-gb {size_gb:g} needs {n} experts, above llama.cpp's limit of {MAX_EXPERTS} "
                         f"({(rest + MAX_EXPERTS * per_expert) / GB:.1f} GB)")
    return n


def check_args(experts: int, top_k: int) -> None:
    """Refuse a shape llama.cpp cannot load, before any work is done."""
    if not 2 <= experts <= MAX_EXPERTS:
        raise ValueError(f"experts must be in 2..{MAX_EXPERTS} (llama.cpp's LLAMA_MAX_EXPERTS)")
    if not 1 <= top_k <= experts:
        raise ValueError("top_k must be in 1..experts")


def _copy_fields(reader: gguf.GGUFReader, w: gguf.GGUFWriter, experts: int, top_k: int) -> None:
    skip = {gguf.Keys.General.ARCHITECTURE, f"{ARCH}.expert_count", f"{ARCH}.expert_used_count"}
    for field in reader.fields.values():
        if field.name in skip or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.NAME:
            value = f"{value} bmoe-demo MoE {experts}x top-{top_k} r{RECIPE}"
        w.add_key_value(field.name, value, vtype, sub_type=sub)
    w.add_uint32(f"{ARCH}.expert_count", experts)
    w.add_uint32(f"{ARCH}.expert_used_count", top_k)


def write(src: Path, out: Path, experts: int, top_k: int, routers: list[np.ndarray],
          say: Callable[[str], None]) -> None:
    """Write the MoE file made from `src` and one router per layer to `out`, reporting progress to `say`."""
    reader = gguf.GGUFReader(src)
    n_embd = _int_field(reader, f"{ARCH}.embedding_length")
    n_ff = _int_field(reader, f"{ARCH}.feed_forward_length")
    by_name = {t.name: t for t in reader.tensors}
    per = _expert_tensor_bytes(n_embd, n_ff)

    w = gguf.GGUFWriter(out, ARCH)
    _copy_fields(reader, w, experts, top_k)
    plan: list[tuple[str, gguf.ReaderTensor | int]] = []  # ("copy", tensor) or ("layer", index) in file order
    seen: set[int] = set()
    total = 0
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            layer = int(parts[1])
            if layer in seen:
                continue
            seen.add(layer)
            p = f"blk.{layer}."
            w.add_tensor_info(p + "ffn_gate_inp.weight", (experts, n_embd), np.dtype(np.float32), experts * n_embd * 4)
            for kind, shape in (("gate", (experts, n_ff, n_embd)), ("up", (experts, n_ff, n_embd)),
                                ("down", (experts, n_embd, n_ff))):
                w.add_tensor_info(p + f"ffn_{kind}_exps.weight", shape, np.dtype(np.float32),
                                  experts * per, raw_dtype=Q8)
            plan.append(("layer", layer))
            total += experts * n_embd * 4 + 3 * experts * per
        else:
            w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
            plan.append(("copy", t))
            total += int(t.n_bytes)
    if len(seen) != len(routers):
        raise RuntimeError(f"{src} has a dense FFN in {len(seen)} layers but {len(routers)} routers were made")

    state = {"done": 0, "last": 0.0, "t0": time.monotonic()}

    def tick(n: int) -> None:
        state["done"] += n
        now = time.monotonic()
        if now - state["last"] >= 1.0 or state["done"] == total:
            state["last"] = now
            say(f"writing: {state['done'] / GB:.2f}/{total / GB:.2f} GB "
                f"({100 * state['done'] // total}%) {now - state['t0']:.0f}s")

    try:
        _write_data(w, reader, plan, by_name, routers, experts, top_k, per, tick)
    finally:
        w.close()


def _write_data(w: gguf.GGUFWriter, reader: gguf.GGUFReader, plan: list[tuple[str, gguf.ReaderTensor | int]],
                by_name: dict[str, gguf.ReaderTensor], routers: list[np.ndarray], experts: int, top_k: int,
                per: int, tick: Callable[[int], None]) -> None:
    """Header, then every tensor in plan order; each layer's FFN is quantized once and its
    expert copies written one at a time."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for kind, item in plan:
        if kind == "copy":
            assert isinstance(item, gguf.ReaderTensor)
            w.write_tensor_data(item.data, tensor_endianess=reader.endianess)
            tick(int(item.n_bytes))
            continue
        layer = item
        assert isinstance(layer, int)
        q = {}
        for name in ("gate", "up", "down"):
            t = by_name[f"blk.{layer}.ffn_{name}.weight"]
            q[name] = _q8(gguf.quants.dequantize(t.data, t.tensor_type))
        w.write_tensor_data(routers[layer])
        tick(routers[layer].nbytes)
        gate, up, down = q["gate"], q["up"], q["down"]
        # an _ExpertStream is an array to write_tensor_data, which reads only its nbytes and calls its tofile
        w.write_tensor_data(_ExpertStream(experts * per, experts, partial(_same, gate), tick))  # type: ignore[arg-type]
        w.write_tensor_data(_ExpertStream(experts * per, experts, partial(_same, up), tick))  # type: ignore[arg-type]
        w.write_tensor_data(_ExpertStream(experts * per, experts,  # type: ignore[arg-type]
                                          partial(sign_down, down, layer, top_k=top_k), tick))
