"""The two kinds of stderr line a user reads from bmoe-cli (and bmoe-server), in one form for every mode."""

from __future__ import annotations

import sys


def notice(msg: str) -> None:
    """Something the user should know; the run goes on."""
    print(f"bmoe: {msg}", file=sys.stderr, flush=True)


def error(msg: str, prog: str = "bmoe-cli") -> None:
    """Why the run ends (the exit code says how)."""
    print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
