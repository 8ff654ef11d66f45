"""Models by name (`-hf`): huggingface_hub's real client against a hub on the loopback interface
(tests/hub_server.py) holding small bmoe-synth models; nothing leaves the machine."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from bmoe.api.hub import HubRef, parse, pick
from bmoe.base import telemetry
from bmoe.base.errors import ConfigError
from tests.hub_server import LoopbackHub

REPO = "bmoe/synth-GGUF"
FETCH = """
import sys
from bmoe.edges import console
from bmoe.api import hub
from bmoe.base.errors import ConfigError
try:
    print(hub.fetch(hub.parse(sys.argv[1]), console.notice))
except ConfigError as e:
    console.error(str(e))
    sys.exit(1)
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from bmoe.tools.synth import write_model

    d = tmp_path_factory.mktemp("hubfiles")
    # past huggingface_hub's 10 MiB write chunk, so a connection cut halfway leaves something to resume from
    single = write_model(d / "synth-Q8_0.gguf", layers=2, experts=4, embd=256, size_gb=0.03)
    first = write_model(d / "split" / "synth-Q4_0.gguf", layers=2, experts=4, quant="q4_0", splits=3)
    shards = sorted(first.parent.glob("synth-Q4_0-*.gguf"))
    assert len(shards) == 3
    return {"README.md": d / "README.md", "synth-Q8_0.gguf": single, "mmproj-synth-f16.gguf": single,
            **{f"Q4_0/{p.name}": p for p in shards}}


@pytest.fixture
def hub(files: dict[str, Path]) -> LoopbackHub:
    files["README.md"].write_text("# synth\n")
    with LoopbackHub() as h:
        h.add(REPO, files)
        h.add("bmoe/private-GGUF", {"private-Q8_0.gguf": files["synth-Q8_0.gguf"]})
        h.tokens["bmoe/private-GGUF"] = "hf_secret"
        yield h


