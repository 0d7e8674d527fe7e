"""The Cells of the CPU kernels, each a subclass of the MindSpore Cell it stands for, with the same parameters (so
the same checkpoint): CpuConv2d, CpuBatchNorm2d, CpuMaxPool2x2, CpuMaxPool3x3, CpuReLU, CpuDropout, CpuDense,
CpuLayerNorm and CpuSoftmax, whose forward and backward are AOT custom ops from the extension's library
(cpu_kernels.library()). Each has `from_cell(cell)`, which builds it around the parameters of the Cell it replaces
(as torch.ao's `from_float`), or returns None for a configuration its ops do not run; cpu_kernels.accelerate swaps
them into a finished network. The ops also come as functions returning the op (affine_op, bmm_op, layer_norm_op,
embed_op, add_op, eltwise_op, scaled_softmax_op, log_softmax_top_k_op, cached_attention_op), for Cells of a model's
own that stand for a unit of it (a residual join, an attention's softmax).

MindSpore 2.10 hands oneDNN plain NCHW tensors for Conv2D and its two gradients, which leaves oneDNN only its
im2col + sgemm path; PyTorch lets oneDNN pick a blocked layout and run its direct kernels. CpuConv2d does what
PyTorch does. The pooling (pool.cc) and BatchNorm (norm.cc) loops replace MindSpore kernels that took several
times PyTorch's time; docs/configuration.md has the measurements.

The blocked layout: inside a stage (BlockedSequentialCell, which accelerate makes of a SequentialCell whose layers
all take it) a tensor of C channels is kept in oneDNN's blocked layout when the block (`block()`: 16 channels a
vector on AVX-512, 8 on AVX2) divides C, as a (N, C/B, H, W, B) tensor with channel c at block c // B, lane c % B
(`block_for`). The stage reorders once on the way in and once on the way out, so every tensor outside it is plain
NCHW. Inside, the convolutions read their input's layout from its rank, CpuBatchNorm2d runs on the blocks,
CpuMaxPool3x3 reorders around its NCHW loops, and element-wise Cells (`layout = "any"`) do not care.
"""
from functools import lru_cache

import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops

from cpu_kernels import cpu_flags, library, onednn_runs_avx512

STRIDES, PADDINGS = (1, 2), (0, 1, 2, 3)  # the variants conv.cc exports


class KernelCell:
    """What every Cell of these kernels is (runs_kernels finds them). `layout` says what it takes inside a blocked
    stage: "blocked" (it is told its block: CpuConv2d, CpuBatchNorm2d), "any" (element-wise, or it reads the layout
    from the rank), or None (plain NCHW only: such a Cell ends a stage). The precision interface the zoo's AMP
    reads (ampzoo.amp.policy) is two class attributes: `weights_as_stored` (it takes fp16 activations and the fp32
    master weights as stored: no Cast on either) and `fp32_inside` (it takes fp16, computes in fp32 and rounds
    its output: a keep-list needs no Cast around it)."""
    layout = None
    weights_as_stored = False
    fp32_inside = False


def share_parameters(new, old):
    """`new` (a Cell just built) holds `old`'s Parameter objects under the same attribute names, so the optimizer,
    a checkpoint and `old` all see one set; returns `new`. Raises ValueError if `new` would hold a Parameter of its
    own (a checkpoint of the swapped network would then differ)."""
    for name, param in old._params.items():
        setattr(new, name, param)
    extra = set(new._params) - set(old._params)
    if extra:
        raise ValueError(f"{type(new).__name__} has parameters {sorted(extra)} that {type(old).__name__} lacks")
    return new


def supports_conv(stride: int, padding: int) -> bool:
    """Whether CpuConv2d runs this stride and padding (the variants conv.cc exports)."""
    return stride in STRIDES and padding in PADDINGS


def block() -> int:
    """The channels of one block of the layout between the kernels: 16 where oneDNN runs AVX-512, else 8."""
    return 16 if onednn_runs_avx512() else 8


