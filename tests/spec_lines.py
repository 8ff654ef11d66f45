"""The telemetry contract's literal lines (tests/data/telemetry_spec_lines.txt), for checking output against.

Nothing here comes from bmoe: the keys, words, units and column order are read from the copy of
the spec's own lines, so a writer that drifts from the spec fails even when bmoe's parser and
constants drift with it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data" / "telemetry_spec_lines.txt"


def _sections() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    lines: list[str] = []
    for raw in DATA.read_text(encoding="utf-8").splitlines():
        if raw.startswith(";") or not raw.strip():
            continue
        if raw.startswith("[") and raw.endswith("]"):
            lines = out.setdefault(raw[1:-1], [])
        elif raw.startswith(" "):
            lines[-1] += raw.strip()  # the spec wraps its JSON lines after a comma
        else:
            lines.append(raw)
    return out


SECTIONS = _sections()
_TYPES = {"<int>": int, "<float>": float, "<bool>": bool, '"<string>"': str}


def _json_template(line: str) -> tuple[str, list[tuple[str, type]]]:
    """`BMOE_TAG {"key":<type>,...}` → (TAG, [(key, type), ...]); the template must hold nothing else."""
    word, body = line.split(None, 1)
    pairs = re.findall(r'"(\w+)":("<string>"|<\w+>)', body)
    assert body == "{" + ",".join(f'"{k}":{v}' for k, v in pairs) + "}", f"unread template: {line}"
    return word.removeprefix("BMOE_"), [(k, _TYPES[v]) for k, v in pairs]


TAGGED: dict[str, list[tuple[str, type]]] = dict(_json_template(x) for x in SECTIONS["per-token"] + SECTIONS["session"])
PROGRESS_KEYS = tuple(k for k, _ in TAGGED["PROGRESS"])
DONE_KEYS = tuple(k for k, _ in TAGGED["DONE"])
ANSWER_BANNER, _ANSWER, PERF_BANNER, *_SUMMARY = SECTIONS["end-of-run"]
assert _ANSWER == "<full generated text>"
(CSV_HEADER,) = SECTIONS["csv"]
(STALL_SUFFIX,) = SECTIONS["overlap fragments"]
CSV_SUMMARY_START, *CSV_SUMMARY_GAINS = SECTIONS["csv-summary fragments"]

# the summary templates by the word before their colon, in the spec's order (moe-spec-gate has two)
SUMMARY: dict[str, list[str]] = {}
for _t in _SUMMARY + SECTIONS["prefetch"] + SECTIONS["spec-gate"]:
    SUMMARY.setdefault(_t.split(":", 1)[0], []).append(_t)

_COUNTS = {"<n>", "<useful>", "<prefetched>"}  # the placeholders that count things; the others are decimals


def line_regex(template: str) -> re.Pattern[str]:
    """A spec line as a regex: its words literal, each <placeholder> a number."""
    parts = re.split(r"(<[^<>]+>)", template)
    return re.compile("".join((r"\d+" if p in _COUNTS else r"-?\d+(?:\.\d+)?") if p.startswith("<") and p.endswith(">")
                              else re.escape(p) for p in parts))


# bmoe's own trailing item after the spec's moe-stream line (only when the lanes copied from the page cache)
PAGE_CACHE_TRAILER = re.compile(r"( page_cache_mib=[0-9]+\.[0-9]{2})?")


def summary_matches(kind: str, line: str, overlap: bool = False) -> bool:
    """`line` is one of the spec's `kind:` lines (moe-stream with the overlap suffix when `overlap`, then
    bmoe's trailing `page_cache_mib=` when there were copies)."""
    suffix = " " + STALL_SUFFIX if overlap and kind == "moe-stream" else ""
    trailer = PAGE_CACHE_TRAILER.pattern if kind == "moe-stream" else ""
    return any(re.fullmatch(line_regex(t + suffix).pattern + trailer, line) for t in SUMMARY[kind])


def check_tagged(line: str) -> tuple[str, dict[str, Any]]:
    """A `BMOE_<TAG> {json}` line with the spec's tag, keys in the spec's order and values of its types;
    bmoe's own keys may only follow them (BMOE_DONE's `page_cache_mib`)."""
    word, _, body = line.partition(" ")
    assert word.startswith("BMOE_") and word[5:] in TAGGED, f"not a tag of the spec: {line[:80]}"
    tag = word[5:]
    pairs = json.loads(body, object_pairs_hook=list)
    want = TAGGED[tag]
    assert [k for k, _ in pairs[:len(want)]] == [k for k, _ in want], f"{tag} keys differ from the spec's: {line[:200]}"
    for (k, v), (_, t) in zip(pairs, want):
        assert type(v) is t, f"{tag}.{k} = {v!r} is not the spec's {t.__name__}"
    return tag, dict(pairs)


def csv_summary_matches(line: str) -> bool:
    """The CSV's `# summary ...` comment line, holding the fields the spec says it gains."""
    return line.startswith(CSV_SUMMARY_START + " ") and all(
        re.search(rf"(?<= ){line_regex(g).pattern}(?= |$)", line) for g in CSV_SUMMARY_GAINS)
