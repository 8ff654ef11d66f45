"""Where each expert tensor's bytes live on flash, and checks that the file set is whole."""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from bmoe.base.errors import ModelError
from bmoe.base.gguf_table import GGUF_MAGIC, GGUFError, read_table

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")
EXPERT_TENSOR = re.compile(r"^blk\.\d+\.ffn_\w+_exps\.weight$")
_LAYER = re.compile(r"^blk\.(\d+)\.")
# Tensors the pinned llama.cpp's loader marks TENSOR_READ_LAZY (qwen4exp's n-gram table, gemma's per-layer
# token embeddings): in its default lazy mode (LLAMA_LAZY_MODE_AUTO) one larger than LAZY_MIN_BYTES is
# read row by row as tokens ask for them, never whole.
LAZY_TENSORS = frozenset({"per_layer_token_embd.weight"})
LAZY_MIN_BYTES = 4 << 30  # llama_model_loader::lazy_read::add's auto_min_size


@dataclass(frozen=True)
class TensorExtent:
    file_index: int
    offset: int
    nbytes: int


@dataclass
class ModelFiles:
    paths: list[Path]
    extents: dict[str, TensorExtent]
    arch: str
    n_expert: int
    n_expert_used: int
    sizes: list[int]
    mtimes: list[float]
    # the trailing multi-token-prediction layers (`nextn_predict_layers`): llama.cpp loads them
    # TENSOR_SKIP unless asked to run MTP (llama-cpp-python never does), so no decode reads them
    mtp_layers: frozenset[int] = frozenset()

    @property
    def expert_bytes(self) -> int:
        """The bytes of the experts a decode can route to (an MTP layer's are never read)."""
        return sum(self.extents[n].nbytes for n in self.expert_names())

    def expert_names(self) -> set[str]:
        """The routed experts' tensors llama.cpp computes with (an MTP layer's left out)."""
        return {n for n in self.extents if EXPERT_TENSOR.match(n) and self.layer_of(n) not in self.mtp_layers}

    def dense_names(self) -> set[str]:
        """The other tensors a decode reads through llama.cpp's mapping, whole: neither an expert, nor an
        MTP layer's, nor a table llama.cpp reads lazily (`LAZY_TENSORS` over LAZY_MIN_BYTES)."""
        return {n for n, e in self.extents.items() if e.nbytes and not EXPERT_TENSOR.match(n)
                and self.layer_of(n) not in self.mtp_layers
                and not (n in LAZY_TENSORS and e.nbytes > LAZY_MIN_BYTES)}

    @staticmethod
    def layer_of(name: str) -> int | None:
        m = _LAYER.match(name)
        return int(m.group(1)) if m else None

    def check_unchanged(self, fix: str) -> None:
        """Raise ModelError (ending with `fix`) if a file's size or mtime differs from when it was opened.

        The offset table the lanes read by, and llama.cpp's mapping of the rest of the model,
        describe the file as it was; a file rewritten since then would feed the matmuls other
        bytes than plain llama.cpp loading it now, so the process must load it again.
        """
        for p, size, mtime in zip(self.paths, self.sizes, self.mtimes):
            try:
                st = p.stat()
            except OSError as e:
                raise ModelError(f"model file {p} is gone ({e.strerror}) since it was loaded; {fix}") from e
            if (st.st_size, st.st_mtime) != (size, mtime):
                what = (f"size {size} -> {st.st_size} bytes" if st.st_size != size
                        else f"modified at {time.strftime('%H:%M:%S', time.localtime(st.st_mtime))}")
                raise ModelError(f"model file {p} changed since it was loaded ({what}); {fix}")


_STATX_DIOALIGN = 0x2000
_STATX_SIZE = 256  # struct statx (linux/stat.h); stx_dio_mem_align at 152, stx_dio_offset_align at 156
_libc = ctypes.CDLL(None, use_errno=True)


