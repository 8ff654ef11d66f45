"""Per-call costs of the pieces of the eval hook's path, best of 7 (timeit), no model: a ctypes C→Python
callback, the hook's body for a node it does not stop at, the routed ids read and written through a
ggml_tensor mirror, np.unique, the slot table lookup, one msgpack order, a pipe write and read, a
zero-timeout select.

    python bench/reports/2026-12-03-real-shape-baseline/tools/hook_micro.py
"""

from __future__ import annotations

import ctypes
import os
import select
import sys
import timeit
from pathlib import Path

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from bmoe.seam import graph  # noqa: E402


def best(fn, n: int = 20000) -> float:
    """µs per call, best of 7."""
    return min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6


def main() -> int:
    ids_buf = np.zeros(16, dtype=np.int32)
    ids_buf[:8] = [5, 9, 1, 77, 3, 100, 42, 8]
    node = graph.GgmlTensor()
    node.ne[0], node.ne[1] = 8, 1
    node.nb[0], node.nb[1] = 4, 64
    node.data = ids_buf.ctypes.data
    node.name = b"ffn_moe_topk-7"
    addr = ctypes.addressof(node)
    other = graph.GgmlTensor()
    other.name = b"attn_norm-12"
    oaddr = ctypes.addressof(other)
    hook = graph.EvalHook()

    class NoStops:  # what the hook consults at a node that is not a MoE stop
        down_nodes: dict = {}
        router_input = False
    hook.stops = NoStops()  # type: ignore[assignment]
    libc = ctypes.CDLL(None)
    cmp_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    calls = [0]

    def cmp(_a: int, _b: int) -> int:
        calls[0] += 1
        return 0
    ccmp = cmp_type(cmp)
    arr = (ctypes.c_int * 1024)()
    per_sort = min(timeit.repeat(lambda: libc.qsort(arr, 1024, 4, ccmp), number=20, repeat=5)) / 20
    calls[0] = 0
    libc.qsort(arr, 1024, 4, ccmp)
    ids = graph.routing_ids(addr)
    table = np.arange(128, dtype=np.int32)
    order = [17, [[0, 123 * 4096, 888832, 4096 * 99, 885152]]]
    r, w = os.pipe()
    rows = [
        ("a ctypes C->Python callback (qsort comparator)", per_sort / calls[0] * 1e6),
        ("EvalHook._callback body, a node it does not stop at", best(lambda: hook._callback(oaddr, True, 0))),
        ("ctypes.string_at(name, 13)", best(lambda: ctypes.string_at(oaddr + graph.NAME_OFFSET, 13))),
        ("graph.routing_ids ([1, 8] ids copied)", best(lambda: graph.routing_ids(addr))),
        ("graph.write_ids", best(lambda: graph.write_ids(addr, ids))),
        ("np.unique(ids).tolist()", best(lambda: np.unique(ids).tolist())),
        ("slot table lookup table[ids] + min()", best(lambda: table[ids].min())),
        ("msgpack.packb(one read order)", best(lambda: msgpack.packb(order))),
        ("os.write(pipe, 40 B) + os.read", best(lambda: (os.write(w, bytes(40)), os.read(r, 64)))),
        ("select.select([pipe], [], [], 0)", best(lambda: select.select([r], [], [], 0))),
    ]
    print("| piece | µs per call |\n|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
