"""Precision-policy search: the most low precision a recipe takes within a tolerance of O0 (fp32).

    python -m amp.search recipe=NAME [search.tolerance=0.5] [search.seeds=[1,2]] [search.budget_epochs=N]
        [search.budget_steps=N] [search.metric=top1] [search.pin_fp32=[...]] [search.pin_low=[...]]
        [search.out=DIR] [key=value ...]

1. Evidence: amp.audit runs one real training batch with every Cell in low precision (O3) and measures each
   compute unit (Conv2d, Dense, LayerNorm, Softmax, BatchMatMul, ...): overflow, float constants that vanish,
   local error against fp32, underflow.
2. Ranking: overflow first, then vanishing constants, local error above the audit's tolerance, underflow;
   within each, by local error. Units that only select or move values (ReLU, max-pooling, Flatten, Dropout)
   are not candidates: low precision costs them nothing beyond their input's rounding. Neither are pinned
   ones: search.pin_fp32 (always fp32) and search.pin_low (never), Cell classes or sub-module paths.
3. Candidates: candidate k runs the first k ranked units (and the pinned ones) in fp32 and everything else in
   low precision (amp.level=O3 with that keep-list, the recipe's loss scale). Strategy: bisection for the
   smallest k within tolerance, assuming that keeping more in fp32 does not hurt. It trains k=0 (O3), k=n
   (every candidate fp32), then about log2(n) more, where a linear scan would train up to n: every candidate
   is a full training run at the budget, and the ranking puts the risky units first.
4. Judging: every candidate trains with train.py like the O0 reference: the same seeds (so the same initial
   weights and batches), data and budget, fallback off. Its metric is compared with O0's seed by seed; the
   mean difference must not be worse than search.tolerance. A candidate that diverges (non-finite weights, or
   overflow at the minimum dynamic scale) is rejected whatever its metric; overflowed steps are counted.
5. Output, in search.out (default runs/search/RECIPE): search.json (every training run), result.json (the
   evidence, candidates and winner), SEARCH.md (the table),
   search.png (metric against low-precision share), RECIPE_searched.yaml (the recipe with the winning policy:
   copy it into recipes/ to use it), and the override line.
weights=NAME (a shipped weight) instead of recipe=: its own recipe and overrides, as eval.py takes them, and
every training run starts from the weight.
Resumable: each training run is a train.py run directory (runs/o0-s1, runs/keep-<hash>-s1) continued with
resume=auto; finished ones are read, not trained again. The search judges accuracy, not speed: it maximises the
share of low precision, which pays on Ascend and GPU, and on a CPU where the project's kernels multiply in bf16.
"""
import hashlib
import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mindspore as ms
from omegaconf import OmegaConf

from amp.audit.command import audit
from ampzoo.amp.ranking import Candidate, Unit, bisect, candidate, matching, rank
from ampzoo.data import create_dataset, task
from ampzoo.engine import train_run
from ampzoo.engine.load import load_config
from ampzoo.engine.rundir import claim
from ampzoo.engine.weights import search_argv
from ampzoo.errors import ConfigError, fail
from ampzoo.interrupt import Interrupted
from ampzoo.paths import check_writable
from ampzoo.runtime import set_context
from ampzoo.engine.network import build_model

METRICS = {"top1": 100.0, "top5": 100.0, "loss": -1.0, "bleu": 1.0, "bleu_lowercase": 1.0}  # reported unit, sign
SET_BY_SEARCH = {  # keys the search sets for every run -> what to give instead
    "amp.level": "search.pin_fp32 / search.pin_low", "amp.keep_fp32": "search.pin_fp32 / search.pin_low",
    "amp.force_fp16": "search.pin_low", "amp.fallback.enabled": "nothing (the search judges divergence itself)",
    "runtime.seed": "search.seeds", "hydra.run.dir": "search.out", "resume": "nothing (a search always resumes)",
    "trainer.max_steps": "search.budget_steps", "trainer.epochs": "search.budget_epochs"}

# --- evidence and ranking -------------------------------------------------------------------------------------

def evidence(cfg) -> Tuple[List[Unit], dict]:
    """amp.audit on one training batch at O3: every compute unit with its flags, parameters and FLOPs."""
    ms.set_seed(cfg.runtime.seed)
    batch = next(create_dataset(cfg.dataset, "train").create_tuple_iterator())
    o3 = OmegaConf.merge(cfg.amp, {"level": "O3", "keep_fp32": [], "force_fp16": []})
    result = audit(lambda: build_model(cfg), o3, batch[:-1])
    units = [Unit(r["path"], r["class"], r["params"], r["flops"], r["flags"], r["local_rel_err"])
             for r in result["cells"]]
    return units, result


