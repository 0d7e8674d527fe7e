"""Locks on shared storage: a run directory and the tokenizer cache on a file system whose flock fails (NFSv4 on a
read-only descriptor: EBADF; Lustre without -o flock: ENOSYS; no lock manager: ENOLCK) still hold one process at
a time, through a lock file, and never send the user to free disk space. flock's failures are stood in for by
monkeypatching fcntl.flock; the msrun side is in test_distributed.py."""
import errno
import fcntl
import os
import socket
import subprocess
import sys

import pytest

from ampzoo.engine.rundir import HELD, LOCK_FILE, claim, claim_by_rank0, release
from tests.conftest import ROOT
from ampzoo import locks
from ampzoo.errors import ConfigError

NO_FLOCK = [errno.EBADF, errno.ENOLCK, errno.ENOSYS]



def write_noflock_plugin(folder, code: int) -> None:
    """folder/noflock.py: a plugin (AMP_ZOO_PLUGINS=noflock) under which every fcntl.flock fails with `code`."""
    (folder / "noflock.py").write_text(
        "import errno, fcntl, os\n"
        f"def refuse(fd, op): raise OSError({code}, os.strerror({code}))\n"
        "fcntl.flock = refuse\n"
        "from ampzoo.data.mnist import mnist\n"  # a plugin registers something (MNIST again, under its own name)
        "from ampzoo.registry import DATASETS\n"
        "DATASETS.add('mnist_noflock', mnist, task='classification')\n")

def flock_fails(monkeypatch, code):
    def refuse(fd, operation):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(fcntl, "flock", refuse)


def test_the_run_directory_lock_is_taken_on_a_file_opened_for_writing(tmp_path, monkeypatch):
    """NFSv4 emulates flock with POSIX locks, which refuse LOCK_EX on a read-only descriptor (EBADF)."""
    real, modes = fcntl.flock, []

    def nfs_flock(fd, operation):
        modes.append(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE)
        if modes[-1] == os.O_RDONLY and operation & fcntl.LOCK_EX:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", nfs_flock)
    claim(tmp_path / "run")
    try:
        assert modes == [os.O_RDWR]
        assert not locks.marker_of(tmp_path / "run" / LOCK_FILE).exists(), "flock worked: no fallback file"
    finally:
        release(tmp_path / "run")


@pytest.mark.parametrize("code", NO_FLOCK, ids=errno.errorcode.get)
def test_without_flock_a_lock_file_holds_the_directory(tmp_path, monkeypatch, code):
    flock_fails(monkeypatch, code)
    run_dir = tmp_path / "run"
    claim(run_dir)
    marker = locks.marker_of(run_dir / LOCK_FILE)
    assert marker.read_text().split() == [socket.gethostname(), str(os.getpid()), locks._boot_id(),
                                          locks._started(os.getpid())]
    # another live process on this host holds it: refused, naming it
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        release(run_dir)
        marker.write_text(f"{socket.gethostname()} {other.pid}\n")
        with pytest.raises(ConfigError) as e:
            claim(run_dir)
        assert str(e.value) == (f"run directory {run_dir} is in use by process {other.pid}: a directory holds one "
                                f"run at a time; wait for it to end, or give another directory; if that run has "
                                f"ended (a killed process leaves this file), remove {marker}")
    finally:
        other.kill()
        other.wait()
    claim(run_dir)  # its process is gone: a stale lock file on this host is taken over
    assert marker.read_text().split()[1] == str(os.getpid())
    release(run_dir)
    assert not marker.exists(), "released: the lock file goes"


def test_a_lock_file_of_another_host_names_the_file_to_remove(tmp_path, monkeypatch):
    flock_fails(monkeypatch, errno.ENOSYS)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    marker = locks.marker_of(run_dir / LOCK_FILE)
    marker.write_text("node7 4242\n")
    with pytest.raises(ConfigError) as e:
        claim(run_dir)
    assert str(e.value) == (f"run directory {run_dir} is in use by process 4242 on host node7: a directory holds one "
                            f"run at a time; wait for it to end, or give another directory; if that run has ended (a "
                            f"killed process leaves this file), remove {marker}")
    assert marker.read_text() == "node7 4242\n"


@pytest.mark.parametrize("left_by", ["this pid", "another boot", "a pid reused since"])
def test_a_lock_file_whose_pid_now_names_another_process_is_stale(tmp_path, monkeypatch, left_by):
    """A killed run's lock file in a new container (a new PID namespace: pid 1 again, or any pid reused): the
    file names this very process, or a live pid of another boot, or one whose start time differs. Each is taken
    over, not "in use by process N" (issue 79, item 5)."""
    flock_fails(monkeypatch, errno.ENOSYS)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    marker = locks.marker_of(run_dir / LOCK_FILE)
    live = os.getppid()  # a live process that is not this one (pytest's parent)
    host, boot = socket.gethostname(), locks._boot_id()
    marker.write_text({"this pid": f"{host} {os.getpid()} {boot} {locks._started(os.getpid())}\n",
                       "another boot": f"{host} {live} 00000000-0000-0000-0000-000000000000 1\n",
                       "a pid reused since": f"{host} {live} {boot} 1\n"}[left_by])
    claim(run_dir)
    assert marker.read_text().split() == locks._me().split()
    release(run_dir)


