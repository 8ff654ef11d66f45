"""llama.cpp alone (no expert streaming) through bmoe.seam.llama's wrappers: one model, one context, a
prompt decoded and tokens sampled with bmoe's sampler chain. For tests of what the sampler allows
(grammars), where the streaming engine would only add time."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp

from bmoe.base.settings import SamplerSettings
from bmoe.chat.grammar import Grammar
from bmoe.generation.answer_text import TextStream
from bmoe.seam.llama import Vocab, init_backend, load_model, make_sampler, new_context


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
