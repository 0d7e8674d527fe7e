"""CpuConv2d (cpu_kernels/cells.py): oneDNN's direct convolution kernels as MindSpore custom ops on the CPU.
Its forward and both gradients equal MindSpore's own nn.Conv2d within fp32 rounding, for every stride, kernel
and padding ResNet uses; under fp16 it rounds as nn.Conv2d does; ResNet builds it and a checkpoint moves
between the two; and where it cannot run, ResNet gets nn.Conv2d. The ImageNet stem's max-pool (CpuMaxPool3x3)
equals nn.MaxPool2d's too, and CpuBatchNorm2d nn.BatchNorm2d's: output, gradients and moving statistics."""
import numpy as np
import pytest

import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops

from cpu_kernels import check, cpu_flags, has_ops, why_not
from cpu_kernels import cells as cpu_conv
from cpu_kernels.build import build
from cpu_kernels.cells import CpuConv2d
from ampzoo.models import create_model
from tests.conftest import built_with, pool_grad, run_cli

pytestmark = pytest.mark.skipif(not has_ops(), reason=why_not())


class Loss(nn.Cell):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def construct(self, x, target):
        return ((self.conv(x) - target) ** 2).sum()


class Grads(nn.Cell):
    """The convolution's output, and the loss's gradients for its input and its weight."""

    def __init__(self, conv):
        super().__init__()
        self.loss = Loss(conv)
        self.weights = ms.ParameterTuple(conv.trainable_params())
        self.grad = ops.GradOperation(get_all=True, get_by_list=True)

    def construct(self, x, target):
        return self.loss.conv(x), self.grad(self.loss, self.weights)(x, target)


def rel(a, b) -> float:
    a, b = a.asnumpy().astype(np.float64), b.asnumpy().astype(np.float64)
    return float(np.abs(a - b).max() / np.abs(a).max())


