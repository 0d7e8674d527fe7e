"""The device paths' third round, in process: what a checkpoint records of the workers that trained it, what
eval.py/export.py take from an msrun run, what a CPU-only note does on a device, which settings turn sinking off,
the profiler's start, and how often accumulated gradients cross the ranks. The msrun side is in
test_distributed.py."""
import inspect
import logging

import numpy as np
import pytest
from omegaconf import OmegaConf

import mindspore as ms

from ampzoo.engine.checkpoint import check_same_shape
from ampzoo.errors import ConfigError
from ampzoo.runtime import cap_onednn_isa, onednn_note, sink_mode


def as_params(**values):
    return {k: ms.Parameter(ms.Tensor(np.array(v)), name=k) for k, v in values.items()}


def test_a_resume_on_another_number_of_workers_says_what_would_change(tmp_path):
    params = as_params(step_num=10_008, epoch_num=2, world_size=8, global_batch=256)
    path = tmp_path / "resnet34-e0002-s00010008.ckpt"
    check_same_shape(params, path, world_size=8, global_batch=256)  # the same workers: resumes
    check_same_shape(as_params(step_num=10_008), path, world_size=4, global_batch=128)  # written before: nothing known
    with pytest.raises(ConfigError) as e:
        check_same_shape(params, path, world_size=4, global_batch=128)
    assert str(e.value) == (
        f"resume: {path} was trained by 8 worker(s) with a global batch of 256, this run has 4 with 128: its step "
        f"10,008 would stand for another number of samples, shifting epochs, evaluations and the learning rate; "
        f"resume it with 8 worker(s) (msrun --worker_num=8), or start a new run from its weights with "
        f"checkpoint={path}")


def test_a_checkpoint_records_its_workers_and_global_batch(tmp_path):
    from ampzoo.engine.checkpoint import AtomicCheckpoint, RUN_SHAPE
    net = ms.nn.Dense(2, 2)
    saver = AtomicCheckpoint(tmp_path, "dense", 1, 2, 10, shape={"world_size": 8, "global_batch": 256})
    params = ms.load_checkpoint(str(saver.save(net, 10)))
    assert {k: int(params[k].asnumpy()) for k in RUN_SHAPE} == {"world_size": 8, "global_batch": 256}


def msrun_run_dir(tmp_path):
    """An msrun run's directory: config.yaml with runtime.distributed=true, and a checkpoint of its LeNet."""
    from ampzoo.engine.load import load_config
    from ampzoo.engine.network import build_model
    cfg, _ = load_config(["recipe=lenet_o0", "runtime.distributed=true"])
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    checkpoint = run_dir / "checkpoints" / "lenet5-e0001-s00000125.ckpt"
    ms.save_checkpoint(build_model(cfg), str(checkpoint))
    return checkpoint


def test_eval_and_export_take_a_device_id_for_an_msrun_runs_checkpoint(tmp_path):
    """They run as one process: the run's runtime.distributed=true must not make runtime.device_id an error."""
    from ampzoo.engine.weights import checkpoint_config
    checkpoint = msrun_run_dir(tmp_path)
    cfg, _ = checkpoint_config([f"checkpoint={checkpoint}", "runtime.device_id=1"])
    assert cfg.runtime.device_id == 1 and cfg.runtime.distributed is False
    cfg, _ = checkpoint_config([f"checkpoint={checkpoint}"])
    assert cfg.runtime.distributed is False and cfg.model.name == "lenet5"


@pytest.mark.parametrize("device", ["Ascend", "GPU"])
def test_the_onednn_notes_are_the_cpus_only(monkeypatch, caplog, device):
    """oneDNN runs none of the network on a device: no ISA cap set, no line about MindSpore's CPU convolutions,
    nothing recorded in metrics.json."""
    from ampzoo.engine.load import load_config
    from ampzoo.engine import network
    from ampzoo.engine.network import build_model
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("AMP_ZOO_ONEDNN_AUTO", raising=False)
    assert cap_onednn_isa("auto", needs_cap=True, device=device) is None
    assert "ONEDNN_MAX_CPU_ISA" not in __import__("os").environ
    assert onednn_note(device) is None
    real = ms.get_context
    monkeypatch.setattr(network.ms, "get_context", lambda key: device if key == "device_target" else real(key))
    cfg, _ = load_config(["recipe=lenet_o0"])
    with caplog.at_level(logging.INFO, logger="amp_zoo"):
        build_model(cfg)
    assert "ONEDNN" not in caplog.text and "convolutions" not in caplog.text


