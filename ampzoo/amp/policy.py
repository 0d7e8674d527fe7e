"""Precision policy: turn a recipe's `amp` block into Cell compute dtypes, once, with `Cell.to_float`.

- O0: everything fp32 (force_fp16 Cells still run in low precision).
- O1: fp32 by default; MindSpore's O1 white-list Cells (Conv, Dense, RNN cells) and force_fp16 run in low
  precision, each an island that casts its output back to fp32.
- O2: low precision by default; keep_fp32 Cells (default BatchNorm, LayerNorm) run in fp32 and cast their
  output back to low precision, as MindSpore's own O2 does.
- O3: like O2 with an empty default keep-list.
keep_fp32 names Cell classes (every instance) or sub-module paths (`fc3`, `decoder.layers.3.ffn`: that one).
A Cell says how it computes through class attributes: `runs_fp32` (fp32 at every level: a search's scores),
and the CPU kernels' `weights_as_stored` and `fp32_inside` (cpu_kernels.cells.KernelCell), so no list of kernel
classes lives here.
Parameters stay fp32 at every level; the network's output is cast to fp32 so the loss is computed in fp32.
`Model` must then be given amp_level="O0", or the network would be cast a second time.
"""
import difflib
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import mindspore.nn as nn
import mindspore.ops as ops
from mindspore import dtype as mstype

from ampzoo.amp.names import NN_CELLS, resolve, split_keep
from ampzoo.cells import replace_child
from ampzoo.config import LEVELS
from ampzoo.errors import ConfigError

DTYPES = {"float16": mstype.float16, "bfloat16": mstype.bfloat16}
O1_WHITE_LIST = ["Conv", "Dense", "LSTMCell", "RNNCell", "GRUCell"]
# Measured with mindspore 2.10 on CPU: no bfloat16 kernels for these (BatchNorm rejects the dtype too). The 2.10
# wheel's GPU plugin (lib/plugin/libmindspore_gpu.so.*, gpu/libcuda_ops.so.11) registers no bfloat16 kernel at all.
UNSUPPORTED = {("CPU", "bfloat16"): "Conv2D, MatMul, Reshape and Transpose",
               ("GPU", "bfloat16"): "Conv2D, MatMul, BatchNorm or LayerNorm (its GPU plugin registers none)"}


class CastOutput(nn.Cell):
    """The edge of a precision region: run `cell`, cast its output to `dtype`. Parameter names unchanged."""

    def __init__(self, cell: nn.Cell, dtype):
        super().__init__(auto_prefix=False)
        self.cell = cell
        self.dtype = dtype

    def construct(self, *args):
        return ops.cast(self.cell(*args), self.dtype)


@dataclass
class Policy:
    level: str
    dtype: str
    keep_fp32: List[str]
    force_fp16: List[str]
    reasons: Dict[str, str] = field(default_factory=dict)  # cell path -> why it runs at its dtype


def keep_fp32_names(amp_cfg) -> List[str]:
    level = str(amp_cfg.level)
    return list(LEVELS[level].keep_fp32 if amp_cfg.keep_fp32 is None else amp_cfg.keep_fp32)


def ascend_910a() -> bool:
    """An Ascend 910A (how MindSpore's own amp module tells it: its SoC supports the classic loss-scale
    target). False on a build or machine without Ascend."""
    try:
        from mindspore._c_expression import MSContext
        return bool(MSContext.get_instance().ascend_soc_supports_feature("amp_loss_scale_train_classic_target"))
    except Exception:  # noqa: BLE001  (no Ascend runtime)
        return False


def check_device_dtype(device: str, amp_cfg) -> None:
    level = str(amp_cfg.level)
    dtype = str(amp_cfg.dtype)
    low_precision_used = LEVELS[level].low != "none" or bool(amp_cfg.force_fp16)
    if low_precision_used and dtype == "bfloat16" and device == "Ascend" and ascend_910a():
        raise ConfigError("amp.dtype=bfloat16 is not supported on an Ascend 910A (its cube units compute fp16 "
                          "only; bf16 needs a 910B or later); use amp.dtype=float16")
    if low_precision_used and (device, dtype) in UNSUPPORTED:
        raise ConfigError(f"amp.dtype={dtype} is not supported on {device}: MindSpore has no {device} {dtype} "
                          f"kernel for {UNSUPPORTED[(device, dtype)]}; use amp.dtype=float16 here, "
                          f"or bfloat16 on Ascend")


# O2 against O0 with bf16 products, AMD EPYC and Intel Xeon with AMX (bench.speed, bench.lab.transformer_speed;
# docs/benchmarks.md)
RESNET_BF16, TRANSFORMER_BF16, LENET_BF16 = "1.7-2.3x", "1.07-1.24x", "0.79-1.07x"