@pytest.mark.parametrize("batch,cin,cout,size,k,stride", [
    (4, 16, 16, 8, 3, 1),    # a basic block's 3x3
    (4, 16, 32, 9, 3, 2),    # the strided 3x3 that opens a stage (odd size: the padding's edge)
    (2, 16, 32, 8, 1, 2),    # the 1x1 strided shortcut
    (2, 3, 8, 15, 7, 2),     # the ImageNet stem
    (4, 1, 8, 7, 3, 1),      # the 1-channel CIFAR stem of the Fashion-MNIST recipes
])
def test_forward_and_gradients_equal_mindspores_conv2d(graph_mode, batch, cin, cout, size, k, stride):
    rng = np.random.RandomState(0)
    w = ms.Tensor(rng.randn(cout, cin, k, k).astype(np.float32) * 0.2)
    ours = CpuConv2d(cin, cout, k, stride, k // 2, weight_init=w)
    ref = nn.Conv2d(cin, cout, k, stride=stride, pad_mode="pad" if k > 1 else "valid", padding=k // 2,
                    has_bias=False, weight_init=w)
    x = ms.Tensor(rng.randn(batch, cin, size, size).astype(np.float32))
    target = ms.Tensor(rng.randn(*ref(x).shape).astype(np.float32))
    (y0, (dx0, dw0)), (y1, (dx1, dw1)) = Grads(ref)(x, target), Grads(ours)(x, target)
    assert y1.shape == y0.shape
    assert rel(y0, y1) < 1e-5 and rel(dx0[0], dx1[0]) < 1e-5 and rel(dw0[0], dw1[0]) < 1e-5


@pytest.mark.parametrize("cin,size,k,stride,padding", [
    (3, 15, 7, 2, 3),   # the ImageNet stem
    (1, 8, 3, 1, 1),    # the Fashion-MNIST CIFAR-style stem
    (1, 12, 5, 1, 0),   # LeNet-5's first convolution
])
def test_a_first_layer_takes_the_weight_gradient_alone_and_equal(graph_mode, cin, size, k, stride, padding):
    """input_grad=False (a network's first layer): the weight gradient is nn.Conv2d's; no input gradient is
    computed, and a training step's gradients by weight, which is all train.py takes, are unchanged."""
    rng = np.random.RandomState(3)
    w = ms.Tensor(rng.randn(8, cin, k, k).astype(np.float32) * 0.2)
    first = CpuConv2d(cin, 8, k, stride, padding, weight_init=w, input_grad=False)
    ref = nn.Conv2d(cin, 8, k, stride=stride, pad_mode="pad" if padding else "valid", padding=padding,
                    has_bias=False, weight_init=w)
    x = ms.Tensor(rng.randn(4, cin, size, size).astype(np.float32))
    target = ms.Tensor(rng.randn(*ref(x).shape).astype(np.float32))
    by_weight = ops.GradOperation(get_by_list=True)
    dw0 = by_weight(Loss(ref), ms.ParameterTuple(ref.trainable_params()))(x, target)[0]
    dw1 = by_weight(Loss(first), ms.ParameterTuple(first.trainable_params()))(x, target)[0]
    assert rel(first(x), ref(x)) < 1e-5 and rel(dw0, dw1) < 1e-5
    dx = ops.GradOperation()(Loss(first))(x, target)
    assert not dx.asnumpy().any()  # not computed: zeros, where the full backward's would not be


@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE])  # train.py; amp.audit runs Cells in PyNative
def test_under_fp16_it_rounds_as_mindspores_conv2d(mode):
    ms.set_context(mode=mode)
    rng = np.random.RandomState(1)
    w = ms.Tensor(rng.randn(8, 4, 3, 3).astype(np.float32) * 0.2)
    ours, ref = CpuConv2d(4, 8, 3, 1, 1, weight_init=w), nn.Conv2d(4, 8, 3, pad_mode="pad", padding=1,
                                                                    has_bias=False, weight_init=w)
    ours.to_float(ms.float16)
    ref.to_float(ms.float16)
    x = ms.Tensor(rng.randn(2, 4, 6, 6).astype(np.float32))
    target = ms.Tensor(rng.randn(2, 8, 6, 6).astype(np.float32))
    (y0, (dx0, dw0)), (y1, (dx1, dw1)) = Grads(ref)(x, target), Grads(ours)(x, target)
    assert y0.dtype == y1.dtype == ms.float16
    # fp16 output: the two differ by at most an ulp where fp32 sums of another order round apart
    assert rel(y0, y1) < 2e-3 and rel(dx0[0], dx1[0]) < 5e-3 and rel(dw0[0], dw1[0]) < 5e-3
    ms.set_context(mode=ms.GRAPH_MODE)


def test_resnet_uses_it_and_checkpoints_move_between_the_two(graph_mode, tmp_path):
    """runtime.cpu_kernels=auto builds the CPU kernels' Cells, off MindSpore's; a checkpoint saved from either
    loads into the other (the same parameter names) and gives the same outputs."""
    fast = built_with("auto", lambda: create_model("resnet18", num_classes=10, stem="cifar", in_channels=1, width=8))
    convs = [c for _, c in fast.cells_and_names() if isinstance(c, nn.Conv2d)]
    assert convs and all(isinstance(c, CpuConv2d) for c in convs)
    block = cpu_conv.block_for
    assert convs[0].conv is cpu_conv.conv_op(1, 1, False, block(8))  # the stem: its input takes no gradient
    assert all(c.conv is cpu_conv.conv_op(c.stride[0], c.padding, True, block(c.out_channels)) for c in convs[1:])
    plain = built_with("off", lambda: create_model("resnet18", num_classes=10, stem="cifar", in_channels=1, width=8))
    assert not any(type(c).__name__.startswith("Cpu") for _, c in plain.cells_and_names())
    assert [p.name for p in fast.get_parameters()] == [p.name for p in plain.get_parameters()]
    x = ms.Tensor(np.random.RandomState(2).randn(2, 1, 12, 12).astype(np.float32))
    for source, target in ((fast, plain), (plain, fast)):
        ms.save_checkpoint(source, str(tmp_path / "one.ckpt"))
        assert ms.load_param_into_net(target, ms.load_checkpoint(str(tmp_path / "one.ckpt")), strict_load=True)[0] == []
        source.set_train(False)
        target.set_train(False)
        assert rel(source(x), target(x)) < 1e-5
        for p in source.get_parameters():  # a different start for the other direction
            p.set_data(p.value() * 0.5)


