"""How a bmoe process ends: its exit codes, and SIGINT/SIGTERM turned into exceptions that reach
the code even mid-decode (seam.deliver parks them on the eval hook, which stops the graph)."""

from __future__ import annotations

import signal

from bmoe import seam

EXIT_OK, EXIT_ERROR, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 130, 143


def _on_signal(signum: int, _frame: object) -> None:
    seam.deliver(KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(EXIT_SIGTERM))


def install_signal_handlers() -> None:
    """SIGINT / SIGTERM end the process as KeyboardInterrupt / SystemExit(143), even mid-decode."""
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
