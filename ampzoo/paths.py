"""Every path a command will write is checked before the work that fills it: a run directory, eval.py's
`output=`, an export file, amp.search's folder. One ConfigError naming the key, the path and why, not a traceback
after minutes of evaluation."""
import tempfile
from pathlib import Path

from ampzoo.errors import ConfigError


def check_writable(path, key: str, folder: bool = False) -> Path:
    """`key`=`path` can be written: a folder (`folder`) or a file, wherever the nearest existing folder on its way
    lets this process create files (tried, not guessed: a read-only filesystem, a permission, a file where a
    folder is needed). Creates nothing that stays. Returns the path, ~ expanded."""
    path = Path(str(path)).expanduser()
    name = f"{key}={path}" if key != str(path) else key
    if folder and path.exists() and not path.is_dir():
        raise ConfigError(f"{name} is a file; give a directory")
    if not folder and path.is_dir():
        raise ConfigError(f"{name} is a directory; give a file name")
    start = path if folder else path.parent
    existing = next(p for p in [start, *start.parents] if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{name}: {existing} is a file, so nothing can be created under it; give a path "
                          f"under a directory")
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".amp-zoo-write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"{name}: {existing} is not writable ({e.strerror}); give a path you can write "
                          f"to") from None
    return path
