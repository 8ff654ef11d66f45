"""How a bmoe process ends: its exit codes, and SIGINT/SIGTERM turned into exceptions that reach
the code even mid-decode (seam.deliver parks them on the eval hook, which stops the graph)."""

from __future__ import annotations

import signal

EXIT_OK, EXIT_ERROR, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 130, 143


def install_signal_handlers() -> None:
    """SIGINT / SIGTERM end the process as KeyboardInterrupt / SystemExit(143), even mid-decode. The seam
    is imported here, by the commands that decode, not with this module: a tool that only reads its
    exit codes loads no llama.cpp."""
    from bmoe import seam

    def on_signal(signum: int, _frame: object) -> None:
        seam.deliver(KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(EXIT_SIGTERM))

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