def test_models_are_mindspores_layers_until_accelerate_swaps_them():
    """A model is built from MindSpore's Conv2d, BatchNorm2d and MaxPool2d (LeNet's written-out MaxPool2x2), and so
    it stays under runtime.cpu_kernels=off; accelerate swaps each for the CPU kernels' Cell, a subclass of it."""
    from ampzoo.engine.network import accelerate
    from ampzoo.models import layers
    made = nn.SequentialCell([layers.conv2d(4, 8, 3, 1, 1), nn.BatchNorm2d(8), layers.max_pool2d(3, 2, 1),
                              layers.max_pool2d(2, 2)])
    assert [type(c) for c in made] == [nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, layers.MaxPool2x2]
    accelerate(made)
    assert [type(c).__name__ for c in made] == ["CpuConv2d", "CpuBatchNorm2d", "CpuMaxPool3x3", "CpuMaxPool2x2"]
    assert isinstance(made[0], nn.Conv2d) and isinstance(made[1], nn.BatchNorm2d)
    lenet = built_with("off", lambda: create_model("lenet5", num_classes=10))
    assert not any(type(c).__name__.startswith("Cpu") for _, c in lenet.cells_and_names())


@pytest.mark.parametrize("recipe,model", [("resnet34_o0", "resnet34"), ("lenet_o0", "lenet5")])
def test_export_writes_mindspores_own_conv2d(tmp_path, recipe, model):
    """An exported MINDIR must run where our library is not: export.py builds nn.Conv2d and LeNet's
    written-out MaxPool2x2."""
    ckpt = tmp_path / f"{model}.ckpt"
    ms.save_checkpoint(create_model(model, num_classes=10), str(ckpt))
    out = tmp_path / "model.mindir"
    exported = run_cli("export.py", f"recipe={recipe}", f"checkpoint={ckpt}", f"output={out}")
    assert exported.returncode == 0, exported.stderr[-2000:]
    data = out.read_bytes()
    assert b"Conv2D" in data and b"cpu_kernels" not in data and b"Custom" not in data


def test_builds_from_source(tmp_path):
    """What make install does on a fresh machine: compile the kernels against MindSpore's libdnnl, warnings as
    errors (as under CI), with a record of what they were built against that loading accepts."""
    out = build(tmp_path, werror=True)
    assert out.is_file() and out.stat().st_size > 10_000
    assert check(tmp_path) == (out, "")


