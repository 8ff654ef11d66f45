"""`--draft mtp` (bmoe.engine.mtp): drafts from the model's own multi-token-prediction layer, verified in one decode.

Lossless means what it means for n-gram drafts (tests/test_drafts.py): the text equals plain llama.cpp's doing the
same speculative work. The reference is bmoe's one generation loop on `--no-stream` with the same MTP drafts;
`test_the_mtp_reference_is_llama_cpps_own_contexts_doing_the_same_work` holds it to llama.cpp's own two contexts (the
target and its MTP context, llama-cpp-python's bindings) running llama-server's draft-mtp loop by hand. Then the
gates: streamed with a quarter of the experts cached, the MTP layer's experts among them (every expert byte a
matmul reads is the file's: SlabCheck), equals the reference at widths 1 to 4, greedy and seeded, q8_0 and Q4_K_M,
on every architecture whose MTP layer the pinned llama.cpp drafts with and bmoe-synth writes.

An MTP decode that only follows the target (no outputs) reads none of the MTP layer's experts (its KV does not
depend on them): SlabCheck checks that each of its positions reads the spare slot's zeros, and the drafts equal the
reference's, which computed them.

The synthetic models' MTP layers have random weights: their drafts are never what the trunk samples. So the gates
also run on `agreeing` copies (glm4moe, and qwen35moe, whose recurrent state then rolls back part of a group), whose
MTP layer mostly predicts what the trunk will: the drafts are accepted and rejected.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from bmoe.api import Completion
from bmoe.base.model_files import read_model_files
from bmoe.base.settings import SamplerSettings
from bmoe.base.units import MiB
from bmoe.engine.drafts import verify
from bmoe.engine.mtp import MtpDrafts
from bmoe.seam import llama
from tests.conftest import SlabCheck, complete, load, run_cli

PROMPT = "one two three one two three one two three one two"
N = 32
FLAGS = ("-c", 256, "-t", 2)
# the architectures whose MTP layer the pinned llama.cpp drafts with (a DECODER_MTP graph) and bmoe-synth writes
# (--mtp), whose memory can drop rejected drafts: a KV cache, or qwen35moe's recurrent state through llama.cpp's
# per-token snapshots (n_rs_seq). deepseek4 is left out: llama.cpp dies of SIGFPE reserving its MTP context's graph
# (llama_init_from_model with LLAMA_CONTEXT_TYPE_MTP) on bmoe-synth's deepseek4; qwen3next is refused (no snapshots)
MTP_DRAFTS = ("qwen35moe", "glm4moe", "deepseek2", "glm-dsa", "bailingmoe3")


def model(synth, arch: str, quant: str = "q8_0") -> str:
    return str(synth(arch=arch, quant=quant, mtp=True, embd=256 if quant == "q4_k_m" else 128))


AGREEING = ("glm4moe", "qwen35moe")
STATE_SHARE = 0.5  # of the carried hidden state the agreeing MTP layer adds to the token's embedding


@pytest.fixture(scope="module")
def agreeing(synth, tmp_path_factory) -> dict[str, str]:
    """Copies of the q8_0 test models whose MTP layer mostly drafts what the trunk samples next: every block's
    output projections (attention, recurrent, dense and expert down matmuls; for q8_0 experts each block's scale)
    scaled by 1/20, so each position's hidden state is nearly its token's embedding and the trunk nearly a map from
    the token to the next; and the MTP layer's eh_proj passing the token's normed embedding through with
    STATE_SHARE of the carried state, so its head, the trunk's output matrix, nearly draws that map too. The rest
    (the state, the layers' and the MTP block's own contributions, the experts among them) makes them disagree now
    and then, and a wrong carried state changes the drafts."""
    return {arch: agreeing_copy(synth, tmp_path_factory.mktemp("agreeing"), arch, STATE_SHARE) for arch in AGREEING}


def agreeing_copy(synth, folder: Path, arch: str, share: float) -> str:
    """The q8_0 test model of `arch` made to agree (`agreeing`), the MTP layer taking `share` of the carried state."""
    src = Path(model(synth, arch))
    dst = folder / src.name
    shutil.copyfile(src, dst)
    files = read_model_files(src)
    mm = np.memmap(dst, dtype=np.uint8, mode="r+")
    for name, e in files.extents.items():
        raw = mm[e.offset:e.offset + e.nbytes]
        if name.endswith(("attn_output.weight", "ffn_down.weight", "ffn_down_shexp.weight", "ssm_out.weight")):
            raw.view(np.float16)[:] = raw.view(np.float16) / np.float16(20)
        elif name.endswith("ffn_down_exps.weight"):  # q8_0: 34-byte blocks, an f16 scale first
            blocks = raw.reshape(-1, 34)
            blocks[:, :2] = (blocks[:, :2].copy().view(np.float16) / np.float16(20)).view(np.uint8)
        elif name.endswith("nextn.eh_proj.weight"):  # [2 n_embd inputs (embedding, state), n_embd outputs]
            width = int(np.sqrt(raw.size // 2 // 2))  # n_embd: the matrix holds 2 * n_embd^2 halves
            eye = np.zeros((width, 2 * width), np.float16)
            eye[np.arange(width), np.arange(width)] = 1
            eye[np.arange(width), width + np.arange(width)] = share
            raw.view(np.float16)[:] = eye.ravel()
    mm.flush()
    del mm
    return str(dst)


@pytest.fixture
def drafts_made(monkeypatch) -> list[list[int]]:
    """Every draft the MTP layer makes while the test runs, in order (the drafts themselves, not their count: a
    wrong expert byte in the MTP layer changes them while the trunk's text, which rejects them, stays)."""
    made: list[list[int]] = []
    draft = MtpDrafts.draft

    def recorded(self: MtpDrafts, *args: int) -> list[int]:
        made.append(draft(self, *args))
        return made[-1]

    monkeypatch.setattr(MtpDrafts, "draft", recorded)
    return made


def run(path: str, *flags: object, n: int = N) -> Completion:
    with load(path, *FLAGS, *flags) as m:
        return complete(m, PROMPT, n)


def drafted(c: Completion) -> list[tuple[int, int]]:
    """Per token: the drafts its verify step carried and how many were accepted."""
    return [(t.drafted, t.accepted) for t in c.tokens]


def taken(made: list[list[int]]) -> list[list[int]]:
    """The drafts made so far, the list emptied for the next run."""
    out = list(made)
    made.clear()
    return out


def mtp(width: int) -> tuple[object, ...]:
    return ("--draft", "mtp", "--draft-max", width, "--no-draft-gate")


# ---- the reference -------------------------------------------------------------------------------------------


def by_hand(path: str, width: int, n: int) -> tuple[list[int], list[list[int]]]:
    """llama-server's draft-mtp loop (common/speculative.cpp's common_speculative_impl_draft_mtp, one head, and
    server-context.cpp's verify) written out on llama.cpp's own contexts: the target context keeping every row's
    hidden state and `width` recurrent snapshots, the MTP context following each target decode with the states
    shifted by one, drafts from the MTP context's likeliest tokens, their positions dropped before the verify, the
    state of the last kept row carried. Returns the tokens and the drafts of each step."""
    llama.init_backend()
    mp = llama.model_params(mtp=True)
    mdl = llama_cpp.llama_model_load_from_file(path.encode(), mp)
    assert mdl and llama_cpp.llama_model_n_layer_nextn(mdl) == 1

    def params(mtp_of: object = None) -> llama_cpp.llama_context_params:
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
        cp.n_threads = cp.n_threads_batch = 2
        cp.kv_unified = False
        cp.n_rs_seq = 0 if mtp_of else width
        if mtp_of:
            cp.ctx_type, cp.ctx_other = llama_cpp.LLAMA_CONTEXT_TYPE_MTP, mtp_of
        return cp

    tgt = llama_cpp.llama_init_from_model(mdl, params())
    dft = llama_cpp.llama_init_from_model(mdl, params(tgt))
    chain = llama.make_sampler(SamplerSettings(temp=0.0))
    vocab = llama.Vocab(mdl)
    try:
        llama.set_embeddings_nextn(tgt, masked=False)
        llama.set_embeddings_nextn(dft, masked=True)
        zero = np.zeros((1, llama.n_embd_out(mdl)), np.float32)

        def process(toks: list[int], pos: int, carried: np.ndarray) -> np.ndarray:
            h = llama.nextn_rows(tgt, mdl, range(len(toks)))
            assert llama.decode_mtp(dft, [(0, toks, pos, np.vstack([carried, h[:-1]]))], outputs=False)[0] == 0
            return h

        toks = vocab.tokenize(PROMPT)
        assert llama.decode(tgt, [(0, toks, 0)])[0] == 0
        carried = process(toks, 0, zero)[-1:]
        nxt = llama.sample(chain, tgt, len(toks) - 1)
        out: list[int] = []
        made: list[list[int]] = []
        while len(out) < n and not vocab.is_eog(nxt):
            pos = len(toks) + len(out)
            drafts, h, last = [], carried, nxt
            for i in range(min(width, n - len(out) - 1)):
                assert llama.decode_mtp(dft, [(0, [last], pos + i, h)], outputs=True)[0] == 0
                last = int(np.argmax(llama.logits(dft, vocab, 0)))
                drafts.append(last)
                h = llama.nextn_rows(dft, mdl, [0])
            assert llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(dft), 0, pos, -1)
            made += [drafts] if drafts else []
            group = [nxt, *drafts]
            assert llama.decode(tgt, [(0, group, pos)], every_logit=len(group) > 1)[0] == 0
            rows = process(group, pos, carried)
            got = verify(group, lambda i: llama.sample(chain, tgt, i), vocab.is_eog)
            carried = rows[len(got) - 1:len(got)]
            for ctx in (tgt, dft):
                assert llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, pos + len(got), -1)
            out += group[:len(got)]
            nxt = got[-1]
        return out, made
    finally:
        llama.free_sampler(chain)
        llama.free_context(dft)
        llama.free_context(tgt)
        llama.free_model(mdl)


