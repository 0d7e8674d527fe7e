"""Convolutions for MindSpore's CPU backend that run oneDNN's direct kernels (models/cpu_conv.cc).

MindSpore 2.10 hands oneDNN plain NCHW tensors for Conv2D and its two gradients, which leaves oneDNN only its
im2col + sgemm path; PyTorch lets oneDNN pick a blocked layout and runs its direct kernels (in one ResNet-18 step,
ONEDNN_VERBOSE=1: 3.9 s of convolution kernels against PyTorch's 2.6 s). `CpuConv2d` is `nn.Conv2d` (the same
parameter, the same checkpoint) whose forward and backward are AOT custom ops doing what PyTorch does, built once
from cpu_conv.cc against MindSpore's own oneDNN with the oneDNN headers from PyPI (onednn-devel) and g++.

Between these kernels a ResNet keeps its activations in oneDNN's blocked layout (`activation_block`: nChw16c
or nChw8c as (N, C/B, H, W, B) tensors), so no reorder runs into or out of each convolution; the ops read a
tensor's layout from its rank, and `relayout_ops` moves a tensor between NCHW and blocks.

The same library holds cpu_pool.cc: the 2x2 max-pooling of LeNet (`CpuMaxPool2x2`) and the 3x3/2 of ResNet's
ImageNet stem (`CpuMaxPool3x3`), forward and backward in one pass each, where MindSpore's MaxPoolGrad,
MaxPool3DWithArgmax and a written-out gradient were slow. And cpu_norm.cc: training-mode BatchNorm
(`CpuBatchNorm2d`), forward and backward a channel at a time on the same threads, where MindSpore's BatchNorm and
BatchNormGrad took twice PyTorch's time.

Used only on the CPU, for groups=1, no dilation and no bias (ResNet's convolutions). Anything else, another
device, AMP_ZOO_CPU_CONV=0, `with mindspore_conv():`, or a machine where the library cannot be built (no g++,
no headers) gets MindSpore's own Conv2D (ResNet's stem nn.MaxPool2d, LeNet its MaxPool2x2): the same numbers,
slower. `make install` builds it (build_report) and says where, or why not.
"""
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Optional

import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops

from zoo.runtime import onednn_runs_avx512

log = logging.getLogger("amp_zoo")
SOURCES = [Path(__file__).with_name(f"cpu_{name}.cc") for name in ("conv", "pool", "norm")]
BUILD_DIR = Path(__file__).resolve().parent / "_build"
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-w"]  # -O3: at -O2 g++ 12 leaves the pooling loops scalar
STRIDES, PADDINGS = (1, 2), (0, 1, 2, 3)  # the variants cpu_conv.cc exports
WHY_NOT = []  # why the library is not used, once known
_OFF = [0]  # > 0 inside mindspore_conv()


def headers() -> Optional[Path]:
    """oneDNN's include folder from the onednn-devel wheel (requirements-data.txt), in this environment."""
    for root in {sys.prefix, sysconfig.get_paths()["data"]}:
        path = Path(root) / "include"
        if (path / "oneapi" / "dnnl" / "dnnl.hpp").is_file():
            return path
    return None


def mindspore_lib() -> Path:
    return Path(ms.__file__).resolve().parent / "lib"


