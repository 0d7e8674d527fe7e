"""Does capping oneDNN at AVX2 help, and does it work when set inside the process?

    python -m bench.lab.onednn_isa [--repeats 3]

Runs a child process per setting, alternating, each timing a 64->64 3x3 convolution (32x32, batch 32,
forward) and a LeNet-5 train step (batch 32) after warm-up:
  none        ONEDNN_MAX_CPU_ISA unset (MindSpore's default oneDNN dispatch)
  in-process  ampzoo.runtime.cap_onednn_isa() sets it inside the process before `import mindspore`
  env         set in the environment before the process starts
Ratios are measured side by side in one run; absolute times depend on the machine.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ampzoo.cli import pop_option
from ampzoo.errors import fail
from bench.common import machine

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import os, sys, time, json
sys.path.insert(0, ROOT)
if MODE == "in-process":
    from ampzoo.runtime import cap_onednn_isa
    cap_onednn_isa("auto", needs_cap=True)
import numpy as np, mindspore as ms, mindspore.nn as nn
ms.set_device("CPU"); ms.set_context(mode=ms.GRAPH_MODE)
from ampzoo.models import create_model

def median_ms(fn, n):
    fn(); fn()
    times = []
    for _ in range(n):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 2]

conv = nn.Conv2d(64, 64, 3)
x = ms.Tensor(np.random.randn(32, 64, 32, 32).astype(np.float32))
conv_ms = median_ms(lambda: conv(x).asnumpy(), 5)
net = create_model("lenet5", num_classes=10)
step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.CrossEntropyLoss()), nn.Momentum(net.trainable_params(), 0.01, 0.9))
img = ms.Tensor(np.random.randn(32, 1, 32, 32).astype(np.float32))
lab = ms.Tensor(np.random.randint(0, 10, 32).astype(np.int32))
lenet_ms = median_ms(lambda: step(img, lab).asnumpy(), 20)
print(json.dumps({"isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "conv_ms": conv_ms, "lenet_step_ms": lenet_ms}))
'''


def child(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    env["GLOG_v"] = "3"
    if mode == "env":
        env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    code = f"ROOT = {str(ROOT)!r}; MODE = {mode!r}\n" + CHILD
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv) -> dict:
    repeats, argv = pop_option(argv, "--repeats", 3)
    if argv:
        fail(f"unknown argument {argv[0]!r}; valid: --repeats N")
    modes = ["none", "in-process", "env"]
    runs = {m: [] for m in modes}
    for _ in range(repeats):
        for m in modes:  # alternate, so drift hits every setting alike
            runs[m].append(child(m))
    result = {}
    for m in modes:
        result[m] = {k: statistics.median(r[k] for r in runs[m]) for k in ("conv_ms", "lenet_step_ms")}
        result[m]["isa"] = runs[m][0]["isa"]
    lines = ["| setting | ONEDNN_MAX_CPU_ISA | conv 64->64 3x3 (ms) | LeNet train step (ms) | speed-up vs none |",
             "|---|---|---:|---:|---:|"]
    for m in modes:
        r = result[m]
        lines.append(f"| {m} | {r['isa'] or 'unset'} | {r['conv_ms']:.1f} | {r['lenet_step_ms']:.1f} | "
                     f"conv {result['none']['conv_ms'] / r['conv_ms']:.1f}x, "
                     f"LeNet {result['none']['lenet_step_ms'] / r['lenet_step_ms']:.1f}x |")
    print("\n".join(lines))
    out = ROOT / "bench" / "results" / "onednn_isa.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"repeats": repeats, "machine": machine(), "medians": result, "runs": runs}, indent=2))
    return result


if __name__ == "__main__":
    run(main)
