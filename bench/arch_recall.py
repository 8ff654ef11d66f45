"""The spec-gate's next-layer recall on a small model of every architecture bmoe streams.

For each architecture: `bmoe-synth --arch A` (q8_0, LAYERS layers of EXPERTS experts, top-TOP_K), then
`bmoe-cli --spec-gate --spec-warmup 1 --spec-recall-min 0` on a prompt with a quarter of the experts
cached; the recall is bmoe-cli's `moe-spec-gate:` line (the share of predicted experts the next layer
routed), and an architecture whose routing the gate cannot follow shows bmoe-cli's refusal instead.
Greedy, so each number is one deterministic run; the streamed answer is also compared with
`--no-stream`'s. Writes DIR/report.md.

    python bench/arch_recall.py --out bench/reports/DATE-architectures/recall
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bmoe.base.model_files import read_model_files
from bmoe.base.units import MiB
from bmoe.tools.synth import write_model
from bmoe.tools.synth_archs import STREAMED_ARCHES

PROMPT = ("In the valley below the mountains, a small village kept an old tradition: every spring the "
          "farmers walked to the river and sang")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bmoe.cli", *args], capture_output=True, text=True, timeout=600)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="report directory")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("-n", type=int, default=64, help="tokens per run")
    ap.add_argument("--arch", action="append", help="only these (default: every streamed architecture)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in a.arch or STREAMED_ARCHES:
            layers = a.layers + (a.layers % 2 if arch == "llama4" else 0)
            path = write_model(Path(tmp) / f"{arch}.gguf", arch=arch, layers=layers, experts=a.experts,
                               top_k=a.top_k)
            quarter = f"{read_model_files(path).expert_bytes / 4 / MiB:.3f}"
            common = ["-m", str(path), "-p", PROMPT, "-n", str(a.n), "-t", "2"]
            t0 = time.monotonic()
            r = cli(*common, "--cache-mb", quarter, "--force", "--io-threads", "2", "--spec-gate",
                    "--spec-warmup", "1", "--spec-recall-min", "0")
            plain = cli(*common, "--no-stream")
            recall = next((line.split(":", 1)[1].strip() for line in r.stdout.splitlines()
                           if line.startswith("moe-spec-gate:")), "")
            err = next((line.removeprefix("bmoe-cli: error: ") for line in r.stderr.splitlines()
                        if line.startswith("bmoe-cli: error:")), "")
            same = r.returncode == 0 and r.stdout.split("\n", 1)[0] == plain.stdout.split("\n", 1)[0]
            rows.append((arch, recall or f"refused: {err}", "yes" if same else ("—" if err else "NO")))
            print(f"{arch}: {rows[-1][1]} ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    lines = ["# Spec-gate recall per architecture", "", "## Command", "", "```",
             "python bench/arch_recall.py " + " ".join(argv if argv is not None else sys.argv[1:]), "```", "",
             f"bmoe-synth --arch A (q8_0, {a.layers} layers, {a.experts} experts, top-{a.top_k}; llama4 MoE on "
             f"every 2nd layer), {a.n} greedy tokens, a quarter of the experts cached, 2 lanes.", "",
             "| arch | spec-gate (bmoe-cli's moe-spec-gate line) | first answer line = --no-stream's |",
             "|---|---|---|", *[f"| `{arch}` | {recall} | {same} |" for arch, recall, same in rows], ""]
    (out / "report.md").write_text("\n".join(lines))
    print(out / "report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
