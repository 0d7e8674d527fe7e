"""The run directory of one train.py process, as one object: opened, claimed and closed.

Opening it notes which folders on its way do not exist yet (`note_missing`, before Hydra creates any), so that
closing a run that leaves nothing worth keeping (bad input, a stop signal before the first checkpoint) removes
the folders this process created and never one it found: a user's own empty folders stay. Claiming it holds it
for this process (ampzoo.engine.rundir.claim). Closing it releases it, and turns the error the run ended with into what
the user reads: where the run stands and the command that continues it.
"""
import logging
import os
import shutil
from pathlib import Path
from typing import List, Optional, Set

from ampzoo.engine.checkpoint import checkpoints
from ampzoo.engine.process.logs import log_line
from ampzoo.engine.rundir import claim, refuse_fresh_start, release
from ampzoo.errors import ConfigError, TracedError, WriteError
from ampzoo.interrupt import Interrupted
from ampzoo.runtime import msrun_env

MISSING: Set[Path] = set()  # folders that did not exist when this process first looked: the ones it creates


def first_process() -> bool:
    """A single process, not one of msrun's workers: it holds its run directory from the start. msrun's ranks are
    known only after init() (msrun may leave RANK_ID unset), so rank 0 claims the directory then (train.setup)."""
    return "MS_WORKER_NUM" not in os.environ and "MS_ROLE" not in os.environ


def note_missing(path) -> None:
    """Note every folder from `path` up that does not exist yet: what this process creates there is its own."""
    path = Path(path).expanduser().resolve()
    for folder in [path, *path.parents]:
        if folder.exists():
            break
        MISSING.add(folder)


def parent_command() -> List[str]:
    """The command line of this process's parent (under msrun: msrun's), or [] where it cannot be read."""
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def launcher() -> Optional[List[str]]:
    """msrun's command line with its own options (`msrun --worker_num=8 ...`, up to the script), when msrun
    started this process; None otherwise."""
    if not msrun_env():
        return None
    words = parent_command()
    start = next((i for i, w in enumerate(words) if Path(w).name == "msrun"), None)
    if start is None:
        return ["msrun", f"--worker_num={os.environ.get('MS_WORKER_NUM', 'N')}", "(with this run's other options)"]
    end = next((i for i in range(start + 1, len(words)) if words[i].endswith(".py")), len(words))
    return ["msrun", *words[start + 1:end]]


def continue_with(run_dir, recipe: Optional[str] = None) -> str:
    """The command that continues a run: under msrun, msrun with the options it was started with (its workers
    take the run's own config.yaml, with runtime.distributed=true as msrun requires)."""
    msrun = launcher()
    prefix = f"{' '.join(msrun)} train.py" if msrun else "python train.py"
    recipe_part = f"recipe={recipe} " if recipe else ""
    distributed = "runtime.distributed=true " if msrun else ""
    return f"continue with: {prefix} {recipe_part}{distributed}hydra.run.dir={run_dir} resume=auto"


class RunDir:
    """One run's directory. `named`: given on the command line (hydra.run.dir); else Hydra made it new for this
    run (runs/<recipe>/<time>-<pid>, a sweep's job folder), so it is this process's own."""

    def __init__(self, path, named: bool, recipe: Optional[str] = None):
        self.path = Path(path).expanduser().resolve()
        self.named, self.recipe = named, recipe

    def ours(self, folder: Path) -> bool:
        """Whether this process created `folder` (or a folder it sits in)."""
        return (folder == self.path and not self.named) or any(p in MISSING for p in [folder, *folder.parents])

    def claim(self, fresh: bool = False) -> "RunDir":
        """Hold the directory for this process, creating it; with `fresh`, refuse one that holds a run. A refusal
        (a ConfigError) leaves no folder this process created."""
        note_missing(self.path)
        try:
            if first_process():
                claim(self.path)
            if fresh:
                refuse_fresh_start(self.path)
        except ConfigError:
            self.remove()
            raise
        return self

    def holds_a_run(self) -> bool:
        return bool(checkpoints(self.path / "checkpoints")) or (self.path / "metrics.json").exists()

    def remove(self) -> bool:
        """Remove the directory and the folders on its way that this process created, if nothing worth keeping
        is in it (a checkpoint, metrics.json) and it is this process's own; never a folder it found. Returns
        whether the directory was removed."""
        if not self.ours(self.path) or not first_process() or self.holds_a_run():
            return False
        release(self.path)
        logging.shutdown()  # train.log's handler lets go of the file
        shutil.rmtree(self.path, ignore_errors=True)
        for folder in self.path.parents:
            if folder not in MISSING:
                break
            try:
                folder.rmdir()  # only when empty: another run may have started in it since
            except OSError:
                break
        return not self.path.exists()

    def close(self, error: Optional[BaseException] = None) -> Optional[BaseException]:
        """Release the directory; with `error`, the error as the user reads it: bad input takes away what this
        process created (a model that does not compile keeps its trace in train.log), a stop signal says where
        the run stands, a file that cannot be written names the command that continues."""
        try:
            if isinstance(error, Interrupted):
                return self.interrupted(error)
            if isinstance(error, ConfigError) and (isinstance(error, TracedError) or not self.remove()):
                log_line(f"error: {error}")
            if isinstance(error, OSError):
                where = error if isinstance(error, WriteError) else \
                    f"could not write {error.filename or self.path}: {error.strerror or error}"
                return WriteError(f"{where}; every complete checkpoint is intact: free space (or fix the "
                                  f"permission), then {continue_with(self.path, self.recipe)}")
            return error
        finally:
            release(self.path)

    def interrupted(self, error: Interrupted) -> Interrupted:
        """A stop signal outside training's own graceful stop (start-up, compiling, the final evaluation): the
        note says what the directory holds and how to go on; a directory that holds nothing is removed."""
        found = checkpoints(self.path / "checkpoints")
        if error.note is None and found:
            error.note = f"the newest checkpoint is {found[-1]}; {continue_with(self.path)}"
        elif error.note is None and self.remove():
            error.note = "nothing was saved (no step had finished); run the command again"
        elif error.note is None:
            error.note = f"no checkpoint was saved in {self.path}; run the command again with resume=auto"
        if self.path.is_dir():
            log_line(f"interrupted by {error.name}: {error.note}")
        return error


def forget_command(run_dir) -> None:
    """A resume with nothing to do leaves the run as it was: the .hydra/resume-N Hydra wrote for this command
    goes."""
    from hydra.core.hydra_config import HydraConfig

    subdir = HydraConfig.get().output_subdir if HydraConfig.initialized() else None
    if subdir and str(subdir).startswith(".hydra/resume-"):
        shutil.rmtree(Path(run_dir) / subdir, ignore_errors=True)
