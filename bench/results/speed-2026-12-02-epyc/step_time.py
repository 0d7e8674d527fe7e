"""The mean step time of one recipe's train step in a process of its own (the A/B logs beside this file):
python step_time.py recipe=resnet34_cifar10_o2 --batch 32 --n 15, run from the repository's root."""
import sys
import time

import mindspore as ms

import ampzoo.entry  # noqa: F401  (the zoo's entry point sets up its packages as train.py does)
from bench.common import bench_config, pop_option
from bench.speed import our_step, shape_of


def main(argv):
    batch, argv = pop_option(argv, "--batch", 0)
    size, argv = pop_option(argv, "--size", 0)
    n, argv = pop_option(argv, "--n", 20)
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = bench_config(argv, smoke=False)
    step = our_step(cfg, shape_of(cfg, batch, size))[0]
    step()
    step()
    start = time.perf_counter()
    for _ in range(n):
        step()
    print("STEP ms", (time.perf_counter() - start) / n * 1e3, "steps", n + 2)


if __name__ == "__main__":
    main(sys.argv[1:])
