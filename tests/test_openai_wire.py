"""The OpenAI objects bmoe-server streams (bmoe.server.openai_wire), for chunks the server sees."""

from __future__ import annotations

from bmoe.base.telemetry import TokenLine
from bmoe.chat.output import Delta
from bmoe.generation.records import Chunk
from bmoe.server.openai_wire import OpenAIShape


def test_text_held_back_to_the_end_streams_without_token_telemetry() -> None:
    """The last text of a generation (held back as a possible stop string or a partial UTF-8
    sequence) comes in a Chunk without a token: it is streamed, with no `bmoe` field."""
    held = Chunk("E")
    completion = OpenAIShape(False, "m").token_chunk(held)
    assert completion["choices"][0]["text"] == "E" and "bmoe" not in completion
    chat = OpenAIShape(True, "m")
    assert chat.token_chunk(held)["choices"][0]["delta"] == {"content": "E"} and "bmoe" not in chat.token_chunk(held)
    assert chat.delta(Delta(content="E"), held)["choices"][0]["delta"] == {"content": "E"}


def test_a_token_chunk_carries_its_progress_fields() -> None:
    line = TokenLine(step=3, steps=8, wall_ms=10.0, io_ms=2.0, mgmt_ms=1.0, stall_ms=0.5, read_bytes=1 << 20,
                     cache_hit_pct=50.0)
    got = OpenAIShape(False, "m").token_chunk(Chunk("word", line))["bmoe"]
    assert got["step"] == 3 and got["steps"] == 8 and got["compute_ms"] == 7.0 and got["cache_hit_pct"] == 50.0


def test_logprobs_take_openais_shapes_and_only_when_asked() -> None:
    from bmoe.generation.logprobs import Alternative, TokenLogprob

    e = "\u00e9".encode()
    toks = (TokenLogprob(1, "", e[:1], -0.5, (Alternative(1, "\ufffd", e[:1], -0.5),), 3),
            TokenLogprob(2, "\u00e9", e[1:], -0.25, (Alternative(2, "\ufffd", e[1:], -0.25),), 3))
    c = Chunk("\u00e9", logprobs=toks)
    assert OpenAIShape(False, "m").token_chunk(c)["choices"][0]["logprobs"] is None  # not asked for
    legacy = OpenAIShape(False, "m").token_chunk(c, logprobs=True)["choices"][0]["logprobs"]
    assert legacy == {"tokens": ["", "\u00e9"], "token_logprobs": [-0.5, -0.25],
                      "top_logprobs": [{"\ufffd": -0.5}, {"\ufffd": -0.25}], "text_offset": [3, 3]}
    chat = OpenAIShape(True, "m").token_chunk(c, logprobs=True)["choices"][0]["logprobs"]
    assert chat == {"refusal": None, "content": [
        {"token": "", "logprob": -0.5, "bytes": [0xC3], "top_logprobs": [{"token": "\ufffd", "logprob": -0.5,
                                                                          "bytes": [0xC3]}]},
        {"token": "\u00e9", "logprob": -0.25, "bytes": [0xA9], "top_logprobs": [{"token": "\ufffd", "logprob": -0.25,
                                                                                 "bytes": [0xA9]}]}]}