def test_sinking_is_off_with_save_every_steps_and_in_pynative():
    """save_every_steps promises a resume point every N steps; a sink returns to the host at epoch ends only.
    In PyNative mode MindSpore runs each step from the host whatever it is asked."""
    sink, note = sink_mode("Ascend", True, save_every_steps=100)
    assert sink is False and "trainer.save_every_steps=100 saves a resume point inside an epoch" in note
    sink, note = sink_mode("Ascend", True, mode="pynative")
    assert sink is False and "PyNative" in note and "one sink per epoch" not in note
    sink, note = sink_mode("Ascend", True)
    assert sink is True and "save_every_steps" not in note


def test_the_profiler_is_started_once(monkeypatch, tmp_path):
    """mindspore.profiler.profile starts itself when built (start_profile=True by default); a second start() was
    a warning MindSpore logged, with the profile's window counted from the first."""
    import mindspore.profiler as profiler

    from ampzoo.amp import profile as amp_profile
    assert inspect.signature(profiler.profile).parameters["start_profile"].default is True
    starts = []

    class Profile:  # MindSpore's semantics: starts in its constructor unless start_profile=False
        def __init__(self, start_profile=True, **kw):
            if start_profile:
                self.start()

        def start(self):
            starts.append(1)

        def stop(self):
            pass

    monkeypatch.setattr(profiler, "profile", Profile)
    monkeypatch.setattr(profiler, "tensorboard_trace_handler", lambda path: None)
    monkeypatch.setattr(amp_profile, "op_times", lambda d, device: [])
    from tests.test_device_paths import Context
    cb = amp_profile.ProfileSteps(tmp_path, {"cells": []}, "Ascend", start=2)
    ctx = Context()
    cb.on_train_begin(ctx)
    for step in range(1, 9):
        cb.on_train_step_begin(ctx)
        ctx.args.cur_step_num = step
        cb.on_train_step_end(ctx)
    assert starts == [1]


def test_accumulated_gradients_cross_the_ranks_once_an_update(pynative_mode):
    """update_freq=2: the gradient all-reduce (the size of the model) runs on the update's mean, not on every
    batch. PyNative runs construct as Python, so a stand-in reducer counts the calls; the weights are those of
    the step without it."""
    from tests.test_loss_scale import X, Y, loss_scale, make_step, weights
    for ls in (loss_scale(type="dynamic", init_scale=8.0), loss_scale(type="none")):
        net, step = make_step(ls, update_freq=2)
        class Reducer(ms.nn.Cell):  # the identity a single process has, counted
            def __init__(self):
                super().__init__()
                self.calls = []

            def construct(self, grads):
                self.calls.append(1)
                return grads
        step.grad_reducer = Reducer()
        calls = step.grad_reducer.calls
        ref_net, ref_step = make_step(ls, update_freq=2)
        for _ in range(4):
            step(ms.Tensor(X), ms.Tensor(Y))
            ref_step(ms.Tensor(X), ms.Tensor(Y))
        assert len(calls) == 2, f"{len(calls)} gradient all-reduces for 2 updates ({ls.type})"
        for name, value in weights(ref_net).items():
            np.testing.assert_allclose(weights(net)[name], value, rtol=1e-6, err_msg=name)


def save(path, step, epoch):
    params = {"w": np.array([1.0, 2.0], np.float32), "step_num": np.array(step, np.int32),
              "epoch_num": np.array(epoch, np.int32)}
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in params.items()], str(path))
    return path, ms.load_checkpoint(str(path))


