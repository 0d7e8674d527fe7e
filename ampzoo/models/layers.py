"""The layers the zoo's convolutional networks are built from (convolution, batch norm, max-pool), each from the
implementation `runtime.cpu_kernels` picks, as timm's layers/config.py picks its layers:

    auto  the CPU kernels of the cpu_kernels extension on the CPU where they are built; MindSpore's own kernels
          elsewhere, and where they are not built (one warning says why)
    on    the CPU kernels; without them (not built, a oneDNN mismatch, not the CPU) an error
    off   MindSpore's own kernels (export.py, and Conv+BN folding, whose Conv2d takes a bias)

Either way a layer is the MindSpore Cell (the CPU kernels' Cells subclass nn.Conv2d, nn.BatchNorm2d and
nn.MaxPool2d), with the same parameters, so a checkpoint of one loads into the other. build_model sets the
switch from the config before it builds a network (set_cpu_kernels); a network built outside a command gets
`auto`.
"""
import logging
import os
from functools import lru_cache

import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops

from ampzoo.config import CpuCompute
from ampzoo.errors import ConfigError

log = logging.getLogger("amp_zoo")
CHOICES = ("auto", "on", "off")
_cpu_kernels = "auto"  # runtime.cpu_kernels of the networks built next (set_cpu_kernels)


def set_cpu_kernels(mode: str) -> None:
    """runtime.cpu_kernels for the layers built from now on: auto, on or off."""
    global _cpu_kernels
    if str(mode) not in CHOICES:
        raise ConfigError(f"runtime.cpu_kernels={mode} is not valid; valid: {', '.join(CHOICES)}")
    _cpu_kernels = str(mode)


COMPUTE_CHOICES = tuple(c.value for c in CpuCompute)
AUTO_IN_TRAINING = "bf16"  # runtime.cpu_compute=auto in training, where the CPU runs it (docs/configuration.md)


# what the kernels read from the environment before their settings were config keys
OLD_VARIABLES = {"AMP_ZOO_CPU_COMPUTE": "runtime.cpu_compute", "AMP_ZOO_CONV_COMPUTE": "runtime.cpu_compute",
                 "AMP_ZOO_CONV_THREADS": "runtime.cpu_threads", "AMP_ZOO_POOL_SPIN_US": "runtime.cpu_pool_spin_us"}


@lru_cache(maxsize=None)
def _warn_old_variable(name: str, value: str) -> None:  # cached: each warning comes once a process
    log.warning("%s=%s is no longer read: set %s=%s", name, value, OLD_VARIABLES[name], value)


def set_cpu_settings(runtime_cfg) -> None:
    """The kernels' pool and weight-gradient settings from the config (runtime.cpu_threads, cpu_pool_spin_us,
    cpu_weight_grad, cpu_half_isa), in one call to cpu_kernels.configure; none of them changes a number but
    cpu_weight_grad, and that only in a bf16 weight gradient's order of sums. An old variable set in the
    environment is named, with the key to set instead."""
    from cpu_kernels import configure
    for name in sorted(OLD_VARIABLES):
        if name in os.environ:
            _warn_old_variable(name, os.environ[name])
    configure(threads=int(runtime_cfg.get("cpu_threads", 0)), spin_us=int(runtime_cfg.get("cpu_pool_spin_us", 200)),
              weight_grad=str(runtime_cfg.get("cpu_weight_grad", "auto")),
              half_isa=str(runtime_cfg.get("cpu_half_isa", "auto")))


def set_cpu_compute(choice: str, training: bool) -> None:
    """runtime.cpu_compute for the fp16 convolutions and Dense layers run from now on (cpu_kernels.configure;
    cpu_kernels.cpu_compute says what runs): auto runs AUTO_IN_TRAINING in training and fp32 in evaluation, whose
    numbers then do not depend on the CPU. bf16 runs only on a CPU with AVX512-BF16; elsewhere the kernels compute
    in fp32 whatever is asked."""
    if str(choice) not in COMPUTE_CHOICES:
        raise ConfigError(f"runtime.cpu_compute={choice} is not valid; valid: {', '.join(COMPUTE_CHOICES)}")
    from cpu_kernels import configure
    configure(compute=(AUTO_IN_TRAINING if training else "fp32") if str(choice) == "auto" else str(choice))


