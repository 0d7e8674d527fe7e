"""Train a recipe:  python train.py recipe=lenet_o2 [key=value ...]   (multirun: -m recipe=lenet_o0,lenet_o2)

Reads top to bottom, like the recipe it runs:
  main       the config Hydra composed, checked; the run directory held while the run trains (ampzoo.engine.process)
  setup      context, seeds, data, TensorBoard, learning rate: what every rung shares
  train      the fallback ladder as a loop over rungs: each `train_rung` ends finished, diverged or stopped
  train_rung model and precision policy, loss scale, optimizer, callbacks, Model.train
  finish     final evaluation and metrics.json
Everything lands in the run directory.
"""
import ampzoo.entry  # noqa: F401  (first: a command's start-up, before MindSpore loads)

import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, List, Optional, Tuple

import hydra
from hydra.core.hydra_config import HydraConfig
from mindspore.train import Model
from omegaconf import OmegaConf
from tensorboardX import SummaryWriter

from ampzoo.amp.fallback import DivergenceWatch, describe, ladder, not_learning, run_failed
from ampzoo.amp.policy import compute_line, compute_path, cpu_cost_note
from ampzoo.amp.precision import precision_report, write_report
from ampzoo.amp.profile import ProfileSteps
from ampzoo.amp.telemetry import AmpTelemetry
from ampzoo.config import register_schema
from ampzoo.data import create_dataset, task
from ampzoo.engine.callbacks import (BusyMachine, EpochLog, Evaluator, GracefulStop, LauncherWatch, NpuStatusClear,
                                     ProgressBar, SafeWriter, StepOffset, StepTimer, StopAtStep, TensorBoardLogger,
                                     planned_epochs)
from ampzoo.engine.checkpoint import (AtomicCheckpoint, check_disk_space, initial_weights, restart_checkpoint,
                                      restore_weights)
from ampzoo.engine.load import load_config, user_keys, validate
from ampzoo.engine.metrics import NetWithEval, metrics
from ampzoo.engine.plan import data_plan, learning_rate
from ampzoo.engine.process.command import job, run_hydra
from ampzoo.engine.process.directory import continue_with, forget_command
from ampzoo.engine.process.failures import step_error
from ampzoo.engine.process.before_init import rank_known
from ampzoo.engine.ranks import rank0_flag, rank0_says, resume_on_ranks, run_shape, together
from ampzoo.engine.records import record_compute, summary, write_metrics, write_run_config
from ampzoo.engine.rundir import find_tokenizer, keep_tokenizer, refuse_fresh_start, resume_config
from ampzoo.engine.start import Start, finished, finished_note, resume_start, start_from, step_of
from ampzoo.engine.state import Rung, Run
from ampzoo.engine.step import build_train_step
from ampzoo.errors import ConfigError, TracedError, fail
from ampzoo.interrupt import Interrupted
from ampzoo.runtime import (any_rank, device_notes, init_distributed, msrun_env, parameter_checksum,
                            seed_everything, set_context, sink_mode)
from ampzoo.models.decoding import translate
from cpu_kernels.accelerate import runs_kernels

log = logging.getLogger("amp_zoo")
logging.raiseExceptions = False  # a log line that cannot be written (disk full) is lost, not a traceback
register_schema()
USERS_OM_PATH = os.environ.get("MS_OM_PATH")  # where the user asked MindSpore to write its graph files, if anywhere


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> Optional[float]:
    """One run (or one job of a sweep) on the config Hydra composed: checked, trained in its run directory, which
    ampzoo.engine.process.command.job holds and closes however the run ends (an error: one line)."""
    with job(cfg) as run_dir:
        cfg, smoke_note = checked(cfg, run_dir.path)
        return train(cfg, run_dir.path, smoke_note)


def checked(cfg, run_dir: Path) -> Tuple[Any, Optional[str]]:
    """The composed config through load_config (as every entry point), and a resume's through the run's own
    config.yaml; (config, smoke note or None). Bad input is a ConfigError."""
    argv = list(HydraConfig.get().overrides.task)
    cfg, smoke_note = load_config(argv, composed=cfg)
    for key in user_keys(argv):  # nothing on the command line is silently ignored
        if key.split(".")[0] in ("output", "infer"):
            raise ConfigError(f"{key} is for eval.py and export.py; train.py writes everything into its run "
                              f"directory (hydra.run.dir)")
    if cfg.resume:  # the run's own config.yaml, with what the command line may change
        cfg, taken = resume_config(cfg, user_keys(argv), run_dir)
        validate(cfg)
        smoke_note = smoke_note if cfg.dataset.path is None else None
        if taken:
            log.info("resume: the run's config.yaml, with %s from the command line",
                     ", ".join(f"{k}={OmegaConf.select(cfg, k)}" for k in taken))
    if cfg.runtime.distributed and not msrun_env():
        raise ConfigError("runtime.distributed=true, but msrun did not start this process: start it with msrun "
                          "(README: Ascend and GPU), or set runtime.distributed=false for one process")
    return cfg, smoke_note


