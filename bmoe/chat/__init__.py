"""What a request asks beyond its text, made ready for the engine: the model's chat template
(`template`), tool-call and reasoning syntaxes (`syntax`), the reading of an answer (`output`),
grammars from JSON schemas (`grammar`, checked in a throwaway process by `grammar_check`) and the
bounds of one request (`limits`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bmoe.base.surface import lazy

if TYPE_CHECKING:
    from bmoe.chat.grammar import Grammar
    from bmoe.chat.limits import STOPS_MAX, check_stops
    from bmoe.chat.output import Delta, Reading, Reply
    from bmoe.chat.request import ChatFormat

__getattr__, __all__ = lazy(
    __name__,
    {
        "bmoe.chat.output": ["Delta", "Reading", "Reply"],
        "bmoe.chat.limits": ["STOPS_MAX", "check_stops"],
        "bmoe.chat.grammar": ["Grammar"],
        "bmoe.chat.request": ["ChatFormat"],
    },
)
