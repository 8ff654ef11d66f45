"""The one place bmoe touches llama.cpp's internals through ctypes.

Every assumption made here (struct layout, op codes, node names, the strided
routing-id view, who reads the routed ids and in which order, the F32 rows a
`NodeTap` copies) is pinned by
tests/test_seam.py against the pinned llama-cpp-python build, so a version bump
that breaks one fails loudly; the graph facts the remap needs are also checked
on every model at load (`Capture`), so a model whose graph differs is refused.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import llama_cpp
import numpy as np
from llama_cpp._ggml import libggml

from bmoe.seam import eval_filter

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64


class GgmlTensor(ctypes.Structure):
    """Mirror of `struct ggml_tensor` (ggml/include/ggml.h)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


NAME_OFFSET = GgmlTensor.name.offset
WEIGHTS_PREFIX = b"ffn_moe_weigh"  # ffn_moe_weights-L (and its _softmax/_sum/_norm/_scaled nodes)
DOWN_INPUT_PREFIX = b"ffn_moe_"  # every down-matmul input seen so far (swiglu, swiglu_oai, ...)
LOGITS_PREFIX = b"ffn_moe_logi"  # ffn_moe_logits-L: the router matmul; its src[1] is the router input
_EXPERT_NAME = re.compile(r"^blk\.(\d+)\.(ffn_\w+_exps)\.weight$")
_BIAS_NAME = re.compile(r"^blk\.(\d+)\.(ffn_\w+_exps)\.bias$")
_SCALE_NAME = re.compile(r"^blk\.(\d+)\.(ffn_\w+_exps)\.scale$")
_TOPK_NAME = re.compile(r"^ffn_moe_topk-(\d+)$")
_WEIGHTS_NAME = re.compile(r"^ffn_moe_weights-(\d+)$")
_LOGITS_NAME = re.compile(r"^ffn_moe_logits-(\d+)$")
_NORM_NAME = re.compile(r"^ffn_moe_weights_(norm|softmax)-(\d+)$")
# the nodes that say how a layer routes (build_moe_ffn): its gating op, a selection bias, a group limit,
# weights multiplied into the experts' input (llama4)
_GATING_NAME = re.compile(r"^ffn_moe_(probs|probs_biased|group_topk|weighted)-(\d+)$")
# how a layer turns its gathered router weights into the experts' weights (build_moe_ffn): divided by
# their sum (`ffn_moe_weights_norm-L`), a softmax over them (`ffn_moe_weights_softmax-L`: the weights
# node then holds logits), or used as gathered
NORM_SUM, NORM_SOFTMAX, NORM_NONE = "sum", "softmax", "none"
ABORTED = 2  # llama_decode's return code when the abort callback stopped the graph

libggml.ggml_op_name.argtypes = [ctypes.c_int]
libggml.ggml_op_name.restype = ctypes.c_char_p
libggml.ggml_get_name.argtypes = [ctypes.c_void_p]
libggml.ggml_get_name.restype = ctypes.c_void_p
libggml.ggml_get_data.argtypes = [ctypes.c_void_p]
libggml.ggml_get_data.restype = ctypes.c_void_p
libggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
libggml.ggml_nbytes.restype = ctypes.c_size_t
libggml.ggml_tensor_overhead.argtypes = []
libggml.ggml_tensor_overhead.restype = ctypes.c_size_t
libggml.ggml_get_unary_op.argtypes = [ctypes.c_void_p]
libggml.ggml_get_unary_op.restype = ctypes.c_int
libggml.ggml_unary_op_name.argtypes = [ctypes.c_int]
libggml.ggml_unary_op_name.restype = ctypes.c_char_p


def op_code(name: str) -> int:
    """Look an op code up by asking ggml for its names, not by counting the enum by hand."""
    for i in range(1024):
        got = libggml.ggml_op_name(i)
        if got is None:
            break
        if got.decode() == name:
            return i
    raise RuntimeError(f"ggml has no op named {name!r}; the pinned llama-cpp-python changed")


GGML_OP_MUL_MAT_ID = op_code("MUL_MAT_ID")
GGML_OP_ADD_ID = op_code("ADD_ID")
GGML_OP_GET_ROWS = op_code("GET_ROWS")
GGML_OP_VIEW = op_code("VIEW")
GGML_OP_REPEAT = op_code("REPEAT")
GGML_OP_UNARY = op_code("UNARY")


def op_of(addr: int) -> str:
    """A node's op by ggml's name, a unary op's by its own (SIGMOID, not UNARY)."""
    t = tensor_at(addr)
    if t.op == GGML_OP_UNARY:
        return (libggml.ggml_unary_op_name(libggml.ggml_get_unary_op(addr)) or b"?").decode()
    return (libggml.ggml_op_name(t.op) or b"?").decode()


