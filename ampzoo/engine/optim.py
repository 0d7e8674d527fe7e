"""Optimizer and learning-rate schedule from the recipe.

The schedule is a per-step array handed to the optimizer (MindSpore's dynamic learning rate), so its
position is the optimizer's `global_step`, which every checkpoint saves.
"""
import math
from typing import Optional

import mindspore as ms
import mindspore.nn as nn
import numpy as np
from mindspore import Tensor, ops

from ampzoo.errors import ConfigError

NO_DECAY_MARKERS = ("beta", "gamma", "bias", "moving_mean", "moving_variance")


def scaled_lr(opt_cfg, global_batch: int) -> float:
    """Linear scaling rule (Goyal et al. 2017): lr grows with the global batch over the reference batch."""
    if opt_cfg.reference_batch_size <= 0:
        return opt_cfg.lr
    return opt_cfg.lr * global_batch / opt_cfg.reference_batch_size


def lr_schedule(sched_cfg, base_lr: float, steps_per_epoch: int, epochs: int) -> np.ndarray:
    total = steps_per_epoch * epochs
    name = str(sched_cfg.name)
    warmup = sched_cfg.warmup_steps or int(round(sched_cfg.warmup_epochs * steps_per_epoch))
    steps = np.arange(total, dtype=np.float64)
    if name == "constant":
        lr = np.full(total, base_lr)
    elif name == "cosine":
        progress = np.clip((steps - warmup) / max(1, total - warmup), 0, 1)
        lr = sched_cfg.min_lr + 0.5 * (base_lr - sched_cfg.min_lr) * (1 + np.cos(math.pi * progress))
    elif name == "linear":  # to min_lr at the end (the MindSpore model zoo's ResNet "linear" decay)
        progress = np.clip((steps - warmup) / max(1, total - warmup), 0, 1)
        lr = base_lr - (base_lr - sched_cfg.min_lr) * progress
    elif name == "step":
        epoch = steps // steps_per_epoch
        lr = base_lr * sched_cfg.gamma ** np.searchsorted(sorted(sched_cfg.milestones), epoch, side="right")
    else:  # inverse_sqrt (Vaswani et al. 2017): linear warm-up, then lr * sqrt(warmup / step)
        w = max(1, warmup)
        lr = base_lr * np.minimum((steps + 1) / w, np.sqrt(w / np.maximum(steps + 1, 1)))
        return lr.astype(np.float32)
    if warmup > 0:
        lr[:warmup] = base_lr * (steps[:warmup] + 1) / warmup
    return lr.astype(np.float32)


def schedule_moved(trained: np.ndarray, now: np.ndarray, update: int, sched_cfg, epochs: int) -> Optional[str]:
    """What a resume does to the learning rate when its schedule is not the one the checkpoint trained under:
    a cosine schedule given another trainer.epochs, or data of another size, is laid over the new length. None
    when the rate at the resume update is the same (constant, step, inverse_sqrt, or an unchanged schedule).
    `trained` is the schedule saved in the checkpoint; a finished run sat at its end."""
    if not len(trained) or update >= len(now):
        return None
    was, goes = float(trained[min(update, len(trained) - 1)]), float(now[update])
    if abs(goes - was) <= 1e-3 * max(abs(was), abs(goes), 1e-12):
        return None
    return (f"resume: the {sched_cfg.name} schedule now spans {len(now):,} updates (trainer.epochs={epochs} of the "
            f"data as it reads now) instead of the {len(trained):,} the run trained under: at update {update:,} the "
            f"learning rate goes from {was:.4g} (as the run trained) to {goes:.4g} and follows the new schedule; "
            f"one whole {sched_cfg.name} schedule of {epochs} epochs is a new run (another hydra.run.dir)")