def build(out: Path) -> Path:
    """Compile cpu_conv.cc, cpu_pool.cc and cpu_norm.cc into `out` (atomically: parallel builds do not clash);
    raises RuntimeError."""
    include = headers()
    if include is None:
        raise RuntimeError("the oneDNN headers are not installed (pip install --no-deps onednn-devel==2026.1.0)")
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        # MindSpore's libdnnl runs on the threadpool runtime; the wheel's headers are configured for SYCL
        config = (include / "oneapi" / "dnnl" / "dnnl_config.h").read_text()
        for key in ("DNNL_CPU_THREADING_RUNTIME", "DNNL_CPU_RUNTIME"):
            config = re.sub(rf"#define {key} \S+", f"#define {key} DNNL_RUNTIME_THREADPOOL", config)
        config = re.sub(r"#define DNNL_GPU_RUNTIME \S+", "#define DNNL_GPU_RUNTIME DNNL_RUNTIME_NONE", config)
        (Path(tmp) / "oneapi" / "dnnl").mkdir(parents=True)
        (Path(tmp) / "oneapi" / "dnnl" / "dnnl_config.h").write_text(config)
        lib = mindspore_lib()
        partial = Path(tmp) / out.name
        cmd = [compiler, *FLAGS, f"-I{tmp}", f"-I{include}", *map(str, SOURCES),
               "-o", str(partial), f"-L{lib}", "-l:libdnnl.so.3", f"-Wl,-rpath,{lib}", "-pthread"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"g++ failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}")
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, out)
    return out


@lru_cache(maxsize=1)
def library() -> Optional[Path]:
    """The built library (building it the first time), or None with the reason in WHY_NOT."""
    if os.environ.get("AMP_ZOO_CPU_CONV", "1") == "0":
        WHY_NOT.append("AMP_ZOO_CPU_CONV=0")
        return None
    built_from = b"".join(f.read_bytes() for f in SOURCES) + " ".join([ms.__version__, *FLAGS]).encode()
    tag = hashlib.sha256(built_from).hexdigest()[:12]
    out = BUILD_DIR / f"cpu_conv-{tag}.so"
    if out.is_file():
        return out
    try:
        return build(out)
    except (RuntimeError, OSError) as e:
        WHY_NOT.append(str(e))
        log.warning("MindSpore's own Conv2D is used on the CPU (slower): %s", e)
        return None


def runs_here() -> bool:
    """Whether the library's kernels (CpuConv2d, CpuMaxPool2x2/3x3, CpuBatchNorm2d) run here: on the CPU, outside
    mindspore_conv(), the library built."""
    return not _OFF[0] and ms.get_context("device_target") == "CPU" and library() is not None


def usable(stride: int, padding: int) -> bool:
    """Whether CpuConv2d runs this convolution here: a variant the library exports, and runs_here()."""
    return stride in STRIDES and padding in PADDINGS and runs_here()


@contextmanager
def mindspore_conv():
    """Networks built inside this block get MindSpore's own nn.Conv2d (export.py; bench.speed's baseline)."""
    _OFF[0] += 1
    try:
        yield
    finally:
        _OFF[0] -= 1


def _out_size(size: int, k: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - k) // stride + 1


