"""`bmoe-bench quality`, the harness that prices lossy settings: a lossless run scores KL 0 and 100 %
agreement against the reference, a known perturbation does not, and its numbers are llama-perplexity's."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bmoe.tools.bench_quality_run import LOGP_FLOOR, kl_divergence, log_softmax
from tests.conftest import REPO

N = 48


def quality(tmp_path, model, *args: str) -> dict:
    """Run `bmoe-bench quality` as a user does; its results.json."""
    out = tmp_path / "q"
    r = subprocess.run([sys.executable, "-m", "bmoe.tools.bench", "quality", "-m", str(model), "-n", str(N),
                        "--context", "16", "--gen-tokens", "12", "--common", "-t 2 -c 256", "--out", str(out),
                        *args], capture_output=True, text=True, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert (out / "report.md").is_file() and (out / "quality.png").is_file()
    phases = [(r["phase"], r["config"]) for r in doc["runs"]]
    assert phases[0] == ("reference", "lossless") and ("reference", "lossless") not in phases[1:], phases
    return {row["config"]: row for row in doc["summary"]}


def test_lossless_against_itself_is_kl_0_and_a_known_perturbation_is_not(tmp_path, small_moe) -> None:
    """The harness's first test: the reference's own measured run, and a lossless configuration that streams
    differently (no cache, serial reads), score KL 0, 100 % top-1 agreement, the reference's perplexity
    and whole greedy generations kept; routing each token to one expert fewer than the model's top-k
    (a known perturbation, exact K: tests/test_seam.py) scores KL > 0 and agreement < 100 %."""
    rows = quality(tmp_path, small_moe, "--repeats", "1", "--config", "nocache=--cache-mb 0 --no-overlap",
                   "--config", "k1=--experts-per-token 1 --cache-mb 1")
    ref, same, k1 = rows["lossless"], rows["nocache"], rows["k1"]
    for r in (ref, same):
        assert r["scored_runs"] == 1  # the reference's measured run too, against its unmeasured first
        assert r["kl_mean"] == r["kl_max"] == 0.0 and r["top1_pct"] == 100.0, r
        assert r["ppl"] == pytest.approx(ref["ppl_all"], rel=1e-12)
        assert r["greedy_same_mean"] == r["greedy_same_min"] == 12
        assert r["weight_changed_pct"] == 0
    assert k1["kl_mean"] > 0 and k1["kl_p99"] > 0 and k1["top1_pct"] < 100.0
    assert k1["weight_changed_pct"] > 0 and k1["experts_per_token"] == 1
    assert k1["greedy_same_min"] < 12
    assert k1["tok_s_median"] > 0 and k1["mib_per_token"] > 0 and k1["speedup"] > 0


def test_kl_is_llama_perplexitys_sum() -> None:
    """KL over the reference's tokens with log-probability above -16 (llama-perplexity skips the rest):
    equal to the full sum when no token is that unlikely, and to the sum without them when some are."""
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=300), rng.normal(size=300)
    pa, pb = log_softmax(a), log_softmax(b)
    ids = np.arange(300)
    assert kl_divergence(ids, pa, pb) == pytest.approx(float(np.sum(np.exp(pa) * (pa - pb))), rel=1e-12)
    assert kl_divergence(ids, pa, pa) == 0.0
    a[:10] -= 40  # ten tokens the reference finds impossible: left out, as llama-perplexity leaves them
    pa = log_softmax(a)
    keep = np.nonzero(pa > LOGP_FLOOR)[0]
    assert len(keep) == 290
    full = float(np.sum(np.exp(pa) * (pa - pb)))
    assert kl_divergence(keep, pa[keep], pb) == pytest.approx(full, abs=1e-12)
