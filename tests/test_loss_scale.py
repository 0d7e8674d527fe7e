"""Loss scaling on CPU through AmpTrainStep: skipped steps, scale updates, unscaling, saved state, and gradient
accumulation (update_freq)."""
import numpy as np
import pytest
from omegaconf import OmegaConf

import mindspore as ms
import mindspore.nn as nn

from ampzoo.amp.loss_scale import AmpTrainStep, plan_loss_scale
from ampzoo.amp.policy import apply_policy

RNG = np.random.RandomState(0)
X = RNG.randn(16, 12).astype(np.float32)
Y = RNG.randint(0, 3, size=16).astype(np.int32)


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(12, 16, weight_init="normal")
        self.relu = nn.ReLU()
        self.fc2 = nn.Dense(16, 3, weight_init="normal")

    def construct(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def loss_scale(**kw):
    base = dict(type="dynamic", scale=1024.0, drop_overflow_update=False, init_scale=2.0 ** 16, factor=2,
                window=2000, min_scale=1.0)
    return OmegaConf.create({**base, **kw})


def make_step(ls_cfg, level="O0", seed=0, update_freq=1, optimizer=nn.Momentum, kernels=False):
    """An MLP's train step; `kernels`: with the CPU kernels applied (and the recipes' Momentum fused on them)."""
    ms.set_seed(seed)
    net = MLP()
    if kernels:
        from ampzoo.engine.network import accelerate
        net = accelerate(net)
    net, _ = apply_policy(net, OmegaConf.create({"level": level, "dtype": "float16", "keep_fp32": None,
                                                 "force_fp16": []}))
    plan = plan_loss_scale(ls_cfg)
    fused = {"fused": kernels} if optimizer is not nn.Momentum else {}
    opt = optimizer(net.trainable_params(), learning_rate=0.1, momentum=0.9, loss_scale=plan.optimizer_loss_scale,
                    **fused)
    step = AmpTrainStep(nn.WithLossCell(net, nn.CrossEntropyLoss()), opt, plan, "CPU", update_freq)
    step.set_train()
    return net, step


def weights(net):
    return {p.name: p.asnumpy().copy() for p in net.trainable_params()}


def run(step, x=X, y=Y):
    loss, overflow, scale = step(ms.Tensor(x), ms.Tensor(y))
    return float(loss.asnumpy()), bool(overflow.asnumpy()), float(scale.asnumpy())


def test_overflow_skips_the_update_and_halves_the_scale(graph_mode):
    # 2**24 times an fp16 gradient is past fp16's 65504: the backward pass overflows.
    net, step = make_step(loss_scale(init_scale=2.0 ** 24), level="O2")
    before = weights(net)
    _, overflow, used = run(step)
    assert overflow and used == 2.0 ** 24
    assert all(np.array_equal(before[k], v) for k, v in weights(net).items()), "weights changed on overflow"
    t = step.telemetry()
    assert t["loss_scale"] == 2.0 ** 23
    assert (t["amp_skipped_steps"], t["amp_overflow_steps"], t["amp_steps_since_overflow"]) == (1, 1, 0)


@pytest.mark.parametrize("ls", [dict(type="dynamic", init_scale=8.0),
                                dict(type="fixed", scale=8.0, drop_overflow_update=True)])
def test_nan_or_inf_in_the_inputs_is_never_trained_on(graph_mode, ls):
    net, step = make_step(loss_scale(**ls))
    run(step)
    before = weights(net)
    for bad in (np.inf, np.nan):
        x = X.copy()
        x[3, 5] = bad
        _, overflow, _ = run(step, x=x)
        assert not overflow, "a data problem is not an fp16 overflow"
        assert all(np.array_equal(before[k], v) for k, v in weights(net).items())
    t = step.telemetry()
    assert t["amp_nonfinite_inputs"] == 2 and t["amp_skipped_steps"] == 2 and t["amp_overflow_steps"] == 0
    assert t["loss_scale"] == 8.0, "the scale does not move for bad data"
    run(step)
    assert any(not np.array_equal(before[k], v) for k, v in weights(net).items()), "clean steps update again"


@pytest.mark.parametrize("ls", [dict(type="none"), dict(type="fixed", scale=1024.0, drop_overflow_update=False)])
def test_without_skipping_a_nonfinite_update_shows_at_the_next_read(graph_mode, ls):
    """The plain step (bare MindSpore's) checks nothing per step; the next telemetry read finds the weights."""
    _, step = make_step(loss_scale(**ls))
    for _ in range(3):
        run(step)
    assert step.telemetry()["amp_nonfinite_updates"] == 0
    x = X.copy()
    x[3, 5] = np.nan
    run(step, x=x)
    run(step)
    t = step.telemetry()
    assert t["amp_nonfinite_updates"] == 1
    assert step.telemetry()["amp_nonfinite_updates"] == 1, "counted once, not at every read"


def test_window_of_clean_steps_doubles_the_scale(graph_mode):
    _, step = make_step(loss_scale(init_scale=4.0, window=3))
    scales = []
    for _ in range(7):
        _, overflow, _ = run(step)
        assert not overflow
        scales.append(step.telemetry()["loss_scale"])
    assert scales == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0]
    assert step.telemetry()["amp_steps_since_overflow"] == 7


