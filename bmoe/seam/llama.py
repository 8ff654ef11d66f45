"""Thin ownership wrappers over llama-cpp-python's low-level API (model, context, vocab, sampler).

Kept apart from the seam: nothing here reaches into ggml internals.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
from typing import TYPE_CHECKING

import llama_cpp

from bmoe.errors import ModelError
from bmoe.settings import SamplerSettings

if TYPE_CHECKING:
    from bmoe.grammar import Grammar

_backend_ready = False
_log_verbose = False
_LOG_ERROR = 4  # GGML_LOG_LEVEL_ERROR (ggml.h)
_errors: collections.deque[str] = collections.deque(maxlen=4)  # llama.cpp's last error lines, for messages


@llama_cpp.llama_log_callback
def _log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if level == _LOG_ERROR:
        _errors.append(text.decode(errors="replace").strip())
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


def load_vocab(path: object) -> llama_cpp.llama_model_p | None:
    """The file's vocabulary alone (no weights are read): what parsing a grammar needs."""
    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = True
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


def grammar_sampler(vocab: Vocab, g: Grammar) -> llama_cpp.llama_sampler_p:
    """llama.cpp's grammar sampler for `g` (lazy when it has triggers); GrammarError naming llama.cpp's
    complaint when it does not parse."""
    from bmoe.grammar import GrammarError

    _errors.clear()
    if g.lazy:
        pats = [p.encode() for p in g.triggers]
        arr = (ctypes.c_char_p * len(pats))(*pats)
        smpl = llama_cpp.llama_sampler_init_grammar_lazy_patterns(vocab.ptr, g.text.encode(), g.root.encode(), arr,
                                                                  len(pats), None, 0)
    else:
        smpl = llama_cpp.llama_sampler_init_grammar(vocab.ptr, g.text.encode(), g.root.encode())
    if not smpl:
        why = "; ".join(_errors) or "see --verbose"
        raise GrammarError(f"llama.cpp rejected the grammar ({why}); fix the grammar")
    return smpl


def free_sampler(smpl: llama_cpp.llama_sampler_p) -> None:
    llama_cpp.llama_sampler_free(smpl)


def make_sampler(s: SamplerSettings, vocab: Vocab | None = None, grammar: Grammar | None = None
                 ) -> llama_cpp.llama_sampler_p:
    """llama.cpp's own sampler chain: greedy when temp is 0, else top-k → top-p → temp → dist; a
    grammar (bmoe.grammar) goes first, so every later stage sees only the tokens it allows."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if grammar is not None:
        assert vocab is not None, "a grammar needs the vocab"
        llama_cpp.llama_sampler_chain_add(chain, grammar_sampler(vocab, grammar))
    if s.temp <= 0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    else:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(s.top_k))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(s.top_p, 1))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(s.temp))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(s.seed & 0xFFFFFFFF))
    return chain


def seq_state(ctx: llama_cpp.llama_context_p, seq: int) -> bytes:
    """The KV state of sequence `seq` (llama.cpp's state API), to put back with `set_seq_state`."""
    n = llama_cpp.llama_state_seq_get_size(ctx, seq)
    buf = (ctypes.c_uint8 * n)()
    got = llama_cpp.llama_state_seq_get_data(ctx, buf, n, seq)
    return ctypes.string_at(buf, got)


def set_seq_state(ctx: llama_cpp.llama_context_p, seq: int, data: bytes) -> bool:
    """Replace sequence `seq`'s KV with a state `seq_state` took; False when llama.cpp refuses it
    (another model's or context's), the sequence then being empty."""
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    return llama_cpp.llama_state_seq_set_data(ctx, buf, len(data), seq) == len(data)


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

    def piece(self, tok: int, special: bool = False) -> bytes:
        """The token's text; a special (control) token's is empty unless `special`."""
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.ptr, tok, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.ptr, tok, buf, len(buf), 0, special)
        return buf.raw[:n]

    def is_eog(self, tok: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.ptr, tok))

    def warmup_token(self) -> int:
        bos = llama_cpp.llama_vocab_bos(self.ptr)
        return bos if bos >= 0 else 0
