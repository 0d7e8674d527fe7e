"""fp16 audit: which Cells are unsafe in low precision, measured on one real batch.

    python -m amp.audit recipe=NAME [key=value ...] [--json PATH] [--tolerance 0.01]

In PyNative mode, the recipe's network runs one batch of its real training data in fp32 with a hook on
every leaf Cell (inputs and outputs kept). Then, for each leaf Cell the policy runs in low precision, the
Cell alone is run on its recorded fp32 input under the policy (its local error, not inherited from earlier
layers), and the whole network under the policy (its end-to-end error). Per Cell it reports max |x|
against the fp16 limit, the share of values that underflow to zero, the relative error against fp32,
and float constants (eps and the like) that vanish or lose most of their value in the low dtype.
It ends with a suggested keep_fp32 list: the classes of the Cells that overflow, lose their constants,
or whose local error exceeds the tolerance (marked when it only repeats the recipe's). Cells that only select or
move values (ReLU, max-pooling, Flatten, Dropout) are measured but never flagged: fp16 adds no error of theirs.

The network has its initial weights unless checkpoint=FILE or weights=NAME (a shipped weight, sha256 checked,
with its own recipe) gives trained ones: fp16 trouble grows with training, so audit the weights that diverged.

Without its data: a recipe with a smoke block audits the smoke data, as train.py trains on it; an idx-format
recipe whose own data path is not on this machine (Fashion-MNIST before its package is installed) audits one
batch of the embedded MNIST digits, the same 28x28 grey format, and says so.
"""
import json
import sys
from pathlib import Path
from typing import Dict, List

import mindspore as ms
import mindspore.nn as nn
import numpy as np

from ampzoo.amp.names import portable
from ampzoo.amp.policy import apply_policy, compute_dtype, compute_path
from ampzoo.amp.precision import units
from ampzoo.amp.ranking import EXACT
from ampzoo.cli import pop_option
from ampzoo.data import create_dataset
from ampzoo.engine.checkpoint import load_weights
from ampzoo.engine.load import load_config, user_keys, validate
from ampzoo.engine.weights import as_trained, weights_argv
from ampzoo.errors import ConfigError, fail
from ampzoo.paths import check_writable
from ampzoo.runtime import set_context
from ampzoo.engine.network import build_model

FP16_MAX = 65504.0
FP16_TINY = 2.0 ** -24  # smallest fp16 subnormal: anything smaller in magnitude becomes 0
BF16_TINY = 2.0 ** -133


def _np(x) -> np.ndarray:
    return x.astype("float32").asnumpy() if hasattr(x, "asnumpy") else np.asarray(x, dtype=np.float32)


def _rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))


def vanishing_constants(cell, dtype: str) -> List[str]:
    """Float attributes (epsilons, scales) that become 0 or lose over 10% of their value in `dtype`."""
    out = []
    for name, value in vars(cell).items():
        if name.startswith("_") or isinstance(value, bool) or not isinstance(value, float) or value == 0:
            continue
        if dtype == "float16":
            low = float(np.float16(value))
        else:  # bfloat16: keep the top 16 bits of the fp32 pattern
            low = float(np.frombuffer((np.array([value], np.float32).view(np.uint32) & 0xFFFF0000).tobytes(),
                                      np.float32)[0])
        if low == 0.0:
            out.append(f"{name}={value:g} is 0 in {dtype}")
        elif abs(low - value) / abs(value) > 0.1:
            out.append(f"{name}={value:g} becomes {low:g} in {dtype}")
    return out