def cpu_cost_note(device: str, amp_cfg, choice: str = "auto") -> str:
    """The line a run at a low-precision level logs first on the CPU ("" elsewhere): what its fp16 costs or gains
    here, and why. The project's kernels (cpu_kernels) store fp16 and multiply either in bf16 (runtime.cpu_compute
    `choice`: auto's choice in training on a CPU with AVX512-BF16), which runs faster than fp32, or in fp32, so a
    step does fp32's arithmetic plus the conversions. MindSpore's own fp16 CPU kernels (ops outside the project's
    kernels) run slower than their fp32 ones. The measurements: docs/benchmarks.md."""
    low_precision_used = LEVELS[str(amp_cfg.level)].low != "none" or bool(amp_cfg.force_fp16)
    if device != "CPU" or not low_precision_used:
        return ""
    from cpu_kernels import cpu_compute, has_ops
    where = "docs/benchmarks.md#mixed-precision-on-the-cpu"
    if not has_ops():
        return (f"amp.level={amp_cfg.level} on the CPU runs slower than O0: the CPU kernels are not built, so "
                f"MindSpore's fp16 CPU kernels run everywhere, 2.5-8x slower than fp32 ({where}); on Ascend and "
                f"GPU fp16 runs natively")
    products = cpu_compute()
    if products != "fp32":
        why = (f"runtime.cpu_compute={choice}" if choice != "auto" else
               "auto's choice in training: this CPU has AVX512-BF16")
        return (f"amp.level={amp_cfg.level} on the CPU: the project's kernels store fp16 and multiply in bf16 with "
                f"fp32 sums{' in the backward passes' if products == 'bf16_backward' else ''} ({why}); O2's step "
                f"measured {RESNET_BF16} O0's for ResNet-34, {TRANSFORMER_BF16} for Transformer-Tiny and {LENET_BF16} "
                f"for LeNet-5 on a quiet machine ({where}); runtime.cpu_compute=fp32 multiplies in fp32, as "
                f"MindSpore's casts do")
    why = ("runtime.cpu_compute=fp32" if choice == "fp32" else
           "this CPU has no AVX512-BF16" if cpu_compute(asked="bf16") == "fp32" else
           f"runtime.cpu_compute={choice}, in fp32 here")
    return (f"amp.level={amp_cfg.level} on the CPU is slower than O0 (0.75-0.9x its step on a quiet machine, "
            f"{where}): the project's kernels store fp16 and multiply in fp32 ({why}), so each does fp32's "
            f"arithmetic plus the conversions; on Ascend and GPU fp16 runs natively")


def compute_path(device: str, amp_cfg, kernels_used: bool) -> dict:
    """What a run's low-precision layers computed with, for its first lines and metrics.json (and so the
    manifest and the reproduce table): `kernels` ("device" on Ascend and GPU, "cpu_kernels" or "mindspore" on
    the CPU) and `products`, the arithmetic of its fp16 convolutions and Dense layers in training ("fp32", "bf16",
    "bf16_backward"; "native fp16" on a device, "fp32" at O0). A run's own evaluations keep its training
    products (the process's runtime.cpu_compute stays as training set it); eval.py computes fp32 products under
    runtime.cpu_compute=auto, so a shipped number does not depend on the CPU. `eval_products` says the first
    for metrics.json's reader."""
    low = LEVELS[str(amp_cfg.level)].low != "none" or bool(amp_cfg.force_fp16)
    if device != "CPU":
        kernels, products = "device", "native fp16" if low else "fp32"
    elif not kernels_used:
        kernels, products = "mindspore", "fp32" if not low else "fp32 (MindSpore's casts)"
    else:
        from cpu_kernels import cpu_compute
        kernels, products = "cpu_kernels", cpu_compute() if low else "fp32"
    return {"kernels": kernels, "products": products, "eval_products": products}


def compute_line(path: dict) -> str:
    """compute_path as the run's log line."""
    if path["kernels"] == "device":
        return f"compute: {path['products']} on the device"
    where = "the project's CPU kernels" if path["kernels"] == "cpu_kernels" else "MindSpore's CPU kernels"
    products = {"bf16": "fp16 rounded to bf16 and multiplied in bf16 (fp32 sums)",
                "bf16_backward": "bf16 products in the backward passes, fp32 in the forward"}.get(
                    path["products"], f"{path['products']} products")
    return (f"compute: {where}, {products} in training and in this run's own evaluations; eval.py evaluates a "
            f"checkpoint with fp32 products (runtime.cpu_compute=auto)")


def _walk(cell: nn.Cell, prefix: str, match, on_match) -> None:
    """Replace every sub-Cell for which match(cell, path) holds by on_match(cell, path); not below it."""
    for name, child in list(cell.name_cells().items()):
        path = f"{prefix}.{name}" if prefix else name
        if match(child, path):
            replace_child(cell, name, on_match(child, path))
        else:
            _walk(child, path, match, on_match)


