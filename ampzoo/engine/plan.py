"""What a run trains with, planned once before its first step: the steps of an epoch and what a step trains on
(samples or padded tokens, over every rank), and the learning rate of every update."""
import logging
from typing import Tuple

from ampzoo.data import create_dataset
from ampzoo.engine.callbacks import planned_epochs
from ampzoo.engine.optim import lr_schedule, scaled_lr, schedule_moved
from ampzoo.engine.start import Start

log = logging.getLogger("amp_zoo")


def data_plan(cfg, world: int, rank: int) -> Tuple[int, int]:
    """(steps an epoch of this rank's shard, samples or padded tokens a step trains on over all ranks), logged."""
    steps_per_epoch = create_dataset(cfg.dataset, "train", (world, rank) if world > 1 else None).get_dataset_size()
    by_tokens = cfg.dataset.max_tokens > 0  # token batching: throughput counts a step's (padded) token budget
    per_step = (cfg.dataset.max_tokens if by_tokens else cfg.dataset.batch_size) * world
    t = cfg.trainer
    capped = t.max_steps and t.max_steps < t.epochs * steps_per_epoch  # the run ends before its epochs do
    log.info("data: %s, %d steps of %s per epoch%s", cfg.dataset.path or "embedded", steps_per_epoch,
             f"up to {cfg.dataset.max_tokens} tokens" if by_tokens else cfg.dataset.batch_size,
             f"; the run ends at step {t.max_steps} (trainer.max_steps), in epoch "
             f"{planned_epochs(t.epochs, t.max_steps, steps_per_epoch)} of {t.epochs}" if capped else "")
    return steps_per_epoch, per_step


def learning_rate(cfg, steps_per_epoch: int, per_step: int, world: int, start: Start):
    """The learning rate of every update (a schedule over updates, gradient accumulation counted); a resume whose
    checkpoint was trained on another schedule says so."""
    k = cfg.trainer.update_freq
    if k > 1:
        log.info("gradient accumulation: %d batches an update (%s per update)", k,
                 f"up to {k * per_step} tokens" if cfg.dataset.max_tokens > 0 else f"{k * per_step} samples")
    lr = lr_schedule(cfg.schedule, scaled_lr(cfg.optimizer, cfg.dataset.batch_size * world * k),
                     -(-steps_per_epoch // k), cfg.trainer.epochs)
    if start.params and "learning_rate" in start.params and "global_step" in start.params:  # from a checkpoint
        moved = schedule_moved(start.params["learning_rate"].asnumpy().reshape(-1), lr,
                               int(start.params["global_step"].asnumpy().reshape(-1)[0]), cfg.schedule,
                               cfg.trainer.epochs)
        if moved:
            log.warning(moved)
    return lr
