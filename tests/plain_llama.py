"""llama.cpp alone (no expert streaming), loaded the way bmoe loads models: the one place tests and
bench scripts run llama.cpp outside bmoe.

- `Plain`: one model and context through bmoe.seam.llama's wrappers, a prompt decoded and tokens
  sampled with bmoe's sampler chain (tests of what the sampler allows, where the streaming engine
  would only add time);
- `plain_llama`: llama-cpp-python's own `Llama` (its own generation loop and chat handling) with
  bmoe's model parameters (`bmoe.seam.llama.model_params`: no extra buffer types);
- `with_llama_defaults`: llama-cpp-python's `Llama` with its own defaults, in a child process. Those
  defaults put weights into llama.cpp's extra buffer types (repacked, AMX), which crash llama.cpp on
  some CPUs and shapes (docs/architecture.md); a crash there ends the child, never pytest.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as low
import pytest

from bmoe.base.settings import SamplerSettings
from bmoe.chat.grammar import Grammar
from bmoe.generation.answer_text import TextStream
from bmoe.seam.llama import Vocab, init_backend, load_model, make_sampler, model_params, new_context


class Plain:
    def __init__(self, path: str | Path, n_ctx: int = 1024, n_ubatch: int | None = None) -> None:
        init_backend()
        self.model = load_model(path)
        assert self.model, f"llama.cpp could not load {path}"
        self.ctx = new_context(self.model, n_ctx, threads=2, n_ubatch=n_ubatch)
        self.vocab = Vocab(self.model)

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def piece(self, tok: int) -> bytes:
        """The token's text with special tokens written out (as a grammar sees them)."""
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab.ptr, tok, buf, len(buf), 0, True)
        return buf.raw[:n]

    def spell(self, text: str) -> list[int]:
        """Tokens whose pieces are exactly `text` (longest piece first; the tokenizer would add a
        word-start space in front)."""
        if not hasattr(self, "_pieces"):
            n = llama_cpp.llama_vocab_n_tokens(self.vocab.ptr)
            text_like = llama_cpp.LLAMA_TOKEN_ATTR_NORMAL | llama_cpp.LLAMA_TOKEN_ATTR_BYTE
            self._pieces = {self.piece(t): t for t in range(n)
                            if llama_cpp.llama_vocab_get_attr(self.vocab.ptr, t) & text_like}
            self._longest = max(len(p) for p in self._pieces)
        raw, out, i = text.encode(), [], 0
        while i < len(raw):
            for k in range(min(self._longest, len(raw) - i), 0, -1):
                if raw[i:i + k] in self._pieces:
                    out.append(self._pieces[raw[i:i + k]])
                    i += k
                    break
            else:
                raise AssertionError(f"no token spells {raw[i:i + 8]!r}")
        return out

    def accepts(self, grammar: Grammar, text: str) -> bool:
        """Whether `grammar` lets the model write `text` (as this vocab tokenizes it) and then end.
        Each token is offered to the grammar alone before it is accepted: accepting one it rejects
        would abort the process."""
        from bmoe.seam.llama import grammar_sampler

        toks = self.spell(text)
        eog = llama_cpp.llama_vocab_eos(self.vocab.ptr)
        smpl = grammar_sampler(self.vocab, grammar.gbnf)
        try:
            for tok in [*toks, eog]:
                data = (llama_cpp.llama_token_data * 1)()
                data[0].id, data[0].logit, data[0].p = tok, 0.0, 0.0
                arr = llama_cpp.llama_token_data_array(data, 1, -1, False)
                llama_cpp.llama_sampler_apply(smpl, ctypes.byref(arr))
                if data[0].logit == float("-inf"):
                    return False
                if tok != eog:
                    llama_cpp.llama_sampler_accept(smpl, tok)
            return True
        finally:
            llama_cpp.llama_sampler_free(smpl)

    def generate(self, prompt: str, grammar: Grammar | None = None, n: int = 64, temp: float = 0.0,
                 seed: int = 0, endless: bool = False) -> tuple[str, bool]:
        """(text, ended): the text sampled after `prompt` (special tokens written out), and whether
        it ended with an end-of-generation token rather than at `n` tokens. `endless`: the end of
        generation is never sampled (what a grammar allows after a complete document shows)."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        chain = make_sampler(SamplerSettings(temp=temp, seed=seed), self.vocab, grammar.gbnf if grammar else None)
        if endless:
            eogs = [t for t in range(llama_cpp.llama_vocab_n_tokens(self.vocab.ptr)) if self.vocab.is_eog(t)]
            bias = (llama_cpp.llama_logit_bias * len(eogs))()
            for b, t in zip(bias, eogs):
                b.token, b.bias = t, float("-inf")
            n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab.ptr)
            ban = llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(eogs), bias)
            # first in the chain: the grammar and the rest never see the end as a choice
            rest = chain
            chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
            llama_cpp.llama_sampler_chain_add(chain, ban)
            llama_cpp.llama_sampler_chain_add(chain, rest)
        out, text = TextStream(), ""
        try:
            toks = self.vocab.tokenize(prompt)
            for _ in range(n):
                arr = (llama_cpp.llama_token * len(toks))(*toks)
                assert llama_cpp.llama_decode(self.ctx, llama_cpp.llama_batch_get_one(arr, len(toks))) == 0
                tok = llama_cpp.llama_sampler_sample(chain, self.ctx, -1)
                if self.vocab.is_eog(tok):
                    return text + out.finish(), True
                text += out.push(self.piece(tok))
                toks = [tok]
            return text + out.finish(), False
        finally:
            llama_cpp.llama_sampler_free(chain)


@contextlib.contextmanager
def _bmoe_params() -> Iterator[None]:
    """llama-cpp-python's Llama takes its model parameters from llama_model_default_params() and has no
    argument for extra buffer types: while a Llama is made, that call answers bmoe's parameters."""
    default = low.llama_model_default_params
    low.llama_model_default_params = model_params
    try:
        yield
    finally:
        low.llama_model_default_params = default


