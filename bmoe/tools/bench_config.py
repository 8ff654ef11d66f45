"""`bmoe-bench run`'s configurations: a name and the bmoe-cli flags it runs with, and their order.

The benchmark sets some bmoe-cli flags itself (CONTROLLED); a configuration may not override them,
or its runs would not measure what the report says they measure.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bmoe.base import StreamSettings, nonneg_int, positive_float, positive_int

BASELINE_NAME = "mmap"
BASELINE_FLAGS = ["--no-stream"]
# bmoe-cli options the benchmark sets itself; a configuration may not override them.
CONTROLLED = {"-m", "--model", "-p", "--prompt", "-f", "--file", "-n", "--n-predict", "--csv"}
# bmoe-cli options that name a file to read: made absolute, so a --checkout run (started in its own tree) finds it
INPUT_PATHS = {"--replay-routes"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


@dataclass
class Config:
    """bmoe-cli flags under a name; the name labels the configuration's runs, log files and rows.
    `checkout` is the source tree its bmoe-cli runs from (None: this one)."""

    name: str
    flags: list[str]
    checkout: Path | None = None

    @property
    def text(self) -> str:
        return shlex.join(self.flags)


def parse_checkout(text: str) -> tuple[str, Path]:
    """`NAME=DIR` -> (configuration name, a source tree holding bmoe/cli.py)."""
    name, eq, where = text.partition("=")
    path = Path(where).expanduser().resolve()
    if not eq or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DIR, e.g. before=../bmoe-main")
    if not (path / "bmoe" / "cli.py").is_file():
        raise argparse.ArgumentTypeError(f"{where!r} holds no bmoe/cli.py; give a checkout of this project "
                                         "(e.g. `git worktree add ../bmoe-before COMMIT`)")
    return name.strip(), path


def parse_config(text: str) -> Config:
    """`NAME=FLAGS` (FLAGS split like a shell would) -> Config."""
    name, eq, flags = text.partition("=")
    name = name.strip()
    if not eq or not name:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME='FLAGS', e.g. --config c1g='--cache-mb 1024 --io-threads 4'")
    if not _NAME.match(name):
        raise argparse.ArgumentTypeError(
            f"{name!r}: a configuration name is letters, digits and _.+- (it names files)")
    try:
        argv = shlex.split(flags)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot split the flags ({e})") from None
    for f in argv:
        if f.split("=", 1)[0] in CONTROLLED:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {f.split('=', 1)[0]} is set by bmoe-bench itself (-m/-p/-f/-n/--csv); "
                "pass it to bmoe-bench instead")
    return Config(name, absolute_inputs(argv))


def absolute_inputs(argv: list[str]) -> list[str]:
    """The flags with each INPUT_PATHS value made absolute (`--flag PATH` or `--flag=PATH`)."""
    out: list[str] = []
    for i, f in enumerate(argv):
        name, eq, value = f.partition("=")
        if eq and name in INPUT_PATHS:
            f = f"{name}={Path(value).expanduser().absolute()}"
        elif i and argv[i - 1] in INPUT_PATHS:
            f = str(Path(f).expanduser().absolute())
        out.append(f)
    return out


def parse_common(text: str) -> list[str]:
    """`--common 'FLAGS'` -> the flags; the benchmark's own flags are refused as in a configuration."""
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot split the flags ({e})") from None
    bad = [f for f in argv if f.split("=", 1)[0] in CONTROLLED]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]} is set by bmoe-bench itself (-m/-p/-f/-n/--csv)")
    return absolute_inputs(argv)


def _flag(flags: list[str], name: str, **kw: Any) -> Any:
    """The value bmoe-cli would take for one flag among these (its default when absent or unparsable)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(name, dest="value", **kw)
    try:
        return p.parse_known_args(flags)[0].value
    except SystemExit:
        return kw.get("default")


def overlap_of(flags: list[str]) -> bool:
    """Whether bmoe-cli streams with --overlap under these flags (the last one given wins)."""
    return _flag(flags, "--overlap", action=argparse.BooleanOptionalAction, default=StreamSettings.overlap)


def io_threads_of(flags: list[str]) -> int:
    """The I/O lanes bmoe-cli runs with under these flags: the bandwidth to compare it with is the
    one measured at that thread count."""
    return _flag(flags, "--io-threads", type=int, default=None) or StreamSettings.io_threads


def schedule(configs: list[Config], warmup: int, repeats: int) -> list[tuple[str, int, Config]]:
    """(phase, round, config) in run order: rounds of every configuration, round-robin."""
    out: list[tuple[str, int, Config]] = []
    for phase, rounds in (("warmup", warmup), ("measure", repeats)):
        for r in range(rounds):
            out.extend((phase, r, c) for c in configs)
    return out


def add_plan_options(p: argparse.ArgumentParser, *, warmup: int, everyone: str) -> argparse.ArgumentParser:
    """The options every round-robin benchmark takes (`bmoe-bench run`, `bmoe-bench quality`): its
    configurations and where they run from, the rounds, the memory limit, the page cache, the
    sampling and the output. `everyone` names who --common applies to."""
    p.add_argument("--config", action="append", type=parse_config, default=[], metavar="NAME='FLAGS'",
                   help="a configuration: a name and the bmoe-cli flags it adds to --common; repeat for more")
    p.add_argument("--checkout", action="append", type=parse_checkout, default=[], metavar="NAME=DIR",
                   help="run configuration NAME's bmoe-cli from the source tree DIR (another git worktree), so a "
                        "code change is measured against the code before it in one benchmark, round-robin")
    p.add_argument("--common", type=parse_common, default=[], metavar="'FLAGS'",
                   help=f"bmoe-cli flags for every configuration, {everyone} included (e.g. '-t 2 -c 512')")
    p.add_argument("--repeats", type=positive_int, default=3, help="measured rounds (default 3)")
    p.add_argument("--warmup", type=nonneg_int, default=warmup, help=f"warm-up rounds, not counted (default {warmup})")
    p.add_argument("--mem-limit-mb", type=positive_float, default=None, metavar="M",
                   help="run each bmoe-cli process tree with only M MiB of memory (cgroup, else a balloon)")
    p.add_argument("--limit-method", choices=("auto", "cgroup", "balloon"), default="auto",
                   help="how --mem-limit-mb is applied: auto (default) = cgroup, falling back to a balloon")
    p.add_argument("--cgroup-parent", default=None, metavar="PATH",
                   help="cgroup (relative to the memory controller's root) under which per-run cgroups "
                        "are made; default: the cgroup bmoe-bench runs in, so the runs stay inside any "
                        "limit and accounting that applies to it ('/' = the top level)")
    p.add_argument("--drop-caches", choices=("all", "file", "none"), default="all",
                   help="before each run: 'all' (default) = drop the model file from the page cache and "
                        "echo 1 > /proc/sys/vm/drop_caches when writable; 'file' = the model file only")
    p.add_argument("--timeout", type=float, default=0.0, metavar="S",
                   help="kill a run after S seconds (default: no limit)")
    p.add_argument("--sample-interval", type=positive_float, default=0.1, metavar="S",
                   help="memory sampling interval in seconds (default 0.1)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default bench/reports/<date-time>)")
    return p
