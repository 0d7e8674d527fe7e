"""The start of every command: train.py, eval.py, export.py, `python -m amp.report | amp.audit | amp.search`
and the benchmarks. A command imports it first, before anything imports MindSpore:

    from zoo.entry import run          # first: a command's start-up
    import mindspore ...
    ...
    if __name__ == "__main__":
        run(main)                      # main(argv) inside the stop-signal handler; errors end in `report`

Importing it is the start-up: it keeps MindSpore's C++ log lines off the console (zoo.runtime.quiet_mindspore),
which works only before MindSpore loads, and makes a Ctrl-C while the command's modules import one line and exit
130 (zoo.interrupt.hook). The stop signals themselves are the command's to take: `run` takes them for the
command's work (zoo.interrupt.handled), and gives them back when it ends. Only commands import this module;
importing a library module leaves the process as it was. oneDNN's ISA cap needs no such place: it is set when a
network is built (models.build_model).
"""
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional

from zoo import interrupt
from zoo.errors import fail
from zoo.report import report
from zoo.runtime import quiet_mindspore


def _shadowed() -> Optional[Path]:
    """A file or package of the user's in the current folder named like one of the zoo's own top-level modules
    (models.py, data/): `python -m amp.report` from that folder puts it first on the path, so the zoo would import
    it instead of its own and fail with a traceback, or run the user's code as the zoo's. Its path, or None."""
    root, cwd = Path(__file__).resolve().parent.parent, Path.cwd().resolve()
    first = [Path(p or ".").resolve() for p in sys.path]
    if cwd == root or cwd not in first or root in first[: first.index(cwd)]:
        return None
    ours = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()} | {p.stem for p in root.glob("*.py")}
    found = [cwd / f"{n}.py" for n in ours if (cwd / f"{n}.py").is_file()] + [cwd / n for n in ours
                                                                            if (cwd / n / "__init__.py").is_file()]
    return sorted(found)[0] if found else None


quiet_mindspore()
sys.excepthook = interrupt.hook
if _shadowed():  # `python -m amp.report` from a folder holding models.py: the zoo would import the user's file
    fail(f"{_shadowed()} has the name of one of amp-zoo's own modules, and this folder comes first on the path "
         f"(python -m): rename it (e.g. my_{_shadowed().stem}.py, then AMP_ZOO_PLUGINS=my_{_shadowed().stem})")


def run(main: Callable[[List[str]], object], argv: Optional[List[str]] = None) -> None:
    """main(argv) (default sys.argv[1:]) inside the stop-signal handler, with its errors ended by `report`; -h or
    --help prints the command's own docstring (its usage) instead."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        try:
            print((sys.modules["__main__"].__doc__ or "").strip(), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader left; no traceback (Python's documented way)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    with interrupt.handled():
        try:
            main(argv)
        except BaseException as e:  # noqa: BLE001  (each kind ends as `report` says)
            report(e)
    interrupt.finished()
