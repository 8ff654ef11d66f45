"""How the coordinator starts a worker process: one command line for every worker (bmoe.workers)."""

from __future__ import annotations

import sys

# Python 3.10 has no -P: the same start through runpy, with the cwd entry `-c` puts first removed
_NO_CWD = ("import runpy, sys; del sys.path[0], sys.argv[0]; "
           "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def command(module: str, *args: str, safe_path: bool = sys.version_info >= (3, 11)) -> list[str]:
    """The command that starts worker `module` (`python -P -m module args`): with a plain `-m` Python
    would put the current directory first on sys.path, so a `bmoe/` folder where the user stands
    would run in the worker instead of the installed package. PYTHONPATH and site-packages (an
    editable install too) still count. `safe_path` False is the form Python 3.10, without -P, gets."""
    if safe_path:
        return [sys.executable, "-P", "-m", module, *args]
    return [sys.executable, "-c", _NO_CWD, module, *args]
