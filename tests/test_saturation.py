"""The 910A's finite overflows: in saturation mode an update whose gradients overflowed is applied (no overflow
skipping) and the weights stay finite. The stop message must say so, and neither the fallback ladder nor a resume
may restart from a checkpoint that holds such an update, though it passes the finiteness test. The NPU's status
ops are stood in for (tests/test_device_paths.py's NpuStatus)."""
import logging

import numpy as np
import pytest
from omegaconf import OmegaConf

import mindspore as ms

from ampzoo.amp.fallback import DivergenceWatch
from ampzoo.amp.telemetry import AmpTelemetry
from ampzoo.engine.checkpoint import last_good_checkpoint, resume_point
from tests.test_device_paths import Context, NpuStatus, fallback_cfg, saturating_net


@pytest.fixture
def step_910a(monkeypatch):
    """resnet34_o2's setting (a fixed scale that keeps every update) on a 910A whose forward pass saturates."""
    import mindspore.nn.wrap.loss_scale as ms_loss_scale

    from ampzoo.amp.loss_scale import AmpTrainStep, plan_loss_scale
    ms.set_context(mode=ms.PYNATIVE_MODE)  # the stand-ins are Python: they run only op by op
    npu = NpuStatus()
    monkeypatch.setattr(ms_loss_scale, "NPUGetFloatStatusV2", npu.get())
    monkeypatch.setattr(ms_loss_scale, "NPUClearFloatStatusV2", npu.clear())
    ls = OmegaConf.create({"type": "fixed", "scale": 1024.0, "drop_overflow_update": False, "min_scale": 1.0})
    net = saturating_net(npu)
    step = AmpTrainStep(net, ms.nn.SGD(net.trainable_params(), 0.1), plan_loss_scale(ls), "Ascend")
    step.gpu_target, step.ascend_910a_target, step.ascend_910b_target = False, True, False
    step.on_cpu, step.saturation_mode = False, True
    yield step
    ms.set_context(mode=ms.GRAPH_MODE)


def test_a_saturated_update_stops_the_run_without_claiming_non_finite_weights(step_910a):
    x, y = ms.Tensor(np.ones((2, 4), np.float32)), ms.Tensor(np.array([0, 1], np.int32))
    telemetry = AmpTelemetry(step_910a, None, 1, "fixed")
    watch = DivergenceWatch(telemetry.read, "fixed", 1.0, fallback_cfg(), 1, saturation=step_910a.saturation_mode)
    ctx = Context()
    watch.on_train_begin(ctx)
    step_910a(x, y)
    ctx.args.cur_step_num = 1
    watch.on_train_step_end(ctx)
    assert step_910a.weights_finite(), "saturation: the weights stay finite"
    assert ctx.stopped and watch.reason == (
        "by step 1: an update whose gradients overflowed was applied to the weights (no overflow skipping); this "
        "Ascend saturates an overflow to the largest float16 instead of inf, so the weights stay finite but hold it")
    assert "no longer finite" not in watch.advice()


def save(path, step, overflowed_updates):
    params = {"w": np.array([1.0, 2.0], np.float32), "step_num": np.array(step, np.int32),
              "amp_nonfinite_updates": np.array(overflowed_updates, np.int32)}
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in params.items()], str(path))
    return path


def test_the_ladder_and_a_resume_skip_a_finite_checkpoint_that_holds_an_overflowed_update(tmp_path, caplog):
    """The checkpoint rank 0 saves when the watch stops is finite on a 910A but holds the update the ladder
    rolls back: the next rung, and a later resume=auto, start from the one before."""
    good = save(tmp_path / "lenet5-e0000-s00000010.ckpt", 10, 0)
    held = save(tmp_path / "lenet5-e0000-s00000020.ckpt", 20, 1)
    with caplog.at_level(logging.WARNING, logger="amp_zoo"):
        path, params = resume_point(tmp_path)
    assert path == good and int(params["step_num"].asnumpy()) == 10
    assert f"resume: skipping {held.name}: it holds an update that overflowed" in caplog.text
    assert last_good_checkpoint(tmp_path, remove=False)[0] == good and held.exists(), "only rank 0 removes"
    assert last_good_checkpoint(tmp_path, remove=True)[0] == good and not held.exists()


def test_metrics_say_when_the_nonfinite_counters_cannot_count(step_910a):
    """In saturation mode a batch with inf/NaN and a non-finite loss count as overflows: metrics.json's amp block
    says so, so that nonfinite_input_batches 0 is not read as clean data."""
    telemetry = AmpTelemetry(step_910a, None, 1, "fixed")
    assert telemetry.summary()["saturation_mode"] is True



@pytest.mark.parametrize("cleared", [True, False])
def test_an_evaluation_that_saturated_is_not_counted_as_the_next_steps_overflow(monkeypatch, caplog, cleared):
    """resnet34_o2's 910A setting (a fixed scale that keeps every update): an fp16 evaluation between epochs that
    saturates sets the NPU's status. Read and cleared after the evaluation, the next clean step counts nothing;
    left set (MindSpore's own cell), that step counts a non-finite update and the watch stops the run."""
    import mindspore.nn.wrap.loss_scale as ms_loss_scale

    from ampzoo.amp.loss_scale import AmpTrainStep, plan_loss_scale
    from ampzoo.engine.callbacks import NpuStatusClear
    ms.set_context(mode=ms.PYNATIVE_MODE)
    npu = NpuStatus()
    monkeypatch.setattr(ms_loss_scale, "NPUGetFloatStatusV2", npu.get())
    monkeypatch.setattr(ms_loss_scale, "NPUClearFloatStatusV2", npu.clear())
    try:
        net = ms.nn.WithLossCell(ms.nn.Dense(4, 2), ms.nn.SoftmaxCrossEntropyWithLogits(sparse=True,
                                                                                          reduction="mean"))
        ls = OmegaConf.create({"type": "fixed", "scale": 1024.0, "drop_overflow_update": False, "min_scale": 1.0})
        step = AmpTrainStep(net, ms.nn.SGD(net.trainable_params(), 0.1), plan_loss_scale(ls), "Ascend")
        step.gpu_target, step.ascend_910a_target, step.ascend_910b_target = False, True, False
        step.on_cpu, step.saturation_mode = False, True
        npu.register = 1  # epoch 1's evaluation saturated in fp16
        ctx = Context()
        ctx.args.cur_epoch_num = 1
        if cleared:
            with caplog.at_level(logging.INFO, logger="amp_zoo"):
                NpuStatusClear(step.clear_status).on_train_epoch_end(ctx)
            assert npu.events == ["read", "clear"] and "epoch 1's evaluation saturated in fp16" in caplog.text
        x, y = ms.Tensor(np.ones((2, 4), np.float32)), ms.Tensor(np.array([0, 1], np.int32))
        step(x, y)  # a clean step: nothing in it saturates
        assert int(step.amp_nonfinite_updates.asnumpy()) == (0 if cleared else 1)
        assert NpuStatusClear(step.clear_status).clear() is False  # the step itself cleared what it read
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
