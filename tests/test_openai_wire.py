"""The OpenAI objects bmoe-server streams (bmoe.server.wire), for chunks the server sees."""

from __future__ import annotations

from bmoe.base.telemetry import TokenLine
from bmoe.chat.output import Delta
from bmoe.engine.generation import Chunk
from bmoe.server.wire import ReplyShape


def test_text_held_back_to_the_end_streams_without_token_telemetry() -> None:
    """The last text of a generation (held back as a possible stop string or a partial UTF-8
    sequence) comes in a Chunk without a token: it is streamed, with no `bmoe` field."""
    held = Chunk("E")
    completion = ReplyShape(False, "m").token(held)
    assert completion["choices"][0]["text"] == "E" and "bmoe" not in completion
    chat = ReplyShape(True, "m")
    assert chat.token(held)["choices"][0]["delta"] == {"content": "E"} and "bmoe" not in chat.token(held)
    assert chat.delta(Delta(content="E"), held)["choices"][0]["delta"] == {"content": "E"}


def test_a_token_chunk_carries_its_progress_fields() -> None:
    line = TokenLine(step=3, steps=8, wall_ms=10.0, io_ms=2.0, mgmt_ms=1.0, stall_ms=0.5, read_bytes=1 << 20,
                     cache_hit_pct=50.0)
    got = ReplyShape(False, "m").token(Chunk("word", line))["bmoe"]
    assert got["step"] == 3 and got["steps"] == 8 and got["compute_ms"] == 7.0 and got["cache_hit_pct"] == 50.0
