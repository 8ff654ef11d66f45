"""A prompt decoded in calls wider than llama.cpp's default ubatch (bmoe.engine.prompt_calls) computes
every token as llama.cpp's one call with ubatches of 512 does: the cut on its own, and the text on
real llama.cpp against plain llama.cpp at n_ubatch 512, streamed and not, on architectures whose
graphs differ where a wider ubatch could tell (MLA attention, sliding windows, a recurrent layer)."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest

from bmoe.engine.prompt_calls import FA_TILE, REGIME_UBATCH, calls, width
from bmoe.tools.synth import write_model
from tests.conftest import complete, generate, load, wide
from tests.plain_llama import Plain


def _regimes(lengths: list[int], chunk: int) -> list[bool]:
    """Per token: whether the ubatch it is computed in has FA_TILE rows or more, for calls of these
    lengths each cut into ubatches of `chunk` from its start."""
    out = []
    for n in lengths:
        for start in range(0, n, chunk):
            rows = min(chunk, n - start)
            out += [rows >= FA_TILE] * rows
    return out


@pytest.mark.parametrize("w", [512, 1024, 2048])
def test_calls_give_every_token_the_regime_of_one_call_with_ubatches_of_512(w: int) -> None:
    for n in range(1, 5000):
        got = calls(n, w)
        assert sum(got) == n and all(0 < k <= w for k in got), (n, got)
        # each call is one ubatch (the context's is at least `w` wide)
        assert _regimes(got, w) == _regimes([n], REGIME_UBATCH), (n, got)
        assert len(got) <= -(-n // w) + 1, "at most one call more than the width needs"


def test_the_context_width_is_whole_chunks_and_never_past_the_context() -> None:
    assert [width(n) for n in (64, 256, 512, 700, 1024, 1600, 4096, 32768)] == [64, 256, 512, 512, 1024, 1536,
                                                                                2048, 2048]
    with pytest.raises(ValueError):
        calls(3000, 1000)


def _prompt(plain: Plain, n_tokens: int) -> str:
    """Text that the model's tokenizer makes exactly `n_tokens` tokens (BOS included): sentences while
    they fit, then one-letter words, one token each."""
    text, words = "", (f"word{i % 89} the keeper of the light" for i in range(n_tokens))
    for w in words:
        if len(plain.vocab.tokenize(f"{text} {w}")) > n_tokens - 4:
            break
        text = f"{text} {w}"
    while (have := len(plain.vocab.tokenize(text))) < n_tokens:
        text += " a" * (n_tokens - have)
    assert len(plain.vocab.tokenize(text)) == n_tokens, "one-letter words are not one token each here"
    return text


@pytest.mark.parametrize("arch", wide(["qwen3moe", "deepseek2", "gemma4", "qwen35moe"], {"qwen35moe"}))
def test_a_long_prompt_gives_plain_llama_cpps_text_at_ubatches_of_512(tmp_path, arch: str) -> None:
    """1030 tokens (a remainder of 6: its own call), 1100 (one call) and 600: bmoe's answer, streamed
    with a third of the experts cached and with --no-stream, is plain llama.cpp's with n_ubatch 512."""
    # (4 layers: qwen35moe's fourth is an attention layer, without which plain llama.cpp aborts)
    path = write_model(tmp_path / f"{arch}.gguf", arch=arch, layers=4, experts=16, top_k=4)
    plain = Plain(path, n_ctx=2048, n_ubatch=REGIME_UBATCH)
    try:
        prompts = [_prompt(plain, n) for n in (1030, 1100, 600)]
        want = [plain.generate(p, n=12)[0] for p in prompts]
    finally:
        plain.close()
    third = f"{path.stat().st_size / 2**20 / 3:.2f}"
    for prompt, text in zip(prompts, want):
        assert generate(path, prompt, 12, "-c", 2048, "-t", 2, "--cache-mb", third, "--force").text == text
        assert generate(path, prompt, 12, "-c", 2048, "-t", 2, "--no-stream").text == text


def _resident_pages(start: int, end: int) -> int:
    """Pages of [start, end) in memory now (mincore)."""
    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page
    vec = ctypes.create_string_buffer(max(1, (hi - lo) // page))
    assert libc.mincore(lo, hi - lo, vec) == 0
    return sum(b & 1 for b in vec.raw[:(hi - lo) // page])


def _model_and_prompt(tmp_path: Path, n_tokens: int) -> tuple[Path, str]:
    """A small qwen3moe file (2 layers of 16 experts, top-4) and a prompt of `n_tokens` tokens for it."""
    path = write_model(tmp_path / "m.gguf", arch="qwen3moe", layers=2, experts=16, top_k=4)
    plain = Plain(path, n_ctx=2048)
    try:
        return path, _prompt(plain, n_tokens)
    finally:
        plain.close()


def test_a_wide_call_gives_back_the_compute_pages_a_decode_does_not_use(tmp_path) -> None:
    """The compute buffer is sized for the widest call; a long prompt touches far more of it than a
    decode does, and those pages go back to the system after the prompt (bmoe.seam.Scratch): the
    decode after it holds no more memory than after a short prompt."""
    path, prompt = _model_and_prompt(tmp_path, 1500)
    with load(path, "-c", 2048, "-t", 2, "--cache-mb", 1) as m:
        s = m.engine.scratch
        assert s is not None and 0 < s.used < s.size
        complete(m, prompt, 2)
        assert _resident_pages(s.base + s.used, s.base + s.size) == 0


def test_a_short_prompt_gives_them_back_where_the_cache_budget_follows_the_room(tmp_path) -> None:
    """Under --cache-mb auto the pages a prompt touched past a decode's would be the cache's: they go back after any
    prompt; a fixed budget cannot grow into them, so a short prompt keeps them (faulting them in again costs the
    next prompt)."""
    path, prompt = _model_and_prompt(tmp_path, 300)
    for budget, kept in (("1", True), ("auto", False)):
        with load(path, "-c", 2048, "-t", 2, "--cache-mb", budget) as m:
            s = m.engine.scratch
            assert s is not None
            complete(m, prompt, 2)
            assert (_resident_pages(s.base + s.used, s.base + s.size) > 0) == kept, budget
