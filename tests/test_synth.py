"""bmoe-synth models must load and run in real llama.cpp, route tokens to varying experts, and be
reproducible byte for byte: the streaming tests elsewhere build on all three."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import gguf
import gguf.quants
import llama_cpp
import numpy as np
import pytest

from bmoe.base.model_files import LAZY_MIN_BYTES, read_model_files
from bmoe.memory.dense import file_spans
from bmoe.seam.llama import model_params, n_layer_nextn
from bmoe.tools import synth, synth_archs, synth_blocks, synth_like, synth_shape
from tests.conftest import run_cli
from tests.plain_llama import plain_llama
from tests.routed_run import check_runs


def _expert_tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    reader = gguf.GGUFReader(path)
    return {t.name: t for t in reader.tensors if "_exps." in t.name}


def _n_expert(path: Path, arch: str) -> int:
    field = gguf.GGUFReader(path).fields[f"{arch}.expert_count"]
    return int(field.parts[field.data[0]][0])


@pytest.mark.parametrize("arch", synth_archs.ARCHES)
def test_every_arch_loads_generates_and_routes(tmp_path: Path, arch: str) -> None:
    path = synth.write_model(tmp_path / f"{arch}.gguf", arch=arch, layers=2, seed=1)
    assert _n_expert(path, arch) == 8
    experts = _expert_tensors(path)
    for layer in range(2):
        for kind in ("gate", "up", "down"):
            t = experts[f"blk.{layer}.ffn_{kind}_exps.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
            assert t.shape[-1] == 8  # ggml order: the expert index is the last dimension
    check_runs(path)


@pytest.mark.parametrize(("arch", "quant", "ggml_type"), [
    ("qwen3moe", "q4_0", gguf.GGMLQuantizationType.Q4_0),
    ("qwen3moe", "f16", gguf.GGMLQuantizationType.F16),
    ("gpt-oss", "mxfp4", gguf.GGMLQuantizationType.MXFP4),
])
def test_quant_types(tmp_path: Path, arch: str, quant: str, ggml_type: int) -> None:
    path = synth.write_model(tmp_path / "m.gguf", arch=arch, quant=quant, layers=2)
    types = {t.tensor_type for t in _expert_tensors(path).values() if t.name.endswith(".weight")}
    assert types == {ggml_type}
    check_runs(path)


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = synth.write_model(tmp_path / "a.gguf", arch="gpt-oss", seed=3)
    b = synth.write_model(tmp_path / "b.gguf", arch="gpt-oss", seed=3)
    c = synth.write_model(tmp_path / "c.gguf", arch="gpt-oss", seed=4)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.stat().st_size == c.stat().st_size


def test_size_gb_picks_ff(tmp_path: Path) -> None:
    path = synth.write_model(tmp_path / "s.gguf", experts=16, embd=256, size_gb=0.02)
    assert abs(path.stat().st_size - 0.02e9) < 0.001e9
    ff = gguf.GGUFReader(path).fields["qwen3moe.expert_feed_forward_length"]
    assert int(ff.parts[ff.data[0]][0]) % 32 == 0


def test_chat_template_and_end_of_turn(tmp_path: Path) -> None:
    path = synth.write_model(tmp_path / "c.gguf", layers=1)
    llm = plain_llama(path, n_ctx=256)
    assert "<|im_start|>" in llm.metadata["tokenizer.chat_template"]
    im_end = llm.tokenize(b"<|im_end|>", add_bos=False, special=True)
    assert len(im_end) == 1
    assert llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), im_end[0])
    out = llm.create_chat_completion([{"role": "user", "content": "hello there"}], max_tokens=8)
    assert out["choices"][0]["message"]["content"] is not None
    llm.close()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.gguf"
    assert synth.main(["--arch", "olmoe", "--layers", "1", "--experts", "4", "--top-k", "1",
                       "-o", str(out)]) == 0
    assert _n_expert(out, "olmoe") == 4
    with pytest.raises(SystemExit) as exc:
        synth.main(["--help"])
    assert exc.value.code == 0
    assert "examples:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        synth.main(["--ff", "256", "--size-gb", "1", "-o", str(out)])
    with pytest.raises(SystemExit):
        synth.main(["--embd", "100", "-o", str(out)])
    capsys.readouterr()
    for flags, msg in ((["--layers", "0"], "--layers: must be 1 or more"),
                       (["--experts", "many"], "--experts: 'many' is not a whole number"),
                       (["--size-gb", "inf"], "--size-gb: must be a finite number more than 0")):
        with pytest.raises(SystemExit) as exc:
            synth.main([*flags, "-o", str(out)])
        assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_rejects_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="top_k"):
        synth.write_model(tmp_path / "x.gguf", experts=4, top_k=5)
    with pytest.raises(ValueError, match="arch"):
        synth.write_model(tmp_path / "x.gguf", arch="mixtral")
    with pytest.raises(ValueError, match="size-gb"):
        synth.write_model(tmp_path / "x.gguf", size_gb=1e-6)


# --- K-quants and published shapes (issue 29) --------------------------------------------------

@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q8_0", "q4_0", "mxfp4"])
def test_random_blocks_decode_to_the_asked_spread(qtype: str) -> None:
    """gguf-py's own dequantizer (the ggml block layouts) reads back weights of the asked std and
    mean ~0: the scales sit where ggml looks for them and are finite."""
    t = synth_shape.Tensor("w", (64, 1024), qtype, "normal", 0.02)
    blocks = np.concatenate(list(synth_blocks.quantized_chunks(t, np.random.Generator(np.random.SFC64(1)))))
    w = gguf.quants.dequantize(blocks.reshape(-1), synth_shape.GGML_TYPE[qtype])
    assert w.size == 64 * 1024 and np.isfinite(w).all()
    assert abs(w.std() - 0.02) < 0.001 if qtype != "mxfp4" else 0.01 < w.std() < 0.04  # mxfp4: a power of 2
    assert abs(w.mean()) < 0.003


def test_k_scales_pack_as_ggml_reads_them() -> None:
    """The 6-bit scales and mins of block_q4_K/q5_K (get_scale_min_k4), values above 15 included."""
    packed = np.frombuffer(synth_blocks.pack_k_scales(45, 38), np.uint8).reshape(1, 12)
    scale, minimum = gguf.quants.Q4_K.get_scale_min(packed)
    assert scale.tolist() == [[45] * 8] and minimum.tolist() == [[38] * 8]


# Published Q4_K_M sizes, in bytes (sources in synth_like.LIKES): the files users download.
REAL_Q4_K_M = {
    "qwen3-30b-a3b": 17.28 * 2**30,   # 17.28 GiB
    "gemma-4-26b-a4b": 16_413_650_040 + 262144 * 2816 * 210 // 256,  # the trace's layers + Q6_K token_embd
    "gpt-oss-20b": 11.6e9,
    "gpt-oss-120b": 58.46 * 2**30,    # 58.46 GiB
    "qwen3.6-35b-a3b": 21.3e9,         # a same-shape finetune's static Q4_K_M
}


@pytest.mark.parametrize("name", list(REAL_Q4_K_M))
def test_like_is_within_2_percent_of_the_real_file(name: str) -> None:
    plan = synth.plan_model(like=name)
    assert abs(plan.tensor_bytes / REAL_Q4_K_M[name] - 1) < 0.02, (plan.tensor_bytes, REAL_Q4_K_M[name])


def test_likes_without_a_published_q4_k_m() -> None:
    """Where no Q4_K_M of the model has a published size, the table is pinned against what its source
    names instead: the nearest published file (its recipe named) and the parameter count."""
    def plan(name: str) -> synth_shape.Plan:
        return synth.plan_model(like=name)

    flash = plan("qwen3.8-flash-next")
    assert flash.tensor_bytes == 118_448_697_344
    assert synth_like.LIKES["qwen3.8-flash-next"].real_recipe == "UD-Q4_K_XL"
    assert round(100 * (flash.tensor_bytes / 111.3e9 - 1), 1) == 6.4  # unsloth's UD-Q4_K_XL, 111.3 GB
    ple = next(t for t in flash.tensors if t.name == "per_layer_token_embd.weight")
    assert (ple.qtype, ple.nbytes) == ("q5_0", 35_200_168_960)  # 160-wide rows: Q4_K's Q5_0 fallback
    v4 = plan("deepseek-v4-flash")
    assert v4.tensor_bytes == 171_916_194_140
    assert abs(v4.tensor_bytes / (163 * 2**30) - 1) < 0.02  # teamblobfish's Q4_K_M-XL, ~163 GiB
    glm = plan("glm-5.2")
    assert glm.tensor_bytes == 454_542_815_232 and synth_like.LIKES["glm-5.2"].real_bytes == 0
    params = sum(math.prod(t.shape) for t in glm.tensors)
    assert abs(params / 753e9 - 1) < 0.002  # unsloth/GLM-5.2-GGUF's 753B


@pytest.mark.parametrize("name", [n for n, like in synth_like.LIKES.items()
                                  if like.shape.arch in synth_archs.PARTS_ARCHES])
def test_like_table_loads_in_llama_cpp(tmp_path: Path, name: str) -> None:
    """The full-size tables of the architectures only plain llama.cpp runs are what its loader asks
    for: each written sparse (the table, no data: a few MB on disk), loaded with no_alloc (shapes
    checked, nothing read) and given a context (its graphs built and reserved)."""
    path = synth.write_model(tmp_path / f"{name}.gguf", like=name, sparse=True)
    st = path.stat()
    assert 0 <= st.st_size - synth.plan_model(like=name).tensor_bytes < 20e6  # the header
    assert st.st_blocks * 512 < 20e6
    mp = model_params()
    mp.no_alloc, mp.load_mode = True, 0  # no_alloc needs the non-mmap load
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    assert model, name
    try:
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_threads = 256, 256, 2
        ctx = llama_cpp.llama_init_from_model(model, cp)
        assert ctx, name
        llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)
    # what bmoe reads of it: the dense read-ahead leaves out an MTP layer's tensors and a table llama.cpp
    # reads lazily (qwen4exp's 35 GB n-gram table), and "the experts" are those a decode can route to
    files = read_model_files(path)
    shape = synth.plan_model(like=name).shape
    mtp = set(range(shape.layers, shape.layers + shape.mtp))
    assert files.mtp_layers == mtp
    assert {files.layer_of(n) for n in files.expert_names()} == set(range(shape.layers)) - {
        i for i in range(shape.layers) if not shape.is_moe(i)}
    lazy = files.extents.get("per_layer_token_embd.weight")
    assert (lazy is not None and lazy.nbytes > LAZY_MIN_BYTES) == (shape.arch == "qwen4exp")
    spans = file_spans(files)
    read = {n for n, e in files.extents.items()
            if any(fi == e.file_index and off <= e.offset + e.nbytes // 2 < off + n_ for fi, off, n_ in spans)}
    assert read == files.dense_names() and "token_embd.weight" in read
    assert not any(files.layer_of(n) in mtp for n in read)
    assert "per_layer_token_embd.weight" not in read and "per_layer_token_embd.weight" not in files.dense_names()
    assert sum(n for _, _, n in spans) < st.st_size - files.expert_bytes - (lazy.nbytes if lazy else 0) + 50e6


def test_like_tensor_tables() -> None:
    """Names, ggml shapes and types as the real Q4_K_M files have them (579 and 459 tensors)."""
    def table(name: str) -> dict[str, tuple[str, list[int]]]:
        return {t.name: (t.qtype, list(reversed(t.shape))) for t in synth.plan_model(like=name).tensors}

    qwen = table("qwen3-30b-a3b")
    assert len(qwen) == 579
    assert qwen["token_embd.weight"] == ("q4_k", [2048, 151936])
    assert qwen["output.weight"] == ("q6_k", [2048, 151936])
    assert qwen["blk.0.attn_q.weight"] == ("q4_k", [2048, 4096])
    assert qwen["blk.0.attn_k.weight"] == ("q4_k", [2048, 512])
    assert qwen["blk.0.attn_v.weight"] == ("q6_k", [2048, 512])
    assert qwen["blk.7.attn_v.weight"] == ("q4_k", [2048, 512])
    assert qwen["blk.0.ffn_gate_exps.weight"] == ("q4_k", [2048, 768, 128])
    assert qwen["blk.0.ffn_down_exps.weight"] == ("q6_k", [768, 2048, 128])
    assert qwen["blk.7.ffn_down_exps.weight"] == ("q4_k", [768, 2048, 128])
    assert qwen["blk.0.ffn_gate_inp.weight"] == ("f32", [2048, 128])
    oss = table("gpt-oss-20b")
    assert len(oss) == 459
    assert oss["token_embd.weight"] == ("q5_0", [2880, 201088])  # 2880 is not whole 256-blocks
    assert oss["output.weight"] == ("q8_0", [2880, 201088])
    assert oss["blk.0.attn_q.weight"] == ("q5_0", [2880, 4096])
    assert oss["blk.0.attn_output.weight"] == ("q4_k", [4096, 2880])
    assert oss["blk.0.ffn_up_exps.weight"] == ("mxfp4", [2880, 2880, 32])
    assert oss["blk.0.ffn_down_exps.bias"] == ("f32", [2880, 32])
    gemma = table("gemma-4-26b-a4b")
    assert "output.weight" not in gemma and gemma["token_embd.weight"] == ("q6_k", [2816, 262144])
    assert gemma["blk.5.attn_q.weight"] == ("q4_k", [2816, 8192])  # full attention: 16 heads of 512
    assert gemma["blk.5.attn_k.weight"] == ("q4_k", [2816, 1024])
    assert gemma["blk.4.attn_k.weight"] == ("q4_k", [2816, 2048])
    assert gemma["blk.0.ffn_down.weight"] == ("q8_0", [2112, 2816])
    assert gemma["blk.0.ffn_down_exps.weight"] == ("q8_0", [704, 2816, 128])
    assert gemma["blk.7.ffn_down_exps.weight"] == ("q5_0", [704, 2816, 128])
    qwen36 = table("qwen3.6-35b-a3b")
    assert qwen36["blk.0.attn_qkv.weight"] == ("q6_k", [2048, 8192])  # attention-v-like: Q6_K on 'more bits'
    assert qwen36["blk.3.attn_q.weight"] == ("q4_k", [2048, 8192])  # full attention: 16 gated heads of 256
    assert qwen36["blk.3.attn_k.weight"] == ("q4_k", [2048, 512])
    assert qwen36["blk.0.ffn_gate_exps.weight"] == ("q4_k", [2048, 512, 256])
    assert qwen36["blk.0.ffn_down_shexp.weight"] == ("q6_k", [512, 2048])
    assert qwen36["blk.0.ssm_conv1d.weight"] == ("f32", [4, 8192])
    assert sum(name.endswith("attn_qkv.weight") for name in qwen36) == 30
    v4 = table("deepseek-v4-flash")
    assert v4["blk.0.ffn_gate_tid2eid.weight"] == ("i32", [6, 129280])
    assert "blk.3.exp_probs_b.bias" in v4 and "blk.2.exp_probs_b.bias" not in v4  # 3 hash-routed layers
    assert "blk.2.indexer.proj.weight" in v4 and "blk.3.indexer.proj.weight" not in v4  # ratio 4, then 128


# The route traces' headers (../shared/traces), copied: one expert's bytes per layer, and
# gpt-oss-120b's dense bytes (its table reproduces both).
GEMMA_TRACE_EXPERT_BYTES = [4336640] * 7 + [3593216, 3593216, 4336640] * 7 + [3593216, 3593216]
OSS120_TRACE_DENSE_BYTES = [23280128] * 4 + [22727168, 22727168, 23280128] * 9 + [23280128] * 5


def test_like_reproduces_the_traces_bytes() -> None:
    gemma = synth.plan_model(like="gemma-4-26b-a4b")
    assert [gemma.expert_bytes(i) for i in range(30)] == GEMMA_TRACE_EXPERT_BYTES
    oss = synth.plan_model(like="gpt-oss-120b")
    assert [oss.expert_bytes(i) for i in range(36)] == [13219200] * 36
    assert [oss.dense_bytes(i) for i in range(36)] == OSS120_TRACE_DENSE_BYTES


def _trace(path: Path, model: str, layer_bytes: list[int]) -> Path:
    lines = ["# route_trace v1", f"# model=/data/{model}.gguf arch=x n_layer={len(layer_bytes)} "
             f"n_expert=128 n_expert_used=6"]
    lines += [f"# layer={i} expert_bytes={b} dense_bytes=1" for i, b in enumerate(layer_bytes)]
    path.write_text("\n".join([*lines, "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes", ""]))
    return path


def test_like_a_trace(tmp_path: Path) -> None:
    """A known model keeps its table with the trace's top-k; another gets experts of the header's
    bytes at every layer; a header that contradicts its model's table is refused."""
    known = synth.plan_model(like=str(_trace(tmp_path / "g.csv", "google_gemma-4-26B-A4B-it-Q4_K_M",
                                             GEMMA_TRACE_EXPERT_BYTES)))
    assert (known.shape.name, known.shape.top_k) == ("gemma-4-26b-a4b", 6)
    other = synth.plan_model(like=str(_trace(tmp_path / "o.csv", "mystery-moe", GEMMA_TRACE_EXPERT_BYTES)))
    assert [other.expert_bytes(i) for i in range(30)] == GEMMA_TRACE_EXPERT_BYTES
    assert (other.shape.experts, other.shape.top_k) == (128, 6)
    with pytest.raises(ValueError, match="differs from gemma-4-26b-a4b"):
        synth.plan_model(like=str(_trace(tmp_path / "b.csv", "gemma-4-26b-a4b", [3593216] * 30)))
    for name, top_k in (("gemma-4-26b-a4b", 6), ("gpt-oss-120b", 2)):  # the real traces, when present
        real = Path(__file__).resolve().parents[2] / "shared" / "traces" / f"{name}-q4_k_m.route.csv"
        if real.exists():
            assert synth_like.shape_from_trace(real) == replace(synth_like.LIKES[name].shape, top_k=top_k)


