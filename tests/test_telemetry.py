"""Contract tests: what a consumer of shared/spec/telemetry.md would check of real runs."""

from __future__ import annotations

import itertools
import math
import re
import time

import psutil
import pytest

from bmoe.base import telemetry
from bmoe.edges.session_client import SessionClient
from bmoe.tools.bench_sys import drop_file_cache
from tests import spec_lines
from tests.conftest import complete, load, per_token, run_cli
from tests.plain_llama import plain_llama

PROMPT = "Tell me about the harbour town where the fishing boats come home every evening before dark"
N = 20
ROUND = 0.01  # ms: every JSON field is rounded to 3 decimals
# the `# summary` keys consumers read, in the order the line has always had them (the spec names the
# line and its stall_s/tok and mgmt_s/tok; bmoe may only append after them)
SUMMARY_KEYS = ("tokens", "s/tok", "tok/s", "read_mib", "io_s/tok", "compute_s/tok", "cache_hit_pct",
                "stall_s/tok", "mgmt_s/tok")
BMOE_SUMMARY_KEYS = ("cache_budget_mib", "prefill_tokens", "prefill_s", "load_s", "llama_load_s", "page_cache_mib")
BMOE_COLUMNS = ",cache_budget_mib,page_cache_bytes,page_cache_ms"  # bmoe's trailing CSV columns, in order


@pytest.fixture(scope="module")
def model(small_moe) -> str:
    return str(small_moe)


def progress_run(model: str, tmp_path, *flags: str) -> tuple[telemetry.ParsedRun, str, str]:
    csv_path = tmp_path / "run.csv"
    r = run_cli("-m", model, "-p", PROMPT, "-n", str(N), "--progress", "--csv", str(csv_path), *flags)
    assert r.returncode == 0, r.stderr
    return telemetry.parse_output(r.stdout), csv_path.read_text(), r.stdout


@pytest.mark.parametrize("cache", ["1", "0"])  # 1 MiB: a third of the experts
def test_progress_lines_follow_the_contract(model: str, tmp_path, cache: str) -> None:
    """Serial mode's formulas (the overlap ones: tests/test_speculation.py)."""
    run, csv_text, stdout = progress_run(model, tmp_path, "--cache-mb", cache, "--no-overlap", "--no-spec-gate")
    assert not run.stray, f"lines outside the contract: {run.stray[:5]}"
    progress = [obj for tag, obj in run.events if tag == "PROGRESS"]
    assert progress and all(tag in ("LOAD", "PROGRESS") for tag, _ in run.events)
    for line in stdout.splitlines()[:len(run.events)]:  # the spec's keys, in its order, of its types
        spec_lines.check_tagged(line)
    for obj in progress:
        # compute is a residual (wall - io - mgmt), so restating that formula proves nothing; what can
        # fail is that the measured terms are disjoint parts of the wall time and the kernels took some
        assert 0 < obj["compute_ms"] <= obj["wall_ms"]
        assert obj["io_ms"] >= 0 and obj["mgmt_ms"] >= 0 and obj["io_ms"] + obj["mgmt_ms"] <= obj["wall_ms"] + ROUND
        # serial io is time blocked on reads: some exactly when the token read experts
        assert (obj["io_ms"] > 0) == (obj["read_mb"] > 0), obj
        assert obj["stall_ms"] == 0
        assert obj["steps"] == N
        assert (obj["cache_hit_pct"] == -1) == (cache == "0")
    assert [o["step"] for o in progress] == list(range(1, len(progress) + 1))
    # BMOE_LOAD comes right before the PROGRESS of a token that read experts, and only then
    for i, (tag, obj) in enumerate(run.events):
        if tag == "LOAD":
            nxt_tag, nxt = run.events[i + 1]
            assert nxt_tag == "PROGRESS" and nxt["read_mb"] > 0
            assert set(obj) == {"mb", "ms"} and abs(obj["mb"] - nxt["read_mb"]) < 1e-3
        elif i == 0 or run.events[i - 1][0] != "LOAD":
            assert obj["read_mb"] == 0
    # text is the full text so far; the answer banner repeats the final text
    assert progress[-1]["text"] == run.answer
    assert all(b["text"].startswith(a["text"]) for a, b in itertools.pairwise(progress))
    # banners, then the summary lines
    lines = stdout.splitlines()
    assert lines.index(spec_lines.ANSWER_BANNER) < lines.index(spec_lines.PERF_BANNER)
    kinds = list(run.summary)
    assert kinds == (["generation", "moe-stream", "moe-cache"] if cache != "0" else ["generation", "moe-stream"])
    assert run.summary["generation"]["tokens"] == len(progress)
    per_tok_sum = sum(o["read_mb"] for o in progress)
    assert abs(per_tok_sum - run.summary["moe-stream"]["read_mib"]) <= 0.01 + 1e-4 * len(progress)
    # CSV by column name: the contract's columns in its order, then bmoe's trailing budget column
    rows, summary = telemetry.read_csv(csv_text)
    # the spec's columns in its order, then bmoe's trailing columns (the contract's CSV is additive)
    assert csv_text.splitlines()[0] == spec_lines.CSV_HEADER + BMOE_COLUMNS
    assert len(rows) == len(progress)
    for row, obj in zip(rows, progress):
        assert row["step"] == obj["step"] and abs(row["wall_ms"] - obj["wall_ms"]) <= ROUND
        assert abs(row["read_bytes"] / 2**20 - obj["read_mb"]) < 1e-3
    last = csv_text.splitlines()[-1]
    assert spec_lines.csv_summary_matches(last), last
    assert [kv.split("=", 1)[0] for kv in last.split()[2:]] == [*SUMMARY_KEYS, *BMOE_SUMMARY_KEYS], last
    assert all(row["cache_budget_mib"] == (0 if cache == "0" else float(cache)) for row in rows)
    assert summary["cache_budget_mib"] == (0 if cache == "0" else float(cache))
    assert summary["tokens"] == len(progress)


