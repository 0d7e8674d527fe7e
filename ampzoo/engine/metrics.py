"""Loss, training and evaluation wrappers, and metrics shared by train.py and eval.py.

The network takes every input column but the last, which is the label: (image) -> label for images,
(src, tgt_in) -> tgt_out for translation (logits one row per target position). Logits and labels are
flattened, so one cross-entropy serves both; padding (label 0 in translation) is ignored through `ignore_index`.
"""
import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops
from mindspore.train import Loss, Top1CategoricalAccuracy, Top5CategoricalAccuracy


class FlatCrossEntropy(nn.Cell):
    def __init__(self, label_smoothing: float = 0.0, ignore_index: int = -100):
        super().__init__()
        self.ce = nn.CrossEntropyLoss(ignore_index=ignore_index, label_smoothing=label_smoothing)
        self.sequence_ce = LabelSmoothedCrossEntropy(label_smoothing, ignore_index)

    def construct(self, logits, labels):
        if labels.ndim > 1:  # static in graph mode: sequences (a large vocabulary) take the faster form
            if logits.ndim > 2:  # our Transformer returns flat rows already (a reshape here would copy them)
                logits = logits.reshape(-1, logits.shape[-1])
            return self.sequence_ce(logits, labels.reshape(-1))
        return self.ce(logits, labels)


class LabelSmoothedCrossEntropy(nn.Cell):
    """nn.CrossEntropyLoss's value (mean over non-ignored labels of (1 - eps) * nll + eps * mean over classes of
    -log p), with its gradient written out: (softmax - (1 - eps) * onehot - eps / classes) per kept row / rows.
    MindSpore's CPU LogSoftmaxGrad kernel is slow over a large vocabulary; this backward is one softmax and one
    scatter of the target entries (docs/benchmarks.md, "The Transformer at real scale", has the numbers)."""

    def __init__(self, label_smoothing: float = 0.0, ignore_index: int = -100):
        super().__init__()
        self.eps, self.ignore_index = label_smoothing, ignore_index
        self.softmax = ops.Softmax(-1)

    def rows(self, labels):
        keep = ops.cast(labels != self.ignore_index, ms.float32)
        return keep, ops.maximum(keep.sum(), 1.0)

    def construct(self, logits, labels):
        # log-sum-exp from the target's softmax probability: MindSpore's CPU Softmax kernel is faster than its
        # max/exp/sum reductions. A probability below 1e-30 counts as 1e-30 in the reported
        # value (a token's nll caps at 69); the gradient (bprop) is exact.
        index = ops.maximum(labels, 0).reshape(-1, 1)
        p_target = ops.gather_elements(self.softmax(logits), 1, index).reshape(-1)
        nll = -ops.log(ops.maximum(p_target, 1e-30))
        lse = ops.gather_elements(logits, 1, index).reshape(-1) + nll
        loss = (1 - self.eps) * nll + self.eps * (lse - logits.mean(-1))
        keep, n = self.rows(labels)
        return (loss * keep).sum() / n

    def bprop(self, logits, labels, out, dout):
        keep, n = self.rows(labels)
        w = (keep * dout / n).reshape(-1, 1)
        grad = (self.softmax(logits) - self.eps / logits.shape[-1]) * w
        # each row has one target: read its entry, subtract, write it back. A plain scatter (no reduction) runs
        # on every backend (tensor_scatter_elements' reduction="add" is refused on Ascend), and is faster on CPU
        index = ops.maximum(labels, 0).reshape(-1, 1)
        target = ops.gather_elements(grad, 1, index) - (1 - self.eps) * w
        return ops.scatter(grad, 1, index, target), ops.zeros_like(labels)


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


class Top5(Top5CategoricalAccuracy):
    """Top-5 accuracy that is 1 for a network of 5 classes or fewer (every label is among its top 5), where
    MindSpore's own fails to broadcast its 5 guesses against fewer columns (a 2-class image folder)."""

    def update(self, *inputs):
        shape = tuple(inputs[0].shape)  # a Tensor's or an array's, without copying a vocabulary's logits
        if len(shape) == 2 and shape[1] <= self.k:
            self._correct_num += shape[0]
            self._samples_num += shape[0]
            return
        super().update(*inputs)


def metrics() -> dict:
    return {"top1": Top1CategoricalAccuracy(), "top5": Top5(), "loss": Loss()}
