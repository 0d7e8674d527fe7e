"""Data-parallel training with MindSpore's msrun, 2 workers over loopback: every rank ends with identical
parameters, and they match one process that trains on the same global batch."""
import errno
import json
import os
import re
import signal
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

    # a resume: msrun names each worker's rank before init(), so rank 0 alone writes the lines composing its
    # config and the resume's .hydra/ record; the scheduler and rank 1 write none of them
    resumed = subprocess.run(
        [str(msrun), "--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1",
         f"--master_port={free_port()}", "--join=True", f"--log_dir={logs}-resume", "train.py", *COMMON[:-2],
         "trainer.max_steps=25", "logger.progress_bar=false", "runtime.distributed=true", "dataset.batch_size=32",
         f"hydra.run.dir={run_dir}", "resume=auto"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert (run_dir / "train.log").read_text().count("resume: the run's config.yaml, with") == 1
    assert [p.name for p in (run_dir / ".hydra").glob("resume-*")] == ["resume-1"]
    others = "".join((Path(f"{logs}-resume") / name).read_text() for name in ("scheduler.log", "worker_1.log"))
    assert [line for line in others.splitlines() if "[amp_zoo][INFO]" in line and "checksum" not in line] == []


PLUGIN = '''
import numpy as np
from ampzoo.data.mnist import mnist
from ampzoo.registry import DATASETS


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


@pytest.mark.slow  # a long run kept out of make test (make test-all runs it); a cheaper test covers the same path
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


def children(pid: int):
    """The processes whose parent is `pid` (msrun's workers and scheduler), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def msrun(tmp_path, *args, env=None, workers=2, timeout=600, script=None):
    """train.py (or `script` with `args`) under msrun with `workers` CPU workers over loopback: (result, the
    workers' logs joined). A job
    that does not end in `timeout` seconds (ranks waiting on each other in a collective) fails the test, its
    workers killed (msrun starts each in a session of its own: killing msrun alone would leave them)."""
    logs = tmp_path / f"logs-{len(list(tmp_path.glob('logs-*')))}"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", **(env or {}))
    command = [str(Path(sys.executable).parent / "msrun"), f"--worker_num={workers}", f"--local_worker_num={workers}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--join=True", f"--log_dir={logs}",
               *([script] if script else ["train.py", "logger.progress_bar=false", "runtime.distributed=true"]), *args]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in children(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()
        text = "".join(p.read_text() for p in sorted(logs.glob("worker_*.log")))
        pytest.fail(f"msrun did not end in {timeout} s (ranks waiting on each other?):\n{text[-4000:]}")
    result = subprocess.CompletedProcess(command, proc.returncode, out, err)
    return result, "".join(p.read_text() for p in sorted(logs.glob("worker_*.log")))


@pytest.mark.parametrize("code", [errno.EBADF, *(pytest.param(c, marks=pytest.mark.slow)
                                                  for c in (errno.ENOLCK, errno.ENOSYS))],
                         ids=errno.errorcode.get)  # EBADF in make test, the others in make test-all
def test_msrun_on_storage_without_flock_claims_the_run_directory(tmp_path, code):
    """NFSv4 (EBADF on a read-only descriptor), NFS without a lock manager (ENOLCK), Lustre without -o flock
    (ENOSYS): rank 0 holds the run directory through a lock file and both ranks train, where every rank used to
    stop at start telling the user to free disk space."""
    from tests.test_locks import write_noflock_plugin
    write_noflock_plugin(tmp_path, code)
    run_dir = tmp_path / "run"
    result, logs = msrun(tmp_path, "recipe=lenet_o0", "trainer.epochs=1", "trainer.max_steps=4",
                         f"hydra.run.dir={run_dir}", env={"AMP_ZOO_PLUGINS": "noflock"})
    assert result.returncode == 0, (result.stdout + logs)[-4000:]
    assert "free space" not in logs and "Traceback" not in logs
    assert len(re.findall(r"rank \d of 2: parameter checksum", logs)) == 2
    assert list((run_dir / "checkpoints").glob("*.ckpt"))
    assert not (run_dir / ".run.lock.held").exists(), "rank 0 removed its lock file at exit"


LADDER_PLUGIN = '''
import numpy as np
from ampzoo.data.mnist import mnist
from ampzoo.registry import DATASETS


def build(cfg, split, shard=None, start_epoch=0, seed=0, skip_batches=0):
    """MNIST whose 7th training batch of every rank is scaled by 1e6: finite data that overflows fp16."""
    ds = mnist(cfg, split, shard, start_epoch, seed, skip_batches)
    if split != "train":
        return ds
    seen = {"n": skip_batches}  # the global batch count: a restart rebuilds the pipeline past the batches done

    def inject(images):
        seen["n"] += 1
        return images * np.float32(1e6) if seen["n"] == 7 else images
    return ds.map(operations=inject, input_columns="image", num_parallel_workers=1)


DATASETS.add("mnist_overflow", build, task="classification")
'''


def test_the_fallback_ladder_restarts_every_rank_from_the_same_checkpoint(tmp_path):
    """A rung that ends with finite weights (here a dynamic scale overflowing at its floor, the update skipped):
    rank 0 saves a checkpoint at the stop step as its Model.train ends. Every rank must restart the next rung
    from that one, not from what its own listing of the folder showed before rank 0 had written it."""
    (tmp_path / "overflow.py").write_text(LADDER_PLUGIN)
    run_dir = tmp_path / "run"
    result, logs = msrun(tmp_path, "recipe=lenet_o2", "dataset.name=mnist_overflow", "trainer.epochs=1",
                         "trainer.max_steps=20", "trainer.log_every=5", "amp.fallback.enabled=true",
                         "amp.loss_scale.type=dynamic", "amp.loss_scale.init_scale=1", "amp.loss_scale.min_scale=1",
                         f"hydra.run.dir={run_dir}", env={"AMP_ZOO_PLUGINS": "overflow"}, timeout=420)
    errors = [line for line in logs.splitlines() if line.startswith("error:")]
    # 20 steps do not learn, and after a fallback that is an error of its own (exit 1): the only one allowed here
    assert all("the run does not learn" in e for e in errors), (result.stdout + logs)[-4000:]
    assert result.returncode == 0 or errors, (result.stdout + logs)[-4000:]
    restarts = re.findall(r"fallback: by step (\d+): a step overflowed at the minimum loss scale.*?; continuing at "
                          r"O2 with fixed scale 128 from (\S+)", logs)
    assert restarts == [("10", "lenet5-e0000-s00000010.ckpt")] * 2, (restarts, logs[-4000:])
    sums = dict(re.findall(r"rank (\d) of 2: parameter checksum (\w+)", logs))
    assert set(sums) == {"0", "1"} and sums["0"] == sums["1"], sums
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 20 and metrics["fallback"]["transitions"][0]["restart_from"] == restarts[0][1]


@pytest.mark.slow  # a long run kept out of make test (make test-all runs it); a cheaper test covers the same path
def test_a_resume_with_another_number_of_workers_is_refused_on_every_rank(tmp_path):
    """An msrun run's checkpoint records its world size and global batch; resumed on another number of workers,
    its global step would count other samples (epochs, evaluations and the learning rate shift): every rank
    refuses in one line, exit 2, and the run directory keeps what it had."""
    run_dir = tmp_path / "run"
    args = ["recipe=lenet_o0", "trainer.epochs=1", f"hydra.run.dir={run_dir}"]
    first, logs = msrun(tmp_path, *args, "trainer.max_steps=4")
    assert first.returncode == 0, (first.stdout + logs)[-4000:]
    [checkpoint] = (run_dir / "checkpoints").glob("*.ckpt")
    saved = checkpoint.read_bytes()
    again, logs = msrun(tmp_path, *args, "trainer.max_steps=8", "resume=auto", workers=1)
    assert again.returncode != 0
    line = (f"error: resume: {checkpoint} was trained by 2 worker(s) with a global batch of 64, this run has 1 with "
            f"32: its step 4 would stand for another number of samples, shifting epochs, evaluations and the learning "
            f"rate; resume it with 2 worker(s) (msrun --worker_num=2), or start a new run from its weights with "
            f"checkpoint={checkpoint}")
    assert line in logs.splitlines(), logs[-3000:]
    assert "Traceback" not in logs
    assert list((run_dir / "checkpoints").glob("*.ckpt")) == [checkpoint] and checkpoint.read_bytes() == saved
    assert not list(run_dir.glob("config.resume-*.yaml")), "refused before the run wrote anything of its own"
    # on its own 2 workers it resumes (every rank from rank 0's checkpoint: ampzoo.engine.checkpoint.agree_on_resume)
    again, logs = msrun(tmp_path, *args, "trainer.max_steps=8", "resume=auto")
    assert again.returncode == 0, (again.stdout + logs)[-4000:]
    assert "resumed from" in (run_dir / "train.log").read_text() and "taking rank 0's" not in logs
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] == 8


FUNCTIONAL_LOOP = '''
import ampzoo.entry  # noqa: F401
import numpy as np
import mindspore as ms
from mindspore.communication import get_rank, init
from omegaconf import OmegaConf

from ampzoo.amp.functional import FunctionalAmpStep
from ampzoo.runtime import parameter_checksum

ms.set_device("CPU")
init()
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
rank = get_rank()
ms.set_seed(0)
net = ms.nn.Dense(4, 3)
ls = OmegaConf.create({"type": "dynamic", "init_scale": 1024.0, "factor": 2, "window": 1000, "scale": 1.0})
step = FunctionalAmpStep(net, ms.nn.CrossEntropyLoss(), ms.nn.SGD(net.trainable_params(), 0.1), ls)
rng = np.random.default_rng(rank)  # each rank its own batches
for i in range(4):
    x, y = rng.standard_normal((8, 4)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32)
    if rank == 1 and i == 2:
        x[0, 0] = np.inf  # this rank's gradients overflow; the other's do not
    step(ms.Tensor(x), ms.Tensor(y))
t = step.telemetry()
print(f"rank {rank}: skipped {t['amp_skipped_steps']}, scale {t['loss_scale']:g}, checksum {parameter_checksum(net)}",
      flush=True)
'''


@pytest.mark.slow  # a long run kept out of make test (make test-all runs it); a cheaper test covers the same path
def test_the_functional_step_averages_gradients_and_skips_together_across_ranks(tmp_path):
    """A hand-written loop under msrun: the gradients are all-reduced and an overflow on one rank is skipped by
    every rank, so the ranks keep the same weights and the same loss scale."""
    (tmp_path / "loop.py").write_text(FUNCTIONAL_LOOP)
    result, logs = msrun(tmp_path, script=str(tmp_path / "loop.py"), timeout=300)
    assert result.returncode == 0, (result.stdout + logs)[-4000:]
    lines = dict(re.findall(r"rank (\d): (skipped .*)", logs))
    assert set(lines) == {"0", "1"} and lines["0"] == lines["1"], lines
    assert lines["0"].startswith("skipped 1, scale 512,"), lines


def test_no_rank_enters_a_collective_while_its_tokenizer_is_still_to_build(tmp_path, monkeypatch):
    """Under msrun a translation run finds or builds its tokenizer on every host before init() (issue 79, item
    2): the stand-in for init() fails if it is entered while the tokenizer cache is still empty, as HCCL's
    timeout would on a cold cache."""
    import train
    from ampzoo.engine.load import load_config
    from ampzoo.engine.start import Start

    cache = tmp_path / "cache"
    cfg, _ = load_config(["recipe=transformer_base_o2", "runtime.distributed=true",
                          f"+dataset.params.cache_dir={cache}"])

    class Entered(Exception):
        pass

    def init_distributed():
        if not list(cache.glob("spm-*.model")):
            raise RuntimeError("HCCL: entered the first collective while this host's tokenizer was not built")
        raise Entered
    monkeypatch.setattr(train, "set_context", lambda runtime: "CPU")
    monkeypatch.setattr(train, "init_distributed", init_distributed)
    with pytest.raises(Entered):
        train.setup(cfg, tmp_path / "run", None, Start())


@pytest.mark.parametrize("rank", [0, 1])
def test_no_rank_waits_in_a_collective_while_rank_0_decodes_the_test_set(monkeypatch, tmp_path, rank):
    """At the end of a translation run under msrun rank 0 decodes the test set on the host (issue 79, item 2):
    every rank takes rank 0's verdict before that, so the stand-in collective fails if rank 0 has started to
    decode, as HCCL's timeout would with ranks 1-7 waiting in it."""
    from types import SimpleNamespace

    import train
    from ampzoo.engine.load import load_config
    from ampzoo.engine.callbacks import Evaluator

    cfg, _ = load_config(["recipe=transformer_tiny_multi30k_o2", "runtime.distributed=true"])
    events = []

    def translate(*args, **kwargs):
        events.append("decode")
        return {"bleu": 30.0}

    def rank0_flag(is_main, world):
        def agree(flag):
            if "decode" in events:
                raise RuntimeError("HCCL: a rank waited in the all-reduce while rank 0 decoded")
            events.append("collective")
            return flag
        return agree
    evaluator = Evaluator(None, 0, None, 1, 10)
    evaluator.evaluate = lambda: {"top1": 0.3, "loss": 2.0}
    monkeypatch.setattr(train, "translate", translate)
    monkeypatch.setattr(train, "rank0_flag", rank0_flag)
    monkeypatch.setattr(train, "parameter_checksum", lambda net: "0")
    monkeypatch.setattr(train, "summary", lambda *args: {})
    monkeypatch.setattr(train, "write_metrics", lambda *args: None)
    run = SimpleNamespace(cfg=cfg, evaluator=evaluator, is_main=rank == 0, world=2, rank=rank, run_dir=tmp_path,
                          steps_per_epoch=10)
    rung = SimpleNamespace(last_step=10, amp_cfg=cfg.amp, net=None)
    train.finish(run, rung, [], [])
    assert events == (["collective", "decode"] if rank == 0 else ["collective"])
    assert evaluator.history[-1]["bleu" if rank == 0 else "loss"] == (30.0 if rank == 0 else 2.0)


def test_ranks_start_from_one_initialisation_and_augment_their_own_samples_differently():
    """Issue 79, item 8: the initial weights must be the same on every rank (nothing broadcasts them), the
    augmentations should differ (each rank reads other samples): the idx readers' flips and shifts are keyed by
    the shard, MindSpore's dataset ops by seed + rank; a single process draws what it always drew."""
    import mindspore.dataset as msds
    import numpy as np

    from ampzoo.data.sampling import EpochBatches
    from ampzoo.runtime import seed_everything

    images, labels = np.arange(64 * 4, dtype=np.float32).reshape(64, 1, 2, 2), np.arange(64)
    drawn = {}
    for shard in (None, (2, 0), (2, 1)):
        def augment(batch, rng, shard=shard):
            drawn.setdefault(shard, []).append(rng.integers(0, 2**31, 4).tolist())
            return batch
        list(EpochBatches((images, labels), 8, "train", seed=1, shard=shard, augment=augment))
    assert drawn[(2, 0)] != drawn[(2, 1)], "each rank draws its own flips and shifts"
    single = np.random.default_rng((1, 0, 0)).integers(0, 2**31, 4).tolist()
    assert drawn[None][0] == single, "a single process draws what it drew before"
    try:
        seed_everything(5, rank=3)
        assert msds.config.get_seed() == 8 and ms.get_seed() == 5, "data: seed + rank; initialisation: the seed"
    finally:
        seed_everything(1)
