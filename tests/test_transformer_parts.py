"""The Transformer's fast parts (written-out backward passes, token batching, the Multi30k recipes) against
what they replace: MindSpore's own Cells give the same values and gradients, batches keep to their budget,
and the recipes' keep-lists hold on a real forward pass."""
import numpy as np
import pytest

import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops

from ampzoo.amp.names import portable
from ampzoo.amp.policy import apply_policy
from ampzoo.data.translation import make_batches
from ampzoo.models import create_model
from ampzoo.models.transformer import Dense, LayerNorm
from tests.conftest import built_with
from tests.test_transformer import TINY, tiny_batch
from ampzoo.compose import compose
from ampzoo.engine.metrics import LabelSmoothedCrossEntropy


class Probe(nn.Cell):
    """sum(f(x) * sin(x)): a loss whose gradient reaches every output element differently."""

    def __init__(self, f):
        super().__init__()
        self.f = f

    def construct(self, x):
        return (self.f(x) * ops.sin(x[..., :1])).sum()


def grads(cell, x):
    fn = ms.jit(ms.value_and_grad(Probe(cell), grad_position=0, weights=cell.trainable_params()))
    value, (gx, gw) = fn(x)
    return float(value.asnumpy()), gx.asnumpy(), [g.asnumpy() for g in gw]


def assert_same(a, b):
    assert a[0] == pytest.approx(b[0], rel=1e-5)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-4, atol=1e-5)
    for x, y in zip(a[2], b[2]):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


def test_dense_matches_mindsporess_dense(graph_mode):
    rng = np.random.RandomState(0)
    x = ms.Tensor(rng.randn(3, 5, 16).astype(np.float32))
    ours, theirs = Dense(16, 24), nn.Dense(16, 24)
    theirs.weight.set_data(ours.weight.data.copy())
    theirs.bias.set_data(ms.Tensor(rng.randn(24).astype(np.float32)))
    ours.bias.set_data(theirs.bias.data.copy())
    assert_same(grads(ours, x), grads(theirs, x))


def test_layernorm_matches_mindsporess_layernorm(graph_mode):
    rng = np.random.RandomState(1)
    x = ms.Tensor((rng.randn(4, 6, 16) * 3 + 1).astype(np.float32))
    ours, theirs = LayerNorm(16), nn.LayerNorm((16,), epsilon=1e-5)
    for cell in (ours, theirs):
        cell.gamma.set_data(ms.Tensor(np.linspace(0.5, 1.5, 16).astype(np.float32)))
        cell.beta.set_data(ms.Tensor(np.linspace(-0.2, 0.3, 16).astype(np.float32)))
    assert_same(grads(ours, x), grads(theirs, x))
    assert isinstance(ours, nn.LayerNorm)  # keep_fp32: [LayerNorm] reaches it


class LayerNormReturningRstd(nn.Cell):
    """ops.LayerNorm as documented since MindSpore 2.3 and as Ascend's kernels return it: (y, mean, rstd); the
    CPU kernel's third output is the variance."""

    def __init__(self, epsilon):
        super().__init__()
        self.norm, self.epsilon = ops.LayerNorm(-1, -1, epsilon), epsilon

    def construct(self, x, gamma, beta):
        y, mean, variance = self.norm(x, gamma, beta)
        return y, mean, ops.rsqrt(variance + self.epsilon)


def test_layernorm_gradient_holds_whichever_statistic_the_kernel_returns(graph_mode):
    """NormFunction, the LayerNorm of every device but the CPU with its kernels."""
    rng = np.random.RandomState(4)
    x = ms.Tensor((rng.randn(3, 7, 32) * 2 - 1).astype(np.float32))
    as_on_cpu, as_on_ascend = LayerNorm(32), LayerNorm(32)
    as_on_ascend.function.norm = LayerNormReturningRstd(1e-5)
    assert_same(grads(as_on_ascend, x), grads(as_on_cpu, x))
    assert_same(grads(as_on_cpu, x), grads(nn.LayerNorm((32,), epsilon=1e-5), x))