def tensor_at(addr: int) -> GgmlTensor:
    return GgmlTensor.from_address(addr)


def tensor_name(addr: int) -> str:
    return ctypes.string_at(addr + NAME_OFFSET).decode(errors="replace")


def _ids_view(t: GgmlTensor) -> np.ndarray:
    """The [n_tokens, n_expert_used] int32 ids of a `ffn_moe_topk-L` node, in place.

    The node is a view into a wider argsort result, so rows are nb[1] bytes
    apart rather than n_expert_used*4: a flat read would return wrong experts.
    """
    k, n_tok = int(t.ne[0]), int(t.ne[1])
    row = int(t.nb[1])
    if n_tok == 0 or k == 0:
        return np.zeros((0, k), dtype=np.int32)
    span = row * (n_tok - 1) + k * 4
    # (the ndarray constructor over the node's bytes: a third of as_strided's cost, once per MoE layer)
    buf = (ctypes.c_char * span).from_address(t.data)
    return np.ndarray((n_tok, k), np.int32, buf, 0, (row, int(t.nb[0])))  # type: ignore[arg-type]


def routing_ids(addr: int) -> np.ndarray:
    """Copy the [n_tokens, n_expert_used] ids of a `ffn_moe_topk-L` node."""
    return _ids_view(tensor_at(addr)).copy()


def write_ids(addr: int, ids: np.ndarray) -> None:
    """Overwrite a `ffn_moe_topk-L` node's ids in place (same shape as `routing_ids` gave)."""
    _ids_view(tensor_at(addr))[...] = ids


def _f32_block(t: GgmlTensor, rows: int, cols: int, what: str) -> np.ndarray:
    if t.type != 0 or int(t.nb[0]) != 4 or int(t.nb[1]) != 4 * int(t.ne[0]) or int(t.ne[0]) * int(t.ne[1]) != cols \
            or int(t.nb[2]) != 4 * cols or int(t.ne[2]) != rows:
        raise RuntimeError(f"{what} is not a contiguous F32 [1, {cols}, {rows}] tensor")
    return np.ctypeslib.as_array((ctypes.c_float * (rows * cols)).from_address(t.data)).reshape(rows, cols)


def moe_weights(addr: int) -> np.ndarray:
    """The [n_tokens, n_expert_used] F32 router weights of a `ffn_moe_weights-L` node, in place (writable):
    what the layer's normalisation (`NORM_*`) reads once this node's ask=False call returns."""
    t = tensor_at(addr)
    return _f32_block(t, int(t.ne[2]), int(t.ne[1]), tensor_name(addr))


def router_scores(addr: int) -> np.ndarray:
    """The [n_tokens, n_expert] F32 router scores every expert got (probabilities, or logits where the
    layer's normalisation is NORM_SOFTMAX) that a `ffn_moe_weights-L` node gathers from (its src[0]), in place."""
    t = tensor_at(addr)
    src = tensor_at(t.src[0])
    return _f32_block(src, int(t.ne[2]), int(src.ne[0]) * int(src.ne[1]), f"the router scores of {tensor_name(addr)}")


def f32_rows(addr: int, what: str = "") -> np.ndarray:
    """Copy an F32 node's [n_tokens, n_embd] rows (ne[0] floats each, nb[1] bytes apart)."""
    t = tensor_at(addr)
    n_embd, n_tok = int(t.ne[0]), int(t.ne[1])
    if t.type != 0 or int(t.nb[0]) != 4:  # GGML_TYPE_F32, contiguous rows
        raise RuntimeError(f"{what or tensor_name(addr)} is not an F32 row-major tensor")
    row = int(t.nb[1])
    buf = (ctypes.c_char * (row * (n_tok - 1) + n_embd * 4)).from_address(t.data)
    raw = np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]  # a ctypes array is a buffer
    return np.lib.stride_tricks.as_strided(raw.view(np.float32)[:1], shape=(n_tok, n_embd),
                                           strides=(row, 4)).copy()


def router_input(addr: int) -> np.ndarray:
    """Copy the F32 [n_tokens, n_embd] hidden state a `ffn_moe_logits-L` matmul multiplies."""
    return f32_rows(tensor_at(addr).src[1], f"router input of {tensor_name(addr)}")


def last_router_input(addr: int) -> tuple[int, int, int]:
    """(address, n_embd, n_tokens) of the last token's F32 router input of a `ffn_moe_logits-L` node."""
    src = tensor_at(tensor_at(addr).src[1])
    if src.type != 0 or int(src.nb[0]) != 4:
        raise RuntimeError(f"router input of {tensor_name(addr)} is not an F32 row-major tensor")
    n_tok = int(src.ne[1])
    return src.data + int(src.nb[1]) * (n_tok - 1), int(src.ne[0]), n_tok


