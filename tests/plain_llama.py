"""llama.cpp alone (no expert streaming) through bmoe.llama's wrappers: one model, one context, a
prompt decoded and tokens sampled with bmoe's sampler chain. For tests of what the sampler allows
(grammars), where the streaming engine would only add time."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp

from bmoe.grammar import Grammar
from bmoe.llama import TextStream, Vocab, init_backend, load_model, make_sampler, new_context
from bmoe.settings import SamplerSettings


class Plain:
    def __init__(self, path: str | Path, n_ctx: int = 1024) -> None:
        init_backend()
        self.model = load_model(path)
        assert self.model, f"llama.cpp could not load {path}"
        self.ctx = new_context(self.model, n_ctx, threads=2)
        self.vocab = Vocab(self.model)

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def piece(self, tok: int) -> bytes:
        """The token's text with special tokens written out (as a grammar sees them)."""
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab.ptr, tok, buf, len(buf), 0, True)
        return buf.raw[:n]

    def generate(self, prompt: str, grammar: Grammar | None = None, n: int = 64, temp: float = 0.0,
                 seed: int = 0) -> tuple[str, bool]:
        """(text, ended): the text sampled after `prompt` (special tokens written out), and whether
        it ended with an end-of-generation token rather than at `n` tokens."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        chain = make_sampler(SamplerSettings(temp=temp, seed=seed), self.vocab, grammar)
        out = TextStream()
        try:
            toks = self.vocab.tokenize(prompt)
            for _ in range(n):
                arr = (llama_cpp.llama_token * len(toks))(*toks)
                assert llama_cpp.llama_decode(self.ctx, llama_cpp.llama_batch_get_one(arr, len(toks))) == 0
                tok = llama_cpp.llama_sampler_sample(chain, self.ctx, -1)
                if self.vocab.is_eog(tok):
                    return out.text + out.finish(), True
                out.push(self.piece(tok))
                toks = [tok]
            return out.text + out.finish(), False
        finally:
            llama_cpp.llama_sampler_free(chain)
