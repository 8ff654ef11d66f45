"""The layout's rules, checked on the source (docs/architecture.md; `python -m tests.import_layers`
prints where the code stands): imports point down the layers, edges see only package surfaces,
only the seam touches llama.cpp, and the light modules stay light (no llama.cpp until a model loads)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from tests import import_layers as layers

PKG = layers.PKG
MODULES = layers.MODULES
GRAPH = layers.graph(typing_too=False)
TYPED_GRAPH = layers.graph()


def test_the_import_graph_is_read_from_the_source() -> None:
    """The checks below see real edges (a walker that found none would pass them all)."""
    assert {"bmoe.streaming.streamer", "bmoe.engine.load", "bmoe.seam.llama"} <= GRAPH["bmoe.coordinator"]
    assert "bmoe.edges.session" in GRAPH["bmoe.cli"]  # a lazy import inside main() counts too
    assert "bmoe.streaming.streamer" not in GRAPH["bmoe.streaming.readahead"], "TYPE_CHECKING imports are not edges"
    assert "bmoe.chat.grammar" in TYPED_GRAPH["bmoe.coordinator"] - GRAPH["bmoe.coordinator"]


def test_every_module_has_a_layer() -> None:
    assert all(layers.owner(m) for m in MODULES), [m for m in MODULES if not layers.owner(m)]


@pytest.mark.parametrize("graph", ["runtime", "typing"])
def test_no_import_cycles(graph: str) -> None:
    """No module imports itself through others, also not through imports made only for type checking
    (a cycle hidden behind TYPE_CHECKING is still two modules that know each other's insides)."""
    assert not layers.cycles(GRAPH if graph == "runtime" else TYPED_GRAPH)


def test_no_import_climbs_against_the_layers() -> None:
    """edges → api → demo → replay → generation → engine → chat → memory → streaming → seam → base: a module
    imports its own layer or one below (type-checking imports included)."""
    assert not layers.climbs(TYPED_GRAPH)


def test_the_check_sees_a_climb() -> None:
    """The climb check itself: an import from the base up into the engine is one."""
    assert layers.climbs({"bmoe.base.units": {"bmoe.coordinator"}, "bmoe.coordinator": set()}) == \
        [("bmoe.base.units", "bmoe.coordinator")]


def test_no_private_import_across_modules() -> None:
    assert not layers.private_imports()


def test_edges_import_only_package_surfaces() -> None:
    """bmoe-cli, the session, the server and the bench tools take what they use from a package's
    __init__ (its surface), never from a module inside it."""
    assert not layers.inner_imports_by_edges()


def test_only_the_seam_touches_llama_cpp() -> None:
    """`grep -rln llama_cpp bmoe` finds the seam package alone: llama.cpp is reached through it."""
    outside = sorted(str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py")
                     if "llama_cpp" in p.read_text() and not p.is_relative_to(PKG / "seam"))
    assert not outside


def test_the_seam_imports_nothing_above_the_base() -> None:
    for name, deps in TYPED_GRAPH.items():
        if layers.owner(name) == layers.SEAM:
            assert all(layers.owner(d) in (layers.SEAM, "bmoe.base") for d in deps), (name, deps)


def test_only_the_api_door_makes_an_engine() -> None:
    """Every edge gets its Model from bmoe.api.open_model, the one place that writes `Engine(`."""
    makers = sorted(name for name, path in MODULES.items() if re.search(r"\bEngine\(", path.read_text()))
    assert makers == ["bmoe.api.model"]


def test_edges_read_the_load_through_the_model_and_its_stats() -> None:
    """No edge reaches a Model's `.engine` (nor, through it, the Streamer): what edges print comes
    from `Model.stats.engine` (an EngineStats), what they ask from Model's methods."""
    bad = []
    for name, path in MODULES.items():
        if layers.layer_of(name) != 0:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "engine" and not (
                    isinstance(node.value, ast.Attribute) and node.value.attr == "stats"):
                bad.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not bad, bad


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
    """Errors are matched by type (bmoe.base.errors), never by `"..." in str(e)` or `type(e).__name__ ==`."""
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


def test_workers_import_only_what_moves_bytes_or_predicts() -> None:
    for worker in ("bmoe.workers.io_lane", "bmoe.workers.spec_gate"):
        heavy = {"bmoe.coordinator", "bmoe.streaming.streamer", "bmoe.streaming.expert_cache", "bmoe.cli"}
        assert not layers.reach(GRAPH, worker) & heavy, worker


def test_a_lane_process_starts_without_numpy_or_the_engine() -> None:
    """A lane runs as `python -P -m bmoe.workers.io_lane`, which imports the bmoe package first: the
    package's API loads on first use, so every lane (4 per start, more on a respawn) skips numpy,
    llama.cpp and the engine; `bmoe.load` and `from bmoe import Model` still work."""
    code = ("import sys, bmoe.workers.io_lane; print(sorted(m for m in ('numpy', 'llama_cpp', 'bmoe.api') "
            "if m in sys.modules)); import bmoe; from bmoe import Model; print(bmoe.load.__module__, Model.__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "bmoe.api.model Model"]


@pytest.mark.parametrize("module", ["bmoe", "bmoe.api", "bmoe.edges.session_client", "bmoe.edges.protocol",
                                    "bmoe.base.telemetry",
                                    "bmoe.base.settings", "bmoe.edges.flags", "bmoe.tools.bench",
                                    "bmoe.tools.bench_quality_run"])
def test_light_modules_do_not_load_llama_cpp(module: str) -> None:
    code = f"import sys, {module}; print('llama_cpp' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False", f"importing {module} loads llama.cpp"


def _schema() -> tuple:
    from bmoe.base.settings import SCHEMA

    return SCHEMA


@pytest.mark.parametrize("entry", _schema(), ids=lambda e: e.name)
def test_every_setting_is_a_flag_of_both_commands_and_a_keyword_of_load(entry) -> None:
    """The three edges come from one declaration in bmoe/base/settings.py: nothing to forget when a
    setting is added (its flag in bmoe-cli --help and bmoe-server --help, its bmoe.load keyword)."""
    import inspect

    import bmoe
    from bmoe.base.settings import from_keywords, names
    from bmoe.edges import flags
    from bmoe.server import main as server

    for help_text in (flags.build_parser().format_help(), server.build_parser().format_help()):
        words = help_text.replace(",", " ").split()
        assert entry.option.flag in words, entry.option.flag
    if entry.name == "model":
        assert "path" in inspect.signature(bmoe.load).parameters  # bmoe.load's first argument
    else:
        assert entry.name in names()
        assert entry.get(from_keywords("m.gguf", **{entry.name: entry.default})) == entry.default


def test_only_the_top_package_loads_its_names_lazily() -> None:
    """Below `bmoe` a package's __init__ is its docstring and the imports of what it exposes, each name
    written once: no lazy table, no __all__, no second list for the type checker."""
    bad = []
    for package in layers.PACKAGES:
        body = ast.parse(MODULES[package].read_text()).body
        for node in body[1:] if body and isinstance(body[0], ast.Expr) else body:
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bmoe"):
                bad.append(f"{package}:{node.lineno} {ast.unparse(node)[:60]}")
    assert not bad, bad


def test_each_surface_offers_exactly_what_other_packages_take_from_it() -> None:
    """A package exposes a name only when another package takes it through the package, and every name
    taken that way is exposed (the check sees both `from bmoe.x import N` and `x.N`)."""
    uses = layers.surface_uses()
    assert {p: sorted(layers.surface(p) - used) for p, used in uses.items() if layers.surface(p) - used} == {}
    assert {p: sorted(used - layers.surface(p)) for p, used in uses.items() if used - layers.surface(p)} == {}


def test_the_surface_check_sees_a_name_nobody_takes_and_one_taken_past_it() -> None:
    """The check itself: api's `open_model` is taken (bmoe-cli), `base.Settings` too; a surface that
    dropped one of them would be missing what a user takes."""
    uses = layers.surface_uses()
    assert "open_model" in uses["bmoe.api"] and "Settings" in uses["bmoe.base"]
    assert "Ask" in uses["bmoe.api"], "bmoe's lazy names count as taken from bmoe.api"


def test_every_name_bmoe_offers_is_the_apis() -> None:
    """`bmoe.NAME` loads bmoe.api on first use and hands over its NAME: each one resolves to the same object."""
    import bmoe
    import bmoe.api

    for name in bmoe.__all__:
        assert getattr(bmoe, name) is getattr(bmoe.api, name), name


# a command's entry point and its parser: each command module has its own, by the console-script convention
COMMAND_NAMES = {"main", "build_parser"}


def _public_definitions() -> dict[str, list[str]]:
    """Public module-level names (classes, functions, assignments) -> the product modules defining them."""
    out: dict[str, list[str]] = {}
    for name, tree in _product_modules_and_tools().items():
        if MODULES[name].name == "__init__.py":
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                continue
            for n in names:
                if not n.startswith("_"):
                    out.setdefault(n, []).append(name)
    return out


def _product_modules_and_tools() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def test_no_two_modules_define_the_same_public_name() -> None:
    """One name per thing, one thing per name: a public name is defined in one module (the same thing
    used elsewhere is imported from there), except each command's `main` and `build_parser`."""
    twice = {n: where for n, where in _public_definitions().items() if len(where) > 1 and n not in COMMAND_NAMES}
    assert twice == {}


def test_the_name_check_sees_a_twin() -> None:
    defs = _public_definitions()
    assert defs["Settings"] == ["bmoe.base.settings"] and len(defs["main"]) > 2
    assert "bmoe.engine.load" in defs["load_engine"]


def test_no_two_files_share_a_name() -> None:
    """A file's name says what it holds, so no two do (`__init__.py` and `__main__.py` aside)."""
    names = [p.name for p in PKG.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_no_product_file_is_over_600_lines() -> None:
    """A file that grew past 600 lines holds more than one job: split it by job (docs/architecture.md)."""
    files = [p for p in PKG.rglob("*") if p.is_file() and p.suffix in (".py", ".c", ".js", ".css", ".html")]
    assert len(files) > 100
    assert {str(p.relative_to(PKG)): n for p in files if (n := len(p.read_text().splitlines())) > 600} == {}


def test_each_synth_architecture_is_a_module_of_its_own() -> None:
    """bmoe-synth's architectures are one module each under bmoe/tools/archs (each registers one Arch, in
    at most 150 lines), and neither the registry nor the shared parts name one: adding an architecture
    is one new file (with its router norm in bmoe.workers.routers and its row in docs/architectures.md)."""
    from bmoe.tools import synth_archs

    modules = [p for p in (PKG / "tools" / "archs").glob("*.py") if p.name != "__init__.py"]
    assert len(modules) == len(synth_archs.SYNTH_ARCHES) == len(synth_archs.REGISTRY)
    assert {p.name: n for p in modules if (n := len(p.read_text().splitlines())) > 150} == {}
    assert all(p.read_text().count("register(Arch(") == 1 for p in modules)
    shared = "".join((PKG / "tools" / f"{m}.py").read_text() for m in ("synth_archs", "synth_parts"))
    assert [a for a in synth_archs.SYNTH_ARCHES if f'"{a}"' in shared] == []
