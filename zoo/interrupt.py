"""Ctrl-C and SIGTERM at any moment of a command end in one line saying what was saved and how to continue, and
the shell's exit code for the signal (128 + its number: 130 for SIGINT, 143 for SIGTERM), so that
`python train.py ... && python eval.py ...` never evaluates a half-trained model. A leaf: imports nothing of ours.

`install()` makes both signals raise `Interrupted` wherever the command is (importing, composing, compiling,
evaluating, decoding); the command that knows what it wrote catches it and calls `exit_line` with that. One that
is not caught (a signal while modules import) still ends in the one line, through `sys.excepthook`. Training
itself stops more gently: engine.callbacks.GracefulStop finishes the step and saves first.
"""
import os
import signal
import sys
from typing import Optional

NOTHING = "nothing was written; run the command again"


class Interrupted(BaseException):
    """A stop signal arrived. Not an Exception: no `except Exception` on the way up may swallow it."""

    def __init__(self, signum: int, note: Optional[str] = None, label: Optional[str] = None):
        super().__init__(signum)
        self.signum, self.note, self.label = signum, note, label  # label: how to name it, if not by its number

    @property
    def name(self) -> str:
        return self.label or signal.Signals(self.signum).name

    @property
    def code(self) -> int:
        return 128 + self.signum


_received: list = []  # the signals this process received (read by `received`; written by the handler alone)


def _raise(signum, frame):
    _received.append(signum)
    raise Interrupted(signum)


def received() -> Optional[int]:
    """The first stop signal this process received, or None: an error raised after one (MindSpore wraps what a
    signal interrupts in a RuntimeError) is reported as the interruption it is."""
    return _received[0] if _received else None


def line(name: str, note: Optional[str] = None) -> str:
    return f"interrupted by {name}: {note or NOTHING}"


def exit_line(error: Interrupted, note: Optional[str] = None) -> None:
    """The one line on stderr, and exit with the signal's code."""
    print(line(error.name, note or error.note), file=sys.stderr, flush=True)
    raise SystemExit(error.code)


def _hook(kind, value, tb, previous=sys.excepthook):
    if not isinstance(value, Interrupted):
        if received() is None:
            return previous(kind, value, tb)
        value = Interrupted(received())  # what the signal cut short: a C extension's import turns it into ImportError
    print(line(value.name, value.note), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(value.code)  # an excepthook cannot set the exit code otherwise (Python would exit 1)


def install() -> None:
    """SIGINT and SIGTERM raise Interrupted from here on (MindSpore's compiled graphs put their own SIGINT handler
    in place while they run, which turns a Ctrl-C into a SIGTERM to this process: the exit is then 143)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise)
    sys.excepthook = _hook


def finished() -> None:
    """The command's work is done and reported: a signal from here on (while Python shuts down) changes nothing."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
