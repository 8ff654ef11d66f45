"""Models by name: `-hf ORG/REPO[:QUANT]` → a GGUF (every shard of a split one) in huggingface_hub's cache.

Everything that touches the network is huggingface_hub's (the `hf` extra): its standard cache
(`HF_HOME`, `HF_HUB_CACHE`), its progress bars on stderr, `HF_TOKEN` for private and gated
repositories, `HF_ENDPOINT` for a mirror, `HF_HUB_OFFLINE=1` for no network at all. A dropped
connection is resumed where it broke (an HTTP Range request) a few times within the run; a
download killed outright starts that file over next time (huggingface_hub writes each attempt to
a file of its own). A file already in the cache is not fetched again, and when the hub cannot be
reached the cache alone answers.

Which file: QUANT is matched, case-insensitively, against the GGUF names (and folders) of the
repository as a whole word of the name (`Q4_K` is not `Q4_K_M`); without QUANT a repository of
one model takes it, else Q4_K_M (llama.cpp's default), else the error lists what there is.
Multimodal projectors (`mmproj`) are never the model.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from bmoe.base.errors import ConfigError
from bmoe.base.model_files import split_name

DEFAULT_QUANT = "Q4_K_M"
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
FIX_NAME = "give -hf ORG/REPO or ORG/REPO:QUANT, e.g. -hf unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M"


@dataclass(frozen=True)
class HubRef:
    repo: str
    quant: str | None = None

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else "")


def parse(text: str) -> HubRef:
    """`ORG/REPO[:QUANT]` → HubRef; ConfigError when it is not one."""
    repo, _, quant = text.strip().partition(":")
    if not _REPO.match(repo) or (_ and not quant):
        raise ConfigError(f"-hf {text!r} is not a model name; {FIX_NAME}")
    return HubRef(repo, quant or None)


def _models(files: Iterable[str]) -> dict[str, list[str]]:
    """The repository's GGUF models: a name for each → its files (a split model's shards in order)."""
    out: dict[str, list[str]] = defaultdict(list)
    for f in sorted(files):
        name = f.rsplit("/", 1)[-1]
        if not name.lower().endswith(".gguf") or "mmproj" in name.lower():
            continue
        split = split_name(f)
        out[split[0] if split else f[:-5]].append(f)
    return dict(out)


def _quant_matches(quant: str, model: str) -> bool:
    return re.search(rf"(?:^|[-._/]){re.escape(quant)}(?=$|[-./])", model, re.I) is not None


def pick(files: Iterable[str], ref: HubRef) -> list[str]:
    """The files of the model `ref` names among a repository's `files`; ConfigError naming what
    there is when none or several fit, or when a split model lacks a shard."""
    models = _models(files)
    if not models:
        raise ConfigError(f"{ref.repo} holds no .gguf model; -hf takes a repository of GGUF files")
    have = ", ".join(sorted(models))
    if ref.quant:
        fits = [m for m in models if _quant_matches(ref.quant, m)]
        if not fits:
            raise ConfigError(f"{ref.repo} has no {ref.quant} model; it has: {have} (name one of their quants "
                              f"after the colon, -hf {ref.repo}:QUANT)")
    else:
        fits = list(models) if len(models) == 1 else [m for m in models if _quant_matches(DEFAULT_QUANT, m)]
        if not fits:
            raise ConfigError(f"{ref.repo} has several models and no {DEFAULT_QUANT}: {have}; choose one with "
                              f"-hf {ref.repo}:QUANT")
    if len(fits) > 1:
        raise ConfigError(f"-hf {ref} fits several models of {ref.repo}: {', '.join(fits)}; name the quant exactly")
    chosen = models[fits[0]]
    split = split_name(chosen[0])
    if split:
        want = [f"{split[0]}-{i:05d}-of-{split[2]:05d}.gguf" for i in range(1, split[2] + 1)]
        missing = sorted(set(want) - set(chosen))
        if missing:
            raise ConfigError(f"{ref.repo}: the split model {fits[0]} lacks {', '.join(missing)}")
        chosen = want
    return chosen


def _hub() -> ModuleType:
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError("-hf needs huggingface_hub; install the hf extra: pip install 'bmoe[hf]'") from None
    return huggingface_hub


def fetch(ref: HubRef, notice: Callable[[str], None] = lambda s: None) -> Path:
    """The model `ref` names, downloaded into huggingface_hub's cache unless it is there: the path of
    its (first) GGUF file. ConfigError with the fix when it cannot be had."""
    hf = _hub()
    from huggingface_hub import constants, errors

    endpoint = constants.ENDPOINT
    try:
        if constants.is_offline_mode():
            return _cached(ref, "HF_HUB_OFFLINE is set")
        try:
            info = hf.HfApi().model_info(ref.repo)
        except (errors.GatedRepoError, errors.RepositoryNotFoundError) as e:
            raise _not_found(ref, endpoint, gated=isinstance(e, errors.GatedRepoError)) from None
        except errors.HfHubHTTPError as e:
            if e.response.status_code < 500:
                raise ConfigError(f"{ref.repo}: {endpoint} answered {_first_line(e)}; check HF_TOKEN and the "
                                  "name") from None
            return _cached(ref, f"{endpoint} is failing ({_first_line(e)})")
        except (errors.HTTPError, OSError) as e:  # no connection
            return _cached(ref, f"{endpoint} cannot be reached ({_first_line(e)})")
        files = pick([s.rfilename for s in info.siblings or ()], ref)
        notice(f"{ref}: {', '.join(files)} from {endpoint} into {constants.HF_HUB_CACHE}")
        paths = [hf.hf_hub_download(ref.repo, f, revision=info.sha) for f in files]  # a progress bar each
        return Path(paths[0])
    except errors.LocalEntryNotFoundError as e:
        raise ConfigError(f"{ref}: not in the cache and {_first_line(e)}; connect to download it") from None
    except (errors.HTTPError, OSError) as e:
        raise ConfigError(f"{ref}: the download failed ({_first_line(e)}); run the command again to resume") from None


def _cached(ref: HubRef, why: str) -> Path:
    """The model from the cache alone (no network)."""
    from huggingface_hub import scan_cache_dir

    try:
        repos = [r for r in scan_cache_dir().repos if r.repo_id == ref.repo and r.repo_type == "model"]
    except Exception:  # noqa: BLE001 - no cache folder yet, or an unreadable one: nothing cached
        repos = []
    revisions = sorted((rev for r in repos for rev in r.revisions), key=lambda rev: ("main" not in rev.refs,
                                                                                    -rev.last_modified))
    for rev in revisions:
        names = {str(f.file_path.relative_to(rev.snapshot_path)) for f in rev.files}
        try:
            files = pick(names, ref)
        except ConfigError:
            continue
        return Path(rev.snapshot_path) / files[0]
    raise ConfigError(f"{ref} is not in the cache and {why}; connect (or unset HF_HUB_OFFLINE) to download it")


def _not_found(ref: HubRef, endpoint: str, gated: bool) -> ConfigError:
    if gated:
        return ConfigError(f"{ref.repo} is gated: accept its terms on {endpoint} and set HF_TOKEN to a token of "
                           "that account")
    return ConfigError(f"{ref.repo}: no such model repository on {endpoint}; check the name (private ones need "
                       "HF_TOKEN)")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
