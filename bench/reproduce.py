"""Reproduce every recipe whose real data is on this machine, and write the table of published numbers.

    python -m bench.reproduce [--data GROUP=PATH ...] [--only RECIPE ...] [--seeds N] [--runs DIR] [--out DIR]
                              [--plan|--table] [--write]
    make reproduce

Every recipe in recipes/ gets a row. Its data group (`override /dataset: ...` in the recipe) is looked for at
the path given with --data (fashion_mnist, mnist, cifar10, imagenet, multi30k, wmt14_en_de; a group it builds
on counts, as multi30k for multi30k_published), else at the recipe's own dataset.path.
Found: the recipe trains with its own settings, once per seed of its plan (PLANS), each run in RUNS/<recipe>-s<seed>
(train.py's run directory; --runs, default runs/reproduce). Resumable: a run with metrics.json is done and
only scored again; a run with checkpoints continues with resume=auto; a killed reproduce picks up there. A run
recorded in reproduce.json but not trained in RUNS (committed from another machine, on earlier code) stays in
the table until this machine trains it again.
Translation recipes are scored with the published protocol of bench/multi30k.py (last checkpoints averaged,
beam search, test split). Not found: the row says so and gives the command that would run it.

It first prints its plan: each run to train with about how long it takes (the recipe's runs recorded here at
its own setting, else its plan's hours), and the total.
Writes OUT/reproduce.json (one record per run, with its test-split curve) and OUT/REPRODUCE.md (the table;
--out, default bench/results/reproduce) with OUT/curves_<family>.png (each model and data set: the test metric
of every run against its step, every precision level at equal steps) after every finished run. With --write,
the table it ends with goes into README.md between its `reproduce` markers, once: the README's "Published
numbers" table comes from here and nowhere else. With --out elsewhere the README is left alone (a scratch
reproduction, say from a worktree, keeps its checkout clean). --plan prints what would run and runs and writes
nothing; --table prints the table from the runs so far and runs nothing, writing it only with --write;
--only RECIPE (repeatable) runs only those recipes (the table keeps every row); --seeds N runs only the first N
seeds of each (one seed of everything first, say; the table keeps every recorded run).
A stop signal (Ctrl-C, SIGTERM) reaches the train.py it runs, which saves; then it exits 130 / 143 with one line.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import json
import re
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from ampzoo.cli import pop_all, pop_flag, pop_option
from ampzoo.compose import compose
from ampzoo.engine import train_run
from ampzoo.engine.checkpoint import CHECKPOINT_NAME, checkpoints
from ampzoo.errors import choices_hint, fail
from ampzoo.interrupt import Interrupted
from ampzoo.machine import machine, machine_kind

ROOT = Path(__file__).resolve().parent.parent
README_BEGIN, README_END = "<!-- reproduce:begin -->", "<!-- reproduce:end -->"
DEFAULT_OUT = ROOT / "bench" / "results" / "reproduce"


# How a reproduction runs a recipe on its real data, fixed before the runs: its seeds (default [1]), the band
# its mean must be within of its O0 sibling's (the metric's unit), and keys it adds to the recipe.
PLANS = {
    "lenet_fashion_o0": {"seeds": [1, 2, 3]},
    "lenet_fashion_o2": {"seeds": [1, 2, 3], "parity": 0.5},
    "lenet_fashion_o3": {"seeds": [1, 2, 3], "parity": 0.5},
    "resnet18_fashion_o0": {"seeds": [1, 2, 3]},
    "resnet18_fashion_o2": {"seeds": [1, 2, 3], "parity": 0.5},
    "resnet18_fashion_o3": {"parity": 0.5},
    # every epoch checkpoint kept, for the val BLEU curve
    # hours: a run's length on a 2-core CPU until one is recorded (docs/benchmarks.md: O0 17,083 s; O2 ~2.3x O0)
    "transformer_tiny_multi30k_o0": {"reproduce_overrides": ["trainer.keep_last=100"], "hours": 4.7},
    "transformer_tiny_multi30k_o2": {"parity": 1.0, "reproduce_overrides": ["trainer.keep_last=100"], "hours": 9},
    # 20 epochs on a 2-core CPU with AVX512-BF16 (docs/benchmarks.md: O2 about 20 minutes an epoch with its
    # evaluation, O0 about 1.8x O2's step); the issue's bar: O2 within 0.3 points of O0
    "resnet34_cifar10_o0": {"hours": 11},
    "resnet34_cifar10_o2": {"parity": 0.3, "hours": 6.5},
    "resnet34_cifar10_o3": {"parity": 0.3, "hours": 6.5},
}


def recipe_card(name: str) -> dict:
    """The recipe's data group, dataset.path default and target block, as Hydra composes the recipe, with its
    reproduction plan (PLANS) in the target block."""
    cfg = compose([f"recipe={name}"])
    target = {"seeds": [1], "parity": None, "reproduce_overrides": [], **OmegaConf.to_container(cfg.target),
              **PLANS.get(name, {})}
    return {"recipe": name, "group": HydraConfig.get().runtime.choices["dataset"], "default_path": cfg.dataset.path,
            "level": str(cfg.amp.level), "target": target, "description": cfg.description}


def data_groups(group: str) -> List[str]:
    """The dataset group and those it builds on (multi30k_published reads multi30k's files): --data names any."""
    conf = ROOT / "conf" / "dataset" / f"{group}.yaml"
    bases = [d for d in OmegaConf.load(conf).get("defaults", []) if isinstance(d, str) and d != "_self_"] \
        if conf.is_file() else []
    return [group] + [g for base in bases for g in data_groups(base)]


def find_data(card: dict, given: Dict[str, str]) -> Optional[str]:
    """The folder of the recipe's data: --data GROUP=PATH, else the recipe's own dataset.path; None: not here."""
    for path in [*(given.get(g) for g in data_groups(card["group"])), card["default_path"]]:
        if path and Path(path).expanduser().is_dir():
            return str(Path(path).expanduser().resolve())
    return None


def train_command(card: dict, data: str, seed: int, run_dir: Path) -> List[str]:
    return train_run.train_command([f"recipe={card['recipe']}", f"dataset.path={data}", f"runtime.seed={seed}",
                                    *card["target"]["reproduce_overrides"]], run_dir)


def run_subprocess(cmd: List[str], log: Path) -> int:
    return train_run.run_logged(cmd, log, cwd=ROOT)


def training_wall_time(run_dir: Path) -> Optional[float]:
    """Seconds of training summed over the run's sessions (a resumed run has several; a session starts at its
    `recipe ...` line in train.log). A session ends at its last log line or at the last checkpoint it wrote,
    whichever is later: a session killed outright (no SIGTERM) logs nothing at its end."""
    train_log = run_dir / "train.log"
    if not train_log.is_file():
        return None
    sessions: List[List[float]] = []
    for line in train_log.read_text().splitlines():
        m = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+)\]", line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000
        if "] - recipe " in line or not sessions:
            sessions.append([t, t])
        sessions[-1][1] = t
    saved = [p.stat().st_mtime for p in checkpoints(run_dir / "checkpoints")]
    starts = [s[0] for s in sessions[1:]] + [float("inf")]
    return round(sum(max([last] + [t for t in saved if first <= t < nxt]) - first
                     for (first, last), nxt in zip(sessions, starts)), 1) if sessions else None


