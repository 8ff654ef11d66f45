"""Every call bmoe makes into llama.cpp's own API (model, context, KV, decode, vocab, samplers,
chat templates), through llama-cpp-python's ctypes bindings.

With bmoe.seam's graph modules (ggml_mirror, capture, eval_hook: the eval hook's reach into ggml's
graph) and populate this is the seam: no other module imports llama_cpp. What crosses it is plain
Python (token lists, bytes, strings, numpy arrays) and the opaque pointers these functions hand out
and take back.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llama_cpp
import numpy as np

from bmoe.base.errors import GrammarError, ModelError
from bmoe.base.settings import SamplerSettings

BINDINGS_VERSION: str = llama_cpp.__version__  # llama-cpp-python's version (keys caches of computed states)
LlamaModel = llama_cpp.llama_model_p
Context = llama_cpp.llama_context_p
if TYPE_CHECKING:
    Sampler = llama_cpp.llama_sampler_p
else:
    Sampler = object  # llama-cpp-python declares the type for checkers only
Gbnf = tuple[str, str, tuple[str, ...]]  # a grammar as llama.cpp takes it: GBNF text, root rule, lazy triggers

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


def model_params(mtp: bool = False) -> llama_cpp.llama_model_params:
    """llama.cpp's default model parameters as bmoe loads every model: without extra buffer types
    (repacked or AMX weights). A repacked weight no longer matches the file layout that expert
    streaming and the demo builder rely on, and on some CPUs those buffer types crash llama.cpp
    (docs/architecture.md, the seam's facts). Plain llama.cpp references load through this too.
    `mtp`: the multi-token-prediction layers are loaded too (llama.cpp skips them otherwise)."""
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = False
    mp.load_mtp = mtp
    return mp


def load_model(path: object, ints: dict[str, int] | None = None, mtp: bool = False) -> LlamaModel | None:
    """llama.cpp's default mmap load with bmoe's `model_params` (`mtp`: with its MTP layers). `ints` override
    integer keys of the file's metadata (llama.cpp's kv_overrides, e.g. `{"llama.expert_used_count": 6}`).
    None when llama.cpp cannot load the file; the caller says why."""
    mp = model_params(mtp)
    if ints:
        table = (llama_cpp.llama_model_kv_override * (len(ints) + 1))()  # the last one's empty key ends it
        for o, (key, value) in zip(table, ints.items()):
            o.tag, o.key, o.value.val_i64 = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, key.encode(), value
        mp.kv_overrides = table
    return llama_cpp.llama_model_load_from_file(str(path).encode(), mp)


def load_vocab(path: object) -> LlamaModel | None:
    """The file's vocabulary alone (no weights are read): what parsing a grammar needs."""
    mp = model_params()
    mp.vocab_only = True
    return llama_cpp.llama_model_load_from_file(str(path).encode(), mp)


