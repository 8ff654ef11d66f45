"""The prompt cache's store (bmoe.generation.prompt_cache) and llama.cpp's per-sequence state API under it:
a prefix's KV saved, checked and put back gives the same logits as prefilling it, and nothing
read from disk is trusted."""

from __future__ import annotations

import os
import struct
import time
import tracemalloc
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from bmoe.engine.prompt_calls import FA_TILE
from bmoe.generation.prompt_cache import KV_MAGIC, PromptCache, cut, model_identity, pieces, usable
from bmoe.seam.llama import seq_state, set_seq_state
from tests.plain_llama import Plain

ID = b"\x01" * 32
N_CTX = 4096
OTHER = 12345  # a uid no one on the machine has: "another user" (root can chown to it)
# the architectures whose memory holds more than attention KV a suffix can be cut from (docs/architectures.md)
RECURRENT = ["qwen35moe", "qwen3next", "qwen4exp", "deepseek4", "lfm2moe", "bailingmoe3"]


def store(folder: Path, mb: float = 10.0, identity: bytes = ID) -> tuple[PromptCache, list[str]]:
    notes: list[str] = []
    return PromptCache(folder, mb, identity, N_CTX, notes.append), notes


def test_an_entry_comes_back_for_a_prompt_that_begins_with_it(tmp_path: Path) -> None:
    c, _ = store(tmp_path)
    c.save([1, 2, 3], b"three")
    c.save([1, 2, 3, 4, 5], b"five")
    c.save([1, 9], b"other")
    again, notes = store(tmp_path)  # a restart finds them
    e = again.match([1, 2, 3, 4, 5, 6])
    assert e.tokens == (1, 2, 3, 4, 5) and again.load(e) == b"five" and not notes
    assert again.match([1, 2, 3, 4, 5]).tokens == (1, 2, 3), "one token at least is left to decode"
    assert again.match([1, 2, 3, 4, 5, 6], shorter_than=5).tokens == (1, 2, 3)
    assert again.match([2, 1]) is None


def test_the_folder_stays_within_its_bound_least_recently_used_first(tmp_path: Path) -> None:
    mib = 2**20
    c, _ = store(tmp_path, mb=2.5)
    a = c.save([1], b"a" * mib)
    c.save([2], b"b" * mib)
    time.sleep(0.01)
    assert c.load(a) is not None  # [1] is now the more recently used
    c.save([3], b"c" * mib)
    left = sorted(e.tokens for e in c.entries.values())
    assert left == [(1,), (3,)], "the least recently used entry went"
    assert sum(p.stat().st_size for p in tmp_path.glob("*.kv")) <= 2.5 * mib
    assert c.save([4], b"d" * 3 * mib) is None, "an entry over the bound is not kept"


def test_a_truncated_or_corrupt_file_is_ignored_with_a_notice_and_removed(tmp_path: Path) -> None:
    c, _ = store(tmp_path)
    cut = c.save([1, 2], b"x" * 1000)
    flip = c.save([1, 2, 3], b"y" * 1000)
    with open(cut.path, "r+b") as f:
        f.truncate(cut.size - 10)
    again, notes = store(tmp_path)
    assert notes == [f"prompt cache: {cut.path.name} is cut short or padded ({cut.size - 10} bytes, the header says "
                     f"{cut.size}); ignored and removed"]
    assert not cut.path.exists()
    raw = bytearray(flip.path.read_bytes())
    raw[-1] ^= 0xFF
    flip.path.write_bytes(bytes(raw))
    e = again.match([1, 2, 3, 4])
    assert e.tokens == (1, 2, 3) and again.load(e) is None
    assert notes[-1] == f"prompt cache: {flip.path.name} is corrupt (its checksum does not match); ignored and removed"
    assert not flip.path.exists() and again.match([1, 2, 3, 4]) is None


def entry_file(folder: Path, n_tokens: int, payload_bytes: int, identity: bytes = ID, size: int | None = None,
               name: str = "ab" * 20 + ".kv") -> Path:
    """A file named as an entry whose header declares `n_tokens` and `payload_bytes`, `size` bytes long
    (sparse; default: the header alone)."""
    p = folder / name
    head = struct.pack("<8s32sIQ32s", KV_MAGIC, identity, n_tokens, payload_bytes, b"\0" * 32)
    with open(p, "wb") as f:
        f.write(head)
        f.truncate(size or len(head))
    return p