def fetch(hub: LoopbackHub, home: Path, ref: str, *, tty: bool = False, **env: str) -> subprocess.CompletedProcess:
    """Resolve `ref` in a process of its own (huggingface_hub reads its environment at import);
    `tty`: its stderr is a terminal (where progress bars are drawn)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    e.update({"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1", **env})
    cmd = [sys.executable, "-c", FETCH, ref]
    if not tty:
        return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=120)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 wide
    out: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the terminal closed
                return
            if not chunk:
                return
            out.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=slave, text=True, env=e, timeout=120)
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    return subprocess.CompletedProcess(cmd, r.returncode, r.stdout, b"".join(out).decode(errors="replace"))


def test_a_model_by_name_is_downloaded_into_the_hub_cache_with_progress(hub, files, tmp_path) -> None:
    r = fetch(hub, tmp_path, f"{REPO}:Q8_0", tty=True)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path == tmp_path / "hub" / "models--bmoe--synth-GGUF" / "snapshots" / hub.sha(REPO) / "synth-Q8_0.gguf"
    assert path.read_bytes() == files["synth-Q8_0.gguf"].read_bytes()
    assert "synth-Q8_0.gguf" in r.stderr and "100%" in r.stderr, "a progress bar on stderr"
    assert len(hub.gets("synth-Q8_0.gguf")) == 1 and not hub.gets("mmproj-synth-f16.gguf")


def test_a_dropped_connection_resumes_where_it_broke(hub, files, tmp_path) -> None:
    hub.drops["synth-Q8_0.gguf"] = 1
    r = fetch(hub, tmp_path, f"{REPO}:q8_0")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == files["synth-Q8_0.gguf"].read_bytes()
    first, again = hub.gets("synth-Q8_0.gguf")
    size = files["synth-Q8_0.gguf"].stat().st_size
    start = int(again.get("range", "bytes=0-")[6:-1])
    assert "range" not in first and 0 < start <= size // 2, "the second GET asks only for the rest"


def test_a_connection_that_keeps_dropping_fails_with_the_fix_and_caches_nothing(hub, tmp_path) -> None:
    hub.drops["synth-Q8_0.gguf"] = 99
    r = fetch(hub, tmp_path, f"{REPO}:Q8_0")
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("bmoe-cli: error: bmoe/synth-GGUF:Q8_0: the download failed")
    assert "run the command again" in err
    assert not list((tmp_path / "hub").rglob("synth-Q8_0.gguf"))


def test_a_later_run_uses_the_cache_with_no_network(hub, files, tmp_path) -> None:
    first = fetch(hub, tmp_path, f"{REPO}:Q8_0")
    assert first.returncode == 0, first.stderr
    n = len(hub.requests)
    offline = fetch(hub, tmp_path, f"{REPO}:Q8_0", HF_HUB_OFFLINE="1")
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == first.stdout and len(hub.requests) == n, "offline: no request at all"
    gone = fetch(hub, tmp_path, f"{REPO}:Q8_0", HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens there
    assert gone.returncode == 0, gone.stderr
    assert gone.stdout == first.stdout
    again = fetch(hub, tmp_path, f"{REPO}:Q8_0")
    assert again.stdout == first.stdout and len(hub.gets("synth-Q8_0.gguf")) == 1, "cached: not fetched again"


def test_offline_with_nothing_cached_says_so(hub, tmp_path) -> None:
    r = fetch(hub, tmp_path, f"{REPO}:Q8_0", HF_HUB_OFFLINE="1")
    assert r.returncode == 1 and not hub.requests
    assert r.stderr.strip() == ("bmoe-cli: error: bmoe/synth-GGUF:Q8_0 is not in the cache and HF_HUB_OFFLINE is set; "
                                "connect (or unset HF_HUB_OFFLINE) to download it")


def test_every_shard_of_a_split_model_comes_down(hub, files, tmp_path) -> None:
    r = fetch(hub, tmp_path, f"{REPO}:Q4_0")
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path.name == "synth-Q4_0-00001-of-00003.gguf"
    for i in (1, 2, 3):
        name = f"synth-Q4_0-0000{i}-of-00003.gguf"
        assert (path.parent / name).read_bytes() == files[f"Q4_0/{name}"].read_bytes()
    offline = fetch(hub, tmp_path, f"{REPO}:Q4_0", HF_HUB_OFFLINE="1")
    assert offline.stdout == r.stdout


def test_hf_token_opens_a_private_repository(hub, tmp_path) -> None:
    without = fetch(hub, tmp_path, "bmoe/private-GGUF")
    assert without.returncode == 1 and "no such model repository" in without.stderr and "HF_TOKEN" in without.stderr
    with_token = fetch(hub, tmp_path, "bmoe/private-GGUF", HF_TOKEN="hf_secret")
    assert with_token.returncode == 0, with_token.stderr
    assert hub.gets("private-Q8_0.gguf")[-1]["authorization"] == "Bearer hf_secret"


@pytest.mark.parametrize("ref, words", [
    ("bmoe/nope-GGUF", "bmoe/nope-GGUF: no such model repository on http://127.0.0.1:"),
    (f"{REPO}:Q2_K", "bmoe/synth-GGUF has no Q2_K model; it has: Q4_0/synth-Q4_0, synth-Q8_0 (name one of their "
                     "quants after the colon, -hf bmoe/synth-GGUF:QUANT)"),
    (f"{REPO}", "bmoe/synth-GGUF has several models and no Q4_K_M: Q4_0/synth-Q4_0, synth-Q8_0; choose one with "
                "-hf bmoe/synth-GGUF:QUANT"),
    ("not a name", "-hf 'not a name' is not a model name; give -hf ORG/REPO or ORG/REPO:QUANT"),
])
def test_a_bad_name_is_one_line_with_the_fix(hub, tmp_path, ref: str, words: str) -> None:
    r = fetch(hub, tmp_path, ref)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bmoe-cli: error: ") and words in lines[0], r.stderr


# ---- choosing the file (no network) -----------------------------------------------------------------

LISTING = ["README.md", "Qwen3-30B-A3B-Q4_K_M.gguf", "Qwen3-30B-A3B-Q4_K_S.gguf", "Qwen3-30B-A3B-Q8_0.gguf",
           "BF16/Qwen3-30B-A3B-BF16-00002-of-00002.gguf", "BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf",
           "mmproj-F16.gguf"]


@pytest.mark.parametrize("ref, want", [
    ("o/r", ["Qwen3-30B-A3B-Q4_K_M.gguf"]),
    ("o/r:q8_0", ["Qwen3-30B-A3B-Q8_0.gguf"]),
    ("o/r:Q4_K_S", ["Qwen3-30B-A3B-Q4_K_S.gguf"]),
    ("o/r:BF16", ["BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf", "BF16/Qwen3-30B-A3B-BF16-00002-of-00002.gguf"]),
])
def test_pick_finds_the_quant_as_a_whole_word(ref: str, want: list[str]) -> None:
    assert pick(LISTING, parse(ref)) == want


def test_pick_refuses_a_partial_quant_name_and_a_split_model_without_a_shard() -> None:
    with pytest.raises(ConfigError, match="has no Q4_K model"):
        pick(LISTING, HubRef("o/r", "Q4_K"))
    with pytest.raises(ConfigError, match=r"lacks BF16/Qwen3-30B-A3B-BF16-00002-of-00002.gguf"):
        pick([f for f in LISTING if not f.endswith("-00002-of-00002.gguf")], HubRef("o/r", "BF16"))
    assert pick(["only.gguf", "mmproj.gguf"], HubRef("o/r")) == ["only.gguf"]


# ---- -hf at every edge --------------------------------------------------------------------------------


def test_bmoe_cli_and_bmoe_load_run_a_model_by_name(hub, files, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path), HF_HUB_DISABLE_TELEMETRY="1")
    run = ["-p", "Once upon a time", "-n", "6", "-t", "2", "--io-threads", "2", "--cache-mb", "2", "--progress"]
    local = subprocess.run([sys.executable, "-m", "bmoe.cli", "-m", str(files["Q4_0/synth-Q4_0-00001-of-00003.gguf"]),
                            *run], capture_output=True, text=True, timeout=300)
    named = subprocess.run([sys.executable, "-m", "bmoe.cli", "-hf", f"{REPO}:Q4_0", *run], capture_output=True,
                           text=True, timeout=300, env=env)
    assert local.returncode == 0 and named.returncode == 0, named.stderr
    answer = telemetry.parse_output(local.stdout).answer
    assert answer and telemetry.parse_output(named.stdout).answer == answer, "by name it runs as the files do"
    code = ("import bmoe\nwith bmoe.load(hf='bmoe/synth-GGUF:Q4_0', cache_mb=2, threads=2) as m:\n"
            "    print(m.generate('Once upon a time', max_tokens=6), end='')")
    api = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**env, "HF_HUB_OFFLINE": "1"})
    assert api.returncode == 0, api.stderr
    assert api.stdout == answer
    both = subprocess.run([sys.executable, "-m", "bmoe.cli", "-m", "x.gguf", "-hf", REPO], capture_output=True,
                          text=True, timeout=60, env=env)
    assert both.returncode == 2 and "error: -m names a file and -hf a model on the hub; give one of them" in both.stderr
