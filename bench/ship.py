"""Ship a finished run's weights:  python -m bench.ship RUN_DIR NAME [--fp16]

Takes the run's final checkpoint (for translation, the last decode.average_last epoch checkpoints averaged,
as the published protocol scores them), keeps the network's parameters only (no optimizer moments, no
loss-scale state or AMP counters), writes weights/NAME.ckpt (fp32, or fp16 with --fp16 for large models; a
translation run's sentencepiece model beside it as weights/NAME.spm.model),
scores that file on the full test split, and writes its entry in weights/MANIFEST.json: sha256, bytes,
parameter count, recipe and overrides, the commit that trained it, MindSpore version and machine, the metric
with its scorer, the published anchor, and the command that re-evaluates it (bench.verify runs them all).
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import json
import shutil
from pathlib import Path
from typing import List

import mindspore as ms
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from ampzoo.cli import pop_flag
from ampzoo.compose import compose
from ampzoo.data import task
from ampzoo.data.translation import tokenizer_file
from ampzoo.engine.checkpoint import average_checkpoints, checkpoints, epoch_checkpoints, read_checkpoint
from ampzoo.engine.load import flatten, load_config
from ampzoo.engine.rundir import load_run_config, resume_configs
from ampzoo.engine.weights import MANIFEST, WEIGHTS, read_manifest, sha256
from ampzoo.errors import ConfigError, fail
from ampzoo.machine import machine, machine_kind
from ampzoo.runtime import set_context
from bench.reproduce import data_groups, training_wall_time
from bench.verify import score
from ampzoo.engine.network import build_model

SKIP = ("recipe_name", "smoke", "resume", "checkpoint", "output", "weights", "description", "target", "search",
        "logger", "runtime.device_id", "dataset.path",  # groups, or keys: where a run ran and how it was watched
        "dataset.params.spm_model",  # the tokenizer ships as a file beside the weights (the manifest's tokenizer)
        "runtime.cpu_threads")  # the kernels' thread count: the same numbers on any (their pieces are fixed)


def overrides(run_cfg) -> List[str]:
    """The key=value list that turns the recipe as written into the run's config (what the run's command line
    changed): composing the recipe with these gives the run's config again. A key the recipe does not have (a
    config group of the run's added it, as dataset=multi30k_published adds dataset.params.lowercase) is
    +key=value; a key the run does not have (setting=cased_4k has no dataset.params.lowercase) is ~key."""
    recipe = flatten(OmegaConf.to_container(compose([f"recipe={run_cfg.recipe_name}"]), resolve=True))
    run = flatten(OmegaConf.to_container(run_cfg, resolve=True))
    def skip(key: str) -> bool:
        return key.split(".")[0] in SKIP or key in SKIP
    out = [f"~{key}" for key in sorted(recipe) if key not in run and not skip(key)]
    for key, value in sorted(run.items()):
        if skip(key) or recipe.get(key) == value:
            continue
        text = json.dumps(value) if isinstance(value, (list, dict)) else value
        out.append(f"{'' if key in recipe else '+'}{key}={text}")
    return out


def trained(run_dir: Path, metrics: dict, final_params: dict) -> dict:
    """Steps, epochs and wall time summed over the run's sessions; the pure training time too when it counts
    every process: one process trained it all, or its checkpoints kept the times from the first step (a run
    resumed before they did counts its last process only)."""
    out = {"steps": metrics["steps"], "epochs": metrics["epochs"],
           "wall_time_s": training_wall_time(run_dir) or metrics["wall_time_s"]}
    resumed = bool(resume_configs(run_dir))
    if not resumed or ("train_time_s" in final_params and "timed_from_step" not in metrics):
        out["train_time_s"] = metrics.get("train_time_s")
    return out


def ship(run_dir: Path, name: str, fp16: bool = False, folder: Path = WEIGHTS) -> dict:
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.json").is_file():
        raise ConfigError(f"{run_dir} has no metrics.json: ship a finished run")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    trained_on = metrics.get("machine") or machine()  # a run trained here, unless its record says otherwise
    cfg = load_run_config(run_dir, latest=True)  # as its last process ran (trainer.epochs may have grown)
    set_context(cfg.runtime)
    final = checkpoints(run_dir / "checkpoints")[-1]
    params = final_params = read_checkpoint(final)
    source = final.name
    if task(cfg) == "translation" and cfg.decode.average_last > 1:  # the last epoch checkpoints, as bench.multi30k
        ends = list(epoch_checkpoints(run_dir / "checkpoints", metrics["steps_per_epoch"]).values())
        if len(ends) < cfg.decode.average_last:
            raise ConfigError(f"decode.average_last={cfg.decode.average_last} but {run_dir / 'checkpoints'} holds "
                              f"{len(ends)} epoch checkpoints")
        last = ends[-cfg.decode.average_last:]
        params, source = average_checkpoints(last), [p.name for p in last]
    net = build_model(cfg)
    names = [p.name for p in net.get_parameters()]
    needs_path = load_config([f"recipe={cfg.recipe_name}"], needs_data=False)[1] is not None  # no packaged data
    data = data_groups(HydraConfig.get().runtime.choices["dataset"])[-1]  # the files' own group: multi30k, not a
    # preparation of them such as multi30k_published
    dtype = ms.float16 if fp16 else ms.float32
    kept = [{"name": n, "data": ms.Tensor(params[n].asnumpy()).astype(dtype)} for n in names]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.ckpt"
    ms.save_checkpoint(kept, str(path))
    path.chmod(0o644)  # MindSpore writes 0400; a shipped file is read by everyone
    entry = {
        "file": path.name, "sha256": sha256(path), "bytes": path.stat().st_size,
        "parameters": int(sum(p.size for p in net.trainable_params())), "dtype": "float16" if fp16 else "float32",
        "recipe": cfg.recipe_name, "overrides": overrides(cfg), "from": source,
        "commit": metrics.get("commit"), "mindspore": trained_on["mindspore"], "machine": machine_kind(trained_on),
        "compute": metrics.get("compute") or "not recorded (trained before 2026-12-07)",  # kernels and products
        "trained": trained(run_dir, metrics, final_params),
        "metric": None, "published": {k: OmegaConf.to_container(cfg.target).get(k)
                                      for k in ("metric", "published", "published_setting", "source")},
        "command": f"python eval.py weights={name}" + (f" dataset.path=/data/{data}" if needs_path else ""),
    }
    if task(cfg) == "translation":  # the run's own sentencepiece model ships beside its weights
        spm_path = folder / f"{name}.spm.model"
        shutil.copyfile(tokenizer_file(cfg.dataset), spm_path)  # the run's copy (load_run_config), or the cached
        entry["tokenizer"] = {"file": spm_path.name, "sha256": sha256(spm_path), "bytes": spm_path.stat().st_size}
    entries = read_manifest(folder)
    entries[name] = entry
    (folder / MANIFEST).write_text(json.dumps(entries, indent=2) + "\n")
    entry["metric"] = score(name, folder, cfg.dataset.path)
    entries[name] = entry
    (folder / MANIFEST).write_text(json.dumps(entries, indent=2) + "\n")
    return entry


def main(argv: List[str]) -> None:
    fp16, args = pop_flag(argv, "--fp16")
    if len(args) != 2 or any(a.startswith("--") for a in args):
        fail(f"usage: python -m bench.ship RUN_DIR NAME [--fp16]; got {' '.join(argv) or 'nothing'}")
    entry = ship(Path(args[0]), args[1], fp16)
    print(json.dumps(entry, indent=2))


if __name__ == "__main__":
    run(main)