# llama.cpp's pooling types by llama-server's --pooling names (llama.h's enum llama_pooling_type)
POOLING = {"none": llama_cpp.LLAMA_POOLING_TYPE_NONE, "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
           "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}


def new_context(model: llama_cpp.llama_model_p, n_ctx: int, threads: int = 0, eval_cb: object = None,
                n_ubatch: int | None = None, n_seq: int = 1, eval_user: int | None = None,
                embeddings: bool = False, pooling: str | None = None, rollback: int = 0,
                mtp_of: Context | None = None) -> llama_cpp.llama_context_p:
    """The one way bmoe makes a llama.cpp context: a batch as large as the context (a prompt is one
    `llama_decode`), ubatches of at most 512 unless asked, `threads` 0 = every core, and the eval
    callback (a ggml_backend_sched_eval_callback, called with `eval_user`) when one is given.

    `n_seq` sequences each get a KV of their own of `n_ctx` cells (llama.cpp's non-unified KV), so
    sequence 0 computes as it does in a one-sequence context.

    `embeddings`: the context is made computing embeddings (pooled by `pooling`, a POOLING name; None:
    the model's own), so the compute buffer llama.cpp reserves at creation holds the embedding graph
    too; the caller turns them off for generation (`set_embeddings`), which then never grows it.

    `rollback`: a recurrent state keeps that many per-token snapshots, so the last positions of a sequence can
    be dropped (llama.cpp's n_rs_seq, what it gives a target context that drafts; `rollback_room` says what the
    architecture took). `mtp_of`: an MTP context for that target context (llama.cpp's draft context for
    `--spec-type draft-mtp`: its graph is the model's MTP layer, fed the target's hidden states)."""
    cp = llama_cpp.llama_context_default_params()
    cp.n_rs_seq = rollback
    if mtp_of is not None:
        cp.ctx_type, cp.ctx_other = llama_cpp.LLAMA_CONTEXT_TYPE_MTP, mtp_of
    cp.embeddings = embeddings
    if pooling is not None:
        cp.pooling_type = POOLING[pooling]
    cp.n_ctx = n_ctx * n_seq
    cp.n_batch = max(n_ctx, n_seq)
    cp.n_seq_max = n_seq
    cp.kv_unified = False
    cp.n_ubatch = n_ubatch or min(512, n_ctx)
    cp.n_threads = cp.n_threads_batch = threads or os.cpu_count() or 1
    if eval_cb is not None:
        cp.cb_eval = eval_cb
        cp.cb_eval_user_data = eval_user
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        raise ModelError(f"llama.cpp could not create a context of {n_ctx} tokens; lower -c")
    return ctx


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE")


def give_back(start: int, end: int) -> None:
    """Hand the pages wholly inside [start, end) of llama.cpp's own scratch memory back to the system
    (MADV_DONTNEED: the next touch finds a zeroed page). Only for memory whose content nothing reads
    before writing it again: the compute buffer past what decode graphs use (bmoe.seam.Scratch)."""
    lo, hi = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if hi > lo and _libc.madvise(lo, hi - lo, _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) of llama.cpp's compute buffer failed")


def rebuild_graphs(ctx: Context, model: LlamaModel) -> None:
    """Make the context build and reserve every graph afresh at its next decode: a weight whose shape
    a graph takes when it is built (an expert scale's REPEAT, bmoe.seam.capture.ExpertScale) was
    rebound. Clearing the control vector (none is set; llama_set_adapter_cvec with no data) is the
    public call that marks the scheduler for a new reserve, which drops every graph kept for reuse."""
    if llama_cpp.llama_set_adapter_cvec(ctx, None, 0, llama_cpp.llama_model_n_embd(model), -1, -1) != 0:
        raise ModelError("llama.cpp refused to rebuild its graphs")


def grammar_sampler(vocab: Vocab, gbnf: Gbnf) -> Sampler:
    """llama.cpp's grammar sampler for `gbnf` (lazy when it has triggers); GrammarError naming llama.cpp's
    complaint when it does not parse."""
    text, root, triggers = gbnf
    _errors.clear()
    if triggers:
        pats = [p.encode() for p in triggers]
        arr = (ctypes.c_char_p * len(pats))(*pats)
        smpl = llama_cpp.llama_sampler_init_grammar_lazy_patterns(vocab.ptr, text.encode(), root.encode(), arr,
                                                                  len(pats), None, 0)
    else:
        smpl = llama_cpp.llama_sampler_init_grammar(vocab.ptr, text.encode(), root.encode())
    if not smpl:
        raise grammar_rejected("; ".join(_errors) or "see --verbose")
    return smpl


def grammar_rejected(why: str) -> GrammarError:
    """The error for a grammar llama.cpp would not parse, `why` being its complaint."""
    return GrammarError(f"llama.cpp rejected the grammar ({why}); fix the grammar")


def free_sampler(smpl: Sampler) -> None:
    llama_cpp.llama_sampler_free(smpl)


def sample(smpl: Sampler, ctx: Context, row: int) -> int:
    """The token `smpl` chooses from the logits of batch row `row` of the last decode."""
    return int(llama_cpp.llama_sampler_sample(smpl, ctx, row))


_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data, 12 bytes


def sample_kept(smpl: Sampler, ctx: Context, vocab: Vocab, row: int) -> tuple[int, np.ndarray]:
    """`sample`, done as llama_sampler_sample does it without a backend sampler (the candidates from batch row
    `row`'s logits, the chain applied, its selected token accepted): the same token; with the chain's probability
    of each token it kept after every sampler (llama-server's post-sampling probabilities), as log p over the vocab
    (-inf for a token it dropped). A greedy chain gives no probabilities: its token has p = 1, the rest none, as
    llama-server's chain at temperature 0 (only the likeliest kept, then its draw) gives them."""
    n = vocab.n_tokens
    cur = np.empty(n, dtype=_TOKEN_DATA)
    cur["id"] = np.arange(n, dtype=np.int32)
    cur["logit"] = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, row), shape=(n,))
    cur["p"] = 0.0
    arr = llama_cpp.llama_token_data_array(
        data=cur.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=n, selected=-1, sorted=False)
    llama_cpp.llama_sampler_apply(smpl, ctypes.byref(arr))
    if not 0 <= arr.selected < arr.size:
        raise ModelError(f"llama.cpp's sampler chain selected candidate {arr.selected} of {arr.size}")
    kept = np.ctypeslib.as_array(ctypes.cast(arr.data, ctypes.POINTER(ctypes.c_uint8)),
                                 shape=(arr.size * _TOKEN_DATA.itemsize,)).view(_TOKEN_DATA)
    token = int(kept["id"][arr.selected])
    llama_cpp.llama_sampler_accept(smpl, token)
    out = np.full(n, -np.inf, dtype=np.float32)
    some = kept[kept["p"] > 0]
    if some.size:
        out[some["id"]] = np.log(some["p"])
    else:
        out[token] = 0.0
    return token, out


