"""BENCHMARKS.md for the Transformer at real scale, from the JSON the Transformer benchmarks wrote.

    python -m bench.lab.transformer_report OUT_DIR [RUN_DIR ...] [--reference TORCH_DIR]

Reads bench/results/transformer_speed*.json, transformer_parts.json and decode.json, each Multi30k run
directory's multi30k_result.json / multi30k_curve.json (bench.multi30k) when given, and the PyTorch reference's
curve.json / compare.json (bench.lab.torch_multi30k); with two or more runs, their val curves at equal optimizer
updates (against the first run given); copies them and the curve plots into OUT_DIR and writes
OUT_DIR/BENCHMARKS.md. Every number in it comes from those files.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import json
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from ampzoo.errors import fail
from bench.common import RESULTS, describe, pop_option
from bench.multi30k import plot


def load(name: str):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def on_machine(data: dict) -> str:
    """'Machine: ... ' for a result that recorded it (results from before 2026-11-23 did not: an Intel Xeon)."""
    return f"Machine: {describe(data['machine'])}. " if "machine" in data else ""


def table(title: str, intro: str, header, rows) -> list:
    """A titled markdown table; the first column left-aligned, the rest right-aligned."""
    return [f"### {title}", "", *([intro, ""] if intro else []), "| " + " | ".join(header) + " |",
            "|---" + "|---:" * (len(header) - 1) + "|", *("| " + " | ".join(map(str, r)) + " |" for r in rows), ""]


def speed_tables(lines):
    for path in sorted(RESULTS.glob("transformer_speed*.json")):
        data = json.loads(path.read_text())
        lines += [f"### Train step against PyTorch (`{path.name}`)", "", on_machine(data) +
                  f"{data['peer']}; ours: {data.get('onednn', '')}. {data['rounds']} rounds of "
                  f"{data['steps_per_round']} steps per variant, alternating; ratios are medians of per-round "
                  f"ratios.", "",
                  "| shape | variant | ms/step | time vs our O0 | time vs PyTorch |", "|---|---|---:|---:|---:|"]
        for shape, rows in data["shapes"].items():
            for name, r in rows.items():
                lines.append(f"| {shape} | {name} | {r['ms']:,.1f} | {r['time_vs_O0']:.3f} | "
                             f"{r.get('time_vs_pytorch', float('nan')):.3f} |")
        lines.append("")


def parts_table(lines):
    data = load("transformer_parts.json")
    if data:
        lines += table(f"Each part in the whole step ({data['shape']}, O0)",
                       "The step with every part as kept, against the step with one part put back as it was "
                       "(`bench.lab.transformer_parts`).", ["variant", "ms/step", "time vs kept"],
                       [(name, f"{r['ms']:,.1f}", f"{r['time_vs_kept']:.3f}") for name, r in data["variants"].items()])


def decode_table(lines):
    data = load("decode.json")
    if not data:
        return
    over = f", with {' '.join(data['overrides'])}" if data.get("overrides") else ""
    lines += table(f"Decoding ({data['recipe']}, checkpoint {data['checkpoint']}{over})", on_machine(data).strip(),
                   ["search", "sentences", "seconds", "sentences/s", "tokens/s", "BLEU (lowercased)"],
                   [(name, r["sentences"], r["decode_s"], r["sentences_per_s"], r["tokens_per_s"],
                     f"{r['bleu_lowercase']:.2f}") for name, r in data["speed"].items()])
    lines += ["Incremental decoding against re-running the whole decoder every step, same checkpoint: " + "; ".join(
        f"{k}: {v['identical']} of {v['sentences']} hypotheses identical" for k, v in data["exactness"].items()), ""]


def multi30k_tables(lines, runs, out: Path):
    for run_dir in map(Path, runs):
        result = run_dir / "multi30k_result.json"
        curve = run_dir / "multi30k_curve.json"
        name = run_dir.name
        if curve.is_file():
            c = json.loads(curve.read_text())
            last = c[max(c, key=int)]
            lines += [f"### Multi30k run `{name}`: val BLEU per epoch", "",
                      f"![val BLEU per epoch]({name}_curve.png)", "",
                      f"{len(c)} epochs scored; epoch {max(map(int, c))}: val BLEU {last['bleu_lowercase']:.2f} "
                      f"lowercased, {last['bleu']:.2f} cased (beam {last['beam']}).", ""]
            shutil.copy(curve, out / f"{name}_curve.json")
            if (run_dir / "multi30k_curve.png").is_file():
                shutil.copy(run_dir / "multi30k_curve.png", out / f"{name}_curve.png")
        if result.is_file():
            r = json.loads(result.read_text())
            shutil.copy(result, out / f"{name}_result.json")
            lines += [f"### Multi30k run `{name}`: published protocol", "",
                      f"Epoch {r['epochs']} (step {r['steps']}); last {len(r['averaged'])} epoch checkpoints averaged; "
                      f"beam {r['beam']}, length penalty {r['length_penalty']} ({r['length_norm']}).", "",
                      "| split | weights | BLEU lowercased | BLEU cased | sentences/s |", "|---|---|---:|---:|---:|"]
            for key, label in (("averaged_test_2016_flickr", "test_2016_flickr, averaged"),
                               ("averaged_val", "val, averaged"), ("last_test_2016_flickr", "test_2016_flickr, last")):
                if key in r:
                    x = r[key]
                    lines.append(f"| {label.split(', ')[0]} | {label.split(', ')[1]} | {x['bleu_lowercase']:.2f} | "
                                 f"{x['bleu']:.2f} | {x['sentences_per_s']} |")
            lines.append("")


def read_curve(run: Path):
    """(name, {epoch: record}, optimizer updates per epoch) of a run directory's multi30k_curve.json, or of a
    curve kept in bench/results (NAME_curve.json) after its run directory is gone; None without a curve."""
    if run.is_file():
        name, curve = run.name.removesuffix("_curve.json"), json.loads(run.read_text())
        freq = curve[min(curve, key=int)].get("update_freq", 1)
    elif (run / "multi30k_curve.json").is_file():
        name, curve = run.name, json.loads((run / "multi30k_curve.json").read_text())
        freq = OmegaConf.load(run / "config.yaml").trainer.get("update_freq", 1)
    else:
        return None
    first = min(curve, key=int)
    return name, curve, curve[first]["step"] / int(first) / freq


def at_update(curve: dict, u: int, key: str = "bleu_lowercase"):
    """(value, exact) of a curve {update: record} at update u: its own record, or the straight line between its
    two scored neighbours (runs whose epochs hold different numbers of updates); None outside its range."""
    if str(u) in curve:
        return curve[str(u)][key], True
    below = [int(v) for v in curve if int(v) < u]
    above = [int(v) for v in curve if int(v) > u]
    if not below or not above:
        return None
    a, b = max(below), min(above)
    ya, yb = curve[str(a)][key], curve[str(b)][key]
    return ya + (yb - ya) * (u - a) / (b - a), False


def runs_compared(lines, runs, out: Path):
    """Every run's val curve against the first's at the first's scored updates (O2 against O0, another update
    size, another vocabulary): one plot over updates, and a table of the updates where another run has a value.
    A run whose epochs end at other updates is read on the straight line between its neighbouring scores
    (marked ~). A run is a run directory or a kept NAME_curve.json."""
    curves = {}
    for found in filter(None, map(read_curve, map(Path, runs))):
        name, c, per = found
        curves[name] = {str(round(int(e) * per)): r for e, r in c.items()}
    if len(curves) < 2:
        return
    names = list(curves)
    plot([(n, curves[n], "bleu_lowercase") for n in names], out / "runs_compared.png",
         "val BLEU (lowercased, greedy) at equal updates", xlabel="optimizer updates")
    base = curves[names[0]]
    values = {u: {n: at_update(curves[n], int(u)) for n in names[1:]} for u in sorted(base, key=int)}
    def cell(v) -> str:
        return "" if v is None else f"{v[0]:.2f}" if v[1] else f"~{v[0]:.2f}"
    rows = [(u, f"{base[u]['bleu_lowercase']:.2f}", *(cell(vs[n]) for n in names[1:]))
            for u, vs in values.items() if any(vs.values())]
    lines += table("Runs compared at equal updates",
                   "Val BLEU lowercased, greedy, after the epoch ending at that update (~: between a run's two "
                   "neighbouring scores, its epochs ending elsewhere). ![runs compared](runs_compared.png)",
                   ["updates", *(f"`{n}`" for n in names)], rows)
    for n in names[1:]:
        diffs = [vs[n][0] - base[u]["bleu_lowercase"] for u, vs in values.items() if vs[n]]
        if diffs:
            lines += [f"`{n}` - `{names[0]}` over the {len(diffs)} updates compared: mean "
                      f"{sum(diffs) / len(diffs):+.2f} BLEU, largest {max(diffs, key=abs):+.2f}.", ""]


def reference_table(lines, ref: Path, out: Path):
    """Our val curve against the PyTorch reference trained on the same batches (bench.lab.torch_multi30k)."""
    compare = json.loads((ref / "compare.json").read_text())
    curve = json.loads((ref / "curve.json").read_text())
    shutil.copy(ref / "compare.json", out / "pytorch_reference_compare.json")
    shutil.copy(ref / "curve.json", out / "pytorch_reference_curve.json")
    shutil.copy(ref / "curve.png", out / "pytorch_reference.png")
    lines += table("The same training in PyTorch (`bench.lab.torch_multi30k`)",
                   "PyTorch eager, fp32, the same model, sentencepiece vocabulary, token batches in the same order, "
                   "learning rate per step, Adam and label smoothing; another random initialisation. Val BLEU "
                   "lowercased, greedy, after each epoch. ![ours against PyTorch](pytorch_reference.png)",
                   ["epoch", "updates", "ours", "PyTorch", "ours - PyTorch", "PyTorch train loss"],
                   [(r["epoch"], curve[str(r["epoch"])]["step"], f"{r['ours']:.2f}", f"{r['pytorch']:.2f}",
                     f"{r['ours'] - r['pytorch']:+.2f}", curve[str(r["epoch"])]["train_loss"]) for r in compare])
    diffs = [r["ours"] - r["pytorch"] for r in compare]
    lines += [f"Mean of ours - PyTorch over epochs {compare[0]['epoch']}-{compare[-1]['epoch']}: "
              f"{sum(diffs) / len(diffs):+.2f} BLEU (largest gap {max(diffs, key=abs):+.2f}).", ""]


def main(argv) -> Path:
    reference, argv = pop_option(argv, "--reference", "", str)
    if not argv:
        fail("give the output folder, then any Multi30k run directories")
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Transformer benchmarks (CPU)", "",
             "Measured on this project's 2-core x86 machines (24 GiB, no accelerator), mindspore 2.10.0 (CPU build), "
             "Python 3.11; a table whose result recorded its machine names it (earlier ones: an Intel Xeon). "
             "Nothing here ran on Ascend or GPU. Regenerate: "
             "`python -m bench.lab.transformer_report OUT_DIR RUN_DIR...`.",
             ""]
    speed_tables(lines)
    parts_table(lines)
    decode_table(lines)
    multi30k_tables(lines, argv[1:], out)
    runs_compared(lines, argv[1:], out)
    if reference:
        reference_table(lines, Path(reference), out)
    for name in ("transformer_parts.json", "decode.json", *[p.name for p in RESULTS.glob("transformer_speed*.json")]):
        if (RESULTS / name).is_file():
            shutil.copy(RESULTS / name, out / name)
    (out / "BENCHMARKS.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'BENCHMARKS.md'}")
    return out


if __name__ == "__main__":
    run(main)