def test_a_lock_file_left_by_a_killed_process_is_taken_over(tmp_path, monkeypatch):
    """The fallback's file outlives a SIGKILL (an flock would not): the next run on this host takes it over."""
    code = ("import errno, fcntl, os, time\n"
            "def refuse(fd, op): raise OSError(errno.ENOLCK, 'No locks available')\n"
            "fcntl.flock = refuse\n"
            "from ampzoo.engine.rundir import claim\n"
            f"claim({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    flock_fails(monkeypatch, errno.ENOLCK)
    with pytest.raises(ConfigError, match=f"in use by process {holder.pid}:"):
        claim(tmp_path)
    holder.kill()
    holder.wait()
    claim(tmp_path)
    release(tmp_path)


@pytest.mark.parametrize("code", NO_FLOCK, ids=errno.errorcode.get)
def test_rank_0_claims_without_flock_and_every_rank_goes_on(tmp_path, monkeypatch, code):
    """Under msrun rank 0 claims after init(): an flock error was an OSError there, which the driver took for a
    full disk on every msrun run on NFS or Lustre."""
    flock_fails(monkeypatch, code)
    flags = []
    claim_by_rank0(tmp_path / "run", 0, lambda flag: flags.append(flag) or flag)
    claim_by_rank0(tmp_path / "run", 1, lambda flag: flags.append(flag) or flag)
    assert flags == [False, False] and (tmp_path / "run").resolve() in HELD
    release(tmp_path / "run")


def test_a_file_system_without_any_lock_is_one_line_not_disk_space(tmp_path, monkeypatch):
    flock_fails(monkeypatch, errno.ENOSYS)
    real_open = os.open

    def no_exclusive(path, flags, mode=0o777):
        if flags & os.O_EXCL:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_exclusive)
    with pytest.raises(ConfigError) as e:
        claim(tmp_path / "run")
    assert str(e.value) == (f"run directory {tmp_path / 'run'} cannot be locked (cannot create the lock file "
                            f"{locks.marker_of((tmp_path / 'run' / LOCK_FILE).resolve())}: "
                            f"{os.strerror(errno.EOPNOTSUPP)}); give a hydra.run.dir on a file system that takes "
                            f"locks (NFS with its lock manager, Lustre mounted with -o flock, a local disk)")
    assert "space" not in str(e.value)


@pytest.mark.parametrize("code", [NO_FLOCK[0], *(pytest.param(c, marks=pytest.mark.slow) for c in NO_FLOCK[1:])],
                         ids=errno.errorcode.get)  # EBADF in make test, the others in make test-all
def test_a_single_process_run_on_storage_without_flock(tmp_path, code):
    """train.py itself, flock failing from the start (a plugin stands in for the file system): the run trains
    and leaves no lock file behind, where it used to end in a traceback."""
    write_noflock_plugin(tmp_path, code)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", AMP_ZOO_PLUGINS="noflock")
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "train.py", "recipe=lenet_o0", "trainer.epochs=1", "trainer.max_steps=3",
                             "logger.progress_bar=false", f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "space" not in result.stderr
    assert list((run_dir / "checkpoints").glob("*.ckpt"))
    assert not locks.marker_of(run_dir / LOCK_FILE).exists()


@pytest.mark.parametrize("code", NO_FLOCK, ids=errno.errorcode.get)
def test_the_tokenizer_cache_builds_under_a_lock_file_without_flock(tmp_path, monkeypatch, code):
    from ampzoo.data.translation import tokenizer_file
    from tests.test_device_paths import tokenizer_data
    flock_fails(monkeypatch, code)
    model = tokenizer_file(tokenizer_data(tmp_path / "cache"))
    assert model.is_file()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [model.name, model.name + ".lock"]


def test_a_tokenizer_cache_that_cannot_be_locked_is_not_a_full_disk(tmp_path, monkeypatch):
    from ampzoo.data.translation import tokenizer_file
    from tests.test_device_paths import tokenizer_data
    flock_fails(monkeypatch, errno.EIO)  # not a missing flock: the lock itself failed
    with pytest.raises(ConfigError) as e:
        tokenizer_file(tokenizer_data(tmp_path / "cache"))
    assert str(e.value) == (f"could not lock the tokenizer cache {tmp_path / 'cache'} (cannot lock "
                            f"{next((tmp_path / 'cache').glob('*.lock'))}: {os.strerror(errno.EIO)}); set "
                            f"dataset.params.cache_dir to a folder on a file system that takes locks (a local disk, "
                            f"say)")
