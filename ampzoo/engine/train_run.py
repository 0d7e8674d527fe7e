"""train.py in a process of its own, for the tools that train many runs (bench.reproduce, bench.run, amp.search): one
run killed or diverged cannot take the tool down, and a run directory that holds a checkpoint continues."""
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[2]


def train_command(overrides: List[str], run_dir: Path) -> List[str]:
    """`python train.py OVERRIDES` into run_dir, with resume=auto when run_dir already holds a checkpoint."""
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}", "logger.progress_bar=false"]
    if any((run_dir / "checkpoints").glob("*.ckpt")):
        cmd.append("resume=auto")
    return cmd


INTERRUPTED = (128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM)  # a run stopped by a signal


def run_logged(cmd: List[str], log: Path, cwd: Optional[Path] = None) -> int:
    """Run cmd with its output appended to log; its exit code (see `wait`)."""
    with open(log, "a") as out:
        return wait(subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT))


def wait(proc: subprocess.Popen) -> int:
    """proc's exit code, once it ends. A stop signal to this process reaches proc too (SIGTERM to the tool alone
    would otherwise leave its run training), and the tool waits for the run to save before it goes on up."""
    try:
        return proc.wait()
    except BaseException as e:  # ampzoo.interrupt.Interrupted (any other error: the run is stopped as well)
        proc.send_signal(getattr(e, "signum", signal.SIGTERM))
        proc.wait()
        raise