def test_csv_summary_times_the_first_token(model: str, tmp_path) -> None:
    """bmoe's `# summary` keys for the time to first token (load_s + prefill_s): the prompt's tokens as
    llama.cpp's own tokenizer counts them, times inside the process's run time, and llama.cpp's part
    of the load without bmoe's streaming start-up (I/O lane processes, warm-up capture)."""
    vocab = plain_llama(model, vocab_only=True)
    n_prompt = len(vocab.tokenize(PROMPT.encode(), add_bos=True, special=True))
    bmoe_load = {}
    for mode, flags in (("stream", ("--cache-mb", "1")), ("mmap", ("--no-stream",))):
        csv_path = tmp_path / f"{mode}.csv"
        t0 = time.monotonic()
        r = run_cli("-m", model, "-p", PROMPT, "-n", "4", "-t", "1", "--csv", str(csv_path), *flags)
        elapsed = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        _, summary = telemetry.read_csv(csv_path.read_text())
        line = csv_path.read_text().splitlines()[-1]
        assert summary["prefill_tokens"] == n_prompt, line
        assert summary["prefill_s"] > 0 and summary["load_s"] >= summary["llama_load_s"] > 0, line
        assert summary["load_s"] + summary["prefill_s"] < elapsed, line
        bmoe_load[mode] = summary["load_s"] - summary["llama_load_s"]
    assert bmoe_load["stream"] > bmoe_load["mmap"], bmoe_load


def test_serial_io_and_read_bytes_are_what_the_lanes_did(model: str) -> None:
    """Measured, not derived: with no cache in serial mode every token blocks on reads (io > 0, within
    its wall time) and its read bytes are the bytes the lane processes read from the file, as the
    kernel counted them (/proc/PID/io read_bytes: O_DIRECT reads bypass the page cache)."""
    drop_file_cache([model])
    m = load(model, "-c", 256, "-t", 1, "--cache-mb", 0, "--no-overlap", "--io-threads", 2)
    try:
        pool = m.engine.streamer.pool
        if not pool.odirect:
            pytest.skip("the model's file system refuses O_DIRECT: the kernel's read_bytes counts page-cache misses")

        def lanes_read() -> int:
            return sum(psutil.Process(lane.pid).io_counters().read_bytes for lane in pool.lanes)

        kernel: list[int] = []
        last = [0]

        def on_token(_i: int) -> None:
            now = lanes_read()
            kernel.append(now - last[0])
            last[0] = now

        res = complete(m, PROMPT, N, on_chunk=per_token(on_token))
        pids = [lane.pid for lane in pool.lanes]
    finally:
        m.close()
    assert len(res.tokens) == N and pool.restarts == 0 and pids
    for i, t in enumerate(res.tokens):
        assert 0 < t.io_ms <= t.wall_ms and t.mgmt_ms >= 0 and t.io_ms + t.mgmt_ms <= t.wall_ms, (i, t)
        assert t.stall_ms == 0
    # the first delta also holds the prompt's reads (prefill has no callback of its own)
    assert kernel[0] > res.tokens[0].read_bytes > 0
    assert kernel[1:] == [t.read_bytes for t in res.tokens[1:]]


