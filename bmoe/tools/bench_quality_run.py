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

The first run with no complete reference is the reference (it must be lossless) and writes it
(`Reference`): per scored token its log-probabilities and its most likely token. Every run writes
`<csv>.quality.json` (per-token KL, agreement and NLL, the generations' token ids) and prints
bmoe-cli's summary lines of the forced decode, which is what `bmoe-bench run` reads speed from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from bmoe.base import BmoeError, ConfigError, telemetry
from bmoe.edges import console, exits, flags
from bmoe.generation import log_softmax

LOGP_FLOOR = -16.0  # llama-perplexity skips reference tokens at or below this log-probability


def kl_divergence(base_ids: np.ndarray, base_logp: np.ndarray, logp: np.ndarray) -> float:
    """KL(reference || this run) of one next-token distribution, as llama-perplexity sums it: over the
    reference's tokens whose log-probability is above LOGP_FLOOR (`base_ids`, `base_logp`)."""
    return float(np.sum(np.exp(base_logp) * (base_logp - logp[base_ids])))


class Reference:
    """The reference's next-token log-probabilities on disk: a directory with `logp.f32` (one float32
    row of the vocabulary per scored token) and `meta.json` (what was scored, each token's most
    likely next token; written last, so a reference without it is incomplete).

    Rows go through the page cache one at a time and are dropped from it at once
    (POSIX_FADV_DONTNEED; the writer syncs them first), so a run under a memory limit holds about
    one row of it, not the whole file: the measured run keeps its memory to itself. Float32 on both
    sides: a lossless repeat, computing the same float32 row, scores exactly 0."""

    SYNC_ROWS = 32  # the writer syncs and drops its rows this often

    def __init__(self, path: Path, vocab: int, writing: bool) -> None:
        self.path, self.vocab, self.writing = path, vocab, writing
        self.row_bytes = vocab * 4
        path.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path / "logp.f32", (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if writing else os.O_RDONLY)
        self.top1: list[int] = []
        self.meta: dict = json.loads((path / "meta.json").read_text()) if not writing else {}

    @staticmethod
    def complete(path: Path) -> bool:
        return (path / "meta.json").is_file()

    def write(self, i: int, logp32: np.ndarray, top: int) -> None:
        os.pwrite(self.fd, logp32.tobytes(), i * self.row_bytes)
        self.top1.append(top)
        if (i + 1) % self.SYNC_ROWS == 0:
            self._drop(i + 1)

    def read(self, i: int) -> np.ndarray:
        raw = os.pread(self.fd, self.row_bytes, i * self.row_bytes)
        os.posix_fadvise(self.fd, i * self.row_bytes, self.row_bytes, os.POSIX_FADV_DONTNEED)
        if len(raw) != self.row_bytes:
            raise ConfigError(f"{self.path} holds fewer rows than this run scores; delete it")
        return np.frombuffer(raw, dtype=np.float32)

    def _drop(self, rows: int) -> None:
        os.fdatasync(self.fd)
        os.posix_fadvise(self.fd, 0, rows * self.row_bytes, os.POSIX_FADV_DONTNEED)

    def finish(self, meta: dict) -> None:
        """The writer's last step: the rows synced, then meta.json (the reference is complete)."""
        self._drop(len(self.top1))
        tmp = self.path / "meta.json.tmp"
        tmp.write_text(json.dumps({**meta, "top1": self.top1}))
        tmp.replace(self.path / "meta.json")

    def close(self) -> None:
        os.close(self.fd)


def build_parser() -> argparse.ArgumentParser:
    ap = flags.build_parser()
    ap.prog = "python -m bmoe.tools.bench_quality_run"
    ap.description = "One run of bmoe-bench quality (see bmoe-bench quality --help)."
    g = ap.add_argument_group("quality run")
    g.add_argument("--text", required=True, help="the text to score (UTF-8)")
    g.add_argument("--context", type=int, default=128, help="tokens of the text prefilled, not scored")
    g.add_argument("--reference", required=True,
                   help="the reference's directory: written when it holds no complete reference, else scored against")
    g.add_argument("--gen-prompts", default="[]", help="JSON list of prompts for greedy generations")
    g.add_argument("--gen-tokens", type=int, default=48, help="tokens per greedy generation")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    settings = flags.settings_from(ap, a)
    exits.install_signal_handlers()
    try:
        return run_quality(a, settings)
    except (BmoeError, OSError) as e:
        console.error(str(e))
        return exits.EXIT_ERROR
    except KeyboardInterrupt:
        return exits.EXIT_SIGINT


def run_quality(a: argparse.Namespace, settings: flags.Settings) -> int:
    from bmoe import cli
    from bmoe.api import Ask, Chunk, Request, open_model

    text = Path(a.text).read_text(encoding="utf-8")
    ref_path = Path(a.reference)
    writing = not Reference.complete(ref_path)
    model = open_model(settings, console.notice)
    lossy = model.stats.engine.lossy
    ref: Reference | None = None
    try:
        tokens = model.tokenize(text)
        c, n = a.context, a.n_predict
        if len(tokens) < c + n:
            raise ConfigError(f"the text has {len(tokens)} tokens with this model's vocabulary, fewer than --context "
                              f"{c} plus -n {n}; give a longer text or fewer tokens")
        forced = tokens[c:c + n]
        meta = {"model": Path(settings.model).name, "context": c, "tokens": forced}
        if writing and lossy:
            raise ConfigError("the reference run (the first, with no reference yet) must be lossless")
        ref = Reference(ref_path, model.n_vocab, writing)
        if not writing and {k: ref.meta.get(k) for k in meta} != meta:
            raise ConfigError(f"{ref_path} was written for another model, text or --context; delete it")
        kl, same, nll = [], [], []
        lines: list[telemetry.TokenLine] = []
        req = Request(tuple(tokens[:c]), n, model.sampler(temperature=0.0), forced=tuple(forced), logits=True)

        def on_chunk(ch: Chunk) -> None:
            if ch.token is None:
                return
            assert ch.logits is not None  # the request asks for them
            i = len(lines)
            lines.append(ch.token)
            lp = log_softmax(ch.logits)
            nll.append(float(-lp[forced[i]]))
            top = int(np.argmax(ch.logits))
            lp32 = lp.astype(np.float32)
            if writing:
                ref.write(i, lp32, top)
                kl.append(0.0)
                same.append(True)
            else:
                base = ref.read(i)
                keep = np.nonzero(base > LOGP_FLOOR)[0]
                kl.append(kl_divergence(keep, base[keep].astype(np.float64), lp32.astype(np.float64)))
                same.append(top == ref.meta["top1"][i])

        t0 = time.perf_counter()
        done = model.run(req, on_chunk)
        forced_s = time.perf_counter() - t0
        if len(lines) != n:
            raise BmoeError(f"the forced decode ended after {len(lines)} of {n} tokens ({done.finish_reason})")
        if writing:
            ref.finish(meta)
        out = sys.stdout
        e = model.stats.engine
        for line in cli.summary(e, settings, lines, done.stats):
            out.write(line + "\n")
        out.flush()
        gens = []
        for p in json.loads(a.gen_prompts):
            g = model.run(model.prepare(Ask(prompt=p, max_tokens=a.gen_tokens)))
            gens.append({"prompt": p, "ids": list(g.ids), "tok_s": g.stats.tok_s})
        if a.csv:
            with open(a.csv, "w") as f:
                f.write(telemetry.csv_header(lossy) + "\n")
                for t in lines:
                    f.write(telemetry.csv_row(t, lossy) + "\n")
                e = model.stats.engine
                totals = telemetry.RunTotals.of(lines, overlap=e.streaming and settings.streaming.overlap)
                f.write(telemetry.csv_summary(
                    totals, done.stats.cache_hit_pct, e.budget_bytes, prefill_tokens=done.stats.prefill_tokens,
                    prefill_s=done.stats.prefill_s, load_s=e.load_s, llama_load_s=e.llama_load_s) + "\n")
            result = {"reference": writing, "kl": kl, "same_top": same, "nll": nll,
                      "forced_s": forced_s, "stats": dataclasses.asdict(done.stats), "generations": gens}
            Path(a.csv + ".quality.json").write_text(json.dumps(result))
    finally:
        if ref is not None:
            ref.close()
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
