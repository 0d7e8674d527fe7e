"""Why loss scaling exists, measured: how many gradient values underflow to zero in fp16 at each loss scale.

    python -m bench.lab.underflow recipe=transformer_base_o2 [key=value ...] [--scales 1,1024,65536]
                              [--checkpoint PATH]

One real training batch of the recipe (its smoke data when no dataset.path is given), one set of weights:
the initial ones, or a trained checkpoint's (gradients shrink as training converges, and underflow grows).
The fp32 network's gradients are the reference; then the same weights under amp.level=O3 (every Cell
fp16) give gradients with the loss multiplied by each scale (and divided back). Per scale it reports the
share of the fp32 gradient's non-zero values that come back as exactly zero (underflow), and the relative
error of the whole gradient. bench.run's matrix trains the same recipe at O3 with no scale and with a dynamic
one, for the outcome; docs/benchmarks.md shows both.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

from pathlib import Path

import mindspore as ms
import mindspore.ops as ops
import numpy as np
from omegaconf import OmegaConf

from ampzoo.amp.policy import apply_policy
from ampzoo.data import create_dataset
from ampzoo.engine.checkpoint import read_checkpoint
from ampzoo.engine.metrics import NetWithLoss, create_loss
from bench.common import bench_config, pop_option, save_result
from ampzoo.engine.network import build_model


def gradients(cfg, level: str, scale: float, params, batch) -> dict:
    net = build_model(cfg)
    ms.load_param_into_net(net, params)
    amp_cfg = OmegaConf.merge(cfg.amp, {"level": level, "keep_fp32": [] if level == "O3" else None})
    net, _ = apply_policy(net, amp_cfg)
    net_with_loss = NetWithLoss(net, create_loss(cfg.trainer))
    weights = ms.ParameterTuple(net.trainable_params())
    grad = ops.GradOperation(get_by_list=True, sens_param=True)(net_with_loss, weights)
    loss = net_with_loss(*batch)
    grads = grad(*batch, ops.ones_like(loss) * scale)
    return {w.name: g.asnumpy().astype(np.float64) / scale for w, g in zip(weights, grads)}


def main(argv) -> dict:
    scales, argv = pop_option(argv, "--scales", [1.0, 1024.0, 65536.0],
                              lambda v: [float(x) for x in v.split(",")])
    checkpoint, argv = pop_option(argv, "--checkpoint", None, str)
    cfg = bench_config(argv)
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_seed(cfg.runtime.seed)
    batch = next(create_dataset(cfg.dataset, "train", seed=cfg.runtime.seed).create_tuple_iterator())
    params = {p.name: ms.Parameter(p.data.copy(), name=p.name)
              for p in build_model(cfg).get_parameters()}
    if checkpoint:
        saved = read_checkpoint(Path(checkpoint))
        params = {k: ms.Parameter(saved[k], name=k) if k in saved else v for k, v in params.items()}
    ref = gradients(cfg, "O0", 1.0, params, batch)
    nonzero = {k: v != 0 for k, v in ref.items()}
    total = sum(int(m.sum()) for m in nonzero.values())
    ref_norm = np.sqrt(sum(float((v ** 2).sum()) for v in ref.values()))
    rows = []
    for scale in scales:
        low = gradients(cfg, "O3", scale, params, batch)
        zeroed = sum(int((nonzero[k] & (low[k] == 0)).sum()) for k in ref)
        finite = all(np.isfinite(v).all() for v in low.values())
        err = np.sqrt(sum(float(((low[k] - ref[k]) ** 2).sum()) for k in ref)) / ref_norm if finite else float("inf")
        tiny = sum(int((nonzero[k] & (np.abs(ref[k]) * scale < 2.0 ** -24)).sum()) for k in ref)
        rows.append({"scale": scale, "underflow_share": zeroed / total, "below_fp16_tiny_share": tiny / total,
                     "relative_error": err, "finite": finite})
        print(f"{cfg.recipe_name} O3 ({'trained' if checkpoint else 'initial'} weights), loss scale {scale:g}: "
              f"{100 * zeroed / total:.2f}% of the non-zero fp32 gradient values come back as 0; relative error "
              f"{err:.3g}{'' if finite else ' (inf/NaN: overflow)'}")
    result = {"recipe": cfg.recipe_name, "weights": checkpoint or "initial", "values": total, "rows": rows}
    save_result(f"underflow-{cfg.recipe_name}{'-trained' if checkpoint else ''}", result, timed=False)
    return result


if __name__ == "__main__":
    run(main)