def plain_llama(path: str | Path, **kw: Any) -> llama_cpp.Llama:
    """llama-cpp-python's own Llama on `path`, loaded as bmoe loads it (no extra buffer types); `kw` are
    Llama's own arguments (context, threads, flash attention...). The caller closes it."""
    with _bmoe_params():
        return llama_cpp.Llama(model_path=str(path), verbose=False, **kw)


# llama-cpp-python's own Llama with every default of the library and llama.cpp (extra buffer types
# included): loads argv[1] and prints a greedy completion of argv[2] of argv[3] tokens. BMOE_PLAIN=1
# loads it bmoe's way instead, the code otherwise the same.
_DEFAULTS_CHILD = """
import os, sys
import llama_cpp
if os.environ.get("BMOE_PLAIN") == "1":
    import llama_cpp.llama_cpp as low
    from bmoe.seam.llama import model_params
    low.llama_model_default_params = model_params
llm = llama_cpp.Llama(sys.argv[1], n_ctx=256, n_threads=2, verbose=True)
print(repr(llm(sys.argv[2], max_tokens=int(sys.argv[3]), temperature=0.0)["choices"][0]["text"]))
llm.close()
"""

# llama.cpp's own name for each buffer it loads weights into ("load_tensors: CPU_REPACK model buffer size")
_BUFFERS = re.compile(r"load_tensors:\s+(\S+) model buffer size")
_PLAIN_BUFFERS = {"CPU", "CPU_Mapped"}


def _child(path: Path, prompt: str, n: int, bmoe_way: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _DEFAULTS_CHILD, str(path), prompt, str(n)],
                          capture_output=True, text=True,
                          # no gdb backtrace from ggml's abort: the stderr's tail is then llama.cpp's own message
                          env={**os.environ, "BMOE_PLAIN": str(int(bmoe_way)), "GGML_NO_BACKTRACE": "1"})


def _death(r: subprocess.CompletedProcess) -> str:
    how = f"died of {signal.Signals(-r.returncode).name}" if r.returncode < 0 else f"exited {r.returncode}"
    return f"{how}; its stderr ends:\n" + "\n".join(line[:300] for line in r.stderr.splitlines()[-15:])


def with_llama_defaults(path: str | Path, prompt: str, n: int = 8) -> str:
    """What llama-cpp-python's own Llama, with its defaults and llama.cpp's, writes after `prompt` on
    `path` (greedy, `n` tokens): it shows a file is a GGUF the library's users load as it is. Run in a
    child process, so a crash of llama.cpp fails the calling test with its signal and stderr and the
    suite goes on.

    One crash is llama.cpp's and not the file's: weights in an extra buffer type that crashes on this
    CPU (docs/architecture.md's seam facts: on AMX CPUs, an abort where MLA multiplies a permuted
    query, and SIGILL in the AMX matmul of two or more tokens on one VM). When the child died with an
    extra buffer type in use and the same child, loading as bmoe does, runs, the test is marked xfail
    naming the buffers;
    any other failure fails it."""
    r = _child(Path(path), prompt, n, bmoe_way=False)
    if r.returncode == 0:
        return ast.literal_eval(r.stdout.splitlines()[-1])
    extra = sorted(set(_BUFFERS.findall(r.stderr)) - _PLAIN_BUFFERS)
    if r.returncode < 0 and extra:
        again = _child(Path(path), prompt, n, bmoe_way=True)
        assert again.returncode == 0, f"llama-cpp-python without extra buffer types {_death(again)}"
        pytest.xfail(f"llama.cpp with its default extra buffer types ({', '.join(extra)}) {_death(r)}\n"
                     "loaded without them (as bmoe does) it runs: a llama.cpp limitation on this CPU")
    pytest.fail(f"llama-cpp-python with its defaults {_death(r)}")