def _layer_of(cache: dict[bytes, int | None], name: bytes, rx: re.Pattern[str]) -> int | None:
    if name not in cache:
        m = rx.match(name.decode(errors="replace"))
        cache[name] = int(m.group(1)) if m else None
    return cache[name]


@dataclass
class ExpertTensor:
    """One `blk.L.ffn_*_exps.weight` tensor as llama.cpp holds it."""

    addr: int
    name: str
    layer: int
    kind: str
    n_expert: int
    expert_bytes: int
    data: int  # llama.cpp's own experts, in its mapping of the model file

    @property
    def nbytes(self) -> int:
        return self.n_expert * self.expert_bytes

    def bind_file(self) -> None:
        """Point llama.cpp back at its own mapping of the file, as it loaded the tensor."""
        self.rebind(self.data, self.expert_bytes, self.n_expert)

    def rebind(self, data_addr: int, stride: int, n_slots: int) -> None:
        """Point llama.cpp at a pool of `n_slots` slots: slot s at data_addr + s * stride.

        ggml's CPU mul_mat_id reads expert i at data + i * nb[2] for i < ne[2] (`n_as`); it sizes
        its per-call bookkeeping from ne[2], and nothing else reads an expert tensor."""
        t = tensor_at(self.addr)
        t.data = data_addr
        t.ne[2] = n_slots
        t.nb[2] = stride
        t.nb[3] = stride * n_slots


