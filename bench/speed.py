"""A recipe's train step against PyTorch's, same model and shapes, same process, taking turns:

    python -m bench.speed recipe=NAME [key=value ...] [--batch N] [--size PIXELS] [--rounds 6] [--steps 3]
                          [--levels O0,O2] [--compute fp32,bf16] [--profile]

Ours is the driver's own train step (bench.common.train_step: the recipe's network under its precision policy,
loss scale and optimizer) at O0 and at the recipe's level; the peer is the same architecture in PyTorch eager
fp32 (torchvision's ResNet with the recipe's stem, or LeNet-5 as ampzoo/models/lenet.py builds it), SGD with momentum
and the recipe's weight decay, on as many threads as MindSpore uses. Inputs are random images of the recipe's
size and channels (or --size), labels random. A ratio is the median of per-round ratios, so drift on a shared
machine cancels, with its 95% bootstrap interval over the rounds (`_95ci`): on a noisy machine, give it more
--rounds until the interval says which side of 1.0 it is on. Take numbers only on a quiet machine. --profile
adds where each step spends its time: our ops (MindSpore's profiler) beside PyTorch's (torch.profiler), by op
type (the library's kernels by Cell and direction), and "(outside ops)": the step's median less its ops' sum.

A ResNet on the CPU runs CpuConv2d and CpuBatchNorm2d (cpu_kernels: oneDNN's direct kernels, our BatchNorm
loops); the same O0 step built with MindSpore's own Conv2D and BatchNorm takes turns too ("MindSpore's kernels"), in a
process of its own: its convolutions need the AVX2 oneDNN cap (ampzoo.runtime.cap_onednn_isa), which ours, with
no MindSpore convolution, lifts. So the gain is measured in the same run, each side at the ISA a user gets.

Three PyTorch peers take turns with ours; "PyTorch bf16 autocast" is PyTorch's own CPU mixed precision,
torch.autocast("cpu", torch.bfloat16), in our process. "PyTorch fp32" runs in our process, at our oneDNN ISA (the run's
"onednn" note): the same kernels' ISA on both sides. "PyTorch fp32, own process" runs in a process of its own at
its full ISA (AVX-512 where the CPU has it), waiting on a pipe while the others run: the step a PyTorch user
gets on this machine.

--compute fp32,bf16 times each level but O0 once per runtime.cpu_compute value ("ours O2, bf16"), taking turns in
the same run: how an fp16 convolution or Dense layer multiplies on this CPU (cpu_kernels.cpu_compute), so
which one `auto` should train with is decided by a ratio measured side by side. A value the CPU cannot run
computes in fp32, as it would in training, and says so in the run's `cpu_compute` rows.

PyTorch (and torchvision) are bench-only dependencies: pip install torch==2.14.1 torchvision==0.29.1.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import mindspore as ms
import numpy as np
from mindspore.profiler import ProfilerActivity, profile, tensorboard_trace_handler

from ampzoo.amp.profile import op_times
from ampzoo.machine import machine
from ampzoo.runtime import onednn_note
from cpu_kernels import AUTO_CAP
from bench.common import (alternate, bench_config, describe, pop_option, ratio, ratio_ci, save_result,
                          train_step, under_compute)
from cpu_kernels import cpu_compute, has_ops, library, why_not


def shape_of(cfg, batch: int, size: int):
    channels = (cfg.dataset.channels or cfg.model.params.get("in_channels")
                or (1 if cfg.model.name == "lenet5" else 3))
    return (batch or cfg.dataset.batch_size, channels, size or cfg.dataset.image_size,
            size or cfg.dataset.image_size)


def our_step(cfg, shape, steps: int = 1000) -> Tuple[Callable[[], float], bool]:
    """The step, with a learning rate for `steps` steps (MindSpore refuses a step past them), and whether its
    network runs CpuConv2d (cpu_kernels)."""
    cell = train_step(cfg, 100, steps)
    rng = np.random.RandomState(0)
    x = ms.Tensor(rng.randn(*shape).astype(np.float32))
    y = ms.Tensor(rng.randint(0, cfg.model.num_classes, shape[0]).astype(np.int32))
    fast = any(type(c).__name__ == "CpuConv2d" for _, c in cell.cells_and_names())
    return (lambda: float(cell(x, y)[0].asnumpy())), fast


def torch_model(cfg, channels: int):
    import torch.nn as tnn
    name, classes = cfg.model.name, cfg.model.num_classes
    if name == "lenet5":
        return tnn.Sequential(tnn.Conv2d(channels, 6, 5), tnn.ReLU(), tnn.MaxPool2d(2), tnn.Conv2d(6, 16, 5),
                              tnn.ReLU(), tnn.MaxPool2d(2), tnn.Flatten(), tnn.Linear(400, 120), tnn.ReLU(),
                              tnn.Linear(120, 84), tnn.ReLU(), tnn.Linear(84, classes))
    import torchvision
    model = getattr(torchvision.models, name)(num_classes=classes)
    if cfg.model.params.get("stem", "imagenet") == "cifar":
        model.conv1 = tnn.Conv2d(channels, 64, 3, 1, 1, bias=False)
        model.maxpool = tnn.Identity()
    elif channels != 3:
        model.conv1 = tnn.Conv2d(channels, 64, 7, 2, 3, bias=False)
    return model


def torch_step(cfg, shape, autocast: bool = False) -> Callable[[], float]:
    """PyTorch's step in fp32, or (autocast) under torch.autocast("cpu", torch.bfloat16): PyTorch's own CPU
    mixed precision."""
    import contextlib

    import torch
    torch.manual_seed(0)
    model = torch_model(cfg, shape[1]).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=cfg.optimizer.weight_decay)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, cfg.model.num_classes, (shape[0],), generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step


WORKER = "--worker"  # python -m bench.speed --worker torch|mindspore ARGS: a variant in its own process


def worker(kind: str, argv: List[str]) -> None:
    """A variant in a process of its own, one step for each line read: "torch", PyTorch's step as torch_step
    builds it; "mindspore", ours with MindSpore's own Conv2D and BatchNorm (the oneDNN cap that they need
    stays in this process, not in ours)."""
    batch, argv = pop_option(argv, "--batch", 0)
    size, argv = pop_option(argv, "--size", 0)
    cfg = bench_config(argv, smoke=False)
    shape = shape_of(cfg, batch, size)
    if kind == "torch":
        import torch
        torch.set_num_threads(2)
        step = torch_step(cfg, shape)
    else:
        ms.set_device("CPU")
        ms.set_context(mode=ms.GRAPH_MODE)
        cfg.runtime.cpu_kernels = "off"
        step = our_step(cfg, shape)[0]
    step()
    print("ready", flush=True)
    for _ in sys.stdin:
        step()
        print("done", flush=True)


def own_process(kind: str, argv: List[str]) -> Callable[[], None]:
    """One step of `worker(kind)` a call; the process ends with ours. PyTorch's runs uncapped
    (ONEDNN_MAX_CPU_ISA=ALL); ours with MindSpore's kernels sets its own cap as every command does."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", AUTO_CAP)}
    env["GLOG_v"] = "3"
    if kind == "torch":
        env["ONEDNN_MAX_CPU_ISA"] = "ALL"
    proc = subprocess.Popen([sys.executable, "-m", "bench.speed", WORKER, kind, *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).resolve().parent.parent)

    def answer(word: str) -> None:
        for line in proc.stdout:  # anything a library prints first is skipped
            if line.strip() == word:
                return
        raise RuntimeError(f"the {kind} worker ended (exit {proc.wait()}): run {' '.join(proc.args)} to see why")

    answer("ready")

    def step() -> None:
        proc.stdin.write("step\n")
        proc.stdin.flush()
        answer("done")
    return step


