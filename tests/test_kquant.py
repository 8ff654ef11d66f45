"""Gates on K-quant files made the way users get them: llama.cpp's own quantizer, from an f16 model.

A Q4_K_M file mixes types inside one model (Q4_K, Q6_K for some down projections, Q8/F32 for small
tensors), so expert slices of different tensors have different sizes and alignments; IQ4_XS and
Q6_K cover the other block layouts users download. Streamed output must equal plain llama.cpp.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from pathlib import Path

import gguf
import llama_cpp
import pytest

from bmoe.base.model_files import read_model_files
from bmoe.base.units import MiB
from tests.conftest import run_cli, wide

PROMPT = "The ferry crossed the bay twice a day, and the captain knew every rock beneath the water"
FTYPES = {"Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
          "IQ4_XS": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_XS}


@pytest.fixture(scope="module")
def f16(synth) -> Path:
    # K-quant blocks hold 256 values: rows of 256 and 512 quantize without fallbacks
    return synth(arch="qwen3moe", layers=4, experts=8, top_k=2, embd=256, ff=512, quant="f16")


def quantize(src: Path, ftype: str, out: Path) -> Path:
    """llama.cpp's llama_model_quantize, as `llama-quantize SRC OUT TYPE` does it."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize {ftype} failed with {rc}"
    return out


@pytest.mark.parametrize("ftype", wide(list(FTYPES), {"Q4_K_M"}))
def test_kquant_files_stream_exactly(f16: Path, tmp_path: Path, ftype: str) -> None:
    model = quantize(f16, ftype, tmp_path / f"m-{ftype}.gguf")
    types = Counter(gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(model).tensors
                    if t.name.endswith("_exps.weight"))
    assert set(types) & {"Q4_K", "Q6_K", "IQ4_XS"}, f"{ftype} left the experts as {dict(types)}"
    plain = run_cli("-m", str(model), "-p", PROMPT, "-n", "32", "-t", "2", "--no-stream")
    assert plain.returncode == 0, plain.stderr
    third = read_model_files(model).expert_bytes / 3 / MiB
    for flags in (["--cache-mb", "0"], ["--cache-mb", f"{third}", "--force"],
                  ["--cache-mb", f"{third}", "--force", "--no-overlap", "--prefetch", "1"]):
        r = run_cli("-m", str(model), "-p", PROMPT, "-n", "32", "-t", "2", "--io-threads", "2", *flags)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split("\ngeneration:")[0] == plain.stdout.split("\ngeneration:")[0], (ftype, flags)
        assert "moe-stream: read" in r.stdout


def test_q4_k_m_mixes_types_across_expert_tensors(f16: Path, tmp_path: Path) -> None:
    """What makes Q4_K_M the interesting case: not every expert tensor has the same type."""
    model = quantize(f16, "Q4_K_M", tmp_path / "mixed.gguf")
    types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(model).tensors
             if t.name.endswith("_exps.weight")}
    assert len(types) > 1, types


def test_synth_k_quant_model_streams_exactly(synth) -> None:
    """bmoe-synth's own K-quant blocks (--quant q4_k_m: every matrix typed as llama.cpp's Q4_K_M,
    so Q4_K and Q6_K experts, Q5_K/Q8_0 attention, Q6_K output) run in llama.cpp and stream exactly."""
    model = synth(arch="qwen3moe", layers=4, experts=8, top_k=2, embd=256, ff=512, quant="q4_k_m")
    types = Counter(gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(model).tensors
                    if t.name.endswith("_exps.weight"))
    assert types == {"Q4_K": 10, "Q6_K": 2}, types
    plain = run_cli("-m", str(model), "-p", PROMPT, "-n", "32", "-t", "2", "--no-stream")
    assert plain.returncode == 0, plain.stderr
    assert len(set(plain.stdout.split("\ngeneration:")[0].split())) > 8, plain.stdout  # words, not one repeated
    third = read_model_files(model).expert_bytes / 3 / MiB
    for flags in (["--cache-mb", "0"], ["--cache-mb", f"{third}", "--force"]):
        r = run_cli("-m", str(model), "-p", PROMPT, "-n", "32", "-t", "2", "--io-threads", "2", *flags)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split("\ngeneration:")[0] == plain.stdout.split("\ngeneration:")[0], flags
        assert "moe-stream: read" in r.stdout
