"""argparse types for numbers, shared by every bmoe command so a bad value reads the same everywhere.

Kept apart from `cli` so that commands which never load llama.cpp (bmoe-bench, bmoe-synth) can
use them without importing it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T", int, float)


def number(text: str, convert: Callable[[str], _T], noun: str, ok: Callable[[_T], bool], rule: str) -> _T:
    """`text` converted, and within its rule; otherwise an error naming the value and the rule."""
    try:
        v = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not {noun}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(rule)
    return v


def positive_int(text: str) -> int:
    """Counts: 1 or more."""
    return number(text, int, "a whole number", lambda v: v >= 1, "must be 1 or more")


def nonneg_int(text: str) -> int:
    """Counts that may be 0."""
    return number(text, int, "a whole number", lambda v: v >= 0, "must be 0 or more")


def positive_float(text: str) -> float:
    return number(text, float, "a number", lambda v: 0 < v < float("inf"), "must be a finite number more than 0")


def percent(text: str) -> float:
    return number(text, float, "a number", lambda v: 0 <= v <= 100, "must be a percentage from 0 to 100")