def score(card: dict, run_dir: Path, scorer: Callable) -> dict:
    """The run's number under the recipe's published protocol, with its bookkeeping."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metric = card["target"]["metric"]
    record = {"steps": metrics["steps"], "device": metrics["device"], "amp": metrics["amp"]["setting"],
              "overflow_steps": metrics["amp"]["overflow_steps"], "skipped_steps": metrics["amp"]["skipped_steps"],
              "throughput": metrics.get("samples_per_s"), "throughput_unit": metrics.get("throughput_unit"),
              "wall_time_s": training_wall_time(run_dir) or metrics["wall_time_s"],
              "machine": machine_kind(metrics.get("machine") or machine()),  # trained here, unless it says otherwise
              "commit": metrics.get("commit"), "compute": compute_of(metrics)}
    run_cfg = OmegaConf.load(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else None
    if run_cfg is not None and run_cfg.trainer.get("update_freq", 1) > 1:  # steps count batches
        record["update_freq"] = int(run_cfg.trainer.update_freq)
    if metric.startswith("bleu"):  # the published protocol: averaged checkpoints, beam, test split
        result = scorer(run_dir)
        test = result["averaged_test_2016_flickr"]
        record.update(value=test[metric], val=result["averaged_val"][metric],
                      protocol=f"last {len(result['averaged'])} averaged, beam {result['beam']}")
        if run_cfg is not None and run_cfg.dataset.params.get("lowercase"):  # a lowercase model: the paper's scorer
            record["moses_lc"] = test["bleu_moses_lc"]                     # (its cased score says nothing)
        else:
            record["cased"] = test["bleu"]
    else:
        value = metrics["final"][metric]
        record.update(value=round(100 * value if metric.startswith("top") else value, 2), protocol="final checkpoint",
                      curve=eval_curve(run_dir, metric))
    return record


def compute_of(metrics: dict) -> str:
    """The products a run's low-precision layers trained with, as the table says it (metrics.json's "compute": one
    entry per way the run computed, in order; none in a run from before it was kept)."""
    paths = metrics.get("compute") or []
    names = {"cpu_kernels": "CPU kernels", "mindspore": "MindSpore's kernels", "device": "the device's kernels"}
    return ", then ".join(f"{names.get(p['kernels'], p['kernels'])}, {p['products']} products"
                          + (f" from step {p['from_step']:,}" if i else "") for i, p in enumerate(paths))


def eval_curve(run_dir: Path, metric: str) -> List[List[float]]:
    """[[step, metric], ...]: the run's evaluations on the test split (eval_history.jsonl), kept in the record so
    the curve outlives the run directory; top-1/top-5 in percent."""
    history = run_dir / "eval_history.jsonl"
    if not history.is_file():
        return []
    points = [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
    scale = 100 if metric.startswith("top") else 1
    return [[p["step"], round(scale * p[metric], 2)] for p in points if metric in p]


def plot_curves(rows: List[dict], out: Path) -> List[Path]:
    """One plot per family (a model on one data set at every precision level): the test metric of each recorded
    run against its step, so the levels compare at equal steps. Written to OUT/curves_<family>.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for fam in sorted({family(r["recipe"]) for r in rows}):
        runs = [(r, rec) for r in rows if family(r["recipe"]) == fam
                for rec in r["runs"] + r.get("unfinished", []) if rec.get("curve")]
        if not runs:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for row, rec in runs:
            steps, values = zip(*rec["curve"])
            done = rec in row["runs"]
            ax.plot(steps, values, marker="o", markersize=3, linestyle="-" if done else "--",
                    label=f"{row['recipe']} seed {rec['seed']}"
                    + ("" if done else f" (unfinished, epoch {rec['epoch']})"))
        ax.set_xlabel("step")
        ax.set_ylabel(f"test {runs[0][0]['target']['metric']}")
        ax.set_title(f"{fam}: every precision level at equal steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"curves_{fam}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def multi30k_scorer(run_dir: Path) -> dict:
    result = run_dir / "multi30k_result.json"
    if not result.is_file():
        code = train_run.wait(subprocess.Popen([sys.executable, "-m", "bench.multi30k", str(run_dir)], cwd=ROOT))
        if code != 0:
            raise subprocess.CalledProcessError(code, f"python -m bench.multi30k {run_dir}")
    return json.loads(result.read_text())


def hours(name: str, target: dict, recorded: Dict[str, dict]) -> Optional[float]:
    """About how long one run of a recipe takes: its runs recorded at its own setting (no overrides), else the
    plan's hours (PLANS); None when neither says."""
    times = [rec["wall_time_s"] for run_id, rec in recorded.items()
             if run_id.rsplit("-s", 1)[0] == name and not rec.get("overrides") and rec.get("wall_time_s")]
    return statistics.mean(times) / 3600 if times else target.get("hours")


def reproduce(recipes: List[str], given: Dict[str, str], runs: Path, out: Path, plan_only: bool = False,
              runner: Callable = run_subprocess, scorer: Callable = multi30k_scorer,
              readme: Optional[Path] = None, only: Optional[List[str]] = None,
              max_seeds: Optional[int] = None, write: bool = True) -> dict:
    """Rows for every recipe in `recipes`; runs (and scores) those in `only` (default: all) whose data is here,
    each at its first `max_seeds` seeds (default: all of its plan's seeds). Prints the plan, with hours, first.
    write=False (and plan_only): nothing is written; `readme`: the README whose table is replaced, once, by the
    table this call ends with."""
    write = write and not plan_only
    if write:
        out.mkdir(parents=True, exist_ok=True)
    results_file = out / "reproduce.json"
    results = read_results(results_file)
    rows = [recipe_row(name, given, runs, results) for name in recipes]
    # seed-major: every recipe's first seed before any second one, so a stopped reproduce already compares
    # the precision levels
    todo = [(row, seed) for i in range(max(len(r["seeds"]) for r in rows))
            for row in rows if row["data"] is not None and i < len(row["seeds"]) for seed in [row["seeds"][i]]]
    print_plan([(row, seed) for row, seed in todo if not recorded(results, row, seed, runs)
                and asked(row, seed, only, max_seeds)
                and not (runs / f"{row['recipe']}-s{seed}" / "metrics.json").is_file()], results, plan_only)
    for row, seed in todo:
        before = results["runs"].get(f"{row['recipe']}-s{seed}")
        if recorded(results, row, seed, runs):
            row["runs"].append(before)
            continue
        record = run_and_score(row, seed, runs, runner, scorer, plan_only) if asked(row, seed, only, max_seeds) \
            else None
        if record is None:  # not asked for, planned only or not finished: a run trained elsewhere (on earlier code)
            if before is not None and before.get("data") == row["data"]:  # stays in the table, its notes naming its
                row["runs"].append(before)  # machine, until this machine trains it again
            continue
        row["runs"].append(record)
        row["unfinished"] = [rec for rec in row["unfinished"] if rec["run"] != record["run"]]
        if write:
            results = save_record(results_file, record)
            publish(rows, out)  # the table as it stands after every finished run
    if write:
        keep_unfinished(results_file, rows)
    for row in rows:
        row["runs"].sort(key=lambda r: r["seed"])
    table = publish(rows, out) if write else render(rows)
    if write and readme is not None:
        write_readme(table, readme)
    return {"rows": rows, "table": table}


def read_results(results_file: Path) -> dict:
    return json.loads(results_file.read_text()) if results_file.is_file() else {"runs": {}}


def recipe_row(name: str, given: Dict[str, str], runs: Path, results: dict) -> dict:
    """A recipe's row: its card, where its data is (None: not here), its recorded runs (from elsewhere, when its
    data is not here) and its unfinished ones (live here, or recorded when their machine is gone)."""
    card = recipe_card(name)
    seeds = card["target"]["seeds"]
    live = unfinished(runs, name, seeds, card["target"]["metric"])
    gone = [dict(rec, live=False) for run_id, rec in results.get("unfinished", {}).items()  # machine gone
            if run_id.rsplit("-s", 1)[0] == name and run_id not in live and run_id not in results["runs"]]
    data = find_data(card, given)
    return {**card, "data": data, "seeds": seeds, "unfinished": list(live.values()) + gone,
            "runs": [] if data else [results["runs"][f"{name}-s{s}"] for s in seeds  # recorded elsewhere
                                     if f"{name}-s{s}" in results["runs"]],
            "started": any((runs / f"{name}-s{seed}").exists() for seed in seeds)}


def recorded(results: dict, row: dict, seed: int, runs: Path) -> bool:
    """Whether a run of the row's recipe at `seed` on its data is recorded in reproduce.json and was trained here,
    in RUNS: a record committed from another machine (or older code) is in the table, but reproduce trains the
    run again on today's code."""
    run_id = f"{row['recipe']}-s{seed}"
    return (results["runs"].get(run_id, {}).get("data") == row["data"]
            and (runs / run_id / "metrics.json").is_file())


def asked(row: dict, seed: int, only: Optional[List[str]], max_seeds: Optional[int]) -> bool:
    """Whether --only and --seeds ask for this run."""
    return (only is None or row["recipe"] in only) and not (max_seeds and row["seeds"].index(seed) >= max_seeds)


def print_plan(to_train: List[Tuple[dict, int]], results: dict, plan_only: bool) -> None:
    """Each run to train with about how long it takes, and the total."""
    plan_hours = [hours(row["recipe"], row["target"], results["runs"]) for row, _ in to_train]
    for (row, seed), h in zip(to_train, plan_hours):
        print(f"plan: {row['recipe']} seed {seed}: " + (f"about {h:.1f} h" if h is not None else "time unknown (no "
              "run of it recorded)"), flush=True)
    known = [h for h in plan_hours if h is not None]
    print(f"plan: {len(to_train)} runs to train, about {sum(known):.0f} hours on a 2-core CPU machine like this "
          f"project's" + (f" plus {len(to_train) - len(known)} of unknown time" if len(known) < len(to_train) else "")
          + ("" if plan_only else "; a killed reproduce continues where it stopped"), flush=True)


def run_and_score(row: dict, seed: int, runs: Path, runner: Callable, scorer: Callable,
                  plan_only: bool) -> Optional[dict]:
    """One run of a recipe trained (or continued) to its end and scored: its record, or None when it did not
    finish, was not run (plan_only) or could not be scored (the line says why; the run is kept)."""
    run_id, run_dir = f"{row['recipe']}-s{seed}", runs / f"{row['recipe']}-s{seed}"
    if not (run_dir / "metrics.json").is_file() and not train_one(row, seed, run_dir, runner, plan_only):
        return None
    if plan_only:  # finished but not scored yet: scoring decodes, and --plan runs nothing
        return None
    try:
        return {"run": run_id, "seed": seed, "data": row["data"], "run_dir": str(run_dir),
                **score(row, run_dir, scorer)}
    except subprocess.CalledProcessError as e:  # the scorer's own output says why; the run is kept
        print(f"{run_id}: scoring failed ({e.cmd} exited {e.returncode}); the run is finished and kept: run "
              f"bench.reproduce again to score it", flush=True)
        return None
    except Interrupted as e:  # not "nothing was written": the run is trained, and earlier runs are recorded
        e.note = f"{run_id} is trained and kept, its scoring stopped; run the same command again to score it"
        raise


def train_one(row: dict, seed: int, run_dir: Path, runner: Callable, plan_only: bool) -> bool:
    """train.py on the row's recipe at `seed` into run_dir (resumed if it holds a checkpoint); whether it
    finished. plan_only: the command is printed, and nothing runs."""
    run_id = run_dir.name
    cmd = train_command(row, row["data"], seed, run_dir)
    print(("would run: " if plan_only else "running: ") + " ".join(cmd[1:]), flush=True)
    if plan_only:
        return False
    run_dir.mkdir(parents=True, exist_ok=True)
    row["started"] = True
    try:
        code = runner(cmd, run_dir.parent / f"{run_id}.out")
    except Interrupted as e:  # the signal came to reproduce and was passed on to the run, which saved
        e.note = (f"{run_id} stopped (train.py's last line in {run_dir.parent / f'{run_id}.out'} says what "
                  f"it saved); run the same command again to continue it")
        raise
    if code != 0 or not (run_dir / "metrics.json").is_file():
        print(f"{run_id}: train.py exited {code} before finishing (see {run_dir.parent}/{run_id}.out); "
              f"run bench.reproduce again to continue it", flush=True)
        return False
    return True


def save_record(results_file: Path, record: dict) -> dict:
    """A finished run's record into reproduce.json, read again first: another reproduce (say --only another
    recipe) may have recorded a run since. Returns what reproduce.json now holds."""
    results = read_results(results_file)
    results["runs"][record["run"]] = record
    results.get("unfinished", {}).pop(record["run"], None)
    results_file.write_text(json.dumps(results, indent=2))
    return results


def keep_unfinished(results_file: Path, rows: List[dict]) -> None:
    """Where the unfinished runs stand, kept in reproduce.json beside the finished ones (those of recipes this
    call did not look at too)."""
    recorded_ = read_results(results_file)
    shown = {row["recipe"] for row in rows}
    kept = {run_id: rec for run_id, rec in recorded_.get("unfinished", {}).items()
            if run_id.rsplit("-s", 1)[0] not in shown}  # recipes this call did not look at
    for rec in (rec for row in rows for rec in row["unfinished"] if rec["run"] not in recorded_["runs"]):
        kept[rec["run"]] = {k: v for k, v in rec.items() if k != "live"}
    recorded_["unfinished"] = kept
    results_file.write_text(json.dumps(recorded_, indent=2))


def publish(rows: List[dict], out: Path) -> str:
    """OUT/REPRODUCE.md (the table and its curves) as the rows stand; returns the table."""
    for row in rows:
        row["runs"].sort(key=lambda r: r["seed"])
    table = render(rows)
    curves = plot_curves(rows, out)
    (out / "REPRODUCE.md").write_text(table + "".join(f"\n![{p.stem}]({p.name})\n" for p in curves))
    return table


def unfinished(runs: Path, name: str, seeds: List[int], metric: str) -> Dict[str, dict]:
    """Where each unfinished run of a recipe stands, read from its run directory: newest checkpoint, test curve
    so far and, for translation, val BLEU if scored. Kept in reproduce.json, so a run that dies with its machine
    still shows how far it got, and its curve still compares with the other precision levels."""
    found, cpu = {}, None
    for seed in seeds:
        run_dir = runs / f"{name}-s{seed}"
        saved = checkpoints(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else []
        if not saved or (run_dir / "metrics.json").is_file():
            continue
        epoch, step = map(int, CHECKPOINT_NAME.fullmatch(saved[-1].name).groups())
        cpu = cpu or machine_kind(machine())
        record = {"run": f"{name}-s{seed}", "seed": seed, "epoch": epoch, "step": step,
                  "curve": eval_curve(run_dir, metric), "machine": cpu,
                  "updated": datetime.fromtimestamp(saved[-1].stat().st_mtime).strftime("%Y-%m-%d %H:%M")}
        bleu = run_dir / "multi30k_curve.json"
        if bleu.is_file():
            scored = json.loads(bleu.read_text())
            last = max(scored, key=int)
            record["val_bleu"] = [int(last), round(scored[last]["bleu_lowercase"], 1)]
        found[record["run"]] = record
    return found


def progress(row: dict) -> str:
    """A row's unfinished runs in words: a live one (its run directory is here) continues with `make reproduce`;
    a recorded one whose run directory went with its machine starts anew."""
    notes = []
    for rec in sorted(row["unfinished"], key=lambda r: r["seed"]):
        note = f"seed {rec['seed']}: epoch {rec['epoch']}, step {rec['step']:,}"
        if rec.get("curve"):
            step, value = rec["curve"][-1]
            note += f", test {row['target']['metric']} {value:.2f} at step {step:,}"
        if rec.get("val_bleu"):
            note += f" (val BLEU {rec['val_bleu'][1]:.1f} lowercased at epoch {rec['val_bleu'][0]}, greedy)"
        if rec.get("live", True):
            note += " (`make reproduce` continues it)"
        else:
            note += (f" when it stopped on {rec['updated']} ({rec['machine']}); its run directory is not on this "
                     f"machine, so `make reproduce` starts it anew")
        notes.append(note)
    return "unfinished: " + "; ".join(notes)


def family(name: str) -> str:
    return re.sub(r"_o\d$", "", name)


def shown_path(path: Optional[str]) -> Optional[str]:
    """A data path as the README shows it: relative to the repository's parent when it lies there."""
    if path is None or not path.startswith(str(ROOT.parent)):
        return path
    return str(Path("..") / Path(path).relative_to(ROOT.parent))


def one_machine(runs: List[dict]) -> Optional[str]:
    """The CPU a recipe's runs trained on, if one and recorded: times and throughputs compare only on one kind
    of machine (a project's machines may change kind between sessions)."""
    kinds = {x.get("machine") for x in runs}
    return kinds.pop() if len(kinds) == 1 else None


def render(rows: List[dict]) -> str:
    """Markdown: a table of the recipes whose data is here (with parity against the O0 sibling where there is
    one), a table of those whose data is not (with the command that would run each), and the published
    settings and sources the rows cite by number. A run recorded with `overrides` trained before its recipe
    changed: the row names them, and compares with O0 only when O0 trained with the same."""
    stats = {r["recipe"]: {"mean": statistics.mean(x["value"] for x in r["runs"]),
                           "speed": statistics.mean(x["throughput"] or 0 for x in r["runs"]),
                           "machine": one_machine(r["runs"]), "settings": r["runs"][0].get("overrides", [])}
             for r in rows if r["runs"]}
    sources: List[str] = []  # one per published setting and source, cited by number
    here = ["| recipe | published | reproduced here | seeds | training time | device, notes |",
            "|---|---|---|---|---|---|"]
    absent: Dict[str, List[tuple]] = {}  # data group -> (recipe, published), one row a group
    for r in sorted(rows, key=lambda r: r["data"] is None and not r["runs"]):  # sources numbered as shown
        head = f"| `{r['recipe']}` | {published(r['target'], sources)} "
        if r["data"] is None and not r["runs"]:  # its recorded runs show even where its data is not
            absent.setdefault(r["group"], []).append((r["recipe"], published(r["target"], sources)))
        elif not r["runs"]:
            state = progress(r) if r.get("unfinished") else "not finished yet (`make reproduce` continues it)"
            if not r.get("started", True) and not r.get("unfinished"):
                state = "not run yet (`make reproduce` runs it)"
            here.append(head + f"| {state} | - | - | - |")
        else:
            here.append(head + reproduced(r, stats))
    found = sorted({(r["group"], shown_path(r["data"])) for r in rows if r["data"] is not None})
    parts = ["\n".join(here) + "\n"]
    if found:
        parts.append("Data here: " + "; ".join(f"{group} in `{path}`" for group, path in found) + ".\n")
    if absent:
        lines = ["| recipes | published | data | run them with |", "|---|---|---|---|"]
        for group, recipes in absent.items():
            cites = " / ".join(dict.fromkeys(cite for _, cite in recipes))
            lines.append(f"| {', '.join(f'`{name}`' for name, _ in recipes)} | {cites} | not found ({group}) | "
                         f"`python -m bench.reproduce --data {group}=PATH` (`--only RECIPE` for one) |")
        parts.append("Not run here, for want of their data:\n\n" + "\n".join(lines) + "\n")
    if sources:
        parts.append("Published settings and sources:\n\n"
                     + "\n".join(f"{i}. {s}" for i, s in enumerate(sources, 1)) + "\n")
    return "\n".join(parts)


def published(target: dict, sources: List[str]) -> str:
    """The published number of a recipe's card, citing its setting and source by number in `sources`."""
    if target.get("published") is None:
        return "none published"
    cited = (f"{target['published']} {target['metric']}: {target.get('published_setting') or '-'}; "
             f"{target.get('source') or '-'}")
    if cited not in sources:
        sources.append(cited)
    return f"{target['published']} {target['metric']} [{sources.index(cited) + 1}]"


def reproduced(r: dict, stats: Dict[str, dict]) -> str:
    """The rest of a row with recorded runs: the mean (± spread, each run), seeds, time a run, and notes."""
    runs, mine = r["runs"], stats[r["recipe"]]
    values = [x["value"] for x in runs]
    ours = f"**{statistics.mean(values):.2f}**" + (f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else "")
    ours += f" ({', '.join(f'{v:.2f}' for v in values)})" if len(values) > 1 else ""
    if "moses_lc" in runs[0]:
        ours += f"; paper's scorer {statistics.mean(x['moses_lc'] for x in runs):.2f}"
    elif "cased" in runs[0]:
        ours += f"; cased {statistics.mean(x['cased'] for x in runs):.2f}"
    if "val" in runs[0]:
        ours += f", val {statistics.mean(x['val'] for x in runs):.2f}"
    minutes = sum(x["wall_time_s"] for x in runs) / len(runs) / 60
    rate = f", {mine['speed']:,.0f} {runs[0].get('throughput_unit') or 'samples'}/s" if mine["speed"] else ""
    return f"| {ours} | {len(runs)} | {minutes:.0f} min a run{rate} | {'; '.join(notes(r, stats))} |"


def notes(r: dict, stats: Dict[str, dict]) -> List[str]:
    """A row's notes: device and setting, overflows, progress, and how it compares with its O0 sibling."""
    runs, mine, cpu = r["runs"], stats[r["recipe"]], stats[r["recipe"]]["machine"]
    compute = runs[0].get("compute") or "compute path not recorded (trained before 2026-12-07)"
    out = [runs[0]["device"] + (f" ({cpu})" if cpu else ""), runs[0]["amp"], compute, runs[0]["protocol"],
           f"{runs[0]['steps']:,} steps" + (f" ({runs[0]['steps'] // runs[0]['update_freq']:,} updates of "
                                            f"{runs[0]['update_freq']})" if runs[0].get("update_freq") else "")]
    if r["level"] != "O0":
        overflowed = sum(x['overflow_steps'] for x in runs)
        out.append(f"{overflowed} overflowed step{'' if overflowed == 1 else 's'}")
    if r.get("unfinished"):
        out.append(progress(r))
    if runs[0].get("overrides"):  # trained before the recipe changed: what the recipe would need to match
        out.append("trained with " + " ".join(runs[0]["overrides"]))
    sibling = stats.get(family(r["recipe"]) + "_o0")
    if sibling is None or sibling is mine:
        return out
    if sibling["settings"] != mine["settings"]:
        return out + ["not compared with O0: trained at another setting"]
    delta, tol = mine["mean"] - sibling["mean"], r["target"]["parity"]
    verdict = "" if tol is None else (f", within ±{tol}" if abs(delta) <= tol else f", OUTSIDE ±{tol}")
    return out + [f"{delta:+.2f} vs O0{verdict}; " + (
        f"{mine['speed'] / sibling['speed']:.2f}x O0's throughput" if cpu and cpu == sibling["machine"]
        else "throughput not compared: O0 trained on another machine")]


def write_readme(table: str, readme: Path) -> bool:
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        return False
    head, rest = text.split(README_BEGIN, 1)
    readme.write_text(head + README_BEGIN + "\n" + table + rest[rest.index(README_END):])
    return True


def data_option(value: str) -> Tuple[str, str]:
    """`--data GROUP=PATH` (where a dataset group's data is on this machine) as (group, path)."""
    if "=" not in value:
        fail(f"--data {value!r}: give GROUP=PATH, GROUP one of the dataset groups in conf/dataset/")
    group, path = value.split("=", 1)
    if not (ROOT / "conf" / "dataset" / f"{group}.yaml").is_file():
        groups = [p.stem for p in (ROOT / "conf" / "dataset").glob("*.yaml")]
        fail(f"--data {group}=...: {group!r} is not a dataset group; " + choices_hint(group, groups))
    if not Path(path).expanduser().is_dir():  # a mistyped path: its data would silently count as not here
        fail(f"--data {group}={path}: {'a file' if Path(path).expanduser().exists() else 'no such folder'}; give the "
             f"folder that holds the {group} files")
    return group, path


def parse(argv: List[str]):
    all_recipes = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    plan, argv = pop_flag(argv, "--plan")
    table_only, argv = pop_flag(argv, "--table")  # run nothing: the table from the runs recorded so far
    write, argv = pop_flag(argv, "--write")  # --plan/--table write files only when asked; README.md only with it
    data, argv = pop_all(argv, "--data")
    only, argv = pop_all(argv, "--only")
    seeds, argv = pop_option(argv, "--seeds", None, str)
    runs, argv = pop_option(argv, "--runs", ROOT / "runs" / "reproduce", Path)
    out, argv = pop_option(argv, "--out", DEFAULT_OUT, Path)
    if argv:
        fail(f"unknown argument {argv[0]!r}; valid: --data GROUP=PATH, --only RECIPE, --seeds N, --runs DIR, "
             f"--out DIR, --plan, --table, --write")
    given = dict(data_option(value) for value in data)
    if seeds is not None and (not seeds.isdigit() or int(seeds) < 1):
        fail(f"--seeds {seeds!r}: give how many of each recipe's seeds to run, a whole number >= 1")
    for name in only:
        if name not in all_recipes:
            fail(f"--only {name!r} is not a recipe; " + choices_hint(name, all_recipes))
    readme = ROOT / "README.md" if write and out.resolve() == DEFAULT_OUT.resolve() else None  # its table is OUT's
    return (all_recipes, given, runs.resolve(), out, plan, [] if table_only else (only or None),
            None if seeds is None else int(seeds), readme, write or not (plan or table_only))


def main(argv: List[str]) -> None:
    recipes, given, runs, out, plan, only, max_seeds, readme, write = parse(argv)
    print(reproduce(recipes, given, runs, out, plan, readme=readme, only=only, max_seeds=max_seeds,
                    write=write)["table"])
    asked = recipes if only is None else only  # --table (only=[]) trains nothing by design
    missing = [name for name in asked if find_data(recipe_card(name), given) is None]
    if missing and (only or len(missing) == len(recipes)):  # a command that reproduced nothing does not say it did
        groups = sorted({recipe_card(name)["group"] for name in missing})
        fail(f"not reproduced, for want of its data: {', '.join(missing)}; give "
             f"{' '.join(f'--data {g}=PATH' for g in groups)}", code=1)


if __name__ == "__main__":
    run(main)
