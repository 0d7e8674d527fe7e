"""Divergence watch and the fallback ladder.

Without `amp.fallback.enabled`, a run stops with a clear error instead of training on NaN weights: when
non-finite gradients were applied to the weights (no overflow skipping; a NaN can hide behind a finite loss,
e.g. after a ReLU; on an Ascend in saturation mode, the 910A, the overflow saturates and the weights stay finite
while holding it), or a dynamic scale overflows at its minimum. With it, those events, or an overflow rate
above `amp.fallback.overflow_rate` over the last `amp.fallback.window` steps, make train.py restore the last
good checkpoint (finite, and holding no overflowed update: on the 910A the one saved at the stop is finite but
holds it; ampzoo.engine.checkpoint.last_good_checkpoint) and continue one rung down: O2 with scale 128 -> O1 with
scale 128 -> O1 without loss scaling -> O0 (the order Ascend's AMP guide recommends).
"""
import collections
import math
from typing import List, Optional

from mindspore.train import Callback
from omegaconf import OmegaConf

from ampzoo.amp.telemetry import crossed
from ampzoo.config import LEVELS


LADDER = [
    {"level": "O2", "loss_scale": {"type": "fixed", "scale": 128.0, "drop_overflow_update": True}},
    {"level": "O1", "loss_scale": {"type": "fixed", "scale": 128.0, "drop_overflow_update": True}},
    {"level": "O1", "loss_scale": {"type": "none"}},
    {"level": "O0", "loss_scale": {"type": "none"}},
]
SCALE_RANK = {"none": 0, "fixed": 1, "dynamic": 2}


def rung_key(level, ls) -> tuple:
    kind = str(ls["type"])
    scale = 1.0 if kind == "none" else float(ls.get("scale", 0) if kind == "fixed" else 1e30)
    return LEVELS[str(level)].rank, SCALE_RANK[kind], scale


def describe(amp_cfg) -> str:
    ls = amp_cfg.loss_scale
    kind = str(ls.type)
    scale = {"none": "no loss scaling", "fixed": f"fixed scale {ls.scale:g}", "dynamic": "dynamic scale"}[kind]
    return f"{amp_cfg.level} with {scale}"


def ladder(amp_cfg) -> List:
    """The recipe's own amp config, then (fallback enabled) every ladder rung below it."""
    rungs = [amp_cfg]
    if not amp_cfg.fallback.enabled:
        return rungs
    top = rung_key(amp_cfg.level, amp_cfg.loss_scale)
    for rung in LADDER:
        if rung_key(rung["level"], rung["loss_scale"]) < top:
            cfg = OmegaConf.merge(amp_cfg, {"level": rung["level"], "keep_fp32": None,
                                            "loss_scale": rung["loss_scale"]})
            rungs.append(cfg)
    return rungs


def finite_loss(final: dict) -> bool:
    """Whether an evaluation record's loss is a number (a run's final weights are usable only then)."""
    return math.isfinite(final.get("loss", 0.0))


def not_learning(amp_cfg, final: dict, num_classes: int, lr: float, fell_back: bool = True,
                 translation: Optional[bool] = None) -> Optional[str]:
    """Whether a finished run learned: one that ends no better than chance (or with a loss that is not finite)
    did not. After the ladder stepped down, the line says whether precision can be the cause (at O0, fp32, it is
    not); a run that never fell back may simply be short. None: it learns. A translation (`translation`, or a
    BLEU in `final`) is judged by its loss alone: the same verdict before and after it decodes."""
    loss, finite = final.get("loss", 0.0), finite_loss(final)
    if not finite and (not fell_back or "top1" not in final):
        ladder_too = "" if amp_cfg.get("fallback", {}).get("enabled") else ", or train with amp.fallback.enabled=true"
        return (f"the run ends with a loss that is not finite ({loss}): its weights are not usable; look at the "
                f"learning rate (optimizer.lr={lr:g}) and the data{ladder_too}")
    if translation or "bleu" in final:  # token top-1 counts padding and frequent tokens; the loss against a
        uniform = math.log(max(num_classes, 2))  # uniform guess over the vocabulary (label smoothing keeps it)
        if finite and loss < uniform:
            return None
        scores = f"loss {loss:.4g}, a uniform guess over {num_classes:,} tokens {uniform:.4g}" + (
            f"; BLEU {final['bleu']:.2f}" if "bleu" in final else "")
    elif "top1" in final:
        chance = 1.0 / max(num_classes, 1)
        if final["top1"] > 1.5 * chance and finite:
            return None
        scores = f"top-1 {final['top1']:.2%}, chance {chance:.2%}; loss {loss:.4g}"
    else:  # no measure of learning beyond a finite loss
        return None
    if not fell_back:
        return (f"the run ends no better than chance ({scores}): train it longer, or look at the learning rate "
                f"(optimizer.lr={lr:g}) and the data")
    if str(amp_cfg.level) == "O0":
        return (f"the fallback ladder reached O0 (fp32) and the run still does not learn ({scores}): the cause is "
                f"not precision; look at the learning rate (optimizer.lr={lr:g}) and the data")
    return (f"the fallback ladder ended at {describe(amp_cfg)} and the run does not learn ({scores}): a lower rung "
            f"may not help; train at amp.level=O0 to tell whether precision is the cause (optimizer.lr={lr:g})")