def block_for(channels: int) -> int:
    """The layout of a tensor of `channels` channels between the kernels: block() when it divides them, else 0
    (plain NCHW)."""
    return block() if channels % block() == 0 else 0


def _out_size(size: int, k: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - k) // stride + 1


@lru_cache(maxsize=None)
def conv_op(stride: int, padding: int, input_grad: bool = True, out_block: int = 0):
    """The forward custom op (x, w -> y) for one stride and padding, with its backward (x, w, dy -> dx, dw).
    x is plain NCHW or blocked (see block_for; the kernel reads which from its rank); y is blocked by
    `out_block` channels, or plain (0).
    input_grad=False: a network's first layer. Its input is data and takes no gradient, so the backward computes
    dw alone (dx is zeros that the graph drops). That is what MindSpore's own Conv2D does when its dx goes unused;
    it halves the 224x224 stem's forward and backward (docs/benchmarks.md)."""
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

    # one name per variant: MindSpore's graph mode gave two custom ops of one name one gradient (conv.cc)
    name = f"ConvFwd{'' if input_grad else 'First'}{'B' if out_block else ''}_s{stride}_p{padding}"
    return ops.Custom(f"{lib}:{name}", out_shape=shape, out_dtype=lambda x, w: x, func_type="aot", bprop=bprop)


class CpuConv2d(KernelCell, nn.Conv2d):
    """nn.Conv2d (pad_mode "pad" or "valid", no bias) whose forward and backward run oneDNN's direct kernels.
    It computes in fp32 like MindSpore's CPU Conv2D, or multiplies in bf16 (cpu_kernels.cpu_compute). Under
    fp16 it takes fp16 input and returns fp16, converting inside the kernel, so no Cast runs around it
    (MindSpore's Conv2D casts around its own). Its weight it takes as stored (`weights_as_stored`: O2 gives it
    no precision flag, ampzoo.amp.policy): an fp32 master weight is rounded to fp16 values inside the kernel and its
    gradient comes back in fp32 holding fp16 values, so no Cast runs on either.
    out_block: its output in the blocked layout (block_for), else plain NCHW; its input may be either.
    input_grad=False: the network's first layer (conv_op)."""
    weights_as_stored = True
    layout = "blocked"

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, weight_init=None,
                 input_grad=True, out_block=0):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride,
                         pad_mode="pad" if padding else "valid", padding=padding, has_bias=False,
                         weight_init=weight_init)
        self.input_grad, self.out_block = input_grad, out_block
        self.conv = conv_op(stride, padding, input_grad, out_block)

    @classmethod
    def from_cell(cls, conv: nn.Conv2d, input_grad: bool = True):
        """The kernel Cell for a bias-free, ungrouped square nn.Conv2d (pad_mode pad or valid, NCHW) of a stride and
        padding conv.cc exports, around its weight; else None."""
        k, stride = conv.kernel_size, conv.stride
        padding = conv.padding if conv.pad_mode == "pad" else 0 if conv.pad_mode == "valid" else None
        if (conv.has_bias or conv.group != 1 or tuple(conv.dilation) != (1, 1) or k[0] != k[1]
                or stride[0] != stride[1] or not isinstance(padding, int) or conv.data_format != "NCHW"
                or not supports_conv(stride[0], padding)):
            return None
        new = cls(conv.in_channels, conv.out_channels, k[0], stride[0], padding, "zeros", input_grad)
        return share_parameters(new, conv)

    def set_block(self, block: int) -> None:
        """Its output in the blocked layout of `block` channels (block_for), or plain NCHW (0)."""
        self.out_block = block
        self.conv = conv_op(self.stride[0], self.padding, self.input_grad, block)

    def construct(self, x):
        channels = x.shape[1] * x.shape[4] if x.ndim == 5 else x.shape[1]  # NCHW, or blocked (block_for)
        if channels != self.in_channels:  # the kernel's own answer would be an error code
            raise ValueError(f"CpuConv2d: the input has {channels} channels, but this layer takes "
                             f"in_channels={self.in_channels} (input shape {x.shape})")
        return self.conv(x, self.weight)  # fp16 (AMP) in, fp16 out: the kernel converts (conv.cc's Arg)


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
    """k x k max-pooling with stride 2 (x -> y; k=3 pads by 1) with its backward from pool.cc: x, dy -> dx
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

    def shape(x):  # NCHW, or (3x3) blocked: N, C/B, H, W, B
        return [x[0], x[1], _pooled(x[2], k), _pooled(x[3], k), *x[4:]]

    return ops.Custom(f"{lib}:MaxPool{k}x{k}Fwd", out_shape=shape, out_dtype=lambda x: x, func_type="aot", bprop=bprop)


class CpuMaxPool2x2(KernelCell, nn.MaxPool2d):
    """nn.MaxPool2d(2, 2) (for keep-lists and reports) running pool.cc's loops, in fp32 or fp16; plain NCHW."""

    def __init__(self):
        super().__init__(kernel_size=2, stride=2)
        self.pool = max_pool_op(2)

    def construct(self, x):
        return self.pool(x)


