"""What a train step costs when one other busy process shares this machine's cores, side by side in one run:

    python -m bench.busy [--steps 5] [--turn-seconds 2] [--rounds 6] [--out DIR] [--models lenet5,resnet34]
                         [--width 0] [--train-steps 1250] [key=value ...]

Issue 78, item 5: beside one busy process, the O2 step of LeNet-5 and of ResNet-34 should be no slower with the
kernels' pool at its default (runtime.cpu_threads=0: the cores this process may use) than with one thread, and
msrun with 2 workers on 2 cores no slower than with one thread each.

Part 1: the O2 train step as bench.speed builds it (bench.common.train_step, random inputs, batch 32 at 32x32;
lenet_o2 and resnet34_cifar10_o2, its width --width if given; key=value goes to both) with runtime.cpu_threads=0,
=1 and runtime.cpu_kernels=off (MindSpore's own kernels and threads), quiet and beside a busy process (`while True:
pass`, stopped by SIGSTOP for the quiet turns). Each of the six runs in a process of its own, started one at a time
with the helper stopped, and compiled then. They take turns, each of --steps steps and at least --turn-seconds
(the pool judges the machine every 0.2 s: a turn far longer measures its steady state, not how soon it noticed
the helper start or stop), --rounds times; a time is the median of the rounds, a ratio the median of per-round
ratios (< 1: the first is faster) with its 95% bootstrap interval. pool_busy is in how many of its 0.2 s windows
a pool found other processes on its cores (cpu_kernels.pool_busy), quiet and busy; train.py's BusyMachine warns at
BusyMachine.FOUND.

Part 2: train.py recipe=lenet_o2 for --train-steps steps (0: skipped) under msrun with 2 workers (each pool sized
by auto_threads: the cores shared among MS_WORKER_NUM), again with runtime.cpu_threads=1 each, then two single runs
at once with runtime.cpu_threads=1: the same steps on the same per-process batch; the seconds in the steps (train.py's
epoch lines), the wall time with start-up, and BusyMachine's warnings. msrun against one thread each is the item's
comparison; against two single runs it shows what msrun itself adds (its start-up, an all-reduce at every step).

busy.json and busy.md go into --out (default bench/results/busy-<date>-<cpu>/), with the machine and how busy it
was before this run began (busy_elsewhere, its busy helper not started yet): take numbers only where it was quiet.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import datetime
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

from ampzoo.errors import fail
from bench.common import QUIET_CORES, busy_elsewhere, describe, pop_option, ratio, ratio_ci, save_result
from cpu_kernels import AUTO_CAP

ROOT = Path(__file__).resolve().parent.parent
WORKER = "--worker"  # python -m bench.busy --worker OVERRIDES: one setting's step in a process of its own
MODELS = {"lenet5": ["recipe=lenet_o2"], "resnet34": ["recipe=resnet34_cifar10_o2"]}
SETTINGS = {"threads 0 (auto)": ["runtime.cpu_threads=0"], "threads 1": ["runtime.cpu_threads=1"],
            "kernels off": ["runtime.cpu_kernels=off"]}


def worker(argv: List[str]) -> None:
    """Build the step and take three (the compile, a warm-up), then for each line "N S" read: N steps and at least
    S seconds of them, and one line of JSON back (their median ms; in how many windows the pool found the machine
    busy since the warm-up)."""
    import mindspore as ms
    from ampzoo.engine.callbacks import BusyMachine
    from bench.common import bench_config
    from bench.speed import our_step, shape_of
    from cpu_kernels import pool_busy, pool_threads
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = bench_config(argv, smoke=False)
    # kernels: the network runs cpu_kernels' convolutions; LeNet's turns of seconds take thousands of steps
    step, kernels = our_step(cfg, shape_of(cfg, 32, 32), steps=200_000)
    for _ in range(3):  # the compile, and two steps to warm up
        step()
    start = pool_busy() if kernels else 0
    print("busy-worker " + json.dumps({"threads": pool_threads() if kernels else None}), flush=True)
    for line in sys.stdin:
        steps, seconds = line.split()
        ts, until = [], time.perf_counter() + float(seconds)
        while len(ts) < int(steps) or time.perf_counter() < until:
            t0 = time.perf_counter()
            step()
            ts.append((time.perf_counter() - t0) * 1e3)
        found = pool_busy() - start if kernels else None
        print("busy-worker " + json.dumps({"ms": statistics.median(ts), "pool_busy": found,
                                           "warns": found is not None and found >= BusyMachine.FOUND}), flush=True)


def own_process(overrides: List[str]) -> Tuple[subprocess.Popen, Callable[[int], dict]]:
    """A worker for `overrides`, ready (compiled), and a call that runs N steps in it: its answer."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", AUTO_CAP)}  # its own oneDNN cap
    proc = subprocess.Popen([sys.executable, "-m", "bench.busy", WORKER, *overrides], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(env, GLOG_v="3"))

    def answer(n: int = 0, seconds: float = 0.0) -> dict:
        if n:
            proc.stdin.write(f"{n} {seconds}\n")
            proc.stdin.flush()
        for line in proc.stdout:  # anything a library prints first is skipped
            if line.startswith("busy-worker "):
                return json.loads(line.split(" ", 1)[1])
        raise RuntimeError(f"a worker ended (exit {proc.wait()}): run {' '.join(proc.args)} to see why")
    return proc, answer


