"""Train a recipe:  python train.py recipe=lenet_o2 [key=value ...]   (multirun: -m recipe=lenet_o0,lenet_o2)

Reads top to bottom: context, seeds, data, model, precision policy, loss scale, optimizer and schedule,
`Model.train` with callbacks, final evaluation, metrics.json. Everything lands in the run directory.
"""
import sys

from zoo.runtime import cap_onednn_isa, quiet_mindspore

ONEDNN_NOTE = cap_onednn_isa(sys.argv[1:])  # must run before MindSpore (and its oneDNN) is imported
quiet_mindspore()

import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from zoo.config import ConfigError, apply_smoke, check_command_line, fail, register_schema, validate  # noqa: E402

log = logging.getLogger("amp_zoo")
register_schema()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> float:
    try:
        return train(cfg, Path(HydraConfig.get().runtime.output_dir))
    except ConfigError as e:
        fail(str(e))


def train(cfg, run_dir: Path, extra_callbacks=()) -> float:
    """extra_callbacks: appended to the driver's own (bench/overhead.py uses it to interleave a bare run)."""
    from mindspore.train import Model
    from tensorboardX import SummaryWriter

    from amp.fallback import DivergenceWatch, describe, ladder, last_good_checkpoint
    from amp.loss_scale import AmpTrainStep, plan_loss_scale
    from amp.policy import apply_policy, check_device_dtype
    from amp.report import precision_report, write_report
    from amp.telemetry import AmpTelemetry
    from data import DATASETS, create_dataset
    from models import create_model
    from zoo.callbacks import (Evaluator, GracefulStop, ProgressBar, StepOffset, StepTimer, StopAtStep,
                               TensorBoardLogger)
    from zoo.checkpoint import AtomicCheckpoint, check_disk_space, read_checkpoint, restore_weights, resume_point
    from zoo.metrics import NetWithEval, NetWithLoss, create_loss, metrics
    from zoo.optim import create_optimizer, lr_schedule, scaled_lr
    from zoo.runtime import init_distributed, parameter_checksum, seed_everything, set_context, sink_mode
    from zoo.translate import translate

    t_start = time.perf_counter()
    validate(cfg)
    cfg, smoke_note = apply_smoke(cfg)
    log.info("recipe %s: %s", cfg.recipe_name, cfg.description)
    log.info("run directory: %s", run_dir.resolve())
    log.info(ONEDNN_NOTE)
    if smoke_note:
        log.warning(smoke_note)

    # 1. Context and seeds
    device = set_context(cfg.runtime)
    check_device_dtype(device, cfg.amp)
    rank, world = init_distributed() if cfg.runtime.distributed else (0, 1)
    shard = (world, rank) if world > 1 else None
    is_main = rank == 0  # rank 0 alone writes logs, TensorBoard, checkpoints and metrics
    if is_main:
        config_file = run_dir / "config.yaml"
        if config_file.exists():  # resuming into this directory: keep the first config, add this one beside it
            config_file = run_dir / f"config.resume-{len(list(run_dir.glob('config*.yaml')))}.yaml"
        config_file.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    else:
        for handler in [h for h in logging.root.handlers if isinstance(h, logging.FileHandler)]:
            logging.root.removeHandler(handler)
    seed_everything(cfg.runtime.seed)
    sink, sink_note = sink_mode(device, cfg.trainer.sink)
    log.info("device %s, %s mode; %s", device, cfg.runtime.mode.value, sink_note)

    # 2. Data, and where training starts (resume: the checkpoint's global step; its epoch's data order)
    ckpt_dir = run_dir / "checkpoints"
    restart_from = None
    if cfg.resume:
        restart_from = resume_point(ckpt_dir)[0] if cfg.resume == "auto" else Path(cfg.resume).expanduser()
    start_step = int(read_checkpoint(restart_from)["step_num"].asnumpy()) if restart_from else 0
    test_ds = create_dataset(cfg.dataset, "test")
    steps_per_epoch = create_dataset(cfg.dataset, "train", shard).get_dataset_size()
    global_batch = cfg.dataset.batch_size * world
    by_tokens = cfg.dataset.max_tokens > 0  # token batching: throughput counts a step's (padded) token budget
    per_step = cfg.dataset.max_tokens * world if by_tokens else global_batch
    epochs = cfg.trainer.epochs
    log.info("data: %s, %d steps of %s per epoch", cfg.dataset.path or "embedded", steps_per_epoch,
             f"up to {cfg.dataset.max_tokens} tokens" if by_tokens else cfg.dataset.batch_size)

    writer = None
    if cfg.logger.tensorboard and is_main:  # on resume, TensorBoard drops the killed run's events from this step on
        writer = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if restart_from else None)
    lr = lr_schedule(cfg.schedule, scaled_lr(cfg.optimizer, global_batch), steps_per_epoch, epochs)
    timer = StepTimer()
    evaluator = Evaluator(None, cfg.trainer.eval_every, writer, epochs)
    rungs, transitions, amp_summaries = ladder(cfg.amp), [], []
    resuming = restart_from is not None

    for rung, amp_cfg in enumerate(rungs):  # one pass unless amp.fallback.enabled and training diverges
        initial_epoch, skip = divmod(start_step, steps_per_epoch)

        # 3. Model and precision policy (applied once; Model below gets amp_level="O0")
        net = create_model(cfg.model.name, num_classes=cfg.model.num_classes, **cfg.model.params)
        net, policy = apply_policy(net, amp_cfg)
        report = precision_report(net, policy)
        if is_main:
            write_report(report, run_dir, writer)
        log.info("precision: %s", report["summary"])

        # 4. Loss scale, optimizer, learning-rate schedule
        plan = plan_loss_scale(amp_cfg.loss_scale)
        optimizer = create_optimizer(net.trainable_params(), cfg.optimizer, lr, plan.optimizer_loss_scale)
        loss_fn = create_loss(cfg.trainer)
        step_cell = AmpTrainStep(NetWithLoss(net, loss_fn), optimizer, plan, device)
        if is_main:
            check_disk_space(ckpt_dir, step_cell)
        model = Model(step_cell, eval_network=NetWithEval(net, loss_fn), metrics=metrics(),
                      eval_indexes=[0, 1, 2], amp_level="O0")
        log.info("loss scale: %s (initial %g)%s", plan.kind, plan.scale,
                 ", overflowed steps are skipped" if plan.skip_on_overflow else "")
        if restart_from is not None:
            restore_weights(step_cell, restart_from, with_amp_state=resuming, model_name=cfg.model.name)
            log.info("%s from %s (step %d, epoch %d%s) at %s", "resumed" if resuming else "restarted",
                     restart_from, start_step, initial_epoch, f" + {skip} steps" if skip else "", describe(amp_cfg))
        resuming = False

        # 5. Callbacks
        evaluator.evaluate = lambda: {k: float(v) for k, v in model.eval(test_ds, dataset_sink_mode=False).items()}
        telemetry = AmpTelemetry(step_cell, writer, cfg.trainer.log_every, plan.kind)
        watch = DivergenceWatch(telemetry.read, plan.kind, plan.min_scale, cfg.amp.fallback, cfg.trainer.log_every)
        checkpoints = AtomicCheckpoint(ckpt_dir, cfg.model.name, cfg.trainer.ckpt_every, cfg.trainer.keep_last,
                                       steps_per_epoch, on_save=writer.flush if writer else None)
        stop = GracefulStop(checkpoints.save if is_main else lambda network, step: None)
        callbacks = [StepOffset(start_step), timer, watch, telemetry, evaluator, stop]
        if is_main:
            callbacks.append(checkpoints)
        if writer is not None:
            writer.add_scalar("amp/rung", rung, start_step)
            callbacks.append(TensorBoardLogger(writer, lambda s: float(lr[min(s, len(lr) - 1)]),
                                               per_step, cfg.trainer.log_every, timer))
        if cfg.logger.progress_bar and is_main:
            callbacks.append(ProgressBar(steps_per_epoch, cfg.trainer.log_every))
        if cfg.trainer.max_steps > 0:
            callbacks.append(StopAtStep(cfg.trainer.max_steps))
        if cfg.runtime.profile and is_main and rung == 0:
            from amp.profile import ProfileSteps
            callbacks.append(ProfileSteps(run_dir, report, device, start=start_step + 2))
        callbacks.extend(extra_callbacks)

        # 6. Train. Resuming mid-epoch, the batches that epoch had left run as a pass of their own first
        #    (MindSpore wants every pass over a dataset to have the same length).
        t_train = time.perf_counter()
        sink_size = cfg.trainer.sink_size if sink else -1
        passes = [(initial_epoch, skip, initial_epoch + 1)] if skip else []
        passes.append((initial_epoch + bool(skip), 0, epochs))
        for first_epoch, skip_batches, end_epoch in passes:
            budget_spent = cfg.trainer.max_steps and timer.steps and timer.steps[-1] >= cfg.trainer.max_steps
            if first_epoch >= epochs or watch.reason or stop.signal or budget_spent:
                break
            train_ds = create_dataset(cfg.dataset, "train", shard, start_epoch=first_epoch, seed=cfg.runtime.seed,
                                      skip_batches=skip_batches)
            callbacks[0] = StepOffset(first_epoch * steps_per_epoch + skip_batches)
            model.train(end_epoch, train_ds, callbacks=callbacks, dataset_sink_mode=sink, sink_size=sink_size,
                        initial_epoch=first_epoch)
        train_time = time.perf_counter() - t_train
        amp_summaries.append({"rung": rung, "setting": describe(amp_cfg), **telemetry.summary()})
        if stop.signal:
            log.warning("%s: stopped after step %d and saved %s", stop.signal, stop.step, checkpoints.latest)
            print(f"stopped by {stop.signal} at step {stop.step}; resume with: python train.py "
                  f"recipe={cfg.recipe_name} hydra.run.dir={run_dir} resume=auto", flush=True)
            return None
        if watch.reason is None:
            break
        if rung + 1 == len(rungs):
            fail(watch.advice() if len(rungs) == 1 else f"{watch.reason}; no rung left on the fallback ladder",
                 code=1)
        restart_from = last_good_checkpoint(ckpt_dir)
        transitions.append({"step": watch.step, "from": describe(amp_cfg), "to": describe(rungs[rung + 1]),
                            "reason": watch.reason, "restart_from": restart_from.name if restart_from else None})
        log.warning("fallback: %s; continuing at %s from %s", watch.reason, describe(rungs[rung + 1]),
                    restart_from.name if restart_from else "the initial weights")
        start_step = int(read_checkpoint(restart_from)["step_num"].asnumpy()) if restart_from else 0

    # 7. Final evaluation and metrics.json
    steps_done = timer.steps[-1] if timer.steps else 0
    final = evaluator.evaluate()
    if getattr(DATASETS[cfg.dataset.name], "task", "") == "translation":
        final.update(translate(net, cfg, "test", cfg.decode.beam, cfg.decode.length_penalty,
                               run_dir / "hypotheses.txt"))
    evaluator.record(round(steps_done / steps_per_epoch, 2), steps_done, final)
    summary = {
        "recipe": cfg.recipe_name, "model": cfg.model.name, "dataset": cfg.dataset.name,
        "data": cfg.dataset.path or "embedded", "device": device, "mode": cfg.runtime.mode.value,
        "sink": sink, "amp_level": policy.level, "amp_dtype": policy.dtype, "batch_size": cfg.dataset.batch_size,
        "world_size": world, "global_batch": global_batch,
        "epochs": epochs, "steps": steps_done, "wall_time_s": round(time.perf_counter() - t_start, 2),
        "train_time_s": round(train_time, 2), **timer.summary(per_step),
        "throughput_unit": "padded tokens" if by_tokens else "samples",
        "final": final, "eval_history": evaluator.history, "amp": amp_summaries[-1],
        "fallback": {"enabled": cfg.amp.fallback.enabled, "transitions": transitions, "rungs": amp_summaries},
        "checkpoint": str(checkpoints.latest), "target": OmegaConf.to_container(cfg.target),
        "onednn": ONEDNN_NOTE, "smoke": smoke_note,
    }
    log.info("rank %d of %d: parameter checksum %s", rank, world, parameter_checksum(net))
    if not is_main:
        return final.get("top1", 0.0)
    (run_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
    if writer is not None:
        writer.close()
    log.info("final: %s", ", ".join(f"{k}={v:.4f}" for k, v in final.items() if isinstance(v, float)))
    log.info("wrote %s", run_dir / "metrics.json")
    return final.get("top1", 0.0)


def resume_run_dir(argv) -> list:
    """resume=auto without hydra.run.dir: the newest run directory of the recipe that holds a checkpoint."""
    if "resume=auto" not in argv or any(a.startswith("hydra.run.dir=") for a in argv):
        return []
    recipe = next((a.split("=", 1)[1] for a in argv if a.startswith("recipe=")), None)
    if recipe is None:
        from zoo.config import compose
        recipe = compose([]).recipe_name
    found = sorted(Path("runs", recipe).glob("*/checkpoints/*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not found:
        fail(f"resume=auto found no checkpoint under runs/{recipe}/; start without resume, or give "
             f"hydra.run.dir=RUN_DIR or resume=PATH/TO.ckpt")
    return [f"hydra.run.dir={found[-1].parent.parent}"]


if __name__ == "__main__":
    check_command_line(sys.argv[1:])
    sys.argv += resume_run_dir(sys.argv[1:])
    main()
