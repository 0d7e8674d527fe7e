"""What does our driver cost per step over bare MindSpore?

    python -m bench.lab.overhead recipe=lenet_o2 [key=value ...] [--block 25]

One process, interleaved in blocks of steps: train.py's `train()` runs the recipe with every callback on
(telemetry, divergence watch, TensorBoard, checkpoints, evaluation; the progress bar off) and our AmpTrainStep.
After every block of its steps, a callback runs the same number of bare steps: `Model.train` over the first
`block` batches of the same data pipeline, with the same network, optimizer and schedule, MindSpore's own
amp_level and FixedLossScaleManager, and only a step timer. Each block pair gives a ratio
of median step times (the step at each block edge is left out); the overhead is the median of the ratios,
with a bootstrap 95% interval. A second bare network, run in the same blocks (order alternating), gives an
A/A ratio: the noise floor of the measurement, which is what "within 2%" has to be read against.

Pairing block by block matters on a shared machine, where whole runs of the same code a minute apart differ
by more than the overhead measured (docs/benchmarks.md, "Our driver against bare MindSpore"). Bare MindSpore
accepts only a fixed loss scale without overflow skipping (or none) on CPU, so the recipe must use one of those.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import mindspore as ms
import mindspore.nn as nn
from mindspore.amp import FixedLossScaleManager
from mindspore.train import Callback, Model

from ampzoo.data import create_dataset
from ampzoo.engine.callbacks import StepOffset
from ampzoo.engine.optim import create_optimizer, lr_schedule, scaled_lr
from ampzoo.errors import fail
from bench.common import bench_config, bootstrap_ci, pop_option, save_result
from models import build_model


class StepTimes(Callback):
    def __init__(self):
        self.times, self.last = [], None

    def on_train_begin(self, run_context):
        self.times, self.last = [], time.perf_counter()

    def on_train_step_end(self, run_context):
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now


class BareBlocks(Callback):
    """Times our steps; after every `block` of them, runs and times `block` steps of two bare Models."""

    def __init__(self, cfg, block: int):
        steps_per_epoch = create_dataset(cfg.dataset, "train").get_dataset_size()
        self.bare, self.bare2 = bare_model(cfg, steps_per_epoch), bare_model(cfg, steps_per_epoch)
        self.data = {id(m): create_dataset(cfg.dataset, "train", seed=cfg.runtime.seed).take(block)
                     for m in (self.bare, self.bare2)}  # MindSpore wants one dataset per Model
        self.block = block
        self.ours, self.theirs, self.theirs2 = [], [], []  # per block: step times in seconds, first step left out
        self.current, self.last = [], None

    def bare_steps(self, model) -> list:
        timer = StepTimes()
        model.train(1, self.data[id(model)], callbacks=[timer], dataset_sink_mode=False)
        return timer.times[1:]

    def on_train_epoch_begin(self, run_context):
        self.current, self.last = [], time.perf_counter()

    def on_train_step_end(self, run_context):
        now = time.perf_counter()
        self.current.append(now - self.last)
        if len(self.current) == self.block:
            self.ours.append(self.current[1:])
            first, second = (self.bare, self.bare2) if len(self.ours) % 2 else (self.bare2, self.bare)
            times = {id(first): self.bare_steps(first)}
            times[id(second)] = self.bare_steps(second)
            self.theirs.append(times[id(self.bare)])
            self.theirs2.append(times[id(self.bare2)])
            self.current = []
        self.last = time.perf_counter()


def bare_model(cfg, steps_per_epoch: int):
    ls = cfg.amp.loss_scale
    scale = float(ls.scale) if ls.type == "fixed" else 1.0
    net = build_model(cfg)
    lr = lr_schedule(cfg.schedule, scaled_lr(cfg.optimizer, cfg.dataset.batch_size), steps_per_epoch,
                     cfg.trainer.epochs)  # as many steps as ours: the bare Models run one block per block of ours
    opt = create_optimizer(net.trainable_params(), cfg.optimizer, lr, scale)
    manager = FixedLossScaleManager(scale, drop_overflow_update=False) if ls.type == "fixed" else None
    return Model(net, nn.CrossEntropyLoss(label_smoothing=cfg.trainer.label_smoothing), opt,
                 amp_level=str(cfg.amp.level), loss_scale_manager=manager)


def ratio_of_blocks(a_blocks, b_blocks):
    """Median over blocks of the ratio of median step times (the first block of each warms up), 95% interval."""
    ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(a_blocks, b_blocks)][1:]
    return statistics.median(ratios), bootstrap_ci(ratios), ratios


def with_blocks(blocks: BareBlocks):
    """The driver's own StepOffset (the first callback of every run) that also runs `blocks`: the lab's way into
    train.py's callbacks without a hook in the product."""
    class StepOffsetAndBlocks(StepOffset):
        def on_train_begin(self, run_context):
            super().on_train_begin(run_context)
            blocks.on_train_begin(run_context)

        def on_train_epoch_begin(self, run_context):
            blocks.on_train_epoch_begin(run_context)

        def on_train_step_end(self, run_context):
            blocks.on_train_step_end(run_context)
    return StepOffsetAndBlocks


def main(argv) -> dict:
    import train as driver

    block, argv = pop_option(argv, "--block", 25)
    cfg = bench_config([*argv, "logger.progress_bar=false"])
    ls = cfg.amp.loss_scale
    if ls.type == "dynamic" or (ls.type == "fixed" and ls.drop_overflow_update):
        fail("bench.lab.overhead compares against bare Model.train, which on CPU accepts only no loss scale or a "
             "fixed one without overflow skipping; use a recipe like lenet_o2 or lenet_o0")
    ms.set_device("CPU")
    blocks = BareBlocks(cfg, block)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "run").mkdir()
        with mock.patch.object(driver, "StepOffset", with_blocks(blocks)):
            driver.train(cfg, Path(tmp) / "run")
    ratio, (low, high), ratios = ratio_of_blocks(blocks.ours, blocks.theirs)
    aa, (aa_low, aa_high), _ = ratio_of_blocks(blocks.theirs2, blocks.theirs)
    def ms_of(blocks_) -> float:
        return round(statistics.median(statistics.median(b) for b in blocks_[1:]) * 1e3, 3)
    result = {"recipe": cfg.recipe_name, "block_steps": block, "blocks": len(ratios),
              "ours_step_ms": ms_of(blocks.ours), "bare_step_ms": ms_of(blocks.theirs),
              "ratio": ratio, "ratio_95ci": [low, high], "aa_ratio": aa, "aa_95ci": [aa_low, aa_high],
              "ratios": ratios}
    def pct(r: float) -> str:
        return f"{100 * (r - 1):+.1f}%"
    print(f"{cfg.recipe_name}: our driver {result['ours_step_ms']:.2f} ms/step, bare MindSpore "
          f"{result['bare_step_ms']:.2f} ms/step, {len(ratios)} interleaved blocks of {block} steps: overhead "
          f"{pct(ratio)} (95% CI {pct(low)} to {pct(high)}); bare against bare (noise floor) {pct(aa)} "
          f"({pct(aa_low)} to {pct(aa_high)})")
    save_result(f"overhead-{cfg.recipe_name}", result)
    return result


if __name__ == "__main__":
    run(main)
