"""Every line of the telemetry contract (shared/spec/telemetry.md), written and parsed in one place.

The formats are the user's: keep every word, unit, key and column order. `Tally` turns the
engine's per-token measurements into the contract's units for every edge (one-shot, session).
The parser is what tests, the session client and `bmoe-bench` read output with; it reads JSON
by key and CSV by column name, as the contract asks consumers to.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from bmoe.base.units import MiB

# cache_budget_mib is bmoe's trailing column after the contract's nine (the contract's CSV is
# additive, read by column name): the budget in force that token, which an adaptive cache moves.
CSV_COLUMNS = ("step", "steps", "wall_ms", "io_ms", "compute_ms", "read_bytes", "cache_hit_pct",
               "stall_ms", "mgmt_ms", "cache_budget_mib")
# A run with lossy routing (bmoe.streaming.lossy) has three more: experts dropped and substituted that token
# (over every layer), and the mean share of a layer's routing weight not computed as the router chose
LOSSY_COLUMNS = ("dropped", "substituted", "weight_changed_pct")
# Last in every run (after the lossy ones too, so no column moves): what the I/O lanes copied from the page
# cache instead of reading the device that token, in bytes and lane busy ms (bmoe.workers.io_lane.PageCache).
# read_bytes and overlap's io_ms leave them out: the contract's are flash reads
PAGE_CACHE_COLUMNS = ("page_cache_bytes", "page_cache_ms")
# A run with --draft (bmoe.engine.drafts) has three more after those: the verify step's drafts, the drafts accepted
# and the bytes read for experts only its drafted rows routed, on the step's first token (0 on the others)
DRAFT_COLUMNS = ("drafted", "accepted", "draft_extra_bytes")
CSV_OPTIONAL = ("stall_ms", "mgmt_ms", "dropped", "substituted", "weight_changed_pct", *PAGE_CACHE_COLUMNS,
                *DRAFT_COLUMNS)
ANSWER_BANNER = "=== answer ==="
PERF_BANNER = "=== perf ==="


@dataclass
class TokenStat:
    """One decode step (sample a token, then decode it) as the engine measured it: ns and bytes."""

    wall_ns: int
    io_ns: int  # serial: blocked on reads; overlap: the lanes' busy time reading the device
    mgmt_ns: int
    read_bytes: int  # from the device
    hits: int
    lookups: int
    stall_ns: int = 0
    budget_bytes: int = 0  # the cache budget in force after this token
    dropped: int = 0  # lossy routing (bmoe.streaming.lossy): experts dropped over the layers
    substituted: int = 0
    weight_changed_pct: float = 0.0  # mean over the layers of the routing weight's share changed
    page_cache_bytes: int = 0  # copied from the page cache instead of read from the device
    page_cache_ns: int = 0  # the lanes' busy time copying them
    drafted: int = 0  # --draft: the verify step's drafts and those accepted, on its first token
    accepted: int = 0
    draft_extra_bytes: int = 0  # read for experts only its drafted rows routed (bmoe.engine.drafts.DraftReads)


@dataclass
class TokenLine:
    """One generated token's accounting, in the contract's units."""

    step: int
    steps: int
    wall_ms: float
    io_ms: float
    mgmt_ms: float
    stall_ms: float
    read_bytes: int
    cache_hit_pct: float
    overlap: bool = False
    budget_bytes: int = 0
    hits: int = 0  # this token's cache lookups that found the expert resident
    lookups: int = 0
    dropped: int = 0  # lossy routing's changes this token (TokenStat)
    substituted: int = 0
    weight_changed_pct: float = 0.0
    page_cache_bytes: int = 0  # TokenStat's
    page_cache_ms: float = 0.0
    drafting: bool = False  # the run drafts (--draft): the lines carry the drafts' keys and columns
    drafted: int = 0  # TokenStat's
    accepted: int = 0
    draft_extra_bytes: int = 0

    @property
    def compute_ms(self) -> float:
        """The residual: no clock runs around llama.cpp's kernels."""
        lost = self.stall_ms if self.overlap else self.io_ms
        return self.wall_ms - lost - self.mgmt_ms

    @property
    def read_mb(self) -> float:
        return self.read_bytes / MiB


