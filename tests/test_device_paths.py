"""The Ascend and GPU paths, checked on a CPU: callbacks driven the way a data sink drives them (MindSpore adds a
whole sink to cur_step_num before a host step's callbacks run), the device and sink decisions, the device id
under msrun, saturation-mode overflow checks, and bf16 on a 910A. What only a device can confirm is listed in
the README's "Ascend and GPU" section."""
import logging
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

import mindspore as ms

from ampzoo.amp.fallback import DivergenceWatch
from ampzoo.amp.loss_scale import saturation_mode
from ampzoo.amp.telemetry import AmpTelemetry, crossed
from ampzoo.engine.callbacks import EpochLog, GracefulStop, TensorBoardLogger
from ampzoo.engine.checkpoint import last_good_checkpoint
from ampzoo.engine.load import load_config
from ampzoo.errors import ConfigError
from ampzoo.runtime import pick_device, set_context, sink_mode

SINK = 937  # steps per sink: one epoch of lenet_fashion at batch 64


class Context:
    """A run context as Model.train hands it to callbacks."""

    def __init__(self, step=0, epoch=0):
        self.args = SimpleNamespace(cur_step_num=step, cur_epoch_num=epoch, epoch_num=3, net_outputs=None,
                                    train_network=None)
        self.stopped = False

    def original_args(self):
        return self.args

    def request_stop(self):
        self.stopped = True

    def get_stop_requested(self):
        return self.stopped


class Counters:
    """AmpTrainStep's in-graph counters as telemetry() reads them; `events` adds to them at given steps."""

    def __init__(self, events=None):
        self.step, self.events = 0, events or {}
        self.values = dict.fromkeys(["amp_steps", "amp_overflow_steps", "amp_skipped_steps",
                                     "amp_steps_since_overflow", "amp_floor_overflows", "amp_nonfinite_losses",
                                     "amp_nonfinite_inputs", "amp_nonfinite_updates"], 0)

    def run_to(self, step):
        for s in range(self.step + 1, step + 1):
            for key, n in self.events.get(s, {}).items():
                self.values[key] += n
        self.step = step

    def telemetry(self):
        return {**self.values, "loss_scale": 1024.0}


def fallback_cfg(enabled=False):
    return OmegaConf.create({"enabled": enabled, "overflow_rate": 0.5, "window": 50})


def drive(callbacks, counters, ctx, host_steps, size, epoch_end=False):
    """Host steps the way a sink advances them: cur_step_num jumps by `size` before the step's callbacks."""
    for _ in range(host_steps):
        if epoch_end:
            ctx.args.cur_epoch_num += 1
            for cb in callbacks:
                getattr(cb, "on_train_epoch_begin", lambda c: None)(ctx)
        ctx.args.cur_step_num += size
        counters.run_to(ctx.args.cur_step_num)
        for cb in callbacks:
            getattr(cb, "on_train_step_begin", lambda c: None)(ctx)
        for cb in callbacks:
            cb.on_train_step_end(ctx)
        if epoch_end:
            for cb in callbacks:
                getattr(cb, "on_train_epoch_end", lambda c: None)(ctx)
        if ctx.stopped:
            break


def test_crossed_counts_a_sink_that_steps_over_a_multiple():
    assert crossed(0, 937, 10) and crossed(937, 1874, 10)  # 937 % 10 != 0: an exact-multiple test never fires
    assert not crossed(11, 19, 10) and crossed(19, 20, 10) and crossed(0, 1, 1)


