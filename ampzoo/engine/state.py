"""What a run shares across the rungs of its fallback ladder (Run), and how one rung ended (Rung)."""
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple

from ampzoo.engine.checkpoint import RUN_TIMES


@dataclass
class Run:
    """What train.py's setup() prepares once and every rung of the ladder shares."""
    cfg: Any
    run_dir: Path
    device: str
    rank: int
    world: int
    sink: bool
    steps_per_epoch: int
    per_step: int          # samples (or padded tokens, token batching) a step trains on, all processes
    test_ds: Any
    writer: Any
    lr: Any
    timer: Any
    evaluator: Any
    t_start: float
    smoke_note: Optional[str]
    trained_s: float = 0.0     # training seconds before the current rung (earlier processes of a resumed run too)
    wall_before_s: float = 0.0  # wall seconds of a resumed run's earlier processes
    timed_from_step: int = 0   # > 0: resumed from a checkpoint that kept no times (written before they were kept)

    @property
    def unit(self) -> str:
        return "padded tokens" if self.cfg.dataset.max_tokens > 0 else "samples"

    @property
    def shard(self) -> Optional[Tuple[int, int]]:
        return (self.world, self.rank) if self.world > 1 else None

    @property
    def is_main(self) -> bool:  # rank 0 alone writes logs, TensorBoard, checkpoints and metrics
        return self.rank == 0

    def resumed(self, params: Optional[dict], step: int) -> None:
        """A resume from a checkpoint's `params`: the time its earlier processes took counts (a checkpoint written
        before times were kept: the times count from `step`)."""
        if params is not None and "train_time_s" in params:
            self.trained_s, self.wall_before_s = (float(params[k].asnumpy()) for k in RUN_TIMES)
        elif params is not None:
            self.timed_from_step = step


@dataclass
class Rung:
    """How one rung of the ladder ended: "finished", "diverged" or "stopped" (SIGTERM/SIGINT)."""
    outcome: str
    amp_cfg: Any             # the rung's precision setting
    net: Any
    policy: Any
    watch: Any
    checkpoints: Any
    amp_summary: dict
    train_time: float
    stop: Any                # the GracefulStop callback: which signal, at which step
    last_step: int = 0       # the global step the rung ended at (its start when it had nothing left to train)