def max_pool_from_cell(pool: nn.MaxPool2d):
    """CpuMaxPool2x2 for a 2x2/2 nn.MaxPool2d without padding, CpuMaxPool3x3 for 3x3/2 with padding 1 (ResNet's
    ImageNet stem); else None."""
    if getattr(pool, "return_indices", False) or getattr(pool, "ceil_mode", None):
        return None
    pad = tuple(pool.padding) if pool.use_pad else (0, 0, 0)
    window = (pool.kernel_size, pool.stride, pad)
    if window in ((2, 2, (0, 0, 0)), ((2, 2), (2, 2), (0, 0, 0))) and pool.pad_mode == "VALID":
        return CpuMaxPool2x2()
    if window == (3, 2, (0, 1, 1)):
        return CpuMaxPool3x3()
    return None


class CpuMaxPool3x3(KernelCell, nn.MaxPool2d):
    """nn.MaxPool2d(3, 2, padding 1), the ImageNet stem's, running pool.cc's loops, in fp32 or fp16. It takes
    and returns NCHW, or the blocked layout (block_for) its neighbours keep: blocks of 16 channels as they are on
    an AVX-512 CPU (pool.cc's blocked loops), other blocks reordered to NCHW and back."""
    layout = "any"

    def __init__(self):
        super().__init__(kernel_size=3, stride=2, pad_mode="pad", padding=1)
        self.pool = max_pool_op(3)
        self.to_blocked8, self.to_plain8 = relayout_ops(8)  # the input's own block, whichever the CPU's is
        self.to_blocked16, self.to_plain16 = relayout_ops(16)
        self.blocked = 16 if "avx512f" in cpu_flags() else 0  # the block the kernel pools as it is

    def construct(self, x):
        if x.ndim == 5 and x.shape[4] != self.blocked:
            if x.shape[4] == 8:
                return self.to_blocked8(self.pool(self.to_plain8(x)))
            return self.to_blocked16(self.pool(self.to_plain16(x)))
        return self.pool(x)


@lru_cache(maxsize=None)
def eltwise_op(name: str, inputs: int):
    """eltwise.cc's `name`Fwd (`inputs` tensors -> y) with its backward `name`Bwd (y, dy -> dx, the gradient of
    every input), in fp32 or fp16."""
    lib = library()
    backward = ops.Custom(f"{lib}:{name}Bwd", out_shape=lambda y, dy: y, out_dtype=lambda y, dy: y, func_type="aot")

    def bprop_one(x, out, dout):
        return (backward(out, dout),)

    def bprop_two(a, b, out, dout):
        dx = backward(out, dout)
        return dx, dx

    bprop = bprop_one if inputs == 1 else bprop_two
    return ops.Custom(f"{lib}:{name}Fwd", out_shape=_first, out_dtype=_first, func_type="aot", bprop=bprop)


def _first(*args):  # an element-wise op's output: the shape and dtype of its first input
    return args[0]


