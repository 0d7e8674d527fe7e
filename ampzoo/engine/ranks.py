"""What the ranks of an msrun run must agree on, each settled by rank 0 (ampzoo.runtime.rank0_value, an all-reduce
every rank calls): the checkpoint a resume or a fallback rung starts from, and whether the run failed. And the
run's shape a checkpoint records, so that a resume on another number of workers is refused."""
from pathlib import Path
from typing import Callable, Optional

from ampzoo.engine.checkpoint import agree_on_resume, check_same_shape, step_of
from ampzoo.engine.rundir import claim_by_rank0
from ampzoo.runtime import any_rank, rank0_value


def together(world: int, agree: Callable[[bool], bool] = any_rank) -> None:
    """Under msrun, wait until every rank is here (an all-reduce): before a failure every rank reports, so that no
    rank exits (and msrun kills the rest) while rank 0 still writes its checkpoint or metrics."""
    if world > 1:
        agree(False)


def rank0_says(is_main: bool, world: int) -> Optional[Callable[[int], int]]:
    """Under msrun, a function giving rank 0's value on every rank; None for a single process."""
    if world == 1:
        return None

    def agree(value: int) -> int:
        return rank0_value(value, is_main)
    return agree


def run_shape(cfg, world: int) -> dict:
    """ampzoo.engine.checkpoint.RUN_SHAPE: the workers, and what one update takes over all of them."""
    per_batch = cfg.dataset.max_tokens if cfg.dataset.max_tokens > 0 else cfg.dataset.batch_size
    return {"world_size": world, "global_batch": per_batch * world * cfg.trainer.update_freq}


def resume_on_ranks(cfg, run_dir: Path, start, rank: int, world: int) -> None:
    """Before the run writes anything: under msrun rank 0 holds the run directory (claim_by_rank0) and every rank
    resumes from rank 0's checkpoint (`start` is changed in place); a checkpoint trained by another number of
    workers is refused, on every rank alike."""
    if cfg.runtime.distributed:
        claim_by_rank0(run_dir, rank, any_rank)
    if world > 1 and cfg.resume:
        start.checkpoint, start.params = agree_on_resume(start.checkpoint, start.params, run_dir / "checkpoints",
                                                         cfg.model.name, rank == 0, rank0_says(rank == 0, world))
        start.step = step_of(start.params)
    if start.params is not None:
        check_same_shape(start.params, start.checkpoint, **run_shape(cfg, world))


def rank0_flag(is_main: bool, world: int) -> Optional[Callable[[bool], bool]]:
    """Under msrun, a function giving rank 0's flag on every rank (amp.fallback.run_failed); None alone."""
    says = rank0_says(is_main, world)
    if says is None:
        return None

    def agree(flag: bool) -> bool:
        return says(int(flag)) == 1
    return agree
