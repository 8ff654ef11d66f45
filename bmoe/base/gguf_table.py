"""A GGUF file's scalar metadata and tensor table, read without the rest.

`gguf.GGUFReader` turns every key-value pair into numpy objects, the tokenizer's arrays of tens of
thousands of strings included: seconds before the first token on the 64-expert demo model. What
streaming needs is a few scalar keys and each tensor's name, type, shape and offset; arrays are
skipped by their lengths, so reading the table costs a small fraction of the reader's time
(`python bench/load_time.py -m MODEL --table` measures both; bench/README.md has the report).

The header is read with plain reads that grow until it fits (HEAD, then four times more), with
the kernel's read-ahead off for that descriptor: read through a mapping, a fault pulled in the
device's whole read-ahead window past the header (16 MiB of tensor data on a disk advertising
8 MiB), bytes a streaming start never needs.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type -> struct format of a scalar (GGUF: uint8, int8, uint16, int16, uint32, int32, float32, bool,
# string, array, uint64, int64, float64)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
HEAD = 1 << 20  # bytes read first; a header that needs more is read again, four times larger
MAX_HEAD = 256 << 20  # no real header comes near this (a 256k-token vocabulary is ~10 MB)
Scalar = int | float | str  # a metadata value this reader keeps (bool is an int)


class GGUFError(ValueError):
    """The file is not a GGUF this reader understands, or its header is cut short."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: int  # ggml type
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the data
    nbytes: int


@dataclass(frozen=True)
class GGUFTable:
    fields: dict[str, Scalar]  # scalar and string values; arrays are left out
    tensors: list[TensorInfo]


class _NeedMore(Exception):
    """The header runs past the bytes read so far (not yet past the end of the file)."""


class _Cursor:
    def __init__(self, buf: bytes, order: str, size: int) -> None:
        self.buf, self.pos, self.order, self.size = buf, 0, order, size

    def _short(self, end: int, what: str) -> Exception:
        """Reading up to `end` went past the bytes read: past the file's end (or MAX_HEAD) is an error."""
        if end > self.size or len(self.buf) >= self.size:
            return GGUFError(what)
        if end > MAX_HEAD:
            return GGUFError(f"the header would be larger than {MAX_HEAD >> 20} MiB (at byte {self.pos})")
        return _NeedMore()

    def take(self, fmt: str) -> Any:
        """One value of struct format `fmt` (an int, float or bool, as struct unpacks it)."""
        fmt = self.order + fmt
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise self._short(self.pos + struct.calcsize(fmt), f"the header ends early (at byte {self.pos})") from None
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise self._short(self.pos + n, f"a string of {n} bytes runs past the end of the file (at byte {self.pos})")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        """Step over `count` strings. A tokenizer's vocabulary and merges are 100k-500k of them, so
        the loop stays tight (a method call per string was a visible share of every start)."""
        length = struct.Struct(self.order + "Q").unpack_from
        buf, pos = self.buf, self.pos
        try:
            for _ in range(count):
                pos += 8 + length(buf, pos)[0]
        except struct.error:
            self.pos = pos
            raise self._short(pos + 8, f"the header ends early (at byte {pos})") from None
        self.pos = pos

    def value(self, vtype: int) -> Scalar | None:
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("I"), self.take("Q")
            if etype in _SCALAR:
                self.pos += count * struct.calcsize(self.order + _SCALAR[etype])
            elif etype == _STRING:
                self.skip_strings(count)
            else:
                for _ in range(count):
                    self.value(etype)
            return None
        raise GGUFError(f"unknown value type {vtype} at byte {self.pos}")


def _nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"unknown tensor type {ggml_type}") from None
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def read_table(path: Path) -> GGUFTable:
    """The scalar fields and tensor infos of one GGUF file (GGUFError if it cannot be read as one)."""
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        n = min(size, HEAD)
        while True:
            buf = os.pread(fd, n, 0)
            try:
                return _parse(buf, size)
            except _NeedMore:
                n = min(size, 4 * n)


def _parse(buf: bytes, size: int) -> GGUFTable:
    """The table from the first bytes of a file of `size` bytes; _NeedMore when they are not enough."""
    if len(buf) < 8 or buf[:4] != GGUF_MAGIC:
        raise GGUFError(f"bad magic {bytes(buf[:4])!r}")
    version = struct.unpack_from("<I", buf, 4)[0]
    order = "<" if version & 0xFFFF else ">"  # a big-endian file reads as a huge little-endian version
    c = _Cursor(buf, order, size)
    c.pos = 4
    version = c.take("I")
    if version < 2:
        raise GGUFError(f"GGUF version {version} is too old (2 or later)")
    n_tensors, n_kv = c.take("Q"), c.take("Q")
    fields: dict[str, Scalar] = {}
    for _ in range(n_kv):
        key = c.string()
        v = c.value(c.take("I"))
        if v is not None:
            fields[key] = v
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        shape = tuple(c.take("Q") for _ in range(c.take("I")))
        ggml_type, rel = c.take("I"), c.take("Q")
        infos.append((name, ggml_type, shape, rel))
    align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-c.pos // align) * align
    return GGUFTable(fields, [TensorInfo(n, t, s, start + rel, _nbytes(t, s)) for n, t, s, rel in infos])
