"""The Transformer's CPU kernels (matmul.cc, layer_norm.cc, eltwise.cc's Add and MaskMul): each computes in fp32
whatever comes in and rounds its output once, so in fp32 it matches the MindSpore ops it replaces and in fp16 it
gives what O2's casts gave (within an ulp); the weights go in as stored, and an fp32 weight's gradient in an fp16
step is still an fp16 value (past 65504 it is inf, which the loss scale's check must see). A Transformer with
the kernels computes the loss and gradients of the one without them."""

import numpy as np
import pytest

import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops

from cpu_kernels import configure, cpu_flags, has_ops, why_not
from cpu_kernels.cells import (CpuDense, CpuDropout, CpuLayerNorm, affine_op, bmm_op, layer_norm_op, scaled_softmax_op,
                               softmax_op)
from tests.conftest import built_with

pytestmark = pytest.mark.skipif(not has_ops(), reason=why_not())


@pytest.fixture
def graph_mode():
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)


class Call(nn.Cell):
    """One op and its gradients for every input, with dy given."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def construct(self, *args):
        return self.op(*args)


def run(op, inputs, dy):
    net = Call(op)
    tensors = [ms.Tensor(a) for a in inputs]
    out = net(*tensors)
    sens = tuple(ms.Tensor(d) for d in dy) if isinstance(dy, tuple) else ms.Tensor(dy)
    grads = ops.GradOperation(get_all=True, sens_param=True)(net)(*tensors, sens)
    return out, [g.asnumpy() for g in grads]


def as_half(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def close_in_fp16(got, want):
    """Rounded once from fp32: equal to fp32's result rounded to fp16 within an ulp."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32).astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=2 ** -10, atol=1e-3)


def test_affine_in_fp32_is_the_matmul_plus_bias(graph_mode):
    rng = np.random.RandomState(0)
    x, w, b, dy = (rng.randn(*s).astype(np.float32) for s in ((33, 20), (17, 20), (17,), (33, 17)))
    y, (dx, dw, db) = run(affine_op(True), [x, w, b], dy)
    np.testing.assert_allclose(y.asnumpy(), x @ w.T + b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dy @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dy.T @ x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, dy.sum(0), rtol=1e-5, atol=1e-5)


def test_affine_takes_fp32_weights_with_fp16_activations_as_o2s_casts_would(graph_mode):
    """No Cast around it: the fp32 weight is rounded to fp16 inside, the output rounded once, dx fp16, and the
    weight's gradient comes back fp32 holding fp16 values."""
    rng = np.random.RandomState(1)
    x, dy = rng.randn(40, 24).astype(np.float16), rng.randn(40, 12).astype(np.float16)
    w, b = rng.randn(12, 24).astype(np.float32) * 0.3, rng.randn(12).astype(np.float32)
    y, (dx, dw, db) = run(affine_op(True), [x, w, b], dy)
    xf, dyf = x.astype(np.float32), dy.astype(np.float32)
    assert y.dtype == ms.float16 and dx.dtype == np.float16 and dw.dtype == np.float32 and db.dtype == np.float32
    close_in_fp16(y.asnumpy(), xf @ as_half(w).T + as_half(b))
    close_in_fp16(dx, dyf @ as_half(w))
    close_in_fp16(dw, dyf.T @ xf)
    np.testing.assert_array_equal(dw, as_half(dw))  # fp16 values, stored fp32


