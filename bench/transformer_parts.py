"""Each part of the Transformer train step in the forms we tried, forward and backward, side by side.

    python -m bench.transformer_parts [--rows 4096] [--rounds 15]

Shapes are Transformer-Tiny's at 128 sentences x 32 tokens (4,096 rows, d_model 128, FFN 256, 4 heads,
vocabulary 8,000). Every variant is a Cell compiled once in graph mode and timed as value_and_grad with
respect to its input and its weights; variants of one part run in turn within each round, and the figure is the
median over rounds. The model (models/transformer.py) and the loss (zoo/metrics.py) keep the fastest correct
form of each part; results go to bench/results/transformer_parts.json.
"""
from zoo.runtime import cap_onednn_isa, quiet_mindspore

cap_onednn_isa()  # before MindSpore is imported
quiet_mindspore()

import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

VOCAB, D, HEADS, FFN, BATCH = 8000, 128, 4, 256, 128


def variants(rows: int):
    """{part: {form: (Cell, inputs)}}; the first form of each part is the one the model had before."""
    import mindspore as ms
    import mindspore.nn as nn
    import mindspore.ops as ops
    from mindspore import Parameter, Tensor

    from models.transformer import NEG, Dropout
    from zoo.metrics import LabelSmoothedCrossEntropy

    rng = np.random.RandomState(0)
    t = rows // BATCH
    x3 = Tensor(rng.randn(BATCH, t, D).astype(np.float32))
    table = Parameter(Tensor(rng.randn(VOCAB, D).astype(np.float32) * D ** -0.5), name="table")

    class Broadcast3D(nn.Cell):  # ops.matmul(x, table.T): the table is broadcast to every sentence
        def __init__(self):
            super().__init__()
            self.table = table

        def construct(self, x):
            return ops.matmul(x, self.table.T).sum()

    class Flat2D(nn.Cell):
        def __init__(self):
            super().__init__()
            self.table, self.mm = table, ops.MatMul(transpose_b=True)

        def construct(self, x):
            return self.mm(x.reshape(-1, D), self.table).sum()

    class QKVSliced(nn.Cell):  # one matmul, Q/K/V taken apart by slicing the head-major result
        def __init__(self):
            super().__init__()
            self.qkv = nn.Dense(D, 3 * D)

        def construct(self, x):
            b, n, _ = x.shape
            y = self.qkv(x).reshape(b, n, 3, HEADS, D // HEADS).transpose(2, 0, 3, 1, 4)
            q, k, v = y[0], y[1], y[2]
            return (q * k + v).sum()

    class QKVSplit(nn.Cell):  # one matmul, ops.split on the feature axis, then heads
        def __init__(self):
            super().__init__()
            self.qkv = nn.Dense(D, 3 * D)

        def construct(self, x):
            b, n, _ = x.shape
            q, k, v = (y.reshape(b, n, HEADS, D // HEADS).transpose(0, 2, 1, 3) for y in ops.split(self.qkv(x), D, -1))
            return (q * k + v).sum()

    class QKVSeparate(nn.Cell):  # three matmuls
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Dense(D, D), nn.Dense(D, D), nn.Dense(D, D)

        def construct(self, x):
            b, n, _ = x.shape
            q, k, v = (y.reshape(b, n, HEADS, D // HEADS).transpose(0, 2, 1, 3) for y in (self.q(x), self.k(x), self.v(x)))
            return (q * k + v).sum()

    class Norm(nn.Cell):
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

        def construct(self, x):
            return (self.norm(x) * x).sum()

    from models.transformer import LayerNorm

    class MaskBuilt(nn.Cell):  # the causal mask built every step
        def construct(self, x):
            n = x.shape[1]
            return (x.reshape(BATCH, n, HEADS, -1).transpose(0, 2, 1, 3).sum(-1, keepdims=True)
                    + (ops.triu(ops.ones((n, n), ms.float32), 1) * NEG).expand_dims(0).expand_dims(0)).sum()

    class MaskConst(nn.Cell):  # sliced from a constant built once
        def __init__(self):
            super().__init__()
            self.causal = Tensor(np.triu(np.full((64, 64), NEG, np.float32), 1))

        def construct(self, x):
            n = x.shape[1]
            return (x.reshape(BATCH, n, HEADS, -1).transpose(0, 2, 1, 3).sum(-1, keepdims=True)
                    + self.causal[:n, :n]).sum()

    class Drop(nn.Cell):
        def __init__(self, drop):
            super().__init__()
            self.drop = drop

        def construct(self, x):
            return (self.drop(x) * x).sum()

    class Loss(nn.Cell):
        def __init__(self, loss):
            super().__init__()
            self.loss = loss

        def construct(self, logits, labels):
            return self.loss(logits, labels)

    logits = Tensor(rng.randn(rows, VOCAB).astype(np.float32))
    labels = Tensor(rng.randint(0, VOCAB, rows).astype(np.int32))  # id 0 is padding: ignored
    return {
        "tied output projection": {"3-D broadcast matmul": (Broadcast3D(), (x3,)), "one 2-D matmul": (Flat2D(), (x3,))},
        "self-attention Q, K, V": {"one matmul, sliced": (QKVSliced(), (x3,)), "one matmul, split": (QKVSplit(), (x3,)),
                                   "three matmuls": (QKVSeparate(), (x3,))},
        "LayerNorm": {"nn.LayerNorm": (Norm(nn.LayerNorm((D,), epsilon=1e-5)), (x3,)),
                      "composed from ops": (Norm(LayerNorm(D)), (x3,))},
        "causal mask": {"built per step": (MaskBuilt(), (x3,)), "constant, sliced": (MaskConst(), (x3,))},
        "dropout 0.3 (training)": {"nn.Dropout": (Drop(nn.Dropout(p=0.3)), (x3,)), "p=0: not in the graph": (Drop(Dropout(0.0)), (x3,))},
        "label-smoothed loss": {"nn.CrossEntropyLoss": (Loss(nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)), (logits, labels)),
                                "log_softmax + gather": (Loss(LabelSmoothedCrossEntropy(0.1, 0)), (logits, labels))},
    }


def main(argv) -> dict:
    import mindspore as ms

    from bench.common import pop_option, save_result

    rows, argv = pop_option(argv, "--rows", 4096)
    rounds, argv = pop_option(argv, "--rounds", 15)
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    result = {"rows": rows, "rounds": rounds, "parts": {}}
    for part, forms in variants(rows).items():
        fns = {}
        for form, (cell, inputs) in forms.items():
            cell.set_train()
            grad = ms.value_and_grad(cell, grad_position=0, weights=cell.trainable_params() or None)
            fns[form] = (ms.jit(grad), inputs)
            fns[form][0](*inputs)  # compile
        times = {f: [] for f in fns}
        for _ in range(rounds):
            for form, (fn, inputs) in fns.items():
                t0 = time.perf_counter()
                out = fn(*inputs)
                out[0].asnumpy()
                times[form].append((time.perf_counter() - t0) * 1e3)
        first = statistics.median(next(iter(times.values())))
        result["parts"][part] = {f: {"ms": round(statistics.median(ts), 2),
                                     "vs first": round(statistics.median(ts) / first, 3)} for f, ts in times.items()}
        print(part, {f: v["ms"] for f, v in result["parts"][part].items()}, flush=True)
    save_result("transformer_parts", result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