@pytest.mark.parametrize("eps, ignore", [(0.1, 0), (0.0, -100), (0.2, 3)])
def test_label_smoothed_loss_matches_cross_entropy_loss(graph_mode, eps, ignore, monkeypatch):
    def refused_on_ascend(*args, **kwargs):  # its reduction="add" is refused on Ascend; the loss must not need it
        raise AssertionError("tensor_scatter_elements used")
    monkeypatch.setattr(ops, "tensor_scatter_elements", refused_on_ascend)
    rng = np.random.RandomState(2)
    logits = ms.Tensor((rng.randn(40, 30) * 3).astype(np.float32))
    labels = ms.Tensor(rng.randint(0, 30, 40).astype(np.int32))
    ours = ms.jit(ms.value_and_grad(LabelSmoothedCrossEntropy(eps, ignore), grad_position=0))(logits, labels)
    theirs = ms.jit(ms.value_and_grad(nn.CrossEntropyLoss(ignore_index=ignore, label_smoothing=eps),
                                      grad_position=0))(logits, labels)
    assert float(ours[0].asnumpy()) == pytest.approx(float(theirs[0].asnumpy()), rel=1e-5)
    np.testing.assert_allclose(ours[1].asnumpy(), theirs[1].asnumpy(), atol=1e-6)


def examples(lengths):
    return [(np.arange(1, n + 1, dtype=np.int32), np.arange(1, n + 1, dtype=np.int32),
             np.arange(1, n + 1, dtype=np.int32)) for n in lengths]


