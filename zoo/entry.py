"""The start of every command: train.py, eval.py, export.py, `python -m amp.report | amp.audit | amp.search`
and the benchmarks. A command imports it first, before anything imports MindSpore:

    from zoo.entry import run          # first: a command's start-up
    import mindspore ...
    ...
    if __name__ == "__main__":
        run(main)                      # main(argv); a ConfigError is one `error:` line and exit 2

Importing it is the start-up: it keeps MindSpore's C++ log lines off the console (zoo.runtime.quiet_mindspore),
which works only before MindSpore loads, and, in the program itself, makes Ctrl-C and SIGTERM one line and the
shell's exit code (zoo.interrupt). Only commands import it; importing a library module leaves the process as it
was. oneDNN's ISA cap needs no such place: it is set when a network is built (models.build_model).
"""
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional

from zoo import interrupt
from zoo.errors import ConfigError, fail
from zoo.runtime import quiet_mindspore



def _imported_by_the_program() -> bool:
    """Whether the module importing this one is the program itself (python train.py, python -m amp.report), not a
    test or a tool that imports a command as a library: only the program takes over the stop signals."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("_frozen_importlib", "importlib",
                                                                                __name__)):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__") == "__main__"


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
if _imported_by_the_program():  # from here on a stop signal is one line and the shell's exit code (zoo.interrupt)
    interrupt.install()
    if _shadowed():
        fail(f"{_shadowed()} has the name of one of amp-zoo's own modules, and this folder comes first on the path "
             f"(python -m): rename it (e.g. my_{_shadowed().stem}.py, then AMP_ZOO_PLUGINS=my_{_shadowed().stem})")


def run(main: Callable[[List[str]], object], argv: Optional[List[str]] = None) -> None:
    """main(argv) (default sys.argv[1:]), with bad input reported as one line and exit 2, and a stop signal as
    one line and 128 + its number; -h or --help prints the command's own docstring (its usage) instead."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        try:
            print((sys.modules["__main__"].__doc__ or "").strip(), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader left; no traceback (Python's documented way)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    try:
        main(argv)
    except interrupt.Interrupted as e:
        interrupt.exit_line(e)
    except Exception as e:
        if interrupt.received():  # what the signal cut short (MindSpore may wrap it), not bad input
            interrupt.exit_line(interrupt.Interrupted(interrupt.received()))
        if not isinstance(e, ConfigError):
            raise
        fail(str(e))
    interrupt.finished()
