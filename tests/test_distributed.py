"""Data-parallel training with MindSpore's msrun, 2 workers over loopback: every rank ends with identical
parameters, and they match one process that trains on the same global batch."""
import errno
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mindspore as ms

from tests.conftest import ROOT, run_cli

COMMON = ["recipe=lenet_o0", "trainer.epochs=1", "trainer.max_steps=20", "logger.progress_bar=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_workers_match_each_other_and_one_process(tmp_path):
    msrun = Path(sys.executable).parent / "msrun"
    run_dir, logs = tmp_path / "dp", tmp_path / "logs"
    # msrun starts its workers with the `python` on PATH: make it this environment's
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [str(msrun), "--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1",
         f"--master_port={free_port()}", "--join=True", f"--log_dir={logs}", "train.py", *COMMON,
         "runtime.distributed=true", "dataset.batch_size=32", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    worker_logs = "".join(p.read_text() for p in sorted(logs.glob("worker_*.log")))
    assert result.returncode == 0, (result.stdout + worker_logs)[-4000:]
    sums = dict(re.findall(r"rank (\d) of 2: parameter checksum (\w+)", worker_logs))
    assert set(sums) == {"0", "1"} and sums["0"] == sums["1"], sums
    [dp_ckpt] = (run_dir / "checkpoints").glob("*.ckpt")  # rank 0 alone writes checkpoints

    single_dir = tmp_path / "single"
    single = run_cli("train.py", *COMMON, "dataset.batch_size=64", f"hydra.run.dir={single_dir}")
    assert single.returncode == 0, single.stderr[-2000:]
    [single_ckpt] = (single_dir / "checkpoints").glob("*.ckpt")
    a, b = ms.load_checkpoint(str(dp_ckpt)), ms.load_checkpoint(str(single_ckpt))
    for name in ("conv1.weight", "conv2.weight", "fc1.weight", "fc3.bias", "moments.fc1.weight"):
        np.testing.assert_allclose(a[name].asnumpy(), b[name].asnumpy(), rtol=1e-5, atol=1e-6, err_msg=name)


PLUGIN = '''
import numpy as np
from data.mnist import mnist
from zoo.registry import DATASETS


def build(cfg, split, shard=None, start_epoch=0, seed=0, skip_batches=0):
    """MNIST whose 5th training batch is NaN on rank 0 only."""
    ds = mnist(cfg, split, shard, start_epoch, seed, skip_batches)
    if split != "train" or shard is None or shard[1] != 0:
        return ds
    seen = {"n": 0}

    def inject(images):
        seen["n"] += 1
        return images * np.float32("nan") if seen["n"] == 5 else images
    return ds.map(operations=inject, input_columns="image", num_parallel_workers=1)


DATASETS.add("mnist_rank0_nan", build, task="classification")
'''


def test_a_bad_batch_on_one_rank_is_skipped_by_every_rank(tmp_path):
    """The bad-input flag is all-reduced like the overflow flag: both ranks skip the step as bad input, and
    neither takes it for an overflow (which would move one rank's loss scale and not the other's)."""
    (tmp_path / "rank0_nan.py").write_text(PLUGIN)
    msrun = Path(sys.executable).parent / "msrun"
    logs = tmp_path / "logs"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", AMP_ZOO_PLUGINS="rank0_nan")
    result = subprocess.run(
        [str(msrun), "--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1",
         f"--master_port={free_port()}", "--join=True", f"--log_dir={logs}", "train.py", "recipe=lenet_o2",
         "trainer.epochs=1", "trainer.max_steps=20", "logger.progress_bar=false", "runtime.distributed=true",
         "dataset.name=mnist_rank0_nan", "amp.loss_scale.type=dynamic", f"hydra.run.dir={tmp_path / 'dp'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    worker_logs = [p.read_text() for p in sorted(logs.glob("worker_*.log"))]
    assert result.returncode == 0, (result.stdout + "".join(worker_logs))[-4000:]
    assert len(worker_logs) == 2
    for text in worker_logs:
        assert "by step 10: 1 batch(es) with NaN/Inf inputs skipped" in text, text[-3000:]
        assert "after an overflow" not in text, "a bad batch is not an fp16 overflow on any rank"
    sums = dict(re.findall(r"rank (\d) of 2: parameter checksum (\w+)", "".join(worker_logs)))
    assert set(sums) == {"0", "1"} and sums["0"] == sums["1"], sums


def msrun(tmp_path, *args, env=None, workers=2, timeout=600):
    """train.py under msrun with `workers` CPU workers over loopback: (result, the workers' logs joined)."""
    logs = tmp_path / f"logs-{len(list(tmp_path.glob('logs-*')))}"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", **(env or {}))
    result = subprocess.run(
        [str(Path(sys.executable).parent / "msrun"), f"--worker_num={workers}", f"--local_worker_num={workers}",
         "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--join=True", f"--log_dir={logs}", "train.py",
         "logger.progress_bar=false", "runtime.distributed=true", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return result, "".join(p.read_text() for p in sorted(logs.glob("worker_*.log")))


@pytest.mark.parametrize("code", [errno.EBADF, errno.ENOLCK, errno.ENOSYS], ids=errno.errorcode.get)
def test_msrun_on_storage_without_flock_claims_the_run_directory(tmp_path, code):
    """NFSv4 (EBADF on a read-only descriptor), NFS without a lock manager (ENOLCK), Lustre without -o flock
    (ENOSYS): rank 0 holds the run directory through a lock file and both ranks train, where every rank used to
    stop at start telling the user to free disk space."""
    (tmp_path / "noflock.py").write_text(
        "import errno, fcntl, os\n"
        f"def refuse(fd, op): raise OSError({code}, os.strerror({code}))\n"
        "fcntl.flock = refuse\n")
    run_dir = tmp_path / "run"
    result, logs = msrun(tmp_path, "recipe=lenet_o0", "trainer.epochs=1", "trainer.max_steps=4",
                         f"hydra.run.dir={run_dir}", env={"AMP_ZOO_PLUGINS": "noflock"})
    assert result.returncode == 0, (result.stdout + logs)[-4000:]
    assert "free space" not in logs and "Traceback" not in logs
    assert len(re.findall(r"rank \d of 2: parameter checksum", logs)) == 2
    assert list((run_dir / "checkpoints").glob("*.ckpt"))
    assert not (run_dir / ".run.lock.held").exists(), "rank 0 removed its lock file at exit"