def test_every_rank_resumes_from_rank_0s_checkpoint(tmp_path, caplog):
    """resume=auto under msrun: a rank whose listing of the shared folder lags (a network file system's cache)
    picked an older checkpoint than rank 0; it takes rank 0's, by name. The all-reduce is stood in for."""
    from ampzoo.engine.checkpoint import agree_on_resume
    older, older_params = save(tmp_path / "lenet5-e0000-s00000010.ckpt", 10, 0)
    newest, _ = save(tmp_path / "lenet5-e0001-s00000125.ckpt", 125, 1)
    from_rank0 = iter([125, 1])  # rank 0's step, then its epoch
    with caplog.at_level(logging.WARNING, logger="amp_zoo"):
        path, params = agree_on_resume(older, older_params, tmp_path, "lenet5", False, lambda v: next(from_rank0))
    assert path == newest and int(params["step_num"].asnumpy()) == 125
    assert "resume: rank 0 resumes from lenet5-e0001-s00000125.ckpt" in caplog.text
    same = iter([10, 0])
    assert agree_on_resume(older, older_params, tmp_path, "lenet5", False, lambda v: next(same))[0] == older
    none = iter([-1, -1])
    with pytest.raises(ConfigError, match="rank 0 found no checkpoint in .*every rank must see the same run"):
        agree_on_resume(older, older_params, tmp_path, "lenet5", False, lambda v: next(none))


def test_every_rank_reads_the_tokenizer_rank_0_keeps(tmp_path):
    """A new translation run under msrun: ranks 1-7 wait for rank 0's copy and read it, rather than the model in
    their own server's cache (trained again there, with ids the same only by luck)."""
    from ampzoo.engine.rundir import keep_tokenizer
    cfg = OmegaConf.create({"dataset": {"params": {"spm_model": None}}})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(ConfigError, match="rank 1 cannot see .*tokenizer.model, the tokenizer rank 0 keeps"):
        keep_tokenizer(cfg, run_dir, 1, resuming=False, wait=lambda flag: False)  # rank 0's copy never came
    def rank0_copies(flag):
        (run_dir / "tokenizer.model").write_bytes(b"rank 0's model")
    keep_tokenizer(cfg, run_dir, 1, resuming=False, wait=rank0_copies)
    assert cfg.dataset.params.spm_model == str((run_dir / "tokenizer.model").resolve())


def test_a_directory_that_takes_no_fsync_does_not_fail_a_save(tmp_path, monkeypatch):
    """The rename that makes a checkpoint is done; some file systems (FUSE, some network mounts) refuse fsync on a
    directory, which stopped the run as a failed write. Any other fsync error still fails the save."""
    import errno
    import os
    import stat

    from ampzoo.engine.checkpoint import AtomicCheckpoint
    from ampzoo.errors import WriteError
    real = os.fsync
    code = {"errno": errno.EINVAL}

    def picky(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code["errno"], os.strerror(code["errno"]))
        return real(fd)

    monkeypatch.setattr(os, "fsync", picky)
    saver = AtomicCheckpoint(tmp_path, "dense", 1, 2, 10)
    assert saver.save(ms.nn.Dense(2, 2), 10).is_file()
    code["errno"] = errno.EIO
    with pytest.raises(WriteError, match=os.strerror(errno.EIO)):
        saver.save(ms.nn.Dense(2, 2), 20)


def test_rank_0s_final_evaluation_decides_whether_the_run_failed():
    """Each rank evaluates with its own BatchNorm statistics; at the threshold their verdicts can differ. Rank 0's
    (the one metrics.json holds) decides the exit code of every rank. The all-reduce is stood in for."""
    from ampzoo.amp.fallback import run_failed
    final = {"top1": 0.1, "loss": 2.3}
    assert run_failed("does not learn", True, final) and not run_failed("does not learn", False, final)
    assert not run_failed(None, True, {"loss": float("nan")})
    rank0_passes, rank0_fails = (lambda flag: False), (lambda flag: True)
    assert not run_failed("does not learn", True, final, agree=rank0_passes), "rank 1 alone at chance"
    assert run_failed(None, True, {"top1": 0.9, "loss": 0.3}, agree=rank0_fails), "rank 0 at chance"
