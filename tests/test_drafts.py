"""Drafting (`--draft ngram`, bmoe.engine.drafts): n-gram drafts verified in one decode.

Lossless means: the text equals what plain llama.cpp produces doing the same speculative work. The
reference is bmoe's one generation loop on `--no-stream` (llama.cpp's own mmap load, nothing streamed),
which drafts and verifies in the same code, so drafts and verify batches are the same by construction;
`test_the_drafting_reference_is_llama_cpp_pythons_context_doing_the_same_work` holds that reference to
llama-cpp-python's own context running the module's lookup and verify by hand. Then the gates: streamed
with a quarter of the experts cached equals the reference at draft widths 1 to 4, greedy and seeded.
Against decoding without drafts the text holds as far as ggml's CPU kernels give a verify batch's rows the
logits they give one token (docs/levers.md): `test_drafts_against_one_token_at_a_time` pins what this CPU does.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import llama_cpp
import pytest

from bmoe.api import Completion
from bmoe.base import telemetry
from bmoe.base.model_files import read_model_files
from bmoe.base.settings import SamplerSettings
from bmoe.base.units import MiB
from bmoe.engine.drafts import DraftGate, DraftTally, NgramLookup, verify
from bmoe.seam import llama
from tests import spec_lines
from tests.conftest import REPO, complete, load, run_cli
from tests.plain_llama import plain_llama

# prompts whose answers tend to copy them: drafts from them are accepted and rejected (the synthetic model's
# random weights fall into a loop after this one; the demo's language model copies the list)
PROMPTS = {"synth": "one two three one two three one two three one two",
           "demo8": ("Copy the list twice. The list: red apple, green pear, blue plum, red apple, green pear, "
                     "blue plum, yellow lemon. Again: red apple, green pear,")}
PROMPT = PROMPTS["synth"]
N = 48
FLAGS = ("-c", 256, "-t", 2)


@pytest.fixture(scope="module")
def models(small_moe: Path, demo8: Path) -> dict[str, str]:
    """The small synthetic MoE most tests stream and the 8-expert demo (a real language model's text)."""
    return {"synth": str(small_moe), "demo8": str(demo8)}


def quarter(path: str) -> float:
    return read_model_files(path).expert_bytes / 4 / MiB


def run(path: str, *flags: object, prompt: str = PROMPT, n: int = N) -> Completion:
    """One answer through the one generation loop with these bmoe-cli flags (the synthetic model's prompt unless
    given)."""
    with load(path, *FLAGS, *flags) as m:
        return complete(m, prompt, n)


def drafts_of(c: Completion) -> tuple[int, int]:
    return sum(t.drafted for t in c.tokens), sum(t.accepted for t in c.tokens)


# ---- the pieces ----------------------------------------------------------------------------------------------


def test_the_lookup_drafts_the_follower_of_the_longest_ngram_that_clears_llama_cpps_thresholds() -> None:
    # after ... 3 4 5 1 2, the 4-gram (5 1 2)... has been followed by 3 once: a 4-gram needs one sighting
    assert NgramLookup([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]).draft(4) == [3, 4, 5, 1]
    assert NgramLookup([7, 8, 9, 7, 8]).draft(3) == []  # a 2-gram needs two sightings: (7 8) had one
    assert NgramLookup([7, 8, 9, 7, 8, 9, 7, 8]).draft(3) == [9, 7, 8]  # (7 8) twice, then the 4-grams it makes
    assert NgramLookup([5, 6, 5, 7]).draft(2) == []  # 1-gram 7 never seen followed; nothing longer matches
    # a 1-gram needs two sightings with 66% for one follower: 3 after 1 twice of three clears it
    assert NgramLookup([1, 3, 1, 3, 1, 4, 0, 1]).draft(1) == [3]
    assert NgramLookup([1, 3, 1, 4, 0, 1]).draft(1) == []  # 50%: below 66
    assert NgramLookup([1]).draft(4) == []


def test_verify_keeps_the_drafts_the_sampler_agrees_with_and_the_token_it_chose_next() -> None:
    never = lambda t: False  # noqa: E731
    assert verify([5, 1, 2, 3], lambda i: [1, 2, 9, 0][i], never) == [1, 2, 9]  # two accepted, then 9
    assert verify([5, 1, 2], lambda i: [1, 2, 4][i], never) == [1, 2, 4]  # all accepted, 4 sampled after
    assert verify([5, 1, 2], lambda i: [8, 2, 4][i], never) == [8]  # none: only row 0 is sampled
    assert verify([5, 1, 2], lambda i: [1, 2, 4][i], lambda t: t == 1) == [1]  # an end of generation ends it


def plain(g: DraftGate, tokens: int, ms: float) -> None:
    """`tokens` steps without drafts, each one token in `ms`."""
    for _ in range(tokens):
        g.step(DraftTally(), 1, ms / 1e3)


def verifies(g: DraftGate, tokens: int, ms_per_step: float, accepted: int = 2, drafted: int = 4) -> None:
    """Verify steps, each generating `accepted` + 1 tokens in `ms_per_step`, until `tokens` are generated."""
    for _ in range(tokens // (accepted + 1)):
        g.step(DraftTally(1, drafted, accepted), accepted + 1, ms_per_step / 1e3)


def guesses(g: DraftGate, right: int, ms: float = 10) -> None:
    """The gate's GUESS steps, `right` of their guesses the token chosen next."""
    for i in range(DraftGate.GUESS):
        g.step(DraftTally(guesses=1, right=int(i < right)), 1, ms / 1e3)


def drafting() -> DraftGate:
    """A gate past its first guesses (some of them right): drafting, its decisions from here on."""
    g = DraftGate()
    guesses(g, 5)
    assert g.on and g.left == DraftGate.SHORTEST and len(g.decisions) == 1
    g.decisions.clear()
    return g


def cycle(g: DraftGate, drafted_ms: float, after_ms: float, base_ms: float, accepted: int = 2) -> None:
    """One of the gate's cycles: its drafted stretch (verify steps of `drafted_ms` a token), the SETTLE steps after
    it (`after_ms` each: what the stretch left them to read) and the baseline (`base_ms` a token)."""
    assert g.on
    verifies(g, g.left + accepted, drafted_ms * (accepted + 1), accepted)
    plain(g, DraftGate.SETTLE, after_ms)
    plain(g, DraftGate.MEASURE, base_ms)


def test_the_gate_keeps_drafting_where_a_token_costs_enough_less_over_a_stretch_with_drafts() -> None:
    g = drafting()
    cycle(g, 8.5, 10, 10)  # (18 x 8.5 + 8 x 10) / 26 = 8.96 ms a token against 10
    assert g.on and g.left == 2 * DraftGate.SHORTEST
    assert g.decisions == ["on for 32 tokens: 9.0 ms a token over 26 tokens with drafts and after (12 of 24 accepted, "
                           "0.00 MiB extra per accepted token) against 10.0 over 16 without"]
    cycle(g, 9.5, 10, 10)  # (33 x 9.5 + 8 x 10) / 41 = 9.6: drafts that only break even lose to the noise
    assert not g.on and g.decisions[-1].startswith(f"off for {DraftGate.PAUSE} tokens: 9.6 ms a token over 41 tokens")


def test_the_gate_charges_a_stretch_with_drafts_what_it_left_the_steps_after_it() -> None:
    """Under a memory limit the drafted rows' experts evict ones the next tokens need: verify steps that look cheap
    a token (8 ms against 10) lose once the slow steps after them are counted."""
    g = drafting()
    cycle(g, 8, 30, 10)  # (18 x 8 + 8 x 30) / 26 = 14.8
    assert not g.on and g.decisions == [f"off for {DraftGate.PAUSE} tokens: 14.8 ms a token over 26 tokens with "
                                        "drafts and after (12 of 24 accepted, 0.00 MiB extra per accepted token) "
                                        "against 10.0 over 16 without"]


def test_the_gates_pause_doubles_each_time_drafting_loses_and_a_stretch_that_pays_resets_it() -> None:
    g, pauses, stretches = drafting(), [], []
    for _ in range(6):
        cycle(g, 11, 10, 10)
        pauses.append(g.left)
        plain(g, g.left, 10)
        guesses(g, 5)
    assert pauses == [64, 128, 256, 512, 512, 512]
    for _ in range(6):  # paying again and again: each stretch with drafts twice as long, up to its most
        stretches.append(g.left)
        cycle(g, 5, 10, 10)
    assert stretches == [16, 32, 64, 128, 256, 512]
    assert g.left == DraftGate.LONGEST
    cycle(g, 11, 10, 10)
    assert g.left == DraftGate.PAUSE  # the pause short again
    plain(g, g.left, 10)
    assert g.guessing  # and the guesses before the stretch that tries again
    guesses(g, 5)
    assert g.on and g.left == DraftGate.SHORTEST


def test_the_gate_is_off_through_a_stretchs_settling_and_its_baseline() -> None:
    g = drafting()
    verifies(g, DraftGate.SHORTEST + 2, 24)  # 6 steps of 3 tokens
    for stage in ["settle"] * DraftGate.SETTLE + ["measure"] * DraftGate.MEASURE:
        assert not g.on and g.stage == stage
        plain(g, 1, 10)
    assert g.on and len(g.decisions) == 1


def test_one_rejected_verify_step_is_enough_where_its_drafts_made_the_cache_read() -> None:
    g = drafting()
    g.step(DraftTally(1, 2, 0, 3 << 29), 1, 0.5)  # streamed: its drafts' experts read (1.5 GiB), all for nothing
    assert not g.on and g.decisions == [f"off for {DraftGate.SETTLE + DraftGate.PAUSE} tokens: 0 of 2 drafts "
                                        "accepted in 1 verify steps, 1536.00 MiB read for them"]
    g = drafting()
    g.step(DraftTally(1, 2, 0), 1, 0.5)  # resident: nothing read, so SURE steps are asked for
    assert g.on


def test_a_stretch_whose_drafts_were_all_rejected_never_pays() -> None:
    """Fewer than SURE verify steps, none accepted, and a stretch that happened to run faster: noise, not drafts."""
    g = drafting()
    g.step(DraftTally(1, 4, 0), 1, 0.005)
    plain(g, DraftGate.SHORTEST - 1 + DraftGate.SETTLE, 5)
    plain(g, DraftGate.MEASURE, 10)
    assert not g.on and g.decisions[-1].startswith(f"off for {DraftGate.PAUSE} tokens: 5.0 ms a token")


def test_the_gate_guesses_before_it_drafts_and_pauses_without_a_verify_step_where_half_or_fewer_were_right() -> None:
    g = DraftGate()
    assert g.guessing and not g.on and g.left == DraftGate.GUESS  # a run starts guessing
    guesses(g, 0)
    assert g.stage == "pause" and g.left == DraftGate.PAUSE
    assert g.decisions == [f"off for {DraftGate.PAUSE} tokens: 0 of {DraftGate.GUESS} guesses right (checked against "
                           "the token chosen next, not verified)"]
    plain(g, DraftGate.PAUSE, 10)
    assert g.guessing  # the pause over, it guesses again, the next pause twice as long
    guesses(g, 0)
    assert g.left == 2 * DraftGate.PAUSE
    plain(g, g.left, 10)
    guesses(g, DraftGate.GUESS // 2)  # half right: drafts would yield under 2 tokens a verify step
    assert g.stage == "pause" and g.left == 4 * DraftGate.PAUSE
    plain(g, g.left, 10)
    guesses(g, DraftGate.GUESS // 2 + 1)
    assert g.on and g.decisions[-1] == (f"on for {DraftGate.SHORTEST} tokens: 5 of {DraftGate.GUESS} guesses right "
                                        "(checked against the token chosen next, not verified)")


def test_the_gate_counts_guesses_not_tokens() -> None:
    """The n-gram lookup finds nothing to draft for a while: those steps made no guess and teach nothing (and a
    guess costs nothing where none is made), so the gate guesses until it has made GUESS of them."""
    g = DraftGate()
    plain(g, 5 * DraftGate.GUESS, 10)
    assert g.guessing
    guesses(g, 0)
    assert g.stage == "pause"


def test_the_gate_stops_a_stretch_whose_first_verify_steps_accepted_nothing() -> None:
    g = drafting()
    for _ in range(DraftGate.SURE - 1):
        g.step(DraftTally(1, 4, 0), 1, 0.001)  # fast, but no draft paid for its row
    assert g.on
    g.step(DraftTally(1, 4, 0), 1, 0.001)
    assert not g.on and g.decisions == [f"off for {DraftGate.SETTLE + DraftGate.PAUSE} tokens: 0 of 12 drafts "
                                        "accepted in 3 verify steps"]


def test_bmoe_bench_reads_the_drafts_from_a_runs_generation_line() -> None:
    from bmoe.tools import bench_numbers

    t = telemetry.RunTotals(tokens=10, wall_s=1.0, io_s=0.0, mgmt_s=0.0, stall_s=0.0, read_bytes=0, drafting=True,
                            drafted=8, accepted=5, draft_extra_bytes=2**20)
    line = telemetry.generation_line(t)
    assert line == "generation: 10 tokens, 0.1000 s/token (10.00 tok/s) drafted=8 accepted=5 draft_extra_mib=1.00"
    r = bench_numbers.run_numbers(line + "\n")
    assert (r["tokens"], r["drafted"], r["accepted"], r["draft_extra_mib"]) == (10, 8, 5, 1.0)
    assert bench_numbers.run_numbers(telemetry.generation_line(replace(t, drafting=False)) + "\n")["drafted"] is None


# ---- lossless ------------------------------------------------------------------------------------------------


def by_hand_on_llama_cpp_python(path: str, prompt: str, n: int, most: int) -> list[int]:
    """The drafting loop written out on llama-cpp-python's own Llama (its context, llama.cpp's C API): the prompt
    in one decode, then per step the module's lookup drafts, one decode of the chosen token and the drafts with
    every row's logits, the module's verify with a greedy chain, llama_memory_seq_rm of the rest."""
    llm = plain_llama(path, n_ctx=256, n_batch=256, n_ubatch=256, n_threads=2, n_threads_batch=2, flash_attn=True)
    chain = llama.make_sampler(SamplerSettings(temp=0.0))
    try:
        ctx, vocab = llm._ctx.ctx, llama.Vocab(llm._model.model)
        toks = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        assert llama.decode(ctx, [(0, toks, 0)])[0] == 0
        lookup = NgramLookup(toks)
        nxt = llama.sample(chain, ctx, len(toks) - 1)
        lookup.add([nxt])
        out: list[int] = []
        while len(out) < n and not vocab.is_eog(nxt):
            group = [nxt, *lookup.draft(min(most, n - len(out) - 1))]
            pos = len(toks) + len(out)
            assert llama.decode(ctx, [(0, group, pos)], every_logit=len(group) > 1)[0] == 0

            def choose(i: int) -> int:
                t = llama.sample(chain, ctx, i)
                lookup.add([t])
                return t

            got = verify(group, choose, vocab.is_eog)
            assert llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, pos + len(got), -1)
            out += group[:len(got)]
            nxt = got[-1]
        return out
    finally:
        llama.free_sampler(chain)
        llm.close()


@pytest.mark.parametrize("width", [1, 4])
def test_the_drafting_reference_is_llama_cpp_pythons_context_doing_the_same_work(models, width: int) -> None:
    path = models["synth"]
    ref = run(path, "--no-stream", "--draft", "ngram", "--draft-max", width, "--no-draft-gate")
    drafted, accepted = drafts_of(ref)
    assert drafted > accepted > 0, "the reference must accept and reject drafts, or it proves little"
    assert list(ref.ids) == by_hand_on_llama_cpp_python(path, PROMPT, N, width)


# every width on the synthetic model; the demo (a real language model's text, 20 s a load here) at the ends
GREEDY = [("synth", w) for w in (1, 2, 3, 4)] + [("demo8", w) for w in (1, 4)]


@pytest.mark.parametrize(("name", "width"), GREEDY)
def test_streamed_drafts_equal_plain_llama_cpp_drafting_the_same(models, name: str, width: int) -> None:
    """The lossless gate: greedy, a quarter of the experts cached (misses every token), two lanes; the text
    equals --no-stream's with the same drafts, token for token, and drafts were accepted and rejected."""
    path, prompt = models[name], PROMPTS[name]
    draft = ("--draft", "ngram", "--draft-max", width, "--no-draft-gate")
    ref = run(path, "--no-stream", *draft, prompt=prompt)
    res = run(path, "--cache-mb", quarter(path), "--io-threads", 2, "--force", *draft, prompt=prompt)
    assert res.ids == ref.ids and res.text == ref.text
    assert drafts_of(res) == drafts_of(ref)
    drafted, accepted = drafts_of(res)
    assert drafted > accepted > 0
    assert sum(t.lookups - t.hits for t in res.tokens) > 0, "a quarter of the experts must miss"
    assert all(t.drafted <= width for t in res.tokens)


def test_seeded_sampling_drafts_losslessly(models) -> None:
    """The chain samples every kept token in order (its seeded draw included), so a seeded run drafts losslessly."""
    path, prompt = models["demo8"], PROMPTS["demo8"]
    flags = ("--temp", 0.7, "--seed", 7, "--draft", "ngram", "--draft-max", 3, "--no-draft-gate")
    ref = run(path, "--no-stream", *flags, prompt=prompt)
    res = run(path, "--cache-mb", quarter(path), "--io-threads", 2, "--force", *flags, prompt=prompt)
    assert res.ids == ref.ids and res.text == ref.text and drafts_of(res)[1] > 0


def test_drafts_against_one_token_at_a_time(models) -> None:
    """What ggml's CPU kernels give (docs/levers.md): on the synthetic q8_0 MoE a verify batch's rows compute as the
    tokens alone do, so drafting's text equals decoding one token at a time. (Not on every model: the 8-expert
    demo's answer to its prompt leaves the one-token text at its 36th token at any width on the Xeon this was
    measured on, the KV of rows computed in a batch of several being a rounding apart.)"""
    path, prompt = models["synth"], PROMPTS["synth"]
    plain = run(path, "--no-stream", prompt=prompt)
    for width in (1, 4):
        drafted = run(path, "--no-stream", "--draft", "ngram", "--draft-max", width, "--no-draft-gate", prompt=prompt)
        assert drafted.ids == plain.ids


# ---- the gate at work ----------------------------------------------------------------------------------------


def test_the_gate_tells_its_decisions_and_leaves_the_text_alone(models) -> None:
    """A cache of 1 MiB (every drafted row's experts are read) and a prompt whose first drafts are all rejected (the
    ungated run shows it): the gated run guesses first (its first decision says how many of its GUESS guesses were
    right), verifies fewer drafts, says what it decides, and its text is the same (on this model drafting is
    byte-identical to one token at a time)."""
    path = models["synth"]
    prompt = "red red red red red red"
    flags = ("--draft", "ngram", "--draft-max", 4, "--cache-mb", 1)
    ungated = run(path, *flags, "--no-draft-gate", prompt=prompt, n=160)
    firsts = [t for t in ungated.tokens if t.drafted][:DraftGate.SURE]
    assert [t.accepted for t in firsts] == [0] * DraftGate.SURE
    told: list[str] = []
    with load(path, *FLAGS, *flags, notice=told.append) as m:
        gated = complete(m, prompt, 160)
    assert gated.ids == ungated.ids
    assert sum(t.drafted for t in gated.tokens) < sum(t.drafted for t in ungated.tokens)
    gate = [t for t in told if t.startswith("draft gate: ")]
    assert re.fullmatch(rf"draft gate: (on|off) for \d+ tokens: \d+ of {DraftGate.GUESS} guesses right \(checked "
                        r"against the token chosen next, not verified\)", gate[0]), told
    assert all(t.startswith(("draft gate: off for ", "draft gate: on for ")) for t in gate), told


# ---- where users meet it -------------------------------------------------------------------------------------


def test_bmoe_cli_drafts_and_reports_them_in_trailing_keys(models, tmp_path) -> None:
    path, csv = models["synth"], tmp_path / "run.csv"
    args = ("-m", path, "-p", PROMPT, "-n", str(N), "-c", "256", "--cache-mb", str(quarter(path)), "--force")
    r = run_cli(*args, "--draft", "ngram", "--draft-max", "3", "--no-draft-gate", "--progress", "--csv", str(csv))
    plain = run_cli(*args, "--no-stream", "--draft", "ngram", "--draft-max", "3", "--no-draft-gate", "--progress")
    assert r.returncode == 0 and plain.returncode == 0, r.stderr + plain.stderr
    run_, ref = telemetry.parse_output(r.stdout), telemetry.parse_output(plain.stdout)
    assert run_.answer == ref.answer and run_.answer.strip()
    progress = [obj for tag, obj in run_.events if tag == "PROGRESS"]
    for obj in progress:  # the contract's keys in its order, then bmoe's
        assert tuple(obj) == (*spec_lines.PROGRESS_KEYS, "drafted", "accepted", "draft_extra_mb")
    drafted, accepted = sum(o["drafted"] for o in progress), sum(o["accepted"] for o in progress)
    assert drafted > accepted > 0
    gen = next(x for x in r.stdout.splitlines() if x.startswith("generation: "))
    head, _, _ = gen.partition(" drafted=")
    assert spec_lines.summary_matches("generation", head), gen  # the contract's line, then bmoe's keys
    parsed = telemetry.parse_summary(gen)
    assert parsed is not None and (parsed[1]["drafted"], parsed[1]["accepted"]) == (drafted, accepted), gen
    rows, summary = telemetry.read_csv(csv.read_text())
    header = csv.read_text().splitlines()[0]
    assert header.endswith(",page_cache_bytes,page_cache_ms,drafted,accepted,draft_extra_bytes"), header
    assert sum(row["drafted"] for row in rows) == summary["drafted"] == drafted
    without = run_cli(*args, "--progress")
    assert "drafted" not in without.stdout, "a run without drafts keeps the contract's lines as they were"


def test_drafting_with_one_token_work_or_a_recurrent_model_is_refused_by_name(models, synth, tmp_path) -> None:
    r = run_cli("-m", models["synth"], "-p", "Hi", "-n", "4", "--draft", "ngram", "--route-trace",
                str(tmp_path / "t.jsonl"))
    assert r.returncode != 0 and "--draft ngram" in r.stderr and "--route-trace" in r.stderr, r.stderr
    hybrid = str(synth(arch="qwen3next"))
    r = run_cli("-m", hybrid, "-p", "Hi", "-n", "4", "--draft", "ngram")
    assert r.returncode != 0 and "--draft ngram" in r.stderr and "recurrent" in r.stderr, r.stderr


def test_bmoe_load_takes_the_drafting_keywords(models) -> None:
    import bmoe

    with bmoe.load(models["synth"], n_ctx=256, threads=2, draft="ngram", draft_max=2, draft_gate=False) as m:
        t0 = time.perf_counter()
        text = m.generate(PROMPT, max_tokens=N)
        spent = time.perf_counter() - t0
        stats = m.stats.last
    assert text == run(models["synth"], "--no-stream", "--draft", "ngram", "--draft-max", 2,
                       "--no-draft-gate").text
    assert stats is not None and stats.drafted > stats.accepted > 0
    # a verify step's tokens share its wall time: the tokens' times add up to no more than the call took
    assert stats.completion_tokens / stats.tok_s <= spent


def test_the_session_ends_its_done_line_with_the_drafts(models) -> None:
    req = json.dumps({"cmd": "generate", "id": 1, "prompt": PROMPT, "n_predict": N})
    r = subprocess.run([sys.executable, "-m", "bmoe.cli", "--session", "-m", models["synth"], "-c", "256",
                        "--draft", "ngram", "--no-draft-gate"], input=req + "\n", capture_output=True, text=True,
                       timeout=240, cwd=REPO)
    assert r.returncode == 0, r.stderr
    tagged = [t for t in map(telemetry.parse_tagged, r.stdout.splitlines()) if t is not None]
    done = next(obj for tag, obj in tagged if tag == "DONE")
    assert tuple(done)[-4:] == ("page_cache_mib", "drafted", "accepted", "draft_extra_mib")
    progress = [obj for tag, obj in tagged if tag == "PROGRESS"]
    drafted, accepted = sum(o["drafted"] for o in progress), sum(o["accepted"] for o in progress)
    assert (done["drafted"], done["accepted"]) == (drafted, accepted) and drafted >= accepted