# --- training runs --------------------------------------------------------------------------------------------

def run_name(keep_fp32: Optional[List[str]], seed: int) -> str:
    """A run is named by the keep-list it trains with: the same policy is never trained twice."""
    if keep_fp32 is None:
        return f"o0-s{seed}"
    return f"keep-{hashlib.sha1(','.join(sorted(keep_fp32)).encode()).hexdigest()[:10]}-s{seed}"


def run_train(cmd: List[str], log: Path) -> Tuple[int, Optional[str]]:
    """train.py's exit code and its `error:` line (None: it crashed without one), from this run of it."""
    start = log.stat().st_size if log.is_file() else 0
    code = train_run.run_logged(cmd, log)  # the user's directory: relative paths in overrides hold
    with open(log) as f:
        f.seek(start)
        errors = [ln for ln in f.read().splitlines() if ln.startswith("error: ")]
    return code, errors[-1][7:] if errors else None


def read_run(run_dir: Path, metric: str) -> dict:
    m = json.loads((run_dir / "metrics.json").read_text())
    amp = m["amp"]
    return {"status": "finished", "metric": m["final"][metric], "overflow_steps": amp.get("overflow_steps", 0),
            "skipped_steps": amp.get("skipped_steps", 0), "steps": m["steps"], "wall_time_s": m["wall_time_s"]}


class Runs:
    """Training runs of one search directory, each trained once: search.json remembers what finished."""

    def __init__(self, out: Path, base: List[str], metric: str):
        self.out, self.base, self.metric = out, base, metric
        self.file = out / "search.json"
        self.state = json.loads(self.file.read_text()) if self.file.is_file() else {"runs": {}}
        self.trained = 0  # runs trained (or continued) by this call

    def get(self, kept: Optional[List[str]], seed: int, keep_fp32: Optional[List[str]] = None) -> dict:
        """The run of the O0 reference (kept None) or of a candidate: the units `kept` in fp32, trained with
        the keep-list `keep_fp32` that the search writes out for them (so what is judged is what is written)."""
        name = run_name(None if kept is None else keep_fp32, seed)
        done = self.state["runs"].get(name)
        if done and done["status"] in ("finished", "diverged"):
            return done
        run_dir = self.out / "runs" / name
        if (run_dir / "metrics.json").is_file():  # finished before the search recorded it
            record = read_run(run_dir, self.metric)
        else:
            policy = (["amp.level=O0", "amp.keep_fp32=null", "amp.loss_scale.type=none"] if kept is None else
                      ["amp.level=O3", f"amp.keep_fp32=[{','.join(keep_fp32)}]"])
            run_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            cmd = train_run.train_command([*self.base, *policy, "amp.fallback.enabled=false", f"runtime.seed={seed}"],
                                          run_dir)
            again = (f"{name} stopped and saved; the runs that finished are in {self.file}: run the same command "
                     f"again to continue the search")
            try:
                code, error = run_train(cmd, self.out / "runs" / f"{name}.log")
            except Interrupted as e:  # the signal came to the search (and was passed on to the run)
                e.note = again
                raise
            self.trained += 1
            if code == 0 and (run_dir / "metrics.json").is_file():
                record = read_run(run_dir, self.metric)
            elif code in train_run.INTERRUPTED:  # stopped by a signal: it saved, and the next call continues it
                raise Interrupted(signal.SIGTERM if code in (143, -15) else signal.SIGINT, again)
            elif code == 1 and error:  # train.py's divergence exit: the run is over, its policy rejected
                record = {"status": "diverged", "reason": error, "wall_time_s": round(time.perf_counter() - t0, 1)}
            else:  # a bad setting (exit 2) or a crash: nothing to judge, nothing recorded
                raise ConfigError(f"train.py failed for {name}: {error or f'exit code {code}, no error line'} "
                                  f"(see {self.out / 'runs' / f'{name}.log'})")
        record.update({"kept": kept, "keep_fp32": keep_fp32, "seed": seed})
        self.state["runs"][name] = record
        self.file.write_text(json.dumps(self.state, indent=2))
        return record


# --- the search -----------------------------------------------------------------------------------------------

def judge(c: Candidate, runs: Runs, seeds: List[int], reference: Dict[int, dict], scale: float, tol: float) -> None:
    for seed in seeds:
        c.runs[str(seed)] = runs.get(c.kept, seed, c.keep_fp32)
        if c.runs[str(seed)]["status"] == "diverged":
            c.verdict, c.reason = "diverged", f"seed {seed}: {c.runs[str(seed)]['reason']}"
            return
    deltas = [(c.runs[str(s)]["metric"] - reference[s]["metric"]) * scale for s in seeds]
    c.delta = sum(deltas) / len(deltas)
    c.verdict = "within" if c.delta >= -tol else "outside"


