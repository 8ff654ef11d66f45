"""`bmoe-server`, the OpenAI-compatible server: its decisions and process (`main`), the HTTP app
(`app`), the OpenAI shapes (`wire`) and the scheduler that shares the engine among requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bmoe.base.surface import lazy

if TYPE_CHECKING:
    from bmoe.server import main
    from bmoe.server.main import ServeSettings

__getattr__, __all__ = lazy(
    __name__,
    {
        "bmoe.server.main": ["ServeSettings", "build_parser", "main"],
    },
)
