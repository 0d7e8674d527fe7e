"""The CPU kernels in fp16 (O2/O3 on the CPU): tensors stay fp16 between the kernels and are computed in fp32
inside them, with no Cast around them. Each kernel's fp16 output and gradients equal its fp32 ones rounded to
fp16 (within an ulp where fp32 sums of another order round apart); on a CPU with AVX512-BF16 a convolution may
multiply in bf16 instead (what training runs there by default), and then equals the fp32 kernel on the
bf16-rounded operands, rounded once to fp16; the fp16 <-> fp32 conversions agree with numpy's on every CPU path
(AVX-512, F16C, portable), overflow included; and O2's BatchNorm keeps fp32 parameters without a precision flag."""
import ctypes
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops

from omegaconf import OmegaConf

from cpu_kernels import (LIBRARY, OMP_LIBRARY, configure, cpu_compute, cpu_flags, has_ops, library, settings,
                         weight_gradients, why_not)
from cpu_kernels.cells import CpuBatchNorm2d, CpuConv2d, CpuReLU, relayout_ops

pytestmark = pytest.mark.skipif(not has_ops(), reason=why_not())
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call(fname: str, arrays, dtype: bytes) -> int:
    """One of the library's element-wise exports on flat numpy arrays, as MindSpore calls it."""
    fn = getattr(ctypes.CDLL(str(library())), fname)
    k, n = len(arrays), arrays[0].size
    shapes = [(ctypes.c_int64 * 1)(n) for _ in range(k)]
    return fn(k, (ctypes.c_void_p * k)(*[a.ctypes.data for a in arrays]), (ctypes.c_int * k)(*[1] * k),
              (ctypes.POINTER(ctypes.c_int64) * k)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shapes]),
              (ctypes.c_char_p * k)(*[dtype] * k), None, None)


def edge_halves() -> np.ndarray:
    """Every fp16 bit pattern but the NaNs, and sums that overflow, tie and land in the subnormals."""
    every = np.arange(65536, dtype=np.uint16).view(np.float16)
    return every[~np.isnan(every)]


CONVERSIONS = """
import sys, numpy as np
sys.path.insert(0, {root!r})
from tests.test_cpu_half import call, edge_halves
import cpu_kernels
cpu_kernels.configure(half_isa={isa!r})
a = edge_halves()
rng = np.random.RandomState(0)
b = rng.permutation(a)
out = np.empty_like(a)
assert call("AddReluFwd", [a, b, out], b"float16") == 0
with np.errstate(over="ignore", invalid="ignore"):
    want = np.maximum((a.astype(np.float32) + b.astype(np.float32)).astype(np.float16), 0)
bad = np.flatnonzero(out.view(np.uint16) != want.view(np.uint16))
assert not bad.size, (a[bad[:5]], b[bad[:5]], out[bad[:5]], want[bad[:5]])
print("ok")
"""