class CpuReLU(KernelCell, nn.ReLU):
    """nn.ReLU (for keep-lists and reports) running eltwise.cc's pass, in fp32 or fp16."""
    layout = "any"

    @classmethod
    def from_cell(cls, relu: nn.ReLU):
        return cls()

    def __init__(self):
        super().__init__()
        self.op = eltwise_op("Relu", 1)

    def construct(self, x):
        return self.op(x)


@lru_cache(maxsize=None)
def affine_op(bias: bool = True, float32_out: bool = False):
    """matmul.cc's AffineFwd (x [M,K], w [N,K], b [N] -> x w^T + b) with its backward (dx, dw, db), or without a
    bias LinearFwd (x, w -> x w^T). x fp32 or fp16, the output x's dtype; w and b as the Cell stores them (fp32
    master weights at O2, so no Cast runs around it), their gradients in w's dtype. With fp16 x every value in
    and out is an fp16 value, whatever its storage. float32_out (no bias): the output in fp32 whatever x's dtype
    (logits that the loss reads in fp32; the gradient may come back in fp32)."""
    lib = library()
    if bias:
        backward = ops.Custom(f"{lib}:AffineBwd", out_shape=lambda x, w, dy: (x, w, [w[0]]),
                              out_dtype=lambda x, w, dy: (x, w, w), func_type="aot")

        def bprop(x, w, b, out, dout):
            dx, dw, db = backward(x, w, dout)
            return dx, dw, db
    else:
        backward = ops.Custom(f"{lib}:LinearBwd", out_shape=lambda x, w, dy: (x, w),
                              out_dtype=lambda x, w, dy: (x, w), func_type="aot")

        def bprop(x, w, out, dout):
            dx, dw = backward(x, w, dout)
            return dx, dw
    forward = "AffineFwd" if bias else "LinearFwd32" if float32_out else "LinearFwd"
    return ops.Custom(f"{lib}:{forward}", out_shape=_affine_shape, out_dtype=_float32 if float32_out else _first,
                      func_type="aot", bprop=bprop)


def _affine_shape(x, w, *bias):
    return [x[0], w[0]]


def _float32(*args):
    return ms.float32


class CpuDense(KernelCell, nn.Dense):
    """nn.Dense (no activation) as one 2-D affine map over the last axis, matmul.cc's AffineFwd and its backward:
    the fp32 weight goes in as it is stored (`weights_as_stored`: O2 casts nothing around it), and fp16 activations
    are multiplied as runtime.cpu_compute says."""
    weights_as_stored = True

    @classmethod
    def from_cell(cls, dense: nn.Dense):
        """For an nn.Dense with a bias and no activation; else None."""
        if not dense.has_bias or dense.activation_flag:
            return None
        return share_parameters(cls(dense.in_channels, dense.out_channels, "zeros"), dense)

    def __init__(self, in_channels, out_channels, weight_init="zeros"):
        super().__init__(in_channels, out_channels, weight_init=weight_init)
        self.affine = affine_op(bias=True)

    def construct(self, x):
        if x.shape[-1] != self.in_channels:  # a compile-time check: the reshape below would hide the mismatch
            raise ValueError(f"For 'Dense', the last axis of x must equal in_channels, but got {x.shape[-1]} and "
                             f"{self.in_channels}")
        y = self.affine(x.reshape(-1, self.in_channels), self.weight, self.bias)
        return y.reshape(x.shape[:-1] + (self.out_channels,))