def schema_converter() -> Any:
    """llama-cpp-python's JSON-schema → GBNF converter (a port of llama.cpp's), as bmoe.chat.grammar uses it."""
    from llama_cpp.llama_grammar import SchemaConverter

    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def make_sampler(s: SamplerSettings, vocab: Vocab | None = None, grammar: Gbnf | None = None) -> Sampler:
    """llama.cpp's own sampler chain, in its common sampler's order: a grammar (bmoe.chat.grammar) first,
    so every later stage sees only the tokens it allows; then the logit bias and the penalties, each
    only when set; then greedy when temp is 0, else top-k → top-p → min-p (when set) → temp → dist.
    The penalties count the tokens the chain samples (llama_sampler_sample accepts each), not the prompt."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if grammar is not None:
        assert vocab is not None, "a grammar needs the vocab"
        llama_cpp.llama_sampler_chain_add(chain, grammar_sampler(vocab, grammar))
    if s.logit_bias or s.penalized:
        assert vocab is not None, "a logit bias and penalties need the vocab"
        n_vocab = vocab.n_tokens
        if s.logit_bias:
            biases = (llama_cpp.llama_logit_bias * len(s.logit_bias))()
            for b, (tok, bias) in zip(biases, s.logit_bias):
                b.token, b.bias = tok, bias
            llama_cpp.llama_sampler_chain_add(
                chain, llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(s.logit_bias), biases))
        if s.penalized:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_penalties(
                n_vocab, s.repeat_last_n, s.repeat_penalty, s.frequency_penalty, s.presence_penalty))
    if s.temp <= 0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    else:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(s.top_k))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(s.top_p, 1))
        if s.min_p > 0:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_min_p(s.min_p, 1))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(s.temp))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(s.seed & 0xFFFFFFFF))
    return chain


# ---- a context: its size, KV sequences, decode, logits ---------------------------------------------


def context_size(ctx: Context) -> int:
    return int(llama_cpp.llama_n_ctx(ctx))


def ubatch_size(ctx: Context) -> int:
    return int(llama_cpp.llama_n_ubatch(ctx))


def set_abort(ctx: Context, callback: object, user: int | None = None) -> None:
    """llama.cpp's abort callback (a ggml_abort_callback, called with `user`), asked after every graph node."""
    llama_cpp.llama_set_abort_callback(ctx, callback, user)


