"""How big the expert cache may be: the `--cache-mb` rules, pure (the caller reads the machine).

A budget below one layer's routed set cannot run at all; below one token's working set (every
MoE layer's top-k, page-rounded as the cache charges them) it only thrashes, so it is refused
unless forced, and `auto` falls back to no cache instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from bmoe.settings import CacheSettings, ConfigError
from bmoe.units import MiB


def mib_up(nbytes: int) -> str:
    """MiB rounded up to 0.1, so a number printed as "use --cache-mb N" is enough."""
    return f"{-(-nbytes * 10 // MiB) / 10:g}"


def auto_cache_bytes(expert_bytes: int, available: int, floor_mb: float,
                     ceil_mb: float | None = None) -> tuple[int, str]:
    """The `--cache-mb auto` budget: the least of available memory minus the floor, the ceiling and
    every expert's bytes; with the terms it compared, for the notice that reports it."""
    terms = [(max(0, available - int(floor_mb * MiB)),
              f"available {available / MiB:.0f} MiB minus --cache-floor-mb {floor_mb:g}"),
             (expert_bytes, f"experts total {expert_bytes / MiB:.0f} MiB")]
    if ceil_mb is not None:
        terms.append((int(ceil_mb * MiB), f"--cache-ceil-mb {ceil_mb:g}"))
    budget = min(b for b, _ in terms)
    why = "; ".join(f"{'=> ' if b == budget else ''}{what}" for b, what in terms)
    return budget, why


@dataclass(frozen=True)
class Budget:
    bytes: int
    notice: str | None = None  # what `auto` chose and why, for the user


def decide(cache: CacheSettings, reads_ahead: bool, expert_bytes: int, layer_need: int, token_need: int,
           available: int) -> Budget:
    """The cache budget in bytes for this model, or a ConfigError that names the fix.

    `layer_need` / `token_need`: one layer's / one token's working set (bmoe.expert_cache.working_sets).
    """
    notice = None
    if cache.mb is not None:
        budget = int(cache.mb * MiB)
    else:
        budget, why = auto_cache_bytes(expert_bytes, available, cache.floor, cache.ceil_mb)
        notice = f"cache budget {budget / MiB:.1f} MiB (auto, the least of: {why})"
        if 0 < budget < token_need and not cache.force:
            notice += (f"; that is below one token's working set ({token_need / MiB:.1f} MiB), where a "
                       "cache thrashes, so this run has none (as --cache-mb 0); --force keeps it")
            budget = 0
        if reads_ahead and budget <= 0:
            raise ConfigError("--prefetch and --spec-gate read experts ahead into the cache, and --cache-mb "
                              "auto found no room for one; free memory, lower --cache-floor-mb, or drop "
                              "those flags")
    what = "--cache-mb " + (f"{cache.mb:g}" if cache.mb is not None else f"auto ({budget / MiB:.1f})")
    if 0 < budget < layer_need:
        raise ConfigError(f"{what} is below one layer's working set ({layer_need / MiB:.1f} MiB), which even "
                          f"--force cannot run; use --cache-mb {mib_up(token_need)} (one token's working set) "
                          "or more, or 0 for no cache")
    if 0 < budget < token_need and not cache.force:
        raise ConfigError(f"{what} is below one token's working set ({token_need / MiB:.1f} MiB): the cache "
                          "would thrash, each token evicting experts the next one needs again; use --cache-mb "
                          f"{mib_up(token_need)} or more, 0 for no cache, or --force to run with it anyway")
    return Budget(budget, notice)