@pytest.mark.parametrize(("arch", "width"), [("glm4moe", 1), ("glm4moe", 4), ("qwen35moe", 3)])
def test_the_mtp_reference_is_llama_cpps_own_contexts_doing_the_same_work(synth, drafts_made, arch: str,
                                                                          width: int) -> None:
    """The same tokens and the same drafts, step by step."""
    path = model(synth, arch)
    ref = run(path, "--no-stream", *mtp(width))
    assert sum(d for d, _ in drafted(ref)) > 0
    assert (list(ref.ids), taken(drafts_made)) == by_hand(path, width, N)


# ---- the gates -----------------------------------------------------------------------------------------------

GREEDY = [(a, "q8_0", w) for a in MTP_DRAFTS for w in (1, 2, 3, 4)] + [
    (a, "q4_k_m", w) for a in ("qwen35moe", "glm4moe") for w in (1, 4)]


def streamed(path: str, *flags: object) -> tuple[Completion, set[int]]:
    """A run with a quarter of the experts cached, two lanes, every expert byte a matmul reads checked against the
    file; with it the layers whose experts were checked."""
    files = read_model_files(path)
    with load(path, *FLAGS, "--cache-mb", files.expert_bytes / 4 / MiB, "--io-threads", 2, "--force", *flags) as m:
        check = SlabCheck(m.engine)
        try:
            res = complete(m, PROMPT, N)
        finally:
            check.close()
        every = replace(files, mtp_layers=frozenset()).expert_names()  # the MTP layer's experts too
        assert {r.name for r in m.engine.streamer.cache.regions} == every
    assert check.checked > 0 and not check.bad, check.bad[:3]
    assert check.blind > 0  # the MTP layer's follows of the target (no outputs) read none of its experts
    return res, set(check._slots)