def kv_clear(ctx: Context, seq: int = -1) -> None:
    """Empty sequence `seq`'s KV (-1: every sequence's)."""
    mem = llama_cpp.llama_get_memory(ctx)
    if seq < 0:
        llama_cpp.llama_memory_clear(mem, True)
    else:
        llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)


def kv_len(ctx: Context, seq: int) -> int:
    """Tokens in sequence `seq`'s KV: the next position to decode there."""
    return int(llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(ctx), seq)) + 1


def kv_cut(ctx: Context, seq: int, n: int) -> bool:
    """Drop sequence `seq`'s positions from `n` on; False when the memory cannot drop part of a
    sequence (sliding-window, recurrent), which then holds what it held."""
    return bool(llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), seq, n, -1))


def rollback_room(ctx: Context) -> int:
    """The positions a recurrent state can go back (the snapshots `new_context`'s rollback kept; 0 where the
    architecture has none: llama.cpp then clamps it)."""
    return int(llama_cpp.llama_n_rs_seq(ctx))


def can_rewind(model: LlamaModel) -> bool:
    """Whether the model's memory can drop a sequence's last positions (a KV cache can; a recurrent or hybrid
    model's state cannot go back to an earlier position)."""
    return not (llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model))


def decode(ctx: Context, parts: Sequence[tuple[int, Sequence[int], int]], every_logit: bool = False,
           no_logit: bool = False) -> tuple[int, list[int]]:
    """One llama_decode of (sequence, tokens, first position) parts, logits for each part's last
    token (every token's with `every_logit`, none with `no_logit`: a prompt's call before its last,
    whose last layer then computes no row); llama.cpp's return code and the batch row of each
    part's last token."""
    n = sum(len(toks) for _, toks, _ in parts)
    batch = llama_cpp.llama_batch_init(n, 0, 1)
    rows, i = [], 0
    try:
        for seq, toks, pos in parts:
            for j, tok in enumerate(toks):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos + j, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = every_logit or (j == len(toks) - 1 and not no_logit)
                i += 1
            rows.append(i - 1)
        batch.n_tokens = n
        rc = llama_cpp.llama_decode(ctx, batch)
    finally:
        llama_cpp.llama_batch_free(batch)
    return int(rc), rows


def logits(ctx: Context, vocab: Vocab, row: int) -> np.ndarray:
    """A copy of the last decode's logits at batch row `row`."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, row), shape=(vocab.n_tokens,)).copy()


def set_embeddings(ctx: Context, on: bool) -> None:
    """Whether the next decodes compute embeddings (every token is then an output: llama.cpp's
    output_all) or only the logits asked for."""
    llama_cpp.llama_set_embeddings(ctx, on)


def pooling_name(ctx: Context) -> str | None:
    """The context's pooling type by its POOLING name (None: one bmoe does not serve, such as rank)."""
    kind = int(llama_cpp.llama_pooling_type(ctx))
    return next((name for name, k in POOLING.items() if k == kind), None)


def token_embeddings(ctx: Context, model: LlamaModel, n_rows: int) -> np.ndarray:
    """A copy of the last decode's per-token embeddings, [n_rows, n_embd_out] (pooling none)."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_embeddings(ctx), shape=(n_rows, n_embd_out(model))).copy()


def seq_embedding(ctx: Context, model: LlamaModel, seq: int) -> np.ndarray:
    """A copy of the last decode's pooled embedding of sequence `seq`, [n_embd_out]."""
    ptr = llama_cpp.llama_get_embeddings_seq(ctx, seq)
    if not ptr:
        raise ModelError(f"llama.cpp computed no pooled embedding for sequence {seq}")
    return np.ctypeslib.as_array(ptr, shape=(n_embd_out(model),)).copy()