@dataclass
class ExpertBias:
    """One `blk.L.ffn_*_exps.bias` tensor (gpt-oss): F32 rows [n_out, n_expert], row e added by
    ggml_add_id to the matmul output of the token routed to expert e. ggml_add_id reads the tensor
    itself when it computes, so it may be rebound at any time (`graph_fixed` False)."""

    addr: int
    name: str
    layer: int
    kind: str
    data: int  # llama.cpp's own rows, in the model file's mapping
    n_expert: int
    row_bytes: int
    graph_fixed: ClassVar[bool] = False

    def rows(self) -> np.ndarray:
        """The file's rows, one per expert (read-only, no copy)."""
        buf = (ctypes.c_char * (self.n_expert * self.row_bytes)).from_address(self.data)
        # a ctypes array is a buffer (numpy's stubs do not know it)
        return np.frombuffer(buf, dtype=np.float32).reshape(self.n_expert,  # type: ignore[call-overload]
                                                            self.row_bytes // 4)

    def rebind(self, data_addr: int, n_rows: int) -> None:
        """Point ggml_add_id at `n_rows` rows from data_addr (it reads row i at data + i * nb[1], i < ne[1])."""
        t = tensor_at(self.addr)
        t.data = data_addr
        t.ne[1] = n_rows
        t.nb[2] = t.nb[3] = self.row_bytes * n_rows


@dataclass
class ExpertScale:
    """One `blk.L.ffn_*_exps.scale` tensor (gemma4's down scale): F32 [n_expert], the matmul output of
    the token routed to expert e multiplied by element e. llama.cpp gathers it as
    GET_ROWS(REPEAT(RESHAPE(scale) -> [1, n_expert, n_tokens]), ids) (build_lora_mm_id): the REPEAT's
    row count and the RESHAPE's data pointer are taken when the graph is built, so the scale is bound
    to its pool once, before the graphs that stream are built (bmoe.seam.llama.rebuild_graphs), and a
    layer with one always reads through the remapped slot ids (`graph_fixed`)."""

    addr: int
    name: str
    layer: int
    kind: str  # "ffn_down_exps.scale": its own pools, apart from a bias of the same experts
    data: int
    n_expert: int
    row_bytes: int = 4
    graph_fixed: ClassVar[bool] = True

    def rows(self) -> np.ndarray:
        """The file's elements as [n_expert, 1] rows (read-only, no copy)."""
        buf = (ctypes.c_char * (self.n_expert * 4)).from_address(self.data)
        return np.frombuffer(buf, dtype=np.float32).reshape(self.n_expert, 1)  # type: ignore[call-overload]

    def rebind(self, data_addr: int, n_rows: int) -> None:
        """Point the scale at `n_rows` elements from data_addr (only before the graphs are built)."""
        t = tensor_at(self.addr)
        t.data = data_addr
        t.ne[0] = n_rows
        t.nb[1] = t.nb[2] = t.nb[3] = 4 * n_rows


@dataclass
class Capture:
    """What one warm-up decode reveals: expert tensors, the layers that route, and whether the
    routed ids may be overwritten with slot indices.

    Every node is visited in graph order (the ask=True calls). For the remap, each layer's
    `ffn_moe_weights-L` must be a GET_ROWS of its `ffn_moe_topk-L` ids computed before any
    matmul that reads them, and nothing but those matmuls, the ADD_IDs of expert biases, the
    GET_ROWS of a per-expert scale (REPEAT of a reshaped `blk.L.ffn_*_exps.scale`) and that GET_ROWS
    may read the ids (or the argsort they view); anything else lands in `bad`.
    """

    tensors: dict[int, ExpertTensor] = field(default_factory=dict)
    biases: dict[int, ExpertBias] = field(default_factory=dict)
    scales: dict[int, ExpertScale] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)
    down_inputs: dict[bytes, int] = field(default_factory=dict)  # node name -> layer
    # layer -> its expert matmuls' kinds in the order computed, and the name of its gate matmul node
    matmul_order: dict[int, list[str]] = field(default_factory=dict)
    gate_nodes: dict[int, bytes] = field(default_factory=dict)
    weights_at: dict[int, int] = field(default_factory=dict)  # layer -> position of ffn_moe_weights-L
    ids_nodes: dict[int, int] = field(default_factory=dict)  # address of ffn_moe_topk-L (and its argsort) -> layer
    norms: dict[int, str] = field(default_factory=dict)  # layer -> NORM_SUM or NORM_SOFTMAX (absent: NORM_NONE)
    # layer -> how it routes: "probs" -> the gating node's op (SOFT_MAX, SIGMOID, SQRT of a SOFTPLUS, ...),
    # "probs_biased"/"group_topk" present with a selection bias / group limit, "weighted" "input" where the
    # weights scale the experts' input (llama4), "topk" the ids node's op (GET_ROWS: a hash layer's table)
    gating: dict[int, dict[str, str]] = field(default_factory=dict)
    seen: int = 0
    dry: bool = True  # stop the graph at its first computed node: the nodes are known, the compute not needed

    def visit(self, addr: int) -> None:
        t = tensor_at(addr)
        self.seen += 1
        name = tensor_name(addr)
        mg = _GATING_NAME.match(name)
        if mg:
            layer = int(mg.group(2))
            first = not any(x.layer == layer for x in self.tensors.values())
            self.gating.setdefault(layer, {})[mg.group(1)] = (
                ("input" if first else "output") if mg.group(1) == "weighted" else op_of(addr))
        mt = _TOPK_NAME.match(name)
        if mt:
            self.gating.setdefault(int(mt.group(1)), {})["topk"] = op_of(addr)
            self.ids_nodes[addr] = int(mt.group(1))
            if t.op == GGML_OP_VIEW and t.src[0]:
                self.ids_nodes[t.src[0]] = int(mt.group(1))
            return
        mn = _NORM_NAME.match(name)
        if mn:
            self.norms[int(mn.group(2))] = NORM_SUM if mn.group(1) == "norm" else NORM_SOFTMAX
        srcs = [s for s in t.src if s]
        read = [self.ids_nodes[s] for s in srcs if s in self.ids_nodes]
        if t.op == GGML_OP_MUL_MAT_ID:
            self._matmul(t, name.encode())
        elif t.op == GGML_OP_ADD_ID and t.src[2] in self.ids_nodes:
            self._bias(t)
        elif read:
            mw = _WEIGHTS_NAME.match(name)
            if mw and t.op == GGML_OP_GET_ROWS and t.src[1] in self.ids_nodes \
                    and int(mw.group(1)) == self.ids_nodes[t.src[1]]:
                self.weights_at[int(mw.group(1))] = self.seen
            elif t.op == GGML_OP_GET_ROWS and t.src[1] in self.ids_nodes and t.src[0] not in self.ids_nodes:
                self._scale(t, name)
            else:
                self.bad.append(_id_reader(t, name, read[0]))

    def _matmul(self, t: GgmlTensor, node: bytes) -> None:
        w, ids = t.src[0], t.src[2]
        if not w:
            return
        wname, iname = tensor_name(w), tensor_name(ids) if ids else ""
        m, mi = _EXPERT_NAME.match(wname), _TOPK_NAME.match(iname)
        if not m or not mi or m.group(1) != mi.group(1):
            self.bad.append(f"an expert matmul of {wname} routed by {iname or '?'}, not a blk.L.ffn_*_exps.weight "
                            "routed by its layer's ffn_moe_topk-L")
            return
        layer = int(m.group(1))
        kinds = self.matmul_order.setdefault(layer, [])
        if m.group(2) not in kinds:
            kinds.append(m.group(2))
            if m.group(2) == "ffn_gate_exps":
                self.gate_nodes[layer] = node
        if layer not in self.weights_at:
            self.bad.append(f"{wname} is multiplied before ffn_moe_weights-{layer} gathered the router weights")
        if w in self.tensors:
            return
        wt = tensor_at(w)
        if wt.view_src or int(wt.nb[2]) * int(wt.ne[2]) != libggml.ggml_nbytes(w):
            self.bad.append(f"{wname} is not a contiguous [*, *, n_expert] tensor")
            return
        self.tensors[w] = ExpertTensor(
            addr=w, name=wname, layer=layer, kind=m.group(2),
            n_expert=int(wt.ne[2]), expert_bytes=int(wt.nb[2]), data=int(wt.data),
        )
        if m.group(2) == "ffn_down_exps" and t.src[1]:
            # the down matmul's input: under --overlap the down slices are awaited there
            name = ctypes.string_at(t.src[1] + NAME_OFFSET)
            if name.startswith(DOWN_INPUT_PREFIX) and name.endswith(f"-{m.group(1)}".encode()):
                self.down_inputs[name] = layer

    def wait_nodes(self) -> dict[bytes, int]:
        """Where overlapped reads are awaited: node name -> wait key. The down matmul's input awaits the
        layer's down slices (key 2L + 1); where a layer multiplies its gate experts before its up experts
        (llama.cpp's graph does, separate gate and up tensors), its gate matmul awaits the up slices
        (key 2L), so they are read while the gate matmul computes."""
        waits = {name: 2 * layer + 1 for name, layer in self.down_inputs.items()}
        for layer, kinds in self.matmul_order.items():
            gate = self.gate_nodes.get(layer, b"")
            if kinds[:2] == ["ffn_gate_exps", "ffn_up_exps"] and gate.startswith(DOWN_INPUT_PREFIX):
                waits[gate] = 2 * layer
        return waits

    def _scale(self, t: GgmlTensor, name: str) -> None:
        """A GET_ROWS of the ids that is not the router weights': only a per-expert scale's, gathered
        from the REPEAT of its reshaped [n_expert] F32 tensor, may read them."""
        layer = self.ids_nodes[t.src[1]]
        rep = tensor_at(t.src[0])
        shaped = tensor_at(rep.src[0]) if rep.op == GGML_OP_REPEAT and rep.src[0] else None
        w: int = (shaped.view_src or shaped.src[0] or 0) if shaped is not None else 0
        m = _SCALE_NAME.match(tensor_name(w)) if w else None
        st = tensor_at(w) if w else None
        if m is None or st is None or int(m.group(1)) != layer or st.type != 0 or st.view_src \
                or int(st.ne[1]) * int(st.ne[2]) * int(st.ne[3]) != 1 or int(st.nb[0]) != 4 \
                or int(rep.ne[1]) != int(st.ne[0]):
            self.bad.append(_id_reader(t, name, layer))
            return
        if w not in self.scales:
            self.scales[w] = ExpertScale(addr=w, name=tensor_name(w), layer=layer, kind=m.group(2) + ".scale",
                                         data=st.data, n_expert=int(st.ne[0]))

    def _bias(self, t: GgmlTensor) -> None:
        b = t.src[1]
        bname = tensor_name(b) if b else "?"
        m = _BIAS_NAME.match(bname)
        bt = tensor_at(b) if b else None
        if not m or bt is None or int(m.group(1)) != self.ids_nodes[t.src[2]] or bt.type != 0 or bt.view_src \
                or int(bt.ne[2]) != 1 or int(bt.nb[1]) != int(bt.ne[0]) * 4:
            self.bad.append(f"expert bias {bname} is not a contiguous F32 [n, n_expert] tensor of its layer")
            return
        if b not in self.biases:
            self.biases[b] = ExpertBias(addr=b, name=bname, layer=int(m.group(1)), kind=m.group(2), data=bt.data,
                                        n_expert=int(bt.ne[1]), row_bytes=int(bt.nb[1]))


