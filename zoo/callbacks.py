"""Training callbacks: step timing, console progress, TensorBoard, periodic evaluation, step budget.

Every callback counts real steps from `cb_params.cur_step_num`, which MindSpore advances by the sink size
in sink mode and by one otherwise (on CPU the driver never asks to sink; see zoo/runtime.sink_mode).
"""
import logging
import signal
import time
from typing import Callable, Dict, List

import numpy as np
from mindspore.train import Callback
from tqdm import tqdm

log = logging.getLogger("amp_zoo")


def loss_of(net_outputs) -> float:
    out = net_outputs[0] if isinstance(net_outputs, (tuple, list)) else net_outputs
    return float(out.asnumpy().reshape(-1)[0])


class StepTimer(Callback):
    """Wall time per host step (a whole sink in sink mode); the first includes graph compilation."""

    def __init__(self):
        self.times: List[float] = []
        self.steps: List[int] = []
        self.start = self.last = None

    def on_train_begin(self, run_context):
        self.start = self.last = time.perf_counter()

    def on_train_step_end(self, run_context):
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.steps.append(run_context.original_args().cur_step_num)
        self.last = now

    def summary(self, batch_size: int) -> Dict[str, float]:
        """Steady state from the second host step on: the first one pays for compilation."""
        if len(self.times) < 2:
            return {"compile_and_first_step_s": self.times[0] if self.times else 0.0}
        steps = np.diff(self.steps).astype(float)
        per_step = np.array(self.times[1:]) / steps
        return {
            "compile_and_first_step_s": round(self.times[0], 3),
            "step_time_median_ms": round(float(np.median(per_step)) * 1e3, 3),
            "step_time_iqr_ms": round(float(np.subtract(*np.percentile(per_step, [75, 25]))) * 1e3, 3),
            "samples_per_s": round(float(steps.sum() * batch_size / np.sum(self.times[1:])), 1),
        }


class ProgressBar(Callback):
    """One tqdm bar per epoch with ETA; the loss shown is the last one logged."""

    def __init__(self, steps_per_epoch: int, log_every: int):
        self.steps_per_epoch = steps_per_epoch
        self.log_every = log_every
        self.bar = None
        self.seen = 0

    def on_train_epoch_begin(self, run_context):
        cb = run_context.original_args()
        self.bar = tqdm(total=self.steps_per_epoch, desc=f"epoch {cb.cur_epoch_num}/{cb.epoch_num}",
                        unit="step", dynamic_ncols=True, leave=True)
        self.seen = cb.cur_step_num

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        self.bar.update(cb.cur_step_num - self.seen)
        self.seen = cb.cur_step_num
        if cb.cur_step_num % self.log_every == 0:
            self.bar.set_postfix(loss=f"{loss_of(cb.net_outputs):.4f}", refresh=False)

    def on_train_epoch_end(self, run_context):
        self.bar.close()


class EpochLog(Callback):
    """One log line per epoch (train.log and console): the step reached, the epoch's last loss, its wall time and
    throughput. A long background run's log shows where it is, and how long each of its sessions trained."""

    def __init__(self, per_step: int, unit: str):
        self.per_step, self.unit = per_step, unit
        self.start = None  # (step, time) at the epoch's first step

    def on_train_epoch_begin(self, run_context):
        self.start = None

    def on_train_step_begin(self, run_context):
        if self.start is None:
            self.start = (run_context.original_args().cur_step_num - 1, time.perf_counter())  # counted already

    def on_train_epoch_end(self, run_context):
        cb = run_context.original_args()
        if self.start is None:
            return
        steps, seconds = cb.cur_step_num - self.start[0], time.perf_counter() - self.start[1]
        log.info("epoch %d/%d: step %d, loss %.4f, %d steps in %.1f s, %s %s/s", cb.cur_epoch_num, cb.epoch_num,
                 cb.cur_step_num, loss_of(cb.net_outputs), steps, seconds,
                 f"{steps * self.per_step / max(seconds, 1e-9):,.0f}", self.unit)


class TensorBoardLogger(Callback):
    """train/loss, train/lr, train/samples_per_s every `log_every` steps (tensorboardX)."""

    def __init__(self, writer, lr_at: Callable[[int], float], batch_size: int, log_every: int, timer: StepTimer):
        self.writer, self.lr_at, self.batch_size, self.log_every, self.timer = (
            writer, lr_at, batch_size, log_every, timer)
        self.mark = None  # (step, time) of the last point

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        step = cb.cur_step_num
        if step % self.log_every and step != 1:
            return
        self.writer.add_scalar("train/loss", loss_of(cb.net_outputs), step)
        self.writer.add_scalar("train/lr", self.lr_at(step - 1), step)
        now = self.timer.last
        if self.mark is not None and step > self.mark[0]:
            rate = (step - self.mark[0]) * self.batch_size / max(now - self.mark[1], 1e-9)
            self.writer.add_scalar("train/samples_per_s", rate, step)
        self.mark = (step, now)


class Evaluator(Callback):
    """Evaluate every `every` epochs (not the last: the driver evaluates after training) on the test split,
    with the `model` of the current rung (the driver sets it)."""

    def __init__(self, test_ds, every: int, writer, epochs: int):
        self.test_ds, self.every, self.writer, self.epochs = test_ds, every, writer, epochs
        self.model = None
        self.history: List[Dict] = []
        self.t0 = time.perf_counter()  # eval times are seconds since the driver started training

    def evaluate(self) -> Dict[str, float]:
        return {k: float(v) for k, v in self.model.eval(self.test_ds, dataset_sink_mode=False).items()}

    def record(self, epoch: float, step: int, metrics: Dict[str, float]) -> None:
        self.history.append({"epoch": epoch, "step": step, "time_s": round(time.perf_counter() - self.t0, 3),
                             **metrics})
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, float):
                    self.writer.add_scalar(f"eval/{k}", v, step)
        shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if isinstance(v, float))
        log.info("eval epoch %g step %d: %s", epoch, step, shown)

    def on_train_epoch_end(self, run_context):
        cb = run_context.original_args()
        if self.every and cb.cur_epoch_num % self.every == 0 and cb.cur_epoch_num < self.epochs:
            self.record(cb.cur_epoch_num, cb.cur_step_num, self.evaluate())


class StopAtStep(Callback):
    def __init__(self, max_steps: int):
        self.max_steps = max_steps

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num >= self.max_steps:
            run_context.request_stop()


class StepOffset(Callback):
    """Put first: after a restart at epoch k, MindSpore counts steps from 0 again; continue the global count."""

    def __init__(self, offset: int):
        self.offset = offset

    def on_train_begin(self, run_context):
        run_context.original_args().cur_step_num = self.offset


class GracefulStop(Callback):
    """SIGTERM or SIGINT: finish the current step, save a checkpoint, stop; the driver then exits 0."""

    def __init__(self, save: Callable[[object, int], object]):
        self.save, self.signal, self.step, self.previous = save, None, None, {}

    def _handler(self, signum, frame):
        self.signal = signal.Signals(signum).name

    def on_train_begin(self, run_context):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handler)

    def on_train_step_end(self, run_context):
        if self.signal and self.step is None:
            cb = run_context.original_args()
            self.step = cb.cur_step_num
            self.save(cb.train_network, cb.cur_step_num)
            run_context.request_stop()

    def on_train_end(self, run_context):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
