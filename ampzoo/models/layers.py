"""The zoo's own layers: Cells of plain MindSpore, each a unit a model is written with.

MaxPool2x2 (LeNet's pooling, its backward written out), AttentionSoftmax (an attention's scaled, masked softmax as
one Cell, so keep-lists reach the whole of it), Add and AddReLU (a residual block's join). A model builds its
network from these and from mindspore.nn, NCHW between every layer.
"""
import mindspore.nn as nn
import mindspore.ops as ops


def conv2d(in_channels, out_channels, kernel_size, stride=1, padding=0, weight_init=None) -> nn.Conv2d:
    """A bias-free square convolution, zero-padded by `padding` on each side."""
    return nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, pad_mode="pad" if padding else "valid",
                     padding=padding, has_bias=False, weight_init=weight_init)


class MaxPool2x2(nn.MaxPool2d):
    """2x2 max-pooling with stride 2 (still an nn.MaxPool2d for keep-lists), its backward written out: the
    gradient goes to the first maximum of each window, as MindSpore's op and PyTorch's do. MindSpore's CPU
    MaxPoolGrad was the largest part of a LeNet step (docs/benchmarks.md); this backward is a few
    reshapes, an argmax and a one-hot, about half its time."""

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
    """Max-pooling: MaxPool2x2 for 2x2/2, else nn.MaxPool2d."""
    if (kernel_size, stride, padding) == (2, 2, 0):
        return MaxPool2x2()
    return nn.MaxPool2d(kernel_size, stride, pad_mode="pad" if padding else "valid", padding=padding)


class AttentionSoftmax(nn.Softmax):
    """softmax(x * scale + bias) over the last axis: an attention's probabilities from its scores and additive mask.
    An nn.Softmax, so a keep-list naming Softmax runs the scaling and the mask in fp32 with it."""

    def __init__(self, scale: float):
        super().__init__(axis=-1)
        self.scale = scale

    def construct(self, x, bias):
        return super().construct(x * self.scale + ops.cast(bias, x.dtype))


class Add(nn.Cell):
    """a + b: a residual sum."""

    def construct(self, a, b):
        return a + b


class AddReLU(nn.Cell):
    """relu(a + b): the end of a residual block."""

    def construct(self, a, b):
        return ops.relu(a + b)