@pytest.mark.parametrize("isa", ["portable", "f16c", "auto"])  # runtime.cpu_half_isa: AVX-512 where the CPU has it
def test_the_conversions_round_as_numpy_on_every_path(isa):
    """The sum of two fp16 values, computed in fp32 and rounded to fp16 (ties to even, past 65504 to inf,
    subnormals exact), bit for bit as numpy rounds it, on each conversion path a CPU may take."""
    out = subprocess.run([sys.executable, "-c", CONVERSIONS.format(root=ROOT, isa=isa)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_relu_and_its_gradient_equal_numpys(dtype):
    x = np.random.RandomState(0).randn(70001).astype(dtype)  # several chunks and threads, and a tail
    x[:3] = [np.nan, -np.inf, np.inf]
    dy = np.random.RandomState(1).randn(70001).astype(dtype)
    y, dx = np.empty_like(x), np.empty_like(x)
    name = b"float16" if dtype == np.float16 else b"float32"
    assert call("ReluFwd", [x, y], name) == 0 and call("ReluBwd", [y, dy, dx], name) == 0
    assert np.isnan(y[0]) and y[1] == 0 and y[2] == np.inf  # a NaN reaches the loss scale's check
    np.testing.assert_array_equal(y[3:], np.maximum(x[3:], 0))
    np.testing.assert_array_equal(dx, np.where(y > 0, dy, 0))


def test_fp16_relu_and_its_gradient_on_the_bits_equal_the_fp32_ops_on_every_value():
    """The fp16 ReLU selects on the bits (no conversion): on all 65,536 patterns, NaNs and -0 among them, it and its
    gradient give what the fp32 ops give on the same values, rounded back."""
    x = np.arange(65536, dtype=np.uint16).view(np.float16)
    dy = np.resize(edge_halves(), x.size)[np.random.RandomState(3).permutation(x.size)]
    y16, dx16 = np.empty_like(x), np.empty_like(x)
    x32, y32, dx32 = x.astype(np.float32), np.empty(x.size, np.float32), np.empty(x.size, np.float32)
    assert call("ReluFwd", [x, y16], b"float16") == 0 and call("ReluFwd", [x32, y32], b"float32") == 0
    assert call("ReluBwd", [x, dy, dx16], b"float16") == 0  # y = every pattern, as the gradient's mask
    assert call("ReluBwd", [x32, dy.astype(np.float32), dx32], b"float32") == 0
    nan = np.isnan(x)
    assert np.isnan(y16[nan]).all() and np.isnan(y32[nan]).all()
    np.testing.assert_array_equal(y16[~nan].view(np.uint16), y32[~nan].astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(dx16.view(np.uint16), dx32.astype(np.float16).view(np.uint16))


def grads_of(cell, *inputs):
    """The cell's output and the gradients of sum(output * weights) for its inputs, in graph mode."""
    class Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.cell = cell

        def construct(self, *xs):
            y = self.cell(*xs)  # weights exact in fp16, so the gradient reaching the cell is the same in both dtypes
            w = ops.arange(y.size).reshape(y.shape).astype(ms.float32).sin().astype(ms.float16).astype(ms.float32)
            return (y.astype(ms.float32) * w).sum()
    out = cell(*inputs)
    grads = ms.grad(Loss(), grad_position=tuple(range(len(inputs))))(*inputs)
    return out, grads if isinstance(grads, tuple) else (grads,)


def as_half(*arrays):
    return [ms.Tensor(a.astype(np.float16)) for a in arrays]


def test_add_relu_in_fp16_rounds_the_fp32_result_once(graph_mode):
    from ampzoo.engine.network import KernelAddReLU
    rng = np.random.RandomState(2)
    a, b = rng.randn(2, 16, 5, 5).astype(np.float32), rng.randn(2, 16, 5, 5).astype(np.float32)
    y16, (da16, db16) = grads_of(KernelAddReLU(), *as_half(a, b))
    a16, b16 = a.astype(np.float16).astype(np.float32), b.astype(np.float16).astype(np.float32)
    y32, (da32, db32) = grads_of(KernelAddReLU(), ms.Tensor(a16), ms.Tensor(b16))
    assert y16.dtype == da16.dtype == ms.float16
    np.testing.assert_array_equal(y16.asnumpy(), y32.asnumpy().astype(np.float16))
    np.testing.assert_array_equal(da16.asnumpy(), da32.asnumpy().astype(np.float16))
    np.testing.assert_array_equal(db16.asnumpy(), da16.asnumpy())
    relu16, (dr16,) = grads_of(CpuReLU(), *as_half(a))
    np.testing.assert_array_equal(relu16.asnumpy(), np.maximum(a.astype(np.float16), 0))
    assert dr16.dtype == ms.float16


def ulps(a, b) -> float:
    """How far fp16 `a` is from fp32 `b`, in units of fp16's spacing at b (0.5 at most when a is b rounded)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    spacing = np.spacing(np.abs(b).astype(np.float16)).astype(np.float32)
    return float(np.max(np.abs(a - b) / spacing))


@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 1), (2, 0)])
def test_conv_in_fp16_is_fp32_rounded_once(graph_mode, fp32_products, stride, padding):
    """fp16 input and weights in, fp16 out, computed in fp32: the output and both gradients are the fp32
    kernel's on the same (fp16) values, rounded to fp16, within an ulp."""
    rng = np.random.RandomState(3)
    k = 3 if padding else 1
    x, w = rng.randn(2, 16, 8, 8).astype(np.float32), (rng.randn(32, 16, k, k) * 0.2).astype(np.float32)
    conv16 = CpuConv2d(16, 32, k, stride, padding, weight_init=ms.Tensor(w.astype(np.float16)))
    conv32 = CpuConv2d(16, 32, k, stride, padding,
                       weight_init=ms.Tensor(w.astype(np.float16).astype(np.float32)))
    y16, (dx16,) = grads_of(conv16, *as_half(x))
    y32, (dx32,) = grads_of(conv32, ms.Tensor(x.astype(np.float16).astype(np.float32)))
    assert y16.dtype == dx16.dtype == ms.float16
    assert ulps(y16.asnumpy(), y32.asnumpy()) <= 1.01 and ulps(dx16.asnumpy(), dx32.asnumpy()) <= 1.01


def to_bf16(a) -> np.ndarray:
    """fp32 values rounded to the nearest bf16 (to even), as fp32."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000).astype(np.uint32).view(np.float32)


BF16_CPU = {"avx512_bf16", "avx512f", "f16c"} <= cpu_flags()


def bf16_conv_check(stride: int, padding: int) -> None:
    """The body of the bf16 convolution test, run in a process of its own: oneDNN's bf16 kernels need its ISA
    uncapped, and this test process caps it at AVX2 (conftest)."""
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.RandomState(4)
    k = 3 if padding else 1
    x = rng.randn(2, 16, 8, 8).astype(np.float16).astype(np.float32)
    w = (rng.randn(32, 16, k, k) * 0.2).astype(np.float16).astype(np.float32)
    n_out = 2 * 32 * (((8 + 2 * padding - k) // stride) + 1) ** 2
    dy = ((np.arange(n_out) % 7 - 3) / 4).astype(np.float32)  # exact in fp16 and bf16

    def run(dtype, x_values, w_values):
        conv = CpuConv2d(16, 32, k, stride, padding, weight_init=ms.Tensor(w_values.astype(dtype)))
        weight = ms.Tensor(dy.reshape(2, 32, -1))

        def loss(inp):
            return (conv(inp).astype(ms.float32).reshape(2, 32, -1) * weight).sum()
        xt = ms.Tensor(x_values.astype(dtype))
        dx, (dw,) = ms.grad(loss, grad_position=0, weights=conv.trainable_params())(xt)
        return conv(xt), dx, dw

    y16, dx16, dw16 = run(np.float16, x, w)
    y32, dx32, dw32 = run(np.float32, to_bf16(x), to_bf16(w))
    assert y16.dtype == dx16.dtype == dw16.dtype == ms.float16
    for name, got, want in (("y", y16, y32), ("dx", dx16, dx32), ("dw", dw16, dw32)):
        assert ulps(got.asnumpy(), want.asnumpy()) <= 1.01, name
    as_stored_check()  # the fp32 weight rounded to fp16, then to bf16, inside the kernel
    configure(compute="fp32")  # and the fp32 path differs from it
    y16_fp32, dx16_fp32, _ = run(np.float16, x, w)
    assert not np.array_equal(y16_fp32.asnumpy(), y16.asnumpy())
    configure(compute="bf16_backward")  # the forward of fp32 compute, the gradients of bf16
    y16_b, dx16_b, dw16_b = run(np.float16, x, w)
    np.testing.assert_array_equal(y16_b.asnumpy(), y16_fp32.asnumpy())
    np.testing.assert_array_equal(dx16_b.asnumpy(), dx16.asnumpy())
    np.testing.assert_array_equal(dw16_b.asnumpy(), dw16.asnumpy())


def bf16_blocked_check(size: int = 8, stride: int = 1, channels: int = 32, batch: int = 4) -> None:
    """A 3x3 convolution between blocked layers. On a small plane (ResNet's 8x8 and 4x4 stages; where oneDNN has
    no AMX, up to 14x14 and at stride 2) conv.cc computes its bf16 weight gradient as one matmul over an im2col of
    x (MatmulWeights, unless runtime.cpu_weight_grad=direct); where oneDNN's bf16 kernels take channels-last tensors
    (AMX), the fp16 blocked activations go to and from them in one pass each (conv.cc's fused Arg), on the pool's
    threads at 16x16. With 64 input channels the matmul reads its im2col in oneDNN's own blocked layout
    (conv.cc's `blocked`), zero rows padding it to a multiple of 32 (an odd number of rows with batch 3 at 7x7).
    y, dx and dw are the fp32 kernel's on bf16-rounded operands within an ulp of fp16, the padding's zeros
    included, for an fp16 weight and for an fp32 master weight taken as stored."""
    ms.set_context(mode=ms.GRAPH_MODE)
    to_blocked, to_plain = relayout_ops(16)
    rng = np.random.RandomState(6)
    x = rng.randn(batch, channels, size, size).astype(np.float16).astype(np.float32)
    w = (rng.randn(64, channels, 3, 3) * 0.1).astype(np.float16).astype(np.float32)
    plane = ((size - 1) // stride + 1) ** 2
    dy = ms.Tensor(((np.arange(batch * 64 * plane) % 7 - 3) / 4).astype(np.float32).reshape(batch, 64, plane))

    def run(x_dtype, w_dtype, x_values, w_values):
        conv = CpuConv2d(channels, 64, 3, stride, 1, weight_init=ms.Tensor(w_values.astype(w_dtype)), out_block=16)

        def loss(inp):
            return (to_plain(conv(to_blocked(inp))).astype(ms.float32).reshape(batch, 64, -1) * dy).sum()
        xt = ms.Tensor(x_values.astype(x_dtype))
        dx, (dw,) = ms.grad(loss, grad_position=0, weights=conv.trainable_params())(xt)
        return to_plain(conv(to_blocked(xt))), dx, dw

    want = run(np.float32, np.float32, to_bf16(x), to_bf16(w))
    for w_dtype in (np.float16, np.float32):
        got = run(np.float16, w_dtype, x, w)
        assert got[2].dtype == (ms.float16 if w_dtype == np.float16 else ms.float32)
        for name, g, ref in zip(("y", "dx", "dw"), got, want):
            g, ref = g.asnumpy().astype(np.float32), ref.asnumpy()
            # an ulp of fp16, and the fp32 reference's own summation error where terms cancel to near zero
            spacing = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float32)
            assert np.all(np.abs(g - ref) <= 1.01 * spacing + 2.0 ** -20 * np.abs(ref).max()), (name, w_dtype)


def as_stored_check() -> None:
    """O2 hands CpuConv2d its fp32 master weight as stored (no Cast): the output and every gradient are bit for
    bit those of the same network whose weights MindSpore casts to fp16 and back."""
    from omegaconf import OmegaConf
    from ampzoo.amp.policy import apply_policy, compute_dtype

    class Loss(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def construct(self, x):
            return (self.net(x) * ops.arange(8 * 8).reshape(8, 8).astype(ms.float32).sin()).sum()

    rng = np.random.RandomState(5)
    x = ms.Tensor(rng.randn(2, 16, 8, 8).astype(np.float32))
    w1, w2 = (ms.Tensor((rng.randn(16, 16, 3, 3) * 0.1).astype(np.float32)) for _ in range(2))
    out = {}
    for as_stored in (True, False):
        net = nn.SequentialCell([CpuConv2d(16, 16, 3, 1, 1, weight_init=w1), CpuReLU(),
                                 CpuConv2d(16, 16, 3, 1, 1, weight_init=w2)])
        for cell in (net[0], net[2]):
            cell.weights_as_stored = as_stored
        net, _ = apply_policy(net, OmegaConf.create({"level": "O2", "dtype": "float16", "keep_fp32": [],
                                                     "force_fp16": []}))
        conv = net.cells_and_names()
        assert all(compute_dtype(c) == "float16" for _, c in conv if isinstance(c, CpuConv2d))
        loss = Loss(net)
        value, grads = ms.value_and_grad(loss, grad_position=0, weights=net.trainable_params())(x)
        out[as_stored] = [value.asnumpy(), grads[0].asnumpy(), *(g.asnumpy() for g in grads[1])]
        assert all(g.dtype == ms.float32 for g in grads[1])
    for got, want in zip(out[True], out[False]):
        np.testing.assert_array_equal(got, want)


def test_o2_hands_the_conv_its_fp32_weight_as_stored_and_changes_no_number(graph_mode):
    as_stored_check()


def run_bf16_check(module: str, call: str, weight_grad: str = "auto") -> None:
    """tests.<module>.<call> in a process of its own with the kernels configured for bf16 products (and
    `weight_grad`) and oneDNN's full ISA (this process caps it below bf16), asserting it printed ok."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "ALL", "GLOG_v": "3"}
    env.pop("AMP_ZOO_ONEDNN_AUTO", None)
    name = call.split("(")[0]
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); import cpu_kernels; "
            f"cpu_kernels.configure(compute='bf16', weight_grad={weight_grad!r}); from tests.{module} import {name}; "
            f"{call}; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.skipif(not BF16_CPU, reason="this CPU has no AVX512-BF16: fp16 convolutions multiply in fp32 here")
@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 0)])
def test_conv_in_fp16_on_a_bf16_cpu_is_fp32_on_bf16_operands_rounded_once(stride, padding):
    """runtime.cpu_compute=bf16 (a CPU with AVX512-BF16): the output, dx and dw are the fp32 kernel's on x, w and
    dy rounded to bf16, summed in fp32 and rounded once to fp16, within an ulp of fp16."""
    run_bf16_check("test_cpu_half", f"bf16_conv_check({stride}, {padding})")


@pytest.mark.skipif(not BF16_CPU, reason="this CPU has no AVX512-BF16: fp16 convolutions multiply in fp32 here")
@pytest.mark.parametrize("weight_grad, size, stride, channels, batch",
                         [("auto", 8, 1, 32, 4), ("direct", 8, 1, 32, 4), ("auto", 4, 1, 32, 4),
                          ("auto", 14, 1, 64, 4), ("auto", 7, 1, 64, 3), ("direct", 7, 1, 64, 3),
                          ("auto", 16, 2, 64, 4), ("direct", 16, 2, 32, 4)])
def test_bf16_conv_between_blocked_layers_is_fp32_on_bf16_operands(weight_grad, size, stride, channels, batch):
    """A bf16 convolution between blocked layers, its weight gradient as one matmul (conv.cc's MatmulWeights: 8x8
    and smaller at stride 1, and stride 2 where oneDNN has no AMX) or as oneDNN's direct kernel
    (runtime.cpu_weight_grad=direct, or 16x16 at stride 1), that kernel in oneDNN on OpenMP where oneDNN has no
    AMX (omp_weights.cc: a primitive per thread on its share of the batch, 1 and 2 images of 3; in MindSpore's
    under runtime.cpu_weight_grad=threadpool, the next test). Where the OpenMP one runs, it takes the 8x8 and
    14x14 planes at stride 1 from the matmul (MatmulWeights::OpenMpFirst), so 4x4 with 32 channels keeps the
    matmul's plain im2col covered there. y, dx and dw each within an ulp of the fp32 kernel's."""
    run_bf16_check("test_cpu_half", f"bf16_blocked_check({size}, {stride}, {channels}, {batch})", weight_grad)


def plain_weights_check(ci: int, co: int, k: int, size: int, stride: int, padding: int, batch: int) -> None:
    """A bf16 convolution between plain (NCHW) layers, LeNet's kind: its weight gradient is conv.cc's own
    (PlainWeights, under runtime.cpu_weight_grad=auto), within an ulp of fp16 of the fp32 kernel's on bf16-rounded
    operands, for an fp16 weight and an fp32 master weight taken as stored; and bit for bit the same on one
    thread as on two, so a training run's numbers do not depend on the threads or on how busy the machine is."""
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.RandomState(7)
    x = rng.randn(batch, ci, size, size).astype(np.float16).astype(np.float32)
    w = (rng.randn(co, ci, k, k) * 0.2).astype(np.float16).astype(np.float32)
    plane = ((size + 2 * padding - k) // stride + 1) ** 2
    dy = ms.Tensor(((np.arange(batch * co * plane) % 7 - 3) / 4).astype(np.float32).reshape(batch, co, plane))

    def run(x_dtype, w_dtype, x_values, w_values):
        conv = CpuConv2d(ci, co, k, stride, padding, weight_init=ms.Tensor(w_values.astype(w_dtype)))

        def loss(inp):
            return (conv(inp).astype(ms.float32).reshape(batch, co, -1) * dy).sum()
        (dw,) = ms.grad(loss, grad_position=None, weights=conv.trainable_params())(ms.Tensor(x_values.astype(x_dtype)))
        return dw.asnumpy().astype(np.float32)

    want = run(np.float32, np.float32, to_bf16(x), to_bf16(w))
    spacing = np.spacing(np.abs(want).astype(np.float16)).astype(np.float32)
    two = {}
    for w_dtype in (np.float16, np.float32):
        two[w_dtype] = got = run(np.float16, w_dtype, x, w)
        assert np.all(np.abs(got - want) <= 1.01 * spacing + 2.0 ** -20 * np.abs(want).max()), w_dtype
    configure(compute="bf16", threads=1)
    for w_dtype in (np.float16, np.float32):
        np.testing.assert_array_equal(run(np.float16, w_dtype, x, w), two[w_dtype])


@pytest.mark.skipif(not BF16_CPU, reason="this CPU has no AVX512-BF16: fp16 convolutions multiply in fp32 here")
@pytest.mark.parametrize("ci, co, k, size, stride, padding, batch",
                         [(1, 6, 5, 32, 1, 0, 4), (6, 16, 5, 14, 1, 0, 3), (3, 5, 3, 9, 2, 1, 3),
                          (2, 4, 3, 40, 1, 1, 2), (1, 4, 1, 6, 1, 0, 2)])
def test_a_bf16_conv_between_plain_layers_has_its_own_weight_gradient_on_any_threads(ci, co, k, size, stride,
                                                                                      padding, batch):
    """LeNet's two convolutions (1 to 6 channels at 32x32, 6 to 16 at 14x14), a strided one with padding on an
    odd plane, rows longer than 32 positions, and a 1x1 one with fewer columns than threads: plain_weights_check."""
    run_bf16_check("test_cpu_half", f"plain_weights_check({ci}, {co}, {k}, {size}, {stride}, {padding}, {batch})")


@pytest.mark.skipif(not BF16_CPU, reason="this CPU has no AVX512-BF16: fp16 convolutions multiply in fp32 here")
def test_a_plain_layer_weight_gradient_runs_no_onednn_primitive_unless_direct():
    """Under runtime.cpu_weight_grad=auto LeNet's second convolution runs no oneDNN backward-weights primitive (its
    gemm-based and jit kernels cut the batch into a parallel region per image); =direct gives it back to oneDNN."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "ALL", "GLOG_v": "3", "ONEDNN_VERBOSE": "1"}
    env.pop("AMP_ZOO_ONEDNN_AUTO", None)
    runs = {}
    for weight_grad in ("auto", "direct"):
        code = (f"import sys; sys.path.insert(0, {ROOT!r}); import cpu_kernels; "
                f"cpu_kernels.configure(compute='bf16', threads=2, weight_grad={weight_grad!r}); "
                f"from tests.test_cpu_half import plain_weights_check; plain_weights_check(6, 16, 5, 14, 1, 0, 2); "
                f"print('ok')")
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert "ok" in result.stdout.splitlines(), result.stderr[-3000:]
        runs[weight_grad] = sum(",exec," in line and "backward_weights" in line and "bf16" in line
                                for line in result.stdout.splitlines())
    assert runs["auto"] == 0 and runs["direct"] > 0, runs


def verbose_weight_gradients(size: int = 16, weight_grad: str = "auto") -> list:
    """The problem strings of the bf16 backward-weights kernels a blocked size x size convolution (batch 4, two
    threads) ran, as oneDNN's verbose log names them, each with the build that ran it: "3.2" for the OpenMP one
    (its log lines start onednn_verbose,exec), "3.10" for MindSpore's (onednn_verbose,v1,primitive,exec); and
    ("matmul", "") for each run of MindSpore's bf16 matmul (conv.cc's MatmulWeights)."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "ALL", "GLOG_v": "3", "ONEDNN_VERBOSE": "1"}
    env.pop("AMP_ZOO_ONEDNN_AUTO", None)
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); import cpu_kernels; "
            f"cpu_kernels.configure(compute='bf16', threads=2, weight_grad={weight_grad!r}); "
            f"from tests.test_cpu_half import bf16_blocked_check; bf16_blocked_check({size}, 1, 32, 4); print('ok')")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "ok" in result.stdout.splitlines(), result.stderr[-3000:]
    runs = []
    for line in result.stdout.splitlines():
        fields = line.split(",")
        if "backward_weights" in fields and "jit_bf16:avx512_core_bf16" in fields:
            build = "3.2" if fields[1] == "exec" else "3.10" if fields[1:4] == ["v1", "primitive", "exec"] else "?"
            runs.append((build, fields[-2].split("_")[0]))
        elif fields[1:4] == ["v1", "primitive", "exec"] and "matmul" in fields and "bf16" in line:
            runs.append(("matmul", ""))
    return runs


