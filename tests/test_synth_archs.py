"""The architectures bmoe-synth writes beyond those bmoe streams (issue 39): each loads and runs in the
pinned llama.cpp alone, through its C API and through llama-cpp-python's own Llama, in both expert
layouts where its loader takes both, at a non-K and a K-quant type (with its MTP layer where it has
one), routes different tokens to different experts, and has the parts its architecture has."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from bmoe.tools import synth
from bmoe.tools.synth_archs import FUSED_ARCHES, MTP_ARCHES, PARTS_ARCHES, REFUSED_ARCHES
from tests.conftest import bmoe_segments, run_cli
from tests.plain_llama import with_llama_defaults
from tests.routed_run import PROMPT, check_runs

CASES = ([(arch, "q8_0", False) for arch in PARTS_ARCHES]
         + [(arch, "q4_k_m", False) for arch in PARTS_ARCHES]
         + [(arch, "q8_0", True) for arch in FUSED_ARCHES])

# What each architecture has besides attention and routed experts (its loader requires them): a
# tensor per part, at the first MoE layer L, the layer before it (a dense one where the first are
# dense), the first full-attention layer F or layer 0.
PARTS = {
    "gemma4": ["blk.L.ffn_gate.weight", "blk.L.ffn_down_exps.scale", "blk.L.ffn_gate_inp.scale",
               "blk.F.attn_q.weight", "rope_freqs.weight"],
    "qwen35moe": ["blk.0.attn_qkv.weight", "blk.0.ssm_a", "blk.0.ssm_conv1d.weight", "blk.0.ssm_alpha.weight",
                  "blk.F.attn_q_norm.weight", "blk.L.ffn_gate_inp_shexp.weight", "blk.L.ffn_down_shexp.weight"],
    "qwen3next": ["blk.0.attn_qkv.weight", "blk.0.ssm_ba.weight", "blk.F.attn_q_norm.weight",
                  "blk.L.ffn_gate_inp_shexp.weight", "blk.L.ffn_down_shexp.weight"],
    "qwen4exp": ["output_hc_norm.weight", "blk.0.hc_attn_inject.weight", "blk.0.hc_ffn_down.weight",
                 "blk.0.ssm_alpha.weight", "blk.F.indexer.q_proj.weight", "blk.L.ffn_gate_inp_shexp.weight",
                 "per_layer_token_embd.weight", "blk.0.ple_key.weight", "blk.0.ple_conv1d.weight"],
    "glm4moe": ["blk.0.ffn_gate.weight", "blk.L.exp_probs_b.bias", "blk.L.ffn_down_shexp.weight",
                "blk.0.attn_q.bias"],
    "deepseek2": ["blk.0.ffn_gate.weight", "blk.L.exp_probs_b.bias", "blk.L.ffn_down_shexp.weight",
                  "blk.0.attn_kv_a_mqa.weight", "blk.0.attn_k_b.weight", "blk.0.attn_q_b.weight"],
    "glm-dsa": ["blk.0.ffn_gate.weight", "blk.L.exp_probs_b.bias", "blk.L.ffn_down_shexp.weight",
                "blk.0.attn_k_b.weight", "blk.0.indexer.attn_q_b.weight"],
    "deepseek4": ["blk.0.ffn_gate_tid2eid.weight", "blk.1.exp_probs_b.bias", "blk.0.ffn_down_shexp.weight",
                  "blk.0.hc_ffn_fn.weight", "output_hc_fn.weight", "blk.2.indexer.proj.weight",
                  "blk.3.attn_compressor_kv.weight"],
    "llama4": ["blk.0.ffn_gate.weight", "blk.L.ffn_down_shexp.weight"],
    "lfm2moe": ["blk.0.ffn_gate.weight", "blk.L.exp_probs_b.bias", "blk.0.shortconv.in_proj.weight",
                "blk.F.attn_q_norm.weight", "token_embd_norm.weight"],
    "bailingmoe2": ["blk.0.ffn_gate.weight", "blk.L.exp_probs_b.bias", "blk.L.ffn_down_shexp.weight",
                    "blk.0.attn_qkv.weight"],
    "bailingmoe3": ["blk.0.ffn_gate.weight", "blk.L.exp_probs_b.bias", "blk.L.ffn_down_shexp.weight",
                    "blk.0.ssm_conv1d_q.weight", "blk.0.ssm_f_a.weight", "blk.F.attn_k_b.weight"],
    "minimax-m2": ["blk.L.exp_probs_b.bias", "blk.0.attn_q_norm.weight"],
}


def _field(reader: gguf.GGUFReader, key: str) -> list[int]:
    f = reader.fields[key]
    return [int(f.parts[i][0]) for i in f.data]


@pytest.mark.parametrize(("arch", "quant", "fused"), CASES)
def test_arch_runs_in_plain_llama_cpp_and_routes(tmp_path: Path, arch: str, quant: str, fused: bool) -> None:
    mtp = quant == "q4_k_m" and arch in MTP_ARCHES
    kw = dict(arch=arch, quant=quant, fused=fused, mtp=mtp, embd=256 if quant == "q4_k_m" else 128)
    shape = synth.plan_model(**kw).shape  # type: ignore[arg-type]  # the keywords of plan_model
    path = synth.write_model(tmp_path / f"{arch}.gguf", **kw)  # type: ignore[arg-type]
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    moe = next(i for i in range(shape.layers) if shape.is_moe(i))
    full = next((i for i in range(shape.layers) if shape.is_full(i)), 0)
    for part in PARTS[arch]:
        assert part.replace(".L.", f".{moe}.").replace(".F.", f".{full}.") in names, part
    if moe:  # the layers before the first MoE layer are dense
        assert f"blk.{moe - 1}.ffn_gate_inp.weight" not in names
    gate_up = f"blk.{moe}.ffn_gate_up_exps.weight"
    assert (gate_up in names) == fused and (f"blk.{moe}.ffn_gate_exps.weight" in names) != fused
    assert _field(reader, f"{arch}.block_count") == [shape.layers + mtp]
    if mtp:
        assert f"blk.{shape.layers}.nextn.eh_proj.weight" in names
        assert _field(reader, f"{arch}.nextn_predict_layers") == [1]
    for t in reader.tensors:  # per-expert scales differ, so reading another expert's row shows in the text
        if t.name.endswith("_exps.scale"):
            v = np.asarray(t.data, dtype=np.float32)
            assert (v > 0).all() and len(np.unique(v)) == v.size, t.name
    exps = {t.tensor_type for t in reader.tensors if t.name.endswith("_exps.weight")}
    assert exps == ({gguf.GGMLQuantizationType.Q8_0} if quant == "q8_0" else
                    {gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K})
    check_runs(path, moe, n_gen=16)
    # llama-cpp-python's own Llama, with its defaults (no bmoe): it loads the file and writes text
    assert with_llama_defaults(path, PROMPT, 8).strip()


def test_deepseek4_hash_layers_route_by_the_token(tmp_path: Path) -> None:
    """deepseek4's first layers take each token's experts from ffn_gate_tid2eid, the token's row:
    routing known from the token alone (what a prefetch of those layers can use)."""
    path = synth.write_model(tmp_path / "dsv4.gguf", arch="deepseek4")
    table = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_gate_tid2eid.weight")
    rows = np.asarray(table.data).reshape(-1, int(table.shape[0]))
    assert (np.sort(rows, axis=1)[:, 1:] != np.sort(rows, axis=1)[:, :-1]).all(), "a row repeats an expert"
    tokens, routes = check_runs(path, 0, n_gen=16)
    assert len(routes) == len(tokens)
    assert routes == [tuple(sorted(rows[t])) for t in tokens]


@pytest.mark.parametrize("arch", REFUSED_ARCHES)
def test_an_architecture_bmoe_cannot_stream_is_refused_in_one_line_and_runs_plain(tmp_path: Path, arch: str) -> None:
    """grovemoe, which the pinned llama.cpp runs: its chunk experts are routed by the expert ids divided by
    the group size (a CPY of ffn_moe_topk-L), which the slot remap cannot serve. Decided from the graph at
    load: one line naming the architecture and the missing piece, exit 1, no shared memory left; with
    --no-stream it runs as plain llama.cpp."""
    path = synth.write_model(tmp_path / f"{arch}.gguf", arch=arch)
    assert "blk.0.ffn_gate_chexps.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    before = bmoe_segments()
    r = run_cli("-m", str(path), "-p", PROMPT, "-n", "4", "-t", "2")
    assert r.returncode == 1 and not r.stdout.strip(), (r.stdout, r.stderr)
    err = [line for line in r.stderr.splitlines() if line.startswith("bmoe-cli: error:")]
    assert len(err) == 1 and err[0].startswith(f"bmoe-cli: error: bmoe cannot stream {arch}: its CPY node "), err
    assert "routed expert ids" in err[0] and err[0].endswith("; run it with --no-stream"), err[0]
    assert bmoe_segments() == before
    plain = run_cli("-m", str(path), "-p", PROMPT, "-n", "4", "-t", "2", "--no-stream")
    assert plain.returncode == 0 and plain.stdout.strip(), plain.stderr


def test_arch_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.gguf"
    for flags, msg in ((["--arch", "glm4moe", "--fused-gate-up"], "takes only separate gate and up experts"),
                       (["--arch", "llama4", "--mtp"], "has no MTP layer"),
                       (["--like", "qwen3-30b-a3b", "--mtp"], "the qwen3moe loader has no MTP layer"),
                       (["--like", "qwen3-30b-a3b", "--layers", "2"], "--like sets the shape; drop --layers")):
        with pytest.raises(SystemExit) as exc:
            synth.main([*flags, "-o", str(out)])
        assert exc.value.code == 2 and msg in capsys.readouterr().err
    assert synth.main(["--arch", "qwen3next", "--fused-gate-up", "--plan"]) == 0
    got = capsys.readouterr()
    assert "blk.0.ffn_gate_up_exps.weight" in got.out and "blk.0.ffn_gate_exps.weight" not in got.out
    assert "bmoe cannot stream" not in got.err
    assert synth.main(["--arch", "grovemoe", "--plan"]) == 0
    assert "bmoe cannot stream grovemoe" in capsys.readouterr().err


def test_the_router_norms_written_with_a_spread_are_the_predictors() -> None:
    """bmoe-synth spreads the norm before the router of each architecture whose files need not keep their
    bytes (a trained model's is not all ones), so the spec-gate's norm swap is exercised: the tensors it
    spreads are those the predictor swaps."""
    from bmoe.tools.synth_archs import SCALED_NORMS
    from bmoe.workers.routers import ROUTER_NORM

    assert all(ROUTER_NORM[a] == n for a, n in SCALED_NORMS.items())
    assert set(SCALED_NORMS) | {"gemma4", "qwen4exp", "deepseek4"} == set(PARTS_ARCHES)  # their own router scale / HC
    norms = {t.name: t for t in synth.plan_model(arch="glm4moe").tensors if t.name.endswith("_norm.weight")}
    assert norms["blk.1.post_attention_norm.weight"].fill == "positive"
    assert norms["blk.1.attn_norm.weight"].fill == "ones"
