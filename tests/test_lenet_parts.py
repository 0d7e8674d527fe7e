"""LeNet-5's two max-pools against MindSpore's own MaxPool2d: the written-out backward (other devices, exports)
and CpuMaxPool2x2 (models/cpu_pool.cc, on the CPU) give the same values and gradients, ties included (the
gradient goes to each window's first maximum), in fp32 and fp16."""
import numpy as np
import pytest

import mindspore as ms
import mindspore.nn as nn

from models import cpu_conv
from models.cpu_conv import CpuMaxPool2x2
from models.lenet import MaxPool2x2
from tests.conftest import pool_grad


POOLS = [MaxPool2x2, pytest.param(CpuMaxPool2x2, marks=pytest.mark.skipif(
    not cpu_conv.runs_here(), reason="the CPU kernel library is not built; make install builds it (needs g++)"))]


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("ties", [False, True])
def test_maxpool_backward_matches_mindspores(graph_mode, pool, dtype, ties):
    rng = np.random.RandomState(0)
    x = rng.randn(4, 6, 28, 28).astype(np.float32)
    if ties:  # ReLU outputs: zeros everywhere, and equal values inside windows
        x = np.maximum(np.round(x), 0).astype(np.float32)
    x, g = ms.Tensor(x.astype(dtype)), ms.Tensor(rng.randn(4, 6, 14, 14).astype(dtype))
    ours, theirs = pool(), nn.MaxPool2d(kernel_size=2, stride=2)
    np.testing.assert_array_equal(ours(x).asnumpy(), theirs(x).asnumpy())
    assert ours(x).dtype == x.dtype
    np.testing.assert_array_equal(pool_grad(ours, x, g), pool_grad(theirs, x, g))
    assert isinstance(ours, nn.MaxPool2d)  # keep_fp32 / force_fp16 lists naming MaxPool2d still reach it


@pytest.mark.skipif(not cpu_conv.runs_here(), reason="the CPU kernel library is not built")
def test_cpu_maxpool_odd_sizes_and_nan(graph_mode):
    """An odd last row and column are dropped, as MindSpore's "valid" pooling does. A NaN stays the window's
    maximum and takes its gradient, as in PyTorch (MindSpore's CPU kernel drops it), so the loss turns NaN
    and the loss scaler counts the step as overflowed instead of training on."""
    rng = np.random.RandomState(1)
    x = rng.randn(2, 3, 7, 9).astype(np.float32)
    g = ms.Tensor(rng.randn(2, 3, 3, 4).astype(np.float32))
    ours, theirs = CpuMaxPool2x2(), nn.MaxPool2d(kernel_size=2, stride=2)
    np.testing.assert_array_equal(ours(ms.Tensor(x)).asnumpy(), theirs(ms.Tensor(x)).asnumpy())
    np.testing.assert_array_equal(pool_grad(ours, ms.Tensor(x), g), pool_grad(theirs, ms.Tensor(x), g))
    x[0, 0, 1, 1] = np.nan  # in the first window, after its maximum would be
    y, dx = ours(ms.Tensor(x)).asnumpy(), pool_grad(ours, ms.Tensor(x), g)
    assert np.isnan(y[0, 0, 0, 0]) and np.isfinite(np.delete(y.ravel(), 0)).all()
    assert dx[0, 0, 1, 1] == g.asnumpy()[0, 0, 0, 0] and (dx[0, 0, :2, :2] != 0).sum() == 1


def test_lenet_pools_on_the_cpu_kernels_where_they_run(graph_mode):
    """The training network pools with CpuMaxPool2x2 on the CPU; an export (mindspore_conv) with MaxPool2x2."""
    from models import create_model
    with cpu_conv.mindspore_conv():
        plain = create_model("lenet5", num_classes=10)
    assert type(plain.pool) is MaxPool2x2
    if cpu_conv.runs_here():
        assert type(create_model("lenet5", num_classes=10).pool) is CpuMaxPool2x2