@pytest.mark.skipif(not BF16_CPU or "amx_bf16" in cpu_flags(), reason="the OpenMP weight gradient is for AVX512-BF16 "
                    "without AMX (this CPU has no AVX512-BF16, or oneDNN runs AMX here)")
def test_where_onednn_has_no_amx_the_weight_gradient_runs_on_openmp_a_primitive_per_thread():
    """With onednn-cpu-gomp installed (make install), a blocked bf16 convolution's direct weight gradient runs in
    that oneDNN, two images on each of the two threads; runtime.cpu_weight_grad=threadpool gives it back to
    MindSpore's oneDNN,
    the whole batch at once, and an 8x8 one back to the matmul. All within an ulp of the fp32 kernel
    (bf16_blocked_check). The status line says which runs (make doctor prints it)."""
    status = weight_gradients()
    assert status.startswith("oneDNN 3.") and status.endswith("(OpenMP)"), status
    assert sorted(set(verbose_weight_gradients())) == [("3.2", "mb2")]
    assert sorted(set(verbose_weight_gradients(weight_grad="threadpool"))) == [("3.10", "mb4")]
    # at 8x8 the OpenMP kernel takes the layer from the matmul (MatmulWeights::OpenMpFirst); off, the matmul has it
    assert sorted(set(verbose_weight_gradients(8))) == [("3.2", "mb2")]
    assert sorted(set(verbose_weight_gradients(8, weight_grad="threadpool"))) == [("matmul", "")]