@pytest.mark.parametrize("size", [1, SINK])
def test_divergence_is_caught_within_one_sink(size):
    counters = Counters({SINK + 5: {"amp_nonfinite_updates": 1}})  # in the second sink
    telemetry = AmpTelemetry(counters, None, 10, "fixed")
    watch = DivergenceWatch(telemetry.read, "fixed", 1.0, fallback_cfg(), 10)
    ctx = Context()
    for cb in (telemetry, watch):
        cb.on_train_begin(ctx)
    drive([watch, telemetry], counters, ctx, 3 * SINK // size, size)
    assert watch.reason is not None and ctx.stopped
    assert watch.step <= 2 * SINK and watch.step >= SINK + 5, watch.step  # by the end of the sink it happened in
    assert f"by step {watch.step}" in watch.reason


def test_the_watch_checks_the_steps_after_its_last_check_at_the_end():
    counters = Counters({25: {"amp_floor_overflows": 1}})
    telemetry = AmpTelemetry(counters, None, 10, "dynamic")
    watch = DivergenceWatch(telemetry.read, "dynamic", 1.0, fallback_cfg(), 10)
    ctx = Context()
    watch.on_train_begin(ctx)
    drive([watch], counters, ctx, 27, 1)  # a run (or a step budget) that ends at step 27
    assert watch.reason is None, "not yet checked: the last check was at step 20"
    watch.on_train_end(ctx)
    assert watch.reason is not None and watch.step == 27 and "minimum loss scale" in watch.reason


def test_overflow_rate_window_counts_real_steps_under_a_sink():
    counters = Counters({s: {"amp_overflow_steps": 1} for s in range(1, 3 * 100 + 1)})  # every step overflows
    telemetry = AmpTelemetry(counters, None, 10, "dynamic")
    watch = DivergenceWatch(telemetry.read, "dynamic", 1.0, fallback_cfg(enabled=True), 10)
    ctx = Context()
    watch.on_train_begin(ctx)
    drive([watch], counters, ctx, 3, 100)
    assert watch.step == 100 and "100 of the last 100 steps overflowed" in watch.reason


def test_telemetry_logs_every_sink_and_its_rate(caplog):
    counters = Counters({SINK + 1: {"amp_nonfinite_inputs": 2}, 2 * SINK: {"amp_overflow_steps": 3}})
    telemetry = AmpTelemetry(counters, None, 10, "dynamic")
    ctx = Context()
    telemetry.on_train_begin(ctx)
    with caplog.at_level(logging.WARNING, logger="amp_zoo"):
        drive([telemetry], counters, ctx, 2, SINK)
    assert "by step 1874: 2 batch(es) with NaN/Inf inputs skipped" in caplog.text
    assert telemetry.last["step"] == 2 * SINK and telemetry.last["overflow_rate"] == pytest.approx(3 / SINK)


def test_epoch_log_counts_a_sinks_steps(caplog):
    ctx = Context()
    ctx.args.net_outputs = ms.Tensor([0.5], ms.float32)
    log_cb = EpochLog(64, "samples", 3)
    with caplog.at_level(logging.INFO, logger="amp_zoo"):
        drive([log_cb], Counters(), ctx, 2, SINK, epoch_end=True)
    assert f"epoch 2/3: step {2 * SINK}, loss 0.5000, {SINK} steps in" in caplog.text, caplog.text


def test_tensorboard_gets_a_point_every_sink():
    points = []
    writer = SimpleNamespace(add_scalar=lambda tag, value, step: points.append((tag, step)))
    timer = SimpleNamespace(last=0.0)
    ctx = Context()
    ctx.args.net_outputs = ms.Tensor([0.5], ms.float32)
    logger = TensorBoardLogger(writer, lambda s: 0.1, 64, 10, timer)
    logger.on_train_begin(ctx)
    drive([logger], Counters(), ctx, 3, SINK)
    assert sorted({s for tag, s in points if tag == "train/loss"}) == [SINK, 2 * SINK, 3 * SINK]


def test_profile_window_is_real_steps_after_the_compile_step(monkeypatch, tmp_path):
    import mindspore.profiler as profiler

    from ampzoo.amp import profile as amp_profile
    started = []
    monkeypatch.setattr(profiler, "profile", lambda **kw: SimpleNamespace(start=lambda: started.append(1),
                                                                         stop=lambda: None))
    monkeypatch.setattr(profiler, "tensorboard_trace_handler", lambda path: None)
    monkeypatch.setattr(amp_profile, "op_times", lambda d, device: [("Default/optimizer-Momentum/ApplyMomentum-op1",
                                                             "ApplyMomentum", 1.0)])
    report = {"cells": [{"path": "(root)", "compute_dtype": "float32"}]}
    for size, window in [(1, [2, 6]), (100, [101, 200])]:
        cb = amp_profile.ProfileSteps(tmp_path, report, "Ascend", start=2)
        ctx = Context()
        cb.on_train_begin(ctx)
        drive([cb], Counters(), ctx, 8, size)
        assert cb.done and cb.window == window and len(started) == 1, (size, cb.window)
        started.clear()
    assert (tmp_path / "profile.md").exists()


@contextmanager
def handling(stop, ctx):
    """GracefulStop's signal handlers in place for the block, as between on_train_begin and on_train_end."""
    stop.on_train_begin(ctx)
    try:
        yield
    finally:
        stop.on_train_end(ctx)


def test_ranks_stop_together_at_the_next_boundary():
    saved = []
    asks = []

    def agree(flag):  # as if another rank had the signal from step 13 on
        asks.append(flag)
        return flag or ctx.args.cur_step_num >= 13

    stop = GracefulStop(lambda net, step: saved.append(step), agree=agree, every=10)
    ctx = Context()
    with handling(stop, ctx):
        drive([stop], Counters(), ctx, 30, 1)
    assert saved == [20] and stop.step == 20 and ctx.stopped, "acts at the boundary every rank reaches"
    assert stop.signal == "a signal to another rank" and asks == [False, False]


def test_a_single_process_stops_at_the_next_step_and_names_the_signal():
    import os
    import signal
    saved = []
    stop, ctx = GracefulStop(lambda net, step: saved.append(step)), Context()
    with handling(stop, ctx):
        drive([stop], Counters(), ctx, 3, 1)
        os.kill(os.getpid(), signal.SIGINT)
        drive([stop], Counters(), ctx, 3, 1)
    assert saved == [4] and stop.signal == "SIGINT"


def test_a_signal_the_compiler_swallowed_stops_at_the_first_step(monkeypatch):
    """MindSpore's compiler may clear the Interrupted a signal raised (ampzoo.interrupt): training still stops at its
    first step and saves, instead of running to the end with exit 0."""
    import signal
    from ampzoo import interrupt
    monkeypatch.setattr(interrupt, "_received", [signal.SIGTERM])
    saved = []
    stop, ctx = GracefulStop(lambda net, step: saved.append(step)), Context()
    with handling(stop, ctx):
        drive([stop], Counters(), ctx, 3, 1)
    assert saved == [1] and ctx.stopped and stop.signum == signal.SIGTERM


def test_the_device_id_is_left_to_mindspore_unless_the_user_sets_one(monkeypatch):
    calls = []
    monkeypatch.setattr(ms, "set_device", lambda *args: calls.append(args))
    monkeypatch.setattr(ms, "set_context", lambda **kw: None)
    monkeypatch.setenv("DEVICE_ID", "5")  # as msrun sets it for a rank; MindSpore reads it when no id is given
    monkeypatch.setenv("RANK_ID", "5")
    runtime = OmegaConf.create({"device": "CPU", "device_id": None, "mode": "graph", "deterministic": False})
    set_context(runtime)
    runtime.device_id = 3
    set_context(runtime)
    assert calls == [("CPU",), ("CPU", 3)]
    cfg, _ = load_config(["recipe=lenet_o2"])
    assert cfg.runtime.device_id is None


def test_an_explicit_device_id_under_msrun_is_refused():
    with pytest.raises(ConfigError, match="would put every rank on device 0"):
        load_config(["recipe=lenet_o2", "runtime.distributed=true", "runtime.device_id=0"])


def test_a_sink_size_other_than_an_epoch_is_refused():
    with pytest.raises(ConfigError, match="trainer.sink_size=100: MindSpore counts each sink as an epoch"):
        load_config(["recipe=lenet_o2", "trainer.sink_size=100"])
    load_config(["recipe=lenet_o2", "trainer.sink_size=100", "trainer.sink=false"])  # not sinking: no effect


def test_sinking_is_off_where_it_cannot_be_right():
    assert sink_mode("Ascend", True) [0] is True
    assert sink_mode("GPU", True, shapes_vary=True)[0] is False
    assert "change shape" in sink_mode("Ascend", True, shapes_vary=True)[1]
    assert "trainer.max_steps=50" in sink_mode("Ascend", True, max_steps=50)[1]
    assert sink_mode("CPU", True)[0] is False and sink_mode("Ascend", False)[0] is False
    assert "runtime.profile=true profiles a few steps" in sink_mode("Ascend", True, profile=True)[1]


def test_device_detection_uses_the_device_context_api(monkeypatch):
    monkeypatch.setattr(ms.device_context.ascend, "is_available", lambda: True)
    assert pick_device("auto") == "Ascend"
    monkeypatch.setattr(ms.device_context.ascend, "is_available", lambda: False)
    monkeypatch.setattr(ms.device_context.gpu, "is_available", lambda: True)
    assert pick_device("auto") == "GPU" and pick_device("CPU") == "CPU"


def test_saturation_mode_is_the_910a_or_a_910b_told_so(monkeypatch):
    monkeypatch.delenv("MS_ASCEND_CHECK_OVERFLOW_MODE", raising=False)
    assert saturation_mode("Ascend", True, False) and not saturation_mode("Ascend", False, True)
    monkeypatch.setenv("MS_ASCEND_CHECK_OVERFLOW_MODE", "SATURATION_MODE")
    assert saturation_mode("Ascend", False, True)
    assert not saturation_mode("CPU", True, True) and not saturation_mode("GPU", True, True)


def test_bf16_is_refused_on_a_910a(monkeypatch):
    from ampzoo.amp import policy
    amp_cfg = OmegaConf.create({"level": "O2", "dtype": "bfloat16", "force_fp16": []})
    monkeypatch.setattr(policy, "ascend_910a", lambda: True)
    with pytest.raises(ConfigError, match="not supported on an Ascend 910A"):
        policy.check_device_dtype("Ascend", amp_cfg)
    monkeypatch.setattr(policy, "ascend_910a", lambda: False)
    policy.check_device_dtype("Ascend", amp_cfg)


def test_only_rank_0_removes_checkpoints_from_a_shared_folder(tmp_path):
    import numpy as np
    net_params = {"w": ms.Parameter(ms.Tensor(np.array([np.nan], np.float32)), name="w")}
    path = tmp_path / "lenet5-e0001-s00000010.ckpt"
    ms.save_checkpoint([{"name": k, "data": v} for k, v in net_params.items()], str(path))
    assert last_good_checkpoint(tmp_path, remove=False) == (None, None) and path.exists()
    assert last_good_checkpoint(tmp_path, remove=True) == (None, None) and not path.exists()


@pytest.mark.parametrize("device", ["Ascend", "GPU"])
def test_networks_build_mindspores_own_cells_off_the_cpu(monkeypatch, device):
    """The CPU kernels (cpu_kernels/) are custom ops built for the CPU: on Ascend and GPU, ResNet must get
    nn.Conv2d, nn.BatchNorm2d (and nn.MaxPool2d in the ImageNet stem), and LeNet nn.Conv2d, its written-out
    MaxPool2x2 and Dense layers that run nn.Dense's own construct, whatever the extension does here
    (runtime.cpu_kernels=auto); `on` there is one error naming the device."""
    from ampzoo.engine import network
    from ampzoo.models import create_model
    from tests.conftest import built_with
    from ampzoo.errors import ConfigError
    real = ms.get_context
    monkeypatch.setattr(network.ms, "get_context", lambda key: device if key == "device_target" else real(key))
    resnet = built_with("auto", lambda: create_model("resnet18", num_classes=10, stem="imagenet", width=8))
    lenet = built_with("auto", lambda: create_model("lenet5", num_classes=10))
    cells = [c for net in (resnet, lenet) for _, c in net.cells_and_names()]
    assert not any(type(c).__name__.startswith("Cpu") for c in cells)
    with pytest.raises(ConfigError, match=f"run on the CPU only \\(the device is {device}\\)"):
        built_with("on", lambda: create_model("lenet5", num_classes=10))
    assert type(resnet.stem[3]) is ms.nn.MaxPool2d
    assert type(lenet.pool).__name__ == "MaxPool2x2"
    assert type(lenet.conv1) is ms.nn.Conv2d and type(lenet.fc1) is ms.nn.Dense


def tokenizer_data(cache_dir):
    from ampzoo.compose import compose
    cfg = compose(["recipe=transformer_tiny_multi30k_o0"])
    data = OmegaConf.create(OmegaConf.to_container(OmegaConf.merge(cfg.dataset, cfg.smoke.dataset)))
    data.params.cache_dir = str(cache_dir)
    return data


def test_ranks_build_the_shared_tokenizer_once_and_all_use_it(tmp_path, monkeypatch):
    """msrun starts every rank at once with an empty ~/.cache/amp_zoo: one builds the sentencepiece model
    under the lock beside it, the others wait and read the same file; nothing half-built is left behind."""
    import multiprocessing

    import sentencepiece as spm

    from ampzoo.data.translation import tokenizer_file
    builds = tmp_path / "builds.txt"
    real = spm.SentencePieceTrainer.train

    def counted(**kw):
        with open(builds, "a") as f:
            f.write("built\n")
        return real(**kw)

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", counted)
    data, results = tokenizer_data(tmp_path / "cache"), tmp_path / "results"
    results.mkdir()
    ready = multiprocessing.get_context("fork").Barrier(3)

    def rank(i):
        ready.wait()
        (results / str(i)).write_text(str(tokenizer_file(data)))

    procs = [multiprocessing.get_context("fork").Process(target=rank, args=(i,)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    paths = {(results / str(i)).read_text() for i in range(3)}
    assert len(paths) == 1 and builds.read_text() == "built\n"
    model = Path(paths.pop())
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [model.name, model.name + ".lock"]


def test_an_unwritable_tokenizer_cache_names_the_cache_not_the_checkpoints(tmp_path):
    from ampzoo.data.translation import tokenizer_file
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    with pytest.raises(ConfigError, match=r"could not write the tokenizer cache .*set dataset.params.cache_dir") as e:
        tokenizer_file(tokenizer_data(tmp_path / "cache"))
    assert "checkpoint" not in str(e.value)


@pytest.mark.parametrize("role", ["MS_WORKER", "MS_SCHED"])
def test_msrun_without_distributed_is_refused_on_every_process(tmp_path, role):
    """msrun's workers and its scheduler run the same command: without runtime.distributed=true each would train
    as rank 0 of 1 into one directory. Each refuses with one line and exit 2, before Hydra makes the directory."""
    from tests.conftest import run_cli
    env = {"MS_ROLE": role, "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118"}
    result = run_cli("train.py", "recipe=lenet_o0", f"hydra.run.dir={tmp_path / 'run'}", env=env, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: msrun started this process (MS_ROLE={role}, MS_WORKER_NUM=2, MS_SCHED_HOST=127.0.0.1, "
        f"MS_SCHED_PORT=8118) but runtime.distributed=false: every worker (and msrun's scheduler) would train alone "
        f"as rank 0 of 1 into the same run directory; add runtime.distributed=true"]
    assert not (tmp_path / "run").exists()


def test_a_held_run_directory_ends_every_rank_under_msrun(tmp_path):
    """Rank 0 holds the run directory for the run; when another run holds it, every rank ends with one line
    (agreed by an all-reduce, stood in for here), none waits alone in a collective."""
    import fcntl
    import os

    from ampzoo.engine.rundir import claim_by_rank0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    other = os.open(run_dir / ".run.lock", os.O_RDWR | os.O_CREAT)  # another run's hold
    fcntl.flock(other, fcntl.LOCK_EX)
    flags = []
    try:
        with pytest.raises(ConfigError, match=f"run directory {run_dir} is in use by"):
            claim_by_rank0(run_dir, 0, lambda flag: flags.append(flag) or flag)
        with pytest.raises(ConfigError, match="in use by another run \\(rank 0's log names the process\\)"):
            claim_by_rank0(run_dir, 1, lambda flag: flags.append(flag) or True)  # rank 0 reported it
    finally:
        os.close(other)
    assert flags == [True, False]
    claim_by_rank0(run_dir, 1, lambda flag: flag)  # a free directory: rank 1 holds nothing and goes on
    claim_by_rank0(run_dir, 0, lambda flag: flag)
    from ampzoo.engine.rundir import HELD, release
    assert run_dir.resolve() in HELD
    release(run_dir)


class NpuStatus:
    """Stand-ins for the NPU float-status ops (no CPU kernel): a register that a saturating forward or backward
    sets, that NPUGetFloatStatusV2 reads and NPUClearFloatStatusV2 clears; `events` records their order."""

    def __init__(self):
        self.register, self.events = 0, []

    def get(self):
        outer = self

        class Get:
            def __call__(self, status):
                outer.events.append("read")
                return ms.Tensor([outer.register] * 8, ms.int32)
        return Get

    def clear(self):
        outer = self

        class Clear:
            def __call__(self, status):
                outer.events.append("clear")
                outer.register = 0
                return status
        return Clear


def saturating_net(npu):
    """LeNet-sized stand-in whose forward pass saturates (as fp16 overflow on a 910A): it sets the register."""
    class Saturating(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = ms.nn.Dense(4, 2)

        def construct(self, x, y):
            npu.events.append("forward")
            npu.register = 1
            return ms.ops.cross_entropy(self.dense(x), y)
    return Saturating()


@pytest.mark.parametrize("loss_scale", ["dynamic", "none"])
def test_saturation_mode_reads_the_npu_status_where_mindspores_own_step_does(monkeypatch, loss_scale):
    """On a 910A, MindSpore 2.10's TrainOneStepWithLossScaleCell reads the status after the backward and clears it
    after the read; clearing it after the forward (start_overflow_check) would hide a saturated forward pass.
    The step's order of forward/read/clear must be MindSpore's own, and a forward that saturates counts: the
    step is skipped and the scale halves (dynamic), or a non-finite update is counted (no skipping)."""
    import numpy as np
    import mindspore.nn.wrap.loss_scale as ms_loss_scale

    from ampzoo.amp.loss_scale import AmpTrainStep, plan_loss_scale
    ms.set_context(mode=ms.PYNATIVE_MODE)  # the stand-ins are Python: they run only op by op
    npu = NpuStatus()
    monkeypatch.setattr(ms_loss_scale, "NPUGetFloatStatusV2", npu.get())
    monkeypatch.setattr(ms_loss_scale, "NPUClearFloatStatusV2", npu.clear())
    x, y = ms.Tensor(np.ones((2, 4), np.float32)), ms.Tensor(np.array([0, 1], np.int32))
    ls = OmegaConf.create({"type": loss_scale, "init_scale": 1024.0, "factor": 2.0, "window": 1000,
                           "scale": 1024.0, "drop_overflow_update": False, "min_scale": 1.0})

    def on_910a(cell):
        cell.gpu_target, cell.ascend_910a_target, cell.ascend_910b_target = False, True, False
        return cell

    try:
        net = saturating_net(npu)
        reference = on_910a(ms.nn.TrainOneStepWithLossScaleCell(
            net, ms.nn.SGD(net.trainable_params(), 0.1), ms.Tensor(1024.0, ms.float32)))
        reference(x, y)
        theirs, npu.events = npu.events, []
        net = saturating_net(npu)
        step = on_910a(AmpTrainStep(net, ms.nn.SGD(net.trainable_params(), 0.1), plan_loss_scale(ls), "Ascend"))
        step.on_cpu, step.saturation_mode = False, True
        before = net.dense.weight.asnumpy().copy()
        _, overflow, _ = step(x, y)
        assert npu.events == theirs and theirs[-2:] == ["read", "clear"] and "clear" not in theirs[:-1], theirs
        if loss_scale == "dynamic":
            assert bool(overflow.asnumpy()) and np.array_equal(net.dense.weight.asnumpy(), before)
            assert float(step.scale_sense.asnumpy()) == 512.0 and int(step.amp_overflow_steps.asnumpy()) == 1
        else:
            assert int(step.amp_nonfinite_updates.asnumpy()) == 1
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)


def test_the_profile_reader_prefers_the_devices_kernel_file(tmp_path):
    """A device run profiles the host too: its CPU op file must not stand in for the device's kernels."""
    from ampzoo.amp.profile import op_times
    host = tmp_path / "host" / "FRAMEWORK"
    host.mkdir(parents=True)
    (host / "cpu_op_detail_info_0.csv").write_text(
        "full_op_name,op_type,op_total_time(ms)\nDefault/GetNext-op1,GetNext,9.0\n")
    ascend = tmp_path / "rank" / "ASCEND_PROFILER_OUTPUT"
    ascend.mkdir(parents=True)
    (ascend / "kernel_details.csv").write_text(
        "Step Id,Name,Type,Duration(us)\n"
        "1,Default/network-NetWithLoss/net-LeNet5/conv1-Conv2d/Conv2D-op3,Conv2D,250.0\n")
    assert op_times(tmp_path, "Ascend") == [("Default/network-NetWithLoss/net-LeNet5/conv1-Conv2d/Conv2D-op3",
                                             "Conv2D", 0.25)]
    assert op_times(tmp_path, "CPU") == [("Default/GetNext-op1", "GetNext", 9.0)]
    assert op_times(tmp_path, "GPU") == [("Default/GetNext-op1", "GetNext", 9.0)]  # none of its own: the host's


def test_every_rank_profiles_the_same_window_and_rank_0_alone_writes_the_summary(monkeypatch, tmp_path):
    import mindspore.profiler as profiler

    from ampzoo.amp import profile as amp_profile
    stopped, folders = [], []
    def stop():
        stopped.append(ctx.args.cur_step_num)
    monkeypatch.setattr(profiler, "profile", lambda **kw: SimpleNamespace(start=lambda: None, stop=stop))
    monkeypatch.setattr(profiler, "tensorboard_trace_handler", lambda path: folders.append(path))
    monkeypatch.setattr(amp_profile, "op_times", lambda d, device: [("Default/net-LeNet5/fc1-Dense/MatMul-op1",
                                                                     "MatMul", 1.0)])
    report = {"cells": [{"path": "(root)", "compute_dtype": "float32"}]}
    for rank in (1, 0):
        cb = amp_profile.ProfileSteps(tmp_path, report, "Ascend", start=2, rank=rank)
        ctx = Context()
        cb.on_train_begin(ctx)
        drive([cb], Counters(), ctx, 10, 1)
        assert not (tmp_path / "profile.md").exists() or rank == 0
    assert stopped == [6, 6] and folders == [str(tmp_path / "profiler" / f"rank-{r}") for r in (1, 0)]
    assert (tmp_path / "profile.md").exists()


def test_bf16_is_refused_on_gpu_before_anything_runs(monkeypatch):
    """MindSpore 2.10's GPU plugin has no bfloat16 kernels: the run would fail at its first step."""
    monkeypatch.setattr(ms.device_context.gpu, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="amp.dtype=bfloat16 is not supported on GPU: MindSpore has no GPU bfloat16 "
                                          "kernel for Conv2D, MatMul, BatchNorm or LayerNorm"):
        load_config(["recipe=lenet_o2", "runtime.device=GPU", "amp.dtype=bfloat16"])
    load_config(["recipe=lenet_o2", "runtime.device=GPU", "amp.dtype=float16"])


ACL_FAILURE = ("Call aclrtMalloc failed, ret: 207001.\n"
               "EL0004: [PID: 4127] 2026-11-27 Failed to allocate memory.\n"
               "        Possible Cause: Available memory is insufficient.\n"
               "----------------------------------------------------\n- C++ Call Stack:\n")


def stand_in_run(device, rank, tmp_path):
    timer = SimpleNamespace(steps=[])
    cfg = OmegaConf.create({"model": {"name": "resnet34"}, "recipe_name": "resnet34_o2",
                            "dataset": {"batch_size": 32}})
    return SimpleNamespace(device=device, rank=rank, world=2, is_main=rank == 0, run_dir=tmp_path, timer=timer, cfg=cfg)


def test_a_device_failure_is_reported_as_one_not_as_a_model_that_does_not_compile(tmp_path, capsys, monkeypatch):
    """An Ascend memory failure in the first step: one line naming the device and its error, exit 1 (DeviceError,
    not the bad-input code), and a rank without train.log (under msrun, rank 1) keeps the trace in its own log."""
    from ampzoo.engine.process.failures import step_error
    from ampzoo.errors import DeviceError, TracedError
    run = stand_in_run("Ascend", 1, tmp_path)
    monkeypatch.setattr(logging.root, "handlers", [])  # as on rank 1: setup removed its train.log handler
    with pytest.raises(DeviceError) as e:
        step_error(run, RuntimeError(ACL_FAILURE), ran_before=False)
    message = str(e.value)  # out of device memory: the batch's, not the device's fault (issue 79, item 7)
    assert message.startswith("the Ascend ran out of memory in the first step (rank 1 of 2): Call aclrtMalloc failed")
    assert "at dataset.batch_size=32 a device this network does not fit its memory: lower dataset.batch_size" \
        in message and "does not compile" not in message and "not the recipe" not in message
    assert "rank 1's msrun worker log" in message and "RuntimeError: Call aclrtMalloc failed" in capsys.readouterr().err
    run.timer.steps = [5005]
    with pytest.raises(DeviceError, match="the Ascend ran out of memory after step 5005"):  # mid-run: no traceback
        step_error(run, RuntimeError(ACL_FAILURE), ran_before=True)
    hccl = "Call HcclAllReduce failed, ret=7\nEI0002: The wait execution of the Notify register times out."
    with pytest.raises(DeviceError, match=r"the Ascend failed after step 5005 .*: EI0002: The wait execution.*; "
                                          r"this is the device or its software, not the recipe: run make doctor"):
        step_error(run, RuntimeError(hccl), ran_before=True)
    shape_bug = "For 'MatMul' the input dimensions must be equal, but got 'x1_col': 1024 and 'x2_row': 32."
    run.timer.steps = []
    assert "does not compile" in step_error(run, ValueError(shape_bug), ran_before=False)
    assert "does not compile" in step_error(stand_in_run("CPU", 0, tmp_path), RuntimeError(ACL_FAILURE), False)
    assert issubclass(TracedError, ConfigError) and not issubclass(DeviceError, ConfigError)


def test_auto_says_why_it_fell_back_to_the_cpu_and_where_mindspores_log_is(monkeypatch):
    from ampzoo import runtime
    monkeypatch.setattr(ms, "set_device", lambda *args: None)
    monkeypatch.setattr(ms, "set_context", lambda **kw: None)
    monkeypatch.setattr(runtime, "plugin_errors", lambda: "Load dynamic library: libmindspore_ascend.so.2 failed. "
                                                          "libge_runner.so: cannot open shared object file")
    monkeypatch.setenv("GLOG_v", "4")
    runtime_cfg = OmegaConf.create({"device": "auto", "device_id": None, "mode": "graph", "deterministic": False})
    assert set_context(runtime_cfg) == "CPU"
    notes = runtime.device_notes(runtime_cfg, "CPU")
    assert notes[0].startswith("runtime.device=auto: CPU, as neither Ascend nor GPU is usable in this MindSpore "
                               f"{ms.__version__} (Load dynamic library: libmindspore_ascend.so.2 failed.")
    assert notes[1] == "MindSpore's own error lines: hidden by GLOG_v=4: run again with GLOG_v=3 to see them"


def test_an_msrun_worker_keeps_mindspores_own_error_lines_in_its_log(tmp_path):
    """A single process keeps MindSpore's C++ lines off its console (GLOG_v=4); an msrun worker's console is its
    worker log, where MindSpore's error lines belong (GLOG_v=3); a GLOG_v the user set is left alone."""
    import os
    import subprocess
    import sys
    from tests.conftest import ROOT
    code = "import ampzoo.entry, os; print(os.environ.get('GLOG_v'))"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOG_", "MS_"))}
    env["PYTHONPATH"] = str(ROOT)
    for extra, want in [({}, "4"), ({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "8"}, "3"), ({"GLOG_v": "1"}, "1")]:
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**env, **extra}, capture_output=True,
                             text=True)
        assert out.stdout.split() == [want], (extra, out.stderr)


def test_under_msrun_other_ranks_print_warnings_and_their_checksum_not_every_line(monkeypatch, capsys):
    """msrun tails every worker's log to the terminal: rank 1 prints no info lines rank 0 already prints, but
    keeps its warnings and the line every rank must say (its parameter checksum)."""
    import sys

    from ampzoo.engine.process.logs import rank_logging
    console, file_log = logging.StreamHandler(sys.stderr), logging.FileHandler("/dev/null")
    monkeypatch.setattr(logging.root, "handlers", [console, file_log])
    monkeypatch.setattr(logging.root, "level", logging.INFO)
    log = logging.getLogger("amp_zoo")
    monkeypatch.setattr(log, "level", logging.NOTSET)  # whatever an earlier test left
    monkeypatch.setattr(log, "disabled", False)
    monkeypatch.setattr(logging.root.manager, "disable", logging.NOTSET)
    log.manager._clear_cache()
    rank_logging()
    assert logging.root.handlers == [console]
    log.info("epoch 1/90: step 5005")
    log.warning("by step 5005: 2 batch(es) with NaN/Inf inputs skipped")
    log.info("rank 1 of 8: parameter checksum abc", extra={"every_rank": True})
    assert capsys.readouterr().err.splitlines() == ["by step 5005: 2 batch(es) with NaN/Inf inputs skipped",
                                                    "rank 1 of 8: parameter checksum abc"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_msrun_assigns_at_init_holds_its_lines_and_rank_0_alone_writes_them(monkeypatch, tmp_path, capsys,
                                                                                   rank):
    """Hosts started without --node_rank learn their ranks only at init(): until then each process holds its
    info lines and writes no .hydra record; then rank 0 writes both (train.log once, one .hydra/resume-N), and the
    other ranks drop them, keeping their warnings."""
    import sys

    from omegaconf import OmegaConf

    from ampzoo.engine.process.before_init import before_rank, hydra_overrides, rank_known
    for key, value in {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "10.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MS_NODE_ID", raising=False)
    assert hydra_overrides([".hydra/resume-2"]) == ["hydra.output_subdir=null"]  # Hydra writes none of it
    (tmp_path / ".hydra" / "resume-1").mkdir(parents=True)
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- recipe=lenet_o0\n")
    console, train_log = logging.StreamHandler(sys.stderr), logging.FileHandler(tmp_path / "train.log")
    monkeypatch.setattr(logging.root, "handlers", [console, train_log])
    monkeypatch.setattr(logging.root, "level", logging.INFO)
    log = logging.getLogger("amp_zoo")
    monkeypatch.setattr(log, "level", logging.NOTSET)
    monkeypatch.setattr(log, "disabled", False)
    monkeypatch.setattr(logging.root.manager, "disable", logging.NOTSET)
    log.manager._clear_cache()
    hydra = OmegaConf.create({"overrides": {"task": ["recipe=lenet_o0", "resume=auto"]}, "run": {"dir": "x"}})
    before_rank(OmegaConf.create({"recipe_name": "lenet_o0"}), hydra, tmp_path)
    log.info("resume: the run's config.yaml, with resume=auto from the command line")
    log.warning("a warning every rank says at once")
    assert capsys.readouterr().err.splitlines() == ["a warning every rank says at once"]
    assert train_log.stream is None or "resume:" not in (tmp_path / "train.log").read_text()
    rank_known(rank)
    log.info("command: python train.py")
    train_log.flush()
    text, err = (tmp_path / "train.log").read_text(), capsys.readouterr().err
    if rank == 0:
        assert text.count("resume: the run's config.yaml") == 1 and "command: python train.py" in text
        assert "resume: the run's config.yaml" in err
        assert OmegaConf.load(tmp_path / ".hydra" / "resume-2" / "overrides.yaml") == ["recipe=lenet_o0",
                                                                                       "resume=auto"]
        assert OmegaConf.load(tmp_path / ".hydra" / "resume-2" / "hydra.yaml").hydra.run.dir == "x"
    else:
        assert "resume:" not in text and "command:" not in text and err == ""
        assert logging.root.handlers == [console]
        assert not (tmp_path / ".hydra" / "resume-2").exists()


def test_a_worker_whose_msrun_ended_stops_as_for_a_sigterm(monkeypatch):
    """SIGTERM to msrun ends msrun alone (its workers run in sessions of their own): each orphaned worker sends
    itself one SIGTERM, so GracefulStop stops the ranks together and rank 0 saves a checkpoint."""
    import os
    import signal

    from ampzoo.engine.callbacks import LauncherWatch
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    parent = [4242]
    monkeypatch.setattr(os, "getppid", lambda: parent[0])
    watch = LauncherWatch(4242)
    ctx = Context()
    drive([watch], Counters(), ctx, 3, 1)
    assert sent == []
    parent[0] = 1  # msrun died: the worker is re-parented
    drive([watch], Counters(), ctx, 3, 1)
    assert sent == [(os.getpid(), signal.SIGTERM)]


def test_the_rank_checksum_covers_the_weights_not_batchnorms_per_rank_statistics():
    """Data-parallel ResNet: gradients are all-reduced, BatchNorm's moving mean and variance are not, so each
    rank's differ; the checksum every rank prints must agree when the weights do."""
    import numpy as np

    from ampzoo.runtime import parameter_checksum
    net = ms.nn.SequentialCell([ms.nn.Conv2d(3, 4, 3), ms.nn.BatchNorm2d(4)])
    before = parameter_checksum(net)
    bn = net[1]
    bn.moving_mean.set_data(ms.Tensor(np.full(4, 0.3, np.float32)))  # another rank's shard
    assert parameter_checksum(net) == before
    net[0].weight.set_data(net[0].weight + 1)
    assert parameter_checksum(net) != before


def test_msrun_without_a_run_directory_is_refused(monkeypatch, capsys):
    """The default run directory names the process id, so under msrun each rank would train (and resume, and fall
    back) from a directory of its own: without hydra.run.dir every process refuses with one line, exit 2."""
    from ampzoo.engine.load import check_command_line
    for key, value in {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as e:
        check_command_line(["recipe=lenet_o0", "runtime.distributed=true"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: msrun started this process, but no hydra.run.dir is given: each process's default run directory "
        "(runs/<recipe>/<time>-<pid>) is its own, so the ranks would not share their checkpoints; give "
        "hydra.run.dir=DIR"]


def test_an_msrun_rank_whose_auto_device_falls_back_to_the_cpu_stops_before_init(monkeypatch):
    """runtime.device=auto is decided per process: on a host with NPUs whose environment lacks CANN, one rank
    would train on the CPU with MCCL while the others use HCCL, and hang in the first collective. That rank stops
    before init() with one line naming it (issue 79, item 4); an explicit device, or a host without device
    hardware, is left alone."""
    from ampzoo import runtime
    from ampzoo.errors import DeviceError

    monkeypatch.setattr(runtime, "device_hardware", lambda: "Ascend")
    monkeypatch.setenv("MS_WORKER_NUM", "8")
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    monkeypatch.setenv("MS_NODE_ID", "5")
    with pytest.raises(DeviceError, match=r"^rank 5 on host .*: runtime.device=auto found no usable Ascend .*, "
                                          r"though this host has Ascend devices: it would train on the CPU while the "
                                          r"other ranks use the Ascends, and their first collective would hang; on "
                                          r"this host, source CANN's set_env.sh"):
        runtime.check_rank_device("auto", pick_device("auto"))
    runtime.check_rank_device("Ascend", "Ascend")
    monkeypatch.setattr(runtime, "device_hardware", lambda: "")
    runtime.check_rank_device("auto", "CPU")  # a CPU cluster: MCCL on every rank


def test_a_stop_at_the_end_of_a_sink_does_not_evaluate_the_test_set_first(tmp_path):
    """Under sinking a sink is the epoch: a stop signal acted on at its last step used to evaluate the whole test
    set (on every rank) before stopping (issue 79, item 7). A stop requested there skips the evaluation; an
    epoch without one is evaluated."""
    import signal

    from ampzoo.engine.callbacks import Evaluator, GracefulStop

    evaluated = []
    evaluator = Evaluator(None, 1, None, 3, SINK)
    evaluator.evaluate = lambda: evaluated.append(True) or {"top1": 0.5}
    stop = GracefulStop(lambda net, step: None)
    ctx = Context()
    stop.on_train_begin(ctx)
    try:
        drive([evaluator, stop], Counters(), ctx, 1, SINK, epoch_end=True)  # epoch 1: no signal, evaluated
        assert evaluated == [True] and not ctx.stopped
        stop._handler(signal.SIGTERM, None)
        drive([evaluator, stop], Counters(), ctx, 1, SINK, epoch_end=True)  # epoch 2: the signal came in the sink
        assert ctx.stopped and stop.step == 2 * SINK and evaluated == [True], "stopped without evaluating"
    finally:
        stop.on_train_end(ctx)


def test_a_run_on_a_busy_machine_says_so_once(caplog):
    """The kernels' pool finds the machine busy when another process holds its cores (issue 78, item 5): a run
    says so in one line, once, when another process has held them for a second; a moment is not enough."""
    from ampzoo.engine.callbacks import BusyMachine
    found = iter([10, 11, 13, 15, 40, 90])  # at train begin, then at each check
    watch = BusyMachine(5, busy=lambda: next(found), threads=2)
    ctx = Context()
    watch.on_train_begin(ctx)
    with caplog.at_level(logging.WARNING, logger="amp_zoo"):
        for step in range(1, 26):
            ctx.args.cur_step_num = step
            watch.on_train_step_end(ctx)
    said = [r.getMessage() for r in caplog.records if "the machine is busy" in r.getMessage()]
    assert len(said) == 1 and "for 1.0 s so far" in said[0] and "runtime.cpu_threads" in said[0], said
