"""Train a recipe:  python train.py recipe=lenet_o2 [key=value ...]   (multirun: -m recipe=lenet_o0,lenet_o2)

Reads top to bottom, like the recipe it runs:
  main       the config, through the same load_config as every other entry point (bad input: one line)
  setup      context, seeds, data, TensorBoard, learning rate: what every rung shares
  train      the fallback ladder as a loop over rungs: each `train_rung` ends finished, diverged or stopped
  train_rung model and precision policy, loss scale, optimizer, callbacks, Model.train
  finish     final evaluation and metrics.json
Everything lands in the run directory.
"""
import zoo.entry  # noqa: F401  (first: a command's start-up, before MindSpore loads)

import json
import logging
import os
import shlex
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Tuple

import hydra
from hydra.core.hydra_config import HydraConfig
from mindspore.train import Model
from omegaconf import OmegaConf, open_dict
from tensorboardX import SummaryWriter

from amp.fallback import DivergenceWatch, describe, ladder, not_learning, run_failed
from amp.precision import precision_report, write_report
from amp.profile import ProfileSteps
from amp.telemetry import AmpTelemetry
from data import create_dataset, task
from engine.callbacks import (EpochLog, Evaluator, GracefulStop, LauncherWatch, ProgressBar, SafeWriter,
                              StepOffset, StepTimer, StopAtStep, TensorBoardLogger, planned_epochs)
from engine.checkpoint import (agree_on_resume, AtomicCheckpoint, check_disk_space, check_same_shape, checkpoints,
                               initial_weights, read_checkpoint, restart_checkpoint, restore_weights, resume_point,
                               RUN_TIMES, step_of)
from engine.load import load_config, user_keys, validate
from engine.metrics import NetWithEval, metrics
from engine.optim import lr_schedule, scaled_lr, schedule_moved
from engine.rundir import (claim, claim_by_rank0, keep_tokenizer, kept_tokenizer, refuse_fresh_start, release,
                           resume_config, run_of_checkpoint, same_tokenizer)
from engine.step import build_train_step
from engine.weights import find as find_weights, shipped_tokenizer
from models.decoding import translate
from zoo import interrupt
from zoo.compose import compose
from zoo.config import register_schema
from zoo.errors import ConfigError, DeviceError, TracedError, WriteError, device_failure, fail, write_error
from zoo.interrupt import Interrupted, exit_line, received
from zoo.machine import machine
from zoo.runtime import (any_rank, device_notes, init_distributed, mindspore_log, msrun_env, onednn_note,
                         parameter_checksum, rank0_value, seed_everything, set_context, sink_mode, source_commit)

log = logging.getLogger("amp_zoo")
logging.raiseExceptions = False  # a log line that cannot be written (disk full) is lost, not a traceback
register_schema()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> Optional[float]:
    argv = list(HydraConfig.get().overrides.task)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        cfg, smoke_note = load_config(argv, composed=cfg)
        for key in user_keys(argv):  # nothing on the command line is silently ignored
            if key.split(".")[0] in ("output", "infer"):
                raise ConfigError(f"{key} is for eval.py and export.py; train.py writes everything into its run "
                                  f"directory (hydra.run.dir)")
        if first_process():
            claim(run_dir)  # already held when the command line named it (claim_run_dir)
        if cfg.resume:  # the run's own config.yaml, with what the command line may change
            cfg, taken = resume_config(cfg, user_keys(argv), run_dir)
            validate(cfg)
            smoke_note = smoke_note if cfg.dataset.path is None else None
            if taken:
                log.info("resume: the run's config.yaml, with %s from the command line",
                         ", ".join(f"{k}={OmegaConf.select(cfg, k)}" for k in taken))
        return train(cfg, run_dir, smoke_note)
    except Interrupted as e:
        interrupted(run_dir, e)
    except ConfigError as e:
        if received():  # what the signal cut short (MindSpore wraps it), not bad input
            interrupted(run_dir, Interrupted(received()))
        abandon(run_dir, e)
        fail(str(e))
    except DeviceError as e:  # not bad input: the device or its software
        fail(str(e), code=1)
    except OSError as e:  # WriteError (a checkpoint, metrics.json, the eval history) or any other file of the run
        where = e if isinstance(e, WriteError) else f"could not write {e.filename or run_dir}: {e.strerror or e}"
        fail(f"{where}; every complete checkpoint is intact: free space (or fix the permission), then "
             f"{continue_with(run_dir, cfg.recipe_name)}", code=1)


def first_process() -> bool:
    """A single process, not one of msrun's workers: it holds its run directory from the start. msrun's ranks are
    known only after init() (msrun may leave RANK_ID unset), so rank 0 claims the directory then (setup)."""
    return "MS_WORKER_NUM" not in os.environ and "MS_ROLE" not in os.environ


CREATED: List[Path] = []  # run directories this process created
USERS_OM_PATH = os.environ.get("MS_OM_PATH")  # where the user asked MindSpore to write its graph files, if anywhere
STARTED = time.time()  # files MindSpore wrote since are this process's


