"""BENCHMARKS.md and the plots, from a bench results.json (bench.run writes both).

    python -m bench.report FOLDER        (FOLDER/results.json in, FOLDER/BENCHMARKS.md and the plots out)
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import List

from ampzoo.errors import fail
from bench.common import describe

ROOT = Path(__file__).resolve().parent.parent


def _mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _fmt(mean, std, scale=1.0, digits=2):
    if mean is None:
        return "-"
    return f"{mean * scale:.{digits}f}" + (f" ± {std * scale:.{digits}f}" if std is not None else "")


def table(results) -> str:
    groups = defaultdict(list)
    for r in results["runs"]:
        groups[(r["recipe"], r["level"], r["loss_scale"])].append(r)
    lines = ["| recipe | level | loss scale | seeds | final metric | time to target (s) | samples/s | speed-up vs O0 "
             "| peak host memory vs O0 | compile + first step (s) | overflowed steps |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {}
    for (recipe, level, ls), runs in groups.items():
        if level == "O0":
            base[runs[0]["family"]] = runs
    for (recipe, level, ls), runs in sorted(groups.items(), key=lambda kv: (kv[1][0]["family"], kv[0][1], kv[0][2])):
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            lines.append(f"| {recipe} | {level} | {ls} | {len(runs)} | failed: {runs[0]['error']} | | | | | | |")
            continue
        metric = ok[0]["metric"]
        scale = 100.0 if metric == "top1" else 1.0
        m, s = _mean_std([r["final_metric"] for r in ok])
        t, _ = _mean_std([r["time_to_target_s"] for r in ok])
        thr, _ = _mean_std([r["samples_per_s"] for r in ok])
        mem, _ = _mean_std([r["peak_host_mb"] for r in ok])
        ref = [r for r in base.get(ok[0]["family"], []) if r["status"] == "ok"]
        thr0, _ = _mean_std([r["samples_per_s"] for r in ref])
        mem0, _ = _mean_std([r["peak_host_mb"] for r in ref])
        comp, _ = _mean_std([r["compile_and_first_step_s"] for r in ok])
        unit = "%" if metric == "top1" else " BLEU"
        reached = sum(r["time_to_target_s"] is not None for r in ok)
        target = f"{t:.1f} ({reached}/{len(ok)} reached {ok[0]['target'] * scale:g}{unit})" if t else \
            f"not reached ({ok[0]['target'] * scale:g}{unit})"
        lines.append(
            f"| {recipe}{' (smoke)' if ok[0]['smoke'] else ''} | {level} | {ls} | {len(ok)} | "
            f"{_fmt(m, s, scale)}{unit} | {target} | {thr:.0f} | {thr / thr0:.2f}x | {mem / mem0:.2f}x | {comp:.1f} | "
            f"{sum(r['overflow_steps'] or 0 for r in ok)} |")
    return "\n".join(lines)


# Parity, fixed before the runs: an AMP level's mean final metric within this of O0's (top-1 in points, BLEU
# in points), for the families of bench.run's matrix.
TOLERANCE = {"lenet": 1.0, "resnet34": 5.0, "transformer_base": 1.5}


def parity(results) -> str:
    """Each AMP row's mean final metric against O0's, within TOLERANCE."""
    groups = defaultdict(list)
    for r in results["runs"]:
        if r["status"] == "ok":
            groups[(r["family"], r["level"], r["loss_scale"])].append(r)
    lines = ["| recipe family | setting | seeds | O0 | this setting | difference | tolerance | within |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for (fam, level, ls), runs in sorted(groups.items()):
        base = next((v for (f, lv, _), v in groups.items() if f == fam and lv == "O0"), None)
        if level == "O0" or not base:
            continue
        scale = 100.0 if runs[0]["metric"] == "top1" else 1.0
        m0, s0 = _mean_std([r["final_metric"] for r in base])
        m, s = _mean_std([r["final_metric"] for r in runs])
        diff = (m - m0) * scale
        tol = TOLERANCE[fam]
        lines.append(f"| {fam} | {level} / {ls} | {len(runs)} | {_fmt(m0, s0, scale)} | {_fmt(m, s, scale)} | "
                     f"{diff:+.2f} | ±{tol:g} | {'yes' if abs(diff) <= tol else '**no**'} |")
    return "\n".join(lines)


def plot(results, out: Path) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    written = []
    by_family = defaultdict(list)
    for r in results["runs"]:
        if r["status"] == "ok" and r["seed"] == min(x["seed"] for x in results["runs"]):
            by_family[r["family"]].append(r)

    def scalars(run, tag):
        tb = ROOT / run["run_dir"] / "tb"  # ROOT / an absolute path is that path
        if not tb.is_dir():  # raw runs are not committed: a report rebuilt elsewhere has no curves
            return []
        ea = EventAccumulator(str(tb))
        ea.Reload()
        return [(e.step, e.value) for e in ea.Scalars(tag)] if tag in ea.Tags()["scalars"] else []

    for fam, runs in by_family.items():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for r in runs:
            label = f"{r['level']} / {r['loss_scale']}"
            loss = scalars(r, "train/loss")
            if loss:
                ax1.plot(*zip(*loss), label=label)
            scale = scalars(r, "amp/loss_scale")
            if scale and r["loss_scale"] == "dynamic":
                ax2.plot(*zip(*scale), label=label)
        ax1.set(title=f"{fam}: training loss", xlabel="step", ylabel="loss")
        ax2.set(title=f"{fam}: loss scale (dynamic runs)", xlabel="step", ylabel="scale", yscale="log")
        for ax in (ax1, ax2):
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{fam}_loss_and_scale.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(10, 4))
    labels, values = [], []
    for fam, runs in by_family.items():
        base = next((r["samples_per_s"] for r in runs if r["level"] == "O0"), None)
        for r in runs:
            if base:
                labels.append(f"{fam}\n{r['level']}/{r['loss_scale']}")
                values.append(r["samples_per_s"] / base)
    ax.bar(range(len(values)), values)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(values)), labels, fontsize=7, rotation=30, ha="right")
    ax.set(title="Throughput relative to O0 of the same recipe (this CPU)", ylabel="x O0")
    fig.tight_layout()
    path = out / "throughput_vs_o0.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


def write_report(results, out: Path) -> None:
    mach = results["machine"]
    pngs = plot(results, out)
    lines = [
        f"# Benchmarks ({results['matrix']} matrix)", "",
        f"Machine: {describe(mach)}; device CPU. Each row is train.py on the embedded data with the bench budget "
        f"(bench/run.py); ResNet-34 and Transformer rows are smoke runs, not their published benchmarks. "
        f"Metric ± standard deviation over seeds where there are several. Throughput is steady state (from the "
        f"second step on); memory is the peak resident memory of the training process.", "",
        table(results), "",
        "On this CPU, fp16 is slower than fp32: MindSpore's CPU backend runs Conv2D and MatMul in fp32 with casts "
        "around them, so O1-O3 add casts without faster kernels. The speed-up of mixed precision belongs to "
        "Ascend and GPU, which we have not measured.", "",
        *[f"![{p.stem}]({p.name})" for p in pngs], "",
        "## Parity: does mixed precision match fp32?", "",
        "Micikevicius et al. (2018) claim that mixed precision with loss scaling matches fp32 accuracy. Each AMP "
        "setting's mean final metric over the seeds against O0's, at this CPU budget; the tolerance is set "
        "before the run (bench/report.py TOLERANCE) from the seed-to-seed spread we expect at that budget.", "",
        parity(results), "",
        "## Ablation: loss scaling", "",
        "O3 (every Cell fp16, LayerNorm and Softmax too) with no loss scale against a dynamic one, trained: the "
        "rows `lenet_o3 | O3 | none` / `| O3 | dynamic` and `transformer_base_o2 | O3 | none` / `| O3 | dynamic` "
        "above, and the Parity table. docs/benchmarks.md measures the mechanism loss scaling guards against "
        "(fp16 gradient values below 2^-24 flushing to zero) on one real batch (bench/lab/underflow.py).", "",
        "Command: `python -m bench.run" + (" --quick" if results["matrix"] == "quick" else "") + "`",
    ]
    (out / "BENCHMARKS.md").write_text("\n".join(lines) + "\n")


def main(argv: List[str]) -> None:
    if len(argv) != 1 or not (Path(argv[0]) / "results.json").is_file():
        fail(f"give one folder holding a bench results.json (bench.run's --out); got {' '.join(argv) or 'nothing'}")
    folder = Path(argv[0])
    write_report(json.loads((folder / "results.json").read_text()), folder)


if __name__ == "__main__":
    run(main)
