"""The mirror of ggml's `struct ggml_tensor` (ctypes) and the readers of a graph node's tensors.

ggml's compute graph is reached through the eval callback, which hands over node addresses; this
module reads and writes what is at them: the struct's fields, op codes (asked of ggml by name), a
node's name, the routed ids of `ffn_moe_topk-L` (a strided view into a wider argsort), the router
weights and scores, F32 rows. Every fact it relies on (the struct's layout, the strided ids, the F32
rows) is pinned by tests/test_seam.py against the pinned llama-cpp-python build, so a version bump
that breaks one fails loudly.
"""

from __future__ import annotations

import ctypes

import numpy as np
from llama_cpp._ggml import libggml

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

libggml.ggml_op_name.argtypes = [ctypes.c_int]
libggml.ggml_op_name.restype = ctypes.c_char_p
libggml.ggml_get_name.argtypes = [ctypes.c_void_p]
libggml.ggml_get_name.restype = ctypes.c_void_p
libggml.ggml_get_data.argtypes = [ctypes.c_void_p]
libggml.ggml_get_data.restype = ctypes.c_void_p
libggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
libggml.ggml_nbytes.restype = ctypes.c_size_t
libggml.ggml_backend_buffer_get_base.argtypes = [ctypes.c_void_p]
libggml.ggml_backend_buffer_get_base.restype = ctypes.c_void_p
libggml.ggml_backend_buffer_get_size.argtypes = [ctypes.c_void_p]
libggml.ggml_backend_buffer_get_size.restype = ctypes.c_size_t
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


def ids_view(addr: int) -> np.ndarray:
    """The [n_tokens, n_expert_used] int32 ids of a `ffn_moe_topk-L` node, in place (writable: the remap
    overwrites them through it).

    The node is a view into a wider argsort result, so rows are nb[1] bytes
    apart rather than n_expert_used*4: a flat read would return wrong experts.
    """
    t = tensor_at(addr)
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
    return ids_view(addr).copy()


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