@lru_cache(maxsize=None)
def embed_op(half: bool = False):
    """eltwise.cc's EmbedFwd (table [V, d], ids int32 [..., T], positions [T, d], scale (1,) -> table[ids] * scale +
    positions, fp16 with `half`, each value rounded as O2's fp16 ops round it, else fp32) with its backward
    (EmbedBwd: the table's gradient in fp32; ids, positions and scale take none). The table and positions go in
    as stored in fp32, so no Cast runs around it."""
    lib = library()
    backward = ops.Custom(f"{lib}:EmbedBwd", out_shape=lambda dy, ids, scale, table: table,
                          out_dtype=lambda dy, ids, scale, table: table, func_type="aot")

    def bprop(table, ids, positions, scale, out, dout):
        return (backward(dout, ids, scale, table), ops.zeros_like(ids), ops.zeros_like(positions),
                ops.zeros_like(scale))
    dtype = ms.float16 if half else ms.float32
    return ops.Custom(f"{lib}:{'EmbedFwdHalf' if half else 'EmbedFwd'}",
                      out_shape=lambda table, ids, positions, scale: [*ids, table[1]],
                      out_dtype=lambda *args: dtype, func_type="aot", bprop=bprop)


@lru_cache(maxsize=1)
def add_op():
    """eltwise.cc's AddFwd (a, b -> a + b, one shape, fp32 or fp16); the gradient of each is dy as it is."""
    def bprop(a, b, out, dout):
        return dout, dout
    return ops.Custom(f"{library()}:AddFwd", out_shape=_first, out_dtype=_first, func_type="aot", bprop=bprop)


class CpuBranch(KernelCell, nn.Cell):
    """x -> n references to x, for a Cell that reads one tensor n times (a residual block's input: its body and its
    shortcut). Forward it is x; backward the n gradients are summed by eltwise.cc's Add in x's dtype, each sum the
    fp32 sum rounded once, where MindSpore sums them in its AddN (several times slower in fp16 on a CPU)."""
    layout = "any"

    def __init__(self, n: int = 2):
        super().__init__()
        self.n = n
        self.add = add_op()

    def construct(self, x):
        return (x,) * self.n

    def bprop(self, x, out, dout):
        if self.n == 1:
            return (dout[0],)
        grad = self.add(dout[0], dout[1])
        for i in range(2, self.n):
            grad = self.add(grad, dout[i])
        return (grad,)


@lru_cache(maxsize=1)
def mask_mul_op():
    """eltwise.cc's MaskMulFwd (x fp32 or fp16, m fp32 of x's shape -> x * m in x's dtype), its gradient dy * m."""
    def bprop(x, m, out, dout):
        return mask_mul(dout, m), ops.zeros_like(m)  # the same op: dy * m
    mask_mul = ops.Custom(f"{library()}:MaskMulFwd", out_shape=_first, out_dtype=_first, func_type="aot",
                          bprop=bprop)
    return mask_mul


class CpuDropout(KernelCell, nn.Dropout):
    """nn.Dropout (same p, same random stream: MindSpore's Dropout draws the mask) whose mask is drawn in fp32 and
    applied by eltwise.cc's MaskMul in x's dtype: MindSpore's CPU Dropout and DropoutGrad run many times slower in
    fp16 than in fp32."""
    layout = "any"

    def __init__(self, p: float):
        super().__init__(p=p)
        self.mask_mul = mask_mul_op()

    @classmethod
    def from_cell(cls, dropout: nn.Dropout):
        return cls(dropout.p)

    def construct(self, x):
        if not self.training or self.p == 0:
            return x
        scaled_mask, _ = self.dropout(ops.ones(x.shape, ms.float32))  # 0 or 1 / (1 - p)
        return self.mask_mul(x, scaled_mask)


def _bmm_shape(ta: bool, tb: bool):
    def shape(a, b):
        return list(a[:-2]) + [a[-1] if ta else a[-2], b[-2] if tb else b[-1]]
    return shape


