"""train.py as a program: its command line read once, Hydra's main inside the stop-signal handler, and each run
(each job of a sweep) in `job()`, which claims its run directory and closes it however the run ends.

The command line is checked and put in the form Hydra's parser reads (its flags first, ~ expanded, a resume
pointed at its run directory) once, before Hydra composes each run, once. A sweep (-m) has every run checked
before the first starts, goes on past a job that fails, and ends saying which jobs finished, failed and never
started.
"""
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ampzoo import interrupt
from ampzoo.compose import expand_home, hydra_flags, one_line, sweep
from ampzoo.config import CONF_DIR
from ampzoo.engine.load import check_command_line
from ampzoo.engine.process.before_init import before_rank, hydra_folder, hydra_overrides
from ampzoo.engine.process.directory import RunDir, first_process, note_missing
from ampzoo.engine.process.logs import file_handlers, log_trace
from ampzoo.errors import ConfigError, fail
from ampzoo.report import report
from ampzoo.runtime import msrun_env


def given(overrides: List[str], key: str) -> Optional[str]:
    """The value of `key=VALUE` on the command line, or None."""
    return next((a.split("=", 1)[1] for a in overrides if a.startswith(f"{key}=")), None)


def recipe_of(overrides: List[str]) -> str:
    """The recipe a command line runs: recipe= or the default of conf/config.yaml."""
    defaults = OmegaConf.load(CONF_DIR / "config.yaml").defaults
    return given(overrides, "recipe") or next(d["recipe"] for d in defaults if "recipe" in d)


def resume_run_dir(overrides: List[str]) -> List[str]:
    """resume=auto without hydra.run.dir: the newest run directory of the recipe that holds a checkpoint, or
    none (Hydra's new directory: the run starts)."""
    if given(overrides, "resume") != "auto" or given(overrides, "hydra.run.dir"):
        return []
    found = sorted(Path("runs", recipe_of(overrides)).glob("*/checkpoints/*.ckpt"), key=lambda p: p.stat().st_mtime)
    return [f"hydra.run.dir={found[-1].parent.parent}"] if found else []


def resume_subdir(overrides: List[str]) -> List[str]:
    """A resume keeps the run's first .hydra/ (the command that started it) and records its own command line in
    .hydra/resume-N/, as config.resume-N.yaml beside config.yaml."""
    run_dir = given(overrides, "hydra.run.dir")
    folder = hydra_folder(Path(run_dir).expanduser()) if run_dir and given(overrides, "resume") else ".hydra"
    return [f"hydra.output_subdir={folder}"] if folder != ".hydra" else []


def hydra_argv(argv: List[str]) -> List[str]:
    """The command line as Hydra's parser reads it, checked (ampzoo.engine.load.check_command_line); a run directory
    named for one run is claimed here, before Hydra writes into it, and the folders on the way to the default
    ones are noted (ampzoo.engine.process.directory.note_missing)."""
    check_command_line(argv, single=bool(msrun_env()))  # under msrun no process removes the shared directory:
    # a run is checked before Hydra makes it; else Hydra composes it once, and train.py checks it then
    flags, overrides = hydra_flags(expand_home(argv))
    overrides += resume_run_dir(overrides)
    overrides += hydra_overrides(resume_subdir(overrides))  # under msrun: rank 0 alone writes .hydra/
    runs = all(f in ("-m", "--multirun", "-r", "--run") for f in flags)  # --cfg, --info, ...: nothing runs
    if runs and ("-m" in flags or "--multirun" in flags):
        note_missing(given(overrides, "hydra.sweep.dir") or Path("runs", "multirun"))
    elif runs and given(overrides, "hydra.run.dir"):
        try:
            RunDir(given(overrides, "hydra.run.dir"), named=True).claim(fresh=not given(overrides, "resume"))
        except ConfigError as e:
            fail(str(e))
    elif runs:
        note_missing(Path("runs", recipe_of(overrides)))
    return flags + overrides