@pytest.mark.parametrize(("arch", "quant", "width"), GREEDY)
def test_streamed_mtp_drafts_equal_plain_llama_cpp_drafting_the_same(synth, drafts_made, arch: str, quant: str,
                                                                     width: int) -> None:
    """The lossless gate: greedy; the text and every step's drafts equal --no-stream's, and the MTP layer's experts
    were streamed (missed, read, checked byte for byte) like the trunk's."""
    path = model(synth, arch, quant)
    ref = run(path, "--no-stream", *mtp(width))
    want = taken(drafts_made)
    res, layers = streamed(path, *mtp(width))
    assert res.ids == ref.ids and res.text == ref.text
    assert taken(drafts_made) == want and drafted(res) == drafted(ref) and sum(d for d, _ in drafted(res)) > 0
    assert all(d <= width for d, _ in drafted(res))
    assert max(read_model_files(path).mtp_layers) in layers, "the MTP layer's experts must be streamed"
    assert sum(t.lookups - t.hits for t in res.tokens) > 0, "a quarter of the experts must miss"


@pytest.mark.parametrize(("arch", "width"), [(a, w) for a in AGREEING for w in (1, 2, 3, 4)])
def test_accepted_mtp_drafts_stream_losslessly(agreeing, drafts_made, arch: str, width: int) -> None:
    """On a model whose MTP layer mostly agrees with its trunk: drafts accepted and rejected (qwen35moe's recurrent
    state rolled back past the accepted ones), streamed equal to --no-stream, token for token and draft for draft."""
    path = agreeing[arch]
    ref = run(path, "--no-stream", *mtp(width))
    want = taken(drafts_made)
    res, layers = streamed(path, *mtp(width))
    assert res.ids == ref.ids and res.text == ref.text and taken(drafts_made) == want
    assert drafted(res) == drafted(ref)
    made, kept = sum(d for d, _ in drafted(res)), sum(a for _, a in drafted(res))
    assert made > kept > 0, (made, kept)
    if width > 1:
        assert any(0 < a < d for d, a in drafted(res)), "some step must keep part of its drafts"
    assert max(read_model_files(path).mtp_layers) in layers