def train(cfg, run_dir: Path, smoke_note: Optional[str] = None) -> Optional[float]:
    """cfg: from ampzoo.engine.load.load_config. Runs the ladder's rungs until one finishes; metrics.json at the end."""
    if not cfg.resume:
        refuse_fresh_start(run_dir)
    start = resume_start(cfg, run_dir / "checkpoints")
    if start.checkpoint is None:
        cfg, start.init = start_from(cfg)
    done = finished(cfg, run_dir, start)
    if done is not None:
        forget_command(run_dir)
        print(finished_note(run_dir, done, cfg.trainer.max_steps), flush=True)
        return done.get("final", {}).get("top1", 0.0)
    run = setup(cfg, run_dir, smoke_note, start)
    rungs, transitions, summaries = ladder(cfg.amp), [], []
    for number, amp_cfg in enumerate(rungs):  # one rung unless amp.fallback.enabled and training diverges
        rung = train_rung(run, number, amp_cfg, start)
        run.trained_s += rung.train_time
        summaries.append({"rung": number, "setting": describe(amp_cfg), **rung.amp_summary})
        if rung.outcome == "finished":
            return finish(run, rung, transitions, summaries)
        if rung.outcome == "stopped":
            raise stopped(run, rung.stop, rung.checkpoints.latest)
        if number + 1 == len(rungs):  # every rank stops here together, after rank 0's checkpoint is written
            together(run.world)
            fail(no_rung_left(cfg, rung.watch, amp_cfg, len(rungs)), code=1)
        checkpoint, params = restart_checkpoint(run_dir / "checkpoints", cfg.model.name, run.steps_per_epoch,
                                                run.is_main, rank0_says(run.is_main, run.world))
        transitions.append({"step": rung.watch.step, "from": describe(amp_cfg), "to": describe(rungs[number + 1]),
                            "reason": rung.watch.reason, "restart_from": checkpoint.name if checkpoint else None})
        log.warning("fallback: %s; continuing at %s from %s", rung.watch.reason, describe(rungs[number + 1]),
                    checkpoint.name if checkpoint else "the initial weights")
        start = Start(checkpoint, params, step_of(params), init=start.init)
    return None


def stopped(run: Run, stop, saved) -> Interrupted:
    """A rung stopped by SIGTERM/SIGINT: under msrun, after every rank agrees (no rank exits before rank 0's
    checkpoint is written), rank 0 says what it saved and how to continue."""
    together(run.world)
    if not run.is_main:
        log.warning("%s: stopped after step %d with the other ranks", stop.signal, stop.step)
        return Interrupted(stop.signum, f"stopped at step {stop.step} with the other ranks (rank 0 saved and says "
                           f"how to continue)", label=stop.signal)
    log.info("%s: stopped after step %d and saved %s", stop.signal, stop.step, saved)
    return Interrupted(stop.signum, f"stopped at step {stop.step} and saved {saved}; "
                       f"{continue_with(run.run_dir, run.cfg.recipe_name)}", label=stop.signal)


def no_rung_left(cfg, watch, amp_cfg, rungs: int) -> str:
    """Why a run that diverged on the ladder's last rung fails: at O0 (fp32), the cause is not precision."""
    if rungs == 1:
        return watch.advice()
    at_o0 = "" if str(amp_cfg.level) != "O0" else (f": it diverges at O0 (fp32) too, so the cause is not precision; "
                                                    f"lower optimizer.lr={cfg.optimizer.lr:g} or check the data")
    return f"{watch.reason}; no rung left on the fallback ladder{at_o0}"


