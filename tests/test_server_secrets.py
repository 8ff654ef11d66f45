"""What a real bmoe-server keeps to itself: the key given with `--api-key-file` is used and is not in
the process list (`/proc/PID/cmdline`, which any local user reads), a bad key file is a usage error,
and a 500 does not tell the client the model's path (the server's stderr does, under the error id)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO
from tests.test_server import FLAGS, KEY, PROMPT, Server, auth, error_of

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def without_key() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "BMOE_API_KEY"}


def stderr_once_ended(s: Server) -> str:
    """The server's whole stderr, once it exited (its reader thread may still be reading)."""
    assert s.proc.wait(60) == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "bmoe-server: error:" not in s.stderr:
        time.sleep(0.05)
    return s.stderr


def test_the_key_file_guards_the_routes_and_stays_out_of_the_process_list(small_moe, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}  \nnot the key\n")
    s = Server("-m", str(small_moe), *FLAGS, "--api-key-file", str(key_file), env=without_key())
    try:
        cmdline = Path(f"/proc/{s.proc.pid}/cmdline").read_bytes()
        assert str(key_file).encode() in cmdline and KEY.encode() not in cmdline
        assert error_of(httpx.post(s.url + "/v1/chat/completions", json=CHAT, timeout=120), 401)["code"] == \
            "invalid_api_key"
        error_of(httpx.post(s.url + "/v1/chat/completions", json=CHAT, headers=auth("not the key"), timeout=120), 401)
        assert httpx.post(s.url + "/v1/chat/completions", json=CHAT, headers=auth(), timeout=120).status_code == 200
        assert httpx.get(s.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize("content, says", [
    (None, "cannot read it (No such file or directory)"),
    ("", "its first line is empty"),
    ("   \nsecond line\n", "its first line is empty"),
    (b"\xff\xfe\x00", "cannot read it"),
    ("dir", "cannot read it (Is a directory)"),
])
def test_a_bad_key_file_is_a_usage_error(tmp_path: Path, content: str | bytes | None, says: str) -> None:
    path = tmp_path / "key"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    r = subprocess.run([sys.executable, "-m", "bmoe.server", "--api-key-file", str(path)], capture_output=True,
                       text=True, cwd=REPO, timeout=60, env=without_key())
    assert r.returncode == 2 and f"--api-key-file {path}: {says}" in r.stderr and "Traceback" not in r.stderr, \
        r.stderr


def test_the_key_and_the_key_file_together_are_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "key").write_text(KEY)
    r = subprocess.run([sys.executable, "-m", "bmoe.server", "--api-key", KEY, "--api-key-file",
                        str(tmp_path / "key")], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and "either --api-key or --api-key-file, not both" in r.stderr, r.stderr


def test_a_500_names_no_path_and_the_servers_stderr_has_it(small_moe, tmp_path: Path) -> None:
    """A model file changed under the server fails the next request (500) and ends the server: the
    client hears that the generation failed and an error id; the file's path is on stderr, under that id."""
    copy = tmp_path / "secret-dir" / "model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(small_moe, copy)
    s = Server("-m", str(copy), *FLAGS, env=without_key())
    try:
        st = copy.stat()
        os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "changed since it was loaded"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=120)
        err = error_of(r, 500)
        assert err["code"] == "internal_error" and "generation failed" in err["message"], err
        for secret in (str(tmp_path), "secret-dir", "model.gguf", "/"):
            assert secret not in r.text, r.text
        ref = re.search(r"error ([0-9a-f]{8})", err["message"])
        assert ref, err
        stderr = stderr_once_ended(s)
        logged = [line for line in stderr.splitlines() if f"error {ref.group(1)}" in line]
        assert logged and str(copy) in logged[0] and "changed since it was loaded" in logged[0], stderr
    finally:
        s.stop()


def test_a_500_in_a_stream_names_no_path(small_moe, tmp_path: Path) -> None:
    """The same failure met by a streamed request: its error event names no path either."""
    copy = tmp_path / "secret-dir" / "model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(small_moe, copy)
    s = Server("-m", str(copy), *FLAGS, env=without_key())
    try:
        copy.write_bytes(copy.read_bytes() + b"\0")  # a size change: "changed since it was loaded"
        with httpx.stream("POST", s.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=120) as r:
            text = r.read().decode()
        events = [json.loads(x[6:]) for x in text.splitlines() if x.startswith('data: {"error"')]
        if r.status_code == 200:  # the stream began before the failure: an error event
            assert events and events[-1]["error"]["code"] == "internal_error", text
        else:
            error_of(r, 500)
        assert str(tmp_path) not in text and "secret-dir" not in text and "model.gguf" not in text, text
        assert str(copy) in stderr_once_ended(s)
    finally:
        s.stop()
