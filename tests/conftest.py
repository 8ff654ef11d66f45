from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import psutil
import pytest

from bmoe.api import Ask, Chunk, Completion, Model
from bmoe.base.settings import FLAGS, Settings
from bmoe.edges import flags
from bmoe.shm_cache import SHM_DIR, SHM_PREFIX, segment_owner

if TYPE_CHECKING:
    from bmoe.coordinator import Engine

REPO = Path(__file__).resolve().parent.parent
_pycache: list[str] = []  # the subprocesses' bytecode folder, while the session runs (pytest_configure)


def pytest_configure(config: pytest.Config) -> None:
    """The suite starts a few thousand Python processes (I/O lanes, spec-gates, bmoe-cli, bmoe-server,
    bench scripts). Where PYTHONDONTWRITEBYTECODE is set, each of them would compile every module it
    imports from source again (a lane 0.08 s of CPU, bmoe-cli 0.25 s, bmoe-server 0.15 s): they share
    one bytecode cache in a temporary folder instead (PYTHONPYCACHEPREFIX, removed at the end), so the
    checkout still gets no __pycache__. Where bytecode is written anyway nothing changes."""
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        import tempfile

        _pycache.append(tempfile.mkdtemp(prefix="bmoe-test-pycache-"))
        os.environ["PYTHONPYCACHEPREFIX"] = _pycache[-1]
        del os.environ["PYTHONDONTWRITEBYTECODE"]


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    while _pycache:
        shutil.rmtree(_pycache.pop(), ignore_errors=True)


def wide(values: list, by_default: set) -> list:
    """A secondary matrix's parameters (its settings beyond the first architecture or format): those in
    `by_default` run in the default suite, the rest only with `-m wide`, the full matrix. The lossless
    gates themselves (every architecture, every budget) are never marked: what this trims is the same
    check repeated where nothing in it depends on the architecture."""
    return [v if v in by_default else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.wide)
            for v in values]


def bmoe_segments() -> set[str]:
    """Segments this test session could own: its own, or this user's of processes that have ended.

    A segment of another live process (another bmoe run on the machine) or of another user is not
    ours to judge.
    """
    if not SHM_DIR.is_dir():
        return set()
    out = set()
    for p in SHM_DIR.glob(f"{SHM_PREFIX}*"):
        owner = segment_owner(p.name)
        if owner is None:
            out.add(p.name)
        elif owner[0] in (os.geteuid(), None) and (owner[1] == os.getpid() or not psutil.pid_exists(owner[1])
                                                   or _is_descendant(owner[1])):
            out.add(p.name)
    return out