@lru_cache(maxsize=1)
def _warn_fallback(reason: str) -> None:  # cached: the warning comes once a process
    log.warning("runtime.cpu_kernels=auto: MindSpore's own CPU kernels are used (slower): %s", reason)


def use_cpu_kernels() -> bool:
    """Whether the layers built now are the CPU kernels' (see the module's docstring); raises ConfigError for
    `on` where they cannot run."""
    if _cpu_kernels == "off":
        return False
    device = ms.get_context("device_target")
    from cpu_kernels import has_ops, why_not
    if _cpu_kernels == "on":
        if device != "CPU":
            raise ConfigError(f"runtime.cpu_kernels=on, but the CPU kernels run on the CPU only (the device is "
                              f"{device}); set runtime.cpu_kernels=auto or off")
        if not has_ops():
            raise ConfigError(f"runtime.cpu_kernels=on, but {why_not()}; or set runtime.cpu_kernels=auto or off")
        return True
    if device != "CPU":
        return False
    if not has_ops():
        _warn_fallback(why_not())
    return has_ops()


def conv2d(in_channels, out_channels, kernel_size, stride=1, padding=0, weight_init=None,
           input_grad=True, plain=False) -> nn.Conv2d:
    """A bias-free square convolution. input_grad=False: a network's first layer, whose input is the data and takes
    no gradient (the CPU kernel then computes the weight gradient alone; MindSpore's Conv2D finds that out by
    itself). plain=True: its output in plain NCHW, never the CPU kernels' blocked layout (a layer whose output is
    flattened next, as LeNet's last convolution)."""
    if use_cpu_kernels():
        from cpu_kernels.cells import CpuConv2d, block_for, supports_conv
        if supports_conv(stride, padding):
            return CpuConv2d(in_channels, out_channels, kernel_size, stride, padding, weight_init, input_grad,
                             0 if plain else block_for(out_channels))
    return nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, pad_mode="pad" if padding else "valid",
                     padding=padding, has_bias=False, weight_init=weight_init)


def batch_norm2d(num_features, eps=1e-5, momentum=0.9, gamma_init="ones") -> nn.BatchNorm2d:
    if use_cpu_kernels():
        from cpu_kernels.cells import CpuBatchNorm2d, block_for
        return CpuBatchNorm2d(num_features, eps, momentum, gamma_init, block_for(num_features))
    return nn.BatchNorm2d(num_features, eps=eps, momentum=momentum, gamma_init=gamma_init)


