"""Command lines: every setting's flag generated from its declaration (bmoe.base.settings), and
bmoe-cli's own flags (prompt, outputs, session) around them.

`bmoe-cli` and `bmoe-server` both build their parsers with `add_options`; a flag's value is None
unless it was given, so `settings_from` knows what the user set (validation can tell a given
`--overlap` from the default one) and every default comes from its field.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, Protocol

from bmoe.base import FLAGS, N_PREDICT, SCHEMA, ConfigError, Entry, Settings, build, positive_int, validate

CLI_EXAMPLES = """\
examples:
  bmoe-cli                                   # built-in demo model and prompt
  bmoe-cli -m model.gguf -p "Why is the sky blue?" -n 128 --cache-mb 2000 --io-threads 4
  bmoe-cli -m model.gguf -f prompt.txt --chat --cache-mb 0
  bmoe-cli -m model.gguf -p "Hello" --cache-mb 1500 --cache-policy lru   # the classic LRU cache
  bmoe-cli -m model.gguf -p "Hello" --no-stream     # plain llama.cpp, the reference output
  bmoe-cli -m model.gguf -p "Hello" --temp 0.8 --min-p 0.05 --frequency-penalty 0.5   # llama.cpp's samplers
  bmoe-cli -m model.gguf -p "Hello" --progress --csv run.csv --profile   # telemetry for apps and benchmarks
  bmoe-cli -m model.gguf -f edit.txt --draft ngram --draft-max 4   # guess tokens from the prompt, verify in one decode
  bmoe-cli -m model.gguf -f edit.txt --draft ngram --no-draft-gate   # draft every step, even when it does not pay
  bmoe-cli --session -m model.gguf --cache-mb 2000  # serve JSON-lines requests on stdin
  bmoe-cli -m model.gguf -p "Hello" --usage-dir ~/bmoe-usage   # keep usage profiles (warm starts) there
"""

DEFAULT_PROMPT = "Once upon a time"


class Flags(Protocol):
    """An argparse parser or argument group: what flags are added to."""

    def add_argument(self, *names: str, **kw: Any) -> argparse.Action: ...


Adder = Callable[[Any], None]  # adds an edge's own flags to the parser it is given


def _shown(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


class _Extend(argparse.Action):
    """A repeatable flag whose values are tuples: each given adds to the ones before (argparse's "extend"
    makes a list, and settings are frozen)."""

    def __call__(self, ap: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(ns, self.dest, (getattr(ns, self.dest) or ()) + tuple(values))


def add_options(ap: Flags, entries: tuple[Entry, ...],
                before: dict[str, Adder] | None = None) -> None:
    """A flag per declared setting, in declaration order; `before[name]` adds an edge's own flags
    just before that setting's. Every flag's value is None unless given."""
    for e in entries:
        if before and e.name in before:
            before[e.name](ap)
        o = e.option
        kw: dict[str, Any] = {"dest": o.name, "default": None, "help": o.help.format(default=_shown(e.default))}
        if e.type is bool:
            kw["action"] = (argparse.BooleanOptionalAction if o.toggle
                            else "store_false" if o.flag.startswith("--no-") else "store_true")
        else:
            kw.update(type=o.parse, metavar=o.metavar, choices=o.choices)
            if o.repeat:
                kw["action"] = _Extend
        ap.add_argument(*filter(None, (o.short, o.flag, o.alias)), **kw)


def given(ns: argparse.Namespace, entries: tuple[Entry, ...] = SCHEMA) -> dict[str, Any]:
    """The settings the command line set, by keyword."""
    return {e.name: v for e in entries if (v := getattr(ns, e.name, None)) is not None}


def settings_from(ap: argparse.ArgumentParser, ns: argparse.Namespace) -> Settings:
    """The flags' Settings, validated in flag words; a contradiction is a usage error (exit 2). The
    model is not looked at yet (none given: the demo model, built later if missing)."""
    values = given(ns)
    s = build(values)
    try:
        validate(s, FLAGS, frozenset(values))
    except ConfigError as e:
        ap.error(str(e))
    return s


def add_n_predict(ap: argparse.ArgumentParser, help: str = f"tokens to generate (default {N_PREDICT})") -> None:  # noqa: A002
    ap.add_argument("-n", "--n-predict", type=positive_int, default=N_PREDICT, help=help)


def build_parser() -> argparse.ArgumentParser:
    """bmoe-cli's parser."""
    ap = argparse.ArgumentParser(
        prog="bmoe-cli", epilog=CLI_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a Mixture-of-Experts GGUF larger than RAM: routed experts are read from "
                    "flash into a bounded shared-memory cache; output equals plain llama.cpp.")

    def prompt(ap: argparse.ArgumentParser) -> None:
        src = ap.add_mutually_exclusive_group()
        src.add_argument("-p", "--prompt", help=f"prompt text (default: {DEFAULT_PROMPT!r})")
        src.add_argument("-f", "--file", help="read the prompt from this file")
        add_n_predict(ap)

    def chat(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's own chat template")

    def outputs(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--progress", action="store_true",
                        help="machine-readable BMOE_LOAD/BMOE_PROGRESS lines per token, then the answer and perf "
                             "banners")
        ap.add_argument("--csv", metavar="PATH",
                        help="also write one CSV row per token (and PATH.procs.csv with --profile)")
        ap.add_argument("--profile", action="store_true",
                        help="at the end, a table of every process of the run (CPU, peak RSS, shared, reads) on "
                             "stderr")

    add_options(ap, SCHEMA, before={"threads": prompt, "temp": chat, "route_trace": outputs})
    ap.add_argument("--session", action="store_true",
                    help="keep the model loaded and serve JSON requests from stdin, one per line, answering with "
                         "BMOE_* lines on stdout (see the telemetry contract's Session mode)")
    return ap