def peak_bytes(work) -> int:
    """The most memory Python held at once while `work()` ran (tracemalloc sees every bytes object)."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_header_declaring_huge_sizes_is_removed_before_anything_is_read_by_them(tmp_path: Path) -> None:
    """A header saying 2^32 - 1 tokens (16 GiB of them) and a 1 TiB payload in an 84-byte file: the start
    takes the sizes apart against the file's before reading by them (it used to read 16 GiB first:
    a MemoryError where memory is short, 16 GiB of address space where it is not)."""
    huge = entry_file(tmp_path, 2**32 - 1, 2**40)
    notes: list[str] = []
    peak = peak_bytes(lambda: notes.extend(store(tmp_path)[1]))
    assert peak < 2**20, f"{peak / 2**30:.1f} GiB allocated for an 84-byte file"
    assert notes == [f"prompt cache: {huge.name} is cut short or padded (84 bytes, the header says "
                     f"{84 + 4 * (2**32 - 1) + 2**40}); ignored and removed"]
    assert not huge.exists()


def test_an_entry_of_more_tokens_than_the_context_is_not_read(tmp_path: Path) -> None:
    """A whole entry (sizes that add up: a 16 MiB sparse file) of 4M tokens, past any prompt this
    context can hold: not read, not used, and left for a run with a longer context."""
    n = 1 << 22
    long = entry_file(tmp_path, n, 0, size=84 + 4 * n)
    made: list[tuple[PromptCache, list[str]]] = []
    peak = peak_bytes(lambda: made.append(store(tmp_path)))
    (c, notes), = made
    assert peak < 2**20 and c.entries == {} and not notes and long.exists()


def test_a_users_own_files_in_the_folder_are_never_removed(tmp_path: Path) -> None:
    """Only bmoe's own entries are removed, as damaged or to keep the bound: a user's `notes.kv`, and a
    file of theirs that happens to have an entry's name but not its magic, stay (the oldest and
    largest in the folder, first in line for the bound as it used to count)."""
    mib = 2**20
    notes_kv = tmp_path / "notes.kv"
    notes_kv.write_bytes(b"my notes" * mib)
    look_alike = tmp_path / ("0" * 40 + ".kv")
    look_alike.write_bytes(b"not bmoe's")
    for p in (notes_kv, look_alike):
        os.utime(p, (0, 0))
    c, notes = store(tmp_path, mb=2.5)
    assert notes == [f"prompt cache: {look_alike.name} is not a bmoe prompt-cache file (no magic); ignored and "
                     "left alone"]
    c.save([1], b"a" * mib)
    c.save([2], b"b" * mib)
    c.save([3], b"c" * mib)
    assert notes_kv.read_bytes() == b"my notes" * mib and look_alike.read_bytes() == b"not bmoe's"
    assert sorted(e.tokens for e in c.entries.values()) == [(2,), (3,)], "the bound counts bmoe's entries"


def test_an_entry_others_can_write_is_neither_loaded_nor_removed(tmp_path: Path) -> None:
    """An entry another user could have written passes its own hash check whatever it holds, so it never
    reaches llama.cpp: ignored with a notice at the start, or at its load when it became writable after
    the start, and left where it is."""
    c, _ = store(tmp_path)
    writable = c.save([1, 2], b"two")
    later = c.save([3, 4], b"four")
    os.chmod(writable.path, 0o666)
    again, notes = store(tmp_path)
    assert notes == [f"prompt cache: {writable.path.name} can be written by other users (mode 666); ignored and "
                     "left alone"]
    assert again.match([1, 2, 3]) is None and writable.path.exists()
    e = again.match([3, 4, 5])
    os.chmod(later.path, 0o620)  # group-writable counts: nothing says who is in the group
    assert again.load(e) is None and later.path.exists() and again.match([3, 4, 5]) is None
    assert notes[-1] == f"prompt cache: {later.path.name} can be written by other users (mode 620); ignored and " \
                        "left alone"


def test_an_entry_owned_by_another_user_is_neither_loaded_nor_removed(tmp_path: Path) -> None:
    """The same for an entry another uid owns (it may rewrite it at will), even one only it can write."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    c, _ = store(tmp_path)
    theirs = c.save([1, 2], b"two")
    mine = c.save([5, 6], b"six")
    os.chown(theirs.path, OTHER, OTHER)
    again, notes = store(tmp_path)
    assert notes == [f"prompt cache: {theirs.path.name} is owned by uid {OTHER}, not by you (uid 0) or root; "
                     "ignored and left alone"]
    assert again.match([1, 2, 3]) is None and theirs.path.exists()
    assert again.load(again.match([5, 6, 7])) == b"six" and mine.path.exists()


