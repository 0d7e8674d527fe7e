"""The process around a run (ampzoo.engine.process, ampzoo.interrupt, ampzoo.entry): a failed run removes only
what it created, the stop signals are taken by the command that runs and given back, the line that continues an
msrun run is msrun's, and a sweep goes on past a job that fails and says which jobs finished, failed and never
started."""
import signal

import pytest

from tests.conftest import run_cli

LENET = ["recipe=lenet_o0", "trainer.max_steps=20", "trainer.log_every=10", "logger.progress_bar=false"]


def test_a_failed_run_keeps_the_users_own_empty_folders(tmp_path):
    """Bad input found once the run directory exists (a batch larger than the data): the run directory and the
    folders this run made on its way go; the user's own empty folders above them stay (issue 62, item 2)."""
    mine = tmp_path / "experiments" / "empty"
    mine.mkdir(parents=True)
    out = run_cli("train.py", *LENET, "dataset.batch_size=100000", f"hydra.run.dir={mine / 'new' / 'run'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("error: dataset.batch_size=100000"), out.stderr[-2000:]
    assert mine.is_dir() and list(mine.iterdir()) == [], "what the run made is gone, the user's folder stays"


def test_a_folder_that_cannot_be_removed_is_left_without_a_traceback(tmp_path, monkeypatch):
    """A folder this run created that cannot be removed (a mount point, say) stays, and closing says nothing."""
    from pathlib import Path

    from ampzoo.engine.process import directory
    from ampzoo.errors import ConfigError

    run_dir = directory.RunDir(tmp_path / "made" / "run", named=True).claim()

    def busy(self):
        raise OSError(16, "Device or resource busy")
    monkeypatch.setattr(Path, "rmdir", busy)
    error = run_dir.close(ConfigError("a bad value"))
    assert isinstance(error, ConfigError) and not (tmp_path / "made" / "run").exists()
    assert (tmp_path / "made").is_dir()


def test_a_command_takes_the_stop_signals_only_while_it_runs():
    """ampzoo.interrupt.handled: SIGTERM raises Interrupted inside the block, and the handler before it is back
    after it (a test or a tool that imports a command keeps its own)."""
    import os

    from ampzoo import interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(interrupt.Interrupted):
        with interrupt.handled():
            assert signal.getsignal(signal.SIGTERM) is not before
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100000):  # the handler runs within these bytecodes
                pass
    assert signal.getsignal(signal.SIGTERM) is before
    interrupt._received.clear()  # this process goes on (as a test); a command would have ended


def test_the_line_that_continues_an_msrun_run_is_msruns_command(monkeypatch, tmp_path):
    """Under msrun, `python train.py ... resume=auto` would start one process of a distributed run: the line
    names msrun with the options it was started with (issue 62, item 9)."""
    from ampzoo.engine.process import directory

    monkeypatch.setenv("MS_WORKER_NUM", "2")
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    monkeypatch.setattr(directory, "parent_command", lambda: [
        "/venv/bin/python", "/venv/bin/msrun", "--worker_num=2", "--local_worker_num=2", "--master_port=8118",
        "--join=True", "--log_dir=msrun_logs", "train.py", "recipe=lenet_o2", "runtime.distributed=true",
        f"hydra.run.dir={tmp_path}", ""])
    assert directory.continue_with(tmp_path, "lenet_o2") == (
        "continue with: msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True "
        f"--log_dir=msrun_logs train.py recipe=lenet_o2 runtime.distributed=true hydra.run.dir={tmp_path} "
        "resume=auto")
    monkeypatch.delenv("MS_WORKER_NUM")
    monkeypatch.delenv("MS_ROLE")
    assert directory.continue_with(tmp_path, "lenet_o2") == (
        f"continue with: python train.py recipe=lenet_o2 hydra.run.dir={tmp_path} resume=auto")


