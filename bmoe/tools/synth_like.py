"""Published models' shapes for bmoe-synth --like: the tables `LIKES` (each checked against the real
Q4_K_M file's size), and the shape a route_trace v1 header describes (a known model, or one derived
from its expert bytes), so streaming reads what it would read from the real file."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from pathlib import Path

from bmoe.streaming import Trace
from bmoe.tools.synth_shape import ARCHES, K_QUANTS, Shape, one_expert_bytes


@dataclass(frozen=True)
class Like:
    """A published model's shape at Q4_K_M and the real GGUF it is checked against.

    `real_bytes` is that file's size and `source` says where the number and the shape come from.
    """

    shape: Shape
    real_bytes: int
    source: str


LIKES: dict[str, Like] = {
    "qwen3-30b-a3b": Like(
        Shape("qwen3moe", layers=48, experts=128, top_k=8, embd=2048, ff=768, quant="q4_k_m",
              n_head=32, n_head_kv=4, head_dim=128, vocab=151936, rope_base=1e6, name="qwen3-30b-a3b"),
        real_bytes=18_554_258_719,
        source="shape: Qwen/Qwen3-30B-A3B config.json (hidden 2048, 48 layers, 32 heads, 4 KV heads of "
               "128, 128 experts of 768, top-8, vocab 151936, rope_theta 1e6); size: 17.28 GiB, the "
               "'original Q4_K_M (17.28 GB)' of huface.ru/GOBA-AI-Labs/PrunedHub-Qwen3-30B-A3B-EN-80pct-"
               "MxMoE, read as GiB as llama.cpp prints sizes (as 1e9-byte GB the synth would be 7.4 % "
               "over)",
    ),
    "gemma-4-26b-a4b": Like(
        Shape("gemma4", layers=30, experts=128, top_k=8, embd=2816, ff=704, quant="q4_k_m",
              n_head=16, n_head_kv=8, head_dim=256, vocab=262144, rope_base=1e6, sliding_window=1024,
              dense_ff=2112, full_every=6, full_head_dim=512, full_kv_heads=2, name="gemma-4-26b-a4b"),
        real_bytes=17_019_202_680,
        source="shape: google/gemma-4-26B-A4B-it config.json text_config (hidden 2816, 30 layers, 16 "
               "heads, 8 KV heads of 256 on sliding layers and 2 of 512 on every 6th (full-attention) "
               "layer, dense FFN 2112, 128 experts of 704, top-8, vocab 262144, tied embeddings, "
               "sliding window 1024); size: the route trace of google_gemma-4-26B-A4B-it-Q4_K_M.gguf "
               "(../shared/traces): its layers' expert and dense bytes, 16.414 GB, plus a Q6_K "
               "token_embd, 0.606 GB. The table's expert bytes equal the trace's at every layer; its "
               "dense bytes are 4-8 MB a layer short of the trace's, which this table cannot explain "
               "from the config and llama.cpp's rules (ggml-org's Q4_K_M of the model is 16.80 GB on "
               "its Hugging Face page, 0.1 % from this table)",
    ),
    "gpt-oss-20b": Like(
        Shape("gpt-oss", layers=24, experts=32, top_k=4, embd=2880, ff=2880, quant="q4_k_m",
              n_head=64, n_head_kv=8, head_dim=64, vocab=201088, rope_base=150000.0, name="gpt-oss-20b"),
        real_bytes=11_600_000_000,
        source="shape: openai/gpt-oss-20b config.json (hidden 2880, 24 layers, 64 heads, 8 KV heads of "
               "64, 32 experts of 2880, top-4, vocab 201088, sliding window 128, rope_theta 150000); "
               "size: gpt-oss-20b-Q4_K_M.gguf, 11.6 GB, huggingface.co/unsloth/gpt-oss-20b-GGUF/tree/main",
    ),
    "gpt-oss-120b": Like(
        Shape("gpt-oss", layers=36, experts=128, top_k=4, embd=2880, ff=2880, quant="q4_k_m",
              n_head=64, n_head_kv=8, head_dim=64, vocab=201088, rope_base=150000.0, name="gpt-oss-120b"),
        real_bytes=62_770_947_031,
        source="shape: openai/gpt-oss-120b config.json (as gpt-oss-20b, 36 layers of 128 experts); "
               "size: unsloth/gpt-oss-120b-GGUF Q4_K_M, 58.46 GiB (ailocalcheck.com's listing; its "
               "F16 60.88 matches the 60.87 GiB llama-bench prints for that repository's F16). The "
               "table gives the trace's (../shared/traces) expert and dense bytes at every layer",
    ),
}


def _like_name(model: str) -> str | None:
    """The LIKES entry a trace's model file is a quantization of, if any (by its file name)."""
    base = Path(model).name.lower()
    return next((name for name in LIKES if name in base), None)