@lru_cache(maxsize=None)
def bmm_op(transpose_b: bool = False):
    """matmul.cc's batched product over equal leading axes: a @ b (BmmFwdNN) or a @ b^T (BmmFwdNT), fp32 or fp16
    (one dtype for all), computed in fp32, with its backward."""
    lib = library()
    nn_, nt, tn = (ops.Custom(f"{lib}:Bmm{v}", out_shape=_bmm_shape(v[0] == "T", v[1] == "T"), out_dtype=_first,
                              func_type="aot") for v in ("NN", "NT", "TN"))
    if transpose_b:  # y = a b^T: da = dy b, db = dy^T a
        def bprop(a, b, out, dout):
            return nn_(dout, b), tn(dout, a)
    else:  # y = a b: da = dy b^T, db = a^T dy
        def bprop(a, b, out, dout):
            return nt(dout, b), tn(a, dout)
    name = "BmmFwdNT" if transpose_b else "BmmFwdNN"
    return ops.Custom(f"{lib}:{name}", out_shape=_bmm_shape(False, transpose_b), out_dtype=_first, func_type="aot",
                      bprop=bprop)


@lru_cache(maxsize=1)
def layer_norm_op():
    """layer_norm.cc's LayerNormFwd (x [..., D], gamma [D], beta [D], eps fp32 (1,) -> y in x's dtype, mean and
    rstd a row, fp32) with its backward (dx, dgamma, dbeta), computing in fp32 whatever comes in."""
    lib = library()
    backward = ops.Custom(f"{lib}:LayerNormBwd", out_shape=lambda x, g, m, r, dy: (x, g, g),
                          out_dtype=lambda x, g, m, r, dy: (x, g, g), func_type="aot")

    def bprop(x, gamma, beta, eps, out, dout):
        dx, dgamma, dbeta = backward(x, gamma, out[1], out[2], dout[0])
        return dx, dgamma, dbeta, ops.zeros_like(eps)

    def shape(x, gamma, beta, eps):
        rows = 1
        for n in x[:-1]:
            rows *= n
        return x, [rows], [rows]

    def dtype(x, gamma, beta, eps):
        return x, ms.float32, ms.float32
    return ops.Custom(f"{lib}:LayerNormFwd", out_shape=shape, out_dtype=dtype, func_type="aot", bprop=bprop)


class CpuLayerNorm(KernelCell, nn.LayerNorm):
    """nn.LayerNorm over the last axis (the same gamma and beta) running layer_norm.cc: fp32 or fp16 in, the same
    out, computed in fp32 (`fp32_inside`: a keep-list needs no Cast around it)."""
    fp32_inside = True

    @classmethod
    def from_cell(cls, norm: nn.LayerNorm):
        """For an nn.LayerNorm over the last axis alone; else None."""
        if len(norm.normalized_shape) != 1 or norm.begin_norm_axis != -1 or norm.begin_params_axis != -1:
            return None
        return share_parameters(cls(norm.normalized_shape[0], norm.epsilon), norm)

    def __init__(self, d: int, epsilon: float = 1e-5):
        super().__init__((d,), epsilon=epsilon)
        self.op = layer_norm_op()
        self.eps = ms.Tensor([epsilon], ms.float32)

    def construct(self, x):
        return self.op(x, self.gamma, self.beta, self.eps)[0]


@lru_cache(maxsize=1)
def softmax_op():
    """softmax.cc's SoftmaxFwd (x -> softmax over the last axis, x's dtype, computed in fp32) with its backward
    SoftmaxBwd (y, dy -> dx)."""
    lib = library()
    backward = ops.Custom(f"{lib}:SoftmaxBwd", out_shape=_first, out_dtype=_first, func_type="aot")

    def bprop(x, out, dout):
        return (backward(out, dout),)
    return ops.Custom(f"{lib}:SoftmaxFwd", out_shape=_first, out_dtype=_first, func_type="aot", bprop=bprop)


class CpuSoftmax(KernelCell, nn.Softmax):
    """nn.Softmax(axis=-1) (keep-lists naming Softmax reach it) running softmax.cc: fp32 or fp16 in, the same
    out, computed in fp32 and rounded once. O2's keep-list needs no Cast around it (`fp32_inside`, which
    ampzoo.amp.policy reads): at O2 MindSpore ran a Cast before and after the attention's Softmax and its gradient."""
    fp32_inside = True

    def __init__(self):
        super().__init__(axis=-1)
        self.op = softmax_op()

    @classmethod
    def from_cell(cls, softmax: nn.Softmax):
        """For an nn.Softmax over the last axis; else None."""
        return cls() if tuple(softmax.softmax.axis) == (-1,) else None

    def construct(self, x):
        return self.op(x)


