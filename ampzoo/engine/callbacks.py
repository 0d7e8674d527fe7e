"""Training callbacks: step timing, console progress, TensorBoard, periodic evaluation, step budget.

Every callback counts real steps from `cb_params.cur_step_num`, which MindSpore advances by the sink size
in sink mode and by one otherwise (on CPU the driver never asks to sink; see ampzoo/runtime.sink_mode). So a
periodic callback acts when the steps since its last call cross a multiple of its period (`crossed`), not
only on an exact multiple, which a sink may never land on.
"""
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
from mindspore.train import Callback
from tqdm import tqdm

from ampzoo.amp.telemetry import crossed
from ampzoo import interrupt
from ampzoo.errors import write_error

log = logging.getLogger("amp_zoo")


def loss_of(net_outputs) -> float:
    out = net_outputs[0] if isinstance(net_outputs, (tuple, list)) else net_outputs
    return float(out.asnumpy().reshape(-1)[0])


class StepTimer(Callback):
    """Wall time per host step (a whole sink in sink mode); the first includes graph compilation. An epoch's
    clock starts at its beginning, so the previous epoch's end (its evaluation, its checkpoint) is not counted
    as training time: under sinking every host step follows one."""

    def __init__(self):
        self.times: List[float] = []
        self.steps: List[int] = []
        self.start = self.last = None

    def on_train_begin(self, run_context):
        self.start = self.last = time.perf_counter()

    def on_train_epoch_begin(self, run_context):
        self.last = time.perf_counter()

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


class SafeWriter:
    """A tensorboardX SummaryWriter that never takes a run down: a failed write (disk full) is one warning, and
    TensorBoard stops for the rest of the run; the checkpoints decide whether the run can go on."""

    def __init__(self, writer, path):
        self.writer, self.path, self.failed = writer, path, False
        previous = threading.excepthook

        def hook(args):  # tensorboardX writes from a thread of its own, which would print a traceback and die
            if type(args.thread).__module__.startswith("tensorboardX") and isinstance(args.exc_value, OSError):
                self._fail(args.exc_value, thread_died=True)
            else:
                previous(args)
        threading.excepthook = hook

    def _fail(self, error, thread_died: bool = False) -> None:
        if self.failed:
            return
        self.failed = True
        for file_writer in (getattr(self.writer, "all_writers", None) or {}).values():
            events = file_writer.event_writer
            if thread_died:  # its exit-time close would wait on the dead thread
                events.close = lambda: None
                continue
            # the thread lives on: what it still writes, and the exit-time flush, go nowhere instead of a traceback
            record = getattr(getattr(events, "_ev_writer", None), "_py_recordio_writer", None)
            if record is None or not hasattr(record, "_writer"):  # another tensorboardX: no exit-time close
                events.close = lambda: None
                continue
            record.write = record.flush = record.close = lambda *args: None
            try:
                record._writer.close()
            except OSError:
                pass
        log.warning("TensorBoard events in %s could not be written (%s); training goes on without them",
                    self.path, getattr(error, "strerror", None) or error)

    def _call(self, name, *args, **kwargs):
        if self.failed:
            return None
        try:
            with interrupt.deferred():  # its queue's lock and wake-up are not safe to cut short (ampzoo.interrupt)
                return getattr(self.writer, name)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001  (OSError from the event file, or from its writer thread)
            self._fail(e)
            return None

    def add_scalar(self, *args, **kwargs):
        return self._call("add_scalar", *args, **kwargs)

    def add_text(self, *args, **kwargs):
        return self._call("add_text", *args, **kwargs)

    def flush(self):
        return self._call("flush")

    def close(self):
        return self._call("close")