def test_a_build_without_the_openmp_onednn_names_the_missing_file(tmp_path):
    """Without onednn-cpu-gomp (no libdnnl_omp.so beside the library) the status names the file it looked for;
    the kernels then run MindSpore's oneDNN, as under runtime.cpu_weight_grad=threadpool (the tests above)."""
    copy = tmp_path / LIBRARY
    shutil.copy(library(), copy)
    status = ctypes.CDLL(str(copy)).AmpZooOmpWeightsStatus
    status.restype = ctypes.c_char_p
    if "amx_bf16" in cpu_flags():
        assert status().decode().startswith("not used: MindSpore's oneDNN runs AMX here")
    else:
        assert status().decode() == f"not installed ({tmp_path / OMP_LIBRARY})"


@pytest.mark.parametrize("setting", ["fp32", "bf16", "bf16_backward"])
def test_cpu_compute_says_what_the_library_runs(monkeypatch, fp32_products, setting):
    """cpu_kernels.cpu_compute() (make doctor, a run's first lines) and runtime.cc choose alike for every
    runtime.cpu_compute: bf16 only when asked for, on a CPU with AVX512-BF16 and oneDNN not capped below it."""
    configure(compute=setting)
    lib = ctypes.CDLL(str(library()))
    assert cpu_compute() == ["fp32", "bf16", "bf16_backward"][lib.AmpZooBf16Compute()]
    assert cpu_compute({"avx512f", "f16c", "avx512_bf16"}, "bf16") == "fp32"  # under this process's AVX2 cap
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert cpu_compute({"avx2", "f16c"}, setting) == "fp32"
    for flags in ({"avx512f", "f16c", "avx512_bf16"}, {"avx512f", "f16c", "avx512_bf16", "avx512_fp16"}):
        assert cpu_compute(flags, setting) == (setting if setting.startswith("bf16") else "fp32")


