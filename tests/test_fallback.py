"""The fallback ladder: a batch that turns to inf/NaN inside the fp16 network at O2 ends the run one rung
down, weights finite, transition recorded; without the ladder the run stops with a clear error instead of
training on NaN weights. (NaN in the inputs themselves is skipped before it gets that far.)"""
import json

import numpy as np
import pytest

from ampzoo.data.mnist import mnist
from ampzoo.engine.load import load_config
from ampzoo.registry import DATASETS

NAN_BATCH = 130  # epoch 2, step 5


@pytest.fixture
def nan_mnist():
    """MNIST with one training batch scaled by 1e6: finite data whose fp16 activations overflow to inf."""
    def build(cfg, split, shard=None, start_epoch=0, seed=0, skip_batches=0):
        ds = mnist(cfg, split, shard, start_epoch, seed, skip_batches)
        if split != "train":
            return ds
        seen = {"n": 0}

        def inject(images):
            seen["n"] += 1
            return images * np.float32(1e6) if seen["n"] == NAN_BATCH else images
        return ds.map(operations=inject, input_columns="image", num_parallel_workers=1)
    DATASETS.add("mnist_nan", build, task="classification")
    yield
    DATASETS.remove("mnist_nan")


def run(overrides, run_dir):
    from train import train
    cfg, _ = load_config(["recipe=lenet_o2", "dataset.name=mnist_nan", "trainer.epochs=2", "logger.progress_bar=false",
                   *overrides])
    run_dir.mkdir(parents=True)
    return train(cfg, run_dir)


def test_ladder_steps_down_and_finishes_with_finite_weights(nan_mnist, tmp_path, graph_mode):
    import mindspore as ms
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    run(["amp.fallback.enabled=true"], run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    [transition] = metrics["fallback"]["transitions"]
    assert transition["from"] == "O2 with fixed scale 1024" and transition["to"] == "O2 with fixed scale 128"
    assert transition["step"] == NAN_BATCH
    assert "non-finite gradients were applied to the weights" in transition["reason"]
    assert transition["restart_from"] == "lenet5-e0001-s00000125.ckpt"
    assert metrics["amp"]["setting"] == "O2 with fixed scale 128" and metrics["steps"] == 250
    ckpt = ms.load_checkpoint(metrics["checkpoint"])
    assert all(np.isfinite(p.asnumpy()).all() for p in ckpt.values())
    assert metrics["final"]["top1"] > 0.2
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("amp/rung")] == [(0, 0.0), (125, 1.0)]


def test_without_the_ladder_the_run_stops_with_a_clear_error(nan_mnist, tmp_path, graph_mode, capsys, monkeypatch):
    """Exit 1 with what happened and what to try; under msrun every rank waits for the others first (issue 79,
    item 7: ranks 1-7 exited before rank 0's checkpoint was written, and msrun killed rank 0)."""
    import train
    from ampzoo.engine.ranks import together
    waited = []
    monkeypatch.setattr(train, "together", lambda world: waited.append(world))
    with pytest.raises(SystemExit) as exit_info:
        run([], tmp_path / "run")
    assert exit_info.value.code == 1 and waited == [1]
    calls = []
    together(2, agree=calls.append)
    together(1, agree=calls.append)
    assert calls == [False], "an all-reduce under msrun, nothing alone"
    err = capsys.readouterr().err
    assert f"error: by step {NAN_BATCH}: non-finite gradients were applied to the weights" in err
    assert "amp.fallback.enabled=true" in err


def test_dynamic_scale_at_its_minimum_stops_like_fairseq(nan_mnist, tmp_path, graph_mode, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(["amp.loss_scale.type=dynamic", "amp.loss_scale.init_scale=1", "amp.loss_scale.min_scale=1"],
            tmp_path / "run")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert (f"error: by step {NAN_BATCH}: a step overflowed at the minimum loss scale "
            f"(amp.loss_scale.min_scale=1)" in err)


@pytest.mark.slow  # a long run kept out of make test (make test-all runs it); a cheaper test covers the same path
def test_a_ladder_that_reaches_o0_and_still_fails_says_the_cause_is_not_precision(tmp_path, graph_mode, capsys):
    """Every batch from epoch 2 on is scaled by 1e6: no precision can train on that. The ladder steps all the way
    down to O0 (fp32), and the run ends with exit 1 and a line that says the cause is not precision, instead
    of exit 0 on a broken model."""
    def build(cfg, split, shard=None, start_epoch=0, seed=0, skip_batches=0):
        ds = mnist(cfg, split, shard, start_epoch, seed, skip_batches)
        if split != "train":
            return ds
        seen = {"n": start_epoch * 125 + skip_batches}  # global batch count: a restart rebuilds the pipeline

        def inject(images):
            seen["n"] += 1
            return images * np.float32(1e6) if seen["n"] > 125 else images
        return ds.map(operations=inject, input_columns="image", num_parallel_workers=1)
    DATASETS.add("mnist_broken", build, task="classification")
    try:
        with pytest.raises(SystemExit) as exit_info:
            run(["dataset.name=mnist_broken", "amp.fallback.enabled=true", "amp.level=O1", "amp.loss_scale.type=none"],
                tmp_path / "run")  # the ladder's last two rungs: O1 without a loss scale, then O0
    finally:
        DATASETS.remove("mnist_broken")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "the cause is not precision" in err, err[-2000:]
    assert "O0" in err