def free_context(ctx: Context) -> None:
    llama_cpp.llama_free(ctx)


def free_model(model: LlamaModel) -> None:
    llama_cpp.llama_model_free(model)


def n_embd(model: LlamaModel) -> int:
    return int(llama_cpp.llama_model_n_embd(model))


def n_embd_out(model: LlamaModel) -> int:
    """Floats in one of the model's embeddings (its output width; n_embd but for deepstack models)."""
    return int(llama_cpp.llama_model_n_embd_out(model))


def n_layer(model: LlamaModel) -> int:
    return int(llama_cpp.llama_model_n_layer(model))


def n_layer_nextn(model: LlamaModel) -> int:
    """The model's multi-token-prediction (NextN) layers, after its n_layer trunk layers."""
    return int(llama_cpp.llama_model_n_layer_nextn(model))


# ---- MTP drafting: llama.cpp's staging API (src/llama-ext.h), exported only under C++ names ---------------
# Each mangled name spells the declaration's parameter types (pinned in tests/test_seam.py with c++filt):
#   void    llama_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
#   float * llama_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
NEXTN_SYMBOLS = {"llama_set_embeddings_nextn": "_Z26llama_set_embeddings_nextnP13llama_contextbb",
                 "llama_get_embeddings_nextn_ith": "_Z30llama_get_embeddings_nextn_ithP13llama_contexti"}
# the library llama-cpp-python loaded (dlopen of the same file gives the same handle)
LIBLLAMA = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libllama.so"))
_set_nextn = getattr(LIBLLAMA, NEXTN_SYMBOLS["llama_set_embeddings_nextn"])
_set_nextn.argtypes, _set_nextn.restype = [llama_cpp.llama_context_p_ctypes, ctypes.c_bool, ctypes.c_bool], None
_nextn_ith = getattr(LIBLLAMA, NEXTN_SYMBOLS["llama_get_embeddings_nextn_ith"])
_nextn_ith.argtypes, _nextn_ith.restype = [llama_cpp.llama_context_p_ctypes, ctypes.c_int32], \
    ctypes.POINTER(ctypes.c_float)


def set_embeddings_nextn(ctx: Context, masked: bool) -> None:
    """The context keeps each decode's hidden states before the output norm (h_nextn, what an MTP layer is fed):
    for every row (`masked` False: a target's), or only for the rows with an output (an MTP context's)."""
    _set_nextn(ctx, True, masked)


def nextn_rows(ctx: Context, model: LlamaModel, rows: Sequence[int]) -> np.ndarray:
    """Copies of the last decode's h_nextn at these batch rows (output rows, for a masked context), [len, n_embd]."""
    width = n_embd_out(model)
    out = np.empty((len(rows), width), dtype=np.float32)
    for i, row in enumerate(rows):
        ptr = _nextn_ith(ctx, row)
        if not ptr:
            raise ModelError(f"llama.cpp kept no hidden state for batch row {row}")
        out[i] = np.ctypeslib.as_array(ptr, shape=(width,))
    return out


