"""Ctrl-C and SIGTERM at any moment of a command end in one line saying what was saved and how to continue, and
the shell's exit code for the signal (128 + its number: 130 for SIGINT, 143 for SIGTERM), so that
`python train.py ... && python eval.py ...` never evaluates a half-trained model. A leaf: imports nothing of ours.

Inside `handled()`, the block a command runs its work in, both signals raise `Interrupted` wherever the command
is (composing, compiling, evaluating, decoding); the command that knows what it wrote catches it and calls
`exit_line` with that. Before and after the block they do what they did: a test or a tool that imports a command
keeps its own handlers. A Ctrl-C or SIGTERM while the command's modules import, before the block, still ends in
the one line through `hook` (sys.excepthook and `at_start_up`, set by ampzoo.entry in a command's own process).
Training itself stops more gently: ampzoo.engine.callbacks.GracefulStop finishes the step and saves first.

An exception raised at any bytecode is not safe everywhere, so two places are guarded:
- inside `deferred()` (the TensorBoard writer's calls) a signal waits for the block's end: raised between a
  `Condition`'s release and its bookkeeping, it loses the writer thread's wake-up and the exit hangs for ever;
- C code may swallow the exception (MindSpore's compiler probes Python attributes with PyObject_HasAttr, which
  clears any error): `received()` still knows, GracefulStop stops at the next step, and `finished()` ends the
  command with the signal's code instead of exit 0.
"""
import os
import signal
import sys
from contextlib import contextmanager
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
_deferring = [0]      # how deep in `deferred()` blocks the main thread is


def _raise(signum, frame):
    _received.append(signum)
    if not _deferring[0]:
        raise Interrupted(signum)


@contextmanager
def deferred():
    """A block that a stop signal does not cut short: a signal that arrives in it raises `Interrupted` when the
    block ends."""
    before = len(_received)
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1
    if not _deferring[0] and len(_received) > before:
        raise Interrupted(_received[before])


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


def hook(kind, value, tb, previous=sys.excepthook):
    """sys.excepthook of a command: an uncaught Interrupted (or a Ctrl-C before `handled()`) is its one line and
    exit code; anything else is Python's own report."""
    cause = value
    while cause is not None and not isinstance(cause, KeyboardInterrupt):  # a C extension's import turns a
        cause = cause.__cause__ or cause.__context__                        # Ctrl-C into ImportError
    if cause is not None:
        value = Interrupted(signal.SIGINT)
    if not isinstance(value, Interrupted):
        if received() is None:
            return previous(kind, value, tb)
        value = Interrupted(received())  # what the signal cut short: a C extension's import turns it into ImportError
    print(line(value.name, value.note), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(value.code)  # an excepthook cannot set the exit code otherwise (Python would exit 1)


SIGNALS = (signal.SIGINT, signal.SIGTERM)


def at_start_up() -> None:
    """SIGTERM raises Interrupted from now on, as Ctrl-C raises KeyboardInterrupt: a command stopped while its
    modules import ends in `hook`'s one line and exit 143, not in a silent kill. For a command's own process
    only (ampzoo.entry): `handled()` takes the signal over for the command's work."""
    signal.signal(signal.SIGTERM, _raise)


@contextmanager
def handled():
    """SIGINT and SIGTERM raise Interrupted inside the block, and do what they did before it once it ends
    (MindSpore's compiled graphs put their own SIGINT handler in place while they run, which turns a Ctrl-C into a
    SIGTERM to this process: the exit is then 143)."""
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:
        signal.signal(sig, _raise)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


SWALLOWED = "the signal came while MindSpore compiled, which cannot be stopped, and the command then finished: " \
            "what it wrote is complete"


def finished() -> None:
    """The command's work is done and reported: a signal from here on (while Python shuts down) changes nothing.
    A signal received before, that C code swallowed, still ends the command with its code, so that
    `train.py && eval.py` stops where the user asked it to."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if _received:
        exit_line(Interrupted(_received[0]), SWALLOWED)
