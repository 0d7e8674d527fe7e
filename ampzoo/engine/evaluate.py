"""What eval.py computes for a checkpoint: top-1, top-5 and loss on the test split (translation: BLEU too, with
the hypotheses written beside the result). bench.verify re-derives the shipped numbers with the same function."""
import sys
from pathlib import Path

from mindspore.train import Model

from ampzoo.data import create_dataset, task
from ampzoo.engine.checkpoint import inference_network
from ampzoo.engine.metrics import NetWithEval, create_loss, metrics
from ampzoo.models.decoding import translate


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