@lru_cache(maxsize=1)
def scaled_softmax_op():
    """softmax.cc's ScaledSoftmaxFwd (x, bias broadcast to x, scale fp32 (1,) -> softmax(x * scale + bias) over
    the last axis, x's dtype, computed in fp32) with its backward ScaledSoftmaxBwd (y, dy, scale -> dx); the bias
    and the scale take no gradient."""
    lib = library()
    backward = ops.Custom(f"{lib}:ScaledSoftmaxBwd", out_shape=_first, out_dtype=_first, func_type="aot")

    def bprop(x, bias, scale, out, dout):
        return backward(out, dout, scale), ops.zeros_like(bias), ops.zeros_like(scale)
    return ops.Custom(f"{lib}:ScaledSoftmaxFwd", out_shape=_first, out_dtype=_first, func_type="aot", bprop=bprop)


@lru_cache(maxsize=None)
def log_softmax_top_k_op(k: int):
    """decode.cc's LogSoftmaxTopK: logits (rows, V) fp32 or fp16 and specials (V,) fp32 -> the k largest of
    log_softmax(logits) + specials (rows, k) fp32, largest first, and their ids (rows, k) int32."""
    def shape(logits, specials):
        return [logits[0], k], [logits[0], k]

    def dtype(logits, specials):
        return ms.float32, ms.int32
    return ops.Custom(f"{library()}:LogSoftmaxTopK", out_shape=shape, out_dtype=dtype, func_type="aot")


@lru_cache(maxsize=1)
def cached_attention_op():
    """decode.cc's CachedSelfAttention: a decoding step's self-attention against the cache. (qkv (R, 1, 3 h dh),
    keys and values (R, h, L, dh), reorder (R,) int32, t (1,) int32, scale (1,)) -> the context (R, 1, h dh), and
    the cache with row r continuing row reorder[r] and this step's key and value at position t (positions after t
    unwritten). fp32, or fp16 with the unfused graph's roundings."""
    return ops.Custom(f"{library()}:CachedSelfAttention", out_shape=_cached_shape, out_dtype=_cached_dtype,
                      func_type="aot")