@lru_cache(maxsize=None)
def conv_op(stride: int, padding: int, input_grad: bool = True, out_block: int = 0):
    """The forward custom op (x, w -> y) for one stride and padding, with its backward (x, w, dy -> dx, dw).
    x is plain NCHW or blocked (see activation_block; the kernel reads which from its rank); y is blocked by
    `out_block` channels, or plain (0).
    input_grad=False: a network's first layer. Its input is data and takes no gradient, so the backward computes
    dw alone (dx is zeros that the graph drops). That is what MindSpore's own Conv2D does when its dx goes unused;
    it took the 224x224 stem's forward and backward from 248 to 117 ms."""
    lib = library()
    if input_grad:
        backward = ops.Custom(f"{lib}:ConvBwd_s{stride}_p{padding}", out_shape=lambda x, w, dy: (x, w),
                              out_dtype=lambda x, w, dy: (x, w), func_type="aot")

        def bprop(x, w, out, dout):
            dx, dw = backward(x, w, dout)
            return dx, dw
    else:
        weights_only = ops.Custom(f"{lib}:ConvBwdW_s{stride}_p{padding}", out_shape=lambda x, w, dy: w,
                                  out_dtype=lambda x, w, dy: w, func_type="aot")

        def bprop(x, w, out, dout):
            return ops.zeros_like(x), weights_only(x, w, dout)

    def shape(x, w):
        h, w_ = _out_size(x[2], w[2], stride, padding), _out_size(x[3], w[3], stride, padding)
        return [x[0], w[0] // out_block, h, w_, out_block] if out_block else [x[0], w[0], h, w_]

    # one name per variant: MindSpore's graph mode gave two custom ops of one name one gradient (cpu_conv.cc)
    name = f"ConvFwd{'' if input_grad else 'First'}{'B' if out_block else ''}_s{stride}_p{padding}"
    return ops.Custom(f"{lib}:{name}", out_shape=shape, out_dtype=lambda x, w: x, func_type="aot", bprop=bprop)


class CpuConv2d(nn.Conv2d):
    """nn.Conv2d (pad_mode "pad" or "valid", no bias) whose forward and backward run oneDNN's direct kernels.
    It computes in fp32 like MindSpore's CPU Conv2D, with casts around the kernel as MindSpore has around its
    own: under fp16 its input is widened and its output rounded to fp16. out_block: its output in the blocked
    layout (activation_block), else plain NCHW; its input may be either."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, weight_init=None,
                 input_grad=True, out_block=0):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride,
                         pad_mode="pad" if padding else "valid", padding=padding, has_bias=False,
                         weight_init=weight_init)
        self.conv = conv_op(stride, padding, input_grad, out_block)

    def construct(self, x):
        channels = x.shape[1] * x.shape[4] if x.ndim == 5 else x.shape[1]  # NCHW, or blocked (activation_block)
        if channels != self.in_channels:  # the kernel's own answer would be an error code
            raise ValueError(f"CpuConv2d: the input has {channels} channels, but this layer takes "
                             f"in_channels={self.in_channels} (input shape {x.shape})")
        if x.dtype == ms.float32 and self.weight.dtype == ms.float32:
            return self.conv(x, self.weight)
        # fp16 (AMP): MindSpore's Cast kernels widen far faster than oneDNN's f16 reorders on AVX2. In PyNative
        # MindSpore casts every op's inputs back to fp16; the kernel widens those itself (amp.audit's path)
        return self.conv(x.astype(ms.float32), self.weight.astype(ms.float32)).astype(x.dtype)


def conv2d(in_channels, out_channels, kernel_size, stride=1, padding=0, weight_init=None,
           input_grad=True, out_block=0) -> nn.Conv2d:
    """A bias-free square convolution: CpuConv2d where it runs (see `usable`), else nn.Conv2d. input_grad=False
    for a network's first layer (see conv_op); nn.Conv2d finds that out by itself. out_block: CpuConv2d's output
    layout (activation_block gives it only where CpuConv2d runs)."""
    if usable(stride, padding):
        return CpuConv2d(in_channels, out_channels, kernel_size, stride, padding, weight_init, input_grad, out_block)
    return nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, pad_mode="pad" if padding else "valid",
                     padding=padding, has_bias=False, weight_init=weight_init)


def runs_mindspore_conv(net: nn.Cell) -> bool:
    """Whether `net` runs one of MindSpore's own convolutions (a Conv Cell other than CpuConv2d, or a Cell holding
    a Conv primitive), which oneDNN runs 20-130x slower above AVX2 (zoo.runtime.settle_onednn_isa). A model that
    calls ops.conv2d inside construct is not seen: give it runtime.onednn_isa=AVX2."""
    from mindspore.nn.layer.conv import _Conv
    for _, cell in net.cells_and_names():
        if isinstance(cell, CpuConv2d):
            continue
        if isinstance(cell, _Conv) or any("conv" in type(p).__name__.lower()
                                          for p in getattr(cell, "_primitives", {}).values() if p is not None):
            return True
    return False


def activation_block(widths) -> int:
    """The layout a ResNet's activations take between the library's kernels: 16 or 8, oneDNN's blocked nChw16c
    or nChw8c, held as a (N, C/B, H, W, B) tensor with channel c at block c // B, lane c % B; or 0, plain NCHW.
    oneDNN's direct kernels run in the blocked layout (16 channels a vector on AVX-512, 8 on AVX2), so a network
    that stays in it skips the reorders into and out of every kernel (on the Xeon, ONEDNN_VERBOSE=1: 176 ms of a
    ResNet-34 CIFAR-stem step's reorders fell to 60 ms, the weights'). Blocked only where the library runs and
    every width in `widths` (the network's channel counts) divides by the block."""
    if not runs_here():
        return 0
    for block in (16, 8) if onednn_runs_avx512() else (8,):
        if all(w % block == 0 for w in widths):
            return block
    return 0


@lru_cache(maxsize=None)
def relayout_ops(block: int):
    """(to_blocked, to_plain): NCHW -> (N, C/block, H, W, block) and back (oneDNN reorders, fp32 or fp16), each
    the other's gradient."""
    lib = library()

    def blocked(x):
        return [x[0], x[1] // block, x[2], x[3], block]

    def plain(x):
        return [x[0], x[1] * x[4], x[2], x[3]]

    def op(name, shape, bprop=None):  # one name a direction: graph mode gives each name one gradient (conv_op)
        return ops.Custom(f"{lib}:{name}", out_shape=shape, out_dtype=lambda x: x, func_type="aot", bprop=bprop)

    back_to_plain, back_to_blocked = op("ToPlain", plain), op("ToBlocked", blocked)

    def to_blocked_bprop(x, out, dout):
        return (back_to_plain(dout),)

    def to_plain_bprop(x, out, dout):
        return (back_to_blocked(dout),)

    return op("ToBlocked", blocked, to_blocked_bprop), op("ToPlain", plain, to_plain_bprop)


def _pooled(size: int, k: int) -> int:
    return size // 2 if k == 2 else (size - 1) // 2 + 1  # 2x2/2 "valid"; 3x3/2 with padding 1


@lru_cache(maxsize=None)
def max_pool_op(k: int = 2):
    """k x k max-pooling with stride 2 (x -> y; k=3 pads by 1) with its backward from cpu_pool.cc: x, dy -> dx
    (2x2), or x, y, dy -> dx (3x3: y locates each window's maximum)."""
    lib = library()
    if k == 2:
        backward = ops.Custom(f"{lib}:MaxPool2x2Bwd", out_shape=lambda x, dy: x, out_dtype=lambda x, dy: x,
                              func_type="aot")

        def bprop(x, out, dout):
            return (backward(x, dout),)
    else:
        backward = ops.Custom(f"{lib}:MaxPool3x3Bwd", out_shape=lambda x, y, dy: x, out_dtype=lambda x, y, dy: x,
                              func_type="aot")

        def bprop(x, out, dout):
            return (backward(x, out, dout),)

    return ops.Custom(f"{lib}:MaxPool{k}x{k}Fwd", out_shape=lambda x: [x[0], x[1], _pooled(x[2], k), _pooled(x[3], k)],
                      out_dtype=lambda x: x, func_type="aot", bprop=bprop)


class CpuMaxPool2x2(nn.MaxPool2d):
    """nn.MaxPool2d(2, 2) (for keep-lists and reports) running cpu_pool.cc's loops, in fp32 or fp16."""

    def __init__(self):
        super().__init__(kernel_size=2, stride=2)
        self.pool = max_pool_op(2)

    def construct(self, x):
        return self.pool(x)


class CpuMaxPool3x3(nn.MaxPool2d):
    """nn.MaxPool2d(3, 2, padding 1), the ImageNet stem's, running cpu_pool.cc's loops, in fp32 or fp16."""

    def __init__(self):
        super().__init__(kernel_size=3, stride=2, pad_mode="pad", padding=1)
        self.pool = max_pool_op(3)

    def construct(self, x):
        return self.pool(x)


def stem_max_pool() -> nn.MaxPool2d:
    """The ImageNet stem's 3x3/2 max-pool (padding 1): CpuMaxPool3x3 where the library runs, else nn.MaxPool2d."""
    if runs_here():
        return CpuMaxPool3x3()
    return nn.MaxPool2d(3, 2, pad_mode="pad", padding=1)


@lru_cache(maxsize=1)
def batch_norm_op():
    """Training BatchNorm from cpu_norm.cc: x, gamma, beta, moving mean, moving var, (momentum, eps) -> y, mean,
    invstd, new moving mean, new moving var; its backward x, gamma, mean, invstd, dy -> dx, dgamma, dbeta (and
    zeros for the moving statistics and hyper, which take no gradient)."""
    lib = library()
    backward = ops.Custom(f"{lib}:BatchNormBwd", out_shape=lambda x, g, m, i, dy: (x, g, g, g, g, [2]),
                          out_dtype=lambda x, g, m, i, dy: (x, g, g, g, g, g), func_type="aot")

    def bprop(x, gamma, beta, moving_mean, moving_var, hyper, out, dout):
        dx, dgamma, dbeta, dmean, dvar, dhyper = backward(x, gamma, out[1], out[2], dout[0])
        return dx, dgamma, dbeta, dmean, dvar, dhyper

    return ops.Custom(f"{lib}:BatchNormFwd", out_shape=lambda x, g, b, mm, mv, h: (x, g, g, g, g),
                      out_dtype=lambda x, g, b, mm, mv, h: (x, g, g, g, g), func_type="aot", bprop=bprop)


class CpuBatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d (the same parameters and checkpoint) whose training forward and backward run cpu_norm.cc's
    loops and write the moving statistics as MindSpore's BatchNorm does. In fp32 only; evaluation, and fp16 input
    (O3: BatchNorm in low precision), run MindSpore's own BatchNorm, so their numbers are MindSpore's. `block`:
    its input and output are in that blocked layout (activation_block), which MindSpore's BatchNorm gets as NCHW."""

    def __init__(self, num_features, eps=1e-5, momentum=0.9, gamma_init="ones", block=0):
        super().__init__(num_features, eps=eps, momentum=momentum, gamma_init=gamma_init)
        self.norm = batch_norm_op()
        self.hyper = ms.Tensor([momentum, eps], ms.float32)
        self.block = block
        self.to_blocked, self.to_plain = relayout_ops(block) if block else (None, None)

    def construct(self, x):
        if not self.training or x.dtype != ms.float32 or self.gamma.dtype != ms.float32:
            if self.block:
                return self.to_blocked(super().construct(self.to_plain(x)))
            return super().construct(x)
        y, _, _, mean, var = self.norm(x, self.gamma, self.beta, self.moving_mean, self.moving_variance, self.hyper)
        ops.assign(self.moving_mean, mean)
        ops.assign(self.moving_variance, var)
        return y


def batch_norm2d(num_features, eps=1e-5, momentum=0.9, gamma_init="ones", block=0) -> nn.BatchNorm2d:
    """BatchNorm over NCHW (or the blocked layout of `block` channels): CpuBatchNorm2d where the library runs
    (runs_here), else nn.BatchNorm2d."""
    if runs_here():
        return CpuBatchNorm2d(num_features, eps, momentum, gamma_init, block)
    return nn.BatchNorm2d(num_features, eps=eps, momentum=momentum, gamma_init=gamma_init)


def build_report() -> None:
    """make install: build the library now, and say where or why not (not fatal: nn.Conv2d is used instead)."""
    path = library()
    print(f"CPU convolutions: {path}" if path else f"note: CPU convolutions not built ({'; '.join(WHY_NOT)}); "
          f"ResNet uses MindSpore's own Conv2D, which is slower on the CPU")
