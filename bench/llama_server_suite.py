#!/usr/bin/env python3
"""llama.cpp's own server test suite, run unchanged against bmoe-server: a yardstick of how far a client
written for llama-server gets with bmoe.

The suite ships in the pinned llama-cpp-python sdist (vendor/llama.cpp/tools/server/tests). It starts
`$LLAMA_SERVER_BIN_PATH` with llama-server's flags; this script points that at itself
(`--as-llama-server`), which turns them into bmoe-server's and runs it on a local MoE model instead of
the hub models the suite names (no hub is reached). The suite runs in a venv of its own with its
requirements.txt, its slow tests left out as its own tests.sh does, one test at a time (its ports are
per worker). Each test's outcome is compared with bench/llama_server_suite.expected, the list of tests
that cannot pass against bmoe and why; what differs is printed, and the exit code is 1 when a test not
on the list fails or one on it passes (so the list is kept current).

  python bench/llama_server_suite.py                      # the whole non-slow suite, the demo model
  python bench/llama_server_suite.py -k test_tokenize     # some of it
  python bench/llama_server_suite.py -m model.gguf --out /tmp/suite
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXPECTED = Path(__file__).with_suffix(".expected")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bmoe" / "llama-server-tests"
SUITE = "vendor/llama.cpp/tools/server/tests"

# llama-server flag -> bmoe-server flag (values passed on); flags with no bmoe meaning are dropped (and
# named on stderr): the tests that need them fail, and are on the expected list
SAME = {"--port": "--port", "--host": "--host", "--temp": "--temp", "--seed": "--seed", "--alias": "--alias",
        "--threads": "-t", "--n-predict": "-n", "--api-key": "--api-key", "--cors-origins": "--allowed-origin",
        "--chat-template-file": "--chat-template-file", "--parallel": "--parallel", "--pooling": "--pooling",
        "--tags": "--tags", "--sleep-idle-seconds": "--sleep-idle-seconds", "--reasoning": "--reasoning",
        "--chat-template": "--chat-template"}
SAME_SWITCH = {"--no-ui": "--no-webui", "--no-webui": "--no-webui", "--no-slots": "--no-slots", "--jinja": "--jinja"}
BMOE_DEFAULT = {"--slots", "--metrics", "--offline", "--cont-batching", "--no-jinja"}  # what bmoe-server does anyway
# the pooling of the suite's embedding model (bert-bge-small's GGUF: bert.pooling_type 2, cls), which the
# stand-in's GGUF does not declare: given when the suite starts --embedding without --pooling
SUITE_POOLING = "cls"
DROPPED_WITH_VALUE = {"--model-url", "--model-draft", "--hf-file", "--models-dir", "--models-max",
                      "--models-preset", "--batch-size", "--ubatch-size", "--n-gpu-layers",
                      "-ctk", "-ctv", "-fa", "--slot-save-path", "--grp-attn-n", "--grp-attn-w", "--lora",
                      "--spec-type", "--spec-draft-n-max", "--spec-draft-n-min", "--spec-synth-len",
                      "--spec-synth-rates", "--reasoning-format", "--mmproj-url",
                      "--media-path", "--cache-ram", "--log-file", "--tools",
                      "--tools-runtime", "--mcp-servers-config", "--mcp-servers-json", "--draft-max",
                      "--draft-min", "--reasoning-budget", "--ctx-checkpoints", "--keep"}


def as_llama_server(argv: list[str], model: str) -> list[str]:
    """bmoe-server's command line for llama-server's `argv` (--ctx-size is llama-server's total over its
    --parallel slots; bmoe's -c is each sequence's; /metrics is off unless llama-server is given --metrics)."""
    out = [sys.executable, "-m", "bmoe.server", "-m", model, "--no-warm-start"]
    ctx, parallel, dropped, i = None, 1, [], 0
    while i < len(argv):
        flag = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if flag == "--n-predict" and int(value) < 0:  # llama-server's "until the context is full": bmoe's default
            i += 2
        elif flag in SAME_SWITCH:
            out.append(SAME_SWITCH[flag])
            i += 1
        elif flag in SAME:
            out += [SAME[flag], value]
            parallel = int(value) if flag == "--parallel" else parallel
            i += 2
        elif flag in ("--ctx-size", "-c"):
            ctx, i = int(value), i + 2
        elif flag in ("--model", "-m", "--hf-repo", "-hf"):
            i += 2  # the local model stands in for every model the suite names
        elif flag in DROPPED_WITH_VALUE:
            dropped.append(f"{flag} {value}")
            i += 2
        elif flag in ("--embedding", "--embeddings"):
            out.append("--embedding")
            i += 1
        else:
            if flag not in BMOE_DEFAULT:
                dropped.append(flag)
            i += 1
    if "--embedding" in out and "--pooling" not in out:
        out += ["--pooling", SUITE_POOLING]
    if ctx:
        out += ["-c", str(max(64, ctx // parallel))]
    if "--metrics" not in argv:
        out.append("--no-metrics")
    if dropped:
        print(f"llama_server_suite: no bmoe-server meaning, dropped: {' '.join(dropped)}", file=sys.stderr)
    return out


def _sdist() -> Path:
    """The pinned llama-cpp-python sdist's llama.cpp, its server tests and the chat templates they read
    (../../../models/templates from the tests), unpacked once into the cache; the tests' folder."""
    from importlib.metadata import version
    v = version("llama_cpp_python")
    dest = CACHE / f"llama_cpp_python-{v}"
    if not (dest / SUITE / "unit").is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        tgz = CACHE / f"llama_cpp_python-{v}.tar.gz"
        if not tgz.exists():
            print(f"llama_server_suite: fetching the llama-cpp-python {v} sdist from the package index",
                  file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", f"llama-cpp-python=={v}", "--no-deps",
                            "--no-binary", ":all:", "-d", str(CACHE)], check=True)
        root = f"llama_cpp_python-{v}/"
        wanted = (root + SUITE + "/", root + "vendor/llama.cpp/models/templates/")
        with tarfile.open(tgz) as t:
            members = [m for m in t.getmembers() if m.name.startswith(wanted)]
            for m in members:
                m.name = m.name[len(root):]
            t.extractall(dest, members=members, filter="data")
    return dest / SUITE


