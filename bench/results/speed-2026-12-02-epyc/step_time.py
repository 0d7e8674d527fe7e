import sys
from ampzoo.entry import run
import mindspore as ms
from bench.speed import our_step, shape_of
from bench.common import bench_config, pop_option
argv = sys.argv[1:]
batch, argv = pop_option(argv, "--batch", 0); size, argv = pop_option(argv, "--size", 0)
n, argv = pop_option(argv, "--n", 20)
ms.set_device("CPU"); ms.set_context(mode=ms.GRAPH_MODE)
import os
e = os.environ.get("EXP", "")
if "a" in e: ms.device_context.cpu.op_tuning.threads_num(1)
if "b" in e: ms.runtime.dispatch_threads_num(1)
if "c" in e: ms.set_context(runtime_num_threads=1)
if "d" in e: ms.runtime.launch_blocking()

cfg = bench_config(argv, smoke=False)
step = our_step(cfg, shape_of(cfg, batch, size))[0]
import time
step(); step()
t = time.perf_counter()
for _ in range(n): step()
print("STEP ms", (time.perf_counter() - t) / n * 1e3, "steps", n + 2)