def _cached_shape(qkv, keys, values, reorder, t, scale):
    return [qkv[0], 1, qkv[2] // 3], keys, values


def _cached_dtype(qkv, keys, values, reorder, t, scale):
    return qkv, keys, values


@lru_cache(maxsize=None)
def momentum_op(nesterov: bool = False):
    """optim.cc's MomentumUpdate: (w, accum, g, lr, momentum, decay, unscale; the last four of one element) -> a
    (1,) float32, writing w and accum in place. A side-effect op, as MindSpore's ApplyMomentum is: MindSpore then
    passes the Parameters themselves, not copies, and runs the op after every reader of their old values."""
    op = ops.Custom(f"{library()}:MomentumUpdate{'Nesterov' if nesterov else ''}", out_shape=_done_shape,
                    out_dtype=_done_dtype, func_type="aot")
    op.add_prim_attr("side_effect_mem", True)
    return op


def _done_shape(*args):
    return [1]


def _done_dtype(w, *args):
    return w


@lru_cache(maxsize=1)
def unscale_sum_op():
    """eltwise.cc's UnscaleSum: a float32 gradient and the loss scale -> the gradient unscaled, and its sum as a
    (1,) tensor (inf or NaN when an element is): amp.loss_scale's unscale and overflow check in one pass."""
    return ops.Custom(f"{library()}:UnscaleSumOp", out_shape=_unscaled_shape, out_dtype=_unscaled_dtype,
                      func_type="aot")


@lru_cache(maxsize=1)
def unscaled_sum_op():
    """eltwise.cc's UnscaledSum: a float32 gradient and the loss scale -> the sum of the gradient unscaled, as a
    (1,) tensor, without writing the unscaled gradient: the check where the optimizer unscales as it updates
    (ampzoo.engine.optim.Momentum.update)."""
    return ops.Custom(f"{library()}:UnscaledSumOp", out_shape=_done_shape, out_dtype=_done_dtype, func_type="aot")


def _unscaled_shape(g, scale):
    return g, [1]


def _unscaled_dtype(g, scale):
    return g, g


@lru_cache(maxsize=1)
def batch_norm_op():
    """Training BatchNorm from norm.cc: x, gamma, beta, moving mean, moving var, (momentum, eps) -> y, mean,
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


class CpuBatchNorm2d(KernelCell, nn.BatchNorm2d):
    """nn.BatchNorm2d (the same parameters and checkpoint) whose training forward and backward run norm.cc's
    loops and write the moving statistics as MindSpore's BatchNorm does. It computes in fp32 on fp32 or fp16
    input and returns the input's dtype: O2's keep-list needs no Cast around it (`fp32_inside`, which
    ampzoo.amp.policy reads). Evaluation runs MindSpore's own BatchNorm in fp32 (fp16 input widened and the output
    rounded back), and fp16 parameters (O3: BatchNorm in low precision) run it in fp16, so those numbers are
    MindSpore's. `block`: its input and output are in that blocked layout (block_for), which MindSpore's
    BatchNorm gets as NCHW."""
    fp32_inside = True
    layout = "blocked"

    def __init__(self, num_features, eps=1e-5, momentum=0.9, gamma_init="ones", block=0):
        super().__init__(num_features, eps=eps, momentum=momentum, gamma_init=gamma_init)
        self.norm = batch_norm_op()
        self.hyper = ms.Tensor([momentum, eps], ms.float32)
        self.set_block(block)

    @classmethod
    def from_cell(cls, bn: nn.BatchNorm2d):
        """For an affine nn.BatchNorm2d (NCHW) that uses batch statistics in training; else None. MindSpore stores
        1 - momentum."""
        if not bn.gamma.requires_grad or bn.use_batch_statistics is not None or bn.format != "NCHW":
            return None
        return share_parameters(cls(bn.num_features, bn.eps, 1.0 - bn.momentum), bn)

    def set_block(self, block: int) -> None:
        """Its input and output in the blocked layout of `block` channels (block_for), or plain NCHW (0)."""
        self.block = block
        self.to_blocked, self.to_plain = relayout_ops(block) if block else (None, None)

    def mindspores(self, x):
        if self.block:
            return self.to_blocked(super().construct(self.to_plain(x)))
        return super().construct(x)

    def construct(self, x):
        # O3 (BatchNorm in low precision): its flag casts the parameters, which ops.dtype sees (Parameter.dtype
        # in graph mode is the declared one)
        if ops.dtype(self.gamma) != ms.float32:
            return self.mindspores(x)
        if not self.training:
            if x.dtype == ms.float32:
                return self.mindspores(x)
            return self.mindspores(x.astype(ms.float32)).astype(x.dtype)
        y, _, _, mean, var = self.norm(x, self.gamma, self.beta, self.moving_mean, self.moving_variance, self.hyper)
        ops.assign(self.moving_mean, mean)
        ops.assign(self.moving_variance, var)
        return y


class BlockedSequentialCell(nn.SequentialCell):
    """A SequentialCell whose layers run in the blocked layout (see the module's docstring): its input is reordered
    once on the way in (when the block divides its channels) and its output once on the way out, so it takes and
    returns plain NCHW. The layers are the ones it was made of, under the same names (cpu_kernels.accelerate)."""

    def __init__(self, layers, block: int):
        super().__init__(layers)
        self.block = block
        self.to_blocked, self.to_plain = relayout_ops(block)

    def construct(self, x):
        if x.ndim == 4 and x.shape[1] % self.block == 0:
            x = self.to_blocked(x)
        for cell in self.cell_list:
            x = cell(x)
        if x.ndim == 5:
            x = self.to_plain(x)
        return x