def _mark_subtree(cell: nn.Cell, path: str, reason: str, reasons: Dict[str, str]) -> None:
    reasons[path] = reason
    for sub_path, _ in cell.cells_and_names():
        if sub_path:
            reasons[f"{path}.{sub_path}"] = reason


def check_paths(net: nn.Cell, paths: List[str], key: str = "amp.keep_fp32") -> None:
    """Every path names a sub-module of net, or one line naming the bad path, near matches and the sub-modules."""
    known = [p for p, _ in net.cells_and_names() if p]
    for path in paths:
        if path not in known:
            close = [c for c in NN_CELLS if c.lower() == path.lower()]  # a class name in lower case
            close = close or difflib.get_close_matches(path, known, n=3, cutoff=0.6)
            raise ConfigError(f"{key}: {path!r} is neither a Cell class nor a sub-module of "
                              f"{type(net).__name__}; " + (f"did you mean {', '.join(close)}? " if close else "")
                              + f"its sub-modules: {', '.join(known[:8])}{', ...' if len(known) > 8 else ''} "
                              f"(python -m amp.report lists them all)")


def apply_policy(net: nn.Cell, amp_cfg) -> Tuple[nn.Cell, Policy]:
    level = str(amp_cfg.level)
    dtype_name = str(amp_cfg.dtype)
    low = DTYPES[dtype_name]
    keep_names = keep_fp32_names(amp_cfg)
    keep_classes, keep_paths = split_keep(keep_names)
    check_paths(net, keep_paths)
    keep = resolve(keep_classes, "amp.keep_fp32")

    def kept(cell, path):
        return isinstance(cell, keep) or path in keep_paths
    force = resolve(list(amp_cfg.force_fp16), "amp.force_fp16")
    policy = Policy(level, dtype_name, keep_names, list(amp_cfg.force_fp16))
    reasons = policy.reasons

    if LEVELS[level].low == "all":
        net.to_float(low)
        for path, cell in net.cells_and_names():
            reasons[path] = f"{level} default"
            if getattr(cell, "weights_as_stored", False) and low == mstype.float16:
                # its kernel takes fp16 activations and the fp32 master weight, which it rounds to fp16 values
                # inside (cpu_kernels' convolution): no precision flag, so no Cast on the weight or its gradient
                cell.add_flags_recursive(fp16=False, fp32=False, bf16=False)
                cell.amp_compute = dtype_name
            if getattr(cell, "runs_fp32", False):
                # it computes in fp32 at every level (a search's log-probabilities: TopCandidates): no flag, so
                # MindSpore casts nothing it takes to fp16
                cell.add_flags_recursive(fp16=False, fp32=False, bf16=False)
                reasons[path] = "fp32 at every level (the Cell's runs_fp32)"

        def keep_in_fp32(cell, path):
            _mark_subtree(cell, path, "keep_fp32", reasons)
            if getattr(cell, "fp32_inside", False) and low == mstype.float16:
                # its kernel takes fp16, computes in fp32 and rounds its output (cpu_kernels' BatchNorm): no
                # precision flag at all, so no Cast on its input, its parameters or its output
                cell.add_flags_recursive(fp16=False, fp32=False, bf16=False)
                return cell
            return CastOutput(cell.to_float(mstype.float32), low)
        if keep_names:
            _walk(net, "", kept, keep_in_fp32)
    else:
        white = resolve(O1_WHITE_LIST, "O1 white list") if LEVELS[level].low == "white_list" else ()
        force_only = tuple(c for c in force if c not in white)
        to_low = tuple(c for c in white + force_only if c not in keep)

        def low_here(cell, path):
            return isinstance(cell, to_low) and not any(path == k or path.startswith(k + ".") for k in keep_paths)
        for path, _ in net.cells_and_names():
            reasons[path] = f"{level} default"

        def run_low(cell, path):
            _mark_subtree(cell, path, "force_fp16" if isinstance(cell, force_only) else "O1 white list", reasons)
            return CastOutput(cell.to_float(low), mstype.float32)
        if to_low:
            _walk(net, "", low_here, run_low)
    reasons.pop("", None)
    if LEVELS[level].low == "none" and not force:
        return net, policy
    return CastOutput(net, mstype.float32), policy


def compute_dtype(cell: nn.Cell) -> str:
    if getattr(cell, "amp_compute", None):  # set by apply_policy on a Cell that converts inside its kernel
        return cell.amp_compute
    flags = cell.get_flags()
    if flags.get("fp16"):
        return "float16"
    if flags.get("bf16"):
        return "bfloat16"
    return "float32"
