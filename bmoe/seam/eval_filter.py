"""The compiled filter in front of the eval hook (`_eval_filter.c`), or None where it was not built.

llama.cpp calls the eval callback on every graph node and the abort callback after every node it
computes; answered in Python, each is a GIL round trip (thousands per token on a large model).
`EvalFilter` is the C side's state, field for field: which nodes Python's hook wants, the flag that
stops the graph when Python parks an error, and how often Python's abort check is asked. The hook
(bmoe.seam.eval_hook.EvalHook) keeps every decision but one: while Python allows it (`fast`), a routing
whose experts are all resident is answered in C from the cache's own tables (`FastLayer`) and logged
for Python to replay (`logged`). With it or without it (`BMOE_PY_HOOK=1`, or an install that could not
compile it) the graph computes the same nodes from the same bytes.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from bmoe.seam.ggml_mirror import NAME_OFFSET, GgmlTensor

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

ABORT_CHECK_NS = 1_000_000  # Python's abort callback is asked at most once a millisecond (signals, cancels)
MAX_STEMS, STEM_LEN, MAX_LAYER_TENSORS = 8, 48, 4  # as in _eval_filter.c
LOG_INTS = 4096  # the fast path's log: 48 decode routings of 8 ids take 912

EvalFn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)
AbortFn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)


@dataclass(frozen=True)
class FastTables:
    """One streamed layer's state the fast path reads: the cache's `table` (int32 slot per expert, -1: none)
    and `resident` flags (one byte per expert), the array of slots shown (`seen`, by layer) and the layer's
    expert tensors as (address, slot stride)."""

    layer: int
    table: np.ndarray
    resident: bytearray
    seen: np.ndarray
    tensors: list[tuple[int, int]]


class FastLayer(ctypes.Structure):
    """Mirror of `struct fast_layer` (_eval_filter.c): one MoE layer's tables, as the fast path reads them."""

    _fields_ = [
        ("table", ctypes.c_void_p),
        ("resident", ctypes.c_void_p),
        ("seen", ctypes.c_void_p),
        ("n_expert", ctypes.c_int32),
        ("handled", ctypes.c_int32),
        ("n_tensors", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("tensors", ctypes.c_void_p * MAX_LAYER_TENSORS),
        ("strides", ctypes.c_int64 * MAX_LAYER_TENSORS),
    ]


class EvalFilter(ctypes.Structure):
    """Mirror of `struct eval_filter` (_eval_filter.c)."""

    _fields_ = [
        ("forward", EvalFn),
        ("forward_abort", AbortFn),
        ("abort_ns", ctypes.c_int64),
        ("abort_last", ctypes.c_int64),
        ("name_offset", ctypes.c_int32),
        ("every", ctypes.c_int32),
        ("stop", ctypes.c_int32),
        ("halt", ctypes.c_int32),
        ("routing", ctypes.c_int32),
        ("router_input", ctypes.c_int32),
        ("n_stems", ctypes.c_int32),
        ("stems", (ctypes.c_char * STEM_LEN) * MAX_STEMS),
        ("fast", ctypes.c_int32),
        ("n_layers", ctypes.c_int32),
        ("layers", ctypes.POINTER(FastLayer)),
        ("src_offset", ctypes.c_int32),
        ("ne_offset", ctypes.c_int32),
        ("nb_offset", ctypes.c_int32),
        ("data_offset", ctypes.c_int32),
        ("log", ctypes.POINTER(ctypes.c_int32)),
        ("log_cap", ctypes.c_int32),
        ("log_len", ctypes.c_int32),
        ("stops_in_c", ctypes.c_int64),
    ]

    @classmethod
    def wired(cls, forward: CFuncPtr, forward_abort: CFuncPtr,
              abort_ns: int = ABORT_CHECK_NS) -> EvalFilter:
        """A filter that hands its undecided calls to these Python callbacks (ctypes callbacks: the caller keeps
        them alive) and reads ggml's tensors at the offsets of the seam's own mirror (GgmlTensor)."""
        f = cls()
        f.forward, f.forward_abort = ctypes.cast(forward, EvalFn), ctypes.cast(forward_abort, AbortFn)
        f.abort_ns, f.name_offset = abort_ns, NAME_OFFSET
        f.src_offset, f.ne_offset, f.nb_offset, f.data_offset = (getattr(GgmlTensor, name).offset
                                                                 for name in ("src", "ne", "nb", "data"))
        return f

    def set_stems(self, stems: list[bytes]) -> None:
        """The down-matmul inputs' names (without their "-L") Python's hook stops at."""
        if len(stems) > MAX_STEMS or any(len(s) >= STEM_LEN for s in stems):
            raise RuntimeError(f"down-input names {stems} do not fit the compiled filter's table")
        for i, s in enumerate(stems):
            self.stems[i].value = s
        self.n_stems = len(stems)

    def set_layers(self, tables: list[FastTables]) -> list[object]:
        """Point the fast path at these layers' tables (none: it answers nothing); returns what must stay alive
        while the filter reads them (the ctypes arrays, and views that pin the bytearrays' buffers)."""
        self.fast = 0
        if not tables:
            self.n_layers, self.layers = 0, None
            return []
        layers = (FastLayer * (max(t.layer for t in tables) + 1))()
        keep: list[object] = [layers]
        for t in tables:
            if len(t.tensors) > MAX_LAYER_TENSORS or t.table.dtype != np.int32 or t.seen.dtype != np.int32:
                raise RuntimeError(f"layer {t.layer}'s tables do not fit the compiled filter's")
            flags = (ctypes.c_uint8 * len(t.resident)).from_buffer(t.resident)
            keep.append(flags)
            fl = layers[t.layer]
            fl.table, fl.resident = t.table.ctypes.data, ctypes.addressof(flags)
            fl.seen = t.seen.ctypes.data + 4 * t.layer
            fl.n_expert, fl.n_tensors = len(t.table), len(t.tensors)
            for i, (addr, stride) in enumerate(t.tensors):
                fl.tensors[i], fl.strides[i] = addr, stride
        log = (ctypes.c_int32 * LOG_INTS)()
        keep.append(log)
        self.n_layers, self.layers = len(layers), ctypes.cast(layers, ctypes.POINTER(FastLayer))
        self.log, self.log_cap, self.log_len = ctypes.cast(log, ctypes.POINTER(ctypes.c_int32)), LOG_INTS, 0
        return keep

    def logged(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """The routings answered in C since the last call, in order: (layer, ids, the slots written), each
        [rows, k]; the log is empty again."""
        out, at, log = [], 0, self.log
        while at < self.log_len:
            layer, rows, k = log[at], log[at + 1], log[at + 2]
            n = rows * k
            flat = np.ctypeslib.as_array(log, shape=(at + 3 + 2 * n,))[at + 3:]
            out.append((layer, flat[:n].reshape(rows, k).copy(), flat[n:].reshape(rows, k).copy()))
            at += 3 + 2 * n
        self.log_len = 0
        return out


def compiled() -> ctypes.CDLL | None:
    """The built filter's library, or None: not built here, or `BMOE_PY_HOOK=1` asks for Python's."""
    if os.environ.get("BMOE_PY_HOOK") == "1":
        return None
    spec = importlib.util.find_spec("bmoe.seam._eval_filter")
    if spec is None or not spec.origin:
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.bmoe_eval_filter.restype = ctypes.c_bool
    lib.bmoe_abort_filter.restype = ctypes.c_bool
    problem = layout_problem(lib)
    if problem is not None:
        raise RuntimeError(f"{spec.origin} was built from another _eval_filter.c ({problem}); reinstall bmoe "
                           "(pip install -e .)")
    return lib


def layout_problem(lib: ctypes.CDLL) -> str | None:
    """None when the built filter's `struct eval_filter` is EvalFilter field for field (each field's offset
    by its name, then the size); else the first difference. Two fields swapped in either would have the
    filter read one flag as another, which a size check alone lets through."""
    for struct, offset, size in ((EvalFilter, "bmoe_filter_offset", "bmoe_filter_size"),
                                 (FastLayer, "bmoe_fast_layer_offset", "bmoe_fast_layer_size")):
        if not hasattr(lib, offset):
            return f"it exports no {offset}"
        getattr(lib, offset).argtypes = [ctypes.c_char_p]
        getattr(lib, offset).restype = ctypes.c_long
        getattr(lib, size).restype = ctypes.c_size_t
        for name, *_ in struct._fields_:
            c, mirror = getattr(lib, offset)(name.encode()), getattr(struct, name).offset
            if c != mirror:
                return f"its {struct.__name__} field {name} is at offset {c}, the mirror's at {mirror}"
        if getattr(lib, size)() != ctypes.sizeof(struct):
            return f"its {struct.__name__} has {getattr(lib, size)()} bytes, the mirror {ctypes.sizeof(struct)}"
    return None
