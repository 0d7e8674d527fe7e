"""Does the data pipeline keep up? Training fed by the real pipeline against the same training fed from
batches already in memory.

    python -m bench.pipeline recipe=lenet_o2 [key=value ...] [--blocks 12] [--block 20]

One process, one train step (the driver's AmpTrainStep under the recipe's policy), two feeds interleaved in
blocks: (a) the recipe's `mindspore.dataset` pipeline (read, decode, augment, batch, with its worker threads),
iterated as Model.train iterates it; (b) the same number of batches taken from that pipeline once beforehand
and kept as Tensors. The ratio of steps per second is the pipeline's efficiency; the target is >= 97%. If it
falls short, the pipeline alone (iterated with no training) says whether it is too slow to produce batches
(its rate is below the training step rate) or competes with training for the cores.
"""
from zoo.runtime import cap_onednn_isa, quiet_mindspore

cap_onednn_isa()  # before MindSpore is imported
quiet_mindspore()

import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def option(argv, name, default):
    if name in argv:
        i = argv.index(name)
        return int(argv[i + 1]), argv[:i] + argv[i + 2:]
    return default, argv


def main(argv) -> dict:
    import mindspore as ms

    from amp.loss_scale import AmpTrainStep, plan_loss_scale
    from amp.policy import apply_policy
    from data import create_dataset
    from models import create_model
    from zoo.config import apply_smoke, check_command_line, compose
    from zoo.metrics import NetWithLoss, create_loss
    from zoo.optim import create_optimizer, lr_schedule, scaled_lr

    blocks, argv = option(argv, "--blocks", 12)
    block, argv = option(argv, "--block", 20)
    check_command_line(argv)
    cfg, _ = apply_smoke(compose(argv))
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    net, _ = apply_policy(create_model(cfg.model.name, num_classes=cfg.model.num_classes, **cfg.model.params),
                          cfg.amp)
    ds = create_dataset(cfg.dataset, "train", seed=cfg.runtime.seed)
    plan = plan_loss_scale(cfg.amp.loss_scale)
    epochs = max(cfg.trainer.epochs, -(-(2 * blocks * block + block + 1) // ds.get_dataset_size()))  # an lr for every step
    lr = lr_schedule(cfg.schedule, scaled_lr(cfg.optimizer, cfg.dataset.batch_size), ds.get_dataset_size(), epochs)
    optimizer = create_optimizer(net.trainable_params(), cfg.optimizer, lr, plan.optimizer_loss_scale)
    step = AmpTrainStep(NetWithLoss(net, create_loss(cfg.trainer)), optimizer, plan, "CPU")
    step.set_train()
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
    out = Path(__file__).resolve().parent / "results" / f"pipeline-{cfg.recipe_name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
