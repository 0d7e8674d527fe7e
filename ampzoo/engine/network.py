"""The network a command runs: `build_model(cfg)` builds the recipe's model from the registry, in plain MindSpore,
and, where `runtime.cpu_kernels` lets them run, applies the CPU kernels to it in one call (cpu_kernels.accelerate):

    auto  the kernels on the CPU where they are built; MindSpore's own kernels elsewhere, and where they are not
          built (one warning says why)
    on    the kernels; without them (not built, a oneDNN mismatch, not the CPU) an error
    off   MindSpore's own kernels (export.py, and Conv+BN folding, whose Conv2d takes a bias)

Either way the network has the same parameters under the same names, so a checkpoint of one loads into the other.
The model's own units (ampzoo.models.layers, the Transformer's Cells) get the kernel Cells below, each a subclass
of the unit it replaces, so keep-lists and reports name it alike. The kernels' settings (runtime.cpu_compute,
cpu_threads, cpu_pool_spin_us, cpu_weight_grad, cpu_half_isa) reach them through cpu_kernels.configure, here.
"""
import logging
import os
from functools import lru_cache

import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops

from ampzoo.config import CpuCompute
from ampzoo.errors import ConfigError
from ampzoo.models import create_model
from ampzoo.models.layers import Add, AddReLU, AttentionSoftmax, MaxPool2x2
from ampzoo.models.resnet import BasicBlock, Bottleneck, Residual
from ampzoo.models.transformer import (BatchMatMul, CachedSelfAttention, Dense, LayerNorm, Sublayer, TiedProjection,
                                       TokenEmbedding, TopCandidates)
from ampzoo.runtime import cap_onednn_isa
from cpu_kernels.cells import (CpuBranch, CpuDense, CpuLayerNorm, CpuMaxPool2x2, KernelCell, add_op, affine_op, bmm_op,
                               cached_attention_op, eltwise_op, embed_op, log_softmax_top_k_op, scaled_softmax_op,
                               share_parameters)

log = logging.getLogger("amp_zoo")
CHOICES = ("auto", "on", "off")
COMPUTE_CHOICES = tuple(c.value for c in CpuCompute)
AUTO_IN_TRAINING = "bf16"  # runtime.cpu_compute=auto in training, where the CPU runs it (docs/configuration.md)

# what the kernels read from the environment before their settings were config keys
OLD_VARIABLES = {"AMP_ZOO_CPU_COMPUTE": "runtime.cpu_compute", "AMP_ZOO_CONV_COMPUTE": "runtime.cpu_compute",
                 "AMP_ZOO_CONV_THREADS": "runtime.cpu_threads", "AMP_ZOO_POOL_SPIN_US": "runtime.cpu_pool_spin_us"}


def build_model(cfg, cpu_kernels=None) -> nn.Cell:
    """The recipe's model: `cfg.model` (name, num_classes, params), built in fp32, with the CPU kernels applied
    where `runtime.cpu_kernels` (or `cpu_kernels`: "off" for export and Conv+BN folding) lets them run. Then sets
    oneDNN's ISA cap for it before its first step (ampzoo.runtime.cap_onednn_isa)."""
    kernels = use_cpu_kernels(cpu_kernels or cfg.runtime.cpu_kernels)  # `on` where they cannot run: an error first
    net = create_model(cfg.model.name, num_classes=cfg.model.num_classes, **cfg.model.params)
    if kernels:
        net = accelerate(net, cfg.runtime)
    note = cap_onednn_isa(cfg.runtime.onednn_isa, runs_mindspore_conv(net), ms.get_context("device_target"))
    if note:  # the CPU only: on Ascend and GPU oneDNN runs none of the network
        log.info(note)
    return net


def accelerate(net: nn.Cell, runtime_cfg=None) -> nn.Cell:
    """`net` (a model of the zoo, or of a plugin) with the CPU kernels swapped in (cpu_kernels.accelerate, with the
    zoo's units below), after passing the runtime.cpu_* settings in `runtime_cfg` to them."""
    from cpu_kernels.accelerate import accelerate as swap
    if runtime_cfg is not None:
        set_cpu_settings(runtime_cfg)
    return swap(net, units=units(), stages=(Residual,))


def check_choice(mode) -> str:
    if str(mode) not in CHOICES:
        raise ConfigError(f"runtime.cpu_kernels={mode} is not valid; valid: {', '.join(CHOICES)}")
    return str(mode)


@lru_cache(maxsize=1)
def _warn_fallback(reason: str) -> None:  # cached: the warning comes once a process
    log.warning("runtime.cpu_kernels=auto: MindSpore's own CPU kernels are used (slower): %s", reason)


def use_cpu_kernels(mode="auto") -> bool:
    """Whether a network built now under runtime.cpu_kernels=`mode` runs the CPU kernels (see the module's
    docstring); raises ConfigError for `on` where they cannot run."""
    if check_choice(mode) == "off":
        return False
    device = ms.get_context("device_target")
    from cpu_kernels import has_ops, why_not
    if mode == "on":
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


# The kernel Cells of the zoo's own units: each a subclass of the unit (the same parameters; keep-lists and
# reports name it alike), its construct one of cpu_kernels' ops. KernelCell says what it is to the kernels and to
# the AMP policy (its layout in a blocked stage; weights_as_stored, fp32_inside).
class KernelAddReLU(KernelCell, AddReLU):
    """relu(a + b) in one pass of eltwise.cc (fp32 or fp16; a and b of one shape, any layout)."""
    layout = "any"

    def __init__(self):
        super().__init__()
        self.op = eltwise_op("AddRelu", 2)

    def construct(self, a, b):
        return self.op(a, b)