def _id_reader(t: GgmlTensor, name: str, layer: int) -> str:
    """What `Capture.bad` says of a node the remap cannot serve: the missing piece, in one phrase."""
    op = (libggml.ggml_op_name(t.op) or b"?").decode()
    return (f"its {op} node '{name}' reads layer {layer}'s routed expert ids, and the slot remap serves only "
            "expert matmuls, expert biases, per-expert scales and the router weights (the remap would change it)")


_decoding: EvalHook | None = None


def deliver(exc: BaseException) -> None:
    """Raise `exc` from a signal handler without losing it inside llama.cpp.

    A Python signal handler runs at whatever Python frame comes next — during a
    decode that is one of the ctypes callbacks, where ctypes would print and
    swallow the exception. So while a decode runs the exception is parked on the
    hook, the abort callback stops the graph, and `_decode` raises it.
    """
    if _decoding is not None:
        _decoding.error = exc
    else:
        raise exc


class StopListener(Protocol):
    """What the eval hook calls at the nodes where it stops the graph (bmoe.engine.graph_stops implements it).

    `wait_nodes` maps the node names where overlapped reads are awaited to their wait key
    (Capture.wait_nodes: a layer's gate matmul for its up slices, its down matmul's input for its down
    slices; empty: no stop there); `router_input` says whether to stop at each layer's router input
    (`ffn_moe_logits-L`).
    """

    wait_nodes: dict[bytes, int]
    router_input: bool

    def skip_route(self, layer: int) -> bool: ...

    def reroute(self, layer: int, ids: np.ndarray, node: int) -> None: ...

    def on_route(self, layer: int, ids: np.ndarray) -> None: ...

    def slot_ids(self, layer: int, ids: np.ndarray) -> np.ndarray: ...

    def on_router_input(self, layer: int, node: int) -> None: ...

    def wait_pending(self, key: int) -> bool: ...

    def on_wait(self, key: int) -> None: ...