def search(cfg, base: List[str], out: Path, log=print) -> dict:
    s = cfg.search
    metric = s.metric or cfg.target.metric
    scale = METRICS[metric]
    t0 = time.perf_counter()
    units, audit_result = evidence(cfg)
    net = build_model(cfg)
    pinned = matching(s.pin_fp32, units, net, "search.pin_fp32")
    never = set(matching(s.pin_low, units, net, "search.pin_low"))
    both = sorted(set(pinned) & never)
    if both:
        raise ConfigError(f"{', '.join(both)} is pinned both fp32 (search.pin_fp32) and low (search.pin_low)")
    ranked = [u for u in rank(units) if u.path not in pinned and u.path not in never]
    audit_s = time.perf_counter() - t0
    shown = [u.path + (" (" + ",".join(u.flags) + ")" if u.flags else "") for u in ranked[:12]]
    log(f"{len(units)} compute units, {len(ranked)} candidates for fp32 in this order: {', '.join(shown)}"
        + (", ..." if len(ranked) > 12 else ""))

    runs = Runs(out, base, metric)
    reference = {seed: runs.get(None, seed) for seed in s.seeds}
    for seed, r in reference.items():
        if r["status"] != "finished":
            raise ConfigError(f"the O0 reference diverged at seed {seed}: {r['reason']}; fix the recipe first")
    values = ", ".join(f"{r['metric'] * abs(scale):.2f}" for r in reference.values())
    log(f"O0 reference: {metric} {values} (seeds {', '.join(map(str, s.seeds))})")
    tried: Dict[int, Candidate] = {}

    def passes(k: int) -> bool:
        if k not in tried:
            c = candidate(k, ranked, pinned, units, net)
            judge(c, runs, list(s.seeds), reference, scale, s.tolerance)
            tried[k] = c
            log(f"k={k}: fp32 [{', '.join(c.keep_fp32)}], {c.low_flops:.1%} of FLOPs low: {c.verdict}"
                + (f" ({c.delta:+.2f})" if c.delta is not None else f" ({c.reason})"))
        return tried[k].verdict == "within"

    best = bisect(len(ranked), passes)
    undecided = None if best is None else inconclusive(tried, best, reference, scale, s, cfg)
    if undecided:
        log(undecided)
    result = {"recipe": cfg.recipe_name, "metric": metric, "tolerance": s.tolerance, "seeds": list(s.seeds),
              "strategy": "bisection over the ranked units", "units": [asdict(u) for u in units],
              "ranked": [u.path for u in ranked], "pinned_fp32": pinned, "pinned_low": sorted(never),
              "reference": {str(k): v for k, v in reference.items()},
              "candidates": [asdict(tried[k]) for k in sorted(tried)], "winner": None if undecided else best,
              "inconclusive": undecided, "best_within": best,
              "audit": audit_result, "audit_s": round(audit_s, 1),
              "cost": {"runs": len(runs.state["runs"]), "trained_now": runs.trained,
                       "train_wall_s": round(sum(r.get("wall_time_s", 0) for r in runs.state["runs"].values()), 1),
                       "search_wall_s_now": round(time.perf_counter() - t0, 1)}}
    return result


def inconclusive(tried: Dict[int, Candidate], best: int, reference: Dict[int, dict], scale: float, s,
                 cfg) -> Optional[str]:
    """Why this budget cannot tell the candidates apart, and what budget would; None when it can: O0's seeds
    agree within the tolerance (two seeds or more measure the noise), or every candidate the winner beat
    diverged (a divergence is no noise)."""
    rivals = [c for k, c in tried.items() if k != best and c.verdict != "within"]
    if rivals and all(c.verdict == "diverged" for c in rivals):
        return None
    now = (f"search.budget_steps={s.budget_steps}" if s.budget_steps else
           f"search.budget_epochs={s.budget_epochs or cfg.trainer.epochs}")
    more = (f"search.budget_steps={2 * s.budget_steps}" if s.budget_steps else
            f"search.budget_epochs={2 * (s.budget_epochs or cfg.trainer.epochs)}")
    values = [r["metric"] * abs(scale) for r in reference.values()]
    if len(values) < 2:
        return (f"Not conclusive: k={best} is within {s.tolerance:g} of O0, but one seed cannot measure this "
                f"budget's run-to-run noise; give search.seeds=[1,2] and a budget at which O0's seeds agree within "
                f"the tolerance (this one: {now})")
    if spread(values) > s.tolerance:
        return (f"Not conclusive: O0's own seeds differ by std {spread(values):.2f}, more than the tolerance "
                f"{s.tolerance:g}, so {now} cannot tell candidates apart; give a budget at which they agree within it "
                f"(at least {more}, or the recipe's full schedule)")
    return None


