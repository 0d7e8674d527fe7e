"""What the single-process benchmarks share: their own command-line options, the recipe's train step, and
where their JSON goes (bench/results/<name>.json; bench.run copies it next to its results.json)."""
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mindspore as ms
from omegaconf import OmegaConf

from ampzoo.cli import pop_option  # noqa: F401  (the benchmarks' options)
from ampzoo.engine.checkpoint import inference_network
from ampzoo.engine.load import load_config
from ampzoo.engine.optim import lr_schedule, scaled_lr
from ampzoo.engine.step import build_train_step
from ampzoo.errors import ConfigError, fail
from ampzoo.machine import machine, machine_kind
from cpu_kernels import configure, settings

RESULTS = Path(__file__).resolve().parent / "results"


def bench_config(argv: List[str], smoke: bool = True):
    """The run a benchmark's command line asks for, through the same load_config as train.py; bad input is
    one error line and exit 2."""
    try:
        return load_config(argv, smoke=smoke)[0]
    except ConfigError as e:
        fail(str(e))


def train_step(cfg, steps_per_epoch: int, steps: int):
    """The step train.py trains with (ampzoo.engine.step.build_train_step: the recipe's network under its policy, loss
    scale and optimizer) on the device MindSpore was set to, with a learning rate for each of `steps` steps;
    set to train."""
    epochs = max(cfg.trainer.epochs, -(-steps // steps_per_epoch))
    lr = lr_schedule(cfg.schedule, scaled_lr(cfg.optimizer, cfg.dataset.batch_size), steps_per_epoch, epochs)
    step = build_train_step(cfg, cfg.amp, lr, ms.get_context("device_target")).cell
    step.set_train()
    return step


def under_compute(mode: str, step: Callable[[], float]) -> Callable[[], float]:
    """The step with the fp16 kernels multiplying as runtime.cpu_compute=mode asks (cpu_kernels.configure between
    steps: the kernels read the setting where they run, so variants built in one process can take turns), the
    setting as it was afterwards."""
    def step_in_mode() -> float:
        before = settings().compute
        configure(compute=mode)
        try:
            return step()
        finally:
            configure(compute=before)
    return step_in_mode


def trained_network(cfg, checkpoint):
    """The run's network under its policy, in eval mode, with one checkpoint's weights (ampzoo.engine.checkpoint's
    inference_network, without averaging)."""
    one = OmegaConf.merge(cfg, {"checkpoint": str(checkpoint), "decode": {"average_last": 1}})
    return inference_network(one, "bench")[0]


def alternate(variants: Dict[str, Callable], rounds: int, steps: int) -> Dict[str, List[float]]:
    """Run every variant `steps` times in turn, `rounds` times over; per variant, the median ms of each round.
    Taking turns puts drift on a shared machine into every variant alike."""
    times: Dict[str, List[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            ts = []
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            times[name].append(statistics.median(ts) * 1e3)
    return times


def ratio(times: List[float], base: List[float]) -> float:
    """Median of per-round ratios."""
    return round(statistics.median(a / b for a, b in zip(times, base)), 3)


def bootstrap_ci(ratios: List[float], n: int = 2000, seed: int = 0) -> Tuple[float, float]:
    """95% bootstrap interval of the median of `ratios` (one per round or block)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return medians[int(0.025 * n)], medians[int(0.975 * n)]


def ratio_ci(times: List[float], base: List[float]) -> List[float]:
    """The 95% interval of ratio(times, base): how far the rounds let a ratio be read."""
    return [round(v, 3) for v in bootstrap_ci([a / b for a, b in zip(times, base)])]


def describe(mach: dict) -> str:
    """One line for a report: 'CPU MODEL (ISA), 2 cores, 23 GiB; MindSpore 2.10.0, Python 3.11.7'."""
    return (f"{machine_kind(mach)}, {mach['cores']} cores, {mach['memory_gb']} GiB; MindSpore {mach['mindspore']}, "
            f"Python {mach['python']}")


def busy_elsewhere(seconds: float = 2.0) -> Optional[float]:
    """Cores that other processes kept busy over `seconds` while this one slept (from /proc/stat, less this
    process's own time); None where there is no /proc. A training run beside a benchmark shows as ~2 here, and
    halves what the benchmark measures."""
    def busy() -> Tuple[float, float]:  # every core's busy seconds so far, and this process's
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
        return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK"), time.process_time()
    try:
        total0, own0 = busy()
        time.sleep(seconds)
        total1, own1 = busy()
    except OSError:
        return None
    return round(max(0.0, (total1 - total0) - (own1 - own0)) / seconds, 2)


QUIET_CORES = 0.25  # more than this busy elsewhere, and a benchmark's numbers say they were not taken quietly


def save_result(name: str, result: dict, out: Optional[Path] = None, timed: bool = True) -> Path:
    """bench/results/<name>.json (or `out`), with the machine it was measured on and, for a result with times
    in it, how busy the rest of the machine was just after (busy_elsewhere; a warning on stderr when it was
    not quiet)."""
    result.setdefault("machine", machine())
    cores = result.setdefault("busy_elsewhere_cores", busy_elsewhere()) if timed else None
    if cores is not None and cores > QUIET_CORES:
        print(f"warning: other processes kept {cores} of {os.cpu_count()} cores busy as this benchmark ended: "
              f"its times are not quiet; stop them and measure again", file=sys.stderr)
    out = out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return out