def test_another_models_entries_are_left_alone(tmp_path: Path) -> None:
    mine, _ = store(tmp_path)
    mine.save([1, 2], b"mine")
    other, notes = store(tmp_path, identity=b"\x02" * 32)
    assert other.match([1, 2, 3]) is None and not notes
    assert len(list(tmp_path.glob("*.kv"))) == 1


def test_a_file_swapped_under_its_name_is_not_trusted(tmp_path: Path) -> None:
    c, notes = store(tmp_path)
    e = c.save([1, 2], b"two")
    other = c.save([7, 8], b"eight")
    os.replace(other.path, e.path)  # the right name, another prompt's KV
    assert c.load(e) is None and "changed on disk" in notes[-1]


# ---- with llama.cpp ---------------------------------------------------------------------------------


def decode(p: Plain, seq: int, toks: list[int], pos: int) -> np.ndarray:
    batch = llama_cpp.llama_batch_init(len(toks), 0, 1)
    for j, t in enumerate(toks):
        batch.token[j], batch.pos[j], batch.n_seq_id[j] = t, pos + j, 1
        batch.seq_id[j][0] = seq
        batch.logits[j] = j == len(toks) - 1
    batch.n_tokens = len(toks)
    try:
        assert llama_cpp.llama_decode(p.ctx, batch) == 0
    finally:
        llama_cpp.llama_batch_free(batch)
    n_vocab = llama_cpp.llama_vocab_n_tokens(p.vocab.ptr)
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(p.ctx, -1), shape=(n_vocab,)).copy()


@pytest.mark.parametrize("arch", ["qwen3moe", *RECURRENT])
def test_a_saved_prefix_put_back_gives_the_logits_of_prefilling_it(synth, tmp_path: Path, arch: str) -> None:
    """llama.cpp's sequence state holds what a prefix left behind, recurrent and compressed states included:
    put back after a restart, into a sequence that held something else, it continues as the prefill did."""
    path = synth(arch=arch, layers=2 if arch == "qwen3moe" else 4, experts=4, top_k=2)
    p = Plain(path, n_ctx=256)
    try:
        toks = p.vocab.tokenize("The keeper climbed the stairs of the old lighthouse every evening " * 3)
        mem = llama_cpp.llama_get_memory(p.ctx)
        k = len(toks) - 5
        decode(p, 0, toks[:k], 0)
        cache, _notes = store(tmp_path, identity=model_identity([Path(path)]))
        cache.save(toks[:k], seq_state(p.ctx, 0))
        want = decode(p, 0, toks[k:], k)
        llama_cpp.llama_memory_clear(mem, True)
        decode(p, 0, [5, 6, 7], 0)  # something else in the sequence first
        again, _ = store(tmp_path, identity=model_identity([Path(path)]))  # a restart
        e = again.match(toks)
        assert e is not None and len(e.tokens) == k
        assert set_seq_state(p.ctx, 0, again.load(e))
        assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == k - 1
        assert np.array_equal(decode(p, 0, toks[k:], k), want)
    finally:
        p.close()


