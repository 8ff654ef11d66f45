"""bmoe.base.gguf_table reads the same table as gguf's own reader, on every kind of file we stream."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from bmoe.base.errors import ModelError
from bmoe.base.gguf_table import GGUFError, read_table
from bmoe.base.model_files import read_model_files
from bmoe.tools.synth_archs import ARCHES


def reference(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(path)
    tensors = {t.name: (int(t.data_offset), int(t.n_bytes), tuple(int(d) for d in t.shape), int(t.tensor_type))
               for t in r.tensors}
    scalars = {k: f.contents() for k, f in r.fields.items()
               if not k.startswith("GGUF.") and f.types and f.types[0] != gguf.GGUFValueType.ARRAY}
    return tensors, scalars


def check(path: Path) -> None:
    table = read_table(path)
    tensors, scalars = reference(path)
    assert {t.name: (t.offset, t.nbytes, t.shape, t.type) for t in table.tensors} == tensors
    assert table.fields == scalars


@pytest.mark.parametrize("arch,quant", [(a, "q8_0") for a in ARCHES] + [("qwen3moe", "f16"), ("llama", "q4_0"),
                                                                      ("gpt-oss", "mxfp4")])
def test_the_table_equals_ggufs_reader_on_every_architecture(synth, arch: str, quant: str) -> None:
    check(synth(arch=arch, quant=quant, layers=3, experts=8, top_k=2))


def test_the_table_equals_ggufs_reader_on_the_demo_model_and_its_tokenizer_arrays(demo8: Path) -> None:
    check(demo8)  # a real tokenizer: string arrays of 49k entries to skip
    assert read_table(demo8).fields["tokenizer.ggml.model"] == "gpt2"


def test_every_shard_of_a_split_model(tmp_path) -> None:
    from bmoe.tools.synth import write_model

    first = write_model(tmp_path / "split.gguf", layers=6, experts=8, top_k=2, splits=3)
    files = read_model_files(first)
    for p in files.paths:
        check(p)


def test_a_header_cut_short_is_named(synth, tmp_path) -> None:
    path = Path(synth(arch="qwen3moe", layers=3, experts=8, top_k=2))
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    vocab = data.index(b"tokenizer.ggml.tokens")
    # in the fields, in the vocabulary's strings (stepped over in one tight loop), in the tensor infos
    for end in (300, vocab + 200, vocab + 5000, min(t.offset for t in read_table(path).tensors) - 40):
        cut.write_bytes(data[:end])
        with pytest.raises(GGUFError, match=r"ends early|runs past the end"):
            read_table(cut)
    with pytest.raises(ModelError, match=r"cut\.gguf is truncated or corrupt .*; re-copy or re-download it"):
        read_model_files(cut)