def test_runtime_cpu_compute_sets_what_the_kernels_read(fp32_products):
    """runtime.cpu_compute (ampzoo.engine.network.set_cpu_compute, before a train step or an evaluation is built)
    reaches the kernels through cpu_kernels.configure, never the environment: a value is what they are asked; auto runs
    the training default and evaluates in fp32; a bad value names the valid ones."""
    from ampzoo.errors import ConfigError
    from ampzoo.engine.network import AUTO_IN_TRAINING, set_cpu_compute
    environment = dict(os.environ)
    set_cpu_compute("bf16_backward", training=True)
    assert settings().compute == "bf16_backward"
    set_cpu_compute("auto", training=False)  # evaluation computes in fp32
    assert settings().compute == "fp32"
    set_cpu_compute("auto", training=True)
    assert settings().compute == AUTO_IN_TRAINING
    assert dict(os.environ) == environment
    with pytest.raises(ConfigError, match="runtime.cpu_compute=bf8 is not valid; valid: auto, fp32, bf16"):
        set_cpu_compute("bf8", training=True)
    with pytest.raises(ValueError, match="weight_grad=fast is not valid; valid: auto, direct, threadpool"):
        configure(weight_grad="fast")


def test_the_old_variables_are_named_not_silently_ignored(monkeypatch, caplog, fp32_products):
    """AMP_ZOO_CPU_COMPUTE, AMP_ZOO_CONV_THREADS and the others are no longer read (the settings are config keys):
    a run that sets one is told once what to set instead."""
    from ampzoo.engine import network
    network._warn_old_variable.cache_clear()
    monkeypatch.setenv("AMP_ZOO_CPU_COMPUTE", "bf16")
    monkeypatch.setenv("AMP_ZOO_CONV_THREADS", "1")
    with caplog.at_level("WARNING", logger="amp_zoo"):
        for _ in range(2):
            network.set_cpu_settings(OmegaConf.create({"cpu_threads": 0}))
    said = sorted(r.getMessage() for r in caplog.records if "is no longer read" in r.getMessage())
    assert said == ["AMP_ZOO_CONV_THREADS=1 is no longer read: set runtime.cpu_threads=1",
                    "AMP_ZOO_CPU_COMPUTE=bf16 is no longer read: set runtime.cpu_compute=bf16"]
    assert settings().compute == "fp32" and settings().threads == 0