def steps_side_by_side(model: str, extra: List[str], helper, steps: int, rounds: int, seconds: float) -> dict:
    """Part 1 for one model: ms per step of every setting, quiet and busy, and the ratios under busy."""
    procs, ask, ready, last = [], {}, {}, {}
    helper.send_signal(signal.SIGSTOP)
    try:
        for cond in ("quiet", "busy"):  # one at a time, the helper stopped: no pool starts out having found it busy
            for name, over in SETTINGS.items():
                proc, ask[cond, name] = own_process([*MODELS[model], *extra, *over])
                procs.append(proc)
                ready[cond, name] = ask[cond, name]()
        times: Dict[tuple, List[float]] = {key: [] for key in ask}
        for _ in range(rounds):
            for cond in ("quiet", "busy"):
                helper.send_signal(signal.SIGCONT if cond == "busy" else signal.SIGSTOP)
                for name in SETTINGS:
                    last[cond, name] = ask[cond, name](steps, seconds)
                    times[cond, name].append(last[cond, name]["ms"])
        helper.send_signal(signal.SIGSTOP)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    rows = {name: {"threads": ready["busy", name]["threads"],
                   **{f"{cond}_ms": round(statistics.median(times[cond, name]), 2) for cond in ("quiet", "busy")},
                   "busy_vs_quiet": ratio(times["busy", name], times["quiet", name]),
                   "pool_busy": last["busy", name]["pool_busy"], "pool_busy_quiet": last["quiet", name]["pool_busy"],
                   "busy_machine_warning": last["busy", name]["warns"]} for name in SETTINGS}
    auto, one, off = (times["busy", name] for name in SETTINGS)
    return {"overrides": [*MODELS[model], *extra], "rows": rows,
            "busy_auto_vs_1_thread": ratio(auto, one), "busy_auto_vs_1_thread_95ci": ratio_ci(auto, one),
            "busy_auto_vs_kernels_off": ratio(auto, off), "busy_auto_vs_kernels_off_95ci": ratio_ci(auto, off)}


