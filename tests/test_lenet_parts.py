"""LeNet-5's two max-pools against MindSpore's own MaxPool2d: the written-out backward (other devices, exports)
and CpuMaxPool2x2 (cpu_kernels/csrc/pool.cc, on the CPU) give the same values and gradients, ties included (the
gradient goes to each window's first maximum), in fp32 and fp16."""
import numpy as np
import pytest

import mindspore as ms
import mindspore.nn as nn

from cpu_kernels import has_ops, why_not
from cpu_kernels.cells import CpuMaxPool2x2
from ampzoo.models.layers import MaxPool2x2
from tests.conftest import built_with, pool_grad

built = pytest.mark.skipif(not has_ops(), reason=why_not())
POOLS = [MaxPool2x2, pytest.param(CpuMaxPool2x2, marks=built)]


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("size", [28, 10])  # LeNet's two poolings: rows of 14 windows (AVX2) and of 5
def test_maxpool_backward_matches_mindspores(graph_mode, pool, dtype, ties, size):
    rng = np.random.RandomState(0)
    x = rng.randn(4, 6, size, size).astype(np.float32)
    if ties:  # ReLU outputs: zeros everywhere, and equal values inside windows
        x = np.maximum(np.round(x), 0).astype(np.float32)
    x, g = ms.Tensor(x.astype(dtype)), ms.Tensor(rng.randn(4, 6, size // 2, size // 2).astype(dtype))
    ours, theirs = pool(), nn.MaxPool2d(kernel_size=2, stride=2)
    np.testing.assert_array_equal(ours(x).asnumpy(), theirs(x).asnumpy())
    assert ours(x).dtype == x.dtype
    np.testing.assert_array_equal(pool_grad(ours, x, g), pool_grad(theirs, x, g))
    assert isinstance(ours, nn.MaxPool2d)  # keep_fp32 / force_fp16 lists naming MaxPool2d still reach it


@built
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cpu_maxpool_odd_sizes_and_nan(graph_mode, dtype):
    """An odd last row and column are dropped, as MindSpore's "valid" pooling does. A NaN stays the window's
    maximum and takes its gradient, as in PyTorch (MindSpore's CPU kernel drops it), so the loss turns NaN
    and the loss scaler counts the step as overflowed instead of training on."""
    rng = np.random.RandomState(1)
    x = rng.randn(2, 3, 7, 9).astype(dtype)
    g = ms.Tensor(rng.randn(2, 3, 3, 4).astype(dtype))
    ours, theirs = CpuMaxPool2x2(), nn.MaxPool2d(kernel_size=2, stride=2)
    np.testing.assert_array_equal(ours(ms.Tensor(x)).asnumpy(), theirs(ms.Tensor(x)).asnumpy())
    np.testing.assert_array_equal(pool_grad(ours, ms.Tensor(x), g), pool_grad(theirs, ms.Tensor(x), g))
    x[0, 0, 1, 1] = np.nan  # in the first window, after its maximum would be
    y, dx = ours(ms.Tensor(x)).asnumpy(), pool_grad(ours, ms.Tensor(x), g)
    assert np.isnan(y[0, 0, 0, 0]) and np.isfinite(np.delete(y.ravel(), 0)).all()
    assert dx[0, 0, 1, 1] == g.asnumpy()[0, 0, 0, 0] and (dx[0, 0, :2, :2] != 0).sum() == 1


def test_lenet_pools_on_the_cpu_kernels_where_they_run(graph_mode):
    """The training network pools with CpuMaxPool2x2 on the CPU; an export (cpu_kernels=off) with MaxPool2x2."""
    from ampzoo.models import create_model
    assert type(built_with("off", lambda: create_model("lenet5", num_classes=10)).pool) is MaxPool2x2
    if has_ops():
        assert type(built_with("auto", lambda: create_model("lenet5", num_classes=10)).pool) is CpuMaxPool2x2


def first_max_pool(x, g):
    """The 2x2 pooling CpuMaxPool2x2 promises, in numpy: each window's first maximum in row-major order, or
    its first NaN; the odd last row and column dropped. Returns y and dx."""
    n, c, h, w = x.shape
    oh, ow = h // 2, w // 2
    win = x[:, :, :2 * oh, :2 * ow].reshape(n, c, oh, 2, ow, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, oh, ow, 4)
    nan = np.isnan(win)
    with np.errstate(invalid="ignore"):
        first = np.where(nan.any(-1), nan.argmax(-1), (win == np.nanmax(win, -1, keepdims=True)).argmax(-1))
    y = np.take_along_axis(win, first[..., None], -1)[..., 0]
    dwin = np.where(np.arange(4) == first[..., None], g[..., None], np.zeros((), x.dtype))  # +0 elsewhere
    dx = np.zeros_like(x)
    dx[:, :, :2 * oh, :2 * ow] = dwin.reshape(n, c, oh, ow, 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(
        n, c, 2 * oh, 2 * ow)
    return y, dx


@built
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape, nans", [
    ((3, 5, 11, 37), [(0, 0, 0, 5), (1, 2, 4, 30), (2, 4, 9, 35), (2, 1, 7, 16)]),  # 18 windows a row
    ((2, 3, 10, 10), [(1, 2, 3, 4)]),  # LeNet's second pooling: 5 windows a row
])
def test_cpu_maxpool_picks_the_first_maximum_bit_for_bit(graph_mode, dtype, shape, nans):
    """Rows of 18 windows (on the vectorized path where the CPU has AVX2: two blocks of 8, and a last block that
    overlaps the one before it) and rows of 5 (the scalar loop), odd sizes, ties everywhere, -0 beside +0, NaNs:
    values and gradients equal, bit for bit, the first-maximum rule, in float32 and float16."""
    rng = np.random.RandomState(3)
    x = rng.randint(-2, 3, shape).astype(np.float32)
    x[x == 0] = rng.choice([0.0, -0.0], (x == 0).sum())
    for at in nans:
        x[at] = np.nan
    g = rng.randn(shape[0], shape[1], shape[2] // 2, shape[3] // 2).astype(np.float32)
    x, g = x.astype(dtype), g.astype(dtype)
    y, dx = CpuMaxPool2x2()(ms.Tensor(x)).asnumpy(), pool_grad(CpuMaxPool2x2(), ms.Tensor(x), ms.Tensor(g))
    want_y, want_dx = first_max_pool(x, g)
    bits = np.uint32 if dtype == np.float32 else np.uint16
    np.testing.assert_array_equal(y.view(bits), want_y.view(bits))
    np.testing.assert_array_equal(dx.view(bits), want_dx.view(bits))


@built
def test_lenet_on_the_cpu_kernels_computes_what_mindspores_layers_compute(graph_mode):
    """LeNet-5 on the CPU kernels (CpuConv2d, the Dense layers' AffineFwd, CpuReLU, CpuMaxPool2x2) and on
    MindSpore's own layers (runtime.cpu_kernels=off, as export.py builds it): the same parameter names and
    shapes, so a checkpoint of one loads into the other, and in fp32 the same outputs and weight gradients."""
    from ampzoo.models import create_model
    ours = built_with("on", lambda: create_model("lenet5", num_classes=10))
    theirs = built_with("off", lambda: create_model("lenet5", num_classes=10))
    assert type(ours.conv1).__name__ == "CpuConv2d" and type(ours.fc1).__name__ == "CpuDense"
    assert [(p.name, p.shape) for p in ours.trainable_params()] == [(p.name, p.shape)
                                                                    for p in theirs.trainable_params()]
    ms.load_param_into_net(theirs, {p.name: ms.Parameter(p.value().copy(), p.name) for p in ours.get_parameters()})
    x = ms.Tensor(np.random.RandomState(2).randn(8, 1, 32, 32).astype(np.float32))

    def outputs_and_grads(net):
        def loss(x):
            return (net(x) ** 2).sum()
        grads = ms.grad(loss, None, net.trainable_params())(x)
        return [net(x).asnumpy()] + [g.asnumpy() for g in grads]
    for a, b in zip(outputs_and_grads(ours), outputs_and_grads(theirs)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