def bf16_dense_check() -> None:
    """The body of the bf16 Dense test, in a process of its own (oneDNN's bf16 kernels need its full ISA): at O2
    (fp16 activations, the fp32 weight as stored) y, dx, dw and db are fp32's products of x, dy and the weight
    rounded to fp16 and then to bf16, summed in fp32 and rounded once to fp16 (the logits: fp32 holding fp16 values,
    the fp32 gradient rounded to fp16 first). In the bf16_backward mode the forward is fp32 compute's."""
    from tests.test_cpu_half import to_bf16
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.RandomState(1)
    x, dy = rng.randn(40, 24).astype(np.float16), rng.randn(40, 12).astype(np.float16)
    w, b = rng.randn(12, 24).astype(np.float32) * 0.3, rng.randn(12).astype(np.float32)
    xb, dyb, wb = to_bf16(x.astype(np.float32)), to_bf16(dy.astype(np.float32)), to_bf16(as_half(w))

    def exact(got, want):  # bit for bit: the same products summed in fp32 (oneDNN's order) within an fp16 ulp
        close_in_fp16(got, want)
    y, (dx, dw, db) = run(affine_op(True), [x, w, b], dy)
    assert y.dtype == ms.float16 and dx.dtype == np.float16 and dw.dtype == np.float32
    exact(y.asnumpy(), xb @ wb.T + as_half(b))
    exact(dx, dyb @ wb)
    exact(dw, dyb.T @ xb)
    exact(db, dyb.sum(0))
    np.testing.assert_array_equal(dw, as_half(dw))
    # bf16 differs from fp32 compute here: the test would pass on an fp32 kernel only by accident
    assert np.abs(y.asnumpy().astype(np.float32) - (x.astype(np.float32) @ as_half(w).T + as_half(b))).max() > 2e-3
    dy32 = rng.randn(40, 30).astype(np.float32)
    w2 = rng.randn(30, 24).astype(np.float32)
    y, (dx, dw) = run(affine_op(False, float32_out=True), [x, w2], dy32)
    exact(y.asnumpy(), xb @ to_bf16(as_half(w2)).T)
    np.testing.assert_array_equal(y.asnumpy(), as_half(y.asnumpy()))
    exact(dx, to_bf16(as_half(dy32)) @ to_bf16(as_half(w2)))
    configure(compute="bf16_backward")
    y, (dx, dw, db) = run(affine_op(True), [x, w, b], dy)
    close_in_fp16(y.asnumpy(), x.astype(np.float32) @ as_half(w).T + as_half(b))
    exact(dw, dyb.T @ xb)


@pytest.mark.skipif(not {"avx512_bf16", "avx512f", "f16c"} <= cpu_flags(),
                    reason="this CPU has no AVX512-BF16: fp16 Dense layers multiply in fp32 here")
def test_dense_in_fp16_on_a_bf16_cpu_is_fp32_on_bf16_operands_rounded_once():
    """runtime.cpu_compute=bf16 (cpu_kernels.configure) on a CPU with AVX512-BF16: the Transformer's Dense layers
    and logits multiply bf16 operands in oneDNN's bf16 matmul and sum in fp32 (bf16_dense_check)."""
    from tests.test_cpu_half import run_bf16_check
    run_bf16_check("test_cpu_transformer", "bf16_dense_check()")


def test_an_fp16_weight_gradient_past_65504_is_inf_for_the_loss_scale(graph_mode):
    x = np.full((64, 4), 60.0, np.float16)
    dy = np.full((64, 2), 30.0, np.float16)  # each dw = 64 * 60 * 30 = 115,200: past fp16's range
    w = np.zeros((2, 4), np.float32)
    _, (dx, dw) = run(affine_op(False), [x, w], dy)
    assert np.isinf(dw).all(), dw


