"""LeNet-5 O2 steps in one process, the diagnostic build's modes (diag.patch) alternating every turn of 0.5 s:
the per-mode median of the turns' median step times, in ms.

    cd CLONE && git apply .../diag.patch && .venv/bin/python -m cpu_kernels.build
    .venv/bin/python .../toggle.py 30 recipe=lenet_o2 [runtime.cpu_threads=1]

DiagSet(serial, onednn1, ours1): the caller runs every region's pieces alone (the pool's busy path, without a busy
process); oneDNN's get_num_threads() answers 1; the kernels' own regions (AmpZooThreads) take one piece."""
import random
import statistics
import sys
import time

sys.path.insert(0, ".")
import mindspore as ms

import cpu_kernels
from bench.common import bench_config
from bench.speed import our_step, shape_of

ms.set_device("CPU")
ms.set_context(mode=ms.GRAPH_MODE)
cfg = bench_config(sys.argv[2:], smoke=False)
step, _ = our_step(cfg, shape_of(cfg, 32, 32), steps=2_000_000)
for _ in range(20):
    step()
lib = cpu_kernels.loaded()
modes = {"parallel": (0, 0, 0), "serial": (1, 0, 0), "serial+onednn1": (1, 1, 0), "serial+ours1": (1, 0, 1),
         "serial+both1": (1, 1, 1)}
turns = {m: [] for m in modes}
for r in range(int(sys.argv[1])):
    order = list(modes)
    random.Random(r).shuffle(order)
    for m in order:
        lib.DiagSet(*modes[m])
        for _ in range(5):
            step()
        ts, until = [], time.perf_counter() + 0.5
        while time.perf_counter() < until:
            t0 = time.perf_counter()
            step()
            ts.append((time.perf_counter() - t0) * 1e3)
        turns[m].append(statistics.median(ts))
for m, v in turns.items():
    print(f"{m:16s} median of turn medians {statistics.median(v):.3f} ms  min {min(v):.3f}  turns {len(v)}")