def planned_epochs(epochs: int, max_steps: int, steps_per_epoch: int) -> int:
    """The epochs a run will go through: trainer.epochs, or fewer when trainer.max_steps ends it sooner."""
    return min(epochs, -(-max_steps // steps_per_epoch)) if max_steps else epochs


class ProgressBar(Callback):
    """One tqdm bar per epoch with ETA; the loss shown is the last one logged."""

    def __init__(self, steps_per_epoch: int, log_every: int, epochs: int):
        self.steps_per_epoch = steps_per_epoch
        self.log_every, self.epochs = log_every, epochs
        self.bar = None
        self.seen = 0

    def on_train_epoch_begin(self, run_context):
        cb = run_context.original_args()
        self.bar = tqdm(total=self.steps_per_epoch, desc=f"epoch {cb.cur_epoch_num}/{self.epochs}",
                        unit="step", dynamic_ncols=True, leave=True)
        self.seen = cb.cur_step_num

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        self.bar.update(cb.cur_step_num - self.seen)
        previous, self.seen = self.seen, cb.cur_step_num
        if crossed(previous, cb.cur_step_num, self.log_every):
            self.bar.set_postfix(loss=f"{loss_of(cb.net_outputs):.4f}", refresh=False)

    def on_train_epoch_end(self, run_context):
        self.bar.close()


class EpochLog(Callback):
    """One log line per epoch (train.log and console): the step reached, the epoch's last loss, its wall time and
    throughput. A long background run's log shows where it is, and how long each of its sessions trained."""

    def __init__(self, per_step: int, unit: str, epochs: int):
        self.per_step, self.unit, self.epochs = per_step, unit, epochs
        self.first_step = self.started = None  # steps done before the epoch; the time its first step began

    def on_train_epoch_begin(self, run_context):
        # here, not at the first step: MindSpore adds a whole sink to cur_step_num before a sink's step_begin
        self.first_step, self.started = run_context.original_args().cur_step_num, None

    def on_train_step_begin(self, run_context):
        if self.started is None:
            self.started = time.perf_counter()

    def on_train_epoch_end(self, run_context):
        cb = run_context.original_args()
        if self.started is None:
            return
        steps, seconds = cb.cur_step_num - self.first_step, time.perf_counter() - self.started
        log.info("epoch %d/%d: step %d, loss %.4f, %d steps in %.1f s, %s %s/s", cb.cur_epoch_num, self.epochs,
                 cb.cur_step_num, loss_of(cb.net_outputs), steps, seconds,
                 f"{steps * self.per_step / max(seconds, 1e-9):,.0f}", self.unit)


class TensorBoardLogger(Callback):
    """train/loss, train/lr, train/samples_per_s every `log_every` steps (tensorboardX)."""

    def __init__(self, writer, lr_at: Callable[[int], float], batch_size: int, log_every: int, timer: StepTimer):
        self.writer, self.lr_at, self.batch_size, self.log_every, self.timer = (
            writer, lr_at, batch_size, log_every, timer)
        self.mark = None  # (step, time) of the last point
        self.seen = 0  # the step of the last host callback

    def on_train_begin(self, run_context):
        self.seen = run_context.original_args().cur_step_num

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        step, previous = cb.cur_step_num, self.seen
        self.seen = step
        if not crossed(previous, step, self.log_every) and step != 1:
            return
        self.writer.add_scalar("train/loss", loss_of(cb.net_outputs), step)
        self.writer.add_scalar("train/lr", self.lr_at(step - 1), step)
        now = self.timer.last
        if self.mark is not None and step > self.mark[0]:
            rate = (step - self.mark[0]) * self.batch_size / max(now - self.mark[1], 1e-9)
            self.writer.add_scalar("train/samples_per_s", rate, step)
        self.mark = (step, now)


class Evaluator(Callback):
    """Evaluate every `every` completed epochs (not the last: the driver evaluates after training) on the test
    split, with the `model` of the current rung (the driver sets it). An epoch cut short (a stop signal, a step
    budget) is not evaluated as if complete. Every evaluation is appended to `history_file` (JSON lines), so a
    resumed run's metrics.json still holds the evaluations from before it; a resume from step s keeps those up
    to s, as TensorBoard does."""

    def __init__(self, test_ds, every: int, writer, epochs: int, steps_per_epoch: int,
                 history_file: Optional[Path] = None, resumed_at: Optional[int] = None):
        self.test_ds, self.every, self.writer, self.epochs = test_ds, every, writer, epochs
        self.steps_per_epoch, self.history_file = steps_per_epoch, history_file
        self.model = None
        self.history: List[Dict] = []
        if history_file is not None and resumed_at is not None and history_file.exists():
            records = [json.loads(line) for line in history_file.read_text().splitlines() if line.strip()]
            self.history = [r for r in records if r["step"] <= resumed_at]
        if history_file is not None:
            history_file.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        self.t0 = time.perf_counter()  # eval times are seconds since the driver started training

    def evaluate(self) -> Dict[str, float]:
        return {k: float(v) for k, v in self.model.eval(self.test_ds, dataset_sink_mode=False).items()}

    def record(self, epoch: float, step: int, metrics: Dict[str, float]) -> None:
        record = {"epoch": epoch, "step": step, "time_s": round(time.perf_counter() - self.t0, 3), **metrics}
        self.history.append(record)
        if self.history_file is not None:
            try:
                with open(self.history_file, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:
                raise write_error(self.history_file, e) from None
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, float):
                    self.writer.add_scalar(f"eval/{k}", v, step)
        shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if isinstance(v, float))
        log.info("eval epoch %g step %d: %s", epoch, step, shown)

    def on_train_epoch_end(self, run_context):
        cb = run_context.original_args()
        if cb.cur_step_num != cb.cur_epoch_num * self.steps_per_epoch:  # stopped mid-epoch
            return
        if run_context.get_stop_requested():  # a stop signal (or a divergence, a step budget) at the epoch's last
            return  # step, as under sinking, where a sink is the epoch: stop now, not after a whole test set
        if self.every and cb.cur_epoch_num % self.every == 0 and cb.cur_epoch_num < self.epochs:
            self.record(cb.cur_epoch_num, cb.cur_step_num, self.evaluate())


class NpuStatusClear(Callback):
    """On an Ascend in saturation mode (the 910A), the float status is one register that any fp16 work sets, an
    evaluation between epochs too, and the training step reads it after its backward: a saturated evaluation
    would count as the next step's overflow. `clear` (AmpTrainStep.clear_status) reads and clears it at each
    epoch's start and after each evaluation (this callback comes after the Evaluator), and says when it was
    set."""

    def __init__(self, clear: Callable[[], bool]):
        self.clear = clear

    def on_train_epoch_begin(self, run_context):
        if self.clear():
            log.info("the NPU float status was set before epoch %d's first step (saturation mode): cleared, not "
                     "counted as that step's overflow", run_context.original_args().cur_epoch_num)

    def on_train_epoch_end(self, run_context):
        if self.clear():
            log.info("epoch %d's evaluation saturated in fp16 (the NPU float status was set): cleared, so the "
                     "next training step counts only its own overflow", run_context.original_args().cur_epoch_num)


class BusyMachine(Callback):
    """On the CPU kernels: one line, once, when another process takes the cores this run trains on (the kernels'
    pool found other processes on a core or more of them in `busy()` windows of 0.2 s, and worked on the cores
    left), since its steps are then slower than its first line's figures, a quiet machine's. FOUND windows, a
    second, are evidence enough: a command someone ran for a moment is not. Checked every `every` steps."""

    FOUND = 5

    def __init__(self, every: int, busy: Optional[Callable[[], int]] = None, threads: Optional[int] = None):
        from cpu_kernels import POOL_WINDOW_S, pool_busy, pool_threads
        self.busy, self.every, self.window = busy or pool_busy, max(int(every), 1), POOL_WINDOW_S
        self.threads = pool_threads() if threads is None else threads
        self.start: Optional[int] = None
        self.said = False

    def on_train_begin(self, run_context):
        self.start = self.busy()

    def on_train_step_end(self, run_context):
        if self.said or run_context.original_args().cur_step_num % self.every:
            return
        found = self.busy() - (self.start or 0)
        if found >= self.FOUND:
            self.said = True
            log.warning("the machine is busy: another process runs on the %d core(s) this run's CPU kernels use (for "
                        "%.1f s so far, while their pool worked on the cores left), so its steps are slower than its "
                        "first line's figures, a quiet machine's; give the run its cores alone, or set "
                        "runtime.cpu_threads to the cores it may have", self.threads, found * self.window)


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
    """SIGTERM or SIGINT: finish the current step, save a checkpoint, stop; the driver then exits with the signal's
    code (ampzoo.interrupt).

    With several ranks, `agree(flag)` tells whether any rank has a signal (an all-reduce). A signal may reach
    the ranks at different steps, and a rank that stopped alone would leave the others waiting in their next
    gradient all-reduce; so the ranks act on a signal together, at the first multiple of `every` steps after
    it, where every rank asks the others."""

    def __init__(self, save: Callable[[object, int], object], agree: Optional[Callable[[bool], bool]] = None,
                 every: int = 1):
        self.save, self.agree, self.every = save, agree, every
        self.signal, self.step, self.previous, self.seen = None, None, {}, 0
        self.signum = None  # the first signal's number (its exit code is 128 + it)

    def _handler(self, signum, frame):
        # The first signal names the stop. A Ctrl-C that arrives while a compiled step runs never reaches
        # Python as SIGINT: MindSpore's graph executor turns it into a SIGTERM to this process (seen with
        # mindspore 2.10), so a SIGTERM is named as possibly that.
        name = signal.Signals(signum).name
        self.signal = self.signal or (name if name != "SIGTERM" else "SIGTERM (or Ctrl-C)")
        self.signum = self.signum or signum

    def on_train_begin(self, run_context):
        self.seen = run_context.original_args().cur_step_num
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handler)
        if interrupt.received() is not None:  # a signal that MindSpore's compiler swallowed (ampzoo.interrupt): stop
            self._handler(interrupt.received(), None)

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        previous, self.seen = self.seen, cb.cur_step_num
        if self.step is not None:
            return
        if self.agree is not None:  # every rank reaches the same boundaries, so the all-reduces pair up
            if not crossed(previous, cb.cur_step_num, self.every) or not self.agree(self.signal is not None):
                return
            self.signal = self.signal or "a signal to another rank"
            self.signum = self.signum or signal.SIGTERM
        elif not self.signal:
            return
        self.step = cb.cur_step_num
        self.save(cb.train_network, cb.cur_step_num)
        run_context.request_stop()

    def on_train_end(self, run_context):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class LauncherWatch(Callback):
    """Under msrun: a SIGTERM to msrun ends msrun alone (it has no handler for it, and starts each worker in a
    session of its own, so no signal reaches them), and its workers would train on, orphaned. A worker whose
    launcher (`parent`, its pid) has gone sends itself a SIGTERM once, so GracefulStop stops every rank together
    at its next boundary and rank 0 saves a checkpoint. (Ctrl-C makes msrun SIGKILL its workers: nothing runs.)"""

    def __init__(self, parent: int):
        self.parent, self.told = parent, False

    def on_train_step_end(self, run_context):
        if not self.told and os.getppid() != self.parent:
            self.told = True
            log.warning("msrun (process %d) has ended: stopping this rank as for a SIGTERM", self.parent)
            os.kill(os.getpid(), signal.SIGTERM)
