"""The error every bad input becomes, and the one line it is shown as. A leaf: it imports nothing of ours."""
import difflib
import re
import sys


class ConfigError(ValueError):
    """A bad value in the configuration: the message names it and what would be valid."""


class TracedError(ConfigError):
    """A bad input found while training, whose full trace went to the run's train.log (a model that does not
    compile, a file the pipeline cannot read): the run directory is kept for that trace."""


class WriteError(OSError):
    """A file of a run could not be written (no space, no permission, a path that is not a directory): the
    message names the file and what to do; every complete checkpoint is intact."""


class DeviceError(RuntimeError):
    """The Ascend or GPU, or the software under it (driver, CANN, CUDA, HCCL/NCCL), failed: not bad input, so
    its exit code is 1, and the message sends the user to `make doctor` and MindSpore's own log."""


# Words that only a device runtime's failure carries in MindSpore's messages (ACL calls, Ascend error codes
# such as EZ9999/EL0004, collective libraries, device memory); a model's own compile error carries none.
DEVICE_WORDS = re.compile(r"\b(acl\w*|ACL|HCCL|NCCL|hccl\w*|nccl\w*|CUDA|cuda\w*|cuDNN|cudnn\w*|CANN|AICore|AICPU|"
                          r"aicore|aicpu|E[A-Z]\d{4}|rtStream\w*|rtMalloc\w*)\b|[Dd]evice memory|Device\(id|"
                          r"Out of Memory|[Mm]emory isn't enough|[Ss]ync(hronize)? stream|Ascend error")


def device_failure(message: str) -> str:
    """The line of `message` that names a device failure, or '' when none does."""
    return next((ln.strip() for ln in message.splitlines() if DEVICE_WORDS.search(ln)), "")


def write_error(path, error: BaseException) -> "WriteError":
    lines = str(error).strip().splitlines()
    reason = getattr(error, "strerror", None) or (lines[0] if lines else type(error).__name__)
    return WriteError(f"could not write {path}: {reason}")


def fail(message: str, code: int = 2) -> None:
    """One `error:` line on stderr and exit `code` (2: bad input)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def choices_hint(value: str, valid) -> str:
    """'did you mean X? valid: A, B, C' for a name that is not one of `valid`."""
    valid = sorted(valid)
    close = difflib.get_close_matches(str(value), valid, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return f"{hint}valid: {', '.join(valid)}"
