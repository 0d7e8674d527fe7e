"""Where a run starts: the checkpoint a resume continues from, the weights a new run starts from (a shipped
weight or a checkpoint), or nothing to do (a finished run resumed with nothing more asked of it)."""
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple

from omegaconf import open_dict

from ampzoo.data import task
from ampzoo.engine.checkpoint import read_checkpoint, resume_point
from ampzoo.engine.rundir import kept_tokenizer, run_of_checkpoint, same_tokenizer
from ampzoo.engine.weights import find as find_weights, shipped_tokenizer
from ampzoo.errors import ConfigError

log = logging.getLogger("amp_zoo")


@dataclass
class Start:
    """Where a rung starts: a checkpoint (already read) and its global step, or the initial weights."""
    checkpoint: Optional[Path] = None
    params: Optional[dict] = None
    step: int = 0
    with_amp_state: bool = False  # a resume restores the loss-scale state; a lower rung starts its own
    init: Optional[Tuple[Path, str]] = None  # no checkpoint: the weights (and what to call them) a new run starts from


def step_of(params: Optional[dict]) -> int:
    return int(params["step_num"].asnumpy()) if params and "step_num" in params else 0


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