def setup(cfg, run_dir: Path, smoke_note: Optional[str], start: Start) -> Run:
    """Context, distributed ranks, seeds, the run's config.yaml, test data, TensorBoard, learning rate."""
    t_start = time.perf_counter()
    device = set_context(cfg.runtime)
    find_tokenizer(cfg, run_dir, resuming=start.checkpoint is not None)  # msrun: a host job before any collective
    rank, world = init_distributed() if cfg.runtime.distributed else (0, 1)
    rank_known(rank)  # first: the lines below (and those held before init) are rank 0's to write
    log.info("command: python %s", shlex.join(sys.argv))  # also in .hydra/overrides.yaml
    log.info("recipe %s: %s", cfg.recipe_name, cfg.description)
    log.info("run directory: %s", run_dir.resolve())
    os.environ["MS_OM_PATH"] = USERS_OM_PATH or str(run_dir.resolve())  # analyze_fail.ir: this run's, not the cwd
    for note in device_notes(cfg.runtime, device):
        log.info(note)
    if smoke_note:
        log.warning(smoke_note)
    resume_on_ranks(cfg, run_dir, start, rank, world)  # under msrun: rank 0 holds the run directory first
    if task(cfg) == "translation":  # the run keeps the tokenizer its token ids come from
        keep_tokenizer(cfg, run_dir, rank, resuming=start.checkpoint is not None, wait=any_rank if world > 1 else None)
    if rank == 0:
        write_run_config(cfg, run_dir, resuming=start.checkpoint is not None)
    seed_everything(cfg.runtime.seed, rank)
    sink, sink_note = sink_mode(device, cfg.trainer.sink, task(cfg) == "translation", cfg.trainer.max_steps,
                                cfg.runtime.profile, cfg.trainer.save_every_steps, str(cfg.runtime.mode))
    log.info("device %s, %s mode; %s", device, cfg.runtime.mode, sink_note)
    test_ds = create_dataset(cfg.dataset, "test")
    steps_per_epoch, per_step = data_plan(cfg, world, rank)
    writer = None
    if cfg.logger.tensorboard and rank == 0:  # TensorBoard drops a killed process's events from here on (from
        # step 0 when it died before its first checkpoint and the run starts over)
        writer = SafeWriter(SummaryWriter(str(run_dir / "tb"), purge_step=start.step + 1 if start.checkpoint else 0),
                            run_dir / "tb")
    evaluator = Evaluator(test_ds, cfg.trainer.eval_every, writer, cfg.trainer.epochs, steps_per_epoch,
                          run_dir / "eval_history.jsonl" if rank == 0 else None,
                          start.step if start.checkpoint else None)
    run = Run(cfg, run_dir, device, rank, world, sink, steps_per_epoch, per_step, test_ds, writer,
              learning_rate(cfg, steps_per_epoch, per_step, world, start), StepTimer(), evaluator, t_start,
              smoke_note)
    run.resumed(start.params, start.step)
    return run


def passes(start_step: int, steps_per_epoch: int, epochs: int) -> List[Tuple[int, int, int]]:
    """The Model.train calls that take a run from global step `start_step` to the end of `epochs`, as
    (first epoch, batches of it to skip, end epoch). Resuming mid-epoch, the batches that epoch had left
    run as a pass of their own first: MindSpore wants every pass over a dataset to have the same length."""
    first_epoch, skip = divmod(start_step, steps_per_epoch)
    out = [(first_epoch, skip, first_epoch + 1)] if skip else []
    out.append((first_epoch + bool(skip), 0, epochs))
    return [p for p in out if p[0] < epochs]


