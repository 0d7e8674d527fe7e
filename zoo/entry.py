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
from typing import Callable, List, Optional

from zoo import interrupt
from zoo.report import report
from zoo.runtime import quiet_mindspore

quiet_mindspore()
sys.excepthook = interrupt.hook


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