def dio_alignment(paths: list[Path]) -> int:
    """The alignment direct reads of these files need, of file offset, length and buffer address alike:
    the kernel's own answer (statx STATX_DIOALIGN: often 512 bytes, not a page) where it gives one, else
    a page. A slot whose bytes sit at the file's offset within such a block needs no copy after its read."""
    statx = getattr(_libc, "statx", None)
    if statx is None:
        return mmap.PAGESIZE
    align = 0
    for p in paths:
        buf = ctypes.create_string_buffer(_STATX_SIZE)
        if statx(-100, os.fsencode(p), 0, _STATX_DIOALIGN, buf) != 0:  # AT_FDCWD
            return mmap.PAGESIZE
        mask, mem, off = (int.from_bytes(buf.raw[a:a + 4], "little") for a in (0, 152, 156))
        if not mask & _STATX_DIOALIGN or not mem or not off:
            return mmap.PAGESIZE
        align = max(align, mem, off)
    return align or mmap.PAGESIZE


def split_name(name: str) -> tuple[str, int, int] | None:
    """(stem, shard number, shards) of a split GGUF's name (`stem-0000i-of-0000N.gguf`), else None."""
    m = _SPLIT.match(name)
    return (m.group("stem"), int(m.group("i")), int(m.group("n"))) if m else None


def shard_paths(path: Path) -> list[Path]:
    """All shards of a split GGUF (`-00001-of-0000N.gguf`), or just the file."""
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    n = int(m.group("n"))
    paths = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise ModelError(
            f"split model {path.name} is missing shard(s) {', '.join(missing)}; "
            f"put all {n} shards in {path.parent}"
        )
    return paths


def check_gguf(path: Path) -> None:
    if not path.exists():
        raise ModelError(f"model file {path} does not exist; check the -m path")
    if not path.is_file():
        raise ModelError(f"model path {path} is not a file; pass the .gguf file itself")
    try:
        fd = os.open(path, os.O_RDONLY)
        try:  # four bytes, without the read-ahead a buffered read starts (and that reads on into the tensors)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            magic = os.pread(fd, 4, 0)
        finally:
            os.close(fd)
    except OSError as e:
        raise ModelError(f"cannot read model file {path}: {e.strerror}; check its permissions") from e
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF file (bad magic {magic!r}); convert the model to GGUF first")


def read_model_files(path: str | os.PathLike[str]) -> ModelFiles:
    """Read the offset table of every shard and verify nothing is cut short."""
    first = Path(path)
    check_gguf(first)
    paths = shard_paths(first)
    extents: dict[str, TensorExtent] = {}
    arch, n_expert, n_used = "", 0, 0
    mtp: frozenset[int] = frozenset()
    sizes, mtimes = [], []
    for i, p in enumerate(paths):
        check_gguf(p)
        st = p.stat()
        sizes.append(st.st_size)
        mtimes.append(st.st_mtime)
        try:
            table = read_table(p)
        except GGUFError as e:
            raise ModelError(f"{p} is truncated or corrupt ({e}); re-copy or re-download it") from e
        if i == 0:
            arch = str(table.fields.get("general.architecture") or "")
            n_expert = int(table.fields.get(f"{arch}.expert_count") or 0)
            n_used = int(table.fields.get(f"{arch}.expert_used_count") or 0)
            n_layer = int(table.fields.get(f"{arch}.block_count") or 0)
            n_mtp = int(table.fields.get(f"{arch}.nextn_predict_layers") or 0)
            mtp = frozenset(range(n_layer - n_mtp, n_layer)) if 0 < n_mtp < n_layer else frozenset()
        for t in table.tensors:
            end = t.offset + t.nbytes
            if end > st.st_size:
                raise ModelError(
                    f"{p} is truncated: tensor {t.name} ends at byte {end} but the file has "
                    f"{st.st_size}; re-copy or re-download it"
                )
            extents[t.name] = TensorExtent(i, t.offset, t.nbytes)
    return ModelFiles(paths, extents, arch, n_expert, n_used, sizes, mtimes, mtp)
