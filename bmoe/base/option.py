"""How one setting is declared: `Option` (its flag, keyword, help and bounds) and `setting(...)`, the
dataclass field that carries it. bmoe.base.settings declares every setting with them (its module notes
say how the edges use the declarations)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Option:
    """How one setting is spelled, explained and bounded at every edge."""

    flag: str  # the long flag; a bool whose flag starts "--no-" is on by default and the flag turns it off
    help: str  # `{default}` becomes the field's default
    short: str | None = None  # e.g. "-t"; also how errors name it
    alias: str | None = None  # another spelling of the long flag (llama-server's), taken as it
    keyword: str | None = None  # bmoe.load's keyword; None: the flag's words ("--no-odirect" -> "odirect")
    parse: Callable[[str], Any] | None = None  # text -> value (the flag's argparse type; bmoe.load takes text too)
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    toggle: bool = False  # a bool with both --X and --no-X
    repeat: bool = False  # the flag may be given again: `parse` returns a tuple (a comma list) and they add up
    ok: Callable[[Any], bool] | None = None  # the bound, checked for every edge (None values are not checked)
    rule: str = ""  # the bound in words, after the offending value
    auto: str | None = None  # what None means, as the user writes it ("auto")
    from_value: Callable[[Any], Any] | None = None  # a keyword's value that is not text -> the setting's

    @property
    def name(self) -> str:
        """The keyword: bmoe.load's, and the argparse dest."""
        return self.keyword or self.flag.removeprefix("--").removeprefix("no-").replace("-", "_")


def setting(default: Any, flag: str, help: str, **option: Any) -> Any:  # noqa: A002 - argparse's word
    """A settings field with its Option (see the module notes)."""
    return field(default=default, metadata={"option": Option(flag, help, **option)})