def run_failed(verdict: Optional[str], fell_back: bool, final: dict, agree=None) -> bool:
    """Whether a finished run's `verdict` (not_learning) fails it, exit 1: it does not learn after the ladder
    stepped down, or its loss is not finite; otherwise a verdict is a warning (a short run may be meant). Under
    msrun `agree(flag)` gives every rank rank 0's judgement: each rank judges its own final evaluation, and a
    ResNet's BatchNorm statistics are each rank's own, so ranks at the threshold could disagree, one exiting 1
    beside rank 0's metrics.json that passes."""
    failed = bool(verdict) and (fell_back or not finite_loss(final))
    return agree(failed) if agree is not None else failed


class DivergenceWatch(Callback):
    """Stops training when it diverges; `reason` says why and by which step.

    It reads the train step's in-graph counters every `every` steps rather than the outputs of every step:
    a host read per step would stall MindSpore's asynchronous execution, and the counters miss nothing.
    `read(step)` is AmpTelemetry.read, so the watch and the telemetry share one read per step."""

    def __init__(self, read, kind: str, min_scale: float, fallback_cfg, every: int, saturation: bool = False):
        self.read, self.kind, self.min_scale, self.every = read, kind, min_scale, every
        self.saturation = saturation  # an Ascend in saturation mode: an overflowed update leaves the weights finite
        self.enabled = bool(fallback_cfg.enabled)
        self.rate, self.window = fallback_cfg.overflow_rate, fallback_cfg.window
        self.history = collections.deque()  # (steps, overflow steps) at each check
        self.last = None
        self.reason: Optional[str] = None
        self.step: Optional[int] = None

    def on_train_begin(self, run_context):
        self.last = self.read(run_context.original_args().cur_step_num)
        self.history.append((self.last["step"], self.last["amp_overflow_steps"]))

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        if crossed(self.last["step"], cb.cur_step_num, self.every):  # every sink, when a sink spans `every` steps
            self.check(cb.cur_step_num, run_context)

    def on_train_end(self, run_context):
        """The steps after the last check (the end of training, a stop, a step budget) are checked too."""
        step = run_context.original_args().cur_step_num
        if self.reason is None and step > self.last["step"]:
            self.check(step, run_context)

    def check(self, step: int, run_context) -> None:
        t, last = self.read(step), self.last
        self.last = t
        self.history.append((t["step"], t["amp_overflow_steps"]))
        while len(self.history) > 1 and t["step"] - self.history[1][0] >= self.window:
            self.history.popleft()
        span, overflows = t["step"] - self.history[0][0], t["amp_overflow_steps"] - self.history[0][1]
        reason = None
        if t["amp_nonfinite_updates"] > last["amp_nonfinite_updates"] and self.saturation:
            reason = (f"by step {step}: an update whose gradients overflowed was applied to the weights (no overflow "
                      f"skipping); this Ascend saturates an overflow to the largest float16 instead of inf, so the "
                      f"weights stay finite but hold it")
        elif t["amp_nonfinite_updates"] > last["amp_nonfinite_updates"]:
            reason = (f"by step {step}: non-finite gradients were applied to the weights "
                      f"(no overflow skipping), so the weights are no longer finite")
        elif self.kind == "dynamic" and t["amp_floor_overflows"] > last["amp_floor_overflows"]:
            reason = (f"by step {step}: a step overflowed at the minimum loss scale "
                      f"(amp.loss_scale.min_scale={self.min_scale:g}): the loss is exploding, not underflowing")
        elif self.enabled and span >= self.window and overflows / span > self.rate:
            reason = (f"by step {step}: {overflows} of the last {span} steps overflowed "
                      f"(above amp.fallback.overflow_rate={self.rate:g})")
        if reason:
            self.reason, self.step = reason, step
            run_context.request_stop()

    def advice(self) -> str:
        return (f"{self.reason}; lower optimizer.lr, keep more Cells fp32 (python -m amp.audit), "
                f"or set amp.fallback.enabled=true")