def param_groups(params, opt_cfg):
    if opt_cfg.decay_norm_and_bias or opt_cfg.weight_decay == 0:
        return [{"params": params, "weight_decay": opt_cfg.weight_decay}]
    is_no_decay = [any(m in p.name.rsplit(".", 1)[-1] for m in NO_DECAY_MARKERS) for p in params]
    no_decay = [p for p, skip in zip(params, is_no_decay) if skip]
    decay = [p for p, skip in zip(params, is_no_decay) if not skip]
    return [{"params": decay, "weight_decay": opt_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Momentum(nn.Momentum):
    """nn.Momentum whose weight decay, loss-scale unscale and update run as one op a parameter on the CPU.

    nn.Momentum adds the decay in two ops of its own (w * wd, then AddN), unscales in a third, and reads each
    decayed weight through a second Load, so MindSpore copies the weight once for each Load (TensorMove: "a
    parameter loaded more than once"). On the CPU these were a seventh of ResNet-34's O2 step outside its
    convolutions (docs/benchmarks.md). With the CPU kernels (`fused`: the network runs them) each parameter
    takes cpu_kernels' MomentumUpdate instead: the same update (accum = momentum * accum + g + wd * w;
    w -= lr * accum, or Nesterov's) in one pass, on the same `moments` parameters, so checkpoints and resume
    are unchanged. Elsewhere (Ascend, GPU, runtime.cpu_kernels=off, parameters not in fp32) the step is
    nn.Momentum's own."""

    def __init__(self, params, learning_rate, momentum, loss_scale=1.0, use_nesterov=False, fused=False):
        super().__init__(params, learning_rate=learning_rate, momentum=momentum, loss_scale=loss_scale,
                         use_nesterov=use_nesterov)
        fp32 = all(p.dtype == ms.float32 for p in self._parameters)  # the op's dtype (fp32 master weights)
        self.fused = fused_momentum_op(use_nesterov) if fp32 and fused else None
        self.unscales_in_update = False
        if self.fused is None:
            return
        # nn.Optimizer holds the decay times the loss scale, to add before it unscales; the op adds it after
        decay = self.group_weight_decay if self.is_group else [self.weight_decay] * len(self._parameters)
        decay = [0.0 if not flag else float(wd) / self.loss_scale for wd, flag in zip(decay, self.decay_flags)]
        self.decays = tuple(Tensor([wd], ms.float32) for wd in decay)
        self.unscale = Tensor([1.0 / self.loss_scale], ms.float32)
        # a loss-scaled step may hand update() the gradients as they are and its own 1 / scale (AmpTrainStep)
        self.unscales_in_update = self.loss_scale == 1.0

    def construct(self, gradients):
        if self.fused is None:
            return super().construct(gradients)
        return self.update(gradients, self.unscale)

    def update(self, gradients, unscale):
        """The fused update with the gradients multiplied by `unscale` (a (1,) float32) as it reads them: the loss
        scale's unscale (amp.loss_scale.AmpTrainStep), with no unscaled copy of the gradients written first."""
        params, moments = self._parameters, self.moments
        gradients = self.gradients_centralization(gradients)
        lr = self.get_lr()
        self.assignadd(self.global_step, self.global_step_increase_tensor)
        success = True
        for i in range(len(params) - 1, -1, -1):  # nn.Momentum's order: the last layers' gradients come first
            rate = lr[i] if self.is_group_lr else lr
            done = self.fused(params[i], moments[i], gradients[i], rate, self.momentum, self.decays[i], unscale)
            success = ops.depend(success, done)
        return success


def fused_momentum_op(nesterov: bool):
    """cpu_kernels' MomentumUpdate on the CPU, else None."""
    if ms.get_context("device_target") != "CPU":
        return None
    from cpu_kernels.cells import momentum_op
    return momentum_op(nesterov)


def create_optimizer(params, opt_cfg, lr: np.ndarray, loss_scale: float, kernels: bool = False) -> nn.Optimizer:
    """`loss_scale` > 1 only for a fixed scale without overflow skipping: the optimizer unscales then. `kernels`:
    the network runs the CPU kernels, and momentum then updates with theirs."""
    name = str(opt_cfg.name)
    groups = param_groups(params, opt_cfg)
    lr = list(map(float, lr))
    if name == "momentum":
        return Momentum(groups, learning_rate=lr, momentum=opt_cfg.momentum, loss_scale=loss_scale,
                        use_nesterov=opt_cfg.nesterov, fused=kernels)
    if name == "sgd":
        return nn.SGD(groups, learning_rate=lr, momentum=0.0, loss_scale=loss_scale)
    if name == "adam":
        return nn.Adam(groups, learning_rate=lr, beta1=opt_cfg.betas[0], beta2=opt_cfg.betas[1],
                       eps=opt_cfg.eps, loss_scale=loss_scale)
    if loss_scale != 1.0:
        raise ConfigError("optimizer.name=adamw cannot unscale gradients (MindSpore's AdamWeightDecay has no "
                          "loss_scale); with it use amp.loss_scale.type=dynamic, or fixed with "
                          "amp.loss_scale.drop_overflow_update=true")
    return nn.AdamWeightDecay(groups, learning_rate=lr, beta1=opt_cfg.betas[0], beta2=opt_cfg.betas[1],
                              eps=opt_cfg.eps)
