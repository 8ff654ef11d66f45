"""
What does a verify group cost against one token? The ceiling on drafting's speed-up (issue 52).

Drafting pays only where a decode of k rows (the chosen token and k-1 drafts) costs less than the k - or
fewer - one-token decodes it replaces. On a dense model a group of a few rows reads each weight once for
all of them; on a Mixture-of-Experts model each row routes its own experts, so the rows of a small group
share few of them and a layer's expert compute grows nearly with the rows. This script times plain
llama.cpp (through bmoe's seam, loaded as bmoe and its tests load it, the file resident in the page cache,
no streaming) decoding groups of 1..W rows after the same prompt, each group's KV removed again, sizes
interleaved; the speed-up drafting can reach at `t` tokens per verify step is then at most
t x cost(1) / cost(rows).

    python bench/verify_width.py --out DIR                  # the 64-expert demo, widths 1-5, -t 2
    python bench/verify_width.py -m MODEL.gguf --width 5 --rounds 5 --out DIR
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bmoe.demo.build import built_path
from bmoe.tools.bench_report import cell, write_summary

PROMPT = ("Copy this passage exactly, changing nothing but the word red to blue: the red fox ran over the "
          "hill and into the wood, where the old trees stood in rows and the light came down in pieces.")


def time_groups(model: Path, threads: int, width: int, repeats: int, rounds: int) -> dict[int, list[float]]:
    """Seconds of one llama_decode of each group size, `repeats` decodes per size per round, sizes interleaved.
    llama.cpp is loaded as bmoe loads it (bmoe.seam.llama: the file's own layout, no extra buffer types, whose
    AMX path dies on some Xeons; docs/architecture.md), with every row's logits asked for, as a verify step asks."""
    from bmoe.seam import llama as seam

    seam.init_backend()
    m = seam.load_model(model)
    if not m:
        raise SystemExit(f"verify_width: llama.cpp could not load {model}")
    ctx = seam.new_context(m, 1024, threads=threads)
    vocab = seam.Vocab(m)
    prompt = vocab.tokenize(PROMPT)
    group = vocab.tokenize(" the red fox ran over the hill and into", add_special=False)[:width]
    out: dict[int, list[float]] = {k: [] for k in range(1, width + 1)}
    try:
        assert seam.decode(ctx, [(0, prompt, 0)])[0] == 0
        for r in range(rounds):
            for k in range(1, width + 1):
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    rc, _ = seam.decode(ctx, [(0, group[:k], len(prompt))], every_logit=True)
                    out[k].append(time.perf_counter() - t0)
                    assert rc == 0 and seam.kv_cut(ctx, 0, len(prompt))  # the group's KV gone again
            print(f"verify_width: round {r + 1}/{rounds}: " + ", ".join(
                f"{k} rows {statistics.median(out[k]) * 1e3:.1f} ms" for k in out), file=sys.stderr)
    finally:
        seam.free_context(ctx)
        seam.free_model(m)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=None, help="default: the 64-expert demo (built when missing)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--width", type=int, default=5, help="the largest group, rows (default 5: --draft-max 4)")
    ap.add_argument("--repeats", type=int, default=20, help="decodes of each size per round (default 20)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.model is None:
        a.model = built_path(64, 8)
    a.out.mkdir(parents=True, exist_ok=True)
    times = time_groups(a.model, a.threads, a.width, a.repeats, a.rounds)
    one = statistics.median(times[1])
    rows = [{"rows": k, "median_ms": statistics.median(v) * 1e3, "per_row_ms": statistics.median(v) * 1e3 / k,
             "cost_vs_one": statistics.median(v) / one, "runs": len(v)} for k, v in times.items()]
    lines = [f"# A verify group's cost: {a.model.name}, -t {a.threads}, plain llama.cpp, {a.rounds} rounds x "
             f"{a.repeats} decodes", "",
             "| rows | ms a decode (median) | ms a row | cost ÷ one row | speed-up if every row is kept |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['rows']} | {cell(r['median_ms'])} | {cell(r['per_row_ms'])} | {cell(r['cost_vs_one'])} "
              f"| {cell(r['rows'] / r['cost_vs_one'])} |" for r in rows]
    if a.width >= 5:
        lines += ["", f"At the 3.8 tokens a verify step that n-gram drafts of 4 gave on the copy prompt "
                  f"(bench/reports/2026-12-06-drafts-gate), drafting's ceiling here is "
                  f"{3.8 / rows[4]['cost_vs_one']:.2f}x (before any of bmoe's own costs)."]
    write_summary(a.out, [{"rows": k, "seconds": v} for k, v in times.items()], lines, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
