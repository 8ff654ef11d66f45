"""Thin ownership wrappers over llama-cpp-python's low-level API (model, context, vocab, sampler).

Kept apart from the seam: nothing here reaches into ggml internals.
"""

from __future__ import annotations

import ctypes
import os
import sys

import llama_cpp

from bmoe.errors import ModelError
from bmoe.settings import SamplerSettings

_backend_ready = False
_log_verbose = False


@llama_cpp.llama_log_callback
def _log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if _log_verbose:
        sys.stderr.write(text.decode(errors="replace"))


def init_backend(verbose: bool = False) -> None:
    """llama.cpp's own log lines go to stderr with --verbose and nowhere otherwise."""
    global _backend_ready, _log_verbose
    _log_verbose = verbose
    if not _backend_ready:
        llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_ready = True


def load_model(path: object, ints: dict[str, int] | None = None) -> llama_cpp.llama_model_p | None:
    """llama.cpp's default mmap load, without repacking: a repacked (extra buffer type) weight
    would no longer match the file layout that expert streaming and the demo builder rely on.
    `ints` override integer keys of the file's metadata (llama.cpp's kv_overrides, e.g.
    `{"llama.expert_used_count": 6}`). None when llama.cpp cannot load the file; the caller says why."""
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = False
    if ints:
        table = (llama_cpp.llama_model_kv_override * (len(ints) + 1))()  # the last one's empty key ends it
        for o, (key, value) in zip(table, ints.items()):
            o.tag, o.key, o.value.val_i64 = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, key.encode(), value
        mp.kv_overrides = table
    return llama_cpp.llama_model_load_from_file(str(path).encode(), mp)


def new_context(model: llama_cpp.llama_model_p, n_ctx: int, threads: int = 0, eval_cb: object = None,
                n_ubatch: int | None = None, n_seq: int = 1) -> llama_cpp.llama_context_p:
    """The one way bmoe makes a llama.cpp context: a batch as large as the context (a prompt is one
    `llama_decode`), ubatches of at most 512 unless asked, `threads` 0 = every core, and the eval
    callback (a ggml_backend_sched_eval_callback) when one is given.

    `n_seq` sequences each get a KV of their own of `n_ctx` cells (llama.cpp's non-unified KV), so
    sequence 0 computes as it does in a one-sequence context."""
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = n_ctx * n_seq
    cp.n_batch = max(n_ctx, n_seq)
    cp.n_seq_max = n_seq
    cp.kv_unified = False
    cp.n_ubatch = n_ubatch or min(512, n_ctx)
    cp.n_threads = cp.n_threads_batch = threads or os.cpu_count() or 1
    if eval_cb is not None:
        cp.cb_eval = eval_cb
        cp.cb_eval_user_data = None
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        raise ModelError(f"llama.cpp could not create a context of {n_ctx} tokens; lower -c")
    return ctx


def make_sampler(s: SamplerSettings) -> llama_cpp.llama_sampler_p:
    """llama.cpp's own sampler chain: greedy when temp is 0, else top-k → top-p → temp → dist."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if s.temp <= 0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    else:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(s.top_k))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(s.top_p, 1))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(s.temp))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(s.seed & 0xFFFFFFFF))
    return chain


class Vocab:
    def __init__(self, model: llama_cpp.llama_model_p) -> None:
        self.model = model
        self.ptr = llama_cpp.llama_model_get_vocab(model)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        raw = text.encode()
        cap = len(raw) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.ptr, raw, len(raw), buf, cap, add_special, True)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.ptr, raw, len(raw), buf, cap, add_special, True)
        return list(buf[:n])

    def piece(self, tok: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.ptr, tok, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.ptr, tok, buf, len(buf), 0, False)
        return buf.raw[:n]

    def is_eog(self, tok: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.ptr, tok))

    def warmup_token(self) -> int:
        bos = llama_cpp.llama_vocab_bos(self.ptr)
        return bos if bos >= 0 else 0
