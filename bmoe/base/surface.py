"""A package's public surface, loaded on first use.

Each package's `__init__` names what other packages may use of it and where each name lives;
nothing is imported until a name is first asked for. So importing one light module of a package
(the spec-gate process imports `bmoe.streaming.routers`, an app imports `bmoe.edges.protocol`)
never drags in the package's heavy modules (numpy, llama.cpp, the engine). The `__init__` also
imports the same names under TYPE_CHECKING, so the type checker sees them as they are.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy(package: str, surface: Mapping[str, Sequence[str]]) -> tuple[Callable[[str], Any], list[str]]:
    """(`__getattr__`, `__all__`) for `package` whose surface maps each module to the names it
    gives; a name that is the module's own last part gives the module itself."""
    where = {name: module for module, names in surface.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = importlib.import_module(module)
        return loaded if module.rsplit(".", 1)[-1] == name else getattr(loaded, name)

    return __getattr__, sorted(where)