def build_step(run: Run, amp_cfg, start: Start):
    """The model under the rung's precision policy, in a train step with its loss scale and optimizer, from
    `start`'s weights; returns (train step, Model, precision report)."""
    step = build_train_step(run.cfg, amp_cfg, run.lr, run.device)
    report = precision_report(step.net, step.policy)
    if run.is_main:
        write_report(report, run.run_dir, run.writer)
    log.info("precision: %s", report["summary"])
    if note := cpu_cost_note(run.device, amp_cfg, str(run.cfg.runtime.cpu_compute)):  # what fp16 costs on the CPU
        log.info(note)
    path = compute_path(run.device, amp_cfg, runs_kernels(step.net))
    log.info(compute_line(path))
    asked = str(run.cfg.runtime.cpu_compute)
    if asked in ("bf16", "bf16_backward") and path["kernels"] == "cpu_kernels" and path["products"] == "fp32":
        log.warning("runtime.cpu_compute=%s: this CPU has no AVX512-BF16 (or oneDNN is capped below it), so the "
                    "kernels multiply in fp32", asked)
    if run.is_main:  # each process of the run, from the step it starts at (a resume may run on another CPU)
        record_compute(run.run_dir, start.step, path)
    if str(amp_cfg.level) == "O3" and step.policy.keep_fp32:  # O3 has no default keep-list, but a given one holds
        log.info("O3 with amp.keep_fp32=[%s]: those Cells stay fp32 (amp.keep_fp32=[] runs everything in low "
                 "precision)", ",".join(step.policy.keep_fp32))
    if run.is_main:
        check_disk_space(run.run_dir / "checkpoints", step.cell)
    model = Model(step.cell, eval_network=NetWithEval(step.net, step.loss_fn), metrics=metrics(),
                  eval_indexes=[0, 1, 2], amp_level="O0")  # the policy is applied above, once
    log.info("loss scale: %s (initial %g)%s", step.plan.kind, step.plan.scale,
             ", overflowed steps are skipped" if step.plan.skip_on_overflow else "")
    cfg = run.cfg
    if start.checkpoint is not None:
        restore_weights(step.cell, start.checkpoint, with_amp_state=start.with_amp_state, model_name=cfg.model.name,
                        params=start.params)
        epoch, skip = divmod(start.step, run.steps_per_epoch)
        log.info("%s from %s (step %d, epoch %d%s) at %s", "resumed" if start.with_amp_state else "restarted",
                 start.checkpoint, start.step, epoch, f" + {skip} steps" if skip else "", describe(amp_cfg))
    elif start.init is not None:
        fresh = initial_weights(step.net, start.init[0], cfg.model.name, cfg.model.num_classes)
        log.info("initialised from %s; optimizer and schedule start fresh%s", start.init[1],
                 f"; {', '.join(fresh)} re-initialised for {cfg.model.num_classes} classes (another class count "
                 f"in the file)" if fresh else "")
    return step, model, report


def train_rung(run: Run, number: int, amp_cfg, start: Start) -> Rung:
    """One rung of the ladder from `start` to the end of training, a divergence, or a stop signal."""
    cfg, t = run.cfg, run.cfg.trainer
    step, model, report = build_step(run, amp_cfg, start)
    run.evaluator.model = model
    telemetry = AmpTelemetry(step.cell, run.writer, t.log_every, step.plan.kind)
    watch = DivergenceWatch(telemetry.read, step.plan.kind, step.plan.min_scale, cfg.amp.fallback, t.log_every,
                            saturation=step.cell.saturation_mode)
    t_train = time.perf_counter()

    def clock() -> dict:  # the run's times so far, saved in each checkpoint
        return {"train_time_s": run.trained_s + time.perf_counter() - t_train,
                "wall_time_s": run.wall_before_s + time.perf_counter() - run.t_start}
    checkpoints = AtomicCheckpoint(run.run_dir / "checkpoints", cfg.model.name, t.ckpt_every, t.keep_last,
                                   run.steps_per_epoch, on_save=run.writer.flush if run.writer else None, clock=clock,
                                   every_steps=t.save_every_steps, shape=run_shape(cfg, run.world))
    stop = GracefulStop(checkpoints.save if run.is_main else save_nothing, agree=any_rank if run.world > 1 else None,
                        every=t.log_every)
    offset = StepOffset(start.step)
    status = NpuStatusClear(step.cell.clear_status) if getattr(step.cell, "saturation_mode", False) else None
    callbacks = rung_callbacks(run, number, start, report, [offset, run.timer, watch, telemetry], stop, checkpoints,
                               status, runs_kernels(step.net))
    def last_step() -> int:  # the global step trained to so far (a resume that trained none: where it started)
        return run.timer.steps[-1] if run.timer.steps else start.step

    for first_epoch, skip_batches, end_epoch in passes(start.step, run.steps_per_epoch, t.epochs):
        if watch.reason or stop.signal or (t.max_steps and last_step() >= t.max_steps):  # a resume at max_steps
            break  # (stopped in its final evaluation, say) trains no further step
        train_ds = create_dataset(cfg.dataset, "train", run.shard, start_epoch=first_epoch, seed=cfg.runtime.seed,
                                  skip_batches=skip_batches)
        offset.offset = first_epoch * run.steps_per_epoch + skip_batches
        compiled = bool(run.timer.steps)
        try:
            model.train(end_epoch, train_ds, callbacks=callbacks, dataset_sink_mode=run.sink,
                        sink_size=t.sink_size if run.sink else -1, initial_epoch=first_epoch)
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            raise TracedError(step_error(run, e, ran_before=compiled or bool(run.timer.steps))) from e
    outcome = "stopped" if stop.signal else ("diverged" if watch.reason else "finished")
    return Rung(outcome, amp_cfg, step.net, step.policy, watch, checkpoints, telemetry.summary(),
                time.perf_counter() - t_train, stop, last_step())