def test_every_line_written_is_the_specs(model: str, tmp_path) -> None:
    """What bmoe-cli and the session write, line by line, against the spec's own lines
    (tests/data/telemetry_spec_lines.txt: keys and their order, words, units, columns), not against
    bmoe's constants or parser."""
    csv_path = tmp_path / "run.csv"
    r = run_cli("-m", model, "-p", PROMPT, "-n", "12", "-t", "1", "--cache-mb", "1", "--overlap", "--prefetch", "1",
                "--spec-gate", "--spec-recall-min", "0", "--progress", "--csv", str(csv_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    a, p = lines.index(spec_lines.ANSWER_BANNER), lines.index(spec_lines.PERF_BANNER)
    tagged = [spec_lines.check_tagged(x) for x in lines[:a]]
    assert {t for t, _ in tagged} == {"LOAD", "PROGRESS"} and tagged[-1][0] == "PROGRESS"
    assert "\n".join(lines[a + 1:p]) == tagged[-1][1]["text"], "the answer between the banners"
    kinds = ["generation", "moe-stream", "moe-cache", "moe-prefetch", "moe-spec-gate"]  # the spec's order
    assert [x.split(":")[0] for x in lines[p + 1:]] == kinds, lines[p + 1:]
    for kind, line in zip(kinds, lines[p + 1:]):
        assert spec_lines.summary_matches(kind, line, overlap=True), line
    csv = csv_path.read_text().splitlines()
    assert csv[0] == spec_lines.CSV_HEADER + BMOE_COLUMNS, csv[0]  # bmoe's trailing columns after the spec's
    assert spec_lines.csv_summary_matches(csv[-1]), csv[-1]
    assert len(csv) == 2 + sum(t == "PROGRESS" for t, _ in tagged)
    for row in csv[1:-1]:
        assert len(row.split(",")) == len(csv[0].split(",")) and all(float(x) == float(x) for x in row.split(","))

    # serial, no --progress: the answer inline, then the summary lines without the overlap suffix
    r = run_cli("-m", model, "-p", PROMPT, "-n", "8", "-t", "1", "--cache-mb", "1", "--no-overlap")
    assert r.returncode == 0, r.stderr
    tail = r.stdout.splitlines()[-3:]
    assert "BMOE_" not in r.stdout and spec_lines.ANSWER_BANNER not in r.stdout
    for kind, line in zip(["generation", "moe-stream", "moe-cache"], tail):
        assert spec_lines.summary_matches(kind, line), line

    # the governor's suffix
    r = run_cli("-m", model, "-p", PROMPT, "-n", "24", "-t", "1", "--cache-mb", "1", "--spec-gate",
                "--spec-warmup", "6", "--spec-recall-min", "100")
    assert r.returncode == 0, r.stderr
    plain, disabled = (spec_lines.line_regex(t) for t in spec_lines.SUMMARY["moe-spec-gate"])
    last = r.stdout.splitlines()[-1]
    assert disabled.fullmatch(last) and not plain.fullmatch(last), last

    # the session's control lines (and its per-token lines)
    with SessionClient(["-m", model, "-t", "1", "--cache-mb", "1"]) as s:
        s.ask(1, PROMPT, n_predict=4)
        s.ask(2, PROMPT, n_predict=5000)  # more than the context holds: a rejected request
        assert s.close() == 0
    tags = [spec_lines.check_tagged(line)[0] for line in s.lines]
    assert tags[:2] == ["READY", "BEGIN"] and {"PROGRESS", "DONE", "ERROR"} <= set(tags), tags


def test_page_cache_copies_are_a_trailing_item_of_their_own() -> None:
    """What the lanes copied from the page cache is bmoe's trailing item on the moe-stream line (only
    when there was some: otherwise the line is the spec's), CSV's last columns and the # summary's
    last key; read_bytes, read_mib and MiB/s stay the flash's."""
    t = telemetry.RunTotals(tokens=4, wall_s=0.1, io_s=0.05, mgmt_s=0.01, stall_s=0.02, read_bytes=8 << 20,
                            overlap=True, page_cache_bytes=3 << 20)
    line = telemetry.stream_line(t)
    assert line == ("moe-stream: read 8.00 MiB (2.00 MiB/token), decode 0.0250 s/token (compute 0.0175 + cache mgmt "
                    "0.0025 + flash I/O 0.0125 s/token, 160.0 MiB/s) stall_s/tok=0.0050 page_cache_mib=3.00")
    assert telemetry.parse_summary(line)[1]["page_cache_mib"] == 3.0
    t.overlap = False
    assert telemetry.stream_line(t).endswith(", 160.0 MiB/s) page_cache_mib=3.00")
    t.page_cache_bytes = 0
    assert spec_lines.summary_matches("moe-stream", telemetry.stream_line(t)), telemetry.stream_line(t)
    assert telemetry.parse_summary(telemetry.stream_line(t))[1]["page_cache_mib"] is None
    assert telemetry.csv_header() == spec_lines.CSV_HEADER + BMOE_COLUMNS
    assert telemetry.csv_header(lossy=True) == (spec_lines.CSV_HEADER + ",cache_budget_mib,dropped,substituted,"
                                                "weight_changed_pct,page_cache_bytes,page_cache_ms")
    tally = telemetry.Tally(steps=2, overlap=True, cache_active=True)
    tok = tally.add(telemetry.TokenStat(wall_ns=9_000_000, io_ns=1_000_000, mgmt_ns=0, read_bytes=4096, hits=1,
                                        lookups=2, budget_bytes=1 << 20, page_cache_bytes=1 << 20,
                                        page_cache_ns=250_000))
    assert telemetry.csv_row(tok) == "1,2,9.000,1.000,9.000,4096,50.00,0.000,0.000,1.0,1048576,0.250"
    assert telemetry.csv_row(tok, lossy=True).endswith(",1.0,0,0,0.000,1048576,0.250")
    rows, _ = telemetry.read_csv(f"{telemetry.csv_header()}\n{telemetry.csv_row(tok)}\n")
    assert rows[0]["read_bytes"] == 4096 and rows[0]["page_cache_bytes"] == 1 << 20
    summary = telemetry.csv_summary(tally.totals(), 50.0, 1 << 20, prefill_tokens=3, prefill_s=0.5, load_s=1.0,
                                    llama_load_s=0.25)
    assert summary.endswith(" read_mib=0.00 io_s/tok=0.0010 compute_s/tok=0.0090 cache_hit_pct=50.00 "
                            "stall_s/tok=0.0000 mgmt_s/tok=0.0000 cache_budget_mib=1.0 prefill_tokens=3 "
                            "prefill_s=0.5000 load_s=1.0000 llama_load_s=0.2500 page_cache_mib=1.00"), summary


@pytest.fixture(scope="module")
def big_slices(synth) -> str:
    """A model whose every expert slice is a read a lane may copy from the page cache (q8_0 256 x 4096:
    1088 KiB, over io_lane.MIN_COPY; large enough that copying it takes longer than a lane's look-ups)."""
    return str(synth(arch="qwen3moe", layers=2, experts=8, top_k=2, embd=256, ff=4096))


def _warm_or_dropped(path: str, warm: bool) -> None:
    """The file whole in the page cache (as plain llama.cpp or a `cat` leaves it), or out of it."""
    if warm:
        with open(path, "rb") as f:
            while f.read(1 << 20):
                pass
    else:
        drop_file_cache([path])


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "dropped"])
def test_read_bytes_are_the_devices_and_page_cache_copies_are_counted_apart(big_slices: str, warm: bool) -> None:
    """Real lanes on a real model: each token's read_bytes are what the lanes read from the device, as
    the kernel counted it (/proc/PID/io read_bytes leaves page-cache hits out); with the file warm the
    lanes copy from the page cache instead and say so (page_cache_bytes > 0, not in read_bytes), with
    it dropped they copy nothing."""
    _warm_or_dropped(big_slices, warm)
    m = load(big_slices, "-c", 256, "-t", 1, "--cache-mb", 0, "--no-overlap", "--io-threads", 2)
    try:
        pool = m.engine.streamer.pool
        if not pool.odirect:
            pytest.skip("the model's file system refuses O_DIRECT: nothing is copied from the page cache")
        kernel: list[int] = []
        last = [0]

        def on_token(_i: int) -> None:
            now = sum(psutil.Process(lane.pid).io_counters().read_bytes for lane in pool.lanes)
            kernel.append(now - last[0])
            last[0] = now

        res = complete(m, PROMPT, 8, on_chunk=per_token(on_token))
    finally:
        m.close()
    tokens = res.tokens
    assert len(tokens) == 8 and all(t.read_bytes + t.page_cache_bytes > 0 for t in tokens)  # no cache: all read
    assert kernel[1:] == [t.read_bytes for t in tokens[1:]]  # (the first delta holds the prompt's reads too)
    copied = sum(t.page_cache_bytes for t in tokens)
    if warm:
        assert copied > 0 and all(t.page_cache_ms > 0 for t in tokens if t.page_cache_bytes)
        assert res.stats.page_cache_mib == copied / 2**20
    else:
        assert copied == 0 and all(t.page_cache_ms == 0 for t in tokens) and res.stats.page_cache_mib == 0


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "dropped"])
def test_cli_and_session_report_page_cache_copies_beside_flash_reads(big_slices: str, tmp_path, warm: bool) -> None:
    """bmoe-cli's moe-stream line gains `page_cache_mib=` (the CSV's page_cache_bytes summed) only when the
    lanes copied from the page cache, which then is not in read_mib nor in overlap's flash I/O time; the
    session's BMOE_DONE always ends with it."""
    _warm_or_dropped(big_slices, warm)
    csv_path = tmp_path / "run.csv"
    r = run_cli("-m", big_slices, "-p", PROMPT, "-n", "8", "-t", "1", "--cache-mb", "0", "--progress",
                "--csv", str(csv_path))
    assert r.returncode == 0, r.stderr
    run = telemetry.parse_output(r.stdout)
    assert not run.stray, run.stray
    stream = run.summary["moe-stream"]
    rows, summary = telemetry.read_csv(csv_path.read_text())
    copied_mib = sum(row["page_cache_bytes"] for row in rows) / 2**20
    assert stream["read_mib"] == pytest.approx(sum(row["read_bytes"] for row in rows) / 2**20, abs=0.01)
    assert summary["page_cache_mib"] == pytest.approx(copied_mib, abs=0.01)
    line = next(x for x in r.stdout.splitlines() if x.startswith("moe-stream:"))
    if warm:
        assert copied_mib > 0 and stream["page_cache_mib"] == pytest.approx(copied_mib, abs=0.01), line
        assert stream["read_mib"] < copied_mib, line  # every slice is one to copy: the device read little
        assert line.endswith(f" page_cache_mib={copied_mib:.2f}"), line
        # overlap's io is the lanes' busy time less their copies' (all the slices were copied: what is left
        # is the lanes' look-ups and the device's few small reads, less than the copying took)
        assert 0 <= sum(row["io_ms"] for row in rows) < sum(row["page_cache_ms"] for row in rows), rows
    else:
        assert copied_mib == 0 and stream["page_cache_mib"] is None and stream["read_mib"] > 0
        assert spec_lines.summary_matches("moe-stream", line, overlap=True), line

    _warm_or_dropped(big_slices, warm)
    with SessionClient(["-m", big_slices, "-t", "1", "--cache-mb", "0"]) as s:
        _, (tag, done) = s.ask(1, PROMPT, n_predict=4)
        assert s.close() == 0
    assert tag == "DONE" and list(done)[-1] == "page_cache_mib", done
    assert (done["page_cache_mib"] > 0) == warm, done


