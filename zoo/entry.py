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


quiet_mindspore()
if _imported_by_the_program():  # from here on a stop signal is one line and the shell's exit code (zoo.interrupt)
    interrupt.install()


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
