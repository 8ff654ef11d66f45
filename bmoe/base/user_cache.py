"""Where bmoe keeps what it builds and learns for the user: $XDG_CACHE_HOME/bmoe (~/.cache/bmoe).

One function, so the demo models, their calibration states, the usage profiles and the tests that
look for them all agree on the folder."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/bmoe, else ~/.cache/bmoe (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bmoe"