def test_without_progress_only_answer_and_summary(model: str) -> None:
    r = run_cli("-m", model, "-p", PROMPT, "-n", "8", "--cache-mb", "1")
    assert r.returncode == 0, r.stderr
    assert "BMOE_" not in r.stdout and spec_lines.ANSWER_BANNER not in r.stdout
    tail = r.stdout.splitlines()[-3:]
    assert [telemetry.parse_summary(x)[0] for x in tail] == ["generation", "moe-stream", "moe-cache"]


def test_older_csv_without_trailing_columns_parses() -> None:
    old = "step,steps,wall_ms,io_ms,compute_ms,read_bytes,cache_hit_pct\n1,2,5.0,1.0,4.0,4096,50.0\n" \
          "2,2,6.0,0.0,6.0,0,75.0\n# summary tokens=2 s/tok=0.0055\n"
    rows, summary = telemetry.read_csv(old)
    assert rows[1]["cache_hit_pct"] == 75.0 and rows[0]["stall_ms"] == 0.0 and rows[0]["mgmt_ms"] == 0.0
    assert summary == {"tokens": 2.0, "s/tok": 0.0055}


def test_run_summary_with_or_without_progress() -> None:
    t = telemetry.RunTotals(tokens=4, wall_s=0.1, io_s=0.05, mgmt_s=0.01, stall_s=0.0, read_bytes=8 << 20)
    tail = [telemetry.generation_line(t), telemetry.stream_line(t)]
    quoted = ["the log said", "generation: 9 tokens, 9.9000 s/token (0.10 tok/s)",
              telemetry.cache_line(99.0, 9 << 20)]  # an answer quoting summary lines is not the summary
    plain = "\n".join([*quoted, *tail]) + "\n"
    progress = "\n".join([telemetry.ANSWER_BANNER, *quoted, telemetry.PERF_BANNER, *tail]) + "\n"
    summary = telemetry.parse_run_summary(plain)
    assert list(summary) == ["generation", "moe-stream"] and summary["generation"]["tokens"] == 4
    assert telemetry.parse_run_summary(progress) == summary == telemetry.parse_output(progress).summary
    assert telemetry.parse_run_summary("no summary\n") == {}


