"""The recipes' momentum optimizer (ampzoo.engine.optim.Momentum): on the CPU with the CPU kernels, the weight
decay, the optimizer's unscale and the update are cpu_kernels' MomentumUpdate, one op a parameter that writes
the weight and its momentum in place. It must step exactly as nn.Momentum does and keep its checkpoint names."""
import numpy as np
import pytest

import mindspore as ms
import mindspore.nn as nn

from ampzoo.engine.optim import Momentum, param_groups
from cpu_kernels import has_ops, why_not

RNG = np.random.RandomState(0)
X = ms.Tensor(RNG.randn(16, 30).astype(np.float32))
Y = ms.Tensor(np.arange(16) % 10, ms.int32)
LR = [0.1, 0.05, 0.02]


class Decay:
    decay_norm_and_bias = False
    weight_decay = 1e-2


def train(optimizer_class, loss_scale=1.0, nesterov=False, steps=3):
    """Three steps of a small network (one decayed group, one not: param_groups' split) -> weights, moments
    and the optimizer."""
    ms.set_seed(0)
    net = nn.SequentialCell([nn.Dense(30, 40), nn.ReLU(), nn.Dense(40, 10)])
    fused = {"fused": True} if optimizer_class is Momentum else {}  # as create_optimizer gives a network on the kernels
    opt = optimizer_class(param_groups(net.trainable_params(), Decay), learning_rate=LR, momentum=0.9,
                          loss_scale=loss_scale, use_nesterov=nesterov, **fused)
    loss = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))
    step = nn.TrainOneStepCell(loss, opt, sens=loss_scale)  # scaled gradients, as a fixed loss scale gives
    for _ in range(steps):
        step(X, Y)
    return ({p.name: p.asnumpy().copy() for p in net.trainable_params()},
            {m.name: m.asnumpy().copy() for m in opt.moments}, opt)


@pytest.fixture
def kernels(graph_mode):
    if not has_ops():
        pytest.skip(why_not())


@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
def test_the_fused_update_is_nn_momentums_bit_for_bit(kernels, loss_scale):
    weights, moments, opt = train(Momentum, loss_scale)
    assert opt.fused is not None, "the CPU kernels' MomentumUpdate runs on the CPU"
    plain_weights, plain_moments, plain = train(nn.Momentum, loss_scale)
    assert weights.keys() == plain_weights.keys() and moments.keys() == plain_moments.keys(), \
        "the same parameter names: a checkpoint of either loads into the other"
    for name, value in plain_weights.items():
        assert np.array_equal(weights[name], value), name
    for name, value in plain_moments.items():
        assert np.array_equal(moments[name], value), name
    assert int(opt.global_step.asnumpy()[0]) == int(plain.global_step.asnumpy()[0]) == 3, "the schedule advances"


def test_nesterov_is_nesterovs_update(kernels):
    """MindSpore's CPU ApplyMomentum steps as plain momentum whatever use_nesterov says; the fused update is
    Nesterov's (buf = m * buf + g + wd * w; w -= lr * (g + wd * w + m * buf)), checked against numpy."""
    weights, _, _ = train(Momentum, nesterov=True, steps=1)
    ms.set_seed(0)
    net = nn.SequentialCell([nn.Dense(30, 40), nn.ReLU(), nn.Dense(40, 10)])
    before = {p.name: p.asnumpy().copy() for p in net.trainable_params()}
    loss = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))
    grads = ms.grad(loss, grad_position=None, weights=net.trainable_params())(X, Y)
    for p, g in zip(net.trainable_params(), grads):
        wd = 0.0 if "bias" in p.name else Decay.weight_decay
        step = g.asnumpy() + wd * before[p.name]
        buf = step  # the momentum starts at zero
        expected = before[p.name] - LR[0] * (step + 0.9 * buf)
        np.testing.assert_allclose(weights[p.name], expected, rtol=1e-5, atol=1e-7, err_msg=p.name)
    plain, _, _ = train(Momentum, nesterov=False, steps=1)
    assert any(not np.allclose(plain[k], v) for k, v in weights.items()), "Nesterov's step is not plain momentum"


def test_without_the_kernels_the_step_is_nn_momentums(graph_mode, monkeypatch):
    from ampzoo.engine import optim
    monkeypatch.setattr(optim, "fused_momentum_op", lambda nesterov: None)
    weights, _, opt = train(Momentum)
    plain, _, _ = train(nn.Momentum)
    assert opt.fused is None
    assert all(np.array_equal(weights[k], v) for k, v in plain.items())
