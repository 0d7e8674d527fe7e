"""The FP32-vs-AMP matrix: every recipe at each amp level and loss-scale type, on the embedded data.

    python -m bench.run [--quick] [--out DIR]        (make bench / make bench-quick)

Each cell of the matrix is one `train.py` run in its own process (a fresh MindSpore per run, so no compile
cache or allocator state leaks between cells), with a fixed budget. Results go to
bench/results/<device>-<date>/: results.json (one record per run), BENCHMARKS.md (the table), and PNG plots.
A killed bench picks up where it stopped: finished runs in results.json are not run again, and a run it stopped
starts anew (its times hold only for one session). A stop signal (Ctrl-C, SIGTERM) reaches the train.py it runs;
then it exits 130 / 143 with one line.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import json
import shutil
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

import psutil
from tqdm import tqdm

from ampzoo.cli import pop_option
from ampzoo.engine import train_run
from ampzoo.errors import fail
from ampzoo.interrupt import Interrupted
from bench.common import machine
from bench.report import write_report

ROOT = Path(__file__).resolve().parent.parent

# (recipe, level, loss scale, extra overrides); the recipe's own loss-scale settings are used for "recipe".
LENET = [("lenet_o0", "O0", "none"), ("lenet_o2", "O1", "dynamic"), ("lenet_o2", "O2", "fixed"),
         ("lenet_o2", "O2", "dynamic"), ("lenet_o3", "O3", "dynamic"), ("lenet_o3", "O3", "none")]
RESNET = [("resnet34_o0", "O0", "none"), ("resnet34_o2", "O2", "fixed"), ("resnet34_o3", "O3", "fixed")]
TRANSFORMER = [("transformer_base_o0", "O0", "none"), ("transformer_base_o2", "O2", "dynamic"),
               ("transformer_base_o2", "O3", "none"), ("transformer_base_o2", "O3", "dynamic")]  # the ablation
TARGETS = {"lenet": ("top1", 0.90), "resnet34": ("top1", 0.30), "transformer_base": ("bleu", 2.0)}

MATRICES = {
    # name: [(cells, seeds, budget overrides)]
    "default": [(LENET, [1, 2, 3], ["trainer.epochs=5"]),
                (RESNET, [1, 2], ["smoke.trainer.max_steps=40"]),
                (TRANSFORMER, [1, 2, 3], ["smoke.trainer.epochs=6", "decode.beam=1"])],
    "quick": [(LENET, [1], ["trainer.epochs=2"]),
              (RESNET[:2], [1], ["smoke.trainer.max_steps=8"]),
              (TRANSFORMER[:2], [1], ["smoke.trainer.epochs=2", "decode.beam=1"])],
}


def family(recipe: str) -> str:
    return recipe.rsplit("_", 1)[0] if not recipe.startswith("resnet34") else "resnet34"


def run_id(recipe, level, ls, seed) -> str:
    return f"{recipe}-{level}-{ls}-s{seed}"


MARKER = ".bench-run"  # in each run directory bench.run makes: the only directories it ever deletes


def train(run_dir: Path, args) -> dict:
    """One train.py run; returns its metrics.json plus the peak resident memory of the process tree. Its stderr
    goes to RUN_DIR.err beside the run."""
    if run_dir.exists():  # stopped in an earlier bench: a run's times hold only for one session
        if not (run_dir / MARKER).exists():
            fail(f"{run_dir} exists and bench.run did not make it (no {MARKER} in it): move it, or give another "
                 f"--out")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / MARKER).write_text("made by python -m bench.run; a stopped run here is deleted and run anew\n")
    err_file = run_dir.with_name(run_dir.name + ".err")
    with open(err_file, "w") as err_out:
        proc = subprocess.Popen([sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}",
                                 "logger.progress_bar=false"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err_out)
    peak = [0]

    def watch():
        p = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
                peak[0] = max(peak[0], rss)
            except psutil.Error:
                pass
            time.sleep(0.1)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    train_run.wait(proc)  # a stop signal to the bench reaches the run too
    thread.join()
    err = err_file.read_text()
    if proc.returncode != 0:
        return {"status": "failed", "error": err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"}
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {"status": "ok", "peak_host_mb": round(peak[0] / 2**20, 1), **metrics}


def time_to_target(metrics: dict, metric: str, value: float):
    for point in metrics.get("eval_history", []):
        if point.get(metric, -1) >= value:
            return point["time_s"], point["step"]
    return None, None


def record(recipe, level, ls, seed, m: dict) -> dict:
    metric, target = TARGETS[family(recipe)]
    t_target, s_target = time_to_target(m, metric, target)
    amp = m.get("amp", {})
    return {
        "id": run_id(recipe, level, ls, seed), "recipe": recipe, "family": family(recipe), "level": level,
        "dtype": m.get("amp_dtype"), "loss_scale": ls, "seed": seed, "device": m.get("device"),
        "status": m["status"], "error": m.get("error"), "steps": m.get("steps"), "metric": metric,
        "final_metric": m.get("final", {}).get(metric), "target": target, "time_to_target_s": t_target,
        "steps_to_target": s_target, "samples_per_s": m.get("samples_per_s"),
        "compile_and_first_step_s": m.get("compile_and_first_step_s"),
        "step_time_median_ms": m.get("step_time_median_ms"), "step_time_iqr_ms": m.get("step_time_iqr_ms"),
        "peak_host_mb": m.get("peak_host_mb"), "device_memory_mb": None,  # CPU: MindSpore reports none
        "overflow_steps": amp.get("overflow_steps"), "final_loss_scale": amp.get("final_loss_scale"),
        "run_dir": m.get("run_dir"), "smoke": bool(m.get("smoke")),
    }


def finished(results) -> set:
    """Runs not to run again: finished, and their run directory still here (a fresh clone has results.json
    but not the raw runs, which the plots read)."""
    return {r["id"] for r in results["runs"] if r["status"] == "ok" and (ROOT / r["run_dir"]).exists()}


def main(argv) -> Path:
    quick = "--quick" in argv
    device = "cpu"
    out, argv = pop_option(argv, "--out", None, Path)
    if any(a != "--quick" for a in argv):
        fail(f"unknown argument {next(a for a in argv if a != '--quick')!r}; valid: --quick, --out DIR")
    out = out or ROOT / "bench" / "results" / f"{device}-{date.today().isoformat()}{'-quick' if quick else ''}"
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {"runs": []}
    done = finished(results)
    results["runs"] = [r for r in results["runs"] if r["id"] in done]
    results["machine"] = machine()
    results["matrix"] = "quick" if quick else "default"
    cells = [(recipe, level, ls, seed, budget) for group, seeds, budget in MATRICES[results["matrix"]]
             for recipe, level, ls in group for seed in seeds]
    todo = [c for c in cells if run_id(*c[:4]) not in done]
    for recipe, level, ls, seed, budget in tqdm(todo, desc="bench", unit="run", initial=len(cells) - len(todo),
                                                total=len(cells)):
        run_dir = out / "raw" / run_id(recipe, level, ls, seed)
        args = [f"recipe={recipe}", f"amp.level={level}", f"amp.loss_scale.type={ls}", f"runtime.seed={seed}",
                *budget]
        try:
            m = train(run_dir, args)
        except Interrupted as e:
            e.note = (f"{run_dir.name} stopped; the runs that finished are in {results_file}: run the same command "
                      f"again to continue (the stopped run starts anew)")
            raise
        m["run_dir"] = str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir)
        results["runs"].append(record(recipe, level, ls, seed, m))
        results_file.write_text(json.dumps(results, indent=2))  # after every run: a killed bench resumes here
    write_report(results, out)
    print(f"wrote {out / 'BENCHMARKS.md'}")
    return out


if __name__ == "__main__":
    run(main)