def batchnorm_in_training(channels: int, block: int, x: np.ndarray):
    """A new CpuBatchNorm2d in training on x: its output, then the gradients of a weighted sum of it (weights
    exact in fp16, so the gradient reaching it is the same in either dtype) for x, gamma and beta, and its moving
    statistics after those two steps."""
    norm = CpuBatchNorm2d(channels, block=block)
    norm.set_train()

    class Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.n = norm

        def construct(self, t):
            y = self.n(t)
            w = ops.arange(y.size).reshape(y.shape).astype(ms.float32).cos().astype(ms.float16)
            return (y.astype(ms.float32) * w.astype(ms.float32)).sum()
    y = norm(ms.Tensor(x)).asnumpy()
    grad = ops.GradOperation(get_all=True, get_by_list=True)(Loss(), ms.ParameterTuple(norm.trainable_params()))
    (dx,), (dgamma, dbeta) = grad(ms.Tensor(x))
    return (y, dx.asnumpy(), dgamma.asnumpy(), dbeta.asnumpy(), norm.moving_mean.asnumpy(),
            norm.moving_variance.asnumpy())


@pytest.mark.parametrize("block", [0, 16])
def test_batchnorm_takes_fp16_and_computes_in_fp32(graph_mode, block):
    """O2 keeps BatchNorm in fp32: on fp16 input its output and input gradient are the fp32 op's rounded to
    fp16, its parameter gradients and moving statistics the fp32 op's."""
    rng = np.random.RandomState(4)
    x = (rng.randn(4, 16, 6, 6) * 3 + 1).astype(np.float16)
    xs = [x, x.astype(np.float32)]
    if block:  # the blocked layout between the kernels: (N, C/16, H, W, 16)
        xs = [v.reshape(4, 1, 16, 6, 6).transpose(0, 1, 3, 4, 2).copy() for v in xs]
    (_, dx16, dg16, db16, mm16, mv16), (_, dx32, dg32, db32, mm32, mv32) = (batchnorm_in_training(16, block, v)
                                                                            for v in xs)
    assert dx16.dtype == np.float16
    assert ulps(dx16, dx32) <= 1.01
    np.testing.assert_allclose(dg16, dg32, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db16, db32, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mm16, mm32, rtol=1e-6)
    np.testing.assert_allclose(mv16, mv32, rtol=1e-6)