def shape_from_trace(path: str | Path) -> Shape:
    """The shape a trace's routing ran on, from its header (route_trace v1, or bmoe's own with
    expert bytes). A known model (by the file name in the header) keeps its published table with
    the trace's top-k, checked against the header's expert_bytes; any other gets a shape whose
    experts have exactly the header's bytes at every layer."""
    trace = Trace.read(path)
    h, expert_bytes = trace.header, trace.expert_bytes
    if not expert_bytes:
        raise ValueError(f"{path}: the trace's header gives no expert bytes per layer (route_trace v1's "
                         f"'# layer=L expert_bytes=B' lines)")
    layers = max(expert_bytes) + 1
    if sorted(expert_bytes) != list(range(layers)):
        raise ValueError(f"{path}: bmoe-synth needs every layer to be a MoE layer; the header lists "
                         f"{len(expert_bytes)} of {layers}")
    name = _like_name(h.get("model", ""))
    if name is not None:
        shape = replace(LIKES[name].shape, top_k=h["top_k"])
        wrong = [(layer, b, one_expert_bytes(shape, layer)) for layer, b in sorted(expert_bytes.items())
                 if layer >= shape.layers or b != one_expert_bytes(shape, layer)]
        if (shape.layers, shape.experts) != (layers, h["n_expert"]) or wrong:
            raise ValueError(f"{path}: its model {Path(h['model']).name} is {name} by name, but the header "
                             f"({layers} layers of {h['n_expert']} experts; layer, its expert bytes, the "
                             f"table's: {wrong[:3]}) differs from {name}'s table")
        return shape
    return _derive_shape(h.get("arch", ""), h["n_expert"], h["top_k"], expert_bytes, path)


def _derive_shape(trace_arch: str, n_expert: int, top_k: int, expert_bytes: dict[int, int],
                  path: str | Path) -> Shape:
    """A shape whose one-expert bytes equal the header's at every layer: the first architecture and
    expert type, then the hidden size closest to 3x the expert width (as real MoEs are), that solve
    them all. qwen2moe comes second: its shared expert is a second ffn_down a layer, which moves
    Q4_K_M's wider down layers as a dense FFN beside the experts does (gemma4)."""
    first, layers = expert_bytes[0], len(expert_bytes)
    arches = dict.fromkeys((trace_arch if trace_arch in ARCHES else "qwen3moe", "qwen2moe"))
    for arch, quant in itertools.product(arches, ("q4_k_m", "q8_0", "q4_0", "mxfp4", "q6_k", "q5_k", "q4_k", "f16")):
        found: list[Shape] = []
        for embd in range(256 if quant in K_QUANTS else 64, 16385, 256 if quant in K_QUANTS else 32):
            for probe in (256, 32):  # the down rows' fallback type depends on ff: try both
                shape = Shape(arch, layers, n_expert, top_k, embd, probe, quant)
                ff, rest = divmod(first * probe, one_expert_bytes(shape, 0))
                if rest or ff < 32 or ff % (256 if quant in K_QUANTS else 32):
                    continue
                shape = replace(shape, ff=ff)
                if all(one_expert_bytes(shape, layer) == b for layer, b in expert_bytes.items()):
                    found.append(shape)
        if found:
            return min(found, key=lambda x: abs(math.log(x.embd / (3 * x.ff))))
    raise ValueError(f"{path}: no expert type and hidden size give experts of the header's bytes at "
                     f"every layer ({first} at layer 0); name a known model with --like ({', '.join(LIKES)})")


def shape_from_like(like: str) -> Shape:
    """--like's shape: a LIKES name, or a route_trace v1 CSV path (see shape_from_trace)."""
    if like in LIKES:
        return LIKES[like].shape
    if Path(like).is_file():
        return shape_from_trace(like)
    raise ValueError(f"--like {like}: neither a known model ({', '.join(LIKES)}) nor a "
                     f"trace file (route_trace v1 .csv)")