def op_label(scope: str, op_type: str) -> str:
    """An op's row in the profile: its type, or for our custom ops the Cell and direction ("CpuConv2d
    backward"), so the library's kernels show one by one beside MindSpore's."""
    cell = re.search(r"-(Cpu\w+)/", scope) if op_type == "Custom" else None
    if cell is None:
        return op_type
    return f"{cell.group(1)} {'backward' if scope.startswith('Gradients/') else 'forward'}"


def our_profile(step: Callable, steps: int = 3) -> Dict[str, float]:
    """ms per step by op type (see op_label), from MindSpore's profiler."""
    with tempfile.TemporaryDirectory() as tmp:
        prof = profile(activities=[ProfilerActivity.CPU], on_trace_ready=tensorboard_trace_handler(tmp))
        prof.start()
        for _ in range(steps):
            step()
        prof.stop()
        by_type: Dict[str, float] = defaultdict(float)
        for scope, op_type, ms_ in op_times(Path(tmp)):
            by_type[op_label(scope, op_type)] += ms_ / steps
    return dict(sorted(by_type.items(), key=lambda kv: -kv[1]))


def torch_profile(step: Callable, steps: int = 3) -> Dict[str, float]:
    """ms per step by op, from torch.profiler (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    rows = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def top_ops(by_op: Dict[str, float], step_ms: float, top: int = 15) -> Dict[str, float]:
    """The `top` ops of a profile (ms a step), and "(outside ops)": what the step spends outside all of them."""
    rows = {k: round(v, 3) for k, v in list(by_op.items())[:top]}
    rows["(outside ops)"] = round(step_ms - sum(by_op.values()), 1)
    return rows


def main(argv: List[str]) -> dict:
    if argv[:1] == [WORKER]:  # a variant in a process of its own (own_process)
        worker(argv[1], argv[2:])
        return {}
    rounds, argv = pop_option(argv, "--rounds", 6)
    steps, argv = pop_option(argv, "--steps", 3)
    batch, argv = pop_option(argv, "--batch", 0)
    size, argv = pop_option(argv, "--size", 0)
    levels, argv = pop_option(argv, "--levels", None, lambda v: v.split(","))
    computes, argv = pop_option(argv, "--compute", None, lambda v: v.split(","))
    want_profile = "--profile" in argv
    argv = [a for a in argv if a != "--profile"]
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = bench_config(argv, smoke=False)  # the recipe as written, not its smoke block
    shape = shape_of(cfg, batch, size)
    levels = levels or sorted({"O0", str(cfg.amp.level)})
    variants: Dict[str, Callable] = {}

    def level_overrides(level: str) -> List[str]:  # the recipe at another level: plain, with no loss scale
        return [] if level == str(cfg.amp.level) else [f"amp.level={level}", "amp.loss_scale.type=none",
                                                       "amp.keep_fp32=null"]

    def at(level: str):
        return bench_config([*argv, *level_overrides(level)], smoke=False)

    fast = False
    ours: Dict[str, Tuple[str, str]] = {}  # our variants: name -> level, cpu_compute asked (None: the recipe's)
    for level in levels:
        step, fast = our_step(at(level), shape)
        for mode in (computes if computes and level != "O0" else [None]):
            name = f"ours {level}" + (f", {mode}" if mode else "")
            variants[name], ours[name] = (under_compute(mode, step) if mode else step), (level, mode)
    own = ["--batch", str(shape[0]), "--size", str(shape[2])]
    if fast:  # the same step with MindSpore's own Conv2D and BatchNorm: what the library gains, side by side
        variants[f"ours {levels[0]}, MindSpore's kernels"] = own_process("mindspore",
                                                                         [*argv, *level_overrides(levels[0]), *own])
    try:
        import torch
        torch.set_num_threads(2)  # MindSpore's CPU kernels use both cores here
        peer = f"PyTorch {torch.__version__} eager fp32, {torch.get_num_threads()} threads"
        variants["PyTorch fp32"] = torch_step(cfg, shape)
        variants["PyTorch bf16 autocast"] = torch_step(cfg, shape, autocast=True)
        variants["PyTorch fp32, own process"] = own_process("torch", [*argv, *own])
    except ImportError:
        torch, peer = None, "PyTorch is not installed (pip install torch==2.14.1 torchvision==0.29.1): no peer"
    first = {}
    for name, fn in variants.items():  # compile (ours) and warm up
        t0 = time.perf_counter()
        fn()
        first[name] = round(time.perf_counter() - t0, 2)
    times = alternate(variants, rounds, steps)
    rows = {name: {"ms": round(statistics.median(ts), 2), "first_call_s": first[name]}
            for name, ts in times.items()}
    if torch is not None:
        for name in rows:  # > 1: we are faster
            for key, peer_name in (("speed_vs_pytorch", "PyTorch fp32"),
                                   ("speed_vs_pytorch_own_process", "PyTorch fp32, own process"),
                                   ("speed_vs_pytorch_bf16_autocast", "PyTorch bf16 autocast")):
                rows[name][key] = ratio(times[peer_name], times[name])
                rows[name][f"{key}_95ci"] = ratio_ci(times[peer_name], times[name])
    for name, (level, mode) in ours.items():
        if level != "O0" and "O0" in levels:  # > 1: faster than our O0 in the same run
            rows[name]["speed_vs_ours_O0"] = ratio(times["ours O0"], times[name])
            rows[name]["speed_vs_ours_O0_95ci"] = ratio_ci(times["ours O0"], times[name])
        if mode:  # what the kernels ran for the value asked (fp32 where the CPU cannot run it)
            rows[name]["cpu_compute"] = cpu_compute(asked=mode) if has_ops() else None
    mach = machine()
    # a number measured without our CPU kernels (no g++ or headers in this environment) must say so
    kernels = f"built: {library().name}" if has_ops() else f"not used: {why_not()}"
    result = {"recipe": cfg.recipe_name, "model": cfg.model.name, "stem": cfg.model.params.get("stem"),
              "shape": list(shape), "rounds": rounds, "steps_per_round": steps, "peer": peer,
              "onednn": onednn_note(), "cpu_kernels": kernels, "cpu_compute": cpu_compute() if has_ops() else None,
              "machine": mach, "rows": rows}
    print(f"{cfg.recipe_name} ({cfg.model.name}, input {'x'.join(map(str, shape))}) on {describe(mach)}; {peer}; "
          f"CPU kernels (cpu_kernels) {kernels}, fp16 convolutions and Dense layers multiply in "
          f"{result['cpu_compute']}")
    for name, row in rows.items():
        print(f"  {name}: {row}")
    if want_profile:  # every level of ours (where O2 loses against O0 is the question), and the peer
        profiles = {name: variants[name] for name in ours}
        if torch is not None:
            profiles["PyTorch fp32"] = variants["PyTorch fp32"]
        result["profile_ms"] = {name: top_ops(our_profile(fn) if name.startswith("ours") else torch_profile(fn),
                                              rows[name]["ms"])
                                for name, fn in profiles.items()}
        for name, ops_ms in result["profile_ms"].items():
            print(f"  profile, {name}: {ops_ms}")
    name = f"speed_{cfg.recipe_name}_{cfg.model.name}_{'x'.join(map(str, shape))}"
    save_result(name, result)
    return result


if __name__ == "__main__":
    run(main)
