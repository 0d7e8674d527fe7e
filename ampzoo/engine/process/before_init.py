"""What a process under msrun writes before it knows its rank: nothing that rank 0 does not write itself.

msrun starts every worker and its scheduler with the same command, so up to nine processes compose the same config,
would write the same lines into one train.log and the same `.hydra/` record (a resume's `.hydra/resume-N` counted
by each, so several folders). Rank 0 alone writes them:
- a rank msrun names before init() (MS_NODE_ID: every worker of one host, or of a host given --node_rank) is
  settled at once: rank 0 writes as a single process does, the others and the scheduler keep only their warnings
  (ampzoo.engine.process.logs.rank_logging);
- a rank msrun assigns at init() (hosts without --node_rank) holds its lines until `rank_known`, which writes them
  on rank 0 only, with the `.hydra/` record Hydra was told not to write (`hydra_overrides`).
"""
import logging
from pathlib import Path
from typing import List, Optional

from omegaconf import OmegaConf

from ampzoo.engine.process.logs import every_rank_or_warning, rank_logging
from ampzoo.runtime import msrun_env, msrun_rank


class _Held(logging.Filter):
    """Keeps a console's lines below WARNING (and train.log's, whose handler is set aside) until the rank is
    known."""

    def __init__(self):
        super().__init__()
        self.records: List[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if every_rank_or_warning(record):
            return True
        self.records.append(record)
        return False


_HELD: Optional[_Held] = None
_FILES: List[logging.Handler] = []
_RECORD: Optional[tuple] = None  # (run directory, .hydra subdir, task config, hydra config, overrides)


def hydra_folder(run_dir: Path) -> str:
    """Where this command's `.hydra/` record goes in `run_dir`: `.hydra` for the run's first command, then
    `.hydra/resume-N`, one more than the resumes recorded so far."""
    first = run_dir / ".hydra"
    return f".hydra/resume-{len(list(first.glob('resume-*'))) + 1}" if (first / "overrides.yaml").is_file() \
        else ".hydra"


def hydra_overrides(resume_subdir: List[str]) -> List[str]:
    """Where Hydra writes this command's `.hydra/` record: `resume_subdir` (the resume's own folder) in a single
    process and on a rank 0 that msrun named; nowhere on the other processes of msrun (their rank's record is rank
    0's, written at `rank_known` when msrun names ranks only at init())."""
    if not msrun_env() or msrun_rank() == 0:
        return resume_subdir
    return ["hydra.output_subdir=null"]


def before_rank(task_cfg, hydra_cfg, run_dir: Path) -> None:
    """At the start of a run's job: a process msrun named settles its logging; one it did not holds its lines and
    keeps the `.hydra/` record for `rank_known`."""
    global _HELD, _RECORD
    if not msrun_env():
        return
    rank = msrun_rank()
    if rank is not None:
        if rank != 0:
            rank_logging()
        return
    _RECORD = (run_dir, hydra_folder(run_dir), task_cfg, OmegaConf.create({"hydra": hydra_cfg}),
               OmegaConf.create(list(hydra_cfg.overrides.task)))
    _HELD = _Held()
    for handler in list(logging.root.handlers):
        if isinstance(handler, logging.FileHandler):
            logging.root.removeHandler(handler)
            _FILES.append(handler)
        else:
            handler.addFilter(_HELD)


def rank_known(rank: int) -> None:
    """After init(): rank 0 writes what it held (its lines into train.log and on its console, the `.hydra/`
    record); the other ranks drop it and keep only their warnings. Nothing when nothing was held."""
    global _HELD, _RECORD
    held, record = _HELD, _RECORD
    _HELD, _RECORD = None, None
    if held is None:  # a single process, or a rank msrun named: settled at before_rank
        return
    for handler in logging.root.handlers:
        handler.removeFilter(held)
    if rank != 0:
        _FILES.clear()
        rank_logging()
        return
    for handler in _FILES:
        logging.root.addHandler(handler)
    _FILES.clear()
    for line in held.records:
        for handler in logging.root.handlers:
            if line.levelno >= handler.level:
                handler.handle(line)
    run_dir, subdir, task_cfg, hydra_cfg, overrides = record
    folder = run_dir / subdir
    folder.mkdir(parents=True, exist_ok=True)
    for name, cfg in (("config.yaml", task_cfg), ("hydra.yaml", hydra_cfg), ("overrides.yaml", overrides)):
        (folder / name).write_text(OmegaConf.to_yaml(cfg), encoding="utf-8")