def _json(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def tagged(tag: str, obj: dict[str, Any]) -> str:
    return f"BMOE_{tag} {_json(obj)}"


def load_line(t: TokenLine) -> str:
    return tagged("LOAD", {"mb": round(t.read_mb, 4), "ms": round(t.io_ms, 3)})


def progress_fields(t: TokenLine) -> dict[str, Any]:
    """BMOE_PROGRESS's fields but the text, rounded as the line prints them (bmoe-server sends them too)."""
    return {
        "step": t.step, "steps": t.steps, "wall_ms": round(t.wall_ms, 3), "io_ms": round(t.io_ms, 3),
        "compute_ms": round(t.compute_ms, 3), "mgmt_ms": round(t.mgmt_ms, 3),
        "stall_ms": round(t.stall_ms, 3), "read_mb": round(t.read_mb, 4),
        "cache_hit_pct": round(t.cache_hit_pct, 2),
    }


def draft_fields(t: TokenLine) -> dict[str, Any]:
    """With --draft, bmoe's trailing keys after BMOE_PROGRESS's (bmoe-server's token chunks too): the verify step's
    drafts, those accepted and the MiB read for experts only its drafted rows routed (on its first token, 0 on the
    others); none without it."""
    if not t.drafting:
        return {}
    return {"drafted": t.drafted, "accepted": t.accepted, "draft_extra_mb": round(t.draft_extra_bytes / MiB, 4)}


def progress_line(t: TokenLine, text: str) -> str:
    """BMOE_PROGRESS, with --draft's trailing keys after the contract's (`draft_fields`)."""
    return tagged("PROGRESS", {**progress_fields(t), "text": text, **draft_fields(t)})


def verify_counts(lines: Sequence[TokenLine], most: int) -> tuple[int, tuple[int, ...]]:
    """The verify steps of a generation's tokens (a step's drafts are on its first token) and, per draft position
    up to `most`, the steps that accepted a draft there: llama-server's n_draft_verif_steps and
    n_accepted_per_pos (nothing per position without a verify step, as llama-server's)."""
    accepted = [t.accepted for t in lines if t.drafted]
    return len(accepted), tuple(sum(a > i for a in accepted) for i in range(most)) if accepted else ()


def token_lines(t: TokenLine, text: str) -> list[str]:
    """The per-token lines in order: BMOE_LOAD only when experts were read."""
    lines = [load_line(t)] if t.read_bytes > 0 else []
    lines.append(progress_line(t, text))
    return lines


@dataclass
class RunTotals:
    """Per-run sums the summary lines are computed from."""

    tokens: int
    wall_s: float
    io_s: float
    mgmt_s: float
    stall_s: float
    read_bytes: int
    overlap: bool = False
    dropped: int = 0
    substituted: int = 0
    weight_changed_pct: float = 0.0  # summed over the tokens (per_tok gives the mean)
    page_cache_bytes: int = 0
    drafting: bool = False  # --draft: the summary lines carry the drafts' figures
    drafted: int = 0
    accepted: int = 0
    draft_extra_bytes: int = 0

    @classmethod
    def of(cls, lines: Iterable[TokenLine], overlap: bool = False) -> RunTotals:
        ls = list(lines)
        return cls(len(ls), sum(t.wall_ms for t in ls) / 1e3, sum(t.io_ms for t in ls) / 1e3,
                   sum(t.mgmt_ms for t in ls) / 1e3, sum(t.stall_ms for t in ls) / 1e3,
                   sum(t.read_bytes for t in ls), overlap, sum(t.dropped for t in ls),
                   sum(t.substituted for t in ls), sum(t.weight_changed_pct for t in ls),
                   sum(t.page_cache_bytes for t in ls), any(t.drafting for t in ls), sum(t.drafted for t in ls),
                   sum(t.accepted for t in ls), sum(t.draft_extra_bytes for t in ls))

    def draft_keys(self) -> str:
        """bmoe's trailing keys of a --draft run's summary lines (none without it)."""
        if not self.drafting:
            return ""
        return f" drafted={self.drafted} accepted={self.accepted} draft_extra_mib={self.draft_extra_bytes / MiB:.2f}"

    @property
    def compute_s(self) -> float:
        lost = self.stall_s if self.overlap else self.io_s
        return self.wall_s - lost - self.mgmt_s

    def per_tok(self, x: float) -> float:
        return x / self.tokens if self.tokens else 0.0


class Tally:
    """One generation's token lines, each with the cache hit rate so far: -1 until a cache is in use
    (`cache_active` at the start, or a token that ran with a budget: an adaptive one can come back)."""

    def __init__(self, steps: int, overlap: bool, cache_active: bool, drafting: bool = False) -> None:
        self.steps = steps
        self.overlap = overlap
        self.drafting = drafting
        self.cache_active = cache_active
        self.lines: list[TokenLine] = []
        self.hits = self.lookups = 0

    @property
    def hit_pct(self) -> float:
        if not self.cache_active:
            return -1.0
        return 100.0 * self.hits / self.lookups if self.lookups else 0.0

    def add(self, st: TokenStat) -> TokenLine:
        self.cache_active |= st.budget_bytes > 0
        self.hits += st.hits
        self.lookups += st.lookups
        line = TokenLine(step=len(self.lines) + 1, steps=self.steps, wall_ms=st.wall_ns / 1e6,
                         io_ms=st.io_ns / 1e6, mgmt_ms=st.mgmt_ns / 1e6, stall_ms=st.stall_ns / 1e6,
                         read_bytes=st.read_bytes, cache_hit_pct=self.hit_pct, overlap=self.overlap,
                         budget_bytes=st.budget_bytes, hits=st.hits, lookups=st.lookups, dropped=st.dropped,
                         substituted=st.substituted, weight_changed_pct=st.weight_changed_pct,
                         page_cache_bytes=st.page_cache_bytes, page_cache_ms=st.page_cache_ns / 1e6,
                         drafting=self.drafting, drafted=st.drafted, accepted=st.accepted,
                         draft_extra_bytes=st.draft_extra_bytes)
        self.lines.append(line)
        return line

    def totals(self) -> RunTotals:
        return RunTotals.of(self.lines, overlap=self.overlap)


def generation_line(t: RunTotals) -> str:
    """The contract's generation line; a --draft run's has bmoe's trailing keys (RunTotals.draft_keys)."""
    tok_s = t.tokens / t.wall_s if t.wall_s > 0 else 0.0
    return f"generation: {t.tokens} tokens, {t.per_tok(t.wall_s):.4f} s/token ({tok_s:.2f} tok/s)" + t.draft_keys()


def stream_line(t: RunTotals) -> str:
    """The contract's moe-stream line, of flash reads only; when the lanes copied some experts from the
    page cache instead, bmoe's trailing `page_cache_mib=` says how much (memory's copies would make the
    MiB/s memory's rate)."""
    mib = t.read_bytes / MiB
    bw = mib / t.io_s if t.io_s > 0 else 0.0
    line = (f"moe-stream: read {mib:.2f} MiB ({t.per_tok(mib):.2f} MiB/token), "
            f"decode {t.per_tok(t.wall_s):.4f} s/token (compute {t.per_tok(t.compute_s):.4f} + "
            f"cache mgmt {t.per_tok(t.mgmt_s):.4f} + flash I/O {t.per_tok(t.io_s):.4f} s/token, "
            f"{bw:.1f} MiB/s)")
    if t.overlap:
        line += f" stall_s/tok={t.per_tok(t.stall_s):.4f}"
    if t.page_cache_bytes:
        line += f" page_cache_mib={t.page_cache_bytes / MiB:.2f}"
    return line


def cache_line(hit_pct: float, resident_bytes: int) -> str:
    return f"moe-cache: {hit_pct:.1f}% hit, resident {resident_bytes / MiB:.1f} MiB"


def prefetch_line(spec_bytes: int, useful: int, prefetched: int) -> str:
    pct = 100.0 * useful / prefetched if prefetched else 0.0
    return f"moe-prefetch: {spec_bytes / MiB:.2f} MiB speculative, {useful}/{prefetched} experts useful ({pct:.1f}%)"


def spec_gate_line(recall_pct: float, disabled_below: float | None) -> str:
    line = f"moe-spec-gate: {recall_pct:.1f}% router prediction recall"
    if disabled_below is not None:
        line += f" (auto-disabled below {disabled_below:g}%)"
    return line


def lossy_line(t: RunTotals, k: int, top_k: int) -> str:
    """bmoe's `moe-lossy:` summary line, after the contract's, in a run with lossy routing (bmoe.streaming.lossy):
    the experts per token per layer, drops and substitutions per token, and the mean share of a
    layer's routing weight not computed as the router chose."""
    return (f"moe-lossy: {k} of {top_k} experts per token, {t.per_tok(t.dropped):.2f} dropped + "
            f"{t.per_tok(t.substituted):.2f} substituted per token, "
            f"{t.per_tok(t.weight_changed_pct):.2f}% of routing weight changed")


def csv_header(lossy: bool = False, drafting: bool = False) -> str:
    return ",".join(CSV_COLUMNS + (LOSSY_COLUMNS if lossy else ()) + PAGE_CACHE_COLUMNS
                    + (DRAFT_COLUMNS if drafting else ()))


def csv_row(t: TokenLine, lossy: bool = False) -> str:
    row = (f"{t.step},{t.steps},{t.wall_ms:.3f},{t.io_ms:.3f},{t.compute_ms:.3f},{t.read_bytes},"
           f"{t.cache_hit_pct:.2f},{t.stall_ms:.3f},{t.mgmt_ms:.3f},{t.budget_bytes / MiB:.1f}")
    row += f",{t.dropped},{t.substituted},{t.weight_changed_pct:.3f}" if lossy else ""
    row += f",{t.page_cache_bytes},{t.page_cache_ms:.3f}"
    return row + (f",{t.drafted},{t.accepted},{t.draft_extra_bytes}" if t.drafting else "")


def csv_summary(t: RunTotals, hit_pct: float, budget_bytes: int, *, prefill_tokens: int, prefill_s: float,
                load_s: float, llama_load_s: float) -> str:
    """The `# summary` line. bmoe's additions come after the contract's keys: `cache_budget_mib=` (the
    budget at the end), then what the first token waited for, so a benchmark can report time to first
    token (load_s + prefill_s) and bmoe's own load work (load_s minus llama_load_s, llama.cpp's part),
    then `page_cache_mib=`, what the lanes copied from the page cache (not in read_mib: not flash), then a --draft
    run's drafts (RunTotals.draft_keys)."""
    tok_s = t.tokens / t.wall_s if t.wall_s > 0 else 0.0
    return (f"# summary tokens={t.tokens} s/tok={t.per_tok(t.wall_s):.4f} tok/s={tok_s:.2f} "
            f"read_mib={t.read_bytes / MiB:.2f} io_s/tok={t.per_tok(t.io_s):.4f} "
            f"compute_s/tok={t.per_tok(t.compute_s):.4f} cache_hit_pct={hit_pct:.2f} "
            f"stall_s/tok={t.per_tok(t.stall_s):.4f} mgmt_s/tok={t.per_tok(t.mgmt_s):.4f} "
            f"cache_budget_mib={budget_bytes / MiB:.1f} prefill_tokens={prefill_tokens} "
            f"prefill_s={prefill_s:.4f} load_s={load_s:.4f} llama_load_s={llama_load_s:.4f} "
            f"page_cache_mib={t.page_cache_bytes / MiB:.2f}{t.draft_keys()}")


# ---- parsing -------------------------------------------------------------------------------------

_TAGGED = re.compile(r"^BMOE_([A-Z]+) (\{.*\})$")
# a number as the writers print it (`:.2f`, `:g`), nan and inf included: a run that divided by zero still parses
_NUM = r"(-?(?:\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|nan|inf))"
_NOTICE = "bmoe: "  # how bmoe-cli's notices on stderr begin
SUMMARY_GRAMMAR = {
    "generation": re.compile(rf"^generation: (\d+) tokens, {_NUM} s/token \({_NUM} tok/s\)"
                             rf"(?: drafted=(\d+) accepted=(\d+) draft_extra_mib={_NUM})?$"),
    "moe-stream": re.compile(
        rf"^moe-stream: read {_NUM} MiB \({_NUM} MiB/token\), decode {_NUM} s/token \(compute {_NUM} \+ "
        rf"cache mgmt {_NUM} \+ flash I/O {_NUM} s/token, {_NUM} MiB/s\)(?: stall_s/tok={_NUM})?"
        rf"(?: page_cache_mib={_NUM})?$"),
    "moe-cache": re.compile(rf"^moe-cache: {_NUM}% hit, resident {_NUM} MiB$"),
    "moe-prefetch": re.compile(rf"^moe-prefetch: {_NUM} MiB speculative, (\d+)/(\d+) experts useful \({_NUM}%\)$"),
    "moe-spec-gate": re.compile(rf"^moe-spec-gate: {_NUM}% router prediction recall"
                                rf"(?: \(auto-disabled below {_NUM}%\))?$"),
    "moe-lossy": re.compile(rf"^moe-lossy: (\d+) of (\d+) experts per token, {_NUM} dropped \+ {_NUM} substituted "
                            rf"per token, {_NUM}% of routing weight changed$"),
}
SUMMARY_FIELDS = {
    "generation": ("tokens", "s_per_token", "tok_s", "drafted", "accepted", "draft_extra_mib"),
    "moe-stream": ("read_mib", "mib_per_token", "decode_s_per_token", "compute_s_per_token",
                   "mgmt_s_per_token", "io_s_per_token", "mib_per_s", "stall_s_per_token", "page_cache_mib"),
    "moe-cache": ("hit_pct", "resident_mib"),
    "moe-prefetch": ("speculative_mib", "useful", "prefetched", "useful_pct"),
    "moe-spec-gate": ("recall_pct", "disabled_below_pct"),
    "moe-lossy": ("experts_per_token", "top_k", "dropped_per_token", "substituted_per_token", "weight_changed_pct"),
}


def _num(s: str | None) -> float | int | None:
    if s is None:
        return None
    return int(s) if re.fullmatch(r"-?\d+", s) else float(s)


def parse_tagged(line: str) -> tuple[str, dict[str, Any]] | None:
    """`BMOE_<TAG> {json}` → (TAG, object); None for any other line."""
    m = _TAGGED.match(line.rstrip("\n"))
    if not m:
        return None
    try:
        obj = json.loads(m.group(2))
    except json.JSONDecodeError:
        return None
    return (m.group(1), obj) if isinstance(obj, dict) else None


def parse_summary(line: str) -> tuple[str, dict[str, Any]] | None:
    """A `generation:` / `moe-*:` end-of-run line → (kind, fields); None otherwise."""
    line = line.rstrip("\n")
    kind = line.split(":", 1)[0]
    rx = SUMMARY_GRAMMAR.get(kind)
    m = rx.match(line) if rx else None
    if not m:
        return None
    return kind, {k: _num(v) for k, v in zip(SUMMARY_FIELDS[kind], m.groups())}


@dataclass
class ParsedRun:
    """Everything a consumer reads from one `bmoe-cli` stdout."""

    events: list[tuple[str, dict[str, Any]]]
    summary: dict[str, dict[str, Any]]
    answer: str | None
    stray: list[str]


def parse_output(stdout: str) -> ParsedRun:
    """Split a `--progress` stdout into events, banners' answer and summary; anything else is stray."""
    events, summary, stray = [], {}, []
    answer_lines: list[str] | None = None
    section = "tokens"
    for line in stdout.splitlines():
        tagged_ = parse_tagged(line)
        if tagged_ and section == "tokens":
            events.append(tagged_)
        elif line == ANSWER_BANNER and section == "tokens":
            section, answer_lines = "answer", []
        elif line == PERF_BANNER and section == "answer":
            section = "perf"
        elif section == "answer":
            assert answer_lines is not None  # set with the section
            answer_lines.append(line)
        elif section == "perf" and (parsed := parse_summary(line)):
            kind, fields = parsed
            summary[kind] = fields
        else:
            stray.append(line)
    return ParsedRun(events, summary, None if answer_lines is None else "\n".join(answer_lines), stray)


def parse_run_summary(stdout: str, stderr: str = "") -> dict[str, dict[str, Any]]:
    """A run's end-of-run lines by kind, with or without --progress (`parse_output` needs --progress).

    They are the last lines of stdout, from the last `generation:` line on, so an answer that
    happens to contain such a line cannot pass for them. A kind stdout lacks is taken from a notice
    on stderr: bmoe-cli prints `bmoe: moe-prefetch: ...` there for --spec-gate without --prefetch.
    """
    parsed = [parse_summary(line) for line in stdout.splitlines()]
    starts = [i for i, p in enumerate(parsed) if p and p[0] == "generation"]
    summary = dict(p for p in parsed[starts[-1]:] if p) if starts else {}
    notices = (parse_summary(line[len(_NOTICE):]) for line in stderr.splitlines()
               if line.startswith(_NOTICE))
    return {**dict(p for p in notices if p), **summary}


def _numbers(pairs: Iterable[Sequence[Any]]) -> dict[str, float]:
    """The pairs whose value is a number: a run killed mid-line leaves a cut value behind."""
    out = {}
    for k, v in pairs:
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            pass
    return out


def read_csv(text: str) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Rows by column name (older files without the trailing columns read as 0) and the summary;
    a value that is not a number is left out of its row."""
    rows, summary = [], {}
    data_lines = []
    for line in text.splitlines():
        if line.startswith("# summary"):
            summary = _numbers(kv.split("=", 1) for kv in line[len("# summary"):].split() if "=" in kv)
        elif line.strip() and not line.startswith("#"):
            data_lines.append(line)
    for rec in csv.DictReader(io.StringIO("\n".join(data_lines))):
        row = _numbers(rec.items())  # a row longer than the header puts a list under None: left out
        for col in CSV_OPTIONAL:
            row.setdefault(col, 0.0)
        rows.append(row)
    return rows, summary