@pytest.mark.parametrize("drop", [False, True])
def test_fixed_scale_128_matches_scale_1(graph_mode, drop):
    """Fixed scale without skipping relies on the optimizer's loss_scale; with skipping, the step unscales."""
    net1, step1 = make_step(loss_scale(type="none"))
    net128, step128 = make_step(loss_scale(type="fixed", scale=128.0, drop_overflow_update=drop))
    for _ in range(5):
        loss1, _, _ = run(step1)
        loss128, _, used = run(step128)
        assert used == 128.0
        assert loss128 == pytest.approx(loss1, rel=1e-5), "the reported loss is the unscaled loss"
    w1, w128 = weights(net1), weights(net128)
    for k in w1:
        np.testing.assert_allclose(w128[k], w1[k], rtol=1e-5, atol=1e-6)


def test_loss_scale_state_survives_a_checkpoint(graph_mode, tmp_path):
    net, step = make_step(loss_scale(init_scale=2.0 ** 24, window=4), level="O2")
    for _ in range(6):
        run(step)
    ms.save_checkpoint(step, str(tmp_path / "s.ckpt"))
    state = step.telemetry()
    assert state["amp_overflow_steps"] >= 1
    net2, step2 = make_step(loss_scale(init_scale=2.0 ** 24, window=4), level="O2", seed=1)
    not_loaded, _ = ms.load_param_into_net(step2, ms.load_checkpoint(str(tmp_path / "s.ckpt")))
    assert not not_loaded
    assert step2.telemetry() == state
    for _ in range(5):  # both continue identically, including the next scale changes
        assert run(step) == run(step2)
        assert step.telemetry() == step2.telemetry()
    for k, v in weights(net).items():
        np.testing.assert_array_equal(weights(net2)[k], v)


ACCUMULATE = [dict(type="none"), dict(type="dynamic", init_scale=8.0)]  # the plain step and the skipping step


@pytest.mark.parametrize("ls", ACCUMULATE)
def test_update_freq_2_is_one_update_on_both_batches(graph_mode, ls):
    """Two half batches with update_freq=2 make the update one step on the whole batch makes (mean losses of
    equal halves), and the weights do not move after the first half; momentum shows the update count."""
    net1, step1 = make_step(loss_scale(**ls))
    net2, step2 = make_step(loss_scale(**ls), update_freq=2)
    before = weights(net2)
    for i in range(3):
        run(step1)
        run(step2, X[:8], Y[:8])
        if i == 0:
            assert all(np.array_equal(before[k], v) for k, v in weights(net2).items()), "updated after one batch"
        run(step2, X[8:], Y[8:])
    w1, w2 = weights(net1), weights(net2)
    for k in w1:
        np.testing.assert_allclose(w2[k], w1[k], rtol=1e-5, atol=1e-6)
    assert any(not np.array_equal(before[k], v) for k, v in w2.items())


def test_a_bad_batch_drops_its_whole_accumulated_update(graph_mode):
    net, step = make_step(loss_scale(type="dynamic", init_scale=8.0), update_freq=2)
    before = weights(net)
    x = X[:8].copy()
    x[1, 1] = np.nan
    run(step, x, Y[:8])
    run(step, X[8:], Y[8:])  # clean, but its update holds the bad batch: dropped
    assert all(np.array_equal(before[k], v) for k, v in weights(net).items())
    t = step.telemetry()
    assert t["amp_nonfinite_inputs"] == 1 and t["amp_steps"] == 2
    assert t["amp_skipped_steps"] == 2, "both batches of the dropped update are skipped, not only the bad one"
    run(step, X[:8], Y[:8])
    run(step, X[8:], Y[8:])  # the next update starts clean
    assert all(np.isfinite(v).all() for v in weights(net).values())
    assert any(not np.array_equal(before[k], v) for k, v in weights(net).items())


