"""Prompt KV kept on disk across restarts (`--prompt-cache DIR`, bounded by `--prompt-cache-mb`).

An entry is the KV of one prompt prefix (a chat's system prompt and tools) in one KV sequence,
taken with llama.cpp's state API after its prefill (`llama_state_seq_get_data`, bmoe.seam.llama) and
put back into a sequence instead of prefilling it (`llama_state_seq_set_data`). It is keyed by
the model's identity and the exact tokens; a request uses the longest entry its prompt begins with.

Nothing read back is trusted: a file must have the magic, this model's identity, the tokens it is
looked up by, its full length and the SHA-256 of its payload, and llama.cpp must accept the
payload, or it is ignored with a notice (and removed when it is corrupt or cut short: a damaged
entry costs its prefill, never the start). The header's sizes are checked against the file's before
anything is read by them, and an entry of more tokens than the context is not read at all. Files
of other models are left alone. The folder as a whole stays within the bound: the least recently
used files go first (a file's mtime is its last use). Each file is written under a temporary
name and renamed, so no reader sees half of one.

Only bmoe's own files are read or removed: named as `_key` names them (`ENTRY_NAME`: 40 hex
digits and `.kv`) and starting with the magic; anything else in the folder (a user's `notes.kv`)
is not touched. The hash checks an entry against damage, not against a forger, so the folder and
each entry must be changeable by no other user (bmoe.base.private_files): bmoe.engine.load refuses
a folder that is, and an entry owned or writable by another user is ignored and left alone.

Where a prompt is cut (`cut`, `usable`, `pieces`): saving a prefix means decoding the prompt in
parts, [0, P) and then the rest, where plain llama.cpp decodes it in one call; a restart decodes
only the rest. Either must compute every token exactly as the one call does, or the answers would
differ. A prompt computes as llama.cpp's one call with ubatches of n_ubatch = REGIME_UBATCH (512)
does, cut from its start (bmoe.engine.prompt_calls, which also decodes it in wider calls), and
ggml's CPU kernels are exact per token within a regime the ubatch's size picks: flash attention
takes its tiled kernel for a ubatch of 64 tokens or more (GGML_FA_TILE_Q) and a per-row one below
(and a matmul of one row leaves tinyBLAS). So the rest is decoded as [P, next multiple of n_ubatch)
and then the remainder, which gives every later token the one call's ubatch, and P is taken only
where it cuts its own ubatch into two parts of 64 tokens or more (or falls on a multiple of
n_ubatch). The save point is 64 tokens or more before the end of the prefix, so that any later
prompt sharing the prefix can use it. tests/test_prompt_cache.py pins these facts on llama.cpp.

File layout, little-endian: magic (8) | model identity (32) | n_tokens u32 | payload bytes u64 |
payload SHA-256 (32) | tokens int32 × n_tokens | payload.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from bmoe.base.private_files import changeable_by_others
from bmoe.engine.prompt_calls import FA_TILE, REGIME_UBATCH

if TYPE_CHECKING:
    from bmoe.coordinator import Engine

KV_MAGIC = b"BMOEKV\x00\x01"
_HEAD = struct.Struct("<8s32sIQ32s")
SUFFIX = ".kv"
ENTRY_NAME = re.compile(r"[0-9a-f]{40}\.kv")  # an entry's name (`_key`); no other file in the folder is touched
_SAMPLES = 16  # 4 KiB blocks read from each model file for its identity
_BLOCK = 4096


def model_identity(paths: Sequence[Path], context: str = "") -> bytes:
    """What a KV state depends on, hashed: each model file's size, its GGUF header (metadata and
    tensor table: the first block, as far as the tensor data) and 16 blocks spread over its data;
    `context` adds what else shapes the KV (llama.cpp's build, the KV type)."""
    from bmoe.seam.llama import BINDINGS_VERSION

    h = hashlib.sha256(f"bmoe prompt cache 1|llama-cpp-python {BINDINGS_VERSION}|{context}".encode())
    for p in paths:
        size = p.stat().st_size
        h.update(struct.pack("<Q", size))
        with open(p, "rb") as f:
            h.update(f.read(min(size, 1 << 20)))  # the header, in all but huge vocabularies
            for i in range(_SAMPLES):
                f.seek(size * i // _SAMPLES)
                h.update(f.read(_BLOCK))
    return h.digest()


def usable(p: int, n: int, n_ubatch: int) -> bool:
    """Whether a prompt of `n` tokens decoded as [0, p) and then `pieces(p, n)` computes each token as
    one call does: p a multiple of n_ubatch, or both parts of the ubatch p falls in 64 tokens or more."""
    if not 0 < p < n:
        return False
    a = p % n_ubatch
    return a == 0 or (a >= FA_TILE and n_ubatch - a >= FA_TILE and n - p >= FA_TILE)


def pieces(p: int, n: int, n_ubatch: int) -> list[tuple[int, int]]:
    """The calls that decode [p, n) so that, from the next multiple of n_ubatch on, the ubatches are
    those of one call from 0."""
    edge = -(-p // n_ubatch) * n_ubatch
    return [(p, n)] if edge in (p, n) or edge > n else [(p, edge), (edge, n)]


def cut(n: int, prefix: int, n_ubatch: int) -> int:
    """Where to save a prompt of `n` tokens whose first `prefix` are worth keeping (a system prompt
    and tools): the furthest usable point at least FA_TILE tokens before the prefix ends, so that
    any prompt sharing the prefix can use it; 0 for none."""
    for p in range(min(prefix, n) - FA_TILE, 0, -1):
        if usable(p, n, n_ubatch):
            return p
    return 0


@dataclass(frozen=True)
class KeptPrefix:
    path: Path
    tokens: tuple[int, ...]
    size: int  # bytes on disk


class CorruptEntry(Exception):
    """bmoe's own entry, damaged: it is removed."""


class LeftAlone(Exception):
    """A file under an entry's name that is neither loaded nor removed (not bmoe's, or another user
    could have changed it); the message says why."""


def _open(path: Path) -> BinaryIO:
    """The entry at `path`, open for reading: a regular file (no link followed, no FIFO waited on) that
    no other user can change; LeftAlone otherwise."""
    f = os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb")
    st = os.fstat(f.fileno())
    why = "is not a regular file" if not stat.S_ISREG(st.st_mode) else changeable_by_others(st)
    if why:
        f.close()
        raise LeftAlone(why)
    return f


def _read_head(f: BinaryIO, identity: bytes, max_tokens: int) -> tuple[tuple[int, ...], int, bytes] | None:
    """(tokens, payload length, payload digest) of an open entry, its header's sizes checked against the
    file's before anything is read by them; None for another model's entry or one of more than
    `max_tokens` tokens (left alone); LeftAlone without the magic, CorruptEntry naming a flaw."""
    size = os.fstat(f.fileno()).st_size
    raw = f.read(_HEAD.size)
    if raw[:len(KV_MAGIC)] != KV_MAGIC:
        raise LeftAlone("is not a bmoe prompt-cache file (no magic)")
    if len(raw) < _HEAD.size:
        raise CorruptEntry(f"cut short ({size} bytes)")
    _, ident, n, length, digest = _HEAD.unpack(raw)
    if _HEAD.size + 4 * n + length != size:
        raise CorruptEntry(f"cut short or padded ({size} bytes, the header says {_HEAD.size + 4 * n + length})")
    if ident != identity or n > max_tokens:
        return None
    toks = f.read(4 * n)
    if len(toks) < 4 * n:
        raise CorruptEntry(f"cut short while read ({len(toks)} of {4 * n} bytes of tokens)")
    return tuple(np.frombuffer(toks, "<i4").tolist()), length, digest


class PromptCache:
    """The entries of one model in `folder` (made and checked by bmoe.engine.load; see the module
    notes), of `max_tokens` tokens at most (the context's: a longer one could not be used)."""

    def __init__(self, folder: str | os.PathLike[str], limit_mb: float, identity: bytes, max_tokens: int,
                 notice: Callable[[str], None] = lambda s: None) -> None:
        self.folder = Path(folder)
        self.limit = int(limit_mb * 2**20)
        self.identity = identity
        self.max_tokens = max_tokens
        self.notice = notice
        self.entries: dict[Path, KeptPrefix] = {}
        for p in self._names():
            try:
                with _open(p) as f:
                    head = _read_head(f, identity, max_tokens)
                    size = os.fstat(f.fileno()).st_size
            except LeftAlone as e:
                self.notice(f"prompt cache: {p.name} {e}; ignored and left alone")
                continue
            except CorruptEntry as e:
                self._drop(p, str(e))
                continue
            except OSError:
                continue  # gone meanwhile (another process evicted it)
            if head is not None:
                self.entries[p] = KeptPrefix(p, head[0], size)

    def _names(self) -> list[Path]:
        """The folder's files named as entries, whoever wrote them."""
        return [self.folder / n for n in sorted(os.listdir(self.folder)) if ENTRY_NAME.fullmatch(n)]

    def _drop(self, path: Path, why: str) -> None:
        """Remove an entry of bmoe's (its magic read, no other user able to change it)."""
        self.notice(f"prompt cache: {path.name} is {why}; ignored and removed")
        self.entries.pop(path, None)
        path.unlink(missing_ok=True)

    def _key(self, tokens: Sequence[int]) -> Path:
        h = hashlib.sha256(self.identity + np.asarray(tokens, "<i4").tobytes())
        return self.folder / f"{h.hexdigest()[:40]}{SUFFIX}"

    def match(self, tokens: Sequence[int], shorter_than: int | None = None) -> KeptPrefix | None:
        """The longest entry `tokens` begin with, of fewer than `shorter_than` tokens (default: all of
        them; one token at least must be left to decode, for its logits)."""
        limit = len(tokens) if shorter_than is None else shorter_than
        best = None
        for e in self.entries.values():
            n = len(e.tokens)
            if n < limit and (best is None or n > len(best.tokens)) and tuple(tokens[:n]) == e.tokens:
                best = e
        return best

    def load(self, entry: KeptPrefix) -> bytes | None:
        """The entry's KV state, checked whole; None (with a notice) when it fails a check."""
        try:
            with _open(entry.path) as f:
                head = _read_head(f, self.identity, self.max_tokens)
                if head is None or head[0] != entry.tokens:
                    self.notice(f"prompt cache: {entry.path.name} changed on disk to another model's or prompt's; "
                                "ignored")
                    self.entries.pop(entry.path, None)
                    return None
                payload = f.read(head[1])
        except LeftAlone as e:
            self.notice(f"prompt cache: {entry.path.name} {e}; ignored and left alone")
            self.entries.pop(entry.path, None)
            return None
        except CorruptEntry as e:
            self._drop(entry.path, str(e))
            return None
        except OSError:
            self.entries.pop(entry.path, None)
            return None
        if hashlib.sha256(payload).digest() != head[2]:
            self._drop(entry.path, "corrupt (its checksum does not match)")
            return None
        os.utime(entry.path)  # last use
        return payload

    def refused(self, entry: KeptPrefix) -> None:
        """llama.cpp would not take the entry's state (made by another build or context): forget it."""
        self._drop(entry.path, "not accepted by llama.cpp (another build or context made it)")

    def save(self, tokens: Sequence[int], payload: bytes) -> KeptPrefix | None:
        """Keep `payload`, the KV state of exactly `tokens`; then trim the folder to the bound.
        None when one entry alone would not fit it."""
        path = self._key(tokens)
        if path in self.entries and path.exists():
            os.utime(path)
            return self.entries[path]
        head = _HEAD.pack(KV_MAGIC, self.identity, len(tokens), len(payload), hashlib.sha256(payload).digest())
        body = np.asarray(tokens, "<i4").tobytes()
        size = len(head) + len(body) + len(payload)
        if size > self.limit:
            self.notice(f"prompt cache: the KV of a {len(tokens)}-token prefix ({size / 2**20:.0f} MiB) is over "
                        f"--prompt-cache-mb ({self.limit / 2**20:.0f} MiB); not kept")
            return None
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX + ".part", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(body)
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        entry = self.entries[path] = KeptPrefix(path, tuple(tokens), size)
        self._trim(keep=path)
        return entry

    def _trim(self, keep: Path) -> None:
        """Remove the least recently used entries of the folder (any model's, bmoe's own only) until
        the entries are within the bound."""
        files = []
        for p in self._names():
            try:
                with _open(p) as f:
                    if f.read(len(KV_MAGIC)) != KV_MAGIC:
                        continue
                    st = os.fstat(f.fileno())
            except (LeftAlone, OSError):
                continue
            files.append((st.st_mtime, p, st.st_size))
        total = sum(s for _, _, s in files)
        for _, p, s in sorted(files):
            if total <= self.limit:
                break
            if p == keep:
                continue
            p.unlink(missing_ok=True)
            self.entries.pop(p, None)
            total -= s

    @property
    def bytes(self) -> int:
        """Bytes of this model's entries."""
        return sum(e.size for e in self.entries.values())


class PromptKV:
    """The prompt cache at work on one engine: a prompt's prefix put back into a KV sequence, or
    prefilled there and kept (Generation.begin calls `prefill` for a sequence it emptied)."""

    def __init__(self, engine: Engine, folder: str, limit_mb: float) -> None:
        self.engine = engine
        self.n_ubatch = REGIME_UBATCH
        identity = model_identity(engine.files.paths, f"n_seq={engine.settings.parallel} k={engine.fixed_k}")
        self.store = PromptCache(folder, limit_mb, identity, engine.n_ctx, engine.notice)

    def prefill(self, seq: int, tokens: Sequence[int], prefix: int) -> tuple[int, int, float]:
        """Fill empty sequence `seq` with the start of `tokens`: the longest kept prefix it can use,
        or else (when `prefix`, the tokens worth keeping, allows a cut) the prefix prefilled and kept;
        then up to the next ubatch edge (see the module notes). Returns (tokens the KV holds now,
        tokens decoded here, seconds); what is left, at least one token, is the caller's to decode."""
        from bmoe.seam.llama import seq_state, set_seq_state

        e, n, u = self.engine, len(tokens), self.n_ubatch
        t0 = time.perf_counter()
        held = decoded = 0
        for entry in sorted(self.store.entries.values(), key=lambda x: -len(x.tokens)):
            p = len(entry.tokens)
            if not (usable(p, n, u) and tuple(tokens[:p]) == entry.tokens):
                continue
            payload = self.store.load(entry)
            if payload is None:
                continue
            if set_seq_state(e.context, seq, payload):
                held = p
                break
            self.store.refused(entry)
            e.clear_kv(seq)
        if not held and (p := cut(n, prefix, u)):
            e.prefill(seq, list(tokens[:p]))
            held = decoded = p
            try:
                self.store.save(tokens[:p], seq_state(e.context, seq))
            except OSError as err:
                e.notice(f"prompt cache: cannot write to {self.store.folder} ({err.strerror}); the prefix is not kept")
        if held:
            first = pieces(held, n, u)[0]
            if first[1] < n:
                e.prefill(seq, list(tokens[first[0]:first[1]]))
                decoded += first[1] - first[0]
                held = first[1]
        return held, decoded, time.perf_counter() - t0