# --- output ---------------------------------------------------------------------------------------------------

def spread(values: List[float]) -> float:
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)) ** 0.5


def to_markdown(result: dict) -> str:
    scale = abs(METRICS[result["metric"]])
    ref = [r["metric"] * scale for r in result["reference"].values()]
    lines = [f"# amp.search: {result['recipe']}", "",
             f"Metric {result['metric']}, tolerance {result['tolerance']:g}, seeds {result['seeds']}. "
             f"Strategy: {result['strategy']}.", "",
             "| k | fp32 keep-list | low-precision params | low-precision FLOPs | "
             f"{result['metric']} per seed | delta to O0 | overflowed / skipped steps | time | verdict |",
             "|---:|---|---:|---:|---|---:|---:|---:|---|",
             f"| O0 | everything | 0% | 0% | {', '.join(f'{v:.2f}' for v in ref)} | - | - | "
             f"{sum(r['wall_time_s'] for r in result['reference'].values()):.0f} s | reference |"]
    for c in result["candidates"]:
        runs = c["runs"].values()
        per_seed = ", ".join(f"{r['metric'] * scale:.2f}" if r["status"] == "finished" else "diverged" for r in runs)
        overflow = f"{sum(r.get('overflow_steps', 0) for r in runs)} / {sum(r.get('skipped_steps', 0) for r in runs)}"
        wall = sum(r.get("wall_time_s", 0) for r in runs)
        delta = "-" if c["delta"] is None else f"{c['delta']:+.2f}"
        lines.append(f"| {c['k']} | {', '.join(c['keep_fp32']) or '(none)'} | {c['low_params']:.1%} | "
                     f"{c['low_flops']:.1%} | {per_seed} | {delta} | {overflow} | {wall:.0f} s | {c['verdict']} |")
    lines += ["", winner_line(result)]
    lines.append(f"Cost: {result['cost']['runs']} training runs, {result['cost']['train_wall_s']:.0f} s of training "
                 f"in all; this call trained {result['cost']['trained_now']} of them in "
                 f"{result['cost']['search_wall_s_now']:.0f} s (audit {result['audit_s']:.0f} s).")
    return "\n".join(lines) + "\n"


def winning(result: dict) -> Optional[dict]:
    return next((c for c in result["candidates"] if c["k"] == result["winner"]), None)


