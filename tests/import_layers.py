"""bmoe's import graph, read from the source, against its layers (docs/architecture.md).

    python -m tests.import_layers            # layers, modules, edges, climbs, cycles, private imports
    python -m tests.import_layers --edges    # every edge between packages too

A layer may import its own modules and any layer below it; an import into a layer above is a
climb. tests/test_layout.py holds the code to these rules; this prints where it stands.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "bmoe"

# top-down: each layer's packages and modules (a name covers the modules under it)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("edges", ("bmoe", "bmoe.cli", "bmoe.edges", "bmoe.server", "bmoe.tools")),
    ("api", ("bmoe.api",)),
    ("demo", ("bmoe.demo",)),
    ("replay", ("bmoe.replay",)),
    ("generation", ("bmoe.generation",)),
    ("engine", ("bmoe.coordinator", "bmoe.engine")),
    ("chat", ("bmoe.chat",)),
    ("memory", ("bmoe.memory",)),
    ("streaming", ("bmoe.streaming", "bmoe.shm_cache", "bmoe.workers")),
    ("seam", ("bmoe.seam",)),
    ("base", ("bmoe.base",)),
]
EDGES = LAYERS[0][1]
SEAM = "bmoe.seam"


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py")) if p.name != "__main__.py"}


def owner(module: str) -> str:
    """The package or top-level module `module` belongs to, as LAYERS names it."""
    best = ""
    for _, names in LAYERS:
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > len(best):
                best = n
    return best


def layer_of(module: str) -> int:
    top = owner(module)
    return next(i for i, (_, names) in enumerate(LAYERS) if top in names)


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports(path: Path, typing_too: bool = True) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every bmoe import in `path`, at the top or
    inside functions; `if TYPE_CHECKING:` blocks too unless not `typing_too`."""
    out: list[tuple[str, list[str], int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not typing_too:
            return
        if isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "bmoe")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bmoe":
            out.append((node.module, [a.name for a in node.names], node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def graph(typing_too: bool = True) -> dict[str, set[str]]:
    """module -> the bmoe modules it imports (a name that is a submodule counts as that module)."""
    g: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for mod, names, _ in imports(path, typing_too):
            subs = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in MODULES]
            deps.update(subs or ([mod] if mod in MODULES else []))
            if subs and len(subs) < len(names) and mod in MODULES:
                deps.add(mod)
        g[name] = deps - {name}
    return g


def climbs(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, deps in g.items() for b in deps if layer_of(b) < layer_of(a))


def reach(g: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in g[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def cycles(g: dict[str, set[str]]) -> list[str]:
    return sorted(m for m in g if m in reach(g, m))


def private_imports() -> list[str]:
    """`from x import _name` across modules (a module's private names are its own)."""
    return [f"{name}:{line} {mod}.{n}" for name, path in MODULES.items() for mod, names, line in imports(path)
            for n in names if n.startswith("_") and not n.startswith("__")]


def inner_imports_by_edges() -> list[str]:
    """An edge module reaching past a lower package's surface (`from bmoe.base.units import MiB`
    instead of `from bmoe.base import MiB`): edges see only what a package's __init__ names."""
    bad = []
    for name, path in MODULES.items():
        if layer_of(name) != 0:
            continue
        for mod, _, line in imports(path):
            top = owner(mod)
            if mod != top and layer_of(mod) > 0:
                bad.append(f"{name}:{line} {mod}")
    return bad


PACKAGES = sorted(m for m, p in MODULES.items() if p.name == "__init__.py" and m != "bmoe")


def surface(package: str) -> set[str]:
    """The names a package's __init__ exposes: what it imports from bmoe's modules (its own modules,
    imported as such, are not surface names)."""
    names = set()
    for node in ast.parse(MODULES[package].read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bmoe":
            names.update(a.asname or a.name for a in node.names if f"{node.module}.{a.name}" not in MODULES)
    return names


def surface_uses() -> dict[str, set[str]]:
    """package -> the names other packages' modules take through its surface: `from bmoe.x import N`
    and `x.N` after `from bmoe import x` (N not a module of the package); bmoe's own lazy names are
    bmoe.api's."""
    uses: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        alias: dict[str, str] = {}  # local name -> a package it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if node.module in uses and owner(name) != node.module and not name.startswith(node.module + "."):
                        if full not in MODULES and a.name != "*":
                            uses[node.module].add(a.name)
                    if full in uses and not name.startswith(full):
                        alias[a.asname or a.name] = full
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in uses and not name.startswith(a.name) and a.asname:
                        alias[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in alias:
                package = alias[node.value.id]
                if f"{package}.{node.attr}" not in MODULES:
                    uses[package].add(node.attr)
    for node in ast.parse(MODULES["bmoe"].read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            uses["bmoe.api"].update(ast.literal_eval(node.value))
    return uses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.import_layers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--edges", action="store_true", help="list every edge between packages")
    a = ap.parse_args(argv)
    g = graph()
    n_edges = sum(len(d) for d in g.values())
    print(f"{len(MODULES)} modules, {n_edges} import edges (type-checking imports included)")
    for i, (label, names) in enumerate(LAYERS):
        mods = [m for m in MODULES if layer_of(m) == i]
        print(f"  layer {i} {label:<9} {len(mods):>3} modules  {', '.join(names)}")
    between = Counter((owner(a), owner(b)) for a, deps in g.items() for b in deps if owner(a) != owner(b))
    print(f"{sum(between.values())} edges between packages, {len(between)} package pairs")
    if a.edges:
        for (x, y), n in sorted(between.items()):
            print(f"  {x} -> {y}: {n}")
    for title, rows in (("climbs (an import into a layer above)", [f"{x} -> {y}" for x, y in climbs(g)]),
                        ("cycles", cycles(g)), ("private imports across modules", private_imports()),
                        ("edges past a package's surface", inner_imports_by_edges()),
                        ("surface names nobody takes", [f"{p}.{n}" for p, used in surface_uses().items()
                                                        for n in sorted(surface(p) - used)]),
                        ("names taken that a surface lacks", [f"{p}.{n}" for p, used in surface_uses().items()
                                                              for n in sorted(used - surface(p))])):
        print(f"{title}: {len(rows)}")
        for r in rows:
            print(f"  {r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
