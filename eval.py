"""Evaluate a checkpoint:  python eval.py recipe=lenet_o2 checkpoint=PATH [output=metrics.json]
                          python eval.py weights=NAME      (a shipped weight: weights/MANIFEST.json)

Builds the recipe's network under its precision policy, loads the weights, and prints and writes top-1,
top-5 and loss (translation: BLEU, sacrebleu's and multi-bleu.perl's) as JSON, with the split and data it
scored (default: next to the checkpoint, <checkpoint>.eval.json, or <checkpoint>.<split>.eval.json for a
translation split; a shipped weight: runs/weights/NAME...). The summary line puts the recipe's target metric
first. With weights=NAME, any key of the weight's own recipe applies (dataset.params.test_prefix=val,
decode.beam=4); the JSON records the command line's keys, and one that changes what is evaluated names its own
file (runs/weights/NAME.amp.level-O0.eval.json), never the plain result's.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import json
from pathlib import Path

from ampzoo.data import task
from ampzoo.engine.evaluate import evaluate, hypotheses_file
from ampzoo.engine.load import user_keys
from ampzoo.engine.weights import checkpoint_config, override_tag, overrides
from ampzoo.paths import check_writable


# How the summary line names each metric; the recipe's target.metric comes first.
SHOWN = {"bleu_lowercase": "BLEU {:.2f} lowercased (sacrebleu 13a, detokenized)",
         "bleu_moses_lc": "BLEU {:.2f} lowercased Moses tokens (multi-bleu.perl, the paper's scorer)",
         "bleu": "BLEU {:.2f} cased (sacrebleu 13a)",
         "top1": "top-1 {:.2f}%", "top5": "top-5 {:.2f}%", "loss": "loss {:.4f}"}


def summary(result: dict, target: str) -> str:
    order = [target] + [k for k in SHOWN if k != target]
    return "  ".join(SHOWN[k].format(result[k] * (100 if k.startswith("top") else 1)) for k in order if k in result)


def split_of(cfg) -> str:
    """The split eval.py scores: a translation data set names its test files (dataset.params.test_prefix)."""
    return str(cfg.dataset.params.get("test_prefix") or "test") if task(cfg) == "translation" else "test"


def result_path(cfg, argv) -> Path:
    """output= when given; else beside the checkpoint (a shipped weight: runs/weights/NAME), named with the split
    when it is not "test", so that scoring another split keeps this one, and with the overrides that change what
    is evaluated (amp.level=O0, decode.beam=1), so that an overridden result never replaces the plain one."""
    if "output" in user_keys(argv):
        return Path(cfg.output)
    default = Path(cfg.output or f"{cfg.checkpoint}.eval.json")
    split = split_of(cfg)
    tag = override_tag(argv)
    parts = [p for p in (tag, "" if split == "test" else split) if p]
    return default.with_name(".".join([default.name.removesuffix(".eval.json"), *parts, "eval.json"]))


def main(argv) -> None:
    cfg, smoke_note = checkpoint_config(argv, ".eval.json")
    out = check_writable(result_path(cfg, argv), "output")  # before minutes of evaluation
    cfg.output = str(out)
    if task(cfg) == "translation":
        check_writable(hypotheses_file(cfg), "output (its .hyp.txt)")
    result = evaluate(cfg)
    record = {"recipe": cfg.recipe_name, "checkpoint": str(cfg.checkpoint), "split": split_of(cfg),
              "data": cfg.dataset.path or ("embedded (smoke)" if smoke_note else "embedded"),
              "overrides": overrides(argv), "target_metric": cfg.target.metric, **result}
    partial = out.with_name(f".{out.name}.partial")  # written whole or not at all
    out.parent.mkdir(parents=True, exist_ok=True)  # output= may name a folder still to make (checked writable)
    partial.write_text(json.dumps(record, indent=2))
    partial.replace(out)
    print(json.dumps(record))
    beam = f"  (beam {result['beam']})" if "beam" in result else ""
    print(f"{record['split']} split of {record['data']}: {summary(result, cfg.target.metric)}{beam}  "
          f"(written to {out})")


if __name__ == "__main__":
    run(main)