class KernelAdd(KernelCell, Add):
    """a + b in one pass of eltwise.cc: MindSpore's CPU Add runs several times slower in fp16 than in fp32."""
    layout = "any"

    def __init__(self):
        super().__init__()
        self.op = add_op()

    def construct(self, a, b):
        return self.op(a, b)


class KernelAttentionSoftmax(KernelCell, AttentionSoftmax):
    """softmax(x * scale + bias) in one pass of softmax.cc, computed in fp32 whatever comes in (at O2 the
    scaling and the mask ran as MindSpore's fp16 Mul and Add)."""
    fp32_inside = True

    def __init__(self, scale: float):
        super().__init__(scale)
        self.op = scaled_softmax_op()
        self.scale_tensor = ms.Tensor([scale], ms.float32)

    def construct(self, x, bias):
        return self.op(x, bias, self.scale_tensor)


class KernelBatchMatMul(KernelCell, BatchMatMul):
    """matmul.cc's batched product, fp32 or fp16 computed in fp32 (MindSpore's fp16 BatchMatMul casts to fp32
    and back around its fp32 kernel, in graph ops)."""

    def __init__(self, transpose_b: bool = False):
        super().__init__(transpose_b)
        self.op = bmm_op(transpose_b)


class KernelTokenEmbedding(KernelCell, TokenEmbedding):
    """The token's row scaled and added to its position in one op (embed_op), the fp32 table taken as stored
    and each value rounded as O2's fp16 ops round it (amp_compute: set at O2 by ampzoo.amp.policy)."""
    weights_as_stored = True

    def __init__(self, vocab_size, d_model):
        super().__init__(vocab_size, d_model)
        self.scale_tensor = ms.Tensor([self.scale], ms.float32)

    def construct(self, ids, positions):
        op = embed_op(getattr(self, "amp_compute", "float32") == "float16")
        return op(self.embedding_table, ids, positions, self.scale_tensor)


class KernelTiedProjection(KernelCell, TiedProjection):
    """x w^T taking the fp32 table as it is and returning fp32 logits (fp16 values at O2)."""
    weights_as_stored = True

    def __init__(self):
        super().__init__()
        self.op = affine_op(bias=False, float32_out=True)

    def construct(self, x, table):
        return self.op(x, table)


class KernelCachedSelfAttention(KernelCell, CachedSelfAttention):
    """decode.cc's CachedSelfAttention: positions 0..t only, the cache reordered and written in one op."""

    def __init__(self, heads: int, dh: int):
        super().__init__(heads, dh)
        self.op = cached_attention_op()
        self.scale_tensor = ms.Tensor([self.scale], ms.float32)

    def construct(self, qkv, keys, values, reorder, t, at_t, bias):
        if reorder is None:  # the op copies the cache's rows as it writes them
            reorder = ops.arange(qkv.shape[0], dtype=ms.int32)
        return self.op(qkv, keys, values, reorder, t, self.scale_tensor)


class KernelTopCandidates(KernelCell, TopCandidates):
    """decode.cc's LogSoftmaxTopK: the log-softmax, the specials and the top k in one pass over each row."""

    def construct(self, logits, specials, k):
        return log_softmax_top_k_op(k)(logits, specials)  # k: a Python constant, one op for each



class _BranchedSplit:
    """A residual unit's split through CpuBranch: one kernel Add sums the gradients of its two reads of x (at O2
    MindSpore's fp16 AddN took 66 ms of a ResNet-34 CIFAR step and 19 of a Transformer-Tiny one)."""

    def split(self, x):
        return self.branch(x)


class KernelBasicBlock(_BranchedSplit, BasicBlock):
    """ResNet's BasicBlock, its input through CpuBranch; the same Cells, parameters and wiring (_branched)."""


class KernelBottleneck(_BranchedSplit, Bottleneck):
    """ResNet's Bottleneck, its input through CpuBranch, as KernelBasicBlock."""


class KernelSublayer(Sublayer):
    """The Transformer's residual unit, its input (read by the sublayer and by the residual) through CpuBranch."""

    def split(self, x):
        h, x = self.branch(x)
        return self.pre(h), x


def _branched(kind):
    """A unit of the zoo made `kind` in place (the same object, Cells and parameters), with a CpuBranch added."""
    def make(block):
        block.__class__ = kind
        block.branch = CpuBranch(2)
        return block
    return make


def _parameter_free(kind):
    return lambda cell: kind()


def units() -> dict:
    """The zoo's units -> the function that builds each one's kernel Cell (cpu_kernels.accelerate's `units`)."""
    return {AddReLU: _parameter_free(KernelAddReLU), Add: _parameter_free(KernelAdd),
            AttentionSoftmax: lambda cell: KernelAttentionSoftmax(cell.scale),
            BatchMatMul: lambda cell: KernelBatchMatMul(cell.transpose_b),
            TokenEmbedding: lambda cell: share_parameters(KernelTokenEmbedding(*cell.embedding_table.shape), cell),
            TiedProjection: _parameter_free(KernelTiedProjection),
            CachedSelfAttention: lambda cell: KernelCachedSelfAttention(cell.h, cell.dh),
            TopCandidates: _parameter_free(KernelTopCandidates),
            MaxPool2x2: _parameter_free(CpuMaxPool2x2), Dense: CpuDense.from_cell, LayerNorm: CpuLayerNorm.from_cell,
            BasicBlock: _branched(KernelBasicBlock), Bottleneck: _branched(KernelBottleneck),
            Sublayer: _branched(KernelSublayer)}
