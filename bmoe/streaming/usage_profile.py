"""A model's usage profile: how often each expert was routed, kept between runs for a warm start.

At exit the Engine saves, per model file, the times each (layer, expert) was routed, out of how
many routings of its layer (a decode token, or a prefill batch), added to half the counts the file
held before (recent runs weigh more). At the next start with a cache the profile is read back and
the cache fills from it in the background, most used first (bmoe.streaming.readahead's `fill`), and the cache
policy starts from its frequencies rather than from nothing (`Policy.prior`).

A profile names the model file it was written for: its size, mtime and a hash of its first MiB
(its header, with the tensor table) per shard. One that names another file (the model was replaced
or edited), or that cannot be read whole (a damaged file, another format), is ignored with a notice
and rewritten at exit. The file is JSON, a few tens of KB (48 layers x 128 experts: ~30 KB),
written whole to a temporary file and renamed; the directory keeps the MAX_PROFILES most recent of
bmoe's own profiles: regular files named as `profile_path` names them (`PROFILE_NAME`) that begin
with `MARK` and belong to this user. A user's `my.json` beside them, or another user's profile, is
never removed. Reading one reads MAX_PROFILE_BYTES at most.

A profile is data checked field by field, and all it steers is which experts are read first, so
one is used wherever it lies (a folder others can write included), unlike a prompt-cache entry
(bmoe.generation.prompt_cache), which goes to llama.cpp.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bmoe.base.model_files import ModelFiles
from bmoe.base.user_cache import cache_dir

FORMAT = "bmoe-usage-profile"
VERSION = 1
HEADER_BYTES = 1 << 20  # hashed per shard: the GGUF header and the start of the tensor table
MAX_PROFILES = 64  # profiles kept in a directory; the least recently written go first
MAX_PROFILE_BYTES = 1 << 20
PROFILE_NAME = re.compile(r".+-[0-9a-f]{12}\.json")  # profile_path's names
MARK = json.dumps({"format": FORMAT}, separators=(",", ":"))[:-1].encode()  # how `save` begins every profile


def default_dir() -> Path:
    """$BMOE_USAGE_DIR, else $XDG_CACHE_HOME/bmoe/usage (~/.cache/bmoe/usage), beside the demo model."""
    if os.environ.get("BMOE_USAGE_DIR"):
        return Path(os.environ["BMOE_USAGE_DIR"])
    return cache_dir() / "usage"


def _header_hash(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return hashlib.sha256(os.pread(fd, HEADER_BYTES, 0)).hexdigest()
    finally:
        os.close(fd)


def identity(files: ModelFiles) -> dict:
    """What a profile records of the model file(s): path, and per shard size, mtime and header hash."""
    return {"path": str(files.paths[0].resolve()), "sizes": list(files.sizes), "mtimes": list(files.mtimes),
            "header_sha256": [_header_hash(p) for p in files.paths]}


def profile_path(directory: Path, files: ModelFiles) -> Path:
    """The profile's file: the model's name and a hash of its full path (two copies, two profiles)."""
    p = files.paths[0].resolve()
    return directory / f"{p.stem}-{hashlib.sha256(str(p).encode()).hexdigest()[:12]}.json"


@dataclass
class Usage:
    """Routing counts per MoE layer: `counts[layer][e]` of `routings[layer]`."""

    counts: dict[int, np.ndarray]
    routings: dict[int, int]

    def fill_order(self) -> list[tuple[int, int]]:
        """(layer, expert) of every expert routed at least once, most often routed first (by the
        share of its layer's routings), ties in layer order."""
        ranked = []
        for layer, c in self.counts.items():
            n = self.routings.get(layer, 0)
            if n:
                ranked += [(-int(x) / n, layer, int(e)) for e, x in enumerate(c) if x > 0]
        return [(layer, e) for _, layer, e in sorted(ranked)]

    def frequencies(self) -> dict[tuple[int, int], float]:
        """Each routed expert's share of its layer's routings."""
        return {(layer, int(e)): float(x) / self.routings[layer]
                for layer, c in self.counts.items() if self.routings.get(layer) for e, x in enumerate(c) if x > 0}

    def merged(self, older: Usage | None) -> Usage:
        """This run's counts plus half of `older`'s (layers and experts that match)."""
        if older is None:
            return self
        counts, routings = {}, {}
        for layer, c in self.counts.items():
            o = older.counts.get(layer)
            half = o // 2 if o is not None and len(o) == len(c) else 0
            counts[layer] = c + half
            routings[layer] = self.routings.get(layer, 0) + (older.routings.get(layer, 0) // 2 if o is not None
                                                              and len(o) == len(c) else 0)
        return Usage(counts, routings)

    @property
    def empty(self) -> bool:
        return not any(self.routings.values())


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_profile(path: Path, model: dict, layers: dict[int, int]) -> tuple[Usage | None, str | None]:
    """The profile at `path` for this model (identity `model`, `layers`: layer -> experts), or None
    and why it was ignored (None, None: there is none yet)."""
    if not path.exists():
        return None, None
    what = f"ignoring the usage profile {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PROFILE_BYTES + 1)
        if len(raw) > MAX_PROFILE_BYTES:
            return None, f"{what}: larger than {MAX_PROFILE_BYTES >> 20} MiB, not one bmoe wrote"
        doc = json.loads(raw)
        body = {k: v for k, v in doc.items() if k != "checksum"}
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            return None, f"{what}: not a version-{VERSION} bmoe usage profile"
        if doc.get("checksum") != _checksum(body):
            return None, f"{what}: it is damaged (checksum mismatch)"
        saved = doc["model"]
        for key, name in (("sizes", "size"), ("mtimes", "mtime"), ("header_sha256", "header hash")):
            if saved.get(key) != model[key]:
                return None, f"{what}: it was written for another version of the model file (its {name} differs)"
        counts, routings = {}, {}
        for layer, row in doc["layers"].items():
            layer = int(layer)
            if layer not in layers or len(row["counts"]) != layers[layer]:
                return None, f"{what}: its layers do not match the model's"
            counts[layer] = np.array(row["counts"], dtype=np.int64)
            routings[layer] = int(row["routings"])
            if routings[layer] < 0 or (counts[layer] < 0).any() or (counts[layer] > routings[layer]).any():
                return None, f"{what}: it is damaged (counts out of range)"
        return Usage(counts, routings), None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        return None, f"{what}: it is damaged ({type(e).__name__}: {e})"


def save(path: Path, model: dict, usage: Usage) -> None:
    """Write the profile whole (temporary file, then rename) and drop the oldest beyond MAX_PROFILES."""
    body = {"format": FORMAT, "version": VERSION, "model": model,
            "layers": {str(layer): {"routings": int(usage.routings.get(layer, 0)), "counts": [int(x) for x in c]}
                       for layer, c in sorted(usage.counts.items())}}
    doc = {**body, "checksum": _checksum(body)}  # "format" first: the file begins with MARK
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for _, old in sorted(_own_profiles(path.parent), reverse=True)[MAX_PROFILES:]:
        old.unlink(missing_ok=True)


def _own_profiles(directory: Path) -> list[tuple[float, Path]]:
    """(mtime, path) of each profile bmoe wrote in `directory` as this user (see the module notes)."""
    out = []
    for name in os.listdir(directory):
        if not PROFILE_NAME.fullmatch(name):
            continue
        try:
            fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # gone meanwhile (another process pruned it), or a link
            continue
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and f.read(len(MARK)) == MARK:
                out.append((st.st_mtime, directory / name))
    return out
