"""LeNet-5's written-out max-pool backward against MindSpore's own MaxPool2d: the same values and gradients,
ties included (the gradient goes to each window's first maximum)."""
import numpy as np
import pytest

import mindspore as ms
import mindspore.nn as nn

from models.lenet import MaxPool2x2


class Probe(nn.Cell):
    def __init__(self, pool):
        super().__init__()
        self.pool = pool

    def construct(self, x, g):
        return (self.pool(x) * g).sum()


@pytest.mark.parametrize("ties", [False, True])
def test_maxpool_backward_matches_mindspores(graph_mode, ties):
    rng = np.random.RandomState(0)
    x = rng.randn(4, 6, 28, 28).astype(np.float32)
    if ties:  # ReLU outputs: zeros everywhere, and equal values inside windows
        x = np.maximum(np.round(x), 0).astype(np.float32)
    g = rng.randn(4, 6, 14, 14).astype(np.float32)
    ours, theirs = MaxPool2x2(), nn.MaxPool2d(kernel_size=2, stride=2)
    np.testing.assert_array_equal(ours(ms.Tensor(x)).asnumpy(), theirs(ms.Tensor(x)).asnumpy())
    grad = lambda pool: ms.jit(ms.grad(Probe(pool), grad_position=0))(ms.Tensor(x), ms.Tensor(g)).asnumpy()  # noqa: E731
    np.testing.assert_array_equal(grad(ours), grad(theirs))
    assert isinstance(ours, nn.MaxPool2d)  # keep_fp32 / force_fp16 lists naming MaxPool2d still reach it
