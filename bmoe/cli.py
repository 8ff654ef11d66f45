"""`bmoe-cli`: generate text from a MoE GGUF while streaming its experts from flash.

One-shot: load, answer one prompt through `bmoe.api.Model.run` (the generation path of the
session and the server too), print the contract's summary lines, exit. `--session`:
bmoe.edges.session. The flags live in bmoe.edges.flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bmoe.api import Ask, Chunk, EngineStats, GenerationStats, open_model
from bmoe.base import BmoeError, ConfigError, MiB, Settings, telemetry
from bmoe.edges import console, exits, flags, profile

DEMO_PROMPT = "What is the capital of France, and what is it famous for?"


def read_prompt(a: argparse.Namespace) -> str:
    if not a.file:
        return a.prompt if a.prompt is not None else flags.DEFAULT_PROMPT
    try:
        raw = Path(a.file).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read prompt file {a.file}: {e.strerror}; check the -f path") from e
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"prompt file {a.file} is not UTF-8 text (byte {e.start} is 0x{raw[e.start]:02x}); "
                          "save it as UTF-8") from None


def summary(e: EngineStats, settings: Settings, lines: list[telemetry.TokenLine], stats: GenerationStats
            ) -> list[str]:
    """The contract's end-of-run lines, in order, from the engine's stats after the run."""
    totals = telemetry.RunTotals.of(lines, overlap=e.streaming and settings.streaming.overlap)
    out = [telemetry.generation_line(totals)]
    if e.streaming:
        out.append(telemetry.stream_line(totals))
    if stats.cache_hit_pct >= 0:
        out.append(telemetry.cache_line(stats.cache_hit_pct, e.resident_bytes))
    if e.streaming and settings.speculation.prefetch:
        out.append(speculation_line(stats))
    if e.spec_gate is not None:
        out.append(telemetry.spec_gate_line(*e.spec_gate))
    if stats.lossy:
        out.append(telemetry.lossy_line(totals, stats.experts_per_token, e.top_k))
    return out


def speculation_line(stats: GenerationStats) -> str:
    return telemetry.prefetch_line(int(stats.speculative_mib * MiB), stats.useful_experts, stats.prefetched_experts)


def run(a: argparse.Namespace, settings: flags.Settings) -> int:
    """One prompt through `Model.run`, the generation path the session and the server use too."""
    prompt = read_prompt(a)
    csv_file = open(a.csv, "w", buffering=1) if a.csv else None
    model = open_model(settings, console.notice)
    lossy = model.stats.engine.lossy
    try:
        req = model.prepare(Ask(messages=[{"role": "user", "content": prompt}] if a.chat else None,
                                prompt=None if a.chat else prompt, max_tokens=a.n_predict,
                                fix="raise -c or shorten the prompt"))
        out = sys.stdout
        lines: list[telemetry.TokenLine] = []
        text = ""
        if csv_file:
            csv_file.write(telemetry.csv_header(lossy, settings.draft.mode != "none") + "\n")

        def on_chunk(chunk: Chunk) -> None:
            nonlocal text
            text += chunk.text
            if chunk.token is not None:
                lines.append(chunk.token)
                if a.progress:
                    out.write("".join(x + "\n" for x in telemetry.token_lines(chunk.token, text)))
                if csv_file:
                    csv_file.write(telemetry.csv_row(chunk.token, lossy) + "\n")
            if not a.progress:
                out.write(chunk.text)
            out.flush()

        done = model.run(req, on_chunk)
        model.check_unchanged("the answer above may not be the model's; run again")
        e = model.stats.engine
        out.write(f"{telemetry.ANSWER_BANNER}\n{done.text}\n{telemetry.PERF_BANNER}\n" if a.progress else "\n")
        for line in summary(e, settings, lines, done.stats):
            out.write(line + "\n")
        out.flush()
        if (e.spec_gate is not None or settings.speculation.guess) and not settings.speculation.prefetch:
            console.notice(speculation_line(done.stats))  # the contract's moe-prefetch line is --prefetch's
        if csv_file:
            totals = telemetry.RunTotals.of(lines, overlap=e.streaming and settings.streaming.overlap)
            csv_file.write(telemetry.csv_summary(
                totals, done.stats.cache_hit_pct, e.budget_bytes, prefill_tokens=done.stats.prefill_tokens,
                prefill_s=done.stats.prefill_s, load_s=e.load_s, llama_load_s=e.llama_load_s) + "\n")
        if a.profile:
            rows = profile.collect(list(e.workers))
            print(profile.process_table(rows, e.resident_bytes, list(e.lanes)), file=sys.stderr)
            if a.csv:
                Path(a.csv + ".procs.csv").write_text(profile.csv_text(rows, e.resident_bytes))
    finally:
        model.close()
        if csv_file:
            csv_file.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = flags.build_parser()
    a = ap.parse_args(argv)
    if a.model is None and a.prompt is None and a.file is None and not a.session:
        a.prompt, a.chat = DEMO_PROMPT, True
    settings = flags.settings_from(ap, a)
    if settings.embedding:  # a load setting of bmoe-server and bmoe.load; bmoe-cli only generates
        ap.error("--embedding: bmoe-cli generates text; embeddings are bmoe-server --embedding's (/v1/embeddings) "
                 "and bmoe.load(embedding=True)'s (Model.embed)")
    exits.install_signal_handlers()
    if a.session:
        from bmoe.edges import session

        return session.serve_session(a, settings)
    try:
        return run(a, settings)
    except (BmoeError, OSError) as e:
        console.error(str(e))
        return exits.EXIT_ERROR
    except KeyboardInterrupt:
        print("bmoe-cli: interrupted", file=sys.stderr)
        return exits.EXIT_SIGINT


if __name__ == "__main__":
    sys.exit(main())
