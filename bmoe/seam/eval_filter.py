"""The compiled filter in front of the eval hook (`_eval_filter.c`), or None where it was not built.

llama.cpp calls the eval callback on every graph node and the abort callback after every node it
computes; answered in Python, each is a GIL round trip (thousands per token on a large model).
`EvalFilter` is the C side's state, field for field: which nodes Python's hook wants, the flag that
stops the graph when Python parks an error, and how often Python's abort check is asked. The hook
(bmoe.seam.eval_hook.EvalHook) keeps every decision; the filter only spares the calls whose answer is
known to be false, so with it or without it (`BMOE_PY_HOOK=1`, or an install that could not compile
it) the graph computes the same nodes from the same bytes.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os

ABORT_CHECK_NS = 1_000_000  # Python's abort callback is asked at most once a millisecond (signals, cancels)
MAX_STEMS, STEM_LEN = 8, 48  # as in _eval_filter.c

EvalFn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)
AbortFn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)


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
    ]

    def set_stems(self, stems: list[bytes]) -> None:
        """The down-matmul inputs' names (without their "-L") Python's hook stops at."""
        if len(stems) > MAX_STEMS or any(len(s) >= STEM_LEN for s in stems):
            raise RuntimeError(f"down-input names {stems} do not fit the compiled filter's table")
        for i, s in enumerate(stems):
            self.stems[i].value = s
        self.n_stems = len(stems)


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
    if not hasattr(lib, "bmoe_filter_offset"):
        return "it exports no field offsets"
    lib.bmoe_filter_offset.argtypes = [ctypes.c_char_p]
    lib.bmoe_filter_offset.restype = ctypes.c_long
    lib.bmoe_filter_size.restype = ctypes.c_size_t
    for name, *_ in EvalFilter._fields_:
        c, mirror = lib.bmoe_filter_offset(name.encode()), getattr(EvalFilter, name).offset
        if c != mirror:
            return f"its field {name} is at offset {c}, the mirror's at {mirror}"
    if lib.bmoe_filter_size() != ctypes.sizeof(EvalFilter):
        return f"its struct has {lib.bmoe_filter_size()} bytes, the mirror {ctypes.sizeof(EvalFilter)}"
    return None