@dataclass
class Sweep:
    """How the jobs of a multirun ended, by Hydra's job number (#N): finished, failed or interrupted."""
    ended: Dict[int, Tuple[str, int]] = field(default_factory=dict)
    code: int = 0  # the exit code of the first job that failed

    def end(self, number: int, how: str, code: int = 0) -> None:
        self.ended[number] = (how, code)
        self.code = self.code or code

    def summary(self, planned: List[List[str]]) -> str:
        """`sweep: 3 jobs; finished: #1; failed: #0 (exit 1); never started: #2 (recipe=lenet_o3)`: the jobs
        that ran are named by number (Hydra's launch lines give their overrides), the rest by their overrides."""
        parts = []
        for how in ("finished", "failed", "interrupted"):
            jobs = [f"#{n}" + (f" (exit {code})" if code else "") for n, (h, code) in sorted(self.ended.items())
                    if h == how]
            parts += [f"{how}: {', '.join(jobs)}"] if jobs else []
        never = [f"#{n} ({' '.join(planned[n])})" for n in range(len(self.ended), len(planned))]
        return f"sweep: {len(planned)} jobs; " + "; ".join(parts + [f"never started: {', '.join(never) or 'none'}"])


SWEEP = Sweep()


def ended(error: BaseException, run_dir: RunDir) -> SystemExit:
    """`report`'s line for `error` printed, and the exit it ends in. An error report does not know (a bug, or a
    collective's failure outside training's own handler) is not bad input: exit 1, its whole message and
    traceback in train.log (a rank without one: its console, msrun's worker log), its first line on the
    console."""
    try:
        report(error)
    except SystemExit as exit_:
        return exit_
    except BaseException as unknown:  # noqa: BLE001  (report re-raised it: not bad input, a device, a stop)
        log_trace(unknown)
        log = run_dir.path / "train.log"
        where = f"in {log}" if file_handlers() and log.is_file() else "above"
        lines = str(unknown).strip().splitlines()
        print(f"error: {type(unknown).__name__}: {lines[0] if lines else 'no message'} (not bad input: the whole "
              f"message and its traceback are {where})", file=sys.stderr, flush=True)
        return SystemExit(1)


@contextmanager
def job(cfg) -> Iterator[RunDir]:
    """The body of one run, or one job of a sweep (`cfg`: the config Hydra composed for it): its run directory,
    claimed, and closed however the run ends. An error ends a single run with its one line
    (ampzoo.report.report); in a sweep, the line is the job's and the sweep goes on with the next job, unless a
    stop signal ends it. Under msrun, only rank 0's lines reach train.log (before_init.before_rank)."""
    hydra = HydraConfig.get()
    multirun = hydra.mode == RunMode.MULTIRUN
    run_dir = RunDir(hydra.runtime.output_dir, named=bool(given(list(hydra.overrides.hydra), "hydra.run.dir")),
                     recipe=hydra.runtime.choices.get("recipe"))
    before_rank(cfg, hydra, run_dir.path)
    number = hydra.job.get("num", 0)
    try:
        yield run_dir.claim() if first_process() else run_dir
        run_dir.close()
        if multirun:
            SWEEP.end(number, "finished")
    except BaseException as error:  # noqa: BLE001  (each kind ends as ampzoo.report.report says)
        exit_ = ended(run_dir.close(error), run_dir)
        if not multirun:
            raise exit_ from None
        stopped = interrupt.received() or isinstance(error, interrupt.Interrupted)
        SWEEP.end(number, "interrupted" if stopped else "failed", int(exit_.code or 1))
        if stopped:  # a stop signal ends the sweep
            raise exit_ from None


def run_hydra(main: Callable[[], object]) -> None:
    """train.py's program: main (Hydra's) on the command line `hydra_argv` makes of sys.argv, inside the
    stop-signal handler (ampzoo.interrupt.handled). What Hydra cannot compose (a value the schema refuses, a recipe
    not found: Hydra's and OmegaConf's own errors) is one line, exit 2; each run's own errors end in `job`, and
    anything else keeps its traceback, exit 1. A sweep ends with its summary, and the exit code of its first
    failed job."""
    argv = sys.argv[1:]
    multirun = "-m" in argv or "--multirun" in argv
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises what it cannot compose, and it becomes one line here
    with interrupt.handled():
        try:
            sys.argv[1:] = hydra_argv(argv)
            main()
        except (HydraException, OmegaConfBaseException, ConfigError) as e:  # composition: a bad value, no recipe
            report(e if interrupt.received() else ConfigError(one_line(e, argv)))
        finally:
            if multirun and SWEEP.ended:
                jobs = sweep([a for a in hydra_flags(sys.argv[1:])[1] if not a.startswith("hydra.")])
                print(SWEEP.summary(jobs), file=sys.stderr, flush=True)
    interrupt.finished()
    if SWEEP.code:
        raise SystemExit(SWEEP.code)

