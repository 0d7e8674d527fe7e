"""Evaluate a checkpoint:  python eval.py recipe=lenet_o2 checkpoint=PATH [output=metrics.json]

Builds the recipe's network under its precision policy, loads the weights, and prints and writes top-1,
top-5 and loss as JSON (default: next to the checkpoint, <checkpoint>.eval.json).
"""
import sys

from zoo.runtime import cap_onednn_isa, quiet_mindspore

cap_onednn_isa()  # before MindSpore is imported
quiet_mindspore()

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from zoo.config import ConfigError, apply_smoke, check_command_line, compose, fail  # noqa: E402


def evaluate(cfg) -> dict:
    import mindspore.nn as nn
    from mindspore.train import Model

    from amp.policy import apply_policy, check_device_dtype
    from data import create_dataset
    from models import create_model
    from zoo.checkpoint import load_weights
    from zoo.metrics import eval_network, metrics
    from zoo.runtime import set_context

    if not cfg.checkpoint:
        raise ConfigError("checkpoint is not set; run: python eval.py recipe=NAME checkpoint=PATH/TO/model.ckpt")
    cfg, smoke_note = apply_smoke(cfg)
    if smoke_note:
        print(smoke_note, file=sys.stderr)
    device = set_context(cfg.runtime)
    check_device_dtype(device, cfg.amp)
    net = create_model(cfg.model.name, num_classes=cfg.model.num_classes, **cfg.model.params)
    load_weights(net, cfg.checkpoint, cfg.model.name)
    net, _ = apply_policy(net, cfg.amp)
    net.set_train(False)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.trainer.label_smoothing)
    model = Model(net, eval_network=eval_network(net, loss_fn), metrics=metrics(), eval_indexes=[0, 1, 2])
    result = model.eval(create_dataset(cfg.dataset, "test"), dataset_sink_mode=False)
    return {k: float(v) for k, v in result.items()}


def main(argv) -> None:
    check_command_line(argv)
    cfg = compose(argv)
    try:
        result = evaluate(cfg)
    except ConfigError as e:
        fail(str(e))
    out = Path(cfg.output) if cfg.output else Path(str(cfg.checkpoint) + ".eval.json")
    record = {"recipe": cfg.recipe_name, "checkpoint": str(cfg.checkpoint),
              "data": cfg.dataset.path or ("embedded (smoke)" if cfg.smoke else "embedded"),
              **result}
    out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record))
    print(f"top-1 {result['top1'] * 100:.2f}%  top-5 {result['top5'] * 100:.2f}%  loss {result['loss']:.4f}"
          f"  (written to {out})")


if __name__ == "__main__":
    main(sys.argv[1:])
