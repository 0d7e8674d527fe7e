"""Evaluate a checkpoint:  python eval.py recipe=lenet_o2 checkpoint=PATH [output=metrics.json]
                          python eval.py weights=NAME      (a shipped weight: weights/MANIFEST.json)

Builds the recipe's network under its precision policy, loads the weights, and prints and writes top-1,
top-5 and loss as JSON (default: next to the checkpoint, <checkpoint>.eval.json).
"""
from zoo.entry import run  # first: a command's start-up, before MindSpore loads

import json
import sys
from pathlib import Path

from mindspore.train import Model

from data import create_dataset, task
from engine.checkpoint import inference_network
from engine.metrics import NetWithEval, create_loss, metrics
from engine.weights import checkpoint_config
from models.decoding import translate


def evaluate(cfg) -> dict:
    net, cfg, notes, fused = inference_network(cfg, "eval.py")
    for note in notes:
        print(note, file=sys.stderr)
    loss_fn = create_loss(cfg.trainer)
    model = Model(net, eval_network=NetWithEval(net, loss_fn), metrics=metrics(), eval_indexes=[0, 1, 2])
    result = {k: float(v) for k, v in model.eval(create_dataset(cfg.dataset, "test"),
                                                  dataset_sink_mode=False).items()}
    if fused is not None:
        result["fused_conv_bn_pairs"] = fused["fused_pairs"]
    if task(cfg) == "translation":
        hyp_file = Path(cfg.output or f"{cfg.checkpoint}.eval.json").with_suffix(".hyp.txt")
        result.update(translate(net, cfg, "test", cfg.decode.beam, cfg.decode.length_penalty, hyp_file))
        result["hypotheses"] = str(hyp_file)
    return result


def main(argv) -> None:
    cfg, smoke_note = checkpoint_config(argv, ".eval.json")
    result = evaluate(cfg)
    out = Path(cfg.output) if cfg.output else Path(str(cfg.checkpoint) + ".eval.json")
    record = {"recipe": cfg.recipe_name, "checkpoint": str(cfg.checkpoint),
              "data": cfg.dataset.path or ("embedded (smoke)" if smoke_note else "embedded"),
              **result}
    out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record))
    bleu = f"  BLEU {result['bleu']:.2f} (beam {result['beam']})" if "bleu" in result else ""
    print(f"top-1 {result['top1'] * 100:.2f}%  top-5 {result['top5'] * 100:.2f}%  loss {result['loss']:.4f}{bleu}"
          f"  (written to {out})")


if __name__ == "__main__":
    run(main)