def test_blocked_fp16_batchnorm_is_the_fp32_ops_rounded_once(graph_mode):
    """In the blocked layout of 16 channels, fp16 BatchNorm reads and writes fp16 itself on an AVX-512 CPU: its
    output and input gradient are the fp32 op's on the same values rounded to fp16, bit for bit, and its batch
    statistics and parameter gradients the fp32 op's exactly (planes longer than its 256-position sums, and two
    blocks, one a thread)."""
    rng = np.random.RandomState(5)
    x = (rng.randn(3, 32, 20, 20) * 2 - 1).astype(np.float16).reshape(3, 2, 16, 20, 20).transpose(0, 1, 3, 4, 2).copy()
    half, single = (batchnorm_in_training(32, 16, v) for v in (x, x.astype(np.float32)))
    assert half[0].dtype == half[1].dtype == np.float16
    for got, want in zip(half[:2], single[:2]):
        np.testing.assert_array_equal(got.view(np.uint16), want.astype(np.float16).view(np.uint16))
    for got, want in zip(half[2:], single[2:]):
        np.testing.assert_array_equal(got, want)


def test_o2_keeps_cpu_batchnorm_fp32_without_casts():
    """amp.level=O2: the CPU BatchNorm gets no precision flag and no CastOutput (its kernel widens and rounds
    itself), its parameters stay fp32, and the precision report says it computes in fp32."""
    from omegaconf import OmegaConf

    from ampzoo.amp.policy import CastOutput, apply_policy, compute_dtype
    from ampzoo.engine.network import accelerate
    from ampzoo.models import create_model
    net = accelerate(create_model("resnet18", num_classes=10, stem="cifar", in_channels=1, width=16))
    amp_cfg = OmegaConf.create({"level": "O2", "dtype": "float16", "keep_fp32": None, "force_fp16": []})
    wrapped, _ = apply_policy(net, amp_cfg)
    norms = [c for _, c in wrapped.cells_and_names() if isinstance(c, CpuBatchNorm2d)]
    assert norms and all(compute_dtype(c) == "float32" for c in norms)
    assert not any(isinstance(c, CastOutput) and isinstance(c.cell, CpuBatchNorm2d)
                   for _, c in wrapped.cells_and_names())
    convs = [c for _, c in wrapped.cells_and_names() if isinstance(c, CpuConv2d)]
    assert all(compute_dtype(c) == "float16" for c in convs)
    x = ms.Tensor(np.random.RandomState(5).randn(2, 1, 8, 8).astype(np.float32))
    wrapped.set_train()
    assert wrapped(x).dtype == ms.float32
    assert all(p.dtype == ms.float32 for p in wrapped.get_parameters())


