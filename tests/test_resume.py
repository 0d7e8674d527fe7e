"""Nothing lost: a run killed with SIGKILL resumes bitwise-exactly; SIGTERM saves and exits 143; a corrupt
newest checkpoint is skipped; TensorBoard has no duplicated steps after a resume."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import mindspore as ms

from ampzoo.engine.checkpoint import RUN_TIMES
from tests.conftest import ROOT, finished_run_dir, run_cli

ARGS = ["recipe=lenet_o0", "trainer.epochs=3", "logger.progress_bar=false"]


def start(run_dir, *extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "train.py", *ARGS, *extra, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path_glob, folder, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = list(folder.glob(path_glob)) if folder.exists() else []
        if found:
            return found
        time.sleep(0.05)
    raise TimeoutError(path_glob)


def weights(path):
    """A checkpoint's training state: every entry but the run's times so far (which differ between two runs)."""
    return {k: v.asnumpy() for k, v in ms.load_checkpoint(str(path)).items() if k not in RUN_TIMES}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return finished_run_dir(tmp_path_factory, "a", *ARGS)


def test_sigkill_then_resume_is_bitwise_exact(uninterrupted, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    proc = start(run_dir)
    wait_for("lenet5-e0001-*.ckpt", run_dir / "checkpoints")
    time.sleep(0.5)  # into epoch 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = run_cli("train.py", *ARGS, f"hydra.run.dir={run_dir}", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = weights(uninterrupted / "checkpoints" / "lenet5-e0003-s00000375.ckpt")
    b = weights(run_dir / "checkpoints" / "lenet5-e0003-s00000375.ckpt")
    assert a.keys() == b.keys()
    for k in a:  # weights, momentum, learning-rate position, AMP counters
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # the run's times count the killed process too (up to its last checkpoint), not only the resumed one
    killed = float(ms.load_checkpoint(str(run_dir / "checkpoints" / "lenet5-e0001-s00000125.ckpt"))["train_time_s"])
    metrics = json.loads((run_dir / "metrics.json").read_text())
    log = (run_dir / "train.log").read_text()
    resumed_s = sum(float(s) for s in re.findall(r"epoch [23]/3: .* in ([0-9.]+) s", log))
    assert metrics["train_time_s"] >= killed + resumed_s > killed > 0 and "timed_from_step" not in metrics
    assert metrics["wall_time_s"] > metrics["train_time_s"]
    assert (run_dir / "config.yaml").exists() and list(run_dir.glob("config.resume-*.yaml"))
    ea, eb = EventAccumulator(str(uninterrupted / "tb")), EventAccumulator(str(run_dir / "tb"))
    ea.Reload()
    eb.Reload()
    steps_a = [(e.step, e.value) for e in ea.Scalars("train/loss")]
    steps_b = [(e.step, e.value) for e in eb.Scalars("train/loss")]
    assert [s for s, _ in steps_b] == sorted({s for s, _ in steps_b}), "no duplicated steps"
    assert [s for s, _ in steps_b] == [s for s, _ in steps_a], "no gap: the same steps as the uninterrupted run"
    np.testing.assert_allclose([v for _, v in steps_b], [v for _, v in steps_a], rtol=1e-6)


@pytest.mark.slow  # a long run kept out of make test (make test-all runs it); a cheaper test covers the same path
def test_resume_points_inside_an_epoch_lose_less_and_resume_exactly(uninterrupted, tmp_path):
    """trainer.save_every_steps=50 (an epoch is 125 steps): a process killed inside epoch 2 resumes from the
    newest resume point inside it, bitwise-exactly; a resume point is replaced by the next checkpoint, so the
    finished run keeps its epoch ends only."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "trainer.save_every_steps=50")
    wait_for("lenet5-e0001-s00000[12][05]0.ckpt", run_dir / "checkpoints")  # step 150 or 200
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    names = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    inside = [n for n in names if n not in ("lenet5-e0001-s00000125.ckpt", "lenet5-e0002-s00000250.ckpt")]
    assert len(inside) == 1 and names[0] == "lenet5-e0001-s00000125.ckpt", names  # s50 and s100 were replaced
    resumed = run_cli("train.py", *ARGS, f"hydra.run.dir={run_dir}", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log = resumed.stdout + resumed.stderr
    if "e0002" not in inside[0]:  # killed before the epoch end: resumed inside epoch 2
        assert f"resumed from {run_dir / 'checkpoints' / inside[0]}" in log and "epoch 1 + " in log, log[-2000:]
    a = weights(uninterrupted / "checkpoints" / "lenet5-e0003-s00000375.ckpt")
    b = weights(run_dir / "checkpoints" / "lenet5-e0003-s00000375.ckpt")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt")) == [
        f"lenet5-e{e:04d}-s{125 * e:08d}.ckpt" for e in (1, 2, 3)]


