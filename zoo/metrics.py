"""Loss, training and evaluation wrappers, and metrics shared by train.py and eval.py.

The network takes every input column but the last, which is the label: (image) -> label for images,
(src, tgt_in) -> tgt_out for translation. Logits and labels are flattened, so one cross-entropy serves
both; padding (label 0 in translation) is ignored through `ignore_index`.
"""
import mindspore.nn as nn
from mindspore.train import Loss, Top1CategoricalAccuracy, Top5CategoricalAccuracy


class FlatCrossEntropy(nn.Cell):
    def __init__(self, label_smoothing: float = 0.0, ignore_index: int = -100):
        super().__init__()
        self.ce = nn.CrossEntropyLoss(ignore_index=ignore_index, label_smoothing=label_smoothing)

    def construct(self, logits, labels):
        if logits.ndim > 2:  # static in graph mode: image classifiers pay for no reshape
            return self.ce(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return self.ce(logits, labels)


class NetWithLoss(nn.Cell):
    def __init__(self, net, loss_fn):
        super().__init__(auto_prefix=False)
        self.net, self.loss_fn = net, loss_fn

    def construct(self, *inputs):
        return self.loss_fn(self.net(*inputs[:-1]), inputs[-1])


class NetWithEval(nn.Cell):
    """(loss, logits, labels), flattened, for Model.eval's metrics."""

    def __init__(self, net, loss_fn):
        super().__init__(auto_prefix=False)
        self.net, self.loss_fn = net, loss_fn

    def construct(self, *inputs):
        logits, labels = self.net(*inputs[:-1]), inputs[-1]
        return self.loss_fn(logits, labels), logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)


def create_loss(trainer_cfg) -> nn.Cell:
    return FlatCrossEntropy(trainer_cfg.label_smoothing, trainer_cfg.ignore_index)


def metrics() -> dict:
    return {"top1": Top1CategoricalAccuracy(), "top5": Top5CategoricalAccuracy(), "loss": Loss()}
