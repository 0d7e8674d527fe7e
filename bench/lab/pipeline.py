"""Does the data pipeline keep up? Training fed by the real pipeline against the same training fed from
batches already in memory.

    python -m bench.lab.pipeline recipe=lenet_o2 [key=value ...] [--blocks 12] [--block 20]

One process, one train step (the driver's AmpTrainStep under the recipe's policy), two feeds interleaved in
blocks: (a) the recipe's `mindspore.dataset` pipeline (read, decode, augment, batch, with its worker threads),
iterated as Model.train iterates it; (b) the same number of batches taken from that pipeline once beforehand
and kept as Tensors. The ratio of steps per second is the pipeline's efficiency; the target is >= 97%. If it
falls short, the pipeline alone (iterated with no training) says whether it is too slow to produce batches
(its rate is below the training step rate) or competes with training for the cores.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import statistics
import time

import mindspore as ms

from ampzoo.data import create_dataset
from bench.common import bench_config, pop_option, save_result, train_step


def main(argv) -> dict:
    blocks, argv = pop_option(argv, "--blocks", 12)
    block, argv = pop_option(argv, "--block", 20)
    cfg = bench_config(argv)
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    ds = create_dataset(cfg.dataset, "train", seed=cfg.runtime.seed)
    step = train_step(cfg, ds.get_dataset_size(), 2 * blocks * block + block + 1)
    stream = [ds.create_tuple_iterator()]

    def next_batch():  # epoch after epoch, as Model.train iterates
        batch = next(stream[0], None)
        if batch is None:
            stream[0] = ds.create_tuple_iterator()
            batch = next(stream[0])
        return batch

    memory = [next_batch() for _ in range(block)]
    step(*memory[0])  # compile

    def timed(feed) -> float:
        t0 = time.perf_counter()
        for i in range(block):
            out = step(*feed(i))
        out[0].asnumpy()
        return block / (time.perf_counter() - t0)

    real, cached = [], []
    for b in range(blocks):  # alternate which goes first
        pair = [("real", lambda i: next_batch()), ("memory", lambda i: memory[i])]
        for name, feed in (pair if b % 2 else pair[::-1]):
            (real if name == "real" else cached).append(timed(feed))
    ratios = [r / c for r, c in zip(real, cached)][1:]
    t0 = time.perf_counter()
    n = blocks * block
    for _ in range(n):
        next_batch()
    alone = n / (time.perf_counter() - t0)
    result = {"recipe": cfg.recipe_name, "batch_size": cfg.dataset.batch_size, "blocks": len(ratios),
              "block_steps": block, "steps_per_s_pipeline": statistics.median(real[1:]),
              "steps_per_s_memory": statistics.median(cached[1:]), "efficiency": statistics.median(ratios),
              "pipeline_alone_batches_per_s": alone, "ratios": ratios}
    verdict = "meets" if result["efficiency"] >= 0.97 else "misses"
    why = "" if verdict == "meets" else (
        f"; the pipeline alone makes {alone:.0f} batches/s against {result['steps_per_s_memory']:.1f} steps/s of "
        + ("training: it is too slow to keep up" if alone < result["steps_per_s_memory"] * 1.5 else
           "training: fast enough alone, so it loses by competing with training for the cores"))
    print(f"{cfg.recipe_name}: {result['steps_per_s_pipeline']:.1f} steps/s from the pipeline, "
          f"{result['steps_per_s_memory']:.1f} from memory: efficiency {100 * result['efficiency']:.1f}% "
          f"({verdict} the 97% target){why}")
    save_result(f"pipeline-{cfg.recipe_name}", result)
    return result


if __name__ == "__main__":
    run(main)
