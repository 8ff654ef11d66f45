"""The layout's rules, checked on the source: imports point one way, tools stay beside the product,
and the light modules stay light (no llama.cpp until a model loads)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "bmoe"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(path: Path, typing_too: bool = False) -> set[str]:
    """bmoe modules a file imports, at the top or inside functions; `if TYPE_CHECKING:` blocks aside
    unless `typing_too`."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not typing_too:
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bmoe":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in MODULES else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in out if m in MODULES}


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}
TYPED_GRAPH = {name: _imports(path, typing_too=True) - {name} for name, path in MODULES.items()}


def _reach(start: str, graph: dict[str, set[str]] = GRAPH) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_import_graph_is_read_from_the_source() -> None:
    """The checks below see real edges (a walker that found none would pass them all)."""
    assert {"bmoe.streamer", "bmoe.settings", "bmoe.seam"} <= GRAPH["bmoe.coordinator"]
    assert "bmoe.session" in GRAPH["bmoe.cli"]  # a lazy import inside main() counts too
    assert "bmoe.streamer" not in GRAPH["bmoe.readahead"], "TYPE_CHECKING imports are not edges"


@pytest.mark.parametrize("graph", ["runtime", "typing"])
def test_no_import_cycles(graph: str) -> None:
    """No module imports itself through others, also not through imports made only for type checking
    (a cycle hidden behind TYPE_CHECKING is still two modules that know each other's insides)."""
    g = GRAPH if graph == "runtime" else TYPED_GRAPH
    cycles = sorted(name for name in g if name in _reach(name, g))
    assert not cycles, f"modules that import themselves through others: {cycles}"


def test_the_api_imports_no_command_line_module() -> None:
    assert not GRAPH["bmoe.api"] & {"bmoe.flags", "bmoe.console", "bmoe.cli", "bmoe.session", "bmoe.server"}


def _product_modules() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text()) for name, path in MODULES.items() if not name.startswith("bmoe.tools")}


def test_no_product_module_reads_another_objects_private_attributes() -> None:
    """`obj._x` only on self or cls: one owner for each piece of state. (`_x_` names are a library's
    protocol, not state: ctypes' `Structure._fields_`.)"""
    bad = []
    for name, tree in _product_modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not node.attr.endswith("_"):
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    bad.append(f"{name}:{node.lineno} .{node.attr}")
    assert not bad, bad


def test_no_error_is_told_apart_by_its_words_or_class_name() -> None:
    """Errors are matched by type (bmoe.errors), never by `"..." in str(e)` or `type(e).__name__ ==`."""
    bad = []
    for name, tree in _product_modules().items():
        for handler in (n for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler) and n.name):
            for node in ast.walk(handler):
                if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn, ast.Eq, ast.NotEq))
                                                         for op in node.ops):
                    for side in (node.left, *node.comparators):
                        text = ast.unparse(side)
                        if text in (f"str({handler.name})", f"type({handler.name}).__name__"):
                            bad.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not bad, bad


def test_the_coordinator_never_imports_the_tools() -> None:
    assert not [m for m in _reach("bmoe.coordinator") if m.startswith("bmoe.tools")]


def test_only_the_model_source_reaches_into_the_tools_for_the_demo_model() -> None:
    """A no-argument run uses the demo model, which bmoe.model_source builds on first use; no other
    product module imports a tool."""
    into_tools = {name: sorted(m for m in deps if m.startswith("bmoe.tools"))
                  for name, deps in GRAPH.items() if not name.startswith("bmoe.tools")}
    assert {name: deps for name, deps in into_tools.items() if deps} == {"bmoe.model_source": ["bmoe.tools.demo"]}


def test_workers_import_only_what_moves_bytes_or_predicts() -> None:
    for worker in ("bmoe.workers.io_lane", "bmoe.workers.spec_gate"):
        assert not _reach(worker) & {"bmoe.coordinator", "bmoe.streamer", "bmoe.expert_cache", "bmoe.cli"}, worker


def test_a_lane_process_starts_without_numpy_or_the_engine() -> None:
    """A lane runs as `python -m bmoe.workers.io_lane`, which imports the bmoe package first: the
    package's API loads on first use, so every lane (4 per start, more on a respawn) skips numpy,
    llama.cpp and the engine; `bmoe.load` and `from bmoe import Model` still work."""
    code = ("import sys, bmoe.workers.io_lane; print(sorted(m for m in ('numpy', 'llama_cpp', 'bmoe.api') "
            "if m in sys.modules)); import bmoe; from bmoe import Model; print(bmoe.load.__module__, Model.__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "bmoe.api Model"]


@pytest.mark.parametrize("module", ["bmoe", "bmoe.api", "bmoe.session_client", "bmoe.protocol", "bmoe.telemetry",
                                    "bmoe.settings", "bmoe.flags", "bmoe.tools.bench"])
def test_light_modules_do_not_load_llama_cpp(module: str) -> None:
    code = f"import sys, {module}; print('llama_cpp' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False", f"importing {module} loads llama.cpp"


def _schema() -> tuple:
    from bmoe.settings import SCHEMA

    return SCHEMA


@pytest.mark.parametrize("entry", _schema(), ids=lambda e: e.name)
def test_every_setting_is_a_flag_of_both_commands_and_a_keyword_of_load(entry) -> None:
    """The three edges come from one declaration in bmoe/settings.py: nothing to forget when a
    setting is added (its flag in bmoe-cli --help and bmoe-server --help, its bmoe.load keyword)."""
    import inspect

    import bmoe
    from bmoe import flags, server
    from bmoe.settings import from_keywords, names

    for help_text in (flags.build_parser().format_help(), server.build_parser().format_help()):
        words = help_text.replace(",", " ").split()
        assert entry.option.flag in words, entry.option.flag
    if entry.name == "model":
        assert "path" in inspect.signature(bmoe.load).parameters  # bmoe.load's first argument
    else:
        assert entry.name in names()
        assert entry.get(from_keywords("m.gguf", **{entry.name: entry.default})) == entry.default