@pytest.mark.parametrize(("arch", "width"), [("glm4moe", 4), ("qwen35moe", 2), ("qwen35moe", 4)])
def test_accepted_mtp_drafts_are_llama_cpps_own_contexts_doing_the_same_work(agreeing, drafts_made, arch: str,
                                                                            width: int) -> None:
    path = agreeing[arch]
    ref = run(path, "--no-stream", *mtp(width))
    assert sum(a for _, a in drafted(ref)) > 0
    assert (list(ref.ids), taken(drafts_made)) == by_hand(path, width, N)


@pytest.mark.parametrize(("arch", "quant"), [("qwen35moe", "q8_0"), ("glm4moe", "q4_k_m")])
def test_seeded_sampling_drafts_with_mtp_losslessly(synth, drafts_made, arch: str, quant: str) -> None:
    path = model(synth, arch, quant)
    flags = ("--temp", 0.8, "--seed", 11, *mtp(3))
    ref = run(path, "--no-stream", *flags)
    want = taken(drafts_made)
    res, _ = streamed(path, *flags)
    assert res.ids == ref.ids and res.text == ref.text and taken(drafts_made) == want and want


# ---- refused by name -----------------------------------------------------------------------------------------


def test_mtp_drafting_is_refused_by_name_where_it_cannot_run(synth, small_moe: Path, tmp_path) -> None:
    r = run_cli("-m", str(small_moe), "-p", "Hi", "-n", "4", "--draft", "mtp")
    assert r.returncode != 0 and "--draft mtp" in r.stderr and "no multi-token-prediction layer" in r.stderr \
        and "--draft ngram" in r.stderr, r.stderr
    r = run_cli("-m", str(synth(arch="qwen3next", mtp=True)), "-p", "Hi", "-n", "4", "--draft", "mtp")
    assert r.returncode != 0 and "--draft mtp" in r.stderr and "recurrent state" in r.stderr, r.stderr
    path = model(synth, "glm4moe")
    for flags, named in ((("--spec-gate",), "--spec-gate"),
                         (("--prompt-cache", str(tmp_path / "pc")), "--prompt-cache"),
                         (("--route-trace", str(tmp_path / "t.jsonl")), "--route-trace")):
        r = run_cli("-m", path, "-p", "Hi", "-n", "4", "--draft", "mtp", *flags)
        assert r.returncode != 0 and "--draft mtp" in r.stderr and named in r.stderr, r.stderr