class MaxPool2x2(nn.MaxPool2d):
    """2x2 max-pooling with stride 2 (still an nn.MaxPool2d for keep-lists), its backward written out: the
    gradient goes to the first maximum of each window, as MindSpore's kernel and PyTorch's do. MindSpore's CPU
    MaxPoolGrad kernel was the largest part of a LeNet step (docs/benchmarks.md); this backward is a few
    reshapes, an argmax and a one-hot, about half its time. Where the CPU kernels run, CpuMaxPool2x2 does both
    directions in one pass each; this one serves other devices and exports."""

    def __init__(self):
        super().__init__(kernel_size=2, stride=2)

    def bprop(self, x, out, dout):
        n, c, h, w = x.shape
        windows = x.reshape(n, c, h // 2, 2, w // 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, h // 2, w // 2, 4)
        first = ops.argmax(windows, -1)
        mask = ops.one_hot(first, 4, ops.ones((), dout.dtype), ops.zeros((), dout.dtype))
        dx = (mask * dout.expand_dims(-1)).reshape(n, c, h // 2, w // 2, 2, 2).transpose(0, 1, 2, 4, 3, 5)
        return (dx.reshape(n, c, h, w),)


def max_pool2d(kernel_size: int, stride: int, padding: int = 0) -> nn.MaxPool2d:
    """Max-pooling: 2x2/2 (LeNet's) and 3x3/2 with padding 1 (ResNet's ImageNet stem) run the CPU kernels' loops
    where they are used; other shapes are nn.MaxPool2d."""
    window = (kernel_size, stride, padding)
    if window in ((2, 2, 0), (3, 2, 1)) and use_cpu_kernels():
        from cpu_kernels.cells import CpuMaxPool2x2, CpuMaxPool3x3
        return CpuMaxPool2x2() if kernel_size == 2 else CpuMaxPool3x3()
    if window == (2, 2, 0):
        return MaxPool2x2()
    return nn.MaxPool2d(kernel_size, stride, pad_mode="pad" if padding else "valid", padding=padding)


def relu() -> nn.ReLU:
    """nn.ReLU, or where the CPU kernels run, CpuReLU (one pass in fp32 or fp16: MindSpore's CPU ReLU and its
    gradient run several times slower in fp16 than in fp32)."""
    if use_cpu_kernels():
        from cpu_kernels.cells import CpuReLU
        return CpuReLU()
    return nn.ReLU()


def dropout(p: float) -> nn.Dropout:
    """nn.Dropout(p), or where the CPU kernels run, CpuDropout (the same random mask, drawn in fp32 and applied in
    the activations' dtype: MindSpore's CPU Dropout runs several times slower in fp16)."""
    if use_cpu_kernels():
        from cpu_kernels.cells import CpuDropout
        return CpuDropout(p)
    return nn.Dropout(p=p)


class Dense(nn.Dense):
    """nn.Dense (a subclass: the same parameters, and keep-lists naming Dense reach it) on 2-D inputs, whose affine
    map runs the CPU kernels' AffineFwd where they run: the fp32 weight goes in as it is stored, so O2 casts
    nothing around it (weights_as_stored, ampzoo.amp.policy), and fp16 activations are multiplied as
    runtime.cpu_compute says. Elsewhere it is nn.Dense."""

    def __init__(self, in_channels, out_channels, weight_init=None):
        super().__init__(in_channels, out_channels, weight_init=weight_init)
        self.kernel = affine_kernel(bias=True)  # None: nn.Dense's own construct
        self.weights_as_stored = self.kernel is not None

    def construct(self, x):
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.bias)
        return super().construct(x)


class AttentionSoftmax(nn.Softmax):
    """softmax(x * scale + bias) over the last axis: an attention's probabilities from its scores and additive mask.
    An nn.Softmax, so a keep-list naming Softmax runs the scaling and the mask in fp32 with it."""

    def __init__(self, scale: float):
        super().__init__(axis=-1)
        self.scale = scale

    def construct(self, x, bias):
        return super().construct(x * self.scale + ops.cast(bias, x.dtype))


def attention_softmax(scale: float) -> nn.Softmax:
    """AttentionSoftmax, or where the CPU kernels run, CpuAttentionSoftmax (the same in one pass, computed in fp32
    whatever comes in)."""
    if use_cpu_kernels():
        from cpu_kernels.cells import CpuAttentionSoftmax
        return CpuAttentionSoftmax(scale)
    return AttentionSoftmax(scale)


class Add(nn.Cell):
    """a + b: a residual sum."""

    def construct(self, a, b):
        return a + b


def add() -> nn.Cell:
    """Add, or where the CPU kernels run, CpuAdd (one pass, fp32 or fp16; a and b of one shape)."""
    if use_cpu_kernels():
        from cpu_kernels.cells import CpuAdd
        return CpuAdd()
    return Add()


class Branch(nn.Cell):
    """x -> n references to x, one for each reader (a residual branch and its sublayer; the encoder's output and
    the decoder's cross-attentions). Their gradients meet in MindSpore's AddN."""

    def __init__(self, n: int = 2):
        super().__init__()
        self.n = n

    def construct(self, x):
        return (x,) * self.n


def branch(n: int = 2) -> Branch:
    """Branch, or where the CPU kernels run, CpuBranch (the gradients summed by eltwise.cc's Add: MindSpore's AddN
    runs several times slower in fp16 than in fp32)."""
    if use_cpu_kernels():
        from cpu_kernels.cells import CpuBranch
        return CpuBranch(n)
    return Branch(n)


class AddReLU(nn.Cell):
    """relu(a + b): the end of a residual block."""

    def construct(self, a, b):
        return ops.relu(a + b)


def add_relu() -> nn.Cell:
    """AddReLU, or where the CPU kernels run, CpuAddReLU (the sum and the ReLU in one pass, fp32 or fp16)."""
    if use_cpu_kernels():
        from cpu_kernels.cells import CpuAddReLU
        return CpuAddReLU()
    return AddReLU()


def affine_kernel(bias: bool = True, float32_out: bool = False):
    """Where the CPU kernels run, cpu_kernels' affine op for a 2-D x [M,K] and a weight [N,K]: x w^T + b (or x w^T
    without a bias) with its backward, taking the weight in the dtype it is stored in (no Cast around it at O2)
    and the activations in fp32 or fp16; elsewhere None (the caller runs MindSpore's MatMul). float32_out: the
    result in fp32 whatever the activations' dtype (holding fp16 values when they are fp16)."""
    if use_cpu_kernels():
        from cpu_kernels.cells import affine_op
        return affine_op(bias, float32_out)
    return None


def embed_kernel():
    """Where the CPU kernels run, cpu_kernels' embed_op (a function of `half`: the token embedding's row scaled and
    added to its position in one op, the table taken as stored); elsewhere None (nn.Embedding, a Mul and an
    Add)."""
    if use_cpu_kernels():
        from cpu_kernels.cells import embed_op
        return embed_op
    return None


def bmm_kernel(transpose_b: bool = False):
    """Where the CPU kernels run, cpu_kernels' batched a @ b (or a @ b^T) over equal leading axes, fp32 or fp16
    computed in fp32, with its backward; elsewhere None."""
    if use_cpu_kernels():
        from cpu_kernels.cells import bmm_op
        return bmm_op(transpose_b)
    return None


def log_softmax_top_k_kernel(k: int):
    """Where the CPU kernels run, cpu_kernels' (logits, specials) -> the top k of log_softmax(logits) + specials
    and their ids, in one pass over each row (a beam-search step's end); elsewhere None."""
    if use_cpu_kernels():
        from cpu_kernels.cells import log_softmax_top_k_op
        return log_softmax_top_k_op(k)
    return None


def cached_attention_kernel():
    """Where the CPU kernels run, cpu_kernels' decoding self-attention against the cache, with the cache's reorder
    and this position's write, over the positions so far only; elsewhere None (the caller gathers, scatters and
    multiplies over the whole cache)."""
    if use_cpu_kernels():
        from cpu_kernels.cells import cached_attention_op
        return cached_attention_op()
    return None


def layer_norm_kernel():
    """Where the CPU kernels run, cpu_kernels' LayerNorm op over the last axis (x, gamma, beta, eps -> y, mean,
    rstd) with its backward, computing in fp32 whatever the dtypes of x and gamma; elsewhere None."""
    if use_cpu_kernels():
        from cpu_kernels.cells import layer_norm_op
        return layer_norm_op()
    return None


class ToNCHW(nn.Cell):
    """The explicit end of the CPU kernels' blocked layout, for a model of your own: a layer built here may return
    its activations as (N, C/B, H, W, B) (cpu_kernels.cells.block_for); element-wise ops, the residual sum and a
    mean over (H, W) do not care, but anything that reads channels or positions does. This returns plain NCHW
    (a rank-4 input passes as it is), with its gradient."""

    def __init__(self):
        super().__init__()
        self.to_plain = None
        if use_cpu_kernels():
            from cpu_kernels.cells import block, relayout_ops
            self.to_plain = relayout_ops(block())[1]

    def construct(self, x):
        if x.ndim == 5:
            return self.to_plain(x)
        return x


def runs_mindspore_conv(net: nn.Cell) -> bool:
    """Whether `net` runs one of MindSpore's own convolutions (a Conv Cell other than the CPU kernels', or a Cell
    holding a Conv primitive), which oneDNN runs far slower above AVX2 (ampzoo.runtime.cap_onednn_isa). A model that
    calls ops.conv2d inside construct is not seen: give it runtime.onednn_isa=AVX2."""
    from mindspore.nn.layer.conv import _Conv
    for _, cell in net.cells_and_names():
        if type(cell).__name__ == "CpuConv2d":
            continue
        if isinstance(cell, _Conv) or any("conv" in type(p).__name__.lower()
                                          for p in getattr(cell, "_primitives", {}).values() if p is not None):
            return True
    return False