def test_sigterm_saves_and_exits_143(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir)
    wait_for("lenet5-e0001-*.ckpt", run_dir / "checkpoints")
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]  # 128 + SIGTERM: `train.py && eval.py` stops here
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted by SIGTERM (or Ctrl-C): stopped at step") and "resume=auto" in last
    steps = [int(p.stem.rsplit("-s", 1)[-1]) for p in (run_dir / "checkpoints").glob("*.ckpt")]
    assert max(steps) > 125, steps


def test_corrupt_newest_checkpoint_is_skipped(uninterrupted, tmp_path):
    import shutil
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    newest = run_dir / "checkpoints" / "lenet5-e0003-s00000375.ckpt"
    newest.write_bytes(newest.read_bytes()[:5000])  # a save killed halfway, had it not been atomic
    (run_dir / "checkpoints" / ".partial").mkdir(exist_ok=True)
    (run_dir / "checkpoints" / ".partial" / "lenet5-e0004-s00000500.ckpt").write_bytes(b"half")
    result = run_cli("train.py", *ARGS[:1], "trainer.epochs=4", "logger.progress_bar=false",
                     f"hydra.run.dir={run_dir}", "resume=auto")
    assert result.returncode == 0, result.stderr[-2000:]
    log = result.stdout + result.stderr
    assert "skipping lenet5-e0003-s00000375.ckpt" in log
    assert "resumed from" in log and "lenet5-e0002-s00000250.ckpt (step 250" in log