# ---- where users meet it -------------------------------------------------------------------------------------


def test_bmoe_cli_reports_mtp_drafts_in_the_trailing_keys_ngram_drafts_use(synth) -> None:
    """The contract's lines as n-gram drafting ends them (tests/test_drafts.py), from the MTP layer's drafts; the
    extra MiB count the MTP layer's drafting decodes too (every expert they read is one no token would have)."""
    from bmoe.base import telemetry
    from tests import spec_lines

    path = model(synth, "qwen35moe")
    quarter = f"{read_model_files(path).expert_bytes / 4 / MiB:.3f}"
    r = run_cli("-m", path, "-p", PROMPT, "-n", str(N), "-c", "256", "--cache-mb", quarter, "--force", "--progress",
                "--draft", "mtp", "--draft-max", "2", "--no-draft-gate")
    assert r.returncode == 0, r.stderr
    out = telemetry.parse_output(r.stdout)
    progress = [obj for tag, obj in out.events if tag == "PROGRESS"]
    assert progress and all(tuple(o) == (*spec_lines.PROGRESS_KEYS, "drafted", "accepted", "draft_extra_mb")
                            for o in progress)
    drafted = sum(o["drafted"] for o in progress)
    gen = next(x for x in r.stdout.splitlines() if x.startswith("generation: "))
    parsed = telemetry.parse_summary(gen)
    assert parsed is not None and parsed[1]["drafted"] == drafted > 0 and parsed[1]["draft_extra_mib"] > 0, gen


def test_bmoe_load_drafts_with_the_mtp_layer(synth) -> None:
    import bmoe

    path = model(synth, "glm4moe")
    with bmoe.load(path, n_ctx=256, threads=2, draft="mtp", draft_max=2, draft_gate=False) as m:
        text = m.generate(PROMPT, max_tokens=N)
        stats = m.stats.last
    assert stats is not None and stats.drafted > 0
    assert text == run(path, "--no-stream", *mtp(2)).text


def test_the_gate_turns_mtp_drafting_off_when_its_guesses_are_wrong_and_the_mtp_layer_rests(synth, drafts_made,
                                                                                             monkeypatch) -> None:
    """Random MTP weights: no draft is right. The gate guesses first (a draft of one token after each chosen token,
    checked against the next, not verified): all GUESS wrong, drafting is off for the pause with no verify step
    made; then it guesses again. While it is off the MTP layer does nothing: the tokens decoded meanwhile are
    decoded there when it next drafts, in one call. No draft was verified, so the text is plain decoding's."""
    from bmoe.engine.drafts import DraftGate

    calls: list[tuple[int, bool]] = []  # each MTP decode: its tokens, and whether it drafts (an output)
    decode_mtp = llama.decode_mtp

    def counted(ctx: object, parts: list, outputs: bool) -> tuple[int, list[int]]:
        calls.append((sum(len(p[1]) for p in parts), outputs))
        return decode_mtp(ctx, parts, outputs)

    monkeypatch.setattr(llama, "decode_mtp", counted)
    path = model(synth, "glm4moe")
    g, pause = DraftGate.GUESS, DraftGate.PAUSE
    n = g + pause + g + 1
    told: list[str] = []
    with load(path, *FLAGS, "--draft", "mtp", "--draft-max", 2, notice=told.append) as m:
        calls.clear()  # the load's graph capture
        gated = complete(m, PROMPT, n)
    assert [t for t in told if t.startswith("draft gate: ")] == [
        f"draft gate: off for {p} tokens: 0 of {g} guesses right (checked against the token chosen next, not verified)"
        for p in (pause, 2 * pause)]
    assert not any(t.drafted for t in gated.tokens)
    made = taken(drafts_made)
    assert len(made) == 2 * g and all(len(d) == 1 for d in made)
    assert gated.ids == run(path, n=n).ids
    drafts = [i for i, (_, out) in enumerate(calls) if out]
    assert len(drafts) == 2 * g  # a decode of one token each: the guesses
    follows = [k for k, out in calls[drafts[g - 1] + 1:drafts[g]] if not out]
    assert follows == [pause + 1], calls  # the pause (and the guess's token before it) caught up at once
    assert all(k == 1 for k, _ in calls[drafts[0] + 1:drafts[g - 1]]), calls  # guessing: a token at a time


