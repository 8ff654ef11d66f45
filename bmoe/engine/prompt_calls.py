"""How a prompt is cut into llama_decode calls: as wide as memory allows, computed as llama.cpp's default.

A prefill reads the experts each ubatch routes, and a ubatch of a few hundred tokens routes nearly
every expert of every layer: a prompt decoded in ubatches of 512 (llama.cpp's default n_ubatch)
reads the model once per 512 tokens. The context is made with a wider ubatch (`WIDEST`), and a
prompt goes to llama.cpp in calls of up to `width` tokens, one ubatch each, so its experts are read
once per call.

The text stays plain llama.cpp's with its default ubatch of 512. ggml's CPU kernels compute a token
the same whatever the number of rows beside it within one regime that the ubatch's size picks: flash
attention takes its tiled kernel from FA_TILE (64) rows (GGML_FA_TILE_Q) and a per-row one below, and a
matmul of one row leaves tinyBLAS. Cut into ubatches of 512 from its start, a call's only ubatch
that can be below 64 rows is its last, the remainder; so a remainder below 64 is decoded in a call
of its own (the same rows, the same regime), and the rest, whose ubatches of 512 are all 64 rows or
more, in calls of up to `width` (a multiple of 512: each call's remainder is the rest's). The
prompt cache's cut points follow the same chunks (bmoe.generation.prompt_cache);
tests/test_prompt_calls.py checks the text against llama.cpp's at every architecture.
"""

from __future__ import annotations

from bmoe import seam
from bmoe.seam import llama

REGIME_UBATCH = 512  # llama.cpp's default n_ubatch: the chunks a prompt's tokens are computed as
FA_TILE = 64  # ggml-cpu's GGML_FA_TILE_Q: a ubatch of at least this many tokens takes the tiled flash attention
WIDEST = 2048  # the context's ubatch: the widest call a prompt is decoded in


def width(n_ctx: int) -> int:
    """The context's ubatch: WIDEST, or the context's size rounded down to whole chunks of
    REGIME_UBATCH (a context smaller than one chunk: its size, as llama.cpp would take it)."""
    return min(WIDEST, max(n_ctx - n_ctx % REGIME_UBATCH, min(n_ctx, REGIME_UBATCH)))


def calls(n_tokens: int, width: int) -> list[int]:
    """The lengths of the llama_decode calls that decode `n_tokens` tokens as one call with ubatches of
    REGIME_UBATCH does, none wider than `width` (a multiple of REGIME_UBATCH)."""
    if width % REGIME_UBATCH and n_tokens > width:
        raise ValueError(f"a call's width must be a multiple of {REGIME_UBATCH}, not {width}")
    tail = n_tokens % REGIME_UBATCH if n_tokens > REGIME_UBATCH else 0
    body = n_tokens - tail if tail < FA_TILE else n_tokens
    out = [width] * (body // width)
    if body % width:
        out.append(body % width)
    if body < n_tokens:
        out.append(n_tokens - body)
    return out


def return_scratch(scratch: seam.Scratch | None, widest: int, budget_follows_room: bool) -> None:
    """After a prompt decoded in calls up to `widest` tokens, the compute buffer's pages past a one-token decode's
    go back to the system (they stay the process's otherwise): after a call wider than REGIME_UBATCH, so a long
    prompt leaves the decode no more memory than a short one; after any while the cache's budget follows the room
    the limits leave, so they become cache (on Qwen3.6-35B-A3B's shape an 86-token prompt left 85 MiB touched,
    185 MiB with --draft mtp, whose target computes every row of its last layer for the MTP layer)."""
    if scratch is not None and (widest > REGIME_UBATCH or budget_follows_room):
        llama.give_back(scratch.base + scratch.used, scratch.base + scratch.size)