def test_llama_cpp_refuses_another_models_state(synth) -> None:
    small = Plain(synth(arch="qwen3moe", layers=2, experts=4, top_k=2), n_ctx=128)
    other = Plain(synth(arch="qwen3moe", layers=3, experts=4, top_k=2), n_ctx=128)
    try:
        decode(small, 0, [5, 6, 7, 8], 0)
        state = seq_state(small.ctx, 0)
        assert not set_seq_state(other.ctx, 0, state)
        assert llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(other.ctx), 0) == -1
        assert not set_seq_state(small.ctx, 0, state[:len(state) // 2]), "a cut state is refused too"
    finally:
        small.close()
        other.close()


def test_the_identity_follows_the_bytes_not_the_name(synth, tmp_path: Path) -> None:
    a = Path(synth(arch="qwen3moe", layers=2, experts=4, top_k=2))
    b = Path(synth(arch="qwen3moe", layers=2, experts=4, top_k=2, seed=1))
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(a.read_bytes())
    assert model_identity([a]) == model_identity([copy]) != model_identity([b])
    assert model_identity([a], "n_seq=1") != model_identity([a], "n_seq=2")


# ---- where a prompt may be cut ----------------------------------------------------------------------


@pytest.mark.parametrize("p, n, ok", [
    (1536, 2050, True), (1536, 1537, True),  # a multiple of n_ubatch: the rest has the one call's ubatches
    (1936, 2030, True), (1936, 2050, True),  # [1536, 2048) cut into 400 + 112
    (1990, 2100, False),  # 454 + 58: the second part takes another kernel
    (1550, 2030, False),  # 14 + 498
    (1936, 1990, False),  # a rest of 54
    (0, 10, False), (10, 10, False),
])
def test_usable_cuts(p: int, n: int, ok: bool) -> None:
    assert usable(p, n, 512) is ok


def test_pieces_rejoin_the_one_calls_ubatches() -> None:
    assert pieces(1936, 2100, 512) == [(1936, 2048), (2048, 2100)]
    assert pieces(1936, 2000, 512) == [(1936, 2000)]
    assert pieces(1536, 2100, 512) == [(1536, 2100)]


def test_the_save_point_leaves_room_for_any_later_question() -> None:
    p = cut(2030, 2000, 512)
    assert p == 2000 - FA_TILE and usable(p, 2030, 512)
    assert all(usable(p, n, 512) for n in range(2001, 4000)), "any prompt that shares the 2000 tokens can use it"
    assert cut(2200, 2100, 512) == 2048 - FA_TILE, "a cut leaves 64 tokens on both sides of its ubatch too"
    assert cut(100, 90, 512) == 0, "no cut leaves 64 tokens on both sides"


@pytest.fixture(scope="module")
def pinned(synth) -> Plain:
    p = Plain(synth(arch="qwen3moe", layers=2, experts=4, top_k=2), n_ctx=1024, n_ubatch=256)
    yield p
    p.close()


@pytest.mark.parametrize("p", [512, 100, 420, 300, 500, 580])
def test_llama_cpp_computes_a_usable_cut_exactly_and_another_not(pinned: Plain, p: int) -> None:
    """Pins the kernel regimes `usable` relies on (see bmoe.generation.prompt_cache): decoded as [0, p) and its
    pieces, a cut it accepts gives the logits of one call exactly; one it refuses does not."""
    toks = pinned.spell(" ".join(f"word{i % 97} the keeper of the light" for i in range(200)))[:600]
    mem = llama_cpp.llama_get_memory(pinned.ctx)
    llama_cpp.llama_memory_clear(mem, True)
    one = decode(pinned, 0, toks, 0)
    llama_cpp.llama_memory_clear(mem, True)
    decode(pinned, 0, toks[:p], 0)
    for a, b in pieces(p, len(toks), 256):
        two = decode(pinned, 0, toks[a:b], a)
    assert np.array_equal(one, two) is usable(p, len(toks), 256)


# ---- at work: bmoe.load(prompt_cache=...), bmoe-server --prompt-cache ---------------------------------

SYSTEM = " ".join(f"Rule {i}: answer the keeper of the light in plain words and name the stairs." for i in range(25))
RUN = dict(n_ctx=2048, threads=2, io_threads=2, cache_mb=4, warm_start=False)  # no warm-start notice or fill


def ask(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def cached_model(synth) -> str:
    return str(synth(arch="qwen3moe", layers=4, experts=8, top_k=2))


@pytest.fixture(scope="module")
def plain_answers(cached_model: str) -> dict[str, str]:
    import bmoe

    with bmoe.load(cached_model, **RUN) as m:
        return {q: m.chat(ask(q), max_tokens=12) for q in ("Where are the stairs?", "Who keeps the light?")}


def test_a_kept_prefix_survives_a_restart_and_answers_stay_the_same(cached_model, plain_answers, tmp_path) -> None:
    import bmoe

    notes: list[str] = []
    with bmoe.load(cached_model, prompt_cache=str(tmp_path), notice=notes.append, **RUN) as m:
        first = m.chat(ask("Where are the stairs?"), max_tokens=12)
        s = m.stats.last
        assert s.prefill_tokens == s.prompt_tokens > 600, "the first run prefills it all (and keeps its prefix)"
    assert first == plain_answers["Where are the stairs?"]
    files = list(tmp_path.glob("*.kv"))
    assert len(files) == 1 and not notes
    with bmoe.load(cached_model, prompt_cache=str(tmp_path), notice=notes.append, **RUN) as m:  # a restart
        for q, want in plain_answers.items():
            assert m.chat(ask(q), max_tokens=12) == want, q
            s = m.stats.last
            assert s.prefill_tokens < 200 < s.prompt_tokens, "the system prompt came from the cache"
    assert not notes


def test_a_truncated_cache_file_is_ignored_with_a_notice(cached_model, plain_answers, tmp_path) -> None:
    import bmoe

    with bmoe.load(cached_model, prompt_cache=str(tmp_path), **RUN) as m:
        m.chat(ask("Where are the stairs?"), max_tokens=12)
    (f,) = tmp_path.glob("*.kv")
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    notes: list[str] = []
    with bmoe.load(cached_model, prompt_cache=str(tmp_path), notice=notes.append, **RUN) as m:
        assert m.chat(ask("Where are the stairs?"), max_tokens=12) == plain_answers["Where are the stairs?"]
        assert m.stats.last.prefill_tokens == m.stats.last.prompt_tokens, "nothing was trusted"
    assert any(n.startswith(f"prompt cache: {f.name} is cut short") and n.endswith("ignored and removed")
               for n in notes), notes
    assert len(list(tmp_path.glob("*.kv"))) == 1, "kept again, whole"


def test_the_cache_stays_within_its_bound(cached_model, tmp_path) -> None:
    import bmoe

    notes: list[str] = []
    with bmoe.load(cached_model, prompt_cache=str(tmp_path), notice=notes.append, **RUN) as m:
        m.chat(ask("Where are the stairs?"), max_tokens=4)
        one = sum(p.stat().st_size for p in tmp_path.glob("*.kv"))
    bound = one * 1.5 / 2**20
    with bmoe.load(cached_model, prompt_cache=str(tmp_path), prompt_cache_mb=bound, notice=notes.append, **RUN) as m:
        for i in range(3):  # three other system prompts: each kept, the oldest dropped
            m.chat([{"role": "system", "content": f"Variant {i}. " + SYSTEM}, {"role": "user", "content": "Hi"}],
                   max_tokens=2)
            assert sum(p.stat().st_size for p in tmp_path.glob("*.kv")) <= bound * 2**20
    assert len(list(tmp_path.glob("*.kv"))) == 1
    with bmoe.load(cached_model, prompt_cache=str(tmp_path), prompt_cache_mb=one / 2 / 2**20, notice=notes.append,
                   **RUN) as m:
        m.chat(ask("Where are the stairs?"), max_tokens=2)
    assert "over --prompt-cache-mb" in notes[-1] and "not kept" in notes[-1]


def test_the_session_and_the_server_keep_prefixes_across_restarts(cached_model, plain_answers, tmp_path) -> None:
    from bmoe.edges.session_client import SessionClient
    from tests.test_server import KEY, Server

    flags = ["-m", cached_model, "-c", "2048", "-t", "2", "--io-threads", "2", "--cache-mb", "4",
             "--prompt-cache", str(tmp_path / "session")]
    prompt = SYSTEM + " Where are the stairs?"
    done = []
    for _ in range(2):  # the same first turn, before and after a restart
        with SessionClient(flags) as s:
            _, last = s.ask(1, prompt, n_predict=8)
            done.append(last[1])
    assert done[0]["text"] == done[1]["text"] and done[1]["n_prompt"] < 200 < done[0]["n_prompt"]

    served = []
    for _ in range(2):
        srv = Server("-m", cached_model, "-c", "2048", "-t", "2", "--io-threads", "2", "--cache-mb", "4",
                     "--prompt-cache", str(tmp_path / "server"), env={"BMOE_API_KEY": KEY})
        try:
            r = srv.client().chat.completions.create(model="x", messages=ask("Where are the stairs?"), max_tokens=12)
            served.append((r.choices[0].message.content, r.model_extra["bmoe"]["prefill_tokens"]))
        finally:
            srv.stop()
    assert served[0][0] == served[1][0] == plain_answers["Where are the stairs?"]
    assert served[1][1] < 200 < served[0][1]


def test_a_server_that_slept_finds_its_prefixes_as_after_a_restart(cached_model, plain_answers, tmp_path) -> None:
    """--sleep-idle-seconds: the wake loads the prompt cache's folder again, as a restart does."""
    from tests.test_server import KEY, Server
    from tests.test_server_sleep import wait_asleep

    srv = Server("-m", cached_model, "-c", "2048", "-t", "2", "--io-threads", "2", "--cache-mb", "4",
                 "--prompt-cache", str(tmp_path), "--sleep-idle-seconds", "1", env={"BMOE_API_KEY": KEY})
    try:
        served = []
        for _ in range(2):  # the same first turn, before and after a sleep
            r = srv.client().chat.completions.create(model="x", messages=ask("Where are the stairs?"), max_tokens=12)
            served.append((r.choices[0].message.content, r.model_extra["bmoe"]["prefill_tokens"]))
            wait_asleep(srv)
    finally:
        srv.stop()
    assert served[0][0] == served[1][0] == plain_answers["Where are the stairs?"]
    assert served[1][1] < 200 < served[0][1]
