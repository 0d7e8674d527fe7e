"""An exclusive lock on a file that works on the shared file systems several servers train from.

`acquire(path)` takes `flock(LOCK_EX)` on `path`, opened for writing: NFSv4 emulates flock with POSIX byte-range
locks, which refuse an exclusive lock on a descriptor opened read-only (EBADF). Where flock is not there at all
(Lustre mounted without `-o flock`: ENOSYS; an NFS server without a lock manager: ENOLCK; EOPNOTSUPP, EINVAL
elsewhere), the lock is a second file created with O_CREAT|O_EXCL (atomic on NFSv3 and later, and on Lustre)
that names its host, process, boot and the process's start time, removed when the lock is released or the process
exits. A lock file left by a killed process on this host is found stale and taken over: its process is gone, or
its pid now belongs to another process (a new container or PID namespace reuses pids: the boot or the start time
differs), or it names this very process (which holds no such lock). One left on another host cannot be told from
a live one, so every message about a lock file names the file to remove.

An flock is dropped by the kernel however the process ends; the fallback's file is not (a SIGKILL leaves it).
"""
import atexit
import errno
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Optional

# flock cannot be used on this file system (as opposed to: another process holds the lock)
NO_FLOCK = {errno.EBADF, errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class LockHeld(Exception):
    """Another process holds the lock: `holder` describes it ('process 123', 'process 123 on host h')."""

    def __init__(self, holder: str, path: Path, fallback: bool):
        super().__init__(holder)
        self.holder, self.path, self.fallback = holder, path, fallback


class LockFailed(OSError):
    """Neither flock nor a lock file could be taken (a file system that refuses both, or a permission)."""


class Lock:
    """A held lock: release() (or the process's end) frees it."""

    def __init__(self, fd: Optional[int], marker: Optional[Path]):
        self.fd, self.marker = fd, marker  # the flock's descriptor, or the fallback's file

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None
        if self.marker is not None:
            try:
                if self.marker.read_text().split() == _me().split():  # still ours
                    self.marker.unlink()
            except OSError:
                pass
            self.marker = None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "-"


def _started(pid: int) -> str:
    """The start time of process `pid` in clock ticks since boot (/proc/PID/stat, field 22); '-' where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2:].split()[19]  # the fields after the command name, which may hold spaces
    except (OSError, ValueError, IndexError):
        return "-"


def _me() -> str:
    """What names this process uniquely: host, pid, boot id and start time."""
    return f"{socket.gethostname()} {os.getpid()} {_boot_id()} {_started(os.getpid())}"


def flock_holder(path: Path) -> Optional[int]:
    """The process holding an flock on `path`, from /proc/locks (Linux, local file systems); None where it
    cannot be told."""
    try:
        inode = os.stat(path).st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if "FLOCK" in parts and "->" not in parts and len(parts) > 5:
            try:
                if int(parts[5].split(":")[-1]) == inode and int(parts[4]) != os.getpid():
                    return int(parts[4])
            except ValueError:
                continue
    return None


def marker_of(path: Path) -> Path:
    """The fallback's lock file for the lock `path`."""
    return path.with_name(path.name + ".held")


def acquire(path, wait: bool = False, poll: float = 0.5) -> Lock:
    """Hold the exclusive lock `path` (created if need be). Held by another process: LockHeld, or with `wait`,
    wait for it. Raises LockFailed when the file system takes neither kind of lock."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise LockFailed(e.errno, f"cannot open the lock file {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return Lock(fd, None)
    except BlockingIOError:
        os.close(fd)
        holder = flock_holder(path)
        raise LockHeld(f"process {holder}" if holder else "another process", path, fallback=False) from None
    except OSError as e:
        os.close(fd)
        if e.errno not in NO_FLOCK:
            raise LockFailed(e.errno, f"cannot lock {path}: {e.strerror}") from None
    return _exclusive_file(marker_of(path), wait, poll)


def _exclusive_file(marker: Path, wait: bool, poll: float) -> Lock:
    while True:
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _holder_of(marker)
            if holder is None:  # stale (its process on this host is gone) or vanished meanwhile: try again
                continue
            if not wait:
                raise LockHeld(holder, marker, fallback=True) from None
            time.sleep(poll)
            continue
        except OSError as e:
            raise LockFailed(e.errno, f"cannot create the lock file {marker}: {e.strerror}") from None
        try:
            os.write(fd, _me().encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        lock = Lock(None, marker)
        atexit.register(lock.release)
        return lock


def _stale(pid: int, boot: Optional[str], started: Optional[str]) -> bool:
    """Whether a lock file of this host naming `pid` (and, from files written since 2026-12, the boot and the
    process's start time) was left by a process that is gone."""
    if pid == os.getpid() or not _alive(pid):  # this process holds no lock file it does not know of
        return True
    if boot not in (None, "-") and _boot_id() != "-" and boot != _boot_id():
        return True  # written before a reboot, or in another container on this host name
    return started not in (None, "-") and _started(pid) not in ("-", started)  # the pid reused since


def _holder_of(marker: Path) -> Optional[str]:
    """Who holds the fallback lock file `marker`; None when it is stale (removed here) or already gone."""
    try:
        fields = marker.read_text().split()
        host, pid = fields[0], int(fields[1])
        boot, started = (fields[2], fields[3]) if len(fields) >= 4 else (None, None)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):  # being written this instant, or not ours to read: held
        return f"the process named in {marker}"
    if host == socket.gethostname() and _stale(pid, boot, started):
        try:
            marker.unlink()
        except FileNotFoundError:
            pass
        return None
    return f"process {pid}" + ("" if host == socket.gethostname() else f" on host {host}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