def unit_flops(cell, inputs, output: np.ndarray) -> int:
    """Multiply-adds x 2 of a matmul or convolution; one operation per output value for anything else."""
    if isinstance(cell, nn.Dense):
        return 2 * cell.in_channels * output.size
    if isinstance(cell, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return 2 * cell.in_channels // cell.group * int(np.prod(cell.kernel_size)) * output.size
    if "MatMul" in type(cell).__name__ and len(inputs) == 2:
        return 2 * int(inputs[0].shape[-1]) * output.size
    return int(output.size)


def audit(net_builder, amp_cfg, batch, tolerance: float = 1e-2) -> Dict:
    """net_builder() -> a fresh fp32 network; batch: the network's inputs (Tensors). One row per compute unit
    (ampzoo.amp.precision.units: the Cells a keep-list names, e.g. Dense, LayerNorm, Softmax, BatchMatMul)."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    net = net_builder()
    net.set_train(False)
    leaves = units(net)
    record: Dict[str, Dict] = {}

    def hook_for(path, store):
        def hook(cell, inputs, output):
            store[path] = {"inputs": inputs, "output": _np(output)}
        return hook

    handles = [c.register_forward_hook(hook_for(p, record)) for p, c in leaves]
    fp32_out = _np(net(*batch))
    for h in handles:
        h.remove()

    policy_net, policy = apply_policy(net, amp_cfg)  # same weights: the policy only sets flags and casts
    policy_record: Dict[str, Dict] = {}
    handles = [c.register_forward_hook(hook_for(p, policy_record)) for p, c in leaves]
    policy_out = _np(policy_net(*batch))
    for h in handles:
        h.remove()

    tiny = FP16_TINY if policy.dtype == "float16" else BF16_TINY
    rows, suggest = [], []
    for path, cell in leaves:
        if path not in record:
            continue  # not called in this forward pass
        dtype = compute_dtype(cell)
        ref = record[path]["output"]
        nonzero = ref[ref != 0]
        row = {
            "path": path, "class": type(cell).__name__, "dtype": dtype,
            "params": int(sum(p.size for p in cell.get_parameters())),
            "flops": unit_flops(cell, record[path]["inputs"], ref),
            "max_abs_fp32": float(np.max(np.abs(ref))) if ref.size else 0.0,
            "underflow_share": float(np.mean(np.abs(nonzero) < tiny)) if nonzero.size else 0.0,
            "end_to_end_rel_err": _rel_err(policy_record[path]["output"], ref) if path in policy_record else None,
            "local_rel_err": 0.0, "constants": [], "flags": [],
        }
        if dtype != "float32" and portable(row["class"]) in EXACT:  # selects or moves values: no error of its own
            row["selects_values"] = True
        elif dtype != "float32":
            local = _np(cell(*record[path]["inputs"]))
            row["local_rel_err"] = _rel_err(local, ref)
            row["max_abs_low"] = float(np.max(np.abs(local))) if np.all(np.isfinite(local)) else float("inf")
            row["constants"] = vanishing_constants(cell, dtype)
            if dtype == "float16" and (row["max_abs_fp32"] > FP16_MAX or not np.isfinite(row["max_abs_low"])):
                row["flags"].append("overflow")
            if row["underflow_share"] > 0.01:
                row["flags"].append("underflow")
            if row["local_rel_err"] > tolerance:
                row["flags"].append("error")
            if row["constants"]:
                row["flags"].append("constant")
            if set(row["flags"]) & {"overflow", "error", "constant"}:
                suggest.append(portable(row["class"]))  # CpuConv2d -> Conv2d: the list must hold on Ascend
        rows.append(row)
    ms.set_context(mode=ms.GRAPH_MODE)
    keep = sorted(set(policy.keep_fp32) | set(suggest))
    return {"level": policy.level, "dtype": policy.dtype, "tolerance": tolerance, "cells": rows,
            "output_rel_err": _rel_err(policy_out, fp32_out), "flagged_classes": sorted(set(suggest)),
            "suggested_keep_fp32": keep, "recipe_keep_fp32": sorted(policy.keep_fp32),
            "suggestion_adds": sorted(set(suggest) - set(policy.keep_fp32))}


def to_markdown(result: Dict) -> str:
    def fmt(v) -> str:
        return "-" if v is None else ("inf" if v == float("inf") else f"{v:.2e}")
    compute = result.get("compute")
    products = ""
    if compute:
        kernels = "the project's CPU kernels" if compute["kernels"] == "cpu_kernels" else compute["kernels"]
        also = "; runtime.cpu_compute=fp32 audits fp32 products" if compute["products"] != "fp32" else ""
        products = f"measured with {compute['products']} products, as training computes them here ({kernels}{also})"
    lines = [f"# fp16 audit: {result['level']} ({result['dtype']}), tolerance {result['tolerance']:g}", "",
             *([products, ""] if products else []),
             *([f"weights: {result['weights']}", ""] if result.get("weights") else []),
             "| cell | class | dtype | max abs (fp32) | underflow | local rel err | end-to-end rel err | flags |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in result["cells"]:
        flags = ", ".join(r["flags"] + r["constants"]) or ("selects values: not judged" if r.get("selects_values")
                                                            else "")
        lines.append(f"| {r['path']} | {r['class']} | {r['dtype']} | {r['max_abs_fp32']:.3g} | "
                     f"{r['underflow_share'] * 100:.2f}% | {fmt(r['local_rel_err'])} | "
                     f"{fmt(r['end_to_end_rel_err'])} | {flags} |")
    lines += ["", f"network output relative error: {fmt(result['output_rel_err'])}",
              f"flagged: {', '.join(result['flagged_classes']) or 'nothing'}",
              f"suggested: amp.keep_fp32=[{','.join(result['suggested_keep_fp32'])}]"
              + ("" if result.get("suggestion_adds", True) else
                 " (the recipe's own keep-list: the audit adds nothing)")]
    return "\n".join(lines) + "\n"


def audit_config(argv: List[str], checkpoint=None):
    """(config, note or None) for the audit: the recipe's own data (a train.py checkpoint: its run's config), or
    a stand-in batch where the recipe's default data path is absent (one given on the command line must exist)."""
    cfg, smoke_note = load_config(argv, needs_data=False)
    cfg = as_trained(cfg, checkpoint, argv)
    smoke_note = smoke_note if cfg.dataset.path is None else None
    path = cfg.dataset.path
    if (path is None or Path(path).expanduser().exists() or "dataset.path" in user_keys(argv)
            or cfg.dataset.name != "mnist"):
        validate(cfg)  # a bad path: the one error line naming it
        return cfg, smoke_note
    install = cfg.dataset.params.get("install")
    cfg.dataset.path = None  # the embedded MNIST subset: ampzoo/data/mnist.py
    return cfg, (f"note: {path} is not on this machine{f' ({install})' if install else ''}; the audit measures one "
                 f"batch of the embedded MNIST digits instead (the same 28x28 grey format). Install the data to audit "
                 f"on the recipe's own.")


