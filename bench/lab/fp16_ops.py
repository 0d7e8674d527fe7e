"""Why O2 and O3 cost time on a CPU: MindSpore's CPU kernels for the ops an fp16 policy adds or moves to fp16,
timed against their fp32 form on one activation-sized tensor, with the cores each keeps busy.

    python -m bench.lab.fp16_ops [--shape 128,64,28,28] [--repeats 20] [--out FILE]

Ops: Cast (fp32 -> fp16 and back: what every fp16/fp32 boundary costs), ReLU and Add (in fp16 at O2/O3, in
fp32 at O0). Each runs as its own compiled graph, alternating with the others; a time is the median of
`--repeats` calls, and "cores busy" is the process's CPU time over wall time across them (2.0 on this machine
is both cores). The default shape is ResNet-18's first-stage activation on Fashion-MNIST at batch 128.
Writes bench/results/fp16_ops.json (--out: another file).
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import resource
import statistics
import time
from pathlib import Path

import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops
import numpy as np

from ampzoo.cli import pop_option
from ampzoo.errors import fail
from bench.common import save_result


class Cast(nn.Cell):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def construct(self, x):
        return ops.cast(x, self.dtype)


class Relu(nn.Cell):
    def construct(self, x):
        return ops.relu(x)


class Add(nn.Cell):
    def construct(self, x, y):
        return x + y


def timed(fn, args, repeats: int) -> dict:
    fn(*args).asnumpy()  # compile
    times = []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).asnumpy()
        times.append(time.perf_counter() - t0)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    return {"ms": 1e3 * statistics.median(times), "cores_busy": cpu / sum(times)}


def main(argv) -> dict:
    shape, argv = pop_option(argv, "--shape", "128,64,28,28", str)
    repeats, argv = pop_option(argv, "--repeats", 20)
    out, argv = pop_option(argv, "--out", None, Path)
    if argv:
        fail(f"unknown argument {argv[0]!r}; valid: --shape N,C,H,W, --repeats N, --out FILE")
    try:
        dims = tuple(int(d) for d in shape.split(","))
    except ValueError:
        dims = ()
    if not dims or min(dims) < 1:
        fail(f"--shape {shape!r}: give positive sizes separated by commas, e.g. 128,64,28,28")
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    x32 = ms.Tensor(np.random.RandomState(0).randn(*dims).astype(np.float32))
    x16 = x32.astype(ms.float16)
    cases = {"cast fp32->fp16": (Cast(ms.float16), (x32,)), "cast fp16->fp32": (Cast(ms.float32), (x16,)),
             "relu fp32": (Relu(), (x32,)), "relu fp16": (Relu(), (x16,)),
             "add fp32": (Add(), (x32, x32)), "add fp16": (Add(), (x16, x16))}
    result = {"shape": list(dims), "repeats": repeats, "ops": {}}
    rounds = {name: [] for name in cases}
    for _ in range(3):  # take turns, so drift on a shared machine reaches every op alike
        for name, (fn, args) in cases.items():
            rounds[name].append(timed(fn, args, repeats))
    print(f"{'op':<16} {'ms':>8} {'cores busy':>11}   (shape {'x'.join(map(str, dims))})")
    for name, rs in rounds.items():
        best = {"ms": statistics.median(r["ms"] for r in rs),
                "cores_busy": statistics.median(r["cores_busy"] for r in rs)}
        result["ops"][name] = best
        print(f"{name:<16} {best['ms']:>8.2f} {best['cores_busy']:>11.2f}")
    for op in ("relu", "add"):
        print(f"{op}: fp16 takes {result['ops'][f'{op} fp16']['ms'] / result['ops'][f'{op} fp32']['ms']:.1f}x "
              f"fp32's time")
    save_result("fp16_ops", result, out)
    return result


if __name__ == "__main__":
    run(main)
