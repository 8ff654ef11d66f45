"""
What does stopping the graph at every MoE layer's routing cost plain llama.cpp? Issue 49's compute tax.

bmoe learns a layer's routing through llama.cpp's eval callback: asked about the layer's
`ffn_moe_weights-L` node, it says yes, and ggml's scheduler then computes the graph up to that node as
one piece, hands it over, and plans and computes the rest as further pieces
(ggml_backend_sched_compute_splits). Every streaming decode pays that, whatever bmoe does at the stop:
one piece more per MoE layer (and one per wait node that stops). This measures it alone, with nothing
streamed: plain llama.cpp, the file read into the page cache, one process, three contexts on the one
model, decoding the same prompt in turn, rounds interleaved:

- `plain`: no eval callback (one piece a token);
- `routing-c`: the compiled filter (bmoe/seam/_eval_filter.c) stops at every `ffn_moe_weights-L` and answers
  it in C from an identity table (every expert resident at its own index: ids unchanged, nothing
  narrowed): one piece more per MoE layer, no Python in the decode;
- `routing-python`: the same stops answered by a Python callback that does nothing (two ctypes calls into
  Python per MoE layer, each taking the GIL): what a stop costs when Python answers it, beyond the piece.

The decode time per token of each, and its ratio to `plain` in the same round, is what the pieces (and
Python's calls) cost. Each routing arm checks that it stopped at every MoE layer of every token.

    python bench/graph_stops_cost.py -m /work/models/qwen3-30b-a3b-like-q4_k_m.gguf --rounds 5 --out DIR
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bmoe.base.model_files import read_model_files  # noqa: E402
from bmoe.seam import eval_filter, llama  # noqa: E402
from bmoe.seam.eval_filter import FastTables  # noqa: E402
from bmoe.tools.bench_machine import machine_info  # noqa: E402
from bmoe.tools.bench_sys import read_into_page_cache  # noqa: E402

PROMPT = [1, 450, 2030, 3300, 16378, 7015, 1152, 520, 263, 4433]  # any ids in every vocabulary's range


class Stopper:
    """An eval callback that stops at each MoE layer's routing and changes nothing: the compiled filter,
    its tables the identity, answering in C (`in_c`) or handing each stop to a Python callback."""

    def __init__(self, lib: ctypes.CDLL, n_layer: int, n_expert: int, k: int, in_c: bool) -> None:
        self.in_c, self.k = in_c, k
        self.python_stops = 0  # routings Python answered
        self.stops = 0  # routings answered, counted at each reset

        def forward(_t: int, ask: bool, _user: int) -> bool:
            self.python_stops += not ask
            return True

        self._forward = eval_filter.EvalFn(forward)
        self._abort = eval_filter.AbortFn(lambda _u: False)
        f = self.filter = eval_filter.EvalFilter.wired(self._forward, self._abort, abort_ns=1 << 62)
        f.routing = 1
        self.seen = np.full(n_layer, n_expert, dtype=np.int32)
        self.tables = [FastTables(layer, np.arange(n_expert, dtype=np.int32), bytearray(b"\x01" * n_expert),
                                  self.seen, []) for layer in range(n_layer)]
        self._keep = f.set_layers(self.tables)
        # room for a prompt's routings (rows * k ids each); reset before each token
        log = (ctypes.c_int32 * (n_layer * (3 + 2 * k * len(PROMPT))))()
        self._keep.append(log)
        f.log, f.log_cap = ctypes.cast(log, ctypes.POINTER(ctypes.c_int32)), len(log)
        f.fast = int(in_c)
        self.callback = ctypes.cast(lib.bmoe_eval_filter, llama_cpp.ggml_backend_sched_eval_callback)
        self.user = ctypes.addressof(f)

    def reset(self) -> None:
        """Before a token: count the last one's routings answered in C, empty the log."""
        self.stops += self.filter.log_len // (3 + 2 * self.k)
        self.filter.log_len = 0

    @property
    def answered(self) -> int:
        return self.python_stops if not self.in_c else self.stops