class EvalHook:
    """The cb_eval trampoline.

    In capture mode it records expert tensors; in stream mode (`stops` set) it asks for each MoE
    layer's `ffn_moe_weights-L` node (the router weights gathered with the real expert ids) and,
    in its ask=False call, before any expert matmul reads the ids, calls `stops.reroute(layer, ids,
    node)` (lossy routing may change the ids and the weights at the node, bmoe.streaming.lossy), then
    `stops.on_route(layer, ids)` and overwrites the routed ids in place with
    `stops.slot_ids(layer, ids)`; a layer
    for which `stops.skip_route(layer)` is True runs without stopping (its tensors then read the
    experts by their own ids). With `stops.router_input` it also hands over each layer's router
    input; at a node of `stops.wait_nodes` whose `wait_pending(key)` is true it stops and calls
    `on_wait(key)` once the node is computed, before the next matmul runs (under --overlap a layer's
    up slices are awaited after its gate matmul, its down slices at the down matmul's input).
    Exceptions (including KeyboardInterrupt from a signal) are kept and the
    graph aborted: ctypes would otherwise swallow them and let llama.cpp compute on.
    """

    def __init__(self) -> None:
        self._capture: Capture | None = None
        self._stops: StopListener | None = None
        self._error: BaseException | None = None
        self._layers: dict[bytes, int | None] = {}
        self.py_callback = llama_cpp.ggml_backend_sched_eval_callback(self._callback)
        self.py_abort = llama_cpp.ggml_abort_callback(self._abort)
        # llama.cpp calls these on every node: the compiled filter (bmoe.seam.eval_filter) answers those
        # whose answer is known and hands the rest to the two above; without it, they are called directly
        self.filter_lib = eval_filter.compiled()
        self.filter: eval_filter.EvalFilter | None = None
        self.c_callback: object = self.py_callback
        self.c_abort: object = self.py_abort
        self.user_data: int | None = None
        if self.filter_lib is not None:
            f = self.filter = eval_filter.EvalFilter()
            f.forward = ctypes.cast(self.py_callback, eval_filter.EvalFn)
            f.forward_abort = ctypes.cast(self.py_abort, eval_filter.AbortFn)
            f.abort_ns, f.name_offset = eval_filter.ABORT_CHECK_NS, NAME_OFFSET
            self.c_callback = ctypes.cast(self.filter_lib.bmoe_eval_filter, llama_cpp.ggml_backend_sched_eval_callback)
            self.c_abort = ctypes.cast(self.filter_lib.bmoe_abort_filter, llama_cpp.ggml_abort_callback)
            self.user_data = ctypes.addressof(f)

    # what the filter needs to know, kept in step with the hook's own state

    @property
    def error(self) -> BaseException | None:
        """An exception parked during a decode (raised by `run` once llama_decode returns); while one
        is parked, every callback answers so that the graph stops."""
        return self._error

    @error.setter
    def error(self, exc: BaseException | None) -> None:
        self._error = exc
        if self.filter is not None:
            self.filter.stop = exc is not None

    @property
    def capture(self) -> Capture | None:
        """The warm-up capture under way: every node is visited (a dry one stops at the first computed)."""
        return self._capture

    @capture.setter
    def capture(self, cap: Capture | None) -> None:
        self._capture = cap
        if self.filter is not None:
            self.filter.every = cap is not None
            self.filter.halt = cap is not None and cap.dry

    @property
    def stops(self) -> StopListener | None:
        """The streaming run's listener at the graph's stops (None: nothing stops)."""
        return self._stops

    @stops.setter
    def stops(self, stops: StopListener | None) -> None:
        self._stops = stops
        if self.filter is not None:
            self.filter.routing = stops is not None
            self.filter.router_input = stops is not None and stops.router_input
            self.filter.set_stems(sorted({name.rsplit(b"-", 1)[0] for name in stops.wait_nodes}) if stops else [])

    def _callback(self, t: int, ask: bool, _user: int) -> bool:
        try:
            if self.error is not None:
                return False
            if self.capture is not None:
                if ask:
                    self.capture.visit(t)
                return False
            stops = self.stops
            if stops is None:
                return False
            prefix = ctypes.string_at(t + NAME_OFFSET, 13)
            if prefix == WEIGHTS_PREFIX:
                layer = _layer_of(self._layers, ctypes.string_at(t + NAME_OFFSET), _WEIGHTS_NAME)
                if ask:
                    # no need to stop the graph for a layer whose experts are all resident for good
                    return layer is not None and not stops.skip_route(layer)
                if layer is not None:
                    ids_node = tensor_at(t).src[1]  # ffn_moe_topk-L (Capture checked)
                    ids = routing_ids(ids_node)
                    stops.reroute(layer, ids, t)
                    stops.on_route(layer, ids)
                    write_ids(ids_node, stops.slot_ids(layer, ids))
                return True
            if stops.router_input and prefix[:12] == LOGITS_PREFIX:
                if ask:
                    return True
                layer = _layer_of(self._layers, ctypes.string_at(t + NAME_OFFSET), _LOGITS_NAME)
                if layer is not None:
                    stops.on_router_input(layer, t)
                if self.filter is not None:
                    self.filter.router_input = stops.router_input  # (the recall governor may have turned it off)
                return True
            if stops.wait_nodes and prefix[:8] == DOWN_INPUT_PREFIX:
                key = stops.wait_nodes.get(ctypes.string_at(t + NAME_OFFSET))
                if key is None:
                    return False
                if ask:
                    return stops.wait_pending(key)
                stops.on_wait(key)
                return True
            return False
        except BaseException as e:  # noqa: BLE001 - re-raised after llama_decode returns
            self.error = e
            return False

    def _abort(self, _user: int) -> bool:
        return self.error is not None or (self.capture is not None and self.capture.dry)

    def take_error(self) -> BaseException | None:
        err, self.error = self.error, None
        return err

    def run(self, decode: Callable[[], tuple[int, list[int]]], aborts: bool = False) -> list[int]:
        """Run one llama_decode (`decode`, returning its code and rows) under this hook: an exception
        parked during it is raised, and so is a failing return code (ABORTED is expected with `aborts`)."""
        with self:
            rc, rows = decode()
        err = self.take_error()
        if err is not None:
            raise err
        if rc != 0 and not (aborts and rc == ABORTED):
            raise RuntimeError(f"llama_decode failed with code {rc}")
        return rows

    def __enter__(self) -> EvalHook:
        global _decoding
        _decoding = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _decoding
        _decoding = None