def decode_mtp(ctx: Context, parts: Sequence[tuple[int, Sequence[int], int, np.ndarray]],
               outputs: bool) -> tuple[int, list[int]]:
    """One decode of an MTP context (llama_batch_ext, llama_process): (sequence, tokens, first position, hidden
    states [len(tokens), n_embd]) parts, each token paired with its state as common_batch::set_embd pairs them
    (llama_batch_ext_set_embd_token; set_embd_state is a stub in this llama.cpp); `outputs`: each part's last
    token is an output (a draft's logits and h_nextn). llama.cpp's return code and each part's last batch row."""
    batch = llama_cpp.llama_batch_ext_init(ctx)
    if not batch:
        raise ModelError("llama.cpp could not make a batch for its MTP context")
    rows: list[int] = []
    try:
        i = 0
        for seq, toks, pos, states in parts:
            states = np.ascontiguousarray(states, dtype=np.float32)
            for j, tok in enumerate(toks):
                at = (llama_cpp.llama_pos * 4)(pos + j, 0, 0, 0)
                embd = llama_cpp.llama_embd(states[j].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1,
                                            states.shape[1])
                if llama_cpp.llama_batch_ext_add_token(batch, seq, tok) != i \
                        or not llama_cpp.llama_batch_ext_set_pos(batch, i, at) \
                        or not llama_cpp.llama_batch_ext_set_embd_token(batch, i, embd) \
                        or (outputs and j == len(toks) - 1
                            and not llama_cpp.llama_batch_ext_set_output_logits(batch, i, True)):
                    raise ModelError(f"llama.cpp refused token {tok} at position {pos + j} of an MTP batch")
                i += 1
            rows.append(i - 1)
        rc = llama_cpp.llama_process(ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch)
    finally:
        llama_cpp.llama_batch_ext_free(batch)
    return int(rc), rows


def chat_template(model: LlamaModel) -> bytes | None:
    """The chat template stored in the GGUF, if any."""
    return llama_cpp.llama_model_chat_template(model, None) or None


def builtin_templates() -> tuple[str, ...]:
    """The names of llama.cpp's built-in chat templates (what `apply_template` takes instead of a template)."""
    cap = 256
    names = (ctypes.c_char_p * cap)()
    n = min(cap, llama_cpp.llama_chat_builtin_templates(names, cap))
    return tuple((names[i] or b"").decode() for i in range(n))


def apply_template(template: bytes, messages: Sequence[tuple[str, str]], add_assistant: bool) -> str | None:
    """(role, content) messages through llama.cpp's own `llama_chat_apply_template` (the templates it
    recognises, or one of `builtin_templates` by name); None for a template it does not know."""
    msgs = (llama_cpp.llama_chat_message * len(messages))()
    keep = []  # the encoded strings must outlive the call
    for m, (role, content) in zip(msgs, messages):
        r, c = role.encode(), content.encode()
        keep += [r, c]
        m.role, m.content = r, c
    cap = 2 * sum(len(x) for x in keep) + 1024
    buf = ctypes.create_string_buffer(cap)
    n = llama_cpp.llama_chat_apply_template(template, msgs, len(messages), add_assistant, buf, cap)
    if n > cap:
        buf = ctypes.create_string_buffer(n)
        n = llama_cpp.llama_chat_apply_template(template, msgs, len(messages), add_assistant, buf, n)
    if n < 0:
        return None
    return buf.raw[:n].decode(errors="replace")


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

    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token of the vocabulary (what ignoring the end of generation bans)."""
        return tuple(t for t in range(self.n_tokens) if self.is_eog(t))

    @property
    def n_tokens(self) -> int:
        return int(llama_cpp.llama_vocab_n_tokens(self.ptr))

    def text(self, tok: int) -> str:
        """A token's text as the vocabulary stores it ("" for none, tok < 0)."""
        if tok < 0:
            return ""
        return (llama_cpp.llama_vocab_get_text(self.ptr, tok) or b"").decode(errors="replace")

    @property
    def bos(self) -> int:
        return int(llama_cpp.llama_vocab_bos(self.ptr))

    @property
    def eos(self) -> int:
        return int(llama_cpp.llama_vocab_eos(self.ptr))

    @property
    def adds_bos(self) -> bool:
        """Whether tokenizing with specials puts BOS in front."""
        return bool(llama_cpp.llama_vocab_get_add_bos(self.ptr))

    def warmup_token(self) -> int:
        return self.bos if self.bos >= 0 else 0
