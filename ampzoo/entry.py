"""The start of every command: train.py, eval.py, export.py, `python -m amp.report | amp.audit | amp.search`
and the benchmarks. A command imports it first, before anything imports MindSpore:

    from ampzoo.entry import run       # first: a command's start-up
    import mindspore ...
    ...
    if __name__ == "__main__":
        run(main)                      # main(argv) inside the stop-signal handler; errors end in `report`

Importing it is the start-up: it keeps MindSpore's C++ log lines off the console (ampzoo.runtime.quiet_mindspore),
which works only before MindSpore loads, and makes a Ctrl-C while the command's modules import one line and exit
130 (ampzoo.interrupt.hook). The stop signals themselves are the command's to take: `run` takes them for the
command's work (ampzoo.interrupt.handled), and gives them back when it ends. Only commands import this module;
importing a library module leaves the process as it was. oneDNN's ISA cap needs no such place: it is set when a
network is built (ampzoo.engine.network.build_model).
"""
import ampzoo.needs  # noqa: F401  (first: a Python without the zoo's packages gets one line, not a traceback)

import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional

from ampzoo import interrupt
from ampzoo.errors import fail
from ampzoo.report import report
from ampzoo.runtime import quiet_mindspore


def _shadowed() -> Optional[Path]:
    """A file or folder of the user's named like one of the zoo's own packages (models.py, a ampzoo/models/ folder) that
    the import system finds first (`python -m amp.report` puts the current folder first on the path): the zoo
    would import it instead of its own and fail with a traceback, or run the user's code as the zoo's. Its path,
    or None. A plain folder counts too: the editable install finds the zoo's packages after the path's folders."""
    root = Path(__file__).resolve().parent.parent
    for name in sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file()):
        spec = importlib.util.find_spec(name)
        places = [Path(p).resolve() for p in (spec.submodule_search_locations or [])] if spec else []
        if spec is not None and root / name not in places:
            return Path(spec.origin) if spec.origin and not spec.submodule_search_locations else places[0]
    return None


def _command_is_main() -> bool:
    """Whether this process runs one of the zoo's commands (train.py, python -m bench.run), not a test or a
    tool that imports one: only a command's own process takes SIGTERM at start-up."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    root = Path(__file__).resolve().parent.parent
    return bool(path) and Path(path).resolve().is_relative_to(root) and Path(path).resolve().parent != root / "tests"


quiet_mindspore()
sys.excepthook = interrupt.hook
if _command_is_main():
    interrupt.at_start_up()
if _shadowed():  # `python -m amp.report` from a folder holding models.py: the zoo would import the user's file
    fail(f"{_shadowed()} has the name of one of amp-zoo's own modules, and this folder comes first on the path "
         f"(python -m): rename it (e.g. my_{_shadowed().stem}.py, then AMP_ZOO_PLUGINS=my_{_shadowed().stem})")


def run(main: Callable[[List[str]], object], argv: Optional[List[str]] = None) -> None:
    """main(argv) (default sys.argv[1:]) inside the stop-signal handler, with its errors ended by `report`; -h or
    --help prints the docstring of main's module (the command's usage) instead."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        try:
            print((sys.modules[main.__module__].__doc__ or "").strip(), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader left; no traceback (Python's documented way)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    with interrupt.handled():
        try:
            main(argv)
        except BaseException as e:  # noqa: BLE001  (each kind ends as `report` says)
            report(e)
    interrupt.finished()
