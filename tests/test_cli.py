"""`bmoe-cli` as a user runs it: real processes, real files, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests import spec_lines
from tests.conftest import REPO, bmoe_segments, run_cli, still_running

PROMPT = "A short note about the weather in the northern hills during the long winter months"


@pytest.fixture(scope="module")
def model(small_moe) -> str:
    return str(small_moe)


def answer_and_summary(stdout: str) -> tuple[str, list[str]]:
    lines = stdout.rstrip("\n").split("\n")
    first = next(i for i, line in enumerate(lines) if line.startswith("generation: "))
    return "\n".join(lines[:first]), lines[first:]


def test_streams_the_same_answer_as_plain_llama_cpp(model: str) -> None:
    plain = run_cli("-m", model, "-p", PROMPT, "-n", "24", "--no-stream")
    streamed = run_cli("-m", model, "-p", PROMPT, "-n", "24", "--cache-mb", "1", "--io-threads", "2")
    assert plain.returncode == 0, plain.stderr
    assert streamed.returncode == 0, streamed.stderr
    text_plain, summary_plain = answer_and_summary(plain.stdout)
    text, summary = answer_and_summary(streamed.stdout)
    assert text == text_plain and text.strip()
    assert len(summary_plain) == 1 and spec_lines.summary_matches("generation", summary_plain[0])
    # default: --overlap (stall_s/tok= on moe-stream); --spec-gate is off
    assert len(summary) == 3, summary
    assert spec_lines.summary_matches("generation", summary[0]), summary
    assert spec_lines.summary_matches("moe-stream", summary[1], overlap=True), summary
    assert spec_lines.summary_matches("moe-cache", summary[2]), summary
    serial = run_cli("-m", model, "-p", PROMPT, "-n", "24", "--cache-mb", "1", "--no-overlap", "--no-spec-gate")
    text, summary = answer_and_summary(serial.stdout)
    assert text == text_plain and len(summary) == 3 and spec_lines.summary_matches("moe-stream", summary[1]), summary


def test_no_arguments_answers_the_demo_question_on_the_demo_model(demo_default) -> None:
    """The README's first command: `bmoe-cli` alone streams the demo model with a quarter cache.
    (`-n 8` only keeps the suite short: the model, prompt, budget and levers are the no-argument ones.)"""
    r = run_cli("-n", "8", timeout=600)
    assert r.returncode == 0, r.stderr
    text, summary = answer_and_summary(r.stdout)
    assert "Paris" in text, text
    assert len(summary) == 3 and summary[0].startswith("generation: 8 tokens"), summary
    assert spec_lines.summary_matches("moe-stream", summary[1], overlap=True), summary
    assert spec_lines.summary_matches("moe-cache", summary[2]), summary


def test_no_cache_drops_the_cache_line(model: str) -> None:
    r = run_cli("-m", model, "-p", PROMPT, "-n", "8", "--cache-mb", "0", "--no-odirect")
    assert r.returncode == 0, r.stderr
    _, summary = answer_and_summary(r.stdout)
    assert [s.split(":")[0] for s in summary] == ["generation", "moe-stream"]


def test_chat_uses_the_models_template(model: str) -> None:
    r = run_cli("-m", model, "-p", "hello there", "-n", "8", "--chat", "--cache-mb", "0")
    assert r.returncode == 0, r.stderr


def test_dense_model_runs_plain_with_a_notice() -> None:
    from bmoe.demo import build as demo

    dense = demo.source_model()
    r = run_cli("-m", str(dense), "-p", "The capital of France is", "-n", "4")
    assert r.returncode == 0, r.stderr
    assert "not a Mixture-of-Experts model; running it plain" in r.stderr
    assert r.stdout.count("generation: 4 tokens") == 1


@pytest.mark.parametrize("case", ["missing", "not-gguf", "truncated", "budget", "token-budget", "prompt-file",
                                  "prompt-not-utf8", "context"])
def test_bad_input_is_named_with_its_fix(model: str, tmp_path, case: str) -> None:
    args = ["-p", PROMPT, "-n", "8"]
    if case == "missing":
        m, want = tmp_path / "nope.gguf", "does not exist; check the -m path"
    elif case == "not-gguf":
        m = tmp_path / "notes.gguf"
        m.write_text("hello")
        want = "is not a GGUF file"
    elif case == "truncated":
        m = tmp_path / "cut.gguf"
        data = open(model, "rb").read()
        m.write_bytes(data[: len(data) * 2 // 3])
        want = "is truncated"
    elif case == "budget":
        m, want = model, "--cache-mb 0.05 is below one layer's working set (0.2 MiB)"
        args += ["--cache-mb", "0.05"]
    elif case == "token-budget":
        m = model
        want = ("--cache-mb 0.5 is below one token's working set (0.8 MiB): the cache would thrash, each token "
                "evicting experts the next one needs again; use --cache-mb 0.9 or more, 0 for no cache, or --force")
        args += ["--cache-mb", "0.5"]
    elif case == "prompt-file":
        m, want = model, "cannot read prompt file"
        args = ["-f", str(tmp_path / "missing.txt")]
    elif case == "prompt-not-utf8":
        f = tmp_path / "latin1.txt"
        f.write_bytes("Caf\u00e9 au lait".encode("latin-1"))
        m, want = model, f"prompt file {f} is not UTF-8 text (byte 3 is 0xe9); save it as UTF-8"
        args = ["-f", str(f), "-n", "8"]
    else:
        m, want = model, "exceeds the context of 64 tokens; raise -c or shorten the prompt"
        args = ["-p", PROMPT * 4, "-n", "8", "-c", "64"]
    r = run_cli("-m", str(m), *args)
    assert r.returncode == 1 and "Traceback" not in r.stderr and not r.stdout, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("bmoe-cli: error: ") and want in errors[0], r.stderr


@pytest.mark.parametrize("flags", [["--cache-mb", "-3"], ["--io-threads", "0"], ["-n", "many"],
                                   ["-p", "x", "-f", "y"]])
def test_bad_flags_exit_2(model: str, flags: list[str]) -> None:
    r = run_cli("-m", model, *flags)
    assert r.returncode == 2 and "error:" in r.stderr


@pytest.mark.parametrize("flags,msg", [
    (["--cache-mb", "2", "--cache-ceil-mb", "3"],
     "--cache-ceil-mb size --cache-mb auto, and --cache-mb 2 is fixed; drop --cache-ceil-mb or use --cache-mb auto"),
    (["--cache-mb", "0", "--cache-floor-mb", "100", "--cache-ceil-mb", "3"],
     "--cache-floor-mb and --cache-ceil-mb size --cache-mb auto, and --cache-mb 0 is fixed"),
    (["--no-stream", "--cache-ceil-mb", "3"], "--cache-ceil-mb size the expert cache, and --no-stream has none"),
    (["--cache-ceil-mb", "0"], "--cache-ceil-mb 0 leaves --cache-mb auto no room; for no cache say --cache-mb 0"),
    (["--cache-ceil-mb", "-1"], "argument --cache-ceil-mb: must be a number of MiB, 0 or more"),
    (["--cache-floor-mb", "lots"], "argument --cache-floor-mb: 'lots' is not a number of MiB"),
])
def test_cache_sizing_flag_conflicts_exit_2(model: str, flags: list[str], msg: str) -> None:
    r = run_cli("-m", model, "-p", "x", *flags)
    assert r.returncode == 2 and f"bmoe-cli: error: {msg}" in r.stderr, r.stderr


def test_force_runs_below_one_tokens_working_set(model: str) -> None:
    r = run_cli("-m", model, "-p", PROMPT, "-n", "8", "-t", "1", "--cache-mb", "0.5", "--force")
    assert r.returncode == 0, r.stderr
    assert any(spec_lines.summary_matches("moe-cache", x) for x in answer_and_summary(r.stdout)[1])


@pytest.mark.parametrize("force", [False, True])
def test_auto_budget_is_capped_by_the_ceiling(model: str, force: bool) -> None:
    """auto = the least of available memory minus the floor, the ceiling and every expert; one below
    one token's working set means no cache, unless --force."""
    ceil = "0.5" if force else "2"
    r = run_cli("-m", model, "-p", PROMPT, "-n", "8", "-t", "1", "--cache-floor-mb", "0", "--cache-ceil-mb", ceil,
                *(["--force"] if force else []))
    assert r.returncode == 0, r.stderr
    (note,) = [x for x in r.stderr.splitlines() if "cache budget" in x]
    assert note.startswith(f"bmoe: cache budget {float(ceil):.1f} MiB (auto, the least of: available ")
    assert f"MiB minus --cache-floor-mb 0; experts total 3 MiB; => --cache-ceil-mb {ceil})" in note
    assert any(spec_lines.summary_matches("moe-cache", x) for x in answer_and_summary(r.stdout)[1]), "the cache is on"
    r = run_cli("-m", model, "-p", PROMPT, "-n", "8", "-t", "1", "--cache-ceil-mb", "0.5")
    assert r.returncode == 0, r.stderr
    (note,) = [x for x in r.stderr.splitlines() if "cache budget" in x]
    assert note.endswith("that is below one token's working set (0.8 MiB), where a cache thrashes, so this run has "
                         "none (as --cache-mb 0); --force keeps it"), note
    assert [s.split(":")[0] for s in answer_and_summary(r.stdout)[1]] == ["generation", "moe-stream"]


