"""AMP telemetry: loss scale, overflow rate and skipped steps in TensorBoard, metrics.json and the console.

The counters live in the graph (`AmpTrainStep`), so a sink that returns only every N-th step loses
nothing: rates are counter differences between two reads over the steps between them (the host's step count,
exact in sink mode too: MindSpore advances it by the sink size).
"""
import logging
from typing import Dict, List, Optional

from mindspore.train import Callback

log = logging.getLogger("amp_zoo")


def crossed(previous: int, step: int, every: int) -> bool:
    """Whether the steps after `previous` up to `step` cross a multiple of `every`. A host callback sees every
    step without sinking, but only every sink's last step with it (MindSpore advances cur_step_num by the sink
    size), where `step % every == 0` may hold rarely or never."""
    return step // every > previous // every


class AmpTelemetry(Callback):
    def __init__(self, step_cell, writer, log_every: int, kind: str):
        self.step_cell, self.writer, self.log_every, self.kind = step_cell, writer, log_every, kind
        self.last: Optional[Dict] = None
        self.scale = None
        self.scale_changes: List[Dict] = []
        self._read_at: Optional[tuple] = None  # (step, counters): callbacks reading at one step share one read
        self.seen = 0  # the step of the last host callback

    def read(self, step: int) -> Dict:
        """The counters at `step`, read from the device once however many callbacks ask."""
        if self._read_at is None or self._read_at[0] != step:
            self._read_at = (step, {**self.step_cell.telemetry(), "step": step})
        return dict(self._read_at[1])

    def on_train_begin(self, run_context):
        self.last = self.read(run_context.original_args().cur_step_num)
        self.scale, self.seen = self.last["loss_scale"], self.last["step"]

    def on_train_step_end(self, run_context):
        step, previous = run_context.original_args().cur_step_num, self.seen
        self.seen = step
        if crossed(previous, step, self.log_every) or step == 1:
            self.log_point(step)

    def on_train_end(self, run_context):
        self.log_point(run_context.original_args().cur_step_num)

    def log_point(self, step: int) -> Dict:
        """Counters and scale since the last point (read every log_every steps, not every step: a host read
        per step stalls MindSpore's asynchronous execution)."""
        t = self.read(step)
        if t["loss_scale"] != self.scale:
            direction = "down" if t["loss_scale"] < self.scale else "up"
            reason = "after an overflow" if direction == "down" else "after a window of clean steps"
            log.info("by step %d: loss scale %g -> %g (%s %s)", step, self.scale, t["loss_scale"], direction, reason)
            self.scale_changes.append({"step": step, "from": self.scale, "to": t["loss_scale"]})
            self.scale = t["loss_scale"]
        new_bad = t["amp_nonfinite_inputs"] - self.last["amp_nonfinite_inputs"]
        if new_bad:
            log.warning("by step %d: %d batch(es) with NaN/Inf inputs skipped, not trained on (%d so far); "
                        "check the data", step, new_bad, t["amp_nonfinite_inputs"])
        steps = t["step"] - self.last["step"]
        rate = (t["amp_overflow_steps"] - self.last["amp_overflow_steps"]) / steps if steps else 0.0
        t["overflow_rate"] = rate
        if self.writer is not None:
            self.writer.add_scalar("amp/loss_scale", t["loss_scale"], step)
            self.writer.add_scalar("amp/overflow_rate", rate, step)
            self.writer.add_scalar("amp/skipped_steps", t["amp_skipped_steps"], step)
        self.last = t
        return t

    def summary(self) -> Dict:
        t = self.last if self.last is not None else self.read(self.seen)  # read at the last step (on_train_end)
        steps = max(t["step"], 1)
        return {
            "loss_scale_type": self.kind,
            "final_loss_scale": t["loss_scale"],
            "steps": t["step"],
            "overflow_steps": t["amp_overflow_steps"],
            "skipped_steps": t["amp_skipped_steps"],
            "overflow_rate": t["amp_overflow_steps"] / steps,
            "steps_since_overflow": t["amp_steps_since_overflow"],
            "nonfinite_losses": t["amp_nonfinite_losses"],
            "nonfinite_input_batches": t["amp_nonfinite_inputs"],
            # an Ascend in saturation mode (the 910A): inf/NaN saturate, so a batch with inf/NaN and a non-finite
            # loss count as overflowed steps there, and the two counters above stay 0 whatever the data holds
            "saturation_mode": bool(getattr(self.step_cell, "saturation_mode", False)),
            "scale_changes": self.scale_changes,
        }