def test_resume_auto_starts_a_run_then_continues_it(tmp_path):
    """One command to start or continue (a queue, a preemptible job): resume=auto with nothing to continue yet
    trains from step 0; the same command again continues that run and finds it finished."""
    cmd = [str(ROOT / "train.py"), "recipe=lenet_o0", "trainer.max_steps=3", "logger.progress_bar=false", "resume=auto"]
    first = run_cli(*cmd, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    log = first.stdout + first.stderr
    assert "resume=auto: no checkpoint in" in log and "starting the run from step 0" in log
    (run_dir,) = (tmp_path / "runs" / "lenet_o0").iterdir()
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] == 3
    assert not list(run_dir.glob("config.resume-*.yaml"))  # a start, not a resume
    again = run_cli(*cmd, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"{run_dir} is finished at step 3 of" in again.stdout and "a larger trainer.max_steps" in again.stdout
    assert len(list((tmp_path / "runs" / "lenet_o0").iterdir())) == 1


def test_a_run_that_died_before_its_first_checkpoint_starts_over_without_its_old_events(tmp_path):
    """resume=auto in a directory whose process died before its first checkpoint starts at step 0; TensorBoard
    then shows the new run only, not the dead process's points beside it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboardX import SummaryWriter

    run_dir = tmp_path / "run"
    dead = SummaryWriter(str(run_dir / "tb"))
    for step in (10, 20, 30):
        dead.add_scalar("train/loss", 99.0, step)
    dead.close()
    done = run_cli("train.py", "recipe=lenet_o0", "trainer.max_steps=20", "logger.progress_bar=false",
                   f"hydra.run.dir={run_dir}", "resume=auto")
    assert done.returncode == 0, done.stderr[-2000:]
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert 99.0 not in [v for _, v in loss] and [s for s, _ in loss] == [1, 10, 20]


def test_resume_auto_refuses_a_finished_run_without_checkpoints(uninterrupted, tmp_path):
    import shutil
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    shutil.rmtree(run_dir / "checkpoints")
    result = run_cli("train.py", *ARGS, f"hydra.run.dir={run_dir}", "resume=auto")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: resume=auto: {run_dir} holds a finished run and no checkpoint to continue it from; give another "
        f"hydra.run.dir to start anew")
    assert (run_dir / "metrics.json").exists()


@pytest.mark.slow  # a long run kept out of make test (make test-all runs it); a cheaper test covers the same path
def test_kill_during_a_save_leaves_the_previous_checkpoint_and_resumes_exactly(uninterrupted, tmp_path):
    """SIGKILL the moment a checkpoint is being written (it sits in checkpoints/.partial/ until renamed)."""
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        partial = run_dir / "checkpoints" / ".partial"
        proc = start(run_dir)
        wait_for("lenet5-e0001-*.ckpt", run_dir / "checkpoints")  # the second save is the one to interrupt
        deadline = time.time() + 120
        while time.time() < deadline and not (partial.exists() and any(partial.iterdir())):
            pass
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if partial.exists() and any(partial.iterdir()):
            break
    else:
        pytest.skip("could not land a kill inside a save in 3 tries")
    # Under load the poll can miss the second save's window and land in the third: what matters is that the
    # save the kill interrupted never became visible, and every save before it did.
    interrupted = [p.name for p in partial.iterdir()]
    epoch = int(re.search(r"lenet5-e(\d+)-s\d+", interrupted[0]).group(1))  # .tmp while MindSpore writes it
    complete = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    assert complete == [f"lenet5-e{e:04d}-s{125 * e:08d}.ckpt" for e in range(1, epoch)], (complete, interrupted)
    resumed = run_cli("train.py", *ARGS, f"hydra.run.dir={run_dir}", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = weights(uninterrupted / "checkpoints" / "lenet5-e0003-s00000375.ckpt")
    b = weights(run_dir / "checkpoints" / "lenet5-e0003-s00000375.ckpt")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_a_disk_too_small_for_two_checkpoints_is_refused_before_training(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from ampzoo.engine.checkpoint import check_disk_space
    from ampzoo.errors import ConfigError
    from ampzoo.models import create_model

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2**20, 10 * 2**20 - 2**19, 2**19))
    with pytest.raises(ConfigError, match=r"not enough disk space for checkpoints in .*: 0 MiB free, two "
                                          r"checkpoints of this run need 163 MiB"):
        check_disk_space(tmp_path / "checkpoints", create_model("resnet34", num_classes=10))


@pytest.mark.slow  # a long run kept out of make test (make test-all runs it); a cheaper test covers the same path
def test_resume_with_half_an_accumulated_update_in_the_checkpoint_is_exact(tmp_path):
    """update_freq=2 over 125-batch epochs: the epoch-1 checkpoint holds one batch of update 63; stopping
    there and resuming gives the uninterrupted run's weights, optimizer state and accumulators bitwise."""
    args = ["recipe=lenet_o0", "trainer.epochs=2", "trainer.update_freq=2", "logger.progress_bar=false"]
    whole = run_cli("train.py", *args, f"hydra.run.dir={tmp_path / 'a'}")
    assert whole.returncode == 0, whole.stderr[-2000:]
    first = run_cli("train.py", *args, "trainer.max_steps=125", f"hydra.run.dir={tmp_path / 'b'}")
    assert first.returncode == 0, first.stderr[-2000:]
    half = weights(tmp_path / "b" / "checkpoints" / "lenet5-e0001-s00000125.ckpt")
    assert np.abs(half["amp_accum.conv1.weight"]).sum() > 0, "the checkpoint holds a batch's gradients"
    resumed = run_cli("train.py", *args, "trainer.max_steps=0", f"hydra.run.dir={tmp_path / 'b'}", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]  # lifting the step budget extends the run
    a = weights(tmp_path / "a" / "checkpoints" / "lenet5-e0002-s00000250.ckpt")
    b = weights(tmp_path / "b" / "checkpoints" / "lenet5-e0002-s00000250.ckpt")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    other = run_cli("train.py", *args, "trainer.update_freq=1", f"hydra.run.dir={tmp_path / 'b'}", "resume=auto")
    assert other.returncode == 2
    assert ("resume: trainer.update_freq=1 would change the run, which has trainer.update_freq=2"
            in other.stderr), other.stderr


@pytest.mark.slow  # a long run kept out of make test (make test-all runs it); a cheaper test covers the same path
def test_resume_says_when_more_epochs_stretch_a_cosine_schedule(tmp_path):
    """Extending a cosine run with a larger trainer.epochs lays the schedule over the new length, so the
    learning rate jumps at the resume: one warning says from what to what. The same epochs (a longer
    max_steps only) keeps the schedule, and says nothing."""
    args = ["recipe=lenet_o0", "schedule=cosine", "logger.progress_bar=false", f"hydra.run.dir={tmp_path}"]
    first = run_cli("train.py", *args, "trainer.epochs=1", "trainer.max_steps=10")
    assert first.returncode == 0, first.stderr[-2000:]
    same = run_cli("train.py", *args, "trainer.max_steps=12", "resume=auto")
    assert same.returncode == 0, same.stderr[-2000:]
    assert "learning rate goes from" not in same.stdout + same.stderr
    longer = run_cli("train.py", *args, "trainer.epochs=2", "trainer.max_steps=14", "resume=auto")
    assert longer.returncode == 0, longer.stderr[-2000:]
    found = re.search(r"resume: the cosine schedule now spans 250 updates \(trainer.epochs=2 of the data as it reads "
                      r"now\) instead of the 125 the run trained under: at update 12 the learning rate goes from "
                      r"([\d.e-]+) \(as the run trained\) to ([\d.e-]+)",
                      longer.stdout + longer.stderr)
    assert found, (longer.stdout + longer.stderr)[-3000:]
    was, goes = map(float, found.groups())
    assert 0 < was < goes  # 12 of 125 steps into the cosine, then 12 of 250


def flip_a_weight_byte(path):
    """One bit of a float in the middle of the file (the largest weight's data) flipped: the file still parses
    and its weights are finite, so only a checksum tells."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 - len(data) // 2 % 4] ^= 0x01  # a mantissa's lowest bit of a little-endian float
    path.write_bytes(bytes(data))


def test_a_runs_own_checkpoint_with_a_flipped_byte_is_refused(tmp_path):
    """train.py's checkpoints carry MindSpore's CRC32: a byte changed on disk is one line on load (it loaded, and
    evaluated or trained on from the changed weight), as a shipped weight's sha256 refuses it."""
    from ampzoo.engine.checkpoint import AtomicCheckpoint, read_checkpoint
    from ampzoo.errors import ConfigError
    from ampzoo.models import create_model

    saver = AtomicCheckpoint(tmp_path, "lenet5", every_epochs=1, keep_last=1, steps_per_epoch=10)
    path = saver.save(create_model("lenet5", num_classes=10), 10)
    read_checkpoint(path)
    flip_a_weight_byte(path)
    with pytest.raises(ConfigError, match="fails its CRC32 check: a byte changed after train.py wrote it"):
        read_checkpoint(path)


def test_resume_skips_a_checkpoint_with_a_flipped_byte(uninterrupted, tmp_path):
    import shutil
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    flip_a_weight_byte(run_dir / "checkpoints" / "lenet5-e0003-s00000375.ckpt")
    result = run_cli("train.py", *ARGS[:1], "trainer.epochs=4", "logger.progress_bar=false",
                     f"hydra.run.dir={run_dir}", "resume=auto")
    assert result.returncode == 0, result.stderr[-2000:]
    log = result.stdout + result.stderr
    assert "skipping lenet5-e0003-s00000375.ckpt" in log and "fails its CRC32 check" in log, log[-3000:]
    assert "resumed from" in log and "lenet5-e0002-s00000250.ckpt (step 250" in log


def test_a_fallback_keeps_a_damaged_checkpoint_it_passes_over(tmp_path):
    """The fallback ladder restarts from the newest finite checkpoint and removes the non-finite ones (the
    divergence's); one that does not read (a failed CRC) was removed as "not finite" too: it is passed over
    and kept, the log naming why."""
    from ampzoo.engine.checkpoint import AtomicCheckpoint, last_good_checkpoint
    from ampzoo.models import create_model

    saver = AtomicCheckpoint(tmp_path, "lenet5", every_epochs=1, keep_last=5, steps_per_epoch=10)
    good = saver.save(create_model("lenet5", num_classes=10), 10)
    damaged = saver.save(create_model("lenet5", num_classes=10), 20)
    flip_a_weight_byte(damaged)
    assert last_good_checkpoint(tmp_path, remove=True)[0] == good
    assert damaged.exists()


STOP_IN_FINAL_EVAL = '''
import os
import signal
from pathlib import Path

from ampzoo.data.mnist import mnist
from ampzoo.engine.callbacks import Evaluator
from ampzoo.registry import DATASETS

DATASETS.add("mnist_stop_eval", mnist, task="classification")  # a plugin registers something
real, marker = Evaluator.evaluate, Path(os.environ["STOP_MARKER"])


def evaluate(self, *args, **kwargs):  # the first process is stopped in its final evaluation; its resume is not
    if not marker.exists():
        marker.write_text("stopped")
        os.kill(os.getpid(), signal.SIGTERM)
    return real(self, *args, **kwargs)


Evaluator.evaluate = evaluate
'''


def test_a_run_stopped_in_its_final_evaluation_resumes_without_training_past_max_steps(tmp_path):
    """SIGTERM during the final evaluation of a run that trainer.max_steps ends: the resume trains no step past
    max_steps, so its weights are the uninterrupted run's (issue 80, item 1), metrics.json says the step it ended
    at, and no empty checkpoints/.partial/ is left."""
    (tmp_path / "stop_in_final_eval.py").write_text(STOP_IN_FINAL_EVAL)
    args = ["recipe=lenet_o2", "trainer.max_steps=20", "logger.progress_bar=false"]
    env = {"AMP_ZOO_PLUGINS": "stop_in_final_eval", "PYTHONPATH": str(tmp_path),
           "STOP_MARKER": str(tmp_path / "stopped")}
    ref = run_cli("train.py", *args, f"hydra.run.dir={tmp_path / 'ref'}")
    stopped = run_cli("train.py", *args, f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["lenet5-e0000-s00000020.ckpt"]
    resumed = run_cli("train.py", *args, f"hydra.run.dir={tmp_path / 'run'}", "resume=auto", env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    checksum = re.compile(r"parameter checksum (\w+)")
    assert checksum.search((tmp_path / "run" / "train.log").read_text().split("resumed from")[-1]).group(1) == \
        checksum.search((tmp_path / "ref" / "train.log").read_text()).group(1)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 20 and metrics["eval_history"][-1]["step"] == 20, metrics["eval_history"]
    assert ref.returncode == 0