def save_nothing(network, step) -> None:
    """A rank other than 0 stops without saving: rank 0 writes the run's checkpoints."""


def rung_callbacks(run: Run, number: int, start: Start, report: dict, first: list, stop, checkpoints,
                   status=None, kernels: bool = False) -> list:
    """The callbacks of one rung, in order: `first` (step offset, timer, watch, telemetry), logs, evaluation, the
    910A's status clear (`status`, after the evaluation it clears), the launcher's watch, the stop and the
    checkpoints, then TensorBoard, progress bar, step budget and profiler."""
    t = run.cfg.trainer
    epochs = planned_epochs(t.epochs, t.max_steps, run.steps_per_epoch)
    watch_msrun = LauncherWatch(os.getppid()) if msrun_env() else None  # before `stop`: it raises the SIGTERM
    callbacks = [*first, EpochLog(run.per_step, run.unit, epochs) if run.is_main else None, run.evaluator,
                 status, watch_msrun, stop, checkpoints if run.is_main else None]
    callbacks = [c for c in callbacks if c is not None]
    if run.writer is not None:
        run.writer.add_scalar("amp/rung", number, start.step)

        def lr_at(s: int) -> float:  # s counts batches
            return float(run.lr[min(s // t.update_freq, len(run.lr) - 1)])
        callbacks.append(TensorBoardLogger(run.writer, lr_at, run.per_step, t.log_every, run.timer))
    if run.cfg.logger.progress_bar and run.is_main and sys.stderr.isatty():  # piped: log lines, no bar in them
        callbacks.append(ProgressBar(run.steps_per_epoch, t.log_every, epochs))
    if kernels:  # a machine shared with another process says so, once
        callbacks.append(BusyMachine(t.log_every))
    if t.max_steps > 0:
        callbacks.append(StopAtStep(t.max_steps))
    if run.cfg.runtime.profile and number == 0:  # every rank: they stop to parse at the same step
        callbacks.append(ProfileSteps(run.run_dir, report, run.device, start=start.step + 2,
                                      rank=run.rank if run.world > 1 else None))
    return callbacks


def finish(run: Run, rung: Rung, transitions: list, summaries: list) -> float:
    """Final evaluation (and BLEU for translation), metrics.json; a run that ends at chance after falling back (or
    with a loss that is not finite) fails, a short one at chance is warned about. Under msrun every rank takes rank
    0's verdict before rank 0 decodes, so none then waits in a collective (HCCL's timeout) while rank 0 decodes."""
    cfg = run.cfg
    steps_done, fell_back, translating = rung.last_step, bool(transitions), task(cfg) == "translation"

    def verdict_of(result: dict) -> Optional[str]:
        return not_learning(rung.amp_cfg, result, cfg.model.num_classes, cfg.optimizer.lr, fell_back=fell_back,
                            translation=translating)
    final = run.evaluator.evaluate()
    failed = run_failed(verdict_of(final), fell_back, final, rank0_flag(run.is_main, run.world))  # the last collective
    if translating and run.is_main:  # rank 0 decodes and writes hypotheses.txt; the weights agree
        final.update(translate(rung.net, cfg, "test", cfg.decode.beam, cfg.decode.length_penalty,
                               run.run_dir / "hypotheses.txt"))
    run.evaluator.record(round(steps_done / run.steps_per_epoch, 2), steps_done, final)
    log.info("rank %d of %d: parameter checksum %s", run.rank, run.world, parameter_checksum(rung.net),
             extra={"every_rank": True})
    if run.is_main:
        write_metrics(run, summary(run, rung, final, steps_done, transitions, summaries))
    verdict = verdict_of(run.evaluator.history[-1])  # with the BLEU it decoded
    if failed:  # metrics.json is written
        fail(f"{verdict or 'rank 0 finds that the run does not learn'} ({run.run_dir / 'metrics.json'})", code=1)
    if verdict and run.is_main:  # at chance: a short run may be meant (a smoke test), so a warning
        log.warning(verdict)
    return final.get("top1", 0.0)


if __name__ == "__main__":
    run_hydra(main)