@pytest.mark.parametrize("size", [(9, 9), (8, 10), (112, 112), (1, 2)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("ties", [False, True])
def test_stem_maxpool_equals_mindspores(graph_mode, size, dtype, ties):
    """CpuMaxPool3x3 (the ImageNet stem's 3x3/2, padding 1) against nn.MaxPool2d: the same values; the gradient
    goes to each window's first maximum, ties included (ReLU outputs). Windows overlap, so an element can take
    the gradient of several: in fp32 the sums are equal; in fp16 ours is summed in fp32 and rounded once, where
    MindSpore rounds after every addition (a few units in the last place apart)."""
    rng = np.random.RandomState(0)
    x = rng.randn(2, 3, *size).astype(np.float32)
    if ties:
        x = np.maximum(np.round(x), 0)
    x = ms.Tensor(x.astype(dtype))
    ours, theirs = cpu_conv.CpuMaxPool3x3(), nn.MaxPool2d(3, 2, pad_mode="pad", padding=1)
    y = ours(x)
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(y.asnumpy(), theirs(x).asnumpy())
    g = ms.Tensor(rng.randn(*y.shape).astype(dtype))
    mine, ref = pool_grad(ours, x, g), pool_grad(theirs, x, g)
    if dtype == np.float32:
        np.testing.assert_array_equal(mine, ref)
    else:
        exact = pool_grad(theirs, ms.Tensor(x.asnumpy().astype(np.float32)), ms.Tensor(g.asnumpy().astype(np.float32)))
        np.testing.assert_array_equal(mine, exact.astype(np.float16))  # the fp32 sum, rounded once
        # MindSpore's: a few units in the last place of the addends (|dy| < 8: units of at most 2^-8)
        np.testing.assert_allclose(mine.astype(np.float32), ref.astype(np.float32), rtol=0, atol=2 ** -6)
    assert isinstance(ours, nn.MaxPool2d)  # keep-lists naming MaxPool2d reach it


def test_stem_maxpool_keeps_a_nan(graph_mode):
    """A NaN stays its windows' maximum and takes their gradient, so the loss turns NaN and the loss scaler
    counts the step as overflowed."""
    rng = np.random.RandomState(1)
    x = rng.randn(1, 1, 6, 6).astype(np.float32)
    x[0, 0, 2, 3] = np.nan  # in the windows at output (1, 1) and (1, 2)
    g = rng.randn(1, 1, 3, 3).astype(np.float32)
    pool = cpu_conv.CpuMaxPool3x3()
    y = pool(ms.Tensor(x)).asnumpy()[0, 0]
    assert np.isnan(y[1, 1]) and np.isnan(y[1, 2]) and np.isfinite(np.delete(y.ravel(), [4, 5])).all()
    dx = pool_grad(pool, ms.Tensor(x), ms.Tensor(g))[0, 0]
    assert dx[2, 3] == np.float32(g[0, 0, 1, 1] + g[0, 0, 1, 2])


@pytest.mark.parametrize("size", [(9, 9), (8, 10), (28, 28)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("block", [16, 8])
def test_stem_maxpool_on_the_blocked_layout_is_the_nchw_ones(graph_mode, size, dtype, block):
    """The stem's pooling takes the blocked layout its BatchNorm and ReLU hand on (N, C/B, H, W, B) and returns
    it: the same values and gradients, bit for bit, as on NCHW, ties and a NaN included. Blocks of 16 run
    pool.cc's blocked loops on an AVX-512 CPU; other blocks, or a CPU without AVX-512, a reorder to NCHW and
    back."""
    rng = np.random.RandomState(2)
    x = np.maximum(np.round(rng.randn(2, 2 * block, *size) * 2), 0).astype(dtype)  # ties, as after a ReLU
    x[1, 3, 4, 5] = np.nan
    to_blocked, to_plain = cpu_conv.relayout_ops(block)
    pool = cpu_conv.CpuMaxPool3x3()
    assert pool.blocked == (16 if "avx512f" in cpu_flags() else 0)
    plain_x = ms.Tensor(x)
    y = pool(plain_x)
    g = ms.Tensor(rng.randn(*y.shape).astype(dtype))
    blocked_y = pool(to_blocked(plain_x))
    assert blocked_y.ndim == 5 and blocked_y.dtype == plain_x.dtype
    np.testing.assert_array_equal(to_plain(blocked_y).asnumpy(), y.asnumpy())
    dx = pool_grad(pool, plain_x, g)
    blocked_dx = pool_grad(pool, to_blocked(plain_x), to_blocked(g))
    np.testing.assert_array_equal(to_plain(ms.Tensor(blocked_dx)).asnumpy(), dx)


def test_resnet_stem_pools_on_the_cpu_kernel():
    """ResNet's ImageNet stem builds CpuMaxPool3x3 here, and nn.MaxPool2d for an export (cpu_kernels=off)."""
    assert type(built_with("auto", lambda: create_model("resnet18", num_classes=10, width=8)).stem[3]) \
        is cpu_conv.CpuMaxPool3x3
    assert type(built_with("off", lambda: create_model("resnet18", num_classes=10, width=8)).stem[3]) is nn.MaxPool2d


class NormGrads(nn.Cell):
    """A BatchNorm's output, and the gradients of sum(output * dy) for its input, gamma and beta."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm
        self.grad = ops.GradOperation(get_all=True, get_by_list=True)
        self.weights = ms.ParameterTuple([norm.gamma, norm.beta])

    def loss(self, x, dy):
        return (self.norm(x) * dy).sum()

    def construct(self, x, dy):
        return self.grad(self.loss, self.weights)(x, dy)


@pytest.mark.parametrize("mode", ["graph", "pynative"])
@pytest.mark.parametrize("shape", [(8, 16, 7, 9), (32, 4, 4, 4), (5, 3, 1, 1)])
def test_batchnorm_equals_mindspores_in_training(request, mode, shape):
    """Two training steps and an evaluation: the same output, gradients (input, gamma, beta) and moving
    statistics (MindSpore's: momentum 0.9, unbiased variance) as nn.BatchNorm2d, within fp32 rounding. Planes:
    7x9 (a remainder past the kernel's 8-lane sums), 4x4 (ResNet's last stage at 32x32) and 1x1 (under one 8-lane
    sum); compiled, and op by op as amp.audit runs cells."""
    request.getfixturevalue(f"{mode}_mode")
    rng = np.random.RandomState(0)
    x = ms.Tensor((rng.randn(*shape) * 3 + 2).astype(np.float32))  # an offset mean: the variance's cancellation
    dy = ms.Tensor(rng.randn(*shape).astype(np.float32))
    gamma, beta = rng.randn(shape[1]).astype(np.float32), rng.randn(shape[1]).astype(np.float32)
    results = []
    for norm in (cpu_conv.CpuBatchNorm2d(shape[1]), nn.BatchNorm2d(shape[1], momentum=0.9, eps=1e-5)):
        norm.gamma.set_data(ms.Tensor(gamma))
        norm.beta.set_data(ms.Tensor(beta))
        norm.set_train(True)
        grads = NormGrads(norm)
        for _ in range(2):
            (dx, _), (dgamma, dbeta) = grads(x, dy)
        y = norm(x)
        stats = [norm.moving_mean.value(), norm.moving_variance.value()]
        norm.set_train(False)
        results.append([y, dx, dgamma, dbeta, *stats, norm(x)])
    ours, theirs = results
    assert isinstance(ours[0], ms.Tensor) and ours[0].shape == shape
    for name, a, b in zip(["y", "dx", "dgamma", "dbeta", "moving_mean", "moving_variance", "eval y"], theirs, ours):
        assert rel(a, b) < 2e-6, name


def test_batchnorm_runs_mindspores_own_op_in_fp16(graph_mode):
    """O3 runs BatchNorm in fp16: CpuBatchNorm2d hands it to MindSpore's BatchNorm, so O3's numbers are
    MindSpore's; a ResNet built here has CpuBatchNorm2d, and keep-lists naming BatchNorm reach it."""
    x = ms.Tensor(np.random.RandomState(0).randn(4, 8, 5, 5).astype(np.float16))
    ours, theirs = cpu_conv.CpuBatchNorm2d(8), nn.BatchNorm2d(8, momentum=0.9, eps=1e-5)
    for norm in (ours, theirs):
        norm.to_float(ms.float16)
        norm.set_train(True)
    np.testing.assert_array_equal(ours(x).asnumpy(), theirs(x).asnumpy())
    net = built_with("auto", lambda: create_model("resnet18", num_classes=10, width=8))
    norms = [c for _, c in net.cells_and_names() if isinstance(c, nn.BatchNorm2d)]
    assert len(norms) == 20 and all(type(c) is cpu_conv.CpuBatchNorm2d for c in norms)
    assert type(built_with("off", lambda: create_model("resnet18", num_classes=10, width=8)).stem[1]) is nn.BatchNorm2d


LIFT_PROBE = """
import os, sys
import mindspore as ms, numpy as np
from omegaconf import OmegaConf
ms.set_device("CPU")
from ampzoo.runtime import onednn_note
from ampzoo.engine.network import build_model
model = {"resnet18": {"stem": "cifar", "in_channels": 1}, "lenet5": {"in_channels": 1}}[sys.argv[1]]
net = build_model(OmegaConf.create({"model": {"name": sys.argv[1], "num_classes": 10, "params": model},
                                    "runtime": {"cpu_kernels": sys.argv[2], "onednn_isa": "auto"}}))
print("isa:", os.environ.get("ONEDNN_MAX_CPU_ISA"))
print("note:", onednn_note())
net.set_train(False)
net(ms.Tensor(np.ones((2, 1, 32, 32), np.float32))).asnumpy()
"""


@pytest.mark.parametrize("model, kernels_mode, lifted", [("resnet18", "auto", True), ("lenet5", "auto", True),
                                                         ("lenet5", "off", False)])
def test_the_avx2_cap_is_lifted_only_for_a_network_without_mindspores_convolutions(model, kernels_mode, lifted):
    """build_model sets oneDNN's cap after MindSpore is imported and before the first kernel, and oneDNN obeys
    it (ONEDNN_VERBOSE names the kernels that ran): LeNet with runtime.cpu_kernels=off (MindSpore's Conv2D,
    20-130x slower above AVX2) gets AVX2 and the gemm kernel, never the reference one; a ResNet or LeNet whose
    convolutions all run CpuConv2d gets the CPU's full ISA (AVX-512 kernels where the CPU has them). A cap
    inherited from an amp-zoo parent is decided afresh; one the user set stays."""
    import os
    import platform
    import subprocess
    import sys

    from tests.conftest import ROOT
    from cpu_kernels import AUTO_CAP
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the oneDNN cap is set on x86 only")
    avx512 = "avx512f" in open("/proc/cpuinfo").read()
    clean = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", AUTO_CAP)}
    runs = {"auto": clean, "inherited": {**clean, "ONEDNN_MAX_CPU_ISA": "ALL" if not lifted else "AVX2",
                                         AUTO_CAP: "1"},
            "user": {**clean, "ONEDNN_MAX_CPU_ISA": "AVX2"}}
    for name, env in runs.items():
        out = subprocess.run([sys.executable, "-c", LIFT_PROBE, model, kernels_mode], cwd=ROOT, capture_output=True,
                             text=True, timeout=600, env={**env, "PYTHONPATH": str(ROOT), "ONEDNN_VERBOSE": "1"})
        assert out.returncode == 0, out.stderr[-2000:]
        isa = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("isa:"))
        kernels = {line.split(",")[6] for line in out.stdout.splitlines() if ",exec,cpu,convolution," in line}
        assert kernels and not any("ref" in k for k in kernels), (name, kernels)
        if name == "user":
            assert isa == "AVX2" and "set by the user" in out.stdout, out.stdout[:500]
        elif lifted:
            assert isa == "ALL", (name, out.stdout[:500])
            assert any("avx512" in k for k in kernels) == avx512, (name, kernels)
        else:
            assert isa == "AVX2" and kernels == {"x64:gemm:jit"}, (name, isa, kernels)


class NetGrads(nn.Cell):
    """A network's loss (cross-entropy) and its gradients for every weight."""

    def __init__(self, net):
        super().__init__()
        self.net, self.loss = net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        self.weights = ms.ParameterTuple(net.trainable_params())
        self.grad = ops.GradOperation(get_by_list=True)

    def loss_of(self, x, y):
        return self.loss(self.net(x), y)

    def construct(self, x, y):
        return self.loss_of(x, y), self.grad(self.loss_of, self.weights)(x, y)


@pytest.mark.parametrize("block,model,stem,size,width", [
    *[(b, m, s, n, 16) for b in (16, 8) for m, s, n in [("resnet18", "cifar", 12), ("resnet18", "imagenet", 64)]],
    (8, "resnet50", "imagenet", 64, 16),
    pytest.param(16, "resnet50", "imagenet", 64, 16, marks=pytest.mark.slow),
    (16, "resnet18", "imagenet", 64, 8),  # 8 channels stay NCHW (the stem, its max-pool, layer1), 16 and up blocked
    (8, "resnet18", "cifar", 12, 12)])    # 12 channels NCHW, 24 and up blocked
def test_a_resnet_in_the_blocked_layout_trains_as_mindspores(graph_mode, monkeypatch, block, model, stem, size,
                                                             width):
    """On the CPU a ResNet keeps its activations in oneDNN's blocked layout (nChw16c on AVX-512, nChw8c on AVX2)
    between its kernels: its loss, every weight's gradient, the moving statistics after two steps and the
    evaluation output equal the same network's built from MindSpore's own Conv2d and BatchNorm (NCHW), where a
    layer of a channel count that the block does not divide stays NCHW. Compiled (train.py's mode): MindSpore
    keeps one gradient per custom op name, so two convolutions sharing one would get each other's. ResNet-50's
    gradients are left out: at these sizes a random Bottleneck network's are chaotic (a 1e-6 change to the input
    moves them by 20%, in MindSpore's own network too), so only its forward numbers compare."""
    monkeypatch.setattr(cpu_conv, "onednn_runs_avx512", lambda: block == 16)
    ms.set_seed(0)
    net = built_with("auto", lambda: create_model(model, num_classes=10, stem=stem, in_channels=3, width=width))
    norms = [c for _, c in net.cells_and_names() if isinstance(c, cpu_conv.CpuBatchNorm2d)]
    assert norms and all(c.block == (block if c.num_features % block == 0 else 0) for c in norms)
    plain = built_with("off", lambda: create_model(model, num_classes=10, stem=stem, in_channels=3, width=width))
    ms.load_param_into_net(plain, {p.name: p.clone() for p in net.get_parameters()})
    rng = np.random.RandomState(3)
    x = ms.Tensor(rng.randn(8, 3, size, size).astype(np.float32))
    y = ms.Tensor(rng.randint(0, 10, 8).astype(np.int32))
    results = []
    for one in (plain, net):
        one.set_train(True)
        step = NetGrads(one)
        for _ in range(2):
            loss, grads = step(x, y)
        stats = [p.value() for p in one.get_parameters() if "moving" in p.name]
        one.set_train(False)
        results.append((loss, grads, stats, one(x)))
    (loss0, grads0, stats0, out0), (loss1, grads1, stats1, out1) = results
    assert abs(float(loss0.asnumpy()) - float(loss1.asnumpy())) < 1e-5 * abs(float(loss0.asnumpy()))
    assert len(grads0) == len(grads1) == len(net.trainable_params())
    for p, a, b in zip(net.trainable_params(), grads0, grads1):
        assert model == "resnet50" or rel(a, b) < 1e-4, p.name
    for a, b in zip(stats0, stats1):
        assert rel(a, b) < 1e-4  # fp32 sums of another order, through up to 50 layers
    assert rel(out0, out1) < 1e-4


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_blocked_batchnorm_evaluates_and_runs_fp16_as_mindspores(graph_mode, dtype):
    """In the blocked layout, evaluation (both dtypes) and fp16 training (O3) hand MindSpore's BatchNorm an NCHW
    copy: the same numbers as nn.BatchNorm2d on the NCHW tensor, back in blocks."""
    rng = np.random.RandomState(0)
    x = (rng.randn(4, 16, 5, 5) * 2 + 1).astype(dtype)
    blocked = ms.Tensor(x.reshape(4, 2, 8, 5, 5).transpose(0, 1, 3, 4, 2).copy())
    ours, theirs = cpu_conv.CpuBatchNorm2d(16, block=8), nn.BatchNorm2d(16, momentum=0.9, eps=1e-5)
    for norm in (ours, theirs):
        norm.moving_mean.set_data(ms.Tensor(rng.randn(16).astype(np.float32)))
        if dtype == np.float16:
            norm.to_float(ms.float16)
    theirs.moving_mean.set_data(ours.moving_mean.value())
    for training in ([True] if dtype == np.float16 else []) + [False]:
        ours.set_train(training)
        theirs.set_train(training)
        got = ours(blocked).asnumpy()
        assert got.shape == (4, 2, 5, 5, 8)
        want = theirs(ms.Tensor(x)).asnumpy()
        np.testing.assert_array_equal(got.transpose(0, 1, 4, 2, 3).reshape(4, 16, 5, 5), want)


@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE])
def test_a_wrong_channel_count_is_named(mode):
    """A forked model that feeds CpuConv2d the wrong number of channels hears which, not the kernel's error
    code (train.py reports it as its one error line)."""
    ms.set_context(mode=mode)
    try:
        conv = CpuConv2d(3, 8, 3, 1, 1)
        with pytest.raises(ValueError, match=r"the input has 1 channels, but this layer takes in_channels=3"):
            conv(ms.Tensor(np.ones((2, 1, 6, 6), np.float32)))
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
