"""The settings schema: each setting declared once (bmoe.base.settings), and every edge generated from it:
bmoe-cli's and bmoe-server's flags, bmoe.load's keywords, and validation worded for each."""

from __future__ import annotations

import dataclasses

import pytest

from bmoe.base.errors import ConfigError
from bmoe.base.settings import SamplerSettings, Settings, from_keywords
from bmoe.edges import flags
from tests.conftest import run_cli


def _leaves(obj: object, prefix: str = "") -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out.update(_leaves(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v) else {prefix + f.name: v})
    return out


def _settings(argv: list[str]) -> Settings:
    ap = flags.build_parser()
    return flags.settings_from(ap, ap.parse_args(argv))


def test_every_setting_is_set_by_its_flag_and_defaults_to_its_field() -> None:
    """Each Settings field (every group) is set by some flag, so --session, one-shot and the tests all
    reach every setting the same way; and the flags' defaults are the Settings' defaults."""
    defaults = _settings([])
    assert _leaves(defaults) == _leaves(Settings()), "flag defaults differ from Settings defaults"
    fixed = [["-m", "other.gguf", "-c", "512", "-t", "3", "--verbose", "--route-trace", "t.jsonl", "--temp", "0.5",
              "--top-k", "7", "--top-p", "0.5", "--seed", "9", "--cache-policy", "lru", "--force", "--preload",
              "--io-threads", "3", "--no-odirect", "--lane-timeout", "9", "--shm", "memfd", "--no-overlap",
              "--prefetch", "2", "--guess", "0.4", "--spec-gate", "--spec-warmup", "9", "--spec-recall-min", "9",
              "--spec-precision", "9", "--cache-mb", "64", "--adapt", "--pin-dense", "--experts-per-token", "3",
              "--drop-cold", "0.1", "--cache-routing", "0.2", "--min-p", "0.1", "--repeat-penalty", "1.1",
              "--repeat-last-n", "32", "--frequency-penalty", "0.5", "--presence-penalty", "-0.5",
              "--logit-bias", "15043-100,2+2.5"],
             ["--no-stream", "--parallel", "2"], ["--cache-floor-mb", "9", "--cache-ceil-mb", "64"],
             ["-hf", "org/repo:Q8_0", "--chat-template-file", "t.jinja", "--prompt-cache", "kv",
              "--prompt-cache-mb", "9"],
             ["--no-warm-start"], ["--usage-dir", "u"], ["--replay-routes", "t.csv"],
             ["--embedding", "--pooling", "mean"], ["--jinja", "--reasoning", "off", "--chat-template", "chatml"],
             ["--draft", "ngram", "--draft-max", "3", "--no-draft-gate"]]
    changed = set()
    for argv in fixed:
        got = _leaves(_settings(argv))
        changed |= {k for k, v in got.items() if v != _leaves(defaults)[k]}
    assert changed == set(_leaves(defaults)), f"no flag sets {sorted(set(_leaves(defaults)) - changed)}"
    assert _settings(["--session", "--cache-policy", "cycle"]).cache.policy == "cycle"


def test_keywords_are_the_flags_words_and_errors_speak_them() -> None:
    s = from_keywords("m.gguf", n_ctx=512, cache_mb="auto", cache_policy="lru", temp=0.5, io_threads=3, stream=True)
    assert (s.model, s.n_ctx, s.cache.mb, s.cache.policy, s.sampler, s.streaming.io_threads) == \
           ("m.gguf", 512, None, "lru", SamplerSettings(temp=0.5), 3)
    assert from_keywords("m.gguf", cache_mb=500).cache.mb == 500.0 == from_keywords("m.gguf", cache_mb="500").cache.mb
    with pytest.raises(TypeError, match=r"unknown setting 'streaming_io_threads'; did you mean io_threads\?"):
        from_keywords("m.gguf", streaming_io_threads=1)
    with pytest.raises(TypeError, match=r"unknown setting 'model'.*the settings are: hf, threads, n_ctx"):
        from_keywords("m.gguf", model="x")
    with pytest.raises(TypeError, match=r"io_threads=2.5: expected int, not float"):
        from_keywords("m.gguf", io_threads=2.5)
    with pytest.raises(ConfigError, match=r"^cache_mb=-1: a budget is 0 \(no cache\)"):
        from_keywords("m.gguf", cache_mb=-1)
    with pytest.raises(ConfigError, match=r"^cache_floor_mb size cache_mb='auto', and cache_mb=500 is fixed; "
                                          r"drop cache_floor_mb or use cache_mb='auto'$"):
        from_keywords("m.gguf", cache_mb=500, cache_floor_mb=100)
    with pytest.raises(ConfigError, match=r"^overlap=True streams experts; drop it or drop stream=False$"):
        from_keywords("m.gguf", overlap=True, stream=False)
    assert not from_keywords("m.gguf", stream=False).streaming.enabled  # the default overlap is no contradiction


def test_logit_bias_is_openais_map_as_a_keyword_and_llama_cpps_spelling_as_a_flag() -> None:
    """One setting, three spellings: bmoe.load's map (keys as numbers or text), the flag's TOKEN_ID(+|-)BIAS
    list, and the same pairs inside; its bound is checked in each edge's words."""
    want = ((2, 2.5), (15043, -100.0))
    assert from_keywords("m.gguf", logit_bias={15043: -100, "2": 2.5}).sampler.logit_bias == want
    assert from_keywords("m.gguf", logit_bias="15043-100,2+2.5").sampler.logit_bias == want
    assert _settings(["--logit-bias", "15043-100,2+2.5"]).sampler.logit_bias == want
    with pytest.raises(ConfigError, match=r"^logit_bias=\{5: 101.0\}: each bias from -100 to 100$"):
        from_keywords("m.gguf", logit_bias={5: 101})
    with pytest.raises(ConfigError, match=r"logit_bias: key 'x' is not a token id"):
        from_keywords("m.gguf", logit_bias={"x": 1})
    with pytest.raises(ConfigError, match=r"^frequency_penalty=3: from -2 to 2$"):
        from_keywords("m.gguf", frequency_penalty=3)



@pytest.mark.parametrize("argv,words", [
    (["--io-threads", "0"], "argument --io-threads: must be 1 or more"),
    (["--no-stream", "--overlap"], "--overlap streams experts; drop it or drop --no-stream"),
    (["--route-trace", "t.jsonl", "--parallel", "2"],
     "--route-trace records one sequence's routing, and --parallel 2 decodes several; drop one of them"),
    (["--temp", "-1"], "--temp -1: 0 (greedy) or more"),
    (["--logit-bias", "5-101"], "--logit-bias 5-101: each bias from -100 to 100"),
    (["--logit-bias", "5*3"], "argument --logit-bias: '5*3' is not TOKEN_ID+BIAS or TOKEN_ID-BIAS (e.g. 15043-100)"),
    (["--chat-template", "chatml", "--chat-template-file", "t.jinja"],
     "--chat-template names a built-in template and --chat-template-file gives one; give one of them"),
    (["--reasoning", "maybe"], "argument --reasoning: invalid choice: 'maybe' (choose from 'on', 'off', 'auto')"),
])
def test_flag_errors_speak_flags(argv: list[str], words: str) -> None:
    r = run_cli(*argv)
    assert r.returncode == 2 and r.stderr.rstrip().endswith(f"bmoe-cli: error: {words}"), r.stderr
