"""Which MindSpore speed settings help here? Variants of one train step, interleaved in one process.

    python -m bench.lab.settings recipe=lenet_o2 [key=value ...] [--rounds 30]

The recipe's network under its policy and loss scale (AmpTrainStep), on one real batch, compiled once per
variant: MindSpore's default, and `JitConfig(jit_level=...)` O0 and O1 set on the train step. Rounds of 15
steps per variant, in turn; the ratio to the default is the median of per-round ratios. Settings that are
process-wide are measured elsewhere: the oneDNN ISA cap (bench.lab.onednn_isa), dataset workers
(bench.lab.pipeline dataset.num_workers=N); graph-kernel fusion (`enable_graph_kernel=True`) is not offered: on the CPU
build it did not finish compiling LeNet (docs/benchmarks.md, "Speed settings on this machine").
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import statistics
import time

import mindspore as ms
from mindspore import JitConfig

from ampzoo.data import create_dataset
from bench.common import bench_config, pop_option, save_result, train_step


def main(argv) -> dict:
    rounds, argv = pop_option(argv, "--rounds", 30)
    cfg = bench_config(argv)
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    ds = create_dataset(cfg.dataset, "train", seed=cfg.runtime.seed)
    batch = next(ds.create_tuple_iterator())

    def step(jit_level):
        cell = train_step(cfg, ds.get_dataset_size(), rounds * 15 + 1)
        if jit_level:
            cell.set_jit_config(JitConfig(jit_level=jit_level))
        t0 = time.perf_counter()
        cell(*batch)[0].asnumpy()
        return cell, time.perf_counter() - t0

    variants, compile_s = {}, {}
    for name, level in (("default", None), ("jit_level O0", "O0"), ("jit_level O1", "O1")):
        variants[name], compile_s[name] = step(level)
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for name, cell in variants.items():
            ts = []
            for _ in range(15):
                t0 = time.perf_counter()
                cell(*batch)[0].asnumpy()
                ts.append(time.perf_counter() - t0)
            times[name].append(statistics.median(ts) * 1e3)
    result = {"recipe": cfg.recipe_name, "rounds": rounds, "variants": {}}
    for name, ts in times.items():
        ratio = statistics.median(a / b for a, b in zip(ts, times["default"]))
        result["variants"][name] = {"step_ms": statistics.median(ts), "ratio_to_default": ratio,
                                    "compile_s": compile_s[name]}
        print(f"{cfg.recipe_name} {name:13s}: {statistics.median(ts):.2f} ms/step, {ratio:.3f}x the default "
              f"(compile {compile_s[name]:.1f} s)")
    save_result(f"settings-{cfg.recipe_name}", result)
    return result


if __name__ == "__main__":
    run(main)
