"""What does our driver cost per step over bare MindSpore?

    python -m bench.overhead recipe=lenet_o2 [key=value ...] [--rounds 3]

In one process, alternating: (a) train.py's `train()` with every callback on (telemetry, divergence watch,
TensorBoard, progress off, checkpoints, evaluation) and our AmpTrainStep; (b) a bare `Model.train` with
MindSpore's own amp_level and FixedLossScaleManager, the same network, data pipeline and optimizer, and only a
step timer. The ratio of median steady-state step times is the overhead. Bare MindSpore accepts only a fixed
loss scale without overflow skipping (or none) on CPU, so the recipe must use one of those.
"""
import json
import statistics
import sys
import tempfile
from pathlib import Path

from zoo.runtime import cap_onednn_isa, quiet_mindspore

cap_onednn_isa()  # before MindSpore is imported
quiet_mindspore()


def bare_step_ms(cfg) -> float:
    import mindspore.nn as nn
    from mindspore.amp import FixedLossScaleManager
    from mindspore.train import Model

    from data import create_dataset
    from models import create_model
    from zoo.callbacks import StepTimer
    from zoo.optim import create_optimizer, lr_schedule, scaled_lr

    ls = cfg.amp.loss_scale
    scale = float(ls.scale) if ls.type.value == "fixed" else 1.0
    ds = create_dataset(cfg.dataset, "train", seed=cfg.runtime.seed)
    net = create_model(cfg.model.name, num_classes=cfg.model.num_classes, **cfg.model.params)
    lr = lr_schedule(cfg.schedule, scaled_lr(cfg.optimizer, cfg.dataset.batch_size), ds.get_dataset_size(),
                     cfg.trainer.epochs)
    opt = create_optimizer(net.trainable_params(), cfg.optimizer, lr, scale)
    manager = FixedLossScaleManager(scale, drop_overflow_update=False) if ls.type.value == "fixed" else None
    model = Model(net, nn.CrossEntropyLoss(label_smoothing=cfg.trainer.label_smoothing), opt,
                  amp_level=cfg.amp.level.value, loss_scale_manager=manager)
    timer = StepTimer()
    model.train(cfg.trainer.epochs, ds, callbacks=[timer], dataset_sink_mode=False)
    return timer.summary(cfg.dataset.batch_size)["step_time_median_ms"]


def ours_step_ms(cfg, run_dir: Path) -> float:
    from train import train
    run_dir.mkdir(parents=True)
    train(cfg, run_dir)
    return json.loads((run_dir / "metrics.json").read_text())["step_time_median_ms"]


def main(argv) -> dict:
    import mindspore as ms

    from zoo.config import check_command_line, compose, fail

    rounds = 3
    if "--rounds" in argv:
        i = argv.index("--rounds")
        rounds, argv = int(argv[i + 1]), argv[:i] + argv[i + 2:]
    check_command_line(argv)
    cfg = compose([*argv, "logger.progress_bar=false"])
    ls = cfg.amp.loss_scale
    if ls.type.value == "dynamic" or (ls.type.value == "fixed" and ls.drop_overflow_update):
        fail("bench.overhead compares against bare Model.train, which on CPU accepts only no loss scale or a "
             "fixed one without overflow skipping; use a recipe like lenet_o2 or lenet_o0")
    ms.set_device("CPU")
    ours, bare = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):  # alternate, so drift and warm-up hit both alike
            ours.append(ours_step_ms(cfg, Path(tmp) / f"ours{r}"))
            bare.append(bare_step_ms(cfg))
    result = {"recipe": cfg.recipe_name, "rounds": rounds, "ours_step_ms": ours, "bare_step_ms": bare,
              "ratio": statistics.median(ours) / statistics.median(bare)}
    print(f"{cfg.recipe_name}: our driver {statistics.median(ours):.2f} ms/step, bare Model.train "
          f"{statistics.median(bare):.2f} ms/step (medians of {rounds} alternating runs): "
          f"overhead {100 * (result['ratio'] - 1):+.1f}%")
    out = Path(__file__).resolve().parent / "results" / f"overhead-{cfg.recipe_name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
