"""The train step a run trains with, built in one place for train.py and every benchmark: the recipe's network
under a precision policy, its loss, its optimizer and loss scale, in amp.loss_scale.AmpTrainStep."""
from typing import NamedTuple

import mindspore.nn as nn

from ampzoo.amp.loss_scale import AmpTrainStep, LossScalePlan, plan_loss_scale
from ampzoo.amp.policy import apply_policy
from ampzoo.engine.metrics import NetWithLoss, create_loss
from ampzoo.engine.optim import create_optimizer
from ampzoo.engine.network import build_model, set_cpu_compute
from cpu_kernels.accelerate import runs_kernels


class TrainStep(NamedTuple):
    net: nn.Cell           # the network under its policy (what eval and checkpoints see)
    policy: object         # ampzoo.amp.policy's record of which Cells run in which precision
    plan: LossScalePlan
    cell: AmpTrainStep     # call it with a batch: one optimizer update (or one micro-batch of update_freq)
    loss_fn: nn.Cell


def build_train_step(cfg, amp_cfg, lr, device: str) -> TrainStep:
    """cfg's model under amp_cfg (the recipe's amp block, or a fallback rung's), trained with learning rate
    `lr` (a number or one per step) on `device` ("CPU", "GPU" or "Ascend")."""
    set_cpu_compute(cfg.runtime.cpu_compute, training=True)
    net, policy = apply_policy(build_model(cfg), amp_cfg)
    plan = plan_loss_scale(amp_cfg.loss_scale)
    optimizer = create_optimizer(net.trainable_params(), cfg.optimizer, lr, plan.optimizer_loss_scale,
                                 runs_kernels(net))
    loss_fn = create_loss(cfg.trainer)
    cell = AmpTrainStep(NetWithLoss(net, loss_fn), optimizer, plan, device, cfg.trainer.update_freq)
    return TrainStep(net, policy, plan, cell, loss_fn)
