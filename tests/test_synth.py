"""bmoe-synth models must load and run in real llama.cpp, route tokens to varying experts, and be
reproducible byte for byte: the streaming tests elsewhere build on all three."""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest

from bmoe.seam.llama import new_context
from bmoe.tools import synth

PROMPT = "The quick brown fox jumps over the lazy dog, then it runs far away into the dark forest."
N_GEN = 32
TOPK_NODE = b"ffn_moe_topk-0"  # routing ids of layer 0, [n_expert_used, n_tokens] int32


class _GgmlTensor(ctypes.Structure):
    """Public `struct ggml_tensor` (ggml/include/ggml.h), enough to read a node's ids."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class _Run:
    """Greedy decode through llama.cpp's C API, recording layer 0's expert choice per token."""

    def __init__(self, path: Path) -> None:
        llama_cpp.llama_backend_init()
        self.routes: list[tuple[int, ...]] = []
        self._cb = llama_cpp.ggml_backend_sched_eval_callback(self._on_node)
        self.model = llama_cpp.llama_model_load_from_file(
            str(path).encode(), llama_cpp.llama_model_default_params())
        assert self.model, f"llama.cpp refused {path}"
        self.ctx = new_context(self.model, 256, threads=2, eval_cb=self._cb)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def _on_node(self, t: int, ask: bool, _user: int) -> bool:
        node = _GgmlTensor.from_address(t)
        if ask:
            return node.name == TOPK_NODE
        k, n_tokens, row = node.ne[0], node.ne[1], node.nb[1]
        for j in range(n_tokens):  # a strided view of the argsort: rows are nb[1] apart
            ids = (ctypes.c_int32 * k).from_address(node.data + j * row)
            self.routes.append(tuple(sorted(ids)))
        return True

    def tokenize(self, text: str, add_bos: bool) -> list[int]:
        data = text.encode()
        buf = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, len(buf), add_bos, False)
        assert n >= 0
        return list(buf[:n])

    def detokenize(self, tokens: list[int]) -> str:
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        buf = ctypes.create_string_buffer(64 * len(tokens) + 64)
        n = llama_cpp.llama_detokenize(self.vocab, arr, len(tokens), buf, len(buf), False, False)
        assert n >= 0
        return buf.raw[:n].decode("utf-8", errors="replace")

    def decode(self, tokens: list[int]) -> np.ndarray:
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        batch = llama_cpp.llama_batch_get_one(arr, len(tokens))
        assert llama_cpp.llama_decode(self.ctx, batch) == 0
        logits = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).copy()


def _check_runs(path: Path) -> list[int]:
    """Load, prefill PROMPT, greedily generate N_GEN tokens; return the generated ids."""
    run = _Run(path)
    try:
        prompt = run.tokenize(PROMPT, add_bos=True)
        assert len(prompt) >= 13 and prompt[0] == llama_cpp.llama_vocab_bos(run.vocab)
        assert run.detokenize(prompt[1:]) == PROMPT  # llama.cpp drops the SPM space prefix
        logits = run.decode(prompt)
        n_prefill_routes = len(run.routes)
        assert n_prefill_routes == len(prompt)
        generated = []
        for _ in range(N_GEN):
            assert np.isfinite(logits).all()
            generated.append(int(np.argmax(logits)))
            logits = run.decode(generated[-1:])
        assert np.isfinite(logits).all()
        text = run.detokenize(generated)
        assert text.strip()
        assert run.detokenize(run.tokenize(text, add_bos=False)) == text
        assert len(set(generated)) > N_GEN // 2, "greedy decoding is stuck on a few tokens"
        decode_routes = run.routes[n_prefill_routes:]
        assert len(decode_routes) == N_GEN
        assert len(set(decode_routes)) > 2, "the router picks the same experts for every token"
    finally:
        run.close()
    return generated


def _expert_tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    reader = gguf.GGUFReader(path)
    return {t.name: t for t in reader.tensors if "_exps." in t.name}


def _n_expert(path: Path, arch: str) -> int:
    field = gguf.GGUFReader(path).fields[f"{arch}.expert_count"]
    return int(field.parts[field.data[0]][0])


@pytest.mark.parametrize("arch", synth.ARCHES)
def test_every_arch_loads_generates_and_routes(tmp_path: Path, arch: str) -> None:
    path = synth.write_model(tmp_path / f"{arch}.gguf", arch=arch, layers=2, seed=1)
    assert _n_expert(path, arch) == 8
    experts = _expert_tensors(path)
    for layer in range(2):
        for kind in ("gate", "up", "down"):
            t = experts[f"blk.{layer}.ffn_{kind}_exps.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
            assert t.shape[-1] == 8  # ggml order: the expert index is the last dimension
    _check_runs(path)


@pytest.mark.parametrize(("arch", "quant", "ggml_type"), [
    ("qwen3moe", "q4_0", gguf.GGMLQuantizationType.Q4_0),
    ("qwen3moe", "f16", gguf.GGMLQuantizationType.F16),
    ("gpt-oss", "mxfp4", gguf.GGMLQuantizationType.MXFP4),
])
def test_quant_types(tmp_path: Path, arch: str, quant: str, ggml_type: int) -> None:
    path = synth.write_model(tmp_path / "m.gguf", arch=arch, quant=quant, layers=2)
    types = {t.tensor_type for t in _expert_tensors(path).values() if t.name.endswith(".weight")}
    assert types == {ggml_type}
    _check_runs(path)


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
    llm = llama_cpp.Llama(str(path), n_ctx=256, verbose=False)
    assert "<|im_start|>" in llm.metadata["tokenizer.chat_template"]
    im_end = llm.tokenize(b"<|im_end|>", add_bos=False, special=True)
    assert len(im_end) == 1
    assert llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), im_end[0])
    out = llm.create_chat_completion([{"role": "user", "content": "hello there"}], max_tokens=8)
    assert out["choices"][0]["message"]["content"] is not None


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