def winner_line(result: dict) -> str:
    c = winning(result)
    if c is None and result.get("inconclusive"):
        return result["inconclusive"]
    if c is None:
        return (f"No candidate is within {result['tolerance']:g} of O0, not even with every candidate unit in fp32: "
                f"what stays low (search.pin_low, the value-moving units, glue ops) matters, or the tolerance is "
                f"below this budget's run-to-run noise; give more budget or tolerance.")
    return (f"Winner: amp.level=O3 amp.keep_fp32=[{','.join(c['keep_fp32'])}] ({c['low_flops']:.1%} of FLOPs, "
            f"{c['low_params']:.1%} of parameters in low precision; {c['delta']:+.2f} against O0)")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for c in result["candidates"]:
        x = 100 * c["low_flops"]
        if c["delta"] is None:
            ax.scatter([x], [-2 * result["tolerance"]], marker="x", color="red")
            ax.annotate(f"k={c['k']} diverged", (x, -2 * result["tolerance"]), fontsize=8)
        else:
            ax.scatter([x], [c["delta"]], color="tab:blue" if c["verdict"] == "within" else "tab:orange")
            ax.annotate(f"k={c['k']}", (x, c["delta"]), fontsize=8)
    ax.scatter([0], [0], color="black", marker="s", label="O0 (fp32)")
    ax.set_xlim(-5, 105)
    ax.axhline(0, color="black", lw=0.8)
    ax.axhline(-result["tolerance"], color="grey", ls="--", lw=0.8, label=f"tolerance -{result['tolerance']:g}")
    ax.set_xlabel("share of FLOPs in low precision (%)")
    ax.set_ylabel(f"{result['metric']}: candidate - O0 (mean over seeds)")
    ax.set_title(f"amp.search {result['recipe']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def searched_recipe(result: dict, out: Path) -> Optional[Path]:
    """The recipe with the winning policy, as a recipe of its own that includes the original."""
    c = winning(result)
    if c is None:
        return None
    name = f"{result['recipe']}_searched"
    text = (f"# @package _global_\n"
            f"# {result['recipe']} with the policy `python -m amp.search recipe={result['recipe']}` found: "
            f"the most low\n"
            f"# precision within {result['tolerance']:g} {result['metric']} of O0 over seeds {result['seeds']} "
            f"({c['low_flops']:.1%} of FLOPs, {c['delta']:+.2f}).\n"
            f"# Copy this file beside {result['recipe']}.yaml and run: python train.py recipe={name}\n"
            f"defaults:\n  - {result['recipe']}\n  - _self_\n\n"
            f"description: {result['recipe']} with the amp.search policy (O3, keep-list of {len(c['keep_fp32'])})\n\n"
            f"amp:\n  level: O3\n  keep_fp32: [{', '.join(c['keep_fp32'])}]\n")
    path = out / f"{name}.yaml"
    path.write_text(text)
    return path


def check_settings(cfg, argv: List[str]) -> List[str]:
    """The search's own settings; returns the overrides every training run gets."""
    s = cfg.search
    keys = [a.split("=", 1)[0].lstrip("+~") for a in argv]
    for key, instead in SET_BY_SEARCH.items():
        if key in keys:
            raise ConfigError(f"{key} is set by amp.search for every run; give {instead}")
    valid = [m for m in METRICS if m in ("top1", "top5", "loss") or task(cfg) == "translation"]
    metric = s.metric or cfg.target.metric
    if metric not in valid:
        raise ConfigError(f"search.metric={metric!r} is not a metric of this {task(cfg)} recipe; valid: "
                          f"{', '.join(valid)}")
    if not s.seeds or any(seed < 0 for seed in s.seeds) or len(set(s.seeds)) != len(s.seeds):
        raise ConfigError(f"search.seeds={list(s.seeds)} must be one or more distinct seeds >= 0, e.g. [1,2]")
    base = [a for a, key in zip(argv, keys) if not key.startswith("search.")]
    base += ["trainer.eval_every=0"]
    if s.budget_epochs:
        base.append(f"trainer.epochs={s.budget_epochs}")
    if s.budget_steps:
        base.append(f"trainer.max_steps={s.budget_steps}")
    warmup = cfg.schedule.warmup_epochs
    if s.budget_epochs and not cfg.schedule.warmup_steps and warmup >= s.budget_epochs:
        print(f"note: the budget (search.budget_epochs={s.budget_epochs}) ends inside the recipe's warm-up "
              f"(schedule.warmup_epochs={warmup:g}): every run would be judged at its peak learning rate, where "
              f"seeds differ by points; compress the schedule into the budget, e.g. "
              f"schedule.warmup_epochs={s.budget_epochs * warmup / cfg.trainer.epochs:g}", file=sys.stderr)
    return base


def prepare_out(cfg, base: List[str]) -> Path:
    """search.out, holding this search's training settings: a directory that holds another search's is refused
    (its runs would be compared with runs trained differently)."""
    out = check_writable(cfg.search.out or Path("runs", "search", cfg.recipe_name), "search.out", folder=True)
    try:
        claim(out, "search.out")  # one search per folder at a time: a second one would rank the first's runs
    except OSError as e:
        raise ConfigError(f"search.out={out} cannot be written: {e.strerror}") from None
    settings = {"recipe": cfg.recipe_name, "train_overrides": base}
    file = out / "settings.json"
    if file.is_file():
        old = json.loads(file.read_text())
        if old != settings:
            raise ConfigError(f"search.out={out} holds a search with other training settings "
                              f"({' '.join(old['train_overrides'])}); give another search.out or remove it")
    try:
        out.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(settings, indent=2))
    except OSError as e:
        raise ConfigError(f"search.out={out} cannot be written: {e.strerror}") from None
    return out


def main(argv: List[str]) -> dict:
    try:
        argv = search_argv(argv)
        cfg, smoke_note = load_config(argv)
        if smoke_note:
            print(smoke_note, file=sys.stderr)
        base = check_settings(cfg, argv)
        out = prepare_out(cfg, base)
        set_context(cfg.runtime)
        result = search(cfg, base, out)
    except ConfigError as e:
        fail(str(e))
    (out / "result.json").write_text(json.dumps(result, indent=2))
    md = to_markdown(result)
    (out / "SEARCH.md").write_text(md)
    plot(result, out / "search.png")
    recipe = searched_recipe(result, out)
    print(md + (f"Recipe: {recipe}\n" if recipe else ""))
    if recipe is None:
        sys.exit(1)
    return result