def test_model_file_changed_during_a_run_is_an_error(model: str, tmp_path, monkeypatch, capsys) -> None:
    from bmoe import cli
    from bmoe.coordinator import Engine
    from bmoe.edges import exits

    copy = tmp_path / "m.gguf"
    copy.write_bytes(open(model, "rb").read())
    step = Engine.step
    steps = []

    def touch_mid_run(self, seqs):
        out = step(self, seqs)
        steps.append(out)
        if len(steps) == 3:
            os.utime(copy, (copy.stat().st_atime, copy.stat().st_mtime + 5))
        return out

    monkeypatch.setattr(Engine, "step", touch_mid_run)
    monkeypatch.setattr(exits.signal, "signal", lambda *a: None)  # leave pytest's own handlers alone
    before = bmoe_segments()
    assert cli.main(["-m", str(copy), "-p", PROMPT, "-n", "6", "-t", "1", "--cache-mb", "1"]) == 1
    err = capsys.readouterr().err
    assert f"bmoe-cli: error: model file {copy} changed since it was loaded (modified at " in err
    assert err.rstrip().endswith("the answer above may not be the model's; run again")
    assert bmoe_segments() == before


def test_help_has_examples() -> None:
    r = run_cli("--help")
    assert r.returncode == 0 and "examples:" in r.stdout and "--cache-mb" in r.stdout


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_mid_generation_cleans_up(model: str, sig: int, code: int) -> None:
    before = bmoe_segments()
    p = subprocess.Popen([sys.executable, "-m", "bmoe.cli", "-m", model, "-p", PROMPT, "-n", "3900",
                          "-c", "4096", "--cache-mb", "0", "--io-threads", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert p.stdout.read(20), "generation should have started"
        lanes = psutil.Process(p.pid).children()
        assert len(lanes) == 2 and all("bmoe.workers.io_lane" in " ".join(c.cmdline()) for c in lanes)
        assert bmoe_segments() - before
        p.send_signal(sig)
        rc = p.wait(600)
        err = p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        p.stderr.close()
    assert rc == code, err[-2000:]
    assert bmoe_segments() == before
    assert not still_running(lanes), "lane processes outlived the coordinator"


def test_error_exit_releases_shared_memory(model: str) -> None:
    before = bmoe_segments()
    r = run_cli("-m", model, "-p", PROMPT * 4, "-n", "8", "-c", "64", "--cache-mb", "1")
    assert r.returncode == 1
    assert bmoe_segments() == before