def test_run_summary_takes_notices_and_nan() -> None:
    t = telemetry.RunTotals(tokens=2, wall_s=0.1, io_s=0.0, mgmt_s=0.0, stall_s=0.0, read_bytes=0)
    stdout = f"{telemetry.generation_line(t)}\n{telemetry.cache_line(float('nan'), 0)}\n"
    notice = f"bmoe: {telemetry.prefetch_line(3 << 20, 1, 4)}\n"
    summary = telemetry.parse_run_summary(stdout, "bmoe: lanes started\n" + notice)
    assert math.isnan(summary["moe-cache"]["hit_pct"])
    assert summary["moe-prefetch"] == {"speculative_mib": 3.0, "useful": 1, "prefetched": 4, "useful_pct": 25.0}
    assert "moe-prefetch" not in telemetry.parse_run_summary(stdout, notice.removeprefix("bmoe: "))


def test_csv_cut_short_by_a_kill_still_parses() -> None:
    text = "step,steps,wall_ms,io_ms,compute_ms,read_bytes,cache_hit_pct\n1,2,5.0,1.0,4.0,4096,50.0\n2,2,6.0,0.0,-"
    rows, summary = telemetry.read_csv(text)
    assert rows[1]["wall_ms"] == 6.0 and "compute_ms" not in rows[1] and rows[0]["read_bytes"] == 4096
    assert summary == {}


