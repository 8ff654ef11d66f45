"""How long does a request built to hurt hold bmoe-server, and does another client's stream notice?

Starts `bmoe-server` (the 16-expert demo model unless -m; `--cache-mb 400 -t 2 --io-threads 2
--parallel 2`, as issue 32 found the crash), starts one long streamed completion and, once its
tokens flow, sends each hostile request of tests/test_server.py's HOSTILE list (a JSON schema
with `maxItems` 100000, a 1 MB stop string, 100000 nested GBNF groups, ...) one after another, to
every route that takes its fields (chat or completions, /v1/responses, Ollama's /api/chat or
/api/generate: tests/test_server.py's hostile_requests).
It reports each one's status and seconds to its answer, the longest gap between two chunks of the
stream beside them (against its longest gap before they began), and whether the server answers
the next request.

    python bench/hostile_requests.py --out bench/reports/DATE-hostile-requests/report.md

Progress goes to stderr, the Markdown report to --out (and stdout).
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bmoe.demo import build as demo_build  # noqa: E402
from tests.test_server import hostile_requests  # noqa: E402 - the same requests the test sends

DEMO16 = demo_build.default_path()  # the 16-expert demo, where bmoe keeps it (honours $XDG_CACHE_HOME)


def note(msg: str) -> None:
    print(f"hostile_requests: {msg}", file=sys.stderr, flush=True)


def start(model: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "bmoe.server", "-m", str(model), "--port", "0", "--cache-mb", "400", "-t", "2",
           "--io-threads", "2", "--parallel", "2", "--queue", "8"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=REPO)
    err = proc.stderr
    assert err is not None
    for raw in err:
        m = re.match(r"bmoe: serving \S+ at (http://\S+)/v1 ", raw.decode(errors="replace"))
        if m:
            threading.Thread(target=err.read, daemon=True).start()  # drained, so the server never blocks on it
            return proc, m.group(1)
    raise SystemExit(f"bmoe-server did not start (exit {proc.wait()})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=DEMO16)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    proc, url = start(a.model)
    note(f"serving at {url}")
    arrivals: list[float] = []
    flowing, done = threading.Event(), threading.Event()

    def stream() -> None:
        with httpx.Client(timeout=600) as h, h.stream("POST", url + "/v1/completions", json={
                "prompt": "Once upon a time there was a king", "max_tokens": 1500, "stream": True}) as r:
            if r.status_code != 200:
                note(f"the stream was refused: {r.status_code} {r.read().decode()}")
                flowing.set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 20:
                        flowing.set()
                if done.is_set():
                    return

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    flowing.wait(600)
    if not arrivals:
        raise SystemExit("the stream beside the hostile requests never started")
    rows = []
    began = time.monotonic()
    with httpx.Client(timeout=600) as h:
        for path, body, param, _words in hostile_requests():
            t0 = time.monotonic()
            r = h.post(url + path, json=body)
            rows.append((path, param, r.status_code, time.monotonic() - t0))
            note(f"{path} {param}: {r.status_code} in {rows[-1][3]:.3f} s")
        ended = time.monotonic()
        n_after = len(arrivals)
        while len(arrivals) < n_after + 20 and t.is_alive():
            time.sleep(0.05)
        nxt = h.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}).status_code
    done.set()
    proc.terminate()
    proc.wait(60)

    def max_gap(lo: float, hi: float) -> float:
        times = [x for x in arrivals if lo <= x <= hi]
        return max((b - c for c, b in itertools.pairwise(times)), default=0.0)

    before = max_gap(arrivals[0], began)
    during = max_gap(began - 1, ended + 1)
    lines = [f"# Hostile requests against bmoe-server ({a.model.name})", "",
             "`python bench/hostile_requests.py" + (f" -m {a.model}" if a.model != DEMO16 else "") + "`", "",
             "| route | request (the field its 400 names) | status | seconds to the answer |", "|---|---|---:|---:|"]
    lines += [f"| `{r}` | `{p}` | {s} | {d:.3f} |" for r, p, s, d in rows]
    lines += ["", f"- the stream beside them: longest gap between chunks {during:.3f} s while they were sent "
              f"({ended - began:.2f} s), {before:.3f} s in its first {len([x for x in arrivals if x <= began])} "
              "chunks before", f"- the next request: HTTP {nxt}",
              f"- server exit code after SIGTERM: {proc.returncode}"]
    report = "\n".join(lines) + "\n"
    print(report)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