def main(argv: List[str]) -> None:
    out, argv = pop_option(argv, "--json", None, str)
    tolerance, argv = pop_option(argv, "--tolerance", 1e-2, float)
    if tolerance <= 0:
        fail(f"--tolerance {tolerance} must be positive")
    if out:
        out = str(check_writable(out, "--json"))
    try:
        argv, checkpoint, weights = weights_argv(argv)  # a trained network's activations are what fp16 must hold
        cfg, smoke_note = audit_config(argv, checkpoint)
        if smoke_note:
            print(smoke_note, file=sys.stderr)
        device = set_context(cfg.runtime)
        from ampzoo.engine.network import set_cpu_compute, use_cpu_kernels
        set_cpu_compute(cfg.runtime.cpu_compute, training=True)  # the products the recipe trains with
        import mindspore as ms
        ms.set_seed(cfg.runtime.seed)
        batch = next(create_dataset(cfg.dataset, "train").create_tuple_iterator())
        inputs = batch[:-1]  # the last column is the label

        def network():
            net = build_model(cfg)
            if checkpoint is not None:
                load_weights(net, checkpoint, cfg.model.name)
            return net
        result = audit(network, cfg.amp, inputs, tolerance)
        result["compute"] = compute_path(device, cfg.amp, device == "CPU" and use_cpu_kernels(cfg.runtime.cpu_kernels))
        result["weights"] = weights if checkpoint else (f"{weights} (seed {cfg.runtime.seed}); checkpoint=FILE or "
                                                        f"weights=NAME audits trained ones")
    except ConfigError as e:
        fail(str(e))
    print(to_markdown(result))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)

