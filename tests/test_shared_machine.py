"""bmoe on a machine it shares with other users: their segments in /dev/shm (left there by a run
that died, or planted to stop ours), a `bmoe/` folder where the user starts a run, and a prompt-cache
folder they could write. A start leaves what is not its own alone, still sweeps its own user's
leftovers, runs only the installed bmoe, and loads no prompt-cache entry another user could have made."""

from __future__ import annotations

import ast
import functools
import os
import re
import stat
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import posix_ipc
import pytest

from bmoe import shm_cache, workers
from bmoe.base.model_files import read_model_files
from bmoe.base.private_files import private_folder
from bmoe.base.units import MiB
from bmoe.chat.grammar import Grammar
from bmoe.chat.grammar_check import GrammarCheck
from bmoe.shm_cache import PAGE, SHM_DIR, Slab, segment_name, sweep_stale_segments
from tests.conftest import complete, load, reference, run_cli

FLAGS = ("-c", 256, "-t", 2)
PROMPT = "Once upon a time, in a village by the sea,"
N_PREDICT = 8
OTHER = 1  # daemon; read as a pid (as bmoe named segments before the uid), alive: no other run sweeps ours


def dead_pid() -> int:
    """The pid of a process that has exited (a run killed with SIGKILL, as its segment's name sees it)."""
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


@pytest.fixture
def planted() -> Iterator[list[Path]]:
    """Segments that look like dead runs' and are not this user's to remove; unlinked afterwards."""
    made: list[Path] = []
    yield made
    for p in made:
        p.unlink(missing_ok=True)


def plant(made: list[Path], name: str, owner: int) -> Path:
    seg = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=PAGE)
    os.fchown(seg.fd, owner, owner)
    seg.close_fd()
    made.append(SHM_DIR / name)
    return made[-1]


def third_of_experts(path: Path) -> float:
    return read_model_files(str(path)).expert_bytes / 3 / MiB


def test_another_users_stale_segments_are_left_alone_and_the_start_works(small_moe, planted) -> None:
    """Another user's segment of a dead run, and one planted under this user's own name: a streaming
    start (as root, who could unlink them) removes neither and answers as plain llama.cpp."""
    theirs = plant(planted, f"bmoe-{OTHER}-{dead_pid()}-0badf00d", OTHER)
    under_our_name = plant(planted, segment_name(dead_pid()), OTHER)
    with load(small_moe, *FLAGS, "--cache-mb", third_of_experts(small_moe), "--io-threads", 2) as m:
        res = complete(m, PROMPT, N_PREDICT)
    assert res.ids == reference(str(small_moe), PROMPT, N_PREDICT, *FLAGS).ids
    for p in (theirs, under_our_name):
        assert p.exists() and p.stat().st_uid == OTHER, p


def test_own_stale_segment_of_a_dead_run_is_swept_by_the_next_start(small_moe) -> None:
    """What a SIGKILLed run of this user left is removed by this user's next start, as before."""
    stale = posix_ipc.SharedMemory("/" + segment_name(dead_pid()), posix_ipc.O_CREX, size=PAGE)
    stale.close_fd()
    notices: list[str] = []
    with load(small_moe, *FLAGS, "--cache-mb", third_of_experts(small_moe), notice=notices.append):
        assert not (SHM_DIR / stale.name.lstrip("/")).exists()
    # (1, or more when other runs on this machine left theirs)
    assert any(re.fullmatch(r"removed \d+ shared-memory segment\(s\) left by dead runs", n) for n in notices), notices