def claim_run_dir(argv: List[str]) -> None:
    """Before Hydra writes anything: hold a named hydra.run.dir for this process, and refuse a fresh start in a
    directory that holds a run. One error line, exit 2, the directory unchanged."""
    given = next((a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")), None)
    if given is None or "-m" in argv or "--multirun" in argv:
        return
    path = Path(given).expanduser()
    existed = path.exists()
    try:
        if first_process():
            claim(path)
        if not any(a.startswith("resume=") for a in argv):
            refuse_fresh_start(path)
    except ConfigError as e:
        if not existed:  # made here: gone again, with the lock file in it
            release(path)
            shutil.rmtree(path, ignore_errors=True)
        fail(str(e))
    if not existed:
        CREATED.append(path.resolve())


def continue_with(run_dir: Path, recipe: Optional[str] = None) -> str:
    return f"continue with: python train.py {f'recipe={recipe} ' if recipe else ''}hydra.run.dir={run_dir} resume=auto"


def interrupted(run_dir: Path, error: Interrupted) -> None:
    """A stop signal outside training's own graceful stop (start-up, compiling, the final evaluation): the line
    says what the run directory holds and how to go on; a directory this process made that holds nothing is
    removed. Exits with the signal's code."""
    found = checkpoints(run_dir / "checkpoints")
    if error.note is None and found:
        error.note = f"the newest checkpoint is {found[-1]}; {continue_with(run_dir)}"
    if error.note is None and abandon(run_dir, None):
        error.note = "nothing was saved (no step had finished); run the command again"
    elif error.note is None:
        error.note = f"no checkpoint was saved in {run_dir}; run the command again with resume=auto"
    if run_dir.is_dir():
        log_line(f"interrupted by {error.name}: {error.note}")
    exit_line(error)


def abandon(run_dir: Path, error: Optional[ConfigError]) -> bool:
    """Bad input (or, error None, an interrupt) found once the run directory exists: a directory this process
    created and nothing else wrote into is removed, with a runs/<recipe>/ left empty, unless the error's trace is
    in its train.log (TracedError: a model that does not compile); any other keeps the error in its train.log.
    Returns whether the directory was removed."""
    named = any(a.startswith("hydra.run.dir=") for a in sys.argv[1:])
    ours = run_dir.resolve() in CREATED or not named  # a dir Hydra made for this run (runs/<recipe>/<time>)
    untouched = not checkpoints(run_dir / "checkpoints") and not (run_dir / "metrics.json").exists()
    if ours and first_process() and not isinstance(error, TracedError) and untouched:
        logging.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
        remove_empty_parents(run_dir)
        return True
    if error is not None:
        log_line(f"error: {error}")
    return False


def remove_empty_parents(run_dir: Path) -> None:
    """runs/<recipe>/ that Hydra made for the removed run, when nothing else is in it (up to runs/)."""
    for parent in Path(run_dir).resolve().parents:
        if parent == Path.cwd().resolve() or parent.name == "runs" or not parent.is_dir() or any(parent.iterdir()):
            break
        parent.rmdir()


def log_line(text: str) -> None:
    """A line for train.log only (the console already has it)."""
    for handler in logging.root.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(logging.LogRecord("amp_zoo", logging.WARNING, __file__, 0, "%s", (text,), None))


@dataclass
class Run:
    """What setup() prepares once and every rung of the ladder shares."""
    cfg: Any
    run_dir: Path
    device: str
    rank: int
    world: int
    sink: bool
    steps_per_epoch: int
    per_step: int          # samples (or padded tokens, token batching) a step trains on, all processes
    test_ds: Any
    writer: Any
    lr: Any
    timer: Any
    evaluator: Any
    t_start: float
    smoke_note: Optional[str]
    trained_s: float = 0.0     # training seconds before the current rung (earlier processes of a resumed run too)
    wall_before_s: float = 0.0  # wall seconds of a resumed run's earlier processes
    timed_from_step: int = 0   # > 0: resumed from a checkpoint that kept no times (written before they were kept)

    @property
    def unit(self) -> str:
        return "padded tokens" if self.cfg.dataset.max_tokens > 0 else "samples"

    @property
    def shard(self) -> Optional[Tuple[int, int]]:
        return (self.world, self.rank) if self.world > 1 else None

    @property
    def is_main(self) -> bool:  # rank 0 alone writes logs, TensorBoard, checkpoints and metrics
        return self.rank == 0


@dataclass
class Start:
    """Where a rung starts: a checkpoint (already read) and its global step, or the initial weights."""
    checkpoint: Optional[Path] = None
    params: Optional[dict] = None
    step: int = 0
    with_amp_state: bool = False  # a resume restores the loss-scale state; a lower rung starts its own
    init: Optional[Tuple[Path, str]] = None  # no checkpoint: the weights (and what to call them) a new run starts from


@dataclass
class Rung:
    """How one rung of the ladder ended: "finished", "diverged" or "stopped" (SIGTERM/SIGINT)."""
    outcome: str
    net: Any
    policy: Any
    watch: Any
    checkpoints: Any
    amp_summary: dict
    train_time: float
    stop: Any                # the GracefulStop callback: which signal, at which step


def train(cfg, run_dir: Path, smoke_note: Optional[str] = None) -> Optional[float]:
    """cfg: from engine.load.load_config."""
    if not cfg.resume:
        refuse_fresh_start(run_dir)
    start = resume_start(cfg, run_dir / "checkpoints")
    if start.checkpoint is None:
        cfg, start.init = start_from(cfg)
    done = finished(cfg, run_dir, start)
    if done is not None:
        forget_this_command(run_dir)
        print(finished_note(run_dir, done, cfg.trainer.max_steps), flush=True)
        return done.get("final", {}).get("top1", 0.0)
    run = setup(cfg, run_dir, smoke_note, start)
    if start.params is not None:  # a resume: its earlier processes' time counts
        if "train_time_s" in start.params:
            run.trained_s, run.wall_before_s = (float(start.params[k].asnumpy()) for k in RUN_TIMES)
        else:
            run.timed_from_step = start.step
    rungs, transitions, summaries = ladder(cfg.amp), [], []
    for number, amp_cfg in enumerate(rungs):  # one rung unless amp.fallback.enabled and training diverges
        rung = train_rung(run, number, amp_cfg, start)
        run.trained_s += rung.train_time
        summaries.append({"rung": number, "setting": describe(amp_cfg), **rung.amp_summary})
        if rung.outcome == "finished":
            top1 = finish(run, rung, transitions, summaries)
            last = run.evaluator.history[-1]
            verdict = not_learning(amp_cfg, last, cfg.model.num_classes, cfg.optimizer.lr,
                                   fell_back=bool(transitions))
            agree = (lambda flag: rank0_value(int(flag), run.is_main) == 1) if run.world > 1 else None
            if run_failed(verdict, bool(transitions), last, agree):  # metrics.json is written; the exit code says
                fail(f"{verdict or 'rank 0 finds that the run does not learn'} ({run_dir / 'metrics.json'})", code=1)
            if verdict and run.is_main:  # at chance: a short run may be meant (a smoke test), so a warning
                log.warning(verdict)
            return top1
        if rung.outcome == "stopped":
            stop = rung.stop
            if run.world > 1:  # no rank exits (msrun would kill the rest) before rank 0's checkpoint is written
                any_rank(False)
            if not run.is_main:  # under msrun: rank 0 saves and tells the user how to resume
                log.warning("%s: stopped after step %d with the other ranks", stop.signal, stop.step)
                raise Interrupted(stop.signum, f"stopped at step {stop.step} with the other ranks (rank 0 saved and "
                                  f"says how to continue)", label=stop.signal)
            log.info("%s: stopped after step %d and saved %s", stop.signal, stop.step, rung.checkpoints.latest)
            raise Interrupted(stop.signum, f"stopped at step {stop.step} and saved {rung.checkpoints.latest}; "
                              f"{continue_with(run_dir, cfg.recipe_name)}", label=stop.signal)
        if number + 1 == len(rungs):  # diverged on the last rung
            fail(rung.watch.advice() if len(rungs) == 1 else f"{rung.watch.reason}; no rung left on the fallback "
                 f"ladder" + ("" if str(amp_cfg.level) != "O0" else f": it diverges at O0 (fp32) too, so the cause is "
                              f"not precision; lower optimizer.lr={cfg.optimizer.lr:g} or check the data"), code=1)
        checkpoint, params = restart_checkpoint(run_dir / "checkpoints", cfg.model.name, run.steps_per_epoch,
                                                run.is_main, agree_with_rank0(run))
        transitions.append({"step": rung.watch.step, "from": describe(amp_cfg), "to": describe(rungs[number + 1]),
                            "reason": rung.watch.reason, "restart_from": checkpoint.name if checkpoint else None})
        log.warning("fallback: %s; continuing at %s from %s", rung.watch.reason, describe(rungs[number + 1]),
                    checkpoint.name if checkpoint else "the initial weights")
        start = Start(checkpoint, params, step_of(params), init=start.init)
    return None


def start_from(cfg) -> Tuple[Any, Optional[Tuple[Path, str]]]:
    """weights=NAME (a shipped weight, sha256 checked) or checkpoint=FILE: the weights a new run starts from, not
    a resume (its optimizer and schedule start fresh). A translation weight, or the checkpoint of a translation run
    that kept its tokenizer, brings that tokenizer (its token ids); another dataset.params.spm_model is the
    user's choice, with a warning."""
    if cfg.weights and cfg.checkpoint:
        raise ConfigError(f"weights={cfg.weights} and checkpoint={cfg.checkpoint}: give one to start from")
    if cfg.checkpoint:
        path = Path(cfg.checkpoint).expanduser()
        if not path.is_file():
            raise ConfigError(f"checkpoint={cfg.checkpoint} is not a file; give a .ckpt file to start from, or "
                              f"weights=NAME for a shipped weight")
        run = run_of_checkpoint(path)  # a train.py run's checkpoint: the tokenizer that run kept
        tokenizer, init = kept_tokenizer(run) if run else None, (path, f"checkpoint {cfg.checkpoint}")
    elif cfg.weights:
        name, entry, path = find_weights(cfg.weights)
        tokenizer, init = shipped_tokenizer(entry, path), (path, f"weights {name} (sha256 verified)")
    else:
        return cfg, None
    given = cfg.dataset.params.get("spm_model") if task(cfg) == "translation" else None
    if tokenizer and given and Path(given).expanduser().is_file() and not same_tokenizer(given, tokenizer):
        log.warning("dataset.params.spm_model=%s is not the tokenizer of the %s (%s): their embeddings index that "
                    "one's pieces, so each of yours starts from another piece's vector", given, init[1], tokenizer)
    if tokenizer and task(cfg) == "translation" and not given:
        with open_dict(cfg):
            cfg.dataset.params.spm_model = str(tokenizer)
    return cfg, init


def forget_this_command(run_dir: Path) -> None:
    """A resume with nothing to do leaves the run as it was: the .hydra/resume-N Hydra wrote for it goes."""
    subdir = HydraConfig.get().output_subdir if HydraConfig.initialized() else None
    if subdir and str(subdir).startswith(".hydra/resume-"):
        shutil.rmtree(run_dir / subdir, ignore_errors=True)


def setup(cfg, run_dir: Path, smoke_note: Optional[str], start: Start) -> Run:
    """Context, distributed ranks, seeds, the run's config.yaml, test data, TensorBoard, learning rate."""
    t_start = time.perf_counter()
    device = set_context(cfg.runtime)
    rank, world = init_distributed() if cfg.runtime.distributed else (0, 1)
    if rank != 0:  # first: the lines below are rank 0's to write
        rank_logging()
    log.info("command: python %s", shlex.join(sys.argv))  # also in .hydra/overrides.yaml
    log.info("recipe %s: %s", cfg.recipe_name, cfg.description)
    log.info("run directory: %s", run_dir.resolve())
    os.environ["MS_OM_PATH"] = USERS_OM_PATH or str(run_dir.resolve())  # analyze_fail.ir: this run's, not the cwd
    for note in device_notes(cfg.runtime, device):
        log.info(note)
    if smoke_note:
        log.warning(smoke_note)
    if cfg.runtime.distributed:
        claim_by_rank0(run_dir, rank, any_rank)
    resume_on_ranks(cfg, run_dir, start, rank, world)
    if task(cfg) == "translation":  # the run keeps the tokenizer its token ids come from
        keep_tokenizer(cfg, run_dir, rank, resuming=start.checkpoint is not None, wait=any_rank if world > 1 else None)
    if rank == 0:
        write_run_config(cfg, run_dir, resuming=start.checkpoint is not None)
    seed_everything(cfg.runtime.seed)
    sink, sink_note = sink_mode(device, cfg.trainer.sink, task(cfg) == "translation", cfg.trainer.max_steps,
                                cfg.runtime.profile, cfg.trainer.save_every_steps, str(cfg.runtime.mode))
    log.info("device %s, %s mode; %s", device, cfg.runtime.mode, sink_note)

    shard = (world, rank) if world > 1 else None
    test_ds = create_dataset(cfg.dataset, "test")
    steps_per_epoch = create_dataset(cfg.dataset, "train", shard).get_dataset_size()
    by_tokens = cfg.dataset.max_tokens > 0  # token batching: throughput counts a step's (padded) token budget
    per_step = (cfg.dataset.max_tokens if by_tokens else cfg.dataset.batch_size) * world
    t = cfg.trainer
    capped = t.max_steps and t.max_steps < t.epochs * steps_per_epoch  # the run ends before its epochs do
    log.info("data: %s, %d steps of %s per epoch%s", cfg.dataset.path or "embedded", steps_per_epoch,
             f"up to {cfg.dataset.max_tokens} tokens" if by_tokens else cfg.dataset.batch_size,
             f"; the run ends at step {t.max_steps} (trainer.max_steps), in epoch "
             f"{planned_epochs(t.epochs, t.max_steps, steps_per_epoch)} of {t.epochs}" if capped else "")
    writer = None
    if cfg.logger.tensorboard and rank == 0:  # TensorBoard drops a killed process's events from here on (from
        # step 0 when it died before its first checkpoint and the run starts over)
        writer = SafeWriter(SummaryWriter(str(run_dir / "tb"), purge_step=start.step + 1 if start.checkpoint else 0),
                            run_dir / "tb")
    k = cfg.trainer.update_freq  # batches an update: the learning rate is a schedule over updates
    if k > 1:
        log.info("gradient accumulation: %d batches an update (%s per update)", k,
                 f"up to {k * per_step} tokens" if by_tokens else f"{k * per_step} samples")
    lr = lr_schedule(cfg.schedule, scaled_lr(cfg.optimizer, cfg.dataset.batch_size * world * k),
                     -(-steps_per_epoch // k), cfg.trainer.epochs)
    if start.params and "learning_rate" in start.params and "global_step" in start.params:  # from a checkpoint
        moved = schedule_moved(start.params["learning_rate"].asnumpy().reshape(-1), lr,
                               int(start.params["global_step"].asnumpy().reshape(-1)[0]), cfg.schedule,
                               cfg.trainer.epochs)
        if moved:
            log.warning(moved)
    evaluator = Evaluator(test_ds, cfg.trainer.eval_every, writer, cfg.trainer.epochs, steps_per_epoch,
                          run_dir / "eval_history.jsonl" if rank == 0 else None,
                          start.step if start.checkpoint else None)
    return Run(cfg, run_dir, device, rank, world, sink, steps_per_epoch, per_step, test_ds, writer, lr, StepTimer(),
               evaluator, t_start, smoke_note)


def write_run_config(cfg, run_dir: Path, resuming: bool) -> None:
    """The run's config.yaml; a resume keeps the first and writes its own beside it (config.resume-N.yaml)."""
    config_file = run_dir / "config.yaml"
    if resuming and config_file.exists():
        config_file = run_dir / f"config.resume-{len(list(run_dir.glob('config*.yaml')))}.yaml"
    try:
        config_file.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    except OSError as e:
        raise write_error(config_file, e) from None


def rank_logging() -> None:
    """A rank other than 0 (under msrun): no train.log (rank 0 writes it), and on its console, which msrun keeps
    as its worker log and tails to the user's terminal, only warnings, errors and the lines every rank must say
    (`extra={"every_rank": True}`, such as its parameter checksum): not every line once per rank."""
    for handler in list(logging.root.handlers):
        if isinstance(handler, logging.FileHandler):
            logging.root.removeHandler(handler)
        else:
            handler.addFilter(lambda r: r.levelno >= logging.WARNING or getattr(r, "every_rank", False))


def resume_start(cfg, ckpt_dir: Path) -> Start:
    """resume=auto: the newest checkpoint that reads (none yet: the initial weights); resume=PATH: that one;
    unset: the initial weights."""
    if not cfg.resume:
        return Start()
    if cfg.resume == "auto":
        path, params = resume_point(ckpt_dir)
        if path is None:  # start or continue: nothing to continue yet
            if (ckpt_dir.parent / "metrics.json").exists():
                raise ConfigError(f"resume=auto: {ckpt_dir.parent} holds a finished run and no checkpoint to continue "
                                  f"it from; give another hydra.run.dir to start anew")
            log.info("resume=auto: no checkpoint in %s yet; starting the run from step 0", ckpt_dir)
            return Start()
    else:
        path = Path(cfg.resume).expanduser()
        params = read_checkpoint(path)
    return Start(path, params, step_of(params), with_amp_state=True)


def finished(cfg, run_dir: Path, start: Start) -> Optional[dict]:
    """The run's metrics.json when resuming would train nothing: it finished at the checkpoint resumed from,
    and neither trainer.epochs nor trainer.max_steps asks for more."""
    metrics = run_dir / "metrics.json"
    if start.checkpoint is None or not metrics.exists():
        return None
    try:
        done = json.loads(metrics.read_text())
    except (ValueError, OSError) as e:
        raise ConfigError(f"{metrics} cannot be read ({e}); train.py writes it when a run ends: move it aside "
                          f"to continue the run from its checkpoints") from None
    t = cfg.trainer
    if "steps_per_epoch" in done:
        target = t.epochs * done["steps_per_epoch"]
        more = (min(target, t.max_steps) if t.max_steps else target) > done["steps"]
    else:  # a metrics.json from before steps_per_epoch was recorded
        more = t.epochs > done["epochs"] or (t.max_steps and t.max_steps > done["steps"])
    return None if more or start.step != done["steps"] else done


def finished_note(run_dir: Path, done: dict, max_steps: int) -> str:
    """What a resume of a finished run says, naming the key that ended it: a run cut by trainer.max_steps
    goes further only with a larger one, whatever trainer.epochs says."""
    if max_steps and done["steps"] >= max_steps and done["steps"] < done["epochs"] * done.get("steps_per_epoch", 0):
        return (f"{run_dir} is finished at step {done['steps']:,} of {done['epochs'] * done['steps_per_epoch']:,} "
                f"(trainer.max_steps={max_steps:,}, trainer.epochs={done['epochs']}): nothing to do; to train it "
                f"further, resume with a larger trainer.max_steps (0: to the end of trainer.epochs)")
    return (f"{run_dir} is finished ({done['steps']:,} steps, {done['epochs']} epochs): nothing to do; to train "
            f"it further, resume with a larger trainer.epochs")


def resume_on_ranks(cfg, run_dir: Path, start: Start, rank: int, world: int) -> None:
    """Before the run writes anything: under msrun every rank resumes from rank 0's checkpoint, and a checkpoint
    trained by another number of workers is refused (on every rank alike)."""
    if world > 1 and cfg.resume:
        start.checkpoint, start.params = agree_on_resume(start.checkpoint, start.params, run_dir / "checkpoints",
                                                         cfg.model.name, rank == 0, lambda v: rank0_value(v, rank == 0))
        start.step = step_of(start.params)
    if start.params is not None:
        check_same_shape(start.params, start.checkpoint, **run_shape(cfg, world))


def run_shape(cfg, world: int) -> dict:
    """engine.checkpoint.RUN_SHAPE: the workers, and what one update takes over all of them."""
    per_batch = cfg.dataset.max_tokens if cfg.dataset.max_tokens > 0 else cfg.dataset.batch_size
    return {"world_size": world, "global_batch": per_batch * world * cfg.trainer.update_freq}


def agree_with_rank0(run: Run):
    """Under msrun, rank 0's value on every rank (zoo.runtime.rank0_value); None for a single process."""
    return (lambda value: rank0_value(value, run.is_main)) if run.world > 1 else None


def passes(start_step: int, steps_per_epoch: int, epochs: int) -> List[Tuple[int, int, int]]:
    """The Model.train calls that take a run from global step `start_step` to the end of `epochs`, as
    (first epoch, batches of it to skip, end epoch). Resuming mid-epoch, the batches that epoch had left
    run as a pass of their own first: MindSpore wants every pass over a dataset to have the same length."""
    first_epoch, skip = divmod(start_step, steps_per_epoch)
    out = [(first_epoch, skip, first_epoch + 1)] if skip else []
    out.append((first_epoch + bool(skip), 0, epochs))
    return [p for p in out if p[0] < epochs]


def build_step(run: Run, amp_cfg):
    """The model under the rung's precision policy, in a train step with its loss scale and optimizer; returns
    (network, policy, loss-scale plan, train step, Model, precision report)."""
    step = build_train_step(run.cfg, amp_cfg, run.lr, run.device)
    report = precision_report(step.net, step.policy)
    if run.is_main:
        write_report(report, run.run_dir, run.writer)
    log.info("precision: %s", report["summary"])
    if str(amp_cfg.level) == "O3" and step.policy.keep_fp32:  # O3 has no default keep-list, but a given one holds
        log.info("O3 with amp.keep_fp32=[%s]: those Cells stay fp32 (amp.keep_fp32=[] runs everything in low "
                 "precision)", ",".join(step.policy.keep_fp32))
    if run.is_main:
        check_disk_space(run.run_dir / "checkpoints", step.cell)
    model = Model(step.cell, eval_network=NetWithEval(step.net, step.loss_fn), metrics=metrics(),
                  eval_indexes=[0, 1, 2], amp_level="O0")  # the policy is applied above, once
    log.info("loss scale: %s (initial %g)%s", step.plan.kind, step.plan.scale,
             ", overflowed steps are skipped" if step.plan.skip_on_overflow else "")
    return step.net, step.policy, step.plan, step.cell, model, report


def train_rung(run: Run, number: int, amp_cfg, start: Start) -> Rung:
    """One rung of the ladder from `start` to the end of training, a divergence, or a stop signal."""
    cfg, t = run.cfg, run.cfg.trainer
    net, policy, plan, step_cell, model, report = build_step(run, amp_cfg)
    if start.checkpoint is not None:
        restore_weights(step_cell, start.checkpoint, with_amp_state=start.with_amp_state, model_name=cfg.model.name,
                        params=start.params)
        epoch, skip = divmod(start.step, run.steps_per_epoch)
        log.info("%s from %s (step %d, epoch %d%s) at %s", "resumed" if start.with_amp_state else "restarted",
                 start.checkpoint, start.step, epoch, f" + {skip} steps" if skip else "", describe(amp_cfg))
    elif start.init is not None:
        fresh = initial_weights(net, start.init[0], cfg.model.name, cfg.model.num_classes)
        log.info("initialised from %s; optimizer and schedule start fresh%s", start.init[1],
                 f"; {', '.join(fresh)} re-initialised for {cfg.model.num_classes} classes (another class count "
                 f"in the file)" if fresh else "")
    run.evaluator.model = model
    telemetry = AmpTelemetry(step_cell, run.writer, t.log_every, plan.kind)
    watch = DivergenceWatch(telemetry.read, plan.kind, plan.min_scale, cfg.amp.fallback, t.log_every,
                            saturation=step_cell.saturation_mode)
    t_train = time.perf_counter()
    clock = lambda: {"train_time_s": run.trained_s + time.perf_counter() - t_train,  # noqa: E731
                     "wall_time_s": run.wall_before_s + time.perf_counter() - run.t_start}
    checkpoints = AtomicCheckpoint(run.run_dir / "checkpoints", cfg.model.name, t.ckpt_every, t.keep_last,
                                   run.steps_per_epoch, on_save=run.writer.flush if run.writer else None, clock=clock,
                                   every_steps=t.save_every_steps, shape=run_shape(cfg, run.world))
    stop = GracefulStop(checkpoints.save if run.is_main else lambda network, step: None,
                        agree=any_rank if run.world > 1 else None, every=t.log_every)
    offset = StepOffset(start.step)
    watch_msrun = LauncherWatch(os.getppid()) if msrun_env() else None  # before `stop`: it raises the SIGTERM
    epochs = planned_epochs(t.epochs, t.max_steps, run.steps_per_epoch)
    callbacks = [offset, run.timer, watch, telemetry, EpochLog(run.per_step, run.unit, epochs) if run.is_main else None,
                 run.evaluator, watch_msrun, stop, checkpoints if run.is_main else None]
    callbacks = [c for c in callbacks if c is not None]
    if run.writer is not None:
        run.writer.add_scalar("amp/rung", number, start.step)
        lr_at = lambda s: float(run.lr[min(s // t.update_freq, len(run.lr) - 1)])  # noqa: E731  (s counts batches)
        callbacks.append(TensorBoardLogger(run.writer, lr_at, run.per_step, t.log_every, run.timer))
    if cfg.logger.progress_bar and run.is_main and sys.stderr.isatty():  # piped: log lines, no bar glued into them
        callbacks.append(ProgressBar(run.steps_per_epoch, t.log_every, epochs))
    if t.max_steps > 0:
        callbacks.append(StopAtStep(t.max_steps))
    if cfg.runtime.profile and number == 0:  # every rank: they stop to parse at the same step
        callbacks.append(ProfileSteps(run.run_dir, report, run.device, start=start.step + 2,
                                      rank=run.rank if run.world > 1 else None))

    for first_epoch, skip_batches, end_epoch in passes(start.step, run.steps_per_epoch, t.epochs):
        if watch.reason or stop.signal or (t.max_steps and run.timer.steps and run.timer.steps[-1] >= t.max_steps):
            break
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
    return Rung(outcome, net, policy, watch, checkpoints, telemetry.summary(), time.perf_counter() - t_train, stop)


def step_error(run: Run, error: Exception, ran_before: bool) -> str:
    """The one line for what model.train raised: data the pipeline cannot read (a broken image, say), a failure
    of the device at any step (a DeviceError: exit 1), or, before any step ran, a model that does not compile.
    Anything else is raised as it is."""
    if "dataset pipeline" in str(error):
        return pipeline_error(run, error)
    if run.device != "CPU" and device_failure(str(error)):
        raise DeviceError(device_error(run, error)) from error
    if ran_before:
        raise error
    return compile_error(run, error)


def log_trace(error: Exception) -> None:
    """The full trace of an error reported in one line, into train.log only; a rank without one (under msrun,
    ranks other than 0) prints it into its own worker log, msrun's file of its output."""
    trace = "".join(traceback.format_exception(error))
    files = [h for h in logging.root.handlers if isinstance(h, logging.FileHandler)]
    for handler in files:
        handler.handle(logging.LogRecord("amp_zoo", logging.ERROR, __file__, 0, "%s", (trace,), None))
    if not files:
        print(trace, file=sys.stderr, flush=True)


def trace_file(run: Run) -> str:
    return str(run.run_dir / "train.log") if run.is_main else f"rank {run.rank}'s msrun worker log"


def device_error(run: Run, error: Exception) -> str:
    """One line for a failure of the device or the software under it (driver, CANN/CUDA, collectives, device
    memory), told apart from a model that does not compile by the words only a device runtime uses."""
    log_trace(error)
    step = run.timer.steps[-1] if run.timer.steps else 0
    return (f"the {run.device} failed {f'after step {step}' if step else 'in the first step'} (rank {run.rank} of "
            f"{run.world}): {device_failure(str(error))}; this is the device or its software, not the recipe: run "
            f"make doctor on this machine; MindSpore's own error lines: {mindspore_log()} (full trace in "
            f"{trace_file(run)})")


def pipeline_error(run: Run, error: Exception) -> str:
    """One line for data the pipeline cannot read, naming the file where MindSpore's message does; the
    checkpoints written before it are intact."""
    log_trace(error)
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip().startswith("[ERROR]")]
    reason = lines[0].removeprefix("[ERROR]").strip() if lines else str(error).splitlines()[0]
    step = run.timer.steps[-1] if run.timer.steps else 0
    then = continue_with(run.run_dir, run.cfg.recipe_name) if step else "run the command again"
    return (f"the data pipeline failed at step {step}: {reason}; fix or remove that file, then {then} (full trace "
            f"in {trace_file(run)})")


def compile_error(run: Run, error: Exception) -> str:
    """One line for a network that does not compile or fails its first step (typically a forked model's
    shape bug); the full trace goes to train.log only."""
    log_trace(error)
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip() and not ln.strip().startswith("-")]
    reason = next((ln for ln in lines if ln.startswith("For ")), lines[0] if lines else type(error).__name__)
    analysis = Path(os.environ.get("MS_OM_PATH", ".")) / f"rank_{run.rank}" / "om" / "analyze_fail.ir"
    written = analysis.is_file() and analysis.stat().st_mtime >= STARTED  # not one an earlier process left there
    graph = f"; MindSpore's account of the graph: {analysis}" if written else ""
    return (f"model {run.cfg.model.name!r} (recipe {run.cfg.recipe_name}) does not compile or fails its first "
            f"step: {reason} (full trace in {trace_file(run)}{graph})")


def finish(run: Run, rung: Rung, transitions: list, summaries: list) -> float:
    """Final evaluation (and BLEU on the test split for translation), metrics.json."""
    cfg = run.cfg
    steps_done = run.timer.steps[-1] if run.timer.steps else 0
    final = run.evaluator.evaluate()
    if task(cfg) == "translation" and run.is_main:  # rank 0 decodes and writes hypotheses.txt; the weights agree
        final.update(translate(rung.net, cfg, "test", cfg.decode.beam, cfg.decode.length_penalty,
                               run.run_dir / "hypotheses.txt"))
    run.evaluator.record(round(steps_done / run.steps_per_epoch, 2), steps_done, final)
    summary = {
        "recipe": cfg.recipe_name, "model": cfg.model.name, "dataset": cfg.dataset.name,
        "data": cfg.dataset.path or "embedded", "device": run.device, "mode": str(cfg.runtime.mode),
        "sink": run.sink, "amp_level": rung.policy.level, "amp_dtype": rung.policy.dtype,
        "batch_size": cfg.dataset.batch_size, "world_size": run.world,
        "global_batch": cfg.dataset.batch_size * run.world,
        "epochs": cfg.trainer.epochs, "steps": steps_done, "steps_per_epoch": run.steps_per_epoch,
        "wall_time_s": round(run.wall_before_s + time.perf_counter() - run.t_start, 2),  # all processes of the run
        "train_time_s": round(run.trained_s, 2), **run.timer.summary(run.per_step),
        **({"timed_from_step": run.timed_from_step} if run.timed_from_step else {}),
        "throughput_unit": run.unit,
        "final": final, "eval_history": run.evaluator.history, "amp": summaries[-1],
        "fallback": {"enabled": cfg.amp.fallback.enabled, "transitions": transitions, "rungs": summaries},
        "checkpoint": str(rung.checkpoints.latest), "target": OmegaConf.to_container(cfg.target),
        "onednn": onednn_note(run.device), "smoke": run.smoke_note,
        "commit": source_commit(), "machine": machine(),  # the one it finished on: times compare only on one kind
    }
    log.info("rank %d of %d: parameter checksum %s", run.rank, run.world, parameter_checksum(rung.net),
             extra={"every_rank": True})
    if run.is_main:
        try:
            (run.run_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
        except OSError as e:
            raise write_error(run.run_dir / "metrics.json", e) from None
        if run.writer is not None:
            run.writer.close()
        log.info("final: %s", ", ".join(f"{k}={v:.4f}" for k, v in final.items() if isinstance(v, float)))
        log.info("wrote %s", run.run_dir / "metrics.json")
    return final.get("top1", 0.0)


def resume_run_dir(argv) -> list:
    """resume=auto without hydra.run.dir: the newest run directory of the recipe that holds a checkpoint, or
    none (Hydra's new directory: the run starts)."""
    if "resume=auto" not in argv or any(a.startswith("hydra.run.dir=") for a in argv):
        return []
    recipe = next((a.split("=", 1)[1] for a in argv if a.startswith("recipe=")), None)
    if recipe is None:
        recipe = compose([]).recipe_name
    found = sorted(Path("runs", recipe).glob("*/checkpoints/*.ckpt"), key=lambda p: p.stat().st_mtime)
    return [f"hydra.run.dir={found[-1].parent.parent}"] if found else []  # none: a new run (Hydra's new directory)


def hydra_subdir(argv) -> list:
    """A resume keeps the run's first .hydra/ (the command that started it) and records its own command line in
    .hydra/resume-N/, as config.resume-N.yaml beside config.yaml."""
    given = next((a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")), None)
    if given is None or not any(a.startswith("resume=") for a in argv):
        return []
    first = Path(given).expanduser() / ".hydra"
    if not (first / "overrides.yaml").is_file():
        return []
    return [f"hydra.output_subdir=.hydra/resume-{len(list(first.glob('resume-*'))) + 1}"]


if __name__ == "__main__":
    from engine.load import check_command_line
    from zoo.compose import expand_home, hydra_flags
    check_command_line(sys.argv[1:])
    flags, overrides = hydra_flags(expand_home(sys.argv[1:]))
    overrides += resume_run_dir(overrides)
    overrides += hydra_subdir(overrides)
    sys.argv[1:] = flags + overrides  # Hydra's parser reads its flags first
    if all(f in ("-m", "--multirun", "-r", "--run") for f in flags):  # --cfg, --info, ... print and run nothing
        claim_run_dir(sys.argv[1:])
    main()
    interrupt.finished()