def train(tmp: Path, name: str, args: List[str], msrun: bool) -> subprocess.Popen:
    """train.py in `tmp` (MindSpore leaves rank_0/ where it runs), under msrun or alone; its output in NAME.out."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=str(ROOT))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [str(Path(sys.executable).parent / "msrun"), "--worker_num=2", "--local_worker_num=2",
              "--master_addr=127.0.0.1", f"--master_port={port}", "--join=True", f"--log_dir={tmp / name}-logs",
              str(ROOT / "train.py"), "runtime.distributed=true"] if msrun else [sys.executable, str(ROOT / "train.py")]
    with open(tmp / f"{name}.out", "w") as out:
        return subprocess.Popen([*launch, *args, f"hydra.run.dir={tmp / name}"], cwd=tmp, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def msrun_against_single(train_steps: int, repeats: int = 2) -> dict:
    """Part 2: msrun's 2 workers with their pools as sized by default, then with runtime.cpu_threads=1 each, then
    two single one-thread runs at once (what msrun itself costs: its start-up, an all-reduce a step); the three in
    turn, `repeats` times, each figure the fastest of its turns (the first run of a kind pays for cold caches)."""
    if not (Path(sys.executable).parent / "msrun").is_file():
        return {"skipped": f"no msrun beside {sys.executable}"}
    args = ["recipe=lenet_o2", "trainer.epochs=1000", f"trainer.max_steps={train_steps}", "trainer.eval_every=0",
            "trainer.ckpt_every=0", "logger.progress_bar=false"]
    result = {"train_steps": train_steps, "args": args, "repeats": repeats}
    single = [(f"single{i}", ["runtime.cpu_threads=1"], False) for i in (0, 1)]
    kinds = {"msrun_2_workers": [("dp", [], True)],
             "msrun_2_workers_1_thread": [("dp1", ["runtime.cpu_threads=1"], True)],
             "two_single_1_thread": single}
    turns: Dict[str, List[Tuple[float, float, int]]] = {key: [] for key in kinds}
    for _ in range(repeats):
        for key, runs in kinds.items():
            with tempfile.TemporaryDirectory(prefix="bench-busy-") as tmp:
                t0 = time.perf_counter()
                procs = [train(Path(tmp), name, [*args, *over], msrun) for name, over, msrun in runs]
                codes = [p.wait() for p in procs]
                wall = time.perf_counter() - t0
                outs = "".join(Path(tmp, f"{name}.out").read_text() for name, _, _ in runs)
                workers = "".join(f.read_text() for name, _, _ in runs
                                  for f in Path(tmp).glob(f"{name}-logs/worker_*"))
                if any(codes):
                    return {**result, "skipped": f"{key} failed (exit {max(codes)}): {(outs + workers)[-1500:]}"}
                # BusyMachine's warning, and the seconds in the steps
                turns[key].append((wall, steps_seconds(workers or outs, len(runs)),
                                   (workers or outs).count("the machine is busy")))
    for key, got in turns.items():
        result[f"{key}_s"] = round(min(w for w, _, _ in got), 1)
        result[f"{key}_steps_s"] = round(min(st for _, st, _ in got), 1)
        result[f"{key}_steps_s_turns"] = [st for _, st, _ in got]
        result[f"{key}_busy_warnings"] = sum(b for _, _, b in got)
    result["msrun_vs_msrun_1_thread"] = round(result["msrun_2_workers_steps_s"] /
                                              result["msrun_2_workers_1_thread_steps_s"], 3)
    result["msrun_vs_two_single"] = round(result["msrun_2_workers_s"] / result["two_single_1_thread_s"], 3)
    result["msrun_vs_two_single_steps"] = round(result["msrun_2_workers_steps_s"] /
                                                result["two_single_1_thread_steps_s"], 3)
    return result


def steps_seconds(logs: str, runs: int) -> float:
    """The seconds a run spent in its steps, start-up and compile left out: the sum of train.py's "N steps in S s"
    lines over its epochs, the mean over `runs` runs (msrun: its workers' logs, which take the same steps)."""
    times = [float(s) for s in re.findall(r"\d+ steps in ([0-9.]+) s", logs)]
    return round(sum(times) / (len(re.findall(r"epoch 1/", logs)) or runs), 1)


def cpu_short(cpu: str) -> str:
    words = re.sub(r"\((r|tm)\)|\b(amd|intel|cpu)\b", " ", cpu.lower()).split()
    return re.sub(r"[^a-z0-9]", "", words[0]) if words else "cpu"


def markdown(result: dict) -> str:
    mach = result["machine"]
    lines = [f"# One busy process beside a train step ({result['date']})", "",
             f"{describe(mach)}; CPU family/model {mach['family']}; cores busy elsewhere before this run: "
             f"{result['busy_before_cores']}, after: {result.get('busy_elsewhere_cores')}", "",
             f"ms per step: the median of {result['rounds']} round(s), each of {result['steps']} steps and at least "
             f"{result.get('turn_seconds', 0)} s.", ""]
    for model, m in result["models"].items():
        lines += [f"## {model} O2 ({' '.join(m['overrides'])}, batch 32, 32x32)", "",
                  "| setting | pool threads | quiet ms | busy ms | busy/quiet | pool_busy quiet / busy | warning |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {name} | {r['threads'] or 'MindSpore'} | {r['quiet_ms']} | {r['busy_ms']} | "
                  f"{r['busy_vs_quiet']} | {r['pool_busy_quiet']} / {r['pool_busy']} | "
                  f"{'yes' if r['busy_machine_warning'] else 'no'} |"
                  for name, r in m["rows"].items()]
        lines += ["", f"Busy: auto / 1 thread {m['busy_auto_vs_1_thread']} {m['busy_auto_vs_1_thread_95ci']}, "
                      f"auto / kernels off {m['busy_auto_vs_kernels_off']} {m['busy_auto_vs_kernels_off_95ci']} "
                      "(time ratios; < 1: auto is faster)", ""]
    d = result["msrun"]
    lines += ["## msrun, 2 workers, against one thread each, and against two single 1-thread runs at once", ""]
    lines += [d["skipped"] if "skipped" in d else
              f"train.py {' '.join(d['args'])}: in the steps, msrun {d['msrun_2_workers_steps_s']} s with its "
              f"pools as sized by default, {d['msrun_2_workers_1_thread_steps_s']} s with one thread each, ratio "
              f"{d['msrun_vs_msrun_1_thread']} (the fastest of {d['repeats']} turns each). Against two single "
              f"runs: msrun {d['msrun_2_workers_s']} s, two single runs "
              f"{d['two_single_1_thread_s']} s, ratio {d['msrun_vs_two_single']} (wall time, start-up included); "
              f"in the steps alone {d['msrun_2_workers_steps_s']} s and {d['two_single_1_thread_steps_s']} s, ratio "
              f"{d['msrun_vs_two_single_steps']}; "
              f"BusyMachine warnings {d['msrun_2_workers_busy_warnings']} and {d['two_single_1_thread_busy_warnings']}"]
    return "\n".join(lines) + "\n"


def main(argv: List[str]) -> dict:
    if argv[:1] == [WORKER]:
        worker(argv[1:])
        return {}
    steps, argv = pop_option(argv, "--steps", 5)
    rounds, argv = pop_option(argv, "--rounds", 6)
    out, argv = pop_option(argv, "--out", None, Path)
    models, argv = pop_option(argv, "--models", list(MODELS), lambda v: v.split(","))
    width, argv = pop_option(argv, "--width", 0)
    train_steps, argv = pop_option(argv, "--train-steps", 1250)
    seconds, argv = pop_option(argv, "--turn-seconds", 2.0, float)
    if set(models) - set(MODELS) or [a for a in argv if "=" not in a]:
        fail(f"--models takes {','.join(MODELS)}; other words are key=value overrides of every step's recipe")
    from ampzoo.machine import machine
    mach = machine()
    before = busy_elsewhere()
    if before is not None and before > QUIET_CORES:
        print(f"warning: other processes kept {before} of {os.cpu_count()} cores busy before this benchmark began: "
              "its times are not quiet; stop them and measure again", file=sys.stderr)
    date = datetime.date.today().isoformat()
    out = out or ROOT / "bench" / "results" / f"busy-{date}-{cpu_short(mach['cpu'])}"
    result = {"date": date, "steps": steps, "turn_seconds": seconds, "rounds": rounds, "busy_before_cores": before,
              "machine": mach,
              "models": {}}
    helper = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for model in models:
            extra = [*argv, *([f"+model.params.width={width}"] if width and model != "lenet5" else [])]
            result["models"][model] = steps_side_by_side(model, extra, helper, steps, rounds, seconds)
    finally:
        helper.kill()
        helper.wait()
    result["msrun"] = msrun_against_single(train_steps) if train_steps else {"skipped": "--train-steps 0"}
    out.mkdir(parents=True, exist_ok=True)
    save_result("busy", result, out / "busy.json")
    (out / "busy.md").write_text(markdown(result))
    print(markdown(result) + f"\n{out / 'busy.json'}")
    return result


if __name__ == "__main__":
    run(main)