def test_profile_lists_each_lane_and_their_reads_match(model: str, tmp_path) -> None:
    csv_path = tmp_path / "p.csv"
    drop_file_cache([model])  # the lanes read the device (/proc/PID/io counts that, not page-cache copies)
    r = run_cli("-m", model, "-p", PROMPT, "-n", "16", "--cache-mb", "0", "--io-threads", "3",
                "--profile", "--csv", str(csv_path))
    assert r.returncode == 0, r.stderr
    procs = (tmp_path / "p.csv.procs.csv").read_text().splitlines()
    header = procs[0].split(",")
    rows = [dict(zip(header, line.split(","))) for line in procs[1:] if not line.startswith("#")]
    roles = [row["role"] for row in rows]
    assert roles == ["coordinator", "io_lane 0", "io_lane 1", "io_lane 2"]
    assert "io_lane 2" in r.stderr and "slab resident" in r.stderr
    lane_read = sum(int(row["read_bytes"]) for row in rows[1:])
    stream = next(telemetry.parse_summary(x)[1] for x in r.stdout.splitlines() if x.startswith("moe-stream:"))
    # lanes also read during prefill; decode reads are a subset, never more than the lanes did
    assert lane_read >= stream["read_mib"] * 2**20 * 0.99
    # the lanes' busy time and queue depth (issue 13: the flash's idle time visible)
    busy = [float(m.group(2)) for m in re.finditer(r"^io_lane (\d): busy ([\d.]+) s of ([\d.]+) s \((\d+)%\)$",
                                                    r.stderr, re.M)]
    # (a layer's up and down reads queue behind its gate reads' lanes: with top-2 routing a lane may
    # read little beyond the prompt's, and its busy time rounds to 0.00 s)
    assert len(busy) == 3 and sum(busy) > 0, r.stderr
    depth = re.search(r"^orders in flight when a layer's reads had gone out: ([\d.]+) on average$", r.stderr, re.M)
    assert depth and float(depth.group(1)) > 0, r.stderr
    per = re.search(r"^per decode token \((\d+)\): lanes busy p10 (\d+)% median (\d+)% p90 (\d+)%; "
                    r"orders in flight median ([\d.]+) p90 ([\d.]+)$", r.stderr, re.M)
    assert per, r.stderr
    n, p10, med, p90, dmed, d90 = (float(x) for x in per.groups())
    assert n == 16 and 0 <= p10 <= med <= p90 and 0 < dmed <= d90  # no cache: every token reads
