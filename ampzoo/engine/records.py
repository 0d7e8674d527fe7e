"""The files that record a run: its config.yaml when it starts (config.resume-N.yaml for each resume), and its
metrics.json when it finishes: what ran, where, how long and how well."""
import json
import logging
import time
from pathlib import Path

from omegaconf import OmegaConf

from ampzoo.engine.state import Rung, Run
from ampzoo.errors import write_error
from ampzoo.machine import machine, machine_kind
from ampzoo.runtime import onednn_note, source_commit

log = logging.getLogger("amp_zoo")


def write_run_config(cfg, run_dir: Path, resuming: bool) -> None:
    """The run's config.yaml; a resume keeps the first and writes its own beside it (config.resume-N.yaml)."""
    config_file = run_dir / "config.yaml"
    if resuming and config_file.exists():
        config_file = run_dir / f"config.resume-{len(list(run_dir.glob('config*.yaml')))}.yaml"
    try:
        config_file.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    except OSError as e:
        raise write_error(config_file, e) from None


def summary(run: Run, rung: Rung, final: dict, steps_done: int, transitions: list, summaries: list) -> dict:
    """metrics.json's record: what ran, where, how long and how well."""
    cfg = run.cfg
    return {
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
        "onednn": onednn_note(run.device), "smoke": run.smoke_note, "compute": computes(run.run_dir),
        "commit": source_commit(), "machine": machine(),  # the one it finished on: times compare only on one kind
    }


COMPUTE = "compute.jsonl"  # in the run directory: a line per process of the run


def record_compute(run_dir: Path, step: int, path: dict) -> None:
    """The compute path (ampzoo.amp.policy.compute_path) of this process of the run, from `step`, with its machine."""
    mach = machine()
    line = {"from_step": step, **path, "machine": f"{machine_kind(mach)}, family {mach['family']}"}
    with open(Path(run_dir) / COMPUTE, "a") as f:
        f.write(json.dumps(line) + "\n")


def computes(run_dir: Path) -> list:
    """Every process's compute path, in order, the repeats of a path on one machine folded: metrics.json's
    "compute" (one entry when the whole run computed one way)."""
    try:
        lines = [json.loads(ln) for ln in (Path(run_dir) / COMPUTE).read_text().splitlines() if ln.strip()]
    except (OSError, ValueError):
        return []
    out = []
    for line in lines:
        if not out or {k: v for k, v in line.items() if k != "from_step"} != \
                {k: v for k, v in out[-1].items() if k != "from_step"}:
            out.append(line)
    return out


def write_metrics(run: Run, record: dict) -> None:
    """metrics.json (a WriteError names it when it cannot be written); TensorBoard's events closed."""
    try:
        (run.run_dir / "metrics.json").write_text(json.dumps(record, indent=2))
    except OSError as e:
        raise write_error(run.run_dir / "metrics.json", e) from None
    if run.writer is not None:
        run.writer.close()
    log.info("final: %s", ", ".join(f"{k}={v:.4f}" for k, v in record["final"].items() if isinstance(v, float)))
    log.info("wrote %s", run.run_dir / "metrics.json")