def still_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `procs` (workers of a coordinator that has exited) that are still there.

    No waiting: a coordinator stops and reaps its workers before it exits, on every path, so once
    its exit has been waited for none may be left, not even as a zombie (one it did not reap)."""
    return [p for p in procs if p.is_running()]


def _is_descendant(pid: int) -> bool:
    try:
        return any(a.pid == os.getpid() for a in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def synth(model_dir: Path) -> Callable[..., Path]:
    """Write (once per session) a synthetic model for these parameters."""
    from bmoe.tools.synth import write_model

    made: dict[tuple, Path] = {}

    def make(**kw: object) -> Path:
        key = tuple(sorted(kw.items()))
        if key not in made:
            name = "-".join(f"{k}{v}" for k, v in key) or "default"
            made[key] = write_model(model_dir / f"{name}.gguf", **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis server of the session's own, on a free loopback port (Debian's `redis-server`, the `redis` client);
    the tests that use it skip, saying why, where either is missing."""
    client = pytest.importorskip("redis", reason="the redis client is not installed: pip install 'bmoe[redis]'")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path_factory.mktemp("redis"))], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}"
    try:
        while True:
            try:
                client.Redis.from_url(url).ping()
                break
            except client.ConnectionError:
                assert proc.poll() is None, "redis-server did not start"
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(autouse=True)
def own_usage_profiles(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no usage profile (bmoe.streaming.usage_profile) and keeps the ones it writes to
    itself: a warm start from another test's run would change what a gate reads, and when."""
    monkeypatch.setenv("BMOE_USAGE_DIR", str(tmp_path_factory.mktemp("usage-profiles")))


@pytest.fixture(autouse=True)
def no_leaked_segments() -> None:
    """Every test must leave /dev/shm as it found it."""
    before = bmoe_segments()
    yield
    leaked = bmoe_segments() - before
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"


def settings_for(model: object, *cli_flags: object) -> Settings:
    """The Settings `bmoe-cli -m MODEL FLAGS...` would run with: tests take the user's path to them."""
    ap = flags.build_parser()
    return flags.settings_from(ap, ap.parse_args(["-m", str(model), *map(str, cli_flags)]))


def engine_for(model: object, *cli_flags: object, notice: Callable[[str], None] = lambda s: None) -> Engine:
    """The Engine `bmoe-cli -m MODEL FLAGS...` loads (bmoe.engine.load, as bmoe.api.open_model does)."""
    from bmoe.coordinator import Engine
    from bmoe.engine.load import load_engine

    return Engine(load_engine(settings_for(model, *cli_flags), notice, FLAGS))


def load(model: object, *cli_flags: object, notice: Callable[[str], None] = lambda s: None) -> Model:
    """The Model `bmoe-cli -m MODEL FLAGS...` runs: its Engine, driven by the one generation loop."""
    from bmoe.api import Model

    return Model(engine_for(model, *cli_flags, notice=notice))


def complete(model: Model, prompt: str, n: int, chat: bool = False,
             on_chunk: Callable[[Chunk], None] | None = None) -> Completion:
    """One answer of `n` tokens at most, through Model.run and bmoe.generation.driver: the path users run."""
    req = (model.prepare(Ask(messages=[{"role": "user", "content": prompt}], max_tokens=n)) if chat
           else model.prepare(Ask(prompt=prompt, max_tokens=n)))
    return model.run(req, on_chunk)


def per_token(act: Callable[[int], None]) -> Callable[[Chunk], None]:
    """An on_chunk that calls act(i) as the i-th generated token's chunk arrives (from 0)."""
    def on_chunk(c: Chunk) -> None:
        if c.token is not None:
            act(c.token.step - 1)
    return on_chunk


def generate(model: object, prompt: str, n: int, *cli_flags: object, chat: bool = False) -> Completion:
    """Load with these flags, answer once, close."""
    with load(model, *cli_flags) as m:
        return complete(m, prompt, n, chat)


@cache
def reference(model: str, prompt: str, n: int, *cli_flags: object, chat: bool = False) -> Completion:
    """Plain llama.cpp's answer (`--no-stream`), once per test session: what every gate compares with."""
    return generate(model, prompt, n, "--no-stream", *cli_flags, chat=chat)


@pytest.fixture(scope="session")
def small_moe(synth: Callable[..., Path]) -> Path:
    """The small MoE most tests stream: qwen3moe, 4 layers of 8 experts, top-2, q8_0."""
    return synth(arch="qwen3moe", layers=4, experts=8, top_k=2)


def slice_bytes(streamer: object, ri: int, e: int) -> memoryview:
    """Expert e's bytes of region ri in the slot its expert holds (writable)."""
    r = streamer.cache.regions[ri]
    at = streamer.slab.base + streamer.cache.slice_offset(ri, e)
    return memoryview((ctypes.c_char * r.expert_bytes).from_address(at)).cast("B")


def run_cli(*args: str, timeout: float = 240, **kw: object) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "bmoe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO, **kw)


_memcmp = ctypes.CDLL(None).memcmp
_memcmp.argtypes, _memcmp.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int


class SlabCheck:
    """Checks, each time llama.cpp is about to multiply with expert bytes, that what it will read
    holds exactly the file's bytes for every expert the layer routed to (and the expert's bias and
    scale rows, where the model has them, at the slot's row of their pools).

    It wraps the hook's entry points of a streaming Engine (the remap of the routed ids to slot
    indices, the down-input node) and reads each expert at `data + slot * nb[2]` of its tensor as
    llama.cpp holds it, so it sees what the matmuls will see. Output comparison alone can miss a
    wrong byte that happens not to flip a greedy token; this cannot.
    """

    def __init__(self, engine: object) -> None:
        self.st = engine.streamer
        self.hook = engine.hook
        self.checked = 0
        self.blind = 0  # routings of a blind layer (bmoe.streaming.graph_stops), each position checked to read zeros
        self.bad: list[str] = []
        self._slots: dict[int, dict[int, int]] = {}  # layer -> expert -> slot ggml reads
        # the files mapped read-only: each check is one memcmp of slab against file, no copies
        # (a pread and a string_at per routed expert were a third of a demo-model gate's time)
        self._maps = []
        for path in self.st.files.paths:
            with open(path, "rb") as f:
                self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        self._file_at = [np.frombuffer(m, dtype=np.uint8).ctypes.data for m in self._maps]
        stops = self.hook.stops
        slot_ids, wait, pending = stops.slot_ids, stops.on_wait, stops.wait_pending
        overlap = self.st.overlap
        up_split = getattr(stops, "up_split", set())
        stops.skip_route = lambda layer: False

        def at_routing(layer: int) -> Callable[[str], bool]:
            """What the routing node's matmul may read at once: all (serial), else the gate slices (and the
            up ones where they are not awaited after the gate matmul)."""
            later = {"ffn_down_exps"} | ({"ffn_up_exps"} if layer in up_split else set())
            return lambda kind: not overlap or kind not in later

        def remap(layer, ids):
            slots = slot_ids(layer, ids)
            if layer in stops.blind:  # an MTP block decoded for its KV alone: each position must read the spare
                self._slots[layer] = {-1 - i: int(s) for i, s in enumerate(slots.reshape(-1))}
                self.blind += 1
            else:
                self._slots[layer] = {int(e): int(s) for e, s in zip(ids.reshape(-1), slots.reshape(-1))}
            self._check(layer, at_routing(layer), "routing node")
            return slots

        stops.slot_ids = remap
        if pending is not None:
            def kind_of(key: int) -> str:
                return "ffn_up_exps" if key % 2 == 0 else "ffn_down_exps"

            def on_wait(key):
                wait(key)
                self._check(key // 2, lambda kind: kind == kind_of(key), f"{kind_of(key)} wait")

            def wait_pending(key):
                if pending(key):
                    return True
                self._check(key // 2, lambda kind: kind == kind_of(key), f"{kind_of(key)} wait (no stop)")
                return False

            stops.on_wait, stops.wait_pending = on_wait, wait_pending

    def _check(self, layer: int, kinds: Callable[[str], bool], where: str) -> None:
        """Each expert's slot holds its file bytes; a position lossy routing dropped (expert -1,
        bmoe.streaming.lossy.DROPPED) or of a blind layer reads the pool's spare slot, which must hold only zeros."""
        from bmoe.seam import ggml_mirror

        c = self.st.cache
        for b, rows, pool in self.st.biases.get(layer, ()):  # expert biases and scales follow the slots
            if not kinds(b.kind.removesuffix(".scale")):
                continue
            for e, slot in self._slots.get(layer, {}).items():
                self.checked += 1
                want = rows[e] if e >= 0 else np.zeros_like(rows[0])
                if not np.array_equal(pool[slot], want):
                    self.bad.append(f"{b.name} expert {e} at the {where}: slot {slot}'s row is not the file's")
        for ri in c.by_layer[layer]:
            r = c.regions[ri]
            if not kinds(r.kind):
                continue
            t = ggml_mirror.tensor_at(self.st.tensors[r.name].addr)
            for e, slot in self._slots.get(layer, {}).items():
                if e < 0:
                    self.checked += 1
                    if slot != 0 or ctypes.string_at(t.data + slot * t.nb[2], r.expert_bytes).strip(b"\0"):
                        self.bad.append(f"{r.name}: a dropped or blind position reads slot {slot}, not the spare's "
                                        "zeros")
                    continue
                want = self._file_at[r.file_index] + r.file_offset + e * r.expert_bytes
                self.checked += 1
                if not 0 <= slot < t.ne[2]:
                    self.bad.append(f"{r.name} expert {e} at the {where}: slot {slot} outside 0..{t.ne[2] - 1}")
                elif _memcmp(t.data + slot * t.nb[2], want, r.expert_bytes) != 0:
                    self.bad.append(f"{r.name} expert {e} at the {where}: slot {slot} differs from the file "
                                    f"(state {c.state[ri][e]})")

    def close(self) -> None:
        self._file_at.clear()
        for m in self._maps:
            m.close()


@pytest.fixture(scope="session")
def demo_default() -> tuple[Path, float]:
    """The model and cache budget a no-argument `bmoe-cli`, `bmoe.load()` or `bmoe-server` runs:
    the 16-expert demo, found where the product keeps it (bmoe.base.user_cache, which honours
    $XDG_CACHE_HOME) and built there with the real builder when missing, once per run, so a test
    that needs it never skips for want of it."""
    from bmoe.demo import build as demo

    return demo.default_model(progress=lambda msg: print(f"demo: {msg}", file=sys.stderr, flush=True))


@pytest.fixture(scope="session")
def demo16(demo_default: tuple[Path, float]) -> Path:
    """The 16-expert demo model's file (built once per run when missing)."""
    return demo_default[0]


@pytest.fixture(scope="session")
def demo8() -> Path:
    """The 8-expert, top-2 demo model's file, found or built as `demo_default` is."""
    from bmoe.demo import build as demo

    return demo.build_demo(8, 2, progress=lambda msg: print(f"demo: {msg}", file=sys.stderr, flush=True))
