"""What users run besides the one-shot CLI: its flags (`flags`, generated from the settings),
the notice and error lines (`console`), exit codes and signals (`exits`), the --profile table
(`profile`), and session mode (`session`, its line protocol `protocol`, and `session_client`, a
driver for apps and tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bmoe.base.surface import lazy

if TYPE_CHECKING:
    from bmoe.edges import console, exits, flags, profile, protocol, session
    from bmoe.edges.session_client import SessionClient

__getattr__, __all__ = lazy(
    __name__,
    {
        "bmoe.edges.console": ["console"],
        "bmoe.edges.exits": ["exits"],
        "bmoe.edges.flags": ["flags"],
        "bmoe.edges.profile": ["profile"],
        "bmoe.edges.session": ["session"],
        "bmoe.edges.protocol": ["protocol"],
        "bmoe.edges.session_client": ["SessionClient"],
    },
)
