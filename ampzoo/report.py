"""The one line every command ends an error with, and its exit code: shared by ampzoo.entry.run (eval.py, export.py,
the tools) and train.py's process (ampzoo.engine.process). Importing it changes nothing in the process."""
from ampzoo import interrupt
from ampzoo.errors import ConfigError, DeviceError, fail


def report(error: BaseException) -> None:
    """The one line every command ends an error with, and its exit code: bad input (ConfigError) 2; the device
    or its software (DeviceError), or a file that cannot be written (OSError) 1; a stop signal 128 + its
    number, also when what it cut short raised something else (MindSpore wraps it). A SystemExit goes on as it
    is; anything else is a bug, raised with its traceback."""
    if isinstance(error, SystemExit):
        raise error
    if isinstance(error, interrupt.Interrupted):
        interrupt.exit_line(error)
    if interrupt.received():
        interrupt.exit_line(interrupt.Interrupted(interrupt.received()))
    if isinstance(error, ConfigError):
        fail(str(error))
    if isinstance(error, DeviceError):
        fail(str(error), code=1)
    if isinstance(error, OSError):
        fail(str(error) if error.strerror is None else f"could not write {error.filename}: {error.strerror}", code=1)
    raise error
