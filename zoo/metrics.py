"""Evaluation network and metrics shared by train.py and eval.py."""
import mindspore.nn as nn
from mindspore.train import Loss, Top1CategoricalAccuracy, Top5CategoricalAccuracy


def eval_network(net: nn.Cell, loss_fn: nn.Cell) -> nn.Cell:
    """Outputs (loss, logits, label); the policy already casts the logits to fp32."""
    return nn.WithEvalCell(net, loss_fn)


def metrics() -> dict:
    return {"top1": Top1CategoricalAccuracy(), "top5": Top5CategoricalAccuracy(), "loss": Loss()}
