"""What a run is asked to do, in groups, each default written once, and the one check of it.

`bmoe-cli`'s flags take their defaults from these classes (bmoe.flags), so the help text, a
session and a Python caller all get the same run. `validate` is pure: it looks at the settings
alone, never at the model or the machine (bmoe.budget decides what the machine allows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bmoe.cache_policy import DEFAULT_POLICY, POLICIES


class ConfigError(ValueError):
    """A setting that cannot work (alone, or with this model); the message names the fix."""


@dataclass(frozen=True)
class CacheSettings:
    """The expert cache: its budget and which slice it gives up first."""

    mb: float | None = None  # None: `auto`, sized from memory (bmoe.budget)
    floor_mb: float | None = None  # memory `auto` leaves to the system; None: FLOOR_MB
    ceil_mb: float | None = None  # the most `auto` may take; None: no cap
    force: bool = False  # accept a budget below one token's working set
    policy: str = DEFAULT_POLICY
    preload: bool = False  # read every expert at start when the budget holds them all
    adapt: bool = False  # a fixed `mb` also follows free memory (auto always does)
    warm_start: bool = True  # fill from the model's usage profile at start, save it at exit (bmoe.warm_fill)
    usage_dir: str | None = None  # where usage profiles live; None: bmoe.usage_profile.default_dir()

    FLOOR_MB = 1536.0

    @property
    def adaptive(self) -> bool:
        return self.mb is None or self.adapt


@dataclass(frozen=True)
class StreamSettings:
    """Where expert bytes come from and how the reads are waited for."""

    enabled: bool = True  # False: plain llama.cpp (mmap), the reference output
    io_threads: int = 2
    odirect: bool = True
    lane_timeout: float = 30.0
    shm_backend: str = "auto"
    overlap: bool = True  # wait for down slices only before the down matmul


@dataclass(frozen=True)
class SpecSettings:
    """Reads ahead: temporal prefetch and the spec-gate's next-layer prediction."""

    prefetch: int = 0  # layers ahead to read the previous token's experts for
    gate: bool = False
    warmup: int = 512  # predictions scored before the recall governor may switch the gate off
    recall_min: float = 75.0
    precision: float = 70.0  # see bench/reports/2026-11-29-issue5 and bmoe.speculation.Confidence


@dataclass(frozen=True)
class SamplerSettings:
    """llama.cpp's sampler chain; temp 0 is greedy."""

    temp: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0


@dataclass(frozen=True)
class Settings:
    model: str
    n_ctx: int = 2048
    threads: int = 0  # 0: every core
    verbose: bool = False
    route_trace: str | None = None
    pin_dense: bool = False  # mlock the dense weights in llama.cpp's mapping (bmoe.dense)
    parallel: int = 1  # KV sequences that may decode together in one batch (Model.batch, bmoe.scheduler)
    cache: CacheSettings = field(default_factory=CacheSettings)
    streaming: StreamSettings = field(default_factory=StreamSettings)
    speculation: SpecSettings = field(default_factory=SpecSettings)
    sampler: SamplerSettings = field(default_factory=SamplerSettings)

    @property
    def reads_ahead(self) -> bool:
        return bool(self.speculation.prefetch or self.speculation.gate)


def _ahead_flags(s: Settings) -> str:
    flags = [f for f, on in (("--prefetch", s.speculation.prefetch), ("--spec-gate", s.speculation.gate)) if on]
    return " and ".join(flags)


def validate(s: Settings) -> None:
    """Raise ConfigError for settings that contradict each other, in the user's (flag) words."""
    c = s.cache
    if s.n_ctx < 1:
        raise ConfigError(f"-c {s.n_ctx}: the context needs at least one token")
    if s.parallel < 1:
        raise ConfigError(f"--parallel {s.parallel}: at least one sequence decodes")
    if s.streaming.io_threads < 1:
        raise ConfigError(f"--io-threads {s.streaming.io_threads}: streaming needs at least one I/O lane")
    if c.policy not in POLICIES:
        raise ConfigError(f"unknown cache policy {c.policy!r}; choose one of {', '.join(POLICIES)}")
    if c.mb is not None and c.mb < 0:
        raise ConfigError(f"--cache-mb {c.mb:g}: a budget is 0 (no cache), a positive number of MiB, or auto")
    if s.reads_ahead and not s.streaming.enabled:
        raise ConfigError(f"{_ahead_flags(s)} stream experts; drop them or drop --no-stream")
    sizing = [f for f, v in (("--cache-floor-mb", c.floor_mb), ("--cache-ceil-mb", c.ceil_mb)) if v is not None]
    if sizing and c.mb is not None and (c.ceil_mb is not None or not c.adapt):
        raise ConfigError(f"{' and '.join(sizing)} size --cache-mb auto, and --cache-mb {c.mb:g} is fixed; "
                          f"drop {' and '.join(sizing)} or use --cache-mb auto")
    if sizing and not s.streaming.enabled:
        raise ConfigError(f"{' and '.join(sizing)} size the expert cache, and --no-stream has none; "
                          "drop one of them")
    if c.ceil_mb == 0:
        raise ConfigError("--cache-ceil-mb 0 leaves --cache-mb auto no room; for no cache say --cache-mb 0")
    if s.pin_dense and not s.streaming.enabled:
        raise ConfigError("--pin-dense keeps the dense weights resident while experts stream, and --no-stream "
                          "streams nothing; drop one of them")
    if c.adapt and (c.mb == 0 or not s.streaming.enabled):
        raise ConfigError("--adapt moves the expert cache's budget with free memory, and "
                          f"{'--cache-mb 0' if s.streaming.enabled else '--no-stream'} has no cache; drop one of them")
    if c.usage_dir is not None and not c.warm_start:
        raise ConfigError("--usage-dir names where usage profiles are kept, and --no-warm-start uses none; "
                          "drop one of them")
    if s.reads_ahead and c.mb == 0:
        raise ConfigError(f"{_ahead_flags(s)} read experts ahead into the cache, and --cache-mb 0 has none; "
                          "give it a budget (--cache-mb N or auto)")