def as_other_user(work: Callable[[], object]) -> object:
    """`work()`'s result in a forked child that has become user OTHER (no exec: this interpreter may
    sit where OTHER cannot run it); its exception is re-raised here as an AssertionError."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            out = repr(work())
            code = 0
        except BaseException:  # noqa: BLE001 - everything goes to the parent
            out = traceback.format_exc()
        finally:
            os.write(write_end, out.encode())
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        out = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    return ast.literal_eval(out)


def other_users_start() -> tuple[list[str], str]:
    """The shared-memory part of a streaming start (bmoe.engine.load): sweep, then make the slab."""
    removed = sweep_stale_segments()
    slab = Slab(PAGE)
    try:
        return removed, slab.name
    finally:
        slab.close()


def test_a_start_as_another_user_passes_over_segments_it_cannot_remove(planted) -> None:
    """The issue's case, as an ordinary user meets it: root-owned segments named like dead runs (the
    old naming, this user's own name, root's) stand in /dev/shm, where this user may not unlink them;
    this user's start sweeps and makes its slab all the same, and leaves them."""
    if os.geteuid() != 0:
        pytest.skip("making a segment another user cannot remove, and becoming that user, needs root")
    plant(planted, f"bmoe-{dead_pid()}-0badf00d", 0)  # the name an older bmoe gave (another run may sweep it)
    theirs = plant(planted, f"bmoe-{OTHER}-{dead_pid()}-0badf00d", 0)
    roots = plant(planted, f"bmoe-0-{dead_pid()}-0badf00d", 0)
    removed, name = as_other_user(other_users_start)
    assert removed == [] and name.startswith(f"/bmoe-{OTHER}-"), (removed, name)
    for p in (theirs, roots):
        assert p.exists() and p.stat().st_uid == 0, p


def test_a_taken_name_is_passed_over_for_a_fresh_one(planted, monkeypatch) -> None:
    """A name another user already holds (the same uid, pid and random part) is not opened and does not
    fail the start: the slab takes a fresh name, the other segment stays as it was."""
    taken = plant(planted, f"bmoe-{os.geteuid()}-{os.getpid()}-0badf00d", OTHER)
    hexes = iter(["0badf00d", "0badf00d", "5afe5afe"])
    monkeypatch.setattr(shm_cache.secrets, "token_hex", lambda n: next(hexes))
    slab = Slab(PAGE)
    try:
        assert slab.name == f"/bmoe-{os.geteuid()}-{os.getpid()}-5afe5afe"
    finally:
        slab.close()
    assert taken.exists() and taken.stat().st_uid == OTHER


HOSTILE_PACKAGE = {
    "__init__.py": "import pathlib\npathlib.Path({marker!r}).write_text(__name__)\n",
    "workers/__init__.py": "",
    "workers/io_lane.py": "raise SystemExit(3)\n",
    "workers/spec_gate.py": "raise SystemExit(3)\n",
    "workers/grammar_worker.py": "raise SystemExit(3)\n",
}


@pytest.mark.parametrize("safe_path", [True, False], ids=["python -P", "python 3.10 form"])
def test_workers_never_run_a_bmoe_folder_where_the_user_stands(small_moe, tmp_path, monkeypatch,
                                                               safe_path: bool) -> None:
    """A start from a folder holding a `bmoe/` package (one that records being imported): the I/O lanes,
    the spec-gate and the grammar checker are the installed bmoe's, the answer plain llama.cpp's.
    Both forms of the worker command: `-P` (3.11+) and the runpy one Python 3.10 gets."""
    marker = tmp_path / "the folder's bmoe ran"
    cwd = tmp_path / "cwd"
    for name, text in HOSTILE_PACKAGE.items():
        (cwd / "bmoe" / name).parent.mkdir(parents=True, exist_ok=True)
        (cwd / "bmoe" / name).write_text(text.format(marker=str(marker)))
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(workers, "command", functools.partial(workers.command, safe_path=safe_path))
    with load(small_moe, *FLAGS, "--cache-mb", third_of_experts(small_moe), "--io-threads", 2, "--overlap",
              "--spec-gate", "--spec-recall-min", 0) as m:
        gate = m.engine.streamer.ahead.gate
        assert gate is not None and gate.active, "the spec-gate started and said hello"
        res = complete(m, PROMPT, N_PREDICT)
    checker = GrammarCheck(str(small_moe))
    try:
        checker.check(Grammar('root ::= "a"'))
    finally:
        checker.close()
    assert not marker.exists(), marker.read_text()
    assert res.ids == reference(str(small_moe), PROMPT, N_PREDICT, *FLAGS).ids


# ---- a prompt cache's folder (bmoe.base.private_files): its entries go to llama.cpp's state loader ----