def decode_run(ctx: object, vocab: llama.Vocab, n_tokens: int, reset: object) -> float:
    """Prompt, then `n_tokens` greedy tokens; returns the decode's seconds per token."""
    llama.kv_clear(ctx)
    rc, rows = llama.decode(ctx, [(0, PROMPT, 0)])
    assert rc == 0, rc
    tok, pos = int(np.argmax(llama.logits(ctx, vocab, rows[0]))), len(PROMPT)
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        reset()
        rc, rows = llama.decode(ctx, [(0, [tok], pos)])
        assert rc == 0, rc
        tok, pos = int(np.argmax(llama.logits(ctx, vocab, rows[0]))), pos + 1
    return (time.perf_counter() - t0) / n_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="folder for results.json and report.md")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("-n", "--tokens", type=int, default=32)
    p.add_argument("-t", "--threads", type=int, default=2)
    a = p.parse_args()
    lib = eval_filter.compiled()
    if lib is None:
        p.error("the compiled filter is not built here (pip install -e .)")
    files = read_model_files(a.model)
    print(f"graph_stops_cost: reading {a.model} into the page cache", file=sys.stderr)
    read_into_page_cache(a.model)
    llama.init_backend()
    model = llama.load_model(a.model)
    n_layer = llama.n_layer(model)
    vocab = llama.Vocab(model)
    arms: dict[str, tuple[object, object]] = {}
    keep = []
    for name in ("plain", "routing-c", "routing-python"):
        if name == "plain":
            ctx = llama.new_context(model, 256, a.threads)
            arms[name] = (ctx, lambda: None)
        else:
            s = Stopper(lib, n_layer, files.n_expert, files.n_expert_used, name == "routing-c")
            keep.append(s)
            ctx = llama.new_context(model, 256, a.threads, s.callback, eval_user=s.user)
            arms[name] = (ctx, s.reset)
    per: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(a.rounds):
        for name, (ctx, reset) in arms.items():
            per[name].append(decode_run(ctx, vocab, a.tokens, reset))
            print(f"graph_stops_cost: round {r + 1}, {name}: {per[name][-1] * 1000:.2f} ms/token", file=sys.stderr)
    for s in keep:  # every MoE layer of every decode token stopped (and the prompt's, counted in Python)
        assert s.answered >= a.rounds * a.tokens * n_layer, (s.in_c, s.answered)
        assert s.in_c or s.stops == 0
    ratios = {name: [x / b for x, b in zip(v, per["plain"])] for name, v in per.items() if name != "plain"}
    a.out.mkdir(parents=True, exist_ok=True)
    machine = machine_info(a.model)
    result = {"model": str(a.model), "tokens": a.tokens, "threads": a.threads, "moe_layers": n_layer,
              "machine": machine, "s_per_token": per, "ratio_to_plain": ratios}
    (a.out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Graph stops' cost on plain llama.cpp: {a.model.name}", "",
             f"`python bench/graph_stops_cost.py -m {a.model} --rounds {a.rounds} -n {a.tokens} -t {a.threads}`", "",
             f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['kernel']}", "",
             "| arm | ms/token per round | median | ÷ plain per round | median ÷ plain |", "|---|---|---:|---|---:|"]
    for name, v in per.items():
        rs = ratios.get(name)
        lines.append(f"| {name} | {', '.join(f'{x * 1000:.2f}' for x in v)} | {statistics.median(v) * 1000:.2f} | "
                     f"{', '.join(f'{x:.3f}' for x in rs) if rs else '–'} | "
                     f"{statistics.median(rs) if rs else 1:.3f} |")
    (a.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for ctx, _ in arms.values():
        llama.free_context(ctx)
    llama.free_model(model)


if __name__ == "__main__":
    main()