def test_the_fp32_logits_hold_fp16_values_and_take_an_fp32_gradient(graph_mode):
    rng = np.random.RandomState(2)
    x, w = rng.randn(16, 8).astype(np.float16), rng.randn(30, 8).astype(np.float32)
    dy = rng.randn(16, 30).astype(np.float32)
    y, (dx, dw) = run(affine_op(False, float32_out=True), [x, w], dy)
    assert y.dtype == ms.float32 and dx.dtype == np.float16 and dw.dtype == np.float32
    close_in_fp16(y.asnumpy(), x.astype(np.float32) @ as_half(w).T)
    np.testing.assert_array_equal(y.asnumpy(), as_half(y.asnumpy()))
    close_in_fp16(dx, as_half(dy) @ as_half(w))  # dy rounded to fp16 first, as the Cast's backward does


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_layer_norm_and_its_gradients_against_numpy(graph_mode, dtype):
    rng = np.random.RandomState(3)
    x = (rng.randn(3, 5, 32) * 40 + 7).astype(dtype)  # activations of a few hundred: fp16 squares overflow
    gamma, beta = rng.rand(32).astype(np.float32) + 0.5, rng.randn(32).astype(np.float32)
    dy = rng.randn(3, 5, 32).astype(dtype)
    eps = np.array([1e-5], np.float32)
    (y, mean, rstd), (dx, dgamma, dbeta, _) = run(layer_norm_op(), [x, gamma, beta, eps],
                                                  (dy, np.zeros(15, np.float32), np.zeros(15, np.float32)))
    xf, g = x.astype(np.float64), dy.astype(np.float64)
    mu = xf.mean(-1, keepdims=True)
    inv = 1 / np.sqrt(((xf - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    xhat = (xf - mu) * inv
    dxhat = g * gamma
    want_dx = inv * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    assert y.dtype == (ms.float16 if dtype == np.float16 else ms.float32) and dgamma.dtype == np.float32
    check = close_in_fp16 if dtype == np.float16 else (lambda a, b: np.testing.assert_allclose(a, b, 1e-4, 1e-4))
    check(y.asnumpy(), xhat * gamma + beta)
    check(dx, want_dx)
    np.testing.assert_allclose(dgamma, (g * xhat).sum((0, 1)), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dbeta, g.sum((0, 1)), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(rstd.asnumpy(), inv.reshape(-1), rtol=1e-5)


@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_batched_matmul_and_its_gradients_against_numpy(graph_mode, transpose_b, dtype):
    rng = np.random.RandomState(4)
    a = rng.randn(2, 3, 5, 8).astype(dtype)
    b = rng.randn(2, 3, *((7, 8) if transpose_b else (8, 7))).astype(dtype)
    dy = rng.randn(2, 3, 5, 7).astype(dtype)
    y, (da, db) = run(bmm_op(transpose_b), [a, b], dy)
    af, bf, gf = (t.astype(np.float32) for t in (a, b, dy))
    bm = bf.swapaxes(-1, -2) if transpose_b else bf
    want_db = (gf.swapaxes(-1, -2) @ af) if transpose_b else (af.swapaxes(-1, -2) @ gf)
    check = close_in_fp16 if dtype == np.float16 else (lambda g, w: np.testing.assert_allclose(g, w, 1e-5, 1e-5))
    check(y.asnumpy(), af @ bm)
    check(da, gf @ bm.swapaxes(-1, -2))
    check(db, want_db)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cpu_dropout_draws_nn_dropouts_mask_and_keeps_the_dtype(graph_mode, dtype):
    x = np.random.RandomState(5).randn(64, 50).astype(dtype)
    ms.set_seed(7)
    want = nn.Dropout(p=0.3)(ms.Tensor(x)).asnumpy()
    ms.set_seed(7)
    drop = CpuDropout(0.3)
    got = drop(ms.Tensor(x))
    assert got.dtype == ms.Tensor(x).dtype
    np.testing.assert_array_equal(got.asnumpy() == 0, want == 0)  # the same mask
    close_in_fp16(got.asnumpy(), want) if dtype == np.float16 else np.testing.assert_allclose(got.asnumpy(), want)
    # the gradient is dy times the same mask: on ones, y is the scaled mask itself
    ones, w = np.ones((64, 50), dtype), np.random.RandomState(6).randn(64, 50).astype(np.float32)
    drop.set_train(True)

    def loss(t):
        y = drop(t)
        return (y.astype(ms.float32) * ms.Tensor(w)).sum(), y
    (_, mask), dx = ms.value_and_grad(loss, grad_position=0, has_aux=True)(ms.Tensor(ones))
    mask = mask.asnumpy().astype(np.float32)
    assert dx.dtype == ms.Tensor(ones).dtype and 0.2 < (mask == 0).mean() < 0.4
    close_in_fp16(dx.asnumpy(), w * mask) if dtype == np.float16 else np.testing.assert_allclose(dx.asnumpy(),
                                                                                                  w * mask, 1e-6)
    drop.set_train(False)
    np.testing.assert_array_equal(drop(ms.Tensor(x)).asnumpy(), x)


def tiny_transformer(kernels: str):
    from ampzoo.models.transformer import Transformer
    ms.set_seed(0)
    return built_with(kernels, lambda: Transformer(50, d_model=32, heads=4, ffn=64, encoder_layers=2,
                                                   decoder_layers=2, dropout=0.0, max_len=16))


class SquareLoss(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, src, tgt):
        return self.net(src, tgt).astype(ms.float32).square().mean()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_softmax_and_its_gradient_against_numpy(graph_mode, dtype):
    """Over the last axis, computed in fp32 and rounded once; masked scores (-1e4) get 0."""
    rng = np.random.RandomState(8)
    x = (rng.randn(2, 4, 5, 16) * 3).astype(dtype)
    x[..., -3:] = -1e4
    dy = rng.randn(2, 4, 5, 16).astype(dtype)
    y, (dx,) = run(softmax_op(), [x], dy)
    xf, g = x.astype(np.float64), dy.astype(np.float64)
    want = np.exp(xf - xf.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    want_dx = want * (g - (g * want).sum(-1, keepdims=True))
    assert y.dtype == (ms.float16 if dtype == np.float16 else ms.float32)
    check = close_in_fp16 if dtype == np.float16 else (lambda a, b: np.testing.assert_allclose(a, b, 1e-5, 1e-6))
    check(y.asnumpy(), want)
    check(dx, want_dx)
    assert not y.asnumpy()[..., -3:].any()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape,bias_shape", [((3, 2, 5, 7), (3, 1, 1, 7)), ((3, 2, 5, 5), (5, 5)),
                                              ((2, 2, 1, 6), (1, 6)), ((4, 6), (4, 1))])
def test_the_attention_softmax_scales_adds_the_broadcast_mask_and_differentiates(graph_mode, dtype, shape, bias_shape):
    """softmax(x * scale + bias) in one pass: the padding mask (B, 1, 1, S) and the causal (T, T) broadcast as numpy
    does; dx = scale * y * (dy - sum(dy * y)); the mask and the scale take no gradient."""
    rng = np.random.RandomState(9)
    x, dy = (rng.randn(*shape) * 3).astype(dtype), rng.randn(*shape).astype(dtype)
    bias = rng.randn(*bias_shape).astype(np.float32)
    if bias_shape[-1] > 1:  # a mask: -1e4 at some keys (never a whole row, whose sum would lose x's digits)
        bias[rng.rand(*bias_shape) < 0.3] = -1e4
    y, (dx, dbias, dscale) = run(scaled_softmax_op(), [x, bias, np.array([0.25], np.float32)], dy)
    z = x.astype(np.float64) * 0.25 + bias
    want = np.exp(z - z.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    g = dy.astype(np.float64)
    check = close_in_fp16 if dtype == np.float16 else (lambda a, b: np.testing.assert_allclose(a, b, 1e-5, 1e-6))
    assert y.dtype == (ms.float16 if dtype == np.float16 else ms.float32)
    check(y.asnumpy(), want)
    check(dx, 0.25 * want * (g - (g * want).sum(-1, keepdims=True)))
    assert not dbias.any() and not dscale.any()


def test_softmax_of_a_row_with_nan_or_inf_is_nan_for_the_loss_scale(graph_mode):
    x = np.zeros((3, 8), np.float16)
    x[0, 2], x[1, 5] = np.nan, np.inf
    y, _ = run(softmax_op(), [x], np.ones((3, 8), np.float16))
    y = y.asnumpy()
    assert np.isnan(y[:2]).all() and np.allclose(y[2], 1 / 8)


def test_a_transformer_with_the_kernels_computes_the_loss_and_gradients_without_them(graph_mode):
    rng = np.random.RandomState(6)
    src = ms.Tensor(rng.randint(1, 50, (4, 9)).astype(np.int32))
    tgt = ms.Tensor(rng.randint(1, 50, (4, 7)).astype(np.int32))
    results = []
    for kernels in ("on", "off"):
        net = tiny_transformer(kernels)
        loss = SquareLoss(net)
        value, grads = ms.value_and_grad(loss, None, net.trainable_params())(src, tgt)
        results.append((float(value.asnumpy()), [g.asnumpy() for g in grads]))
    (on, grads_on), (off, grads_off) = results
    assert abs(on - off) <= 1e-5 * abs(off)
    for a, b in zip(grads_on, grads_off):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)


def test_o2_keeps_the_kernels_layernorm_and_softmax_fp32_without_casts(graph_mode):
    """amp.keep_fp32 [LayerNorm, Softmax]: the kernels' LayerNorm and Softmax get no flag and no CastOutput (they
    take fp16 and compute in fp32), and the precision report says fp32; the Dense layers run fp16."""
    from omegaconf import OmegaConf

    from ampzoo.amp.policy import CastOutput, apply_policy, compute_dtype
    from ampzoo.engine.network import KernelAttentionSoftmax
    amp_cfg = OmegaConf.create({"level": "O2", "dtype": "float16", "keep_fp32": ["LayerNorm", "Softmax"],
                                "force_fp16": []})
    wrapped, _ = apply_policy(tiny_transformer("on"), amp_cfg)
    for kind in (CpuLayerNorm, KernelAttentionSoftmax):
        kept = [c for _, c in wrapped.cells_and_names() if isinstance(c, kind)]
        assert kept and all(c.fp32_inside and compute_dtype(c) == "float32" for c in kept)
        assert not any(isinstance(c, CastOutput) and isinstance(c.cell, kind) for _, c in wrapped.cells_and_names())
    assert all(compute_dtype(c) == "float16" for _, c in wrapped.cells_and_names() if isinstance(c, CpuDense))
    assert all(p.dtype == ms.float32 for p in wrapped.get_parameters())


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_fused_beam_step_is_log_softmax_plus_specials_then_top_k(graph_mode, dtype):
    """decode.cc's LogSoftmaxTopK against numpy: the same ids (a stable sort's, ties to the lower id), values
    within fp32's rounding, the specials' -inf never picked; rows wider than a block and narrower than one."""
    from cpu_kernels.cells import log_softmax_top_k_op
    rng = np.random.RandomState(7)
    for width in (1000, 37):
        logits = (rng.randn(9, width) * 5).astype(dtype)
        logits[3, 10:20] = logits[3, 5]  # ties
        specials = np.zeros(width, np.float32)
        specials[[0, 2]] = -np.inf
        values, ids = Call(log_softmax_top_k_op(6))(ms.Tensor(logits), ms.Tensor(specials))
        x = logits.astype(np.float64)
        logp = x - x.max(1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(1, keepdims=True)) + specials
        want = np.argsort(-logp, 1, kind="stable")[:, :6]
        np.testing.assert_array_equal(ids.asnumpy(), want)
        np.testing.assert_allclose(values.asnumpy(), np.take_along_axis(logp, want, 1), rtol=1e-5, atol=1e-5)
        assert not np.isin(ids.asnumpy(), [0, 2]).any()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_cached_self_attention_is_the_masked_attention_over_the_reordered_cache(graph_mode, dtype):
    """decode.cc's CachedSelfAttention against numpy: row r's cache is row reorder[r]'s for positions before t and
    this step's key and value at t, and the context is softmax(q k^T x scale) v over positions 0..t (what the
    causal mask leaves); in fp16 with the graph's roundings (scores and probabilities rounded to fp16)."""
    from cpu_kernels.cells import cached_attention_op
    rng = np.random.RandomState(3)
    rows, heads, length, dh = 6, 2, 7, 8
    cache_k = rng.randn(rows, heads, length, dh).astype(dtype)
    cache_v = rng.randn(rows, heads, length, dh).astype(dtype)
    qkv = rng.randn(rows, 1, 3 * heads * dh).astype(dtype)
    reorder = np.array([2, 2, 0, 5, 1, 3], np.int32)
    scale = np.float32(1 / np.sqrt(dh))
    fp16 = dtype == np.float16
    for t in (0, 4, length - 1):
        context, keys, values = Call(cached_attention_op())(
            ms.Tensor(qkv), ms.Tensor(cache_k), ms.Tensor(cache_v), ms.Tensor(reorder), ms.Tensor([t], ms.int32),
            ms.Tensor([scale]))
        q, k, v = (a.reshape(rows, heads, dh).astype(np.float32) for a in np.split(qkv[:, 0], 3, -1))
        want_k, want_v = cache_k[reorder].astype(np.float32), cache_v[reorder].astype(np.float32)
        want_k[:, :, t], want_v[:, :, t] = k, v
        np.testing.assert_array_equal(keys.asnumpy()[:, :, :t + 1], want_k[:, :, :t + 1])
        np.testing.assert_array_equal(values.asnumpy()[:, :, :t + 1], want_v[:, :, :t + 1])
        scores = np.einsum("rhd,rhpd->rhp", q, want_k[:, :, :t + 1])
        scores = (as_half(scores) if fp16 else scores) * scale
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        want = np.einsum("rhp,rhpd->rhd", as_half(probs) if fp16 else probs, want_v[:, :, :t + 1])
        got = context.asnumpy().reshape(rows, heads, dh)
        if fp16:
            close_in_fp16(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_o2_hands_dense_its_fp32_weights_as_stored_and_changes_no_number(graph_mode):
    """At O2 the Transformer's Dense takes its fp32 weight and bias as stored (no precision flag, so MindSpore
    casts neither): the loss and every gradient are bit for bit those of the Dense whose parameters MindSpore
    casts to fp16, and the parameters' gradients come back in fp32."""
    from omegaconf import OmegaConf
    from ampzoo.amp.policy import apply_policy, compute_dtype
    from ampzoo.models.transformer import Dense

    class Loss(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def construct(self, x):
            return (self.net(x) * ops.arange(16).astype(ms.float32).sin()).sum()

    rng = np.random.RandomState(0)
    x = ms.Tensor(rng.randn(6, 16).astype(np.float32))
    w, b = rng.randn(16, 16).astype(np.float32) * 0.3, np.linspace(-1, 1, 16).astype(np.float32)
    out = {}
    for as_stored in (True, False):
        dense = CpuDense.from_cell(Dense(16, 16))
        dense.weight.set_data(ms.Tensor(w))
        dense.bias.set_data(ms.Tensor(b))
        assert dense.weights_as_stored
        dense.weights_as_stored = as_stored
        net, _ = apply_policy(nn.SequentialCell([dense, nn.ReLU()]),
                              OmegaConf.create({"level": "O2", "dtype": "float16", "keep_fp32": [], "force_fp16": []}))
        assert compute_dtype(dense) == "float16"
        value, grads = ms.value_and_grad(Loss(net), grad_position=0, weights=net.trainable_params())(x)
        assert all(g.dtype == ms.float32 for g in grads[1])
        out[as_stored] = [value.asnumpy(), grads[0].asnumpy(), *(g.asnumpy() for g in grads[1])]
    for got, want in zip(out[True], out[False]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_the_token_embedding_kernel_gives_the_numbers_of_the_lookup_mul_and_add(graph_mode, level):
    """TokenEmbedding on the kernels (embed_op: the row, the scale and the position in one op, the fp32 table taken
    as stored) against the same network running nn.Embedding's lookup, the Mul and the Add: the embedding and the
    logits bit for bit at O0 and at O2 (where each value is rounded as O2's fp16 ops round it, so a shipped O2
    weight scores as before), and the table's gradient bit for bit at O0; at O2 it is summed in fp32, where
    MindSpore's fp16 lookup gradient summed in fp16, so within fp16's rounding of the largest row."""
    from omegaconf import OmegaConf
    from ampzoo.amp.policy import apply_policy

    class Embedded(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def construct(self, ids):
            return self.net.embed_tokens(ids, self.net.positions[:ids.shape[1]])

    rng = np.random.RandomState(0)
    src, tgt = (ms.Tensor(rng.randint(0, 50, shape).astype(np.int32)) for shape in ((3, 7), (3, 5)))
    out = {}
    from cpu_kernels.accelerate import accelerate
    from ampzoo.engine.network import KernelTokenEmbedding, units
    from ampzoo.models.transformer import TokenEmbedding, Transformer
    for kernel in (True, False):  # the same network but for the embedding
        ms.set_seed(0)
        net = Transformer(50, d_model=32, heads=4, ffn=64, encoder_layers=2, decoder_layers=2, dropout=0.0,
                          max_len=16)
        net = accelerate(net, units={k: v for k, v in units().items() if kernel or k is not TokenEmbedding})
        assert isinstance(net.embed, KernelTokenEmbedding) == kernel == getattr(net.embed, "weights_as_stored", False)
        net.set_train(False)
        inner = net
        net, _ = apply_policy(net, OmegaConf.create({"level": level, "dtype": "float16",
                                                     "keep_fp32": ["LayerNorm", "Softmax"], "force_fp16": []}))
        table = inner.embed.embedding_table
        grad = ms.grad(SquareLoss(net), grad_position=None, weights=[table])(src, tgt)[0]
        assert grad.dtype == ms.float32
        out[kernel] = [Embedded(inner)(src).asnumpy(), net(src, tgt).asnumpy(), grad.asnumpy()]
    assert out[True][0].dtype == (np.float16 if level == "O2" else np.float32)
    for got, want in zip(out[True][:2], out[False][:2]):
        np.testing.assert_array_equal(got, want)
    if level == "O0":
        np.testing.assert_array_equal(out[True][2], out[False][2])
    else:
        got, want = out[True][2], out[False][2]
        assert not np.array_equal(got, want)  # fp32 sums, not fp16 ones
        np.testing.assert_allclose(got, want, atol=2 ** -9 * np.abs(want).max())