def test_distributed_without_msrun_is_one_line(tmp_path):
    """runtime.distributed=true in a process msrun did not start (say, a resume of an msrun run started with
    python): one line naming the key and what to do, exit 2, nothing left behind (issue 62, item 9)."""
    out = run_cli("train.py", *LENET, "runtime.distributed=true", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "error: runtime.distributed=true, but msrun did not start this process: start it with msrun (README: "
        "Ascend and GPU), or set runtime.distributed=false for one process"], out.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a long run kept out of make test (make test-all runs it); a cheaper test covers the same path
def test_a_sweep_goes_on_past_a_job_that_diverges(tmp_path):
    """-m with a learning rate that diverges in job #0: its error line, then job #1 trains to its end, and the
    sweep ends naming what finished and what failed, with the failed job's exit code (issue 62, item 10)."""
    out = run_cli("train.py", "-m", *LENET, "optimizer.lr=1e6,0.01", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "error: by step 10: non-finite gradients were applied" in out.stderr, out.stderr[-2000:]
    assert (tmp_path / "1-lenet_o0" / "metrics.json").is_file(), "the next job ran"
    assert out.stderr.strip().splitlines()[-1] == \
        "sweep: 2 jobs; finished: #1; failed: #0 (exit 1); never started: none", out.stderr[-2000:]


def test_a_sweep_names_the_jobs_that_never_started():
    from ampzoo.engine.process.command import Sweep

    sweep = Sweep()
    sweep.end(0, "finished")
    sweep.end(1, "interrupted", 143)
    planned = [["recipe=lenet_o0"], ["recipe=lenet_o2"], ["recipe=lenet_o3"]]
    assert sweep.summary(planned) == ("sweep: 3 jobs; finished: #0; interrupted: #1 (exit 143); never started: #2 "
                                      "(recipe=lenet_o3)")
    assert sweep.code == 143


HCCL = '''
import sys

from mindspore import nn

from ampzoo.registry import CELLS


@CELLS.register()
class HcclStandIn(nn.Cell):  # a plugin registers something; this one's work is the patch below
    pass

def seed_everything(seed, rank=0):  # stands in for a collective that fails in setup, outside training's handler
    if seed == 7:
        raise RuntimeError("Call HcclAllReduce failed, ret=7\\nEI0002: The wait execution of the Notify register "
                           "times out. Reason: The Notify register has not received the Notify record")
    real(seed, rank)

main = sys.modules["__main__"]
real, main.seed_everything = main.seed_everything, seed_everything
'''


def test_an_error_outside_trainings_handler_keeps_its_trace_and_exits_1(tmp_path):
    """An HCCL failure raised from setup (issue 79, item 3) is not bad input: exit 1, its first line on the
    console naming train.log, and its whole message (the EI0002 line) and traceback in train.log."""
    (tmp_path / "hccl_stand_in.py").write_text(HCCL)
    run_dir = tmp_path / "run"
    out = run_cli("train.py", *LENET, "runtime.seed=7", f"hydra.run.dir={run_dir}",
                  env={"AMP_ZOO_PLUGINS": "hccl_stand_in", "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: RuntimeError: Call HcclAllReduce failed, ret=7 (not bad input: the whole message and its traceback "
        f"are in {run_dir / 'train.log'})"), out.stderr[-2000:]
    log = (run_dir / "train.log").read_text()
    assert "EI0002: The wait execution of the Notify register times out" in log, log[-2000:]
    assert "Traceback (most recent call last)" in log and 'in setup' in log, log[-2000:]


def test_a_sweep_job_that_fails_outside_training_fails_that_job_not_the_sweep(tmp_path):
    (tmp_path / "hccl_stand_in.py").write_text(HCCL)
    out = run_cli("train.py", "-m", *LENET, "trainer.max_steps=5", "runtime.seed=7,1",
                  f"hydra.sweep.dir={tmp_path / 's'}",
                  env={"AMP_ZOO_PLUGINS": "hccl_stand_in", "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1, out.stderr[-2000:]
    assert "error: RuntimeError: Call HcclAllReduce failed, ret=7" in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == \
        "sweep: 2 jobs; finished: #1; failed: #0 (exit 1); never started: none", out.stderr[-2000:]