def test_token_batches_keep_within_max_tokens_and_use_only_bucket_shapes():
    rng = np.random.RandomState(0)
    data = examples(rng.randint(1, 40, 500))
    buckets = [8, 16, 24, 40]
    batches = make_batches(data, buckets, 256, 0, train=True)
    shapes = {b[0].shape for b in batches}
    assert {s[1] for s in shapes} <= set(buckets)
    assert all(rows * width <= 256 for rows, width in shapes)
    assert shapes == {(256 // w, w) for w in buckets}  # one full shape per bucket: few compiled graphs
    kept = sum(len(b[0]) for b in batches)
    assert kept > 500 - sum(256 // w for w in buckets)  # only each bucket's last partial batch is dropped
    for src, tgt_in, tgt_out in batches:  # padding is 0 after each sentence, never inside it
        lengths = (src > 0).sum(1)
        assert all((row[:n] > 0).all() and (row[n:] == 0).all() for row, n in zip(src, lengths))


def test_sentence_batches_remain_the_alternative():
    data = examples([5] * 10 + [20] * 7)
    batches = make_batches(data, [8, 24], 0, 4, train=False)  # test split: nothing dropped
    assert [b[0].shape for b in batches] == [(4, 8), (4, 8), (2, 8), (4, 24), (3, 24)]


@pytest.mark.parametrize("recipe", ["transformer_tiny_multi30k_o0", "transformer_tiny_multi30k_o2"])
def test_tiny_recipes_compose_as_published(recipe):
    cfg = compose([f"recipe={recipe}"])
    p = cfg.model.params
    assert (p.d_model, p.heads, p.ffn, p.encoder_layers, p.decoder_layers, p.dropout) == (128, 4, 256, 4, 4, 0.3)
    assert (cfg.optimizer.lr, cfg.schedule.warmup_steps, cfg.trainer.label_smoothing) == (5e-3, 2000, 0.1)
    assert (cfg.decode.beam, cfg.decode.length_penalty, cfg.decode.average_last) == (5, 1.0, 10)
    assert cfg.target.published == 41.02 and "Revisit-MMT" in cfg.target.source
    assert cfg.dataset.params.test_prefix == "test_2016_flickr" and cfg.dataset.max_tokens > 0
    d, t = cfg.dataset.params, cfg.trainer  # the published setting: lowercased Moses text, 10k BPE, ~8k tokens
    assert (d.lowercase, d.moses, d.spm_type, d.vocab_size, cfg.model.num_classes) == (True, True, "bpe", 10000, 10000)
    assert (cfg.dataset.max_tokens * t.update_freq, t.max_steps // t.update_freq, t.epochs) == (8192, 8000, 124)
    old = compose([f"recipe={recipe}", "setting=cased_4k"])  # the earlier default setting: one override away
    assert (old.trainer.update_freq, old.trainer.max_steps, old.trainer.epochs, old.dataset.params.vocab_size) == (
        1, 8000, 60, 8000) and "lowercase" not in old.dataset.params


def test_o2_keep_list_holds_on_a_real_forward_pass(pynative_mode):
    """Forward hooks see what each Cell really returned: LayerNorm and Softmax outputs fp32 (then cast back
    to fp16 at their edge), Dense and the attention matmuls fp16. The CPU kernels' LayerNorm and Softmax compute
    in fp32 and return fp16 themselves (fp32_inside: no Cast at their edge), and the report says fp32."""
    from ampzoo.amp.policy import compute_dtype
    from ampzoo.models.transformer import BatchMatMul
    cfg = compose(["recipe=transformer_tiny_multi30k_o2"])
    assert list(cfg.amp.keep_fp32) == ["LayerNorm", "Softmax"] and cfg.amp.loss_scale.type.value == "dynamic"
    net, _ = apply_policy(built_with("auto", lambda: create_model("transformer", num_classes=50, **TINY)), cfg.amp)
    seen = {}

    def hook(cell, inputs, output):  # CpuSoftmax under the name a keep-list uses
        seen.setdefault(portable(type(cell).__name__), set()).add(str(output.dtype))
    for _, cell in net.cells_and_names():
        if isinstance(cell, (nn.LayerNorm, nn.Softmax, nn.Dense, BatchMatMul)):
            cell.register_forward_hook(hook)
    src, tgt_in, _ = tiny_batch()
    out = net(src, tgt_in)
    for kind in (nn.LayerNorm, nn.Softmax):
        kept = [c for _, c in net.cells_and_names() if isinstance(c, kind)]
        inside = all(getattr(c, "fp32_inside", False) for c in kept)
        assert seen[kind.__name__] == {"Float16" if inside else "Float32"}
        assert all(compute_dtype(c) == "float32" for c in kept)
    assert seen["Dense"] == {"Float16"} and seen["BatchMatMul"] == {"Float16"}
    assert out.dtype == ms.float32  # the loss is computed in fp32


def test_decode_batches_are_one_shape_sorted_and_cover_every_sentence():
    from ampzoo.models.decoding import decode_batches
    rng = np.random.RandomState(3)
    data = examples(rng.randint(1, 30, 23))
    seen, shapes, previous_max = [], set(), 0
    for take, src in decode_batches(data, 8):
        shapes.add(src.shape)
        lengths = [len(data[j][0]) for j in take]
        assert min(lengths) >= previous_max  # sorted by length across batches
        previous_max = max(lengths)
        for row, j in zip(src, take):  # each row is its sentence, zero-padded
            np.testing.assert_array_equal(row[:len(data[j][0])], data[j][0])
        seen.extend(take.tolist())
    assert sorted(seen) == list(range(23)) and len(shapes) == 1  # every sentence once; one compiled shape


def test_o3_layernorm_gradient_holds_at_large_activations(graph_mode):
    """O3 runs LayerNorm in fp16: its backward recomputes the statistics in fp32, so activations of a few
    hundred (whose squared deviations overflow fp16) still get the fp32 gradient, within fp16's precision."""
    rng = np.random.RandomState(5)
    x = (rng.randn(64, 256) * 300).astype(np.float16)
    weight = ms.Tensor(np.sin(np.arange(64 * 256)).reshape(64, 256).astype(np.float32))

    class Loss(nn.Cell):
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

        def construct(self, t):
            return (self.norm(t).astype(ms.float32) * weight).sum()

    low = LayerNorm(256).to_float(ms.float16)
    dx16 = ms.grad(Loss(low))(ms.Tensor(x)).asnumpy().astype(np.float32)
    dx32 = ms.grad(Loss(LayerNorm(256)))(ms.Tensor(x.astype(np.float32))).asnumpy()
    assert np.all(np.isfinite(dx16))
    assert np.linalg.norm(dx16 - dx32) / np.linalg.norm(dx32) < 1e-2