def open_folder(parent: Path, mode: int) -> Path:
    """A folder of `mode` under `parent` (chmod, past the umask)."""
    d = parent / f"mode-{mode:o}"
    d.mkdir()
    os.chmod(d, mode)
    return d


def test_a_prompt_cache_folder_others_can_write_is_refused_before_the_model_loads(small_moe, tmp_path) -> None:
    """A folder anyone can write (0777, no sticky bit): any local user could put an entry there whose own
    hash matches. bmoe.load refuses it in one line naming the folder and the fix, before llama.cpp loads
    anything, and reads nothing in it."""
    import bmoe

    folder = open_folder(tmp_path, 0o777)
    planted = folder / ("ab" * 20 + ".kv")
    planted.write_bytes(b"a state for llama.cpp to load")
    with pytest.raises(bmoe.ConfigError) as e:
        bmoe.load(str(small_moe), prompt_cache=str(folder), threads=2)
    assert str(e.value) == (f"prompt_cache={str(folder)!r}: {folder} can be written by other users (mode 777), so "
                            f"another user could swap the files bmoe loads from it; run `chmod go-w {folder}` or "
                            "choose a folder of your own")
    assert planted.read_bytes() == b"a state for llama.cpp to load"


def test_bmoe_cli_names_the_folder_above_that_others_can_write(small_moe, tmp_path) -> None:
    """Whoever can write a folder on the path can rename the cache folder away and put theirs in its
    place: a group-writable parent is named, in the flag's words, exit 1, one line."""
    folder = open_folder(tmp_path, 0o775) / "cache"
    r = run_cli("-m", str(small_moe), "--prompt-cache", str(folder), "-p", PROMPT, "-n", "1", "-t", "2")
    assert r.returncode == 1, r.stderr
    assert r.stderr == (f"bmoe-cli: error: --prompt-cache {folder}: {folder.parent} can be written by other users "
                        f"(mode 775), so another user could swap the files bmoe loads from it; run `chmod go-w "
                        f"{folder.parent}` or choose a folder of your own\n")


def test_a_prompt_cache_folder_another_user_owns_is_refused(small_moe, tmp_path) -> None:
    """A folder of another uid, even one only that user can write: it could swap the entries at will."""
    import bmoe

    if os.geteuid() != 0:
        pytest.skip("giving a folder to another uid needs root")
    folder = open_folder(tmp_path, 0o700)
    os.chown(folder, OTHER, OTHER)
    with pytest.raises(bmoe.ConfigError, match=rf": {folder} is owned by uid {OTHER}, not by you \(uid 0\) or root, "
                       "so another user could swap the files bmoe loads from it; chown it or choose a folder of "
                       "your own$"):
        bmoe.load(str(small_moe), prompt_cache=str(folder), threads=2)


def test_a_missing_prompt_cache_folder_is_made_for_its_user_alone_and_a_sticky_one_taken(tmp_path) -> None:
    """What bmoe makes (the folder and any missing above it) is 0700 whatever the umask, so it never
    refuses its own work; a sticky folder others can write (like /tmp) is taken, since they can add files
    there but not replace ours, and the entries they add are theirs (refused one by one)."""
    deep = tmp_path / "a" / "b" / "cache"
    old = os.umask(0o002)
    try:
        assert private_folder(deep) is None
    finally:
        os.umask(old)
    assert [stat.S_IMODE(d.stat().st_mode) for d in (deep, deep.parent, deep.parent.parent)] == [0o700] * 3
    sticky = open_folder(tmp_path, 0o1777)
    assert private_folder(sticky) is None and private_folder(sticky / "mine") is None


def test_a_prompt_cache_that_names_a_file_is_refused(small_moe, tmp_path) -> None:
    import bmoe

    f = tmp_path / "cache"
    f.write_text("a file")
    with pytest.raises(bmoe.ConfigError, match=rf"^prompt_cache='{f}': {f} is not a folder; name a folder \(bmoe "
                       r"makes it when it is missing\)$"):
        bmoe.load(str(small_moe), prompt_cache=str(f), threads=2)
