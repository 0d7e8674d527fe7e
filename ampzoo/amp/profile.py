"""runtime.profile=true: MindSpore's Profiler over a few steps, summarised for the "why is AMP not faster?"
question: the time share of ops in low-precision Cells, in fp32 Cells (a model's own ops, such as a tied output
projection, count for its root Cell), outside the network (loss, optimizer, loss scaling), of ops whose name
names no Cell, and of Cast ops, and the slowest ops, written to profile.md / profile.json in the run directory.

Each op's precision comes from the Cell it was generated for: MindSpore names every op by its scope
(`.../net-CastOutput/cell-LeNet5/conv1-Conv2d/Conv2D-op3`, gradients under `Gradients/...`), and the
precision report says which dtype each Cell path computes in. On CPU the Profiler writes per-op times to
FRAMEWORK/cpu_op_detail_info_*.csv; on Ascend to ASCEND_PROFILER_OUTPUT/kernel_details.csv (read here by its
Name and Duration(us) columns); on GPU to gpu_activity_data_*.csv (read as MindSpore's own OpAnalyser reads it:
the op's full name in the third column, its time in us fourth from the end). The Ascend and GPU readers follow
MindSpore 2.10's sources; we have not run them on a device.

The window is counted in real steps and starts after the first host step, which compiles the graph. A run
that profiles does not sink (ampzoo.runtime.sink_mode): a sink is a whole epoch, which would make the window one.
"""
import csv
import json
import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mindspore.profiler as profiler
from mindspore.train import Callback

log = logging.getLogger("amp_zoo")
SEGMENT = re.compile(r"^([^-]+)-([A-Za-z_]\w*)$")  # attribute-Class
UNSCOPED = "no Cell in the op's name (expanded functional ops, custom backward)"


def cell_path(scope: str) -> Optional[str]:
    """The precision report's Cell path for an op's scope name: '' at the model's root, None outside it."""
    parts = scope.split("/")[:-1]  # the last part is the op itself
    names, after_cast_output, inside = [], False, False
    for part in parts:
        m = SEGMENT.match(part)
        if not m:
            continue
        name, cls = m.groups()
        if not inside:  # network-NetWithLoss / net-<model or CastOutput> lead to the model
            inside = name == "net"
            after_cast_output = cls == "CastOutput"
            continue
        if after_cast_output and name == "cell":
            after_cast_output = cls == "CastOutput"
            continue
        after_cast_output = cls == "CastOutput"
        names.append(name)
    return ".".join(names) if inside else None


def names_a_cell(scope: str) -> bool:
    """False for ops whose scope names no Cell at all: ops expanded from functional calls (`Expand/_SumExt/...`)
    and ops of custom backward functions (`Default/ReduceMean-op3`). They ran somewhere in the step, but the
    name does not say where, so they are reported apart rather than as outside the network."""
    return any(SEGMENT.match(part) for part in scope.split("/")[:-1])


def op_times(profile_dir: Path, device: str = "CPU") -> List[Tuple[str, str, float]]:
    """(scope name, op type, total ms) for every op the Profiler timed on `device`. A device run profiles the host
    too (ProfilerActivity.CPU), so the device's own kernel file is read first and the CPU's only without one."""
    readers = {"Ascend": _ascend_kernels, "GPU": _gpu_kernels}
    first = readers.get(device)
    for reader in ([first] if first else []) + [_cpu_ops]:
        rows = reader(profile_dir)
        if rows:
            return rows
    return []


def _cpu_ops(profile_dir: Path) -> List[Tuple[str, str, float]]:
    rows = []
    for path in profile_dir.rglob("cpu_op_detail_info_*.csv"):
        with open(path) as f:
            for r in csv.DictReader(f):
                rows.append((r["full_op_name"], r["op_type"], float(r["op_total_time(ms)"])))
    return rows


def _ascend_kernels(profile_dir: Path) -> List[Tuple[str, str, float]]:
    rows = []
    for path in profile_dir.rglob("kernel_details.csv"):
        with open(path) as f:
            for r in csv.DictReader(f):
                rows.append((r["Name"], r.get("Type", r["Name"].split("/")[-1].split("-")[0]),
                             float(r["Duration(us)"]) / 1e3))
    return rows


def _gpu_kernels(profile_dir: Path) -> List[Tuple[str, str, float]]:
    rows = []
    for path in profile_dir.rglob("gpu_activity_data_*.csv"):  # as mindspore.profiler's OpAnalyser reads it
        with open(path) as f:
            for line in f.readlines()[1:]:
                fields = line.strip().replace(", ", ";").split(",")
                if len(fields) > 4:
                    name = fields[2]
                    rows.append((name, name.split("/")[-1].split("-")[0], float(fields[-4]) / 1e3))
    return rows


