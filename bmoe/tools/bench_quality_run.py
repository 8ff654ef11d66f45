"""One run of `bmoe-bench quality`: a text teacher-forced through the decode path, scored against the
lossless reference, then greedy generations; started by bmoe.tools.bench_quality as
`python -m bmoe.tools.bench_quality_run` with bmoe-cli's flags, under the benchmark's memory limit.

The text's first `--context` tokens are the prompt (prefilled, not scored, as llama-perplexity
leaves the first half of each window unscored); each of the next `-n` tokens is decoded one step at
a time through bmoe's one generation loop (a Request with `forced` tokens), so the cache, the
reads and lossy routing behave as in a real decode, and the distribution each token was predicted
from is scored as `llama-perplexity --kl-divergence` scores it (tools/perplexity/perplexity.cpp):
KL(reference || this run) over the reference's tokens with log-probability above -16, whether the
most likely token is the reference's, and the negative log-likelihood of the text's token.

The first run with no reference file is the reference (it must be lossless) and writes it:
per scored token the reference's log-probabilities above -16 (float64, so a lossless repeat
scores exactly 0) and its most likely token. Every run writes `<csv>.quality.json` (per-token
KL, agreement and NLL, the generations' token ids) and prints bmoe-cli's summary lines of the
forced decode, which is what `bmoe-bench run` reads speed from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from bmoe import console, exits, flags, telemetry
from bmoe.errors import BmoeError, ConfigError

LOGP_FLOOR = -16.0  # llama-perplexity skips reference tokens at or below this log-probability


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def kl_divergence(base_ids: np.ndarray, base_logp: np.ndarray, logp: np.ndarray) -> float:
    """KL(reference || this run) of one next-token distribution, as llama-perplexity sums it: over the
    reference's tokens whose log-probability is above LOGP_FLOOR (`base_ids`, `base_logp`)."""
    return float(np.sum(np.exp(base_logp) * (base_logp - logp[base_ids])))


class Reference:
    """The reference's per-token distributions (the entries above LOGP_FLOOR) and most likely tokens."""

    def __init__(self, ids: list[np.ndarray], logp: list[np.ndarray], top1: list[int], meta: dict) -> None:
        self.ids, self.logp, self.top1, self.meta = ids, logp, top1, meta

    @classmethod
    def load(cls, path: Path) -> "Reference":
        z = np.load(path)
        off = z["offsets"]
        ids = [z["ids"][off[i]:off[i + 1]] for i in range(len(off) - 1)]
        logp = [z["logp"][off[i]:off[i + 1]] for i in range(len(off) - 1)]
        return cls(ids, logp, z["top1"].tolist(), json.loads(str(z["meta"])))

    def save(self, path: Path) -> None:
        off = np.cumsum([0] + [len(x) for x in self.ids])
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, offsets=off, ids=np.concatenate(self.ids), logp=np.concatenate(self.logp),
                 top1=np.array(self.top1), meta=json.dumps(self.meta))
        tmp.replace(path)


def build_parser() -> argparse.ArgumentParser:
    ap = flags.build_parser()
    ap.prog = "python -m bmoe.tools.bench_quality_run"
    ap.description = "One run of bmoe-bench quality (see bmoe-bench quality --help)."
    g = ap.add_argument_group("quality run")
    g.add_argument("--text", required=True, help="the text to score (UTF-8)")
    g.add_argument("--context", type=int, default=128, help="tokens of the text prefilled, not scored")
    g.add_argument("--reference", required=True, help="the reference's file: written when missing, else scored against")
    g.add_argument("--gen-prompts", default="[]", help="JSON list of prompts for greedy generations")
    g.add_argument("--gen-tokens", type=int, default=48, help="tokens per greedy generation")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    settings = flags.settings_from(ap, a)
    exits.install_signal_handlers()
    try:
        return run(a, settings)
    except (BmoeError, OSError) as e:
        console.error(str(e))
        return exits.EXIT_ERROR
    except KeyboardInterrupt:
        return exits.EXIT_SIGINT


