"""A greedy run through llama.cpp's C API alone (no expert streaming, the model loaded as bmoe loads it),
recording which experts one MoE layer routes each token to: what the bmoe-synth tests check every
synthetic model with."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import numpy as np

from bmoe.seam.llama import init_backend, load_model, new_context

PROMPT = "The quick brown fox jumps over the lazy dog, then it runs far away into the dark forest."


class _GgmlTensor(ctypes.Structure):
    """Public `struct ggml_tensor` (ggml/include/ggml.h), enough to read a node's ids."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class RoutedRun:
    """Greedy decode through llama.cpp's C API, recording layer `layer`'s expert choice per token
    (its `ffn_moe_topk-L` node: [n_expert_used, n_tokens] int32)."""

    def __init__(self, path: Path, layer: int = 0) -> None:
        init_backend()
        self.routes: list[tuple[int, ...]] = []
        self._node = f"ffn_moe_topk-{layer}".encode()
        self._cb = llama_cpp.ggml_backend_sched_eval_callback(self._on_node)
        self.model = load_model(path)  # as bmoe loads it: llama.cpp's defaults crash on some CPUs
        assert self.model, f"llama.cpp refused {path}"
        self.ctx = new_context(self.model, 256, threads=2, eval_cb=self._cb)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def _on_node(self, t: int, ask: bool, _user: int) -> bool:
        node = _GgmlTensor.from_address(t)
        if ask:
            return node.name == self._node
        k, n_tokens, row = node.ne[0], node.ne[1], node.nb[1]
        for j in range(n_tokens):  # a strided view of the argsort: rows are nb[1] apart
            ids = (ctypes.c_int32 * k).from_address(node.data + j * row)
            self.routes.append(tuple(sorted(ids)))
        return True

    def tokenize(self, text: str, add_bos: bool) -> list[int]:
        data = text.encode()
        buf = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, len(buf), add_bos, False)
        assert n >= 0
        return list(buf[:n])

    def detokenize(self, tokens: list[int]) -> str:
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        buf = ctypes.create_string_buffer(64 * len(tokens) + 64)
        n = llama_cpp.llama_detokenize(self.vocab, arr, len(tokens), buf, len(buf), False, False)
        assert n >= 0
        return buf.raw[:n].decode("utf-8", errors="replace")

    def decode(self, tokens: list[int]) -> np.ndarray:
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        batch = llama_cpp.llama_batch_get_one(arr, len(tokens))
        assert llama_cpp.llama_decode(self.ctx, batch) == 0
        logits = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).copy()


def check_runs(path: Path, layer: int = 0, n_gen: int = 32) -> tuple[list[int], list[tuple[int, ...]]]:
    """Load, prefill PROMPT, greedily generate `n_gen` tokens; check the text is words that round-trip,
    not one token repeated, and that layer `layer` routes different tokens to different experts.
    Returns the prompt and generated ids and that layer's routes (one per token)."""
    run = RoutedRun(path, layer)
    try:
        prompt = run.tokenize(PROMPT, add_bos=True)
        assert len(prompt) >= 13 and prompt[0] == llama_cpp.llama_vocab_bos(run.vocab)
        assert run.detokenize(prompt[1:]) == PROMPT  # llama.cpp drops the SPM space prefix
        logits = run.decode(prompt)
        n_prefill_routes = len(run.routes)
        assert n_prefill_routes == len(prompt)
        generated = []
        for _ in range(n_gen):
            assert np.isfinite(logits).all()
            generated.append(int(np.argmax(logits)))
            logits = run.decode(generated[-1:])
        assert np.isfinite(logits).all()
        text = run.detokenize(generated)
        assert text.strip()
        assert run.detokenize(run.tokenize(text, add_bos=False)) == text
        assert len(set(generated)) > n_gen // 2, "greedy decoding is stuck on a few tokens"
        decode_routes = run.routes[n_prefill_routes:]
        assert len(decode_routes) == n_gen
        assert len(set(decode_routes)) > 2, "the router picks the same experts for every token"
    finally:
        run.close()
    return prompt + generated, run.routes
