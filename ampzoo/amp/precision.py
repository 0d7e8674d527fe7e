"""The precision report of a built network: every Cell, the dtype it computes in, its parameters' dtype, and the
rule that put it there (train.py writes it into each run; `python -m amp.report` prints it for a recipe).

The compute dtype is read from the flags `Cell.to_float` set on the built network (what MindSpore's compiler
casts by), not from the recipe; the reason comes from the policy that set them.
"""
import json
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import mindspore.nn as nn

from ampzoo.amp.policy import CastOutput, Policy, compute_dtype

BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _cells(net: nn.Cell, prefix: str = "") -> Iterator[Tuple[str, nn.Cell]]:
    """(path, cell) for every Cell, looking through the policy's CastOutput boundaries."""
    while isinstance(net, CastOutput):
        net = net.cell
    if not prefix:
        yield "(root)", net
    for name, child in net.name_cells().items():
        while isinstance(child, CastOutput):
            child = child.cell
        path = f"{prefix}.{name}" if prefix else name
        yield path, child
        yield from _cells(child, path)


CONTAINERS = (nn.SequentialCell, nn.CellList, nn.CellDict)


def is_unit(cell: nn.Cell) -> bool:
    """A Cell a keep-list names as a whole: a leaf, or an instance of a mindspore.nn layer (Dense, LayerNorm;
    our subclasses hold their kernels as children, which are details of the layer)."""
    if not cell.name_cells():
        return True
    return any(c.__module__.startswith("mindspore.nn") and c is not nn.Cell and not issubclass(c, CONTAINERS)
               for c in type(cell).__mro__ if isinstance(c, type) and issubclass(c, nn.Cell))


def units(net: nn.Cell) -> List[Tuple[str, nn.Cell]]:
    """(path, cell) of the network's compute units (is_unit), in order, none inside another."""
    out: List[Tuple[str, nn.Cell]] = []
    for path, cell in _cells(net):
        if path != "(root)" and is_unit(cell) and not any(path.startswith(p + ".") for p, _ in out):
            out.append((path, cell))
    return out


def precision_report(net: nn.Cell, policy: Policy) -> Dict:
    rows: List[Dict] = []
    stored = working_low = 0
    for path, cell in _cells(net):
        own = list(cell._params.values())  # pylint: disable=protected-access
        dtype = compute_dtype(cell)
        n = sum(p.size for p in own)
        stored += sum(p.size * BYTES.get(str(p.dtype).lower(), 4) for p in own)
        if dtype != "float32" and not getattr(cell, "amp_compute", None):  # amp_compute: no copy, as stored
            working_low += n * BYTES[dtype]
        rows.append({
            "path": path, "class": type(cell).__name__, "compute_dtype": dtype,
            "param_dtype": ",".join(sorted({str(p.dtype) for p in own})) or "-", "params": int(n),
            "why": policy.reasons.get(path, f"{policy.level} default"),
        })
    leaves = [r for r, (_, c) in zip(rows, _cells(net)) if not c.name_cells()]
    count = {d: sum(r["compute_dtype"] == d for r in leaves) for d in ("float16", "bfloat16", "float32")}
    total = sum(r["params"] for r in rows)
    summary = (f"{policy.level} {policy.dtype}: {count['float16'] + count['bfloat16']} leaf Cells in low precision, "
               f"{count['float32']} in float32; {total:,} parameters stored as "
               f"{', '.join(sorted({r['param_dtype'] for r in rows if r['param_dtype'] != '-'}))} "
               f"({stored / 1024:.1f} KiB) + {working_low / 1024:.1f} KiB low-precision working copies")
    return {"level": policy.level, "dtype": policy.dtype, "keep_fp32": policy.keep_fp32,
            "force_fp16": policy.force_fp16, "leaf_counts": count, "parameters": total,
            "param_bytes": stored, "low_precision_copy_bytes": working_low, "summary": summary, "cells": rows}


def to_markdown(report: Dict) -> str:
    lines = [f"# Precision report: {report['level']} ({report['dtype']})", "",
             f"keep_fp32: {report['keep_fp32'] or '[]'}; force_fp16: {report['force_fp16'] or '[]'}", "",
             report["summary"], "",
             "| cell | class | compute | params | # params | why |", "|---|---|---|---|---:|---|"]
    for r in report["cells"]:
        lines.append(f"| {r['path']} | {r['class']} | {r['compute_dtype']} | {r['param_dtype']} | "
                     f"{r['params']:,} | {r['why']} |")
    return "\n".join(lines) + "\n"


def write_report(report: Dict, run_dir: Path, writer=None) -> None:
    md = to_markdown(report)
    (run_dir / "precision_report.md").write_text(md)
    (run_dir / "precision_report.json").write_text(json.dumps(report, indent=2))
    if writer is not None:
        writer.add_text("amp/precision_report", md, 0)


def diff(a: Dict, b: Dict) -> str:
    rows_b = {r["path"]: r for r in b["cells"]}
    lines = [f"# What changes from {a['level']} to {b['level']}", "",
             f"| cell | class | {a['level']} | {b['level']} | why ({b['level']}) |", "|---|---|---|---|---|"]
    changed = 0
    for r in a["cells"]:
        other = rows_b.get(r["path"])
        if other and other["compute_dtype"] != r["compute_dtype"]:
            changed += 1
            lines.append(f"| {r['path']} | {r['class']} | {r['compute_dtype']} | {other['compute_dtype']} | "
                         f"{other['why']} |")
    lines += ["", f"{changed} of {len(a['cells'])} Cells change compute dtype."]
    return "\n".join(lines) + "\n"