def test_a_network_of_your_own_takes_the_kernels_and_keeps_nchw_between_its_layers(graph_mode):
    """cpu_kernels.accelerate on a network written in mindspore.nn alone: its convolution, BatchNorm and ReLU become
    the kernels' Cells, a blocked stage reorders inside itself only, and the output is the plain network's."""
    from cpu_kernels.accelerate import accelerate, runs_kernels
    rng = np.random.RandomState(6)
    w = ms.Tensor((rng.randn(16, 3, 3, 3) * 0.2).astype(np.float32))

    def build():
        return nn.SequentialCell([nn.Conv2d(3, 16, 3, pad_mode="pad", padding=1, has_bias=False, weight_init=w),
                                  nn.BatchNorm2d(16), nn.ReLU()])
    plain, ours = build(), accelerate(build())
    assert runs_kernels(ours) and not runs_kernels(plain)
    assert [type(c).__name__ for c in ours.cell_list] == ["CpuConv2d", "CpuBatchNorm2d", "CpuReLU"]
    plain.set_train(False)
    ours.set_train(False)
    x = ms.Tensor(rng.randn(2, 3, 8, 8).astype(np.float32))
    got, want = ours(x), plain(x)
    assert got.shape == want.shape == (2, 16, 8, 8)
    np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-4, atol=1e-5)
