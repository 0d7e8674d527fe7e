"""Re-derive every shipped number:  python -m bench.verify [NAME ...] [--data GROUP=PATH ...]   (make verify)

For each weight in weights/MANIFEST.json whose data is on this machine (--data GROUP=PATH, as make reproduce
takes it, or the recipe's own dataset.path): check its sha256, evaluate it with
eval.py's own evaluation on the full test split, and compare with the manifest. Evaluation is deterministic
on one machine; across CPUs (oneDNN picks other kernels) a few borderline test images may flip, so a
classification result agrees when within TOLERANCE (2 images in 10,000). Prints a table; exit 1 on a mismatch,
and when it verified nothing (no weight's data here) or not every weight it was asked for by name.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import sys
from pathlib import Path
from typing import Dict, List, Optional

from hydra.core.hydra_config import HydraConfig

from ampzoo.cli import pop_all
from ampzoo.engine.load import load_config
from ampzoo.engine.weights import WEIGHTS, checkpoint_config, read_manifest
from ampzoo.errors import choices_hint, fail
from bench.reproduce import data_groups, data_option, find_data

TOLERANCE = {"top1": 2e-4, "top5": 2e-4, "bleu_lowercase": 0.01, "bleu_moses_lc": 0.01, "bleu": 0.01}


def score(name: str, folder: Path = WEIGHTS, data: Optional[str] = None) -> Dict:
    """The weight's metrics as eval.py computes them (sha256 checked first), with the scorer named; `data`: the
    dataset.path to score on (None: the recipe's own, or its embedded data)."""
    from ampzoo.engine.evaluate import evaluate

    path = [f"dataset.path={data}"] if data else []
    cfg, _ = checkpoint_config([f"weights={folder / read_manifest(folder)[name]['file']}", *path])
    result = evaluate(cfg)
    out = {k: round(v, 6) for k, v in result.items() if isinstance(v, float)}
    if "bleu" in result:
        out["scorer"] = {"bleu": result["signature"], "bleu_lowercase": result["signature_lowercase"],
                         "bleu_moses_lc": result["signature_moses_lc"]}
    else:
        out["scorer"] = "mindspore.train Top1/Top5CategoricalAccuracy on the full test split"
    out["split"] = "test"
    return out


def data_here(entry: dict, given: Optional[Dict[str, str]] = None) -> Optional[str]:
    """Where the weight's data is on this machine: --data GROUP=PATH, the recipe's dataset.path, or where this
    project's machines keep it ("embedded" for data that ships in a package); None when it is not here."""
    composed = [f"recipe={entry['recipe']}", *entry["overrides"]]
    cfg, smoke_note = load_config(composed, needs_data=False)
    if cfg.dataset.path is None and smoke_note is None:
        return "embedded"
    group = HydraConfig.get().runtime.choices["dataset"]
    return find_data({"group": group, "default_path": cfg.dataset.path}, given or {})


def verify(names: Optional[List[str]] = None, folder: Path = WEIGHTS, given: Optional[Dict[str, str]] = None
           ) -> List[Dict]:
    rows = []
    for name, entry in read_manifest(folder).items():
        if names and name not in names:
            continue
        metric = entry["published"].get("metric") or "top1"
        expected = entry["metric"][metric]
        data = data_here(entry, given)
        if data is None:
            rows.append({"name": name, "metric": metric, "manifest": expected, "now": None, "ok": None})
            continue
        now = score(name, folder, None if data == "embedded" else data)[metric]
        rows.append({"name": name, "metric": metric, "manifest": expected, "now": now,
                     "ok": abs(now - expected) <= TOLERANCE.get(metric, 0.0)})
    return rows


def table(rows: List[Dict]) -> str:
    lines = ["| weight | metric | manifest | now | agrees |", "|---|---|---:|---:|---|"]
    for r in rows:
        now = "no data here" if r["now"] is None else f"{r['now']:.4f}"
        ok = "-" if r["ok"] is None else ("yes" if r["ok"] else "**NO**")
        lines.append(f"| {r['name']} | {r['metric']} | {r['manifest']:.4f} | {now} | {ok} |")
    return "\n".join(lines)


def main(argv: List[str]) -> None:
    known = read_manifest()
    data, argv = pop_all(argv, "--data")
    given = dict(data_option(value) for value in data)
    for name in argv:
        if name not in known:
            fail(f"{name!r} is not a shipped weight; " + choices_hint(name, known))
    rows = verify(argv or None, given=given)
    print(table(rows))
    if any(r["ok"] is False for r in rows):
        sys.exit(1)
    missing = [r["name"] for r in rows if r["ok"] is None]
    if missing and (argv or len(missing) == len(rows)):  # a command that verified nothing does not say it did
        groups = sorted({data_group(read_manifest()[name]) for name in missing})
        fail(f"not verified, for want of its data: {', '.join(missing)}; give --data "
             f"{' --data '.join(f'{g}=PATH' for g in groups)}", code=1)


def data_group(entry: dict) -> str:
    """The dataset group a weight's data is given as (--data GROUP=PATH): the one whose files it reads."""
    load_config([f"recipe={entry['recipe']}", *entry["overrides"]], needs_data=False)
    return data_groups(HydraConfig.get().runtime.choices["dataset"])[-1]


if __name__ == "__main__":
    run(main)
