"""What one warm-up graph reveals (`Capture`): the expert tensors and the per-expert biases and
scales llama.cpp multiplies, which layers route and how, and whether the routed ids may be overwritten
with slot indices; and those tensors as bmoe rebinds them to pools of slots (`ExpertTensor`,
`ExpertBias`, `ExpertScale`). The facts are checked on every model at load, so a model whose graph
differs is refused; tests/test_seam.py pins them on real graphs.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from bmoe.seam.ggml_mirror import (
    GGML_OP_ADD_ID,
    GGML_OP_GET_ROWS,
    GGML_OP_MUL_MAT_ID,
    GGML_OP_REPEAT,
    GGML_OP_VIEW,
    NAME_OFFSET,
    GgmlTensor,
    libggml,
    op_of,
    tensor_at,
    tensor_name,
)

DOWN_INPUT_PREFIX = b"ffn_moe_"  # every down-matmul input seen so far (swiglu, swiglu_oai, ...)
WEIGHTS_NAME = re.compile(r"^ffn_moe_weights-(\d+)$")
_EXPERT_NAME = re.compile(r"^blk\.(\d+)\.(ffn_\w+_exps)\.weight$")
_BIAS_NAME = re.compile(r"^blk\.(\d+)\.(ffn_\w+_exps)\.bias$")
_SCALE_NAME = re.compile(r"^blk\.(\d+)\.(ffn_\w+_exps)\.scale$")
_TOPK_NAME = re.compile(r"^ffn_moe_topk-(\d+)$")
_NORM_NAME = re.compile(r"^ffn_moe_weights_(norm|softmax)-(\d+)$")
# the nodes that say how a layer routes (build_moe_ffn): its gating op, a selection bias, a group limit,
# weights multiplied into the experts' input (llama4)
_GATING_NAME = re.compile(r"^ffn_moe_(probs|probs_biased|group_topk|weighted)-(\d+)$")
# how a layer turns its gathered router weights into the experts' weights (build_moe_ffn): divided by
# their sum (`ffn_moe_weights_norm-L`), a softmax over them (`ffn_moe_weights_softmax-L`: the weights
# node then holds logits), or used as gathered
NORM_SUM, NORM_SOFTMAX, NORM_NONE = "sum", "softmax", "none"


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


@dataclass(frozen=True)
class Scratch:
    """llama.cpp's compute buffer: `size` bytes from `base`, sized for the widest ubatch, of which a one-token
    decode's graph uses the first `used`. A wide prefill touches more; those pages stay the process's
    until given back (bmoe.seam.llama.give_back), and the next graph that needs them gets zeroed pages:
    every node of a graph is written before it is read."""

    base: int
    size: int
    used: int


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
    # buffer -> [nodes allocated there, the end of the furthest]: the compute buffer is the one most nodes use
    buffers: dict[int, list[int]] = field(default_factory=dict)

    def visit(self, addr: int) -> None:
        t = tensor_at(addr)
        self.seen += 1
        if t.buffer and not t.view_src and t.data:
            b = self.buffers.setdefault(t.buffer, [0, 0])
            b[0] += 1
            b[1] = max(b[1], t.data + libggml.ggml_nbytes(addr))
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
            mw = WEIGHTS_NAME.match(name)
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

    def scratch(self) -> Scratch | None:
        """The compute buffer (the one most of the graph's own nodes are allocated in) and how far into it
        this graph's nodes reach."""
        if not self.buffers:
            return None
        buf, (_, end) = max(self.buffers.items(), key=lambda kv: kv[1][0])
        base = libggml.ggml_backend_buffer_get_base(buf) or 0
        return Scratch(base, libggml.ggml_backend_buffer_get_size(buf), end - base)

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