@pytest.mark.parametrize("ls", ACCUMULATE)
def test_a_checkpoint_between_two_batches_of_an_update_resumes_exactly(graph_mode, tmp_path, ls):
    net, step = make_step(loss_scale(**ls), update_freq=2)
    for x, y in ((X[:8], Y[:8]), (X[8:], Y[8:]), (X[:8], Y[:8])):
        run(step, x, y)
    ms.save_checkpoint(step, str(tmp_path / "half.ckpt"))  # one batch of the second update in the accumulators
    net2, step2 = make_step(loss_scale(**ls), seed=1, update_freq=2)
    not_loaded, _ = ms.load_param_into_net(step2, ms.load_checkpoint(str(tmp_path / "half.ckpt")))
    assert not not_loaded
    for x, y in ((X[8:], Y[8:]), (X[:8], Y[:8]), (X[8:], Y[8:])):
        assert run(step, x, y) == run(step2, x, y)
    for k, v in weights(net).items():
        np.testing.assert_array_equal(weights(net2)[k], v)


def test_with_update_freq_the_scale_moves_once_an_update(graph_mode):
    """fairseq's rule: every batch of an update uses one scale, the growth window counts updates, and an
    overflow in the first batch halves the scale once, at the end of its update, which is dropped."""
    _, step = make_step(loss_scale(init_scale=4.0, window=2), update_freq=2)
    used = [run(step, x, y)[2] for _ in range(4) for x, y in ((X[:8], Y[:8]), (X[8:], Y[8:]))]
    assert used == [4.0, 4.0, 4.0, 4.0, 8.0, 8.0, 8.0, 8.0], "doubled after 2 clean updates (4 batches)"
    net, step = make_step(loss_scale(init_scale=2.0 ** 24), level="O2", update_freq=2)
    before = weights(net)
    first, second = run(step, X[:8], Y[:8]), run(step, X[8:], Y[8:])
    assert first[1] and first[2] == second[2] == 2.0 ** 24, "the second batch uses the update's scale"
    t = step.telemetry()
    assert t["loss_scale"] == 2.0 ** 23 and t["amp_overflow_steps"] >= 1 and t["amp_skipped_steps"] == 2
    assert all(np.array_equal(before[k], v) for k, v in weights(net).items()), "the overflowed update is dropped"


@pytest.mark.parametrize("init_scale, overflows", [(2.0 ** 4, False), (2.0 ** 24, True)])
def test_the_cpu_kernels_unscale_and_check_as_mindspores_ops_do(graph_mode, monkeypatch, init_scale, overflows):
    """On the CPU with the CPU kernels, the unscale and the overflow check are one pass (cpu_kernels'
    UnscaleSum): the overflow verdict and the weights after the step are those of MindSpore's Mul and
    ReduceSum, bit for bit."""
    from ampzoo.amp import loss_scale as module
    from cpu_kernels import has_ops, why_not
    if not has_ops():
        pytest.skip(why_not())
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(module, "fused_unscale_op", lambda device, distributed, net: None)
        net, step = make_step(loss_scale(init_scale=init_scale), level="O2", kernels=True)
        assert (step.unscale_sum is not None) == fused
        _, overflow, _ = run(step)
        results.append((overflow, weights(net)))
    (fused_overflow, fused_weights), (overflow, plain_weights) = results
    assert fused_overflow == overflow == overflows
    assert all(np.array_equal(fused_weights[k], v) for k, v in plain_weights.items())


@pytest.mark.parametrize("init_scale, overflows", [(2.0 ** 4, False), (2.0 ** 24, True)])
def test_with_the_fused_optimizer_the_update_unscales_and_steps_as_mindspores_ops_do(graph_mode, monkeypatch,
                                                                                      init_scale, overflows):
    """The recipes' Momentum on the CPU kernels unscales the gradients as it updates (the check only reads
    them): the verdict, the scale's next value and the weights are those of MindSpore's unscale, check and
    nn.Momentum, bit for bit, over three steps."""
    from ampzoo.amp import loss_scale as module
    from ampzoo.engine.optim import Momentum
    from cpu_kernels import has_ops, why_not
    if not has_ops():
        pytest.skip(why_not())
    net, step = make_step(loss_scale(init_scale=init_scale, window=2), level="O2", optimizer=Momentum, kernels=True)
    assert step.unscale_in_update, "the fold is on where the kernels run"
    folded = [run(step) for _ in range(3)]
    monkeypatch.setattr(module, "fused_unscale_op", lambda device, distributed, net: None)
    plain_net, plain = make_step(loss_scale(init_scale=init_scale, window=2), level="O2", kernels=True)
    assert not plain.unscale_in_update
    assert [run(plain) for _ in range(3)] == folded
    assert folded[0][1] == overflows
    assert all(np.array_equal(weights(net)[k], v) for k, v in weights(plain_net).items())