def summarise(rows: List[Tuple[str, str, float]], dtypes: Dict[str, str], steps: int) -> Dict:
    by_class, slow = defaultdict(float), defaultdict(float)
    total = sum(t for _, _, t in rows) or 1e-12
    for scope, op_type, ms in rows:
        path = cell_path(scope)
        if path is not None:  # the nearest Cell the precision report knows
            while path and path not in dtypes:
                path = path.rpartition(".")[0]
            path = path or "(root)"
        if op_type == "Cast":
            group = "Cast"
        elif not names_a_cell(scope):
            group = UNSCOPED
        elif path is None:
            group = "outside the network (loss, optimizer, loss scaling)"
        else:
            group = f"{dtypes.get(path, 'float32')} Cells"
        by_class[group] += ms
        slow[(op_type, path or "-", group)] += ms
    top = sorted(slow.items(), key=lambda kv: -kv[1])[:15]
    return {
        "steps": steps, "total_ms_per_step": total / max(steps, 1),
        # the graph's Cast ops, by name (a device's kernel file has a row per run): what a precision policy adds,
        # read without a timing
        "cast_ops": len({scope for scope, op_type, _ in rows if op_type == "Cast"}),
        "share": {k: v / total for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "slowest": [{"op": op, "cell": cell, "group": group, "ms_per_step": ms / max(steps, 1), "share": ms / total}
                    for (op, cell, group), ms in top],
    }


def write_summary(summary: Dict, run_dir: Path) -> Path:
    (run_dir / "profile.json").write_text(json.dumps(summary, indent=2))
    lines = [f"# Profile: {summary['steps']} steps, {summary['total_ms_per_step']:.2f} ms of op time per step", "",
             f"Cast ops in the step's graph: {summary['cast_ops']}", "",
             "| ops | share of op time |", "|---|---:|",
             *[f"| {k} | {100 * v:.1f}% |" for k, v in summary["share"].items()], "",
             "| op | Cell | precision | ms/step | share |", "|---|---|---|---:|---:|",
             *[f"| {r['op']} | {r['cell']} | {r['group']} | {r['ms_per_step']:.3f} | {100 * r['share']:.1f}% |"
               for r in summary["slowest"]]]
    path = run_dir / "profile.md"
    path.write_text("\n".join(lines) + "\n")
    return path


class ProfileSteps(Callback):
    """Profiles at least `steps` real steps from the first host step that starts at or after global step
    `start` (after compilation), then writes the summary.

    With several ranks every rank profiles the same window into its own folder (profiler/rank-N) and stops,
    and parses, at the same step: a rank that stopped alone to parse would leave the others waiting in their
    next gradient all-reduce. Rank 0 (`write`) alone writes profile.md / profile.json."""

    def __init__(self, run_dir: Path, report: Dict, device: str, start: int = 2, steps: int = 5,
                 rank: Optional[int] = None):
        self.run_dir, self.start, self.steps, self.device = run_dir, start, steps, device
        self.out = run_dir / "profiler" / (f"rank-{rank}" if rank is not None else "")
        self.write = not rank
        self.dtypes = {r["path"]: r["compute_dtype"] for r in report["cells"]}
        self.profiler, self.done, self.seen = None, False, 0
        self.last = 0  # global step at the end of the previous host step
        self.window: List[int] = []  # the global steps profiled: [first, last]

    def on_train_begin(self, run_context):
        self.last = run_context.original_args().cur_step_num

    def on_train_step_begin(self, run_context):
        first = self.last + 1  # MindSpore has already counted this host step (a whole sink) in cur_step_num
        if self.profiler is None and not self.done and first >= self.start:
            kind = profiler.ProfilerActivity  # read at call time, so a test can stand in for the profiler
            device = {"Ascend": [kind.NPU], "GPU": [kind.GPU]}.get(self.device, [])
            trace = profiler.tensorboard_trace_handler(str(self.out))
            # start_profile=False: mindspore.profiler.profile starts itself when built unless told not to, and a
            # second start() of a running profiler is an error MindSpore logs and swallows
            self.profiler = profiler.profile(activities=[kind.CPU, *device], on_trace_ready=trace, start_profile=False)
            self.profiler.start()
            self.window = [first, first]

    def on_train_step_end(self, run_context):
        step, previous = run_context.original_args().cur_step_num, self.last
        self.last = step
        if self.profiler is not None:
            self.seen += step - previous
            self.window[1] = step
            if self.seen >= self.steps:
                self.finish()

    def on_train_end(self, run_context):
        if self.profiler is not None:
            self.finish()

    def finish(self):
        self.profiler.stop()  # on_trace_ready parses what was collected
        self.profiler, self.done = None, True
        if not self.write:
            return
        rows = op_times(self.out, self.device)
        if not rows:
            log.warning("profile of steps %d-%d: the profiler wrote no op times under %s (looked for %s); nothing "
                        "to summarise", *self.window, self.out, KERNEL_FILES.get(self.device, KERNEL_FILES["CPU"]))
            return
        summary = summarise(rows, self.dtypes, self.seen)
        path = write_summary(summary, self.run_dir)
        log.info("profile of %d steps (%d-%d): %s; %s", self.seen, *self.window,
                 ", ".join(f"{k} {100 * v:.0f}%" for k, v in summary["share"].items()), path)


KERNEL_FILES = {"CPU": "cpu_op_detail_info_*.csv", "Ascend": "kernel_details.csv", "GPU": "gpu_activity_data_*.csv"}