class NodeTap:
    """A cb_eval callback that copies chosen activations of a plain decode, layer by layer.

    Each node named `NAME-L` for a NAME in `names` (the whole name: views such as
    "ffn_norm-3 (reshaped)" are not it) is asked for, and once computed its F32 rows go to
    `on_rows(NAME, L, rows)` as a copy. Tools that read a model's activations use it (the demo's
    calibration reads `ffn_norm-L`, the router input of the llama graph); streaming uses
    `EvalHook`. An exception in the callback is kept in `error` (ctypes would swallow it) and
    nothing more is copied; the caller raises it once `llama_decode` returns.
    """

    def __init__(self, names: tuple[str, ...], on_rows: Callable[[str, int, np.ndarray], None]) -> None:
        self.on_rows = on_rows
        self.error: BaseException | None = None
        self._rx = re.compile(r"^(" + "|".join(map(re.escape, names)) + r")-(\d+)$")
        self._nodes: dict[bytes, tuple[str, int] | None] = {}
        self.c_callback = llama_cpp.ggml_backend_sched_eval_callback(self._callback)

    def _node(self, name: bytes) -> tuple[str, int] | None:
        if name not in self._nodes:
            m = self._rx.match(name.decode(errors="replace"))
            self._nodes[name] = (m.group(1), int(m.group(2))) if m else None
        return self._nodes[name]

    def _callback(self, t: int, ask: bool, _user: int) -> bool:
        try:
            if self.error is not None:
                return False
            node = self._node(ctypes.string_at(t + NAME_OFFSET))
            if node is None:
                return False
            if not ask:
                self.on_rows(node[0], node[1], f32_rows(t))
            return True
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller after llama_decode returns
            self.error = e
            return False


# ---- a load that maps the file without reading it -----------------------------------------------
#
# llama.cpp's loader maps each model file with MAP_POPULATE and advises WILLNEED over all of it
# (llama_model_loader::init_mappings, llama_mmap in llama-mmap.cpp): every byte is read at load,
# the experts bmoe never reads through that mapping included. It skips both when the CPU backend
# registry's `get_proc_address("ggml_backend_cpu_is_numa")` gives a function that answers true;
# the file is then mapped as is and advised MADV_RANDOM. That answer is asked for only there (the
# CPU compute code reads ggml's own NUMA state), so answering true for the duration of a load, and
# putting the registry's function back after it, changes what the load reads and nothing else.
# The registry is a writable `static struct ggml_backend_reg` in ggml-cpu.cpp; its layout is
# checked (`registry_problem`) before it is touched.