def test_like_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert synth.main(["--like", "gpt-oss-120b", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "blk.35.ffn_down_exps.weight" in out and "layer=0 expert_bytes=13219200 dense_bytes=23280128" in out
    with pytest.raises(SystemExit) as exc:
        synth.main(["--like", "qwen3-30b-a3b", "--layers", "2", "-o", str(tmp_path / "x.gguf")])
    assert exc.value.code == 2 and "--like sets the shape; drop --layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        synth.main(["--like", "llama-9000", "--plan"])
    assert "neither a known model" in capsys.readouterr().err


def test_like_with_mtp_is_the_models_mtp_variant(tmp_path: Path) -> None:
    """--like NAME --mtp: one more layer, the MTP one (as the converter's MTP variant of Qwen3.6 has: blk.40 and
    block_count 41), written sparse and loaded by llama.cpp with its MTP layer; a loader without one refuses it."""
    base, mtp = synth.plan_model(like="qwen3.6-35b-a3b"), synth.plan_model(like="qwen3.6-35b-a3b", mtp=True)
    assert (base.shape.mtp, mtp.shape.mtp, mtp.shape.all_layers) == (0, 1, 41)
    names = {t.name for t in mtp.tensors} - {t.name for t in base.tensors}
    assert "blk.40.ffn_down_exps.weight" in names and all(n.startswith("blk.40.") for n in names)
    path = synth.write_model(tmp_path / "q36-mtp.gguf", like="qwen3.6-35b-a3b", mtp=True, sparse=True)
    assert read_model_files(path).mtp_layers == {40}
    mp = model_params(mtp=True)
    mp.no_alloc, mp.load_mode = True, 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    assert model
    try:
        assert (llama_cpp.llama_model_n_layer(model), n_layer_nextn(model)) == (40, 1)  # the trunk's, and the MTP
    finally:
        llama_cpp.llama_model_free(model)
    with pytest.raises(ValueError, match="the qwen3moe loader has no MTP layer"):
        synth.plan_model(like="qwen3-30b-a3b", mtp=True)


def test_small_gemma4_like_loads_and_runs(tmp_path: Path) -> None:
    """The gemma4 table's metadata and tensors are what the pinned llama.cpp needs (bmoe does not
    stream gemma4 yet): the real shape, scaled down to a few MB."""
    small = replace(synth_like.LIKES["gemma-4-26b-a4b"].shape, layers=6, experts=4, top_k=2, embd=256, ff=256,
                    n_head=4, n_head_kv=2, head_dim=64, full_head_dim=128, full_kv_heads=1, dense_ff=256,
                    vocab=0)
    path = tmp_path / "g4.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synth_like.LIKES, "small-gemma4", synth_like.Like(small, 1, "test"))
        synth.write_model(path, like="small-gemma4")
    # through bmoe's loader: llama.cpp's default AMX repacking of quantized attention crashes on
    # this machine's CPU in-process, for llama-quantize's own Q4_K_M files too
    r = run_cli("-m", str(path), "-p", "The quick brown fox", "-n", "4", "-t", "2", "--no-stream")
    assert r.returncode == 0 and "generation: 4 tokens" in r.stdout, r.stderr