def _venv(suite: Path) -> Path:
    """A venv with the suite's own requirements (made once)."""
    py = CACHE / "venv" / "bin" / "python"
    if not py.exists():
        print("llama_server_suite: making the suite's venv (its requirements.txt)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(CACHE / "venv")], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(suite / "requirements.txt")], check=True)
    return py


def expected() -> dict[str, str]:
    """The tests that cannot pass against bmoe-server: a test id (taken as it is: a parametrized one's
    brackets are not a pattern), or a pattern of ids (fnmatch: a whole file of a feature bmoe does not
    have), -> why."""
    out = {}
    for line in EXPECTED.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            test, _, why = line.partition("  # ")
            out[test.strip()] = why.strip()
    return out


def outcomes(junit: Path) -> dict[str, bool]:
    """test id (unit/file.py::name[param]) -> passed."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        mod = case.get("classname", "").replace(".", "/")
        out[f"{mod}.py::{case.get('name')}"] = case.find("failure") is None and case.find("error") is None
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--as-llama-server":
        cmd = as_llama_server(sys.argv[2:], os.environ["BMOE_SUITE_MODEL"])
        os.execv(cmd[0], cmd)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="the MoE GGUF standing in for the suite's models (default: the "
                                          "16-expert demo, built when missing)")
    ap.add_argument("-k", default="", help="pytest's -k over the suite's tests")
    ap.add_argument("--out", type=Path, default=None, help="folder for the run (default: a fresh one in the cache)")
    a = ap.parse_args()
    model = a.model
    if model is None:
        from bmoe.demo import build
        model = str(build.default_model(progress=lambda msg: print(f"demo: {msg}", file=sys.stderr))[0])
    suite = _sdist()
    py = _venv(suite)
    run = a.out or CACHE / "run"
    shutil.rmtree(run, ignore_errors=True)
    work = run / SUITE
    shutil.copytree(suite, work)
    shutil.copytree(suite.parents[2] / "models" / "templates", run / "vendor/llama.cpp/models/templates")
    wrapper = work / "llama-server"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} --as-llama-server \"$@\"\n")
    wrapper.chmod(0o755)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(wrapper), "BMOE_SUITE_MODEL": model,
           "PYTHONPATH": str(REPO)}
    junit = run / "junit.xml"
    cmd = [str(py), "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "-o", "addopts=", "unit"] + (["-k", a.k] if a.k else [])
    print(f"llama_server_suite: {' '.join(cmd)} (in {work})", file=sys.stderr)
    subprocess.run(cmd, cwd=work, env=env)
    got, want = outcomes(junit), expected()
    listed = {t for t in got if t in want or any(fnmatch.fnmatchcase(t, w) for w in want)}  # an id's [...] is no class
    fail_new = sorted(t for t, ok in got.items() if not ok and t not in listed)
    # a test named on the list that passes is taken off it; under a whole feature's pattern, a test that
    # wants an error passes by the route's 404 and says nothing
    pass_listed = sorted(t for t, ok in got.items() if ok and t in want)
    passed = sum(got.values())
    print(f"\n{passed} of {len(got)} passed; {len(listed)} on the expected list "
          f"({len(listed) / max(1, len(got)):.0%} of the suite), {len(fail_new)} failed off it")
    for t in fail_new:
        print(f"FAILED, not on the list: {t}")
    for t in pass_listed:
        print(f"PASSED, but on the list (take it off): {t}")
    return 1 if fail_new or pass_listed else 0


if __name__ == "__main__":
    sys.exit(main())