def run(a: argparse.Namespace, settings: flags.Settings) -> int:
    from bmoe import cli
    from bmoe.api import Chunk, Model, Request
    from bmoe.coordinator import Engine

    text = Path(a.text).read_text(encoding="utf-8")
    ref_path = Path(a.reference)
    ref = Reference.load(ref_path) if ref_path.exists() else None
    model = Model(Engine(settings, notice=console.notice))
    e = model.engine
    try:
        tokens = e.tokenize(text)
        c, n = a.context, a.n_predict
        if len(tokens) < c + n:
            raise ConfigError(f"the text has {len(tokens)} tokens with this model's vocabulary, fewer than --context "
                              f"{c} plus -n {n}; give a longer text or fewer tokens")
        forced = tokens[c:c + n]
        meta = {"model": Path(settings.model).name, "context": c, "tokens": forced}
        if ref is None:
            if e.is_lossy:
                raise ConfigError("the reference run (the first, with no reference file yet) must be lossless")
            ref_out: Reference | None = Reference([], [], [], meta)
        else:
            ref_out = None
            if ref.meta != meta:
                raise ConfigError(f"{ref_path} was written for another model, text or --context; delete it")
        kl, same, nll, lines = [], [], [], []
        greedy = model.sampler(temperature=0.0)
        req = Request(tuple(tokens[:c]), n, greedy, forced=tuple(forced), logits=True)

        def on_chunk(ch: Chunk) -> None:
            if ch.token is None:
                return
            i = len(lines)
            lines.append(ch.token)
            lp = log_softmax(ch.logits)
            nll.append(float(-lp[forced[i]]))
            top = int(np.argmax(ch.logits))
            if ref_out is not None:
                keep = np.nonzero(lp > LOGP_FLOOR)[0]
                ref_out.ids.append(keep.astype(np.int32))
                ref_out.logp.append(lp[keep])
                ref_out.top1.append(top)
                kl.append(0.0)
                same.append(True)
            else:
                base = ref.logp[i]
                kl.append(kl_divergence(ref.ids[i], base, lp))
                same.append(top == ref.top1[i])

        t0 = time.perf_counter()
        done = model.run(req, on_chunk)
        forced_s = time.perf_counter() - t0
        if len(lines) != n:
            raise BmoeError(f"the forced decode ended after {len(lines)} of {n} tokens ({done.finish_reason})")
        if ref_out is not None:
            ref_out.save(ref_path)
        out = sys.stdout
        for line in cli.summary(e, lines, done.stats):
            out.write(line + "\n")
        out.flush()
        gens = []
        for p in json.loads(a.gen_prompts):
            g = model.run(model.prepare(prompt=p, max_tokens=a.gen_tokens))
            gens.append({"prompt": p, "ids": list(g.ids), "tok_s": g.stats.tok_s})
        if a.csv:
            with open(a.csv, "w") as f:
                f.write(telemetry.csv_header(e.is_lossy) + "\n")
                for t in lines:
                    f.write(telemetry.csv_row(t, e.is_lossy) + "\n")
                totals = telemetry.RunTotals.of(lines, overlap=e.streaming and settings.streaming.overlap)
                f.write(telemetry.csv_summary(
                    totals, done.stats.cache_hit_pct, e.budget, prefill_tokens=done.stats.prefill_tokens,
                    prefill_s=done.stats.prefill_s, load_s=e.load_s, llama_load_s=e.llama_load_s) + "\n")
            result = {"reference": ref_out is not None, "kl": kl, "same_top": same, "nll": nll,
                      "forced_s": forced_s, "stats": dataclasses.asdict(done.stats), "generations": gens}
            Path(a.csv + ".quality.json").write_text(json.dumps(result))
    finally:
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
