"""Evaluate a checkpoint:  python eval.py recipe=lenet_o2 checkpoint=PATH [output=metrics.json]
                          python eval.py weights=NAME      (a shipped weight: weights/MANIFEST.json)

Builds the recipe's network under its precision policy, loads the weights, and prints and writes top-1,
top-5 and loss as JSON (default: next to the checkpoint, <checkpoint>.eval.json).
"""
import sys

from zoo.entry import prepare, run

prepare()  # before MindSpore is imported

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from mindspore.train import Model  # noqa: E402

from data import create_dataset, task  # noqa: E402
from engine.checkpoint import inference_network  # noqa: E402
from engine.metrics import NetWithEval, create_loss, metrics  # noqa: E402
from engine.weights import checkpoint_config  # noqa: E402
from models.decoding import translate  # noqa: E402
from zoo.paths import check_writable  # noqa: E402



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
        hyp_file = hypotheses_file(cfg)
        result.update(translate(net, cfg, "test", cfg.decode.beam, cfg.decode.length_penalty, hyp_file))
        result["hypotheses"] = str(hyp_file)
    return result


def hypotheses_file(cfg) -> Path:
    return Path(cfg.output or f"{cfg.checkpoint}.eval.json").expanduser().with_suffix(".hyp.txt")


def main(argv) -> None:
    cfg, smoke_note = checkpoint_config(argv, ".eval.json")
    out = check_writable(cfg.output or f"{cfg.checkpoint}.eval.json", "output")  # before minutes of evaluation
    if task(cfg) == "translation":
        check_writable(hypotheses_file(cfg), "output (its .hyp.txt)")
    result = evaluate(cfg)
    record = {"recipe": cfg.recipe_name, "checkpoint": str(cfg.checkpoint),
              "data": cfg.dataset.path or ("embedded (smoke)" if smoke_note else "embedded"),
              **result}
    partial = out.with_name(f".{out.name}.partial")  # written whole or not at all
    partial.write_text(json.dumps(record, indent=2))
    partial.replace(out)
    print(json.dumps(record))
    bleu = f"  BLEU {result['bleu']:.2f} (beam {result['beam']})" if "bleu" in result else ""
    print(f"top-1 {result['top1'] * 100:.2f}%  top-5 {result['top5'] * 100:.2f}%  loss {result['loss']:.4f}{bleu}"
          f"  (written to {out})")


if __name__ == "__main__":
    run(main)
