"""Precision report: every Cell, the dtype it computes in, its parameters' dtype, and why.

    python -m amp.report recipe=lenet_o2 [key=value ...] [--diff O1 O3]
    python -m amp.report weights=NAME | checkpoint=FILE      (the network those weights belong to)

The compute dtype is read from the flags `Cell.to_float` set on the built network (what MindSpore's
compiler casts by), not from the recipe; the reason comes from the policy that set them.
"""
from typing import Dict, List

from ampzoo.amp.policy import apply_policy
from ampzoo.amp.precision import diff, precision_report, to_markdown
from ampzoo.config import LEVELS
from ampzoo.engine.checkpoint import load_weights
from ampzoo.engine.load import load_config
from ampzoo.engine.weights import as_trained, weights_argv
from ampzoo.errors import fail
from ampzoo.engine.network import build_model


def build_report(overrides: List[str]) -> Dict:
    """The report of the network the command line names; with checkpoint=FILE or weights=NAME, the network those
    weights belong to (the recipe as written, not its smoke block), the weights loaded to prove they fit."""
    overrides, checkpoint, weights = weights_argv(overrides)
    # a report builds the network and reads no data
    cfg, _ = load_config(overrides, needs_data=False, smoke=checkpoint is None)
    cfg = as_trained(cfg, checkpoint, overrides)
    net = build_model(cfg)
    if checkpoint is not None:
        load_weights(net, checkpoint, cfg.model.name)
    net, policy = apply_policy(net, cfg.amp)
    report = precision_report(net, policy)
    report["weights"] = weights
    return report


def main(argv: List[str]) -> None:
    levels = []
    if "--diff" in argv:
        i = argv.index("--diff")
        levels, argv = argv[i + 1:i + 3], argv[:i] + argv[i + 3:]
        if len(levels) != 2 or any(lv not in LEVELS for lv in levels):
            fail(f"--diff takes two levels from {', '.join(LEVELS)}; got {' '.join(levels) or 'nothing'}")
    if levels:
        a, b = (build_report(argv + [f"amp.level={lv}"]) for lv in levels)
        print(diff(a, b))
    else:
        report = build_report(argv)
        print(f"weights: {report['weights']}\n\n{to_markdown(report)}")