GGML_BACKEND_DEVICE_TYPE_CPU = 0  # enum ggml_backend_dev_type (ggml-backend.h)
REGISTRY_API_VERSION = 2  # GGML_BACKEND_API_VERSION (ggml-backend-impl.h) of the pinned ggml
IS_NUMA = b"ggml_backend_cpu_is_numa"

_GetName = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)
_GetProcAddress = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
_IsNuma = ctypes.CFUNCTYPE(ctypes.c_bool)


class BackendRegI(ctypes.Structure):
    """Mirror of `struct ggml_backend_reg_i` (ggml-backend-impl.h): four function pointers."""

    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("get_device_count", ctypes.c_void_p),
        ("get_device", ctypes.c_void_p),
        ("get_proc_address", ctypes.c_void_p),
    ]


class BackendReg(ctypes.Structure):
    """Mirror of `struct ggml_backend_reg` (ggml-backend-impl.h)."""

    _fields_ = [("api_version", ctypes.c_int), ("iface", BackendRegI), ("context", ctypes.c_void_p)]


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


libggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
libggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
libggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
libggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
libggml.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
libggml.ggml_backend_reg_name.restype = ctypes.c_char_p
libggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
libggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
_libc = ctypes.CDLL(None)
_libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
_libc.dladdr.restype = ctypes.c_int


def cpu_registry() -> int | None:
    """Address of the CPU backend's registry, found the way llama.cpp's loader finds it."""
    dev = libggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    return libggml.ggml_backend_dev_backend_reg(dev) if dev else None


def library_of(addr: int) -> str | None:
    """The file name of the shared library that holds code address `addr` (dladdr), or None."""
    info = _DlInfo()
    if not addr or not _libc.dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.basename(info.dli_fname.decode(errors="replace"))


def registry_problem(reg: int | None) -> str | None:
    """None when the CPU registry at `reg` is the layout bmoe knows; else what differs.

    Read before anything is called through it: the API version, then every function pointer must
    be code in ggml's CPU backend library; only then are two of them called and their answers
    compared with ggml's public accessors (name "CPU", the same `is_numa` function)."""
    if not reg:
        return "llama.cpp has no CPU backend registry"
    r = BackendReg.from_address(reg)
    if r.api_version != REGISTRY_API_VERSION:
        return f"the CPU backend registry has api_version {r.api_version}, not {REGISTRY_API_VERSION}"
    for entry in BackendRegI._fields_:
        name = entry[0]
        lib = library_of(getattr(r.iface, name))
        if lib is None or "ggml-cpu" not in lib:
            return f"the CPU backend registry's {name} is not ggml-cpu code ({lib or 'no library'})"
    if _GetName(r.iface.get_name)(reg) != libggml.ggml_backend_reg_name(reg) or \
            libggml.ggml_backend_reg_name(reg) != b"CPU":
        return "the CPU backend registry's get_name does not answer as ggml_backend_reg_name"
    mine = _GetProcAddress(r.iface.get_proc_address)(reg, IS_NUMA)
    if not mine or mine != libggml.ggml_backend_reg_get_proc_address(reg, IS_NUMA):
        return "the CPU backend registry's get_proc_address does not answer as ggml's accessor"
    return None


_no_populate_lock = threading.Lock()


@contextmanager
def no_populate() -> Iterator[str | None]:
    """While open, llama.cpp's loads in this process map model files without reading them.

    Yields None when that is in force, or why not (the registry is not the known layout): the
    load then reads the file as it always did, and the caller says so. The registry's own
    `get_proc_address` is back in place when the block ends, however it ends."""
    with _no_populate_lock:
        reg = cpu_registry()
        problem = registry_problem(reg)
        if problem is not None:
            yield problem
            return
        assert reg is not None  # registry_problem names a missing registry
        iface = BackendReg.from_address(reg).iface
        original = iface.get_proc_address
        forward = _GetProcAddress(original)
        answer_true = _IsNuma(lambda: True)
        true_addr = ctypes.cast(answer_true, ctypes.c_void_p).value

        def get_proc_address(r: int, name: bytes) -> int | None:
            return true_addr if name == IS_NUMA else forward(r, name)

        patched = _GetProcAddress(get_proc_address)
        iface.get_proc_address = ctypes.cast(patched, ctypes.c_void_p).value
        try:
            yield None
        finally:
            iface.get_proc_address = original
