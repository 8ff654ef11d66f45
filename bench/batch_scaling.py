"""What one llama.cpp batch of k sequences buys on this CPU, with nothing read from flash: plain
llama.cpp (`--no-stream`) and bmoe with every expert cached (`--preload`), through Model.batch.

Aggregate decode tok/s for k = 1, 2, 4, 8 different prompts decoded together (prefill left out:
the batch's decode wall time is its longest request's), plain and bmoe loaded in turn each round.
It answers whether batching can pay when decode is compute-bound: on a model whose experts
dominate the per-token work, k sequences route to nearly k times the experts, so a batch step
costs nearly k single steps.

    python bench/batch_scaling.py -m demo64.gguf --rounds 3 > scaling.md
"""

from __future__ import annotations

import argparse
import statistics
import sys

from serve_concurrency import PROMPTS  # the same eight prompts as the server bench (bench/ is on the path)

import bmoe


def rate(m: bmoe.Model, k: int, n: int) -> tuple[float, list[str]]:
    done = m.batch([m.prepare(bmoe.Ask(p, max_tokens=n)) for p in PROMPTS[:k]])
    tokens = sum(d.stats.completion_tokens for d in done)
    wall = max(d.stats.completion_tokens / d.stats.tok_s for d in done if d.stats.tok_s > 0)
    return tokens / wall, [d.text for d in done]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    sizes = [int(k) for k in a.sizes.split(",")]
    runs = {"plain llama.cpp (--no-stream)": dict(stream=False),
            "bmoe, every expert cached (--preload)": dict(preload=True, io_threads=4)}
    got: dict[str, dict[int, list[float]]] = {name: {k: [] for k in sizes} for name in runs}
    texts: dict[str, dict[int, list[str]]] = {name: {} for name in runs}
    alone: dict[str, list[str]] = {}
    for r in range(a.rounds):
        for name, kw in runs.items():  # one model loaded at a time: two in one process share the cores
            with bmoe.load(a.model, parallel=max(sizes), threads=a.threads, n_ctx=512, **kw) as m:
                if name not in alone:
                    alone[name] = [m.generate(p, max_tokens=a.tokens) for p in PROMPTS[:max(sizes)]]
                else:  # warm-up: a load's first generation pays for first touches of its pages
                    m.generate(PROMPTS[0], max_tokens=8)
                for k in sizes:
                    tok_s, out = rate(m, k, a.tokens)
                    got[name][k].append(tok_s)
                    texts[name][k] = out
                    print(f"batch_scaling: round {r + 1}, {name}, k={k}: {tok_s:.2f} tok/s",
                          file=sys.stderr, flush=True)
    print(f"Aggregate decode tok/s, median of {a.rounds} rounds ({a.tokens} tokens per sequence, -t {a.threads}); "
          "in brackets: × one sequence.\n")
    print("| run | " + " | ".join(f"k={k}" for k in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for name in runs:
        one = statistics.median(got[name][sizes[0]])
        cells = [f"{statistics.median(got[name][k]):.2f} ({statistics.median(got[name][k]) / one:.2f}×)"
                 for k in sizes]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    plain, streamed = runs
    same = all(texts[plain][k] == texts[streamed][k] for k in sizes)
    print(f"bmoe's batches equal plain llama.cpp's batches of the same composition: {same}")
    for name in runs:
        differ = [sum(t != want for t, want in zip(texts[name][k], alone[name])) for k in sizes]
        print(f"{name}: answers that differ from the same prompt served alone: "
              + ", ".join(f"{d} of {k} at k={k}" for d, k in zip(differ, sizes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
