"""Published models' shapes for bmoe-synth --like: the tables `LIKES` (each checked against the real
Q4_K_M file's size where one is published), and the shape a route_trace v1 header describes (a known
model, or one derived from its expert bytes), so streaming reads what it would read from the real
file."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from pathlib import Path

from bmoe.streaming import Trace
from bmoe.tools.synth_archs import ARCHES, check_mtp, one_expert_bytes
from bmoe.tools.synth_shape import K_QUANTS, Dsv4, Indexer, Mla, Ple, Recurrent, Shape


@dataclass(frozen=True)
class Like:
    """A published model's shape at Q4_K_M and the real GGUF it is checked against.

    `real_bytes` is that file's size, `real_recipe` its quantization where no Q4_K_M file's size
    could be found (the nearest published file; 0 bytes: none), and `source` says where the number
    and the shape come from.
    """

    shape: Shape
    real_bytes: int
    source: str
    real_recipe: str = "Q4_K_M"


# GLM-5.2's indexer types (llama.cpp's GLM_5_2_DEFAULT_INDEXER_TYPES, src/models/glm-dsa.cpp, from the
# model's config.json): layers 0-2 and every 4th after compute their own top-k, the others reuse it.
_GLM_5_2_FULL_INDEXERS = tuple(i < 3 or (i - 2) % 4 == 0 for i in range(78))


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
    "qwen3.6-35b-a3b": Like(
        Shape("qwen35moe", layers=40, experts=256, top_k=8, embd=2048, ff=512, quant="q4_k_m", n_head=16,
              n_head_kv=2, head_dim=256, vocab=248320, rope_base=1e7, shared_ff=512, full_every=4, rope_dims=64,
              recurrent=Recurrent(conv=4, head_dim=128, k_heads=16, v_heads=32), name="qwen3.6-35b-a3b"),
        real_bytes=21_300_000_000,
        source="shape: the Qwen3.6-35B-A3B model card (hidden 2048, 40 layers as 10 x (3 Gated DeltaNet + 1 "
               "gated attention), DeltaNet 32 V and 16 QK heads of 128, attention 16 Q and 2 KV heads of 256, "
               "rotary 64, 256 experts of 512, 8 routed + 1 shared, vocab 248320; as quoted on mera.a-ai.ru and "
               "chaobro.com) and the llama.cpp load logs of its GGUFs in ggml-org/llama.cpp PRs #22673 and "
               "#23269 (qwen35moe.ssm.* = conv 4, state 128, groups 16, rank 32, inner 4096; shared expert 512; "
               "rope sections [11, 11, 10, 0], freq base 1e7); no MTP layer (the converter's MTP variant adds "
               "blk.40, block_count 41); size: 21.3 GB, the static Q4_K_M of the same-shape finetune "
               "Qwen3.6-35B-A3B-uncensored-heretic (mradermacher's quant table, Kyonbyte's bucket on "
               "huggingface.co); no plain Q4_K_M of the original with a byte count was found (unsloth's "
               "UD-Q4_K_M: 21 GB, mudler's APEX table)",
    ),
    "qwen3.8-flash-next": Like(
        Shape("qwen4exp", layers=48, experts=512, top_k=10, embd=2560, ff=640, quant="q4_k_m", n_head=24,
              n_head_kv=2, head_dim=256, vocab=248320, rope_base=1e7, shared_ff=640, full_every=4, rope_dims=64,
              recurrent=Recurrent(conv=4, head_dim=128, k_heads=16, v_heads=32), hyper=4, hyper_rank=16,
              indexer=Indexer(heads=8, head_dim=128, top_k=2048,
                              ratios=tuple(4 if (i + 1) % 4 == 0 else 0 for i in range(48))),
              ple=Ple(rows=320_001_536, dim=160, layer=0, ngram=3, heads_per_ngram=8, conv=4),
              name="qwen3.8-flash-next"),
        real_bytes=111_300_000_000,
        real_recipe="UD-Q4_K_XL",
        source="shape: Qwen/Qwen3.8-Flash-Next's config as quoted in jundot/omlx#3170 and anthony-chaudhary/"
               "fak#9122 (48 layers, 36 linear + 12 full attention every 4th, hidden 2560, 24 Q and 2 KV heads "
               "of 256, rotary 0.25, 512 experts top-10), ROCm/aiter#5379 (expert width 640, 512 + 1 shared), "
               "lvyufeng/PocketLLM#88 (4 hyper-connection streams) and Tanguille/cluster#4764 (the n-gram table "
               "per_layer_token_embd [160, 320001536], 51.2B of 176.9B parameters; this table has 175.8B); "
               "not found, so assumed: the DeltaNet heads (16 QK, 32 V of 128 as Qwen3.6-35B), vocab 248320, "
               "hyper-connection rank 16, the indexer's 8 heads of 128 and ratio 4, the n-gram heads (2 x 8) "
               "and layer 0 (all a few hundred MB at most); size: no Q4_K_M with a byte count was found; the "
               "nearest is unsloth's UD-Q4_K_XL, 111.3 GB (unslothai/unsloth#11098), which this table exceeds "
               "by 6.4 %: the n-gram table alone is 35.2 GB here (Q4_K falls back to Q5_0 on 160-wide rows, "
               "llama-quant's tensor_type_fallback) where an IQ4_NL table is 28.8 GB (Helldez/BigMoeOnEdge#172)",
    ),
    "glm-5.2": Like(
        Shape("glm-dsa", layers=78, experts=256, top_k=8, embd=6144, ff=2048, quant="q4_k_m", n_head=64,
              n_head_kv=1, head_dim=192, vocab=154880, shared_ff=2048, dense_lead=3, dense_ff=12288,
              mtp=1, rope_dims=64, mla=Mla(q_lora=2048, kv_lora=512, qk_nope=192, qk_rope=64, v_head=256),
              indexer=Indexer(heads=32, head_dim=128, top_k=2048, full=_GLM_5_2_FULL_INDEXERS), name="glm-5.2"),
        real_bytes=0,
        real_recipe="none found",
        source="shape: the GLM-5 family's GlmMoeDsaConfig (hidden 6144, 78 layers, 3 dense of 12288, 256 experts "
               "of 2048, top-8, 1 shared, 64 heads, q_lora 2048, kv_lora 512, qk 192 + 64 rope, v 256, indexer 32 "
               "heads of 128, top-k 2048, vocab 154880), which GLM-5.2 keeps (744B, 256 experts, 8 active: "
               "betagouv/ComparIA#540), its indexer types (llama.cpp's GLM_5_2_DEFAULT_INDEXER_TYPES) and its "
               "MTP layer (mtp_num_layers 1, converted by default: block_count 79); the table's 753.3B "
               "parameters match the 753B xinference lists for unsloth/GLM-5.2-GGUF (xorbitsai/inference#5404); "
               "size: no Q4_K_M file size of GLM-5.2 was found",
    ),
    "deepseek-v4-flash": Like(
        Shape("deepseek4", layers=43, experts=256, top_k=6, embd=4096, ff=2048, quant="q4_k_m", n_head=64,
              n_head_kv=1, head_dim=512, vocab=129280, rope_base=10000.0, shared_ff=2048, hyper=4, rope_dims=64,
              dsv4=Dsv4(q_lora=1024, o_groups=8, o_lora=1024, window=128, hash_layers=3),
              indexer=Indexer(heads=64, head_dim=128, top_k=512,
                              ratios=(0, 0, *(4 if i % 2 == 0 else 128 for i in range(2, 43)))),
              name="deepseek-v4-flash"),
        real_bytes=175_019_917_312,
        real_recipe="Q4_K_M-XL",
        source="shape: DeepSeek-V4-Flash's config as quoted in tenstorrent/tt-metal#45408 and anthony-chaudhary/"
               "fak#12635 (43 layers, hidden 4096, 64 heads of 512, one KV head, rope 64, q_lora 1024, 8 output "
               "groups of rank 1024, window 128, compress ratios 0, 0 then 4 and 128 alternating, indexer 64 "
               "heads of 128 top-512, 4 hyper-connection streams, 256 experts of 2048, top-6, 1 shared, the "
               "first 3 layers hash-routed, vocab 129280; 284B parameters, this table 284.3B); no MTP layer; "
               "size: no plain Q4_K_M was found; the nearest is teamblobfish's Q4_K_M-XL, ~163 GiB at 4.92 BPW "
               "(ggml-org/llama.cpp#22319), which this table is 1.8 % under",
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


def shape_from_like(like: str, mtp: bool = False) -> Shape:
    """--like's shape: a LIKES name, or a route_trace v1 CSV path (see shape_from_trace); `mtp` adds the trailing
    multi-token-prediction layer a converter's MTP variant of the model has (one, as llama.cpp's converters write
    Qwen3.6's and GLM's: block_count one more), where the shape's loader has one and it has none yet."""
    if like in LIKES:
        shape = LIKES[like].shape
    elif Path(like).is_file():
        shape = shape_from_trace(like)
    else:
        raise ValueError(f"--like {like}: neither a known model ({', '.join(LIKES)}) nor a "
                         f"trace file (route_trace v1 .csv)")
    if mtp and not shape.mtp:
        check_mtp(shape.arch)
        shape = replace(shape, mtp=1)
    return shape
