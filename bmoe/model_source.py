"""Which model file a run uses: the path it was given or, with none, the demo model (built on
first use, bmoe.tools.demo) with a cache budget of about a quarter of its experts.

Every edge (bmoe-cli, the session, bmoe-server, bmoe.load) resolves its model here, so the
no-argument runs of each are the same run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from bmoe.settings import Settings


def resolve(s: Settings, progress: Callable[[str], None]) -> Settings:
    """`s` with its model: as given, or (an empty model path) the demo model and, unless the cache
    was sized, the demo's budget. `progress` hears of a first-use build."""
    if s.model:
        return s
    from bmoe.tools.demo import default_model

    path, demo_cache_mb = default_model(progress=progress)
    cache = s.cache
    if cache.mb is None and cache.floor_mb is None and cache.ceil_mb is None:
        cache = replace(cache, mb=demo_cache_mb)
    return replace(s, model=str(path), cache=cache)
