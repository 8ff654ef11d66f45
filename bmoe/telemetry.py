"""Lines of the telemetry contract (shared/spec/telemetry.md), written in one place.

The formats here are the user's: keep every word, unit and order.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass
class RunTotals:
    """Per-run sums the summary lines are computed from."""

    tokens: int
    wall_s: float
    io_s: float
    mgmt_s: float
    stall_s: float
    read_bytes: int
    overlap: bool = False

    @property
    def compute_s(self) -> float:
        lost = self.stall_s if self.overlap else self.io_s
        return self.wall_s - lost - self.mgmt_s


def _per_tok(x: float, n: int) -> float:
    return x / n if n else 0.0


def generation_line(t: RunTotals) -> str:
    s_tok = _per_tok(t.wall_s, t.tokens)
    tok_s = t.tokens / t.wall_s if t.wall_s > 0 else 0.0
    return f"generation: {t.tokens} tokens, {s_tok:.4f} s/token ({tok_s:.2f} tok/s)"


def stream_line(t: RunTotals) -> str:
    n = t.tokens
    mib = t.read_bytes / MiB
    bw = mib / t.io_s if t.io_s > 0 else 0.0
    line = (f"moe-stream: read {mib:.2f} MiB ({_per_tok(mib, n):.2f} MiB/token), "
            f"decode {_per_tok(t.wall_s, n):.4f} s/token (compute {_per_tok(t.compute_s, n):.4f} + "
            f"cache mgmt {_per_tok(t.mgmt_s, n):.4f} + flash I/O {_per_tok(t.io_s, n):.4f} s/token, "
            f"{bw:.1f} MiB/s)")
    if t.overlap:
        line += f" stall_s/tok={_per_tok(t.stall_s, n):.4f}"
    return line


def cache_line(hit_pct: float, resident_bytes: int) -> str:
    return f"moe-cache: {hit_pct:.1f}% hit, resident {resident_bytes / MiB:.1f} MiB"
