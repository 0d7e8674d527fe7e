"""Re-derive every shipped number:  python -m bench.verify [NAME ...]   (make verify)

For each weight in weights/MANIFEST.json whose data is on this machine: check its sha256, evaluate it with
eval.py's own evaluation on the full test split, and compare with the manifest. Evaluation is deterministic
on one machine; across CPUs (oneDNN picks other kernels) a few borderline test images may flip, so a
classification result agrees when within TOLERANCE (2 images in 10,000). Prints a table; exit 1 on a mismatch.
"""
import sys

from zoo.entry import prepare, run

prepare()  # before MindSpore is imported

from pathlib import Path  # noqa: E402
from typing import Dict, List, Optional  # noqa: E402

from engine.load import load_config  # noqa: E402
from engine.weights import WEIGHTS, checkpoint_config, read_manifest  # noqa: E402
from zoo.errors import choices_hint, fail  # noqa: E402

TOLERANCE = {"top1": 2e-4, "top5": 2e-4, "bleu_lowercase": 0.01, "bleu": 0.01}


def score(name: str, folder: Path = WEIGHTS) -> Dict:
    """The weight's metrics as eval.py computes them (sha256 checked first), with the scorer named."""
    from eval import evaluate

    cfg, _ = checkpoint_config([f"weights={folder / read_manifest(folder)[name]['file']}"])
    result = evaluate(cfg)
    out = {k: round(v, 6) for k, v in result.items() if isinstance(v, float)}
    if "bleu" in result:
        out["scorer"] = {"bleu": result["signature"], "bleu_lowercase": result["signature_lowercase"]}
    else:
        out["scorer"] = "mindspore.train Top1/Top5CategoricalAccuracy on the full test split"
    out["split"] = "test"
    return out


def data_here(entry: dict) -> Optional[str]:
    """The weight's data path when it is on this machine ("embedded" for packaged data); None otherwise."""
    cfg, _ = load_config([f"recipe={entry['recipe']}", *entry["overrides"]], needs_data=False)
    if cfg.dataset.path is None:
        return "embedded"
    return cfg.dataset.path if Path(cfg.dataset.path).expanduser().exists() else None


def verify(names: Optional[List[str]] = None, folder: Path = WEIGHTS) -> List[Dict]:
    rows = []
    for name, entry in read_manifest(folder).items():
        if names and name not in names:
            continue
        metric = entry["published"].get("metric") or "top1"
        expected = entry["metric"][metric]
        data = data_here(entry)
        if data is None:
            rows.append({"name": name, "metric": metric, "manifest": expected, "now": None, "ok": None})
            continue
        now = score(name, folder)[metric]
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
    for name in argv:
        if name not in known:
            fail(f"{name!r} is not a shipped weight; " + choices_hint(name, known))
    rows = verify(argv or None)
    print(table(rows))
    if any(r["ok"] is False for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    run(main)