def test_the_gate_lets_an_mtp_layer_that_guesses_right_draft(synth, tmp_path) -> None:
    """An agreeing copy whose MTP layer takes a tenth of the carried state predicts the trunk two times in three
    (`agreeing`'s, at half, one in three): more than half of the gate's first guesses are right, so the drafted
    stretch starts after them (no verify step before it) and its drafts are accepted. (The guesses' decision
    depends on the tokens alone, the stretch's on time: only the first is pinned.)"""
    from bmoe.engine.drafts import DraftGate

    told: list[str] = []
    path = agreeing_copy(synth, tmp_path, "glm4moe", 0.1)
    with load(path, *FLAGS, "--draft", "mtp", "--draft-max", 2, notice=told.append) as m:
        res = complete(m, PROMPT, N)
    gate = [t for t in told if t.startswith("draft gate: ")]
    right = re.fullmatch(rf"draft gate: on for {DraftGate.SHORTEST} tokens: (\d) of {DraftGate.GUESS} guesses right "
                         r"\(checked against the token chosen next, not verified\)", gate[0] if gate else "")
    assert right and int(right[1]) > DraftGate.GUESS // 2, told
    assert not any(t.drafted for t in res.tokens[:DraftGate.GUESS]) and sum(t.accepted for t in res.tokens) > 0


def test_a_tokens_cycle_of_layers_leaves_the_mtp_block_out(synth) -> None:
    """The MTP block runs in the MTP context's own decodes, not after the trunk's last layer: with --prefetch the
    read-ahead never wishes for its experts (after the trunk's last layer it wishes for the next token's first),
    and the run is --no-stream's, token for token."""
    path = model(synth, "glm4moe")
    files = read_model_files(path)
    block = max(files.mtp_layers)
    ref = run(path, "--no-stream", *mtp(2))
    with load(path, *FLAGS, "--cache-mb", files.expert_bytes / 4 / MiB, "--force", "--prefetch", 1, *mtp(2)) as m:
        st = m.engine.streamer
        assert block in st.layers and block not in st.ahead.layers
        wished: list[int] = []
        wish = st.ahead._wish

        def seen(layer: int, experts: object) -> None:
            wished.append(layer)
            wish(layer, experts)

        st.ahead._wish = seen
        res = complete(m, PROMPT, N)
    assert res.ids == ref.ids
    assert min(st.ahead.layers) in wished and block not in wished


def test_ngram_drafts_run_on_a_hybrid_model_through_llama_cpps_state_snapshots(agreeing) -> None:
    """The snapshots that roll qwen35moe's recurrent state back for MTP drafts serve n-gram drafts too (the agreeing
    copy falls into a loop the lookup drafts from): streamed equals --no-stream drafting the same."""
    path, flags = agreeing["qwen35moe"], ("--draft", "ngram", "--draft-max", 4, "--no-draft-gate")
    ref = run(path, "--no-stream", *flags, n=64)
    res = run(path, "--cache-mb", read_model_files(path).expert_bytes / 4 / MiB, "--force", *flags, n=64)
    assert res.ids == ref.ids and drafted(res) == drafted(ref) and sum(a for _, a in drafted(res)) > 0
