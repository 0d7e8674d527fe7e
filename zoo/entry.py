"""The start of every command: train.py, eval.py, export.py, `python -m amp.report | amp.audit | amp.search`
and the benchmarks.

    from zoo.entry import prepare
    ONEDNN = prepare()                 # a script: first, before anything imports MindSpore
    if __name__ == "__main__":         # a module that is a library too (amp.report): only when run as one
        prepare()
    ...
    if __name__ == "__main__":
        run(main)                      # main(argv); a ConfigError is one `error:` line and exit 2

`prepare` caps oneDNN's ISA as the command line's recipe asks (runtime.onednn_isa; zoo.runtime.cap_onednn_isa
says why) and keeps MindSpore's C++ log lines off the console. Both must happen before `import mindspore`, which
is why nothing else in the project does either at import time.
"""
import os
import sys
from typing import Callable, List, Optional

from zoo import interrupt
from zoo.errors import ConfigError, fail
from zoo.runtime import cap_onednn_isa, quiet_mindspore


def prepare(argv: Optional[List[str]] = None, recipe: Optional[str] = None) -> str:
    """Set up the process for MindSpore from the command line (default sys.argv[1:]; only its key=value
    overrides are read); `recipe`: the recipe a benchmark always runs. Returns the oneDNN note a run records.
    The program itself (called from `__main__` on its own command line) also gets zoo.interrupt's handlers: from
    here on a stop signal is one line and the shell's exit code; a test or tool that imports train.py keeps its own."""
    if argv is None and sys._getframe(1).f_globals.get("__name__") == "__main__":
        interrupt.install()
    argv = sys.argv[1:] if argv is None else list(argv)
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    note = cap_onednn_isa([f"recipe={recipe}", *overrides] if recipe else overrides)
    quiet_mindspore()
    return note


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
