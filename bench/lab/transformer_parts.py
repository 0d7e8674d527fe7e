"""Each fast part of the Transformer train step, measured in the whole step: the step with every part as we
keep it, against the step with one part put back in the form it replaced.

    python -m bench.lab.transformer_parts [--rounds 6] [--steps 2] [--length 16]

Transformer-Tiny (the recipe's model, loss and optimizer at O0, bench.common.train_step) on 128 sentences x
`--length` tokens of random ids, at `setting=cased_4k` (pinned): the 8,000-piece vocabulary and one batch an
update its recorded figures were taken at (the published setting's 10,000 pieces and two-batch updates change
the step). Variants run in turn, `steps` steps each per round; a variant's figure is the median over rounds of
its time relative to the kept step in the same round. Measured in the step rather than alone because a part's
cost there (memory traffic, what MindSpore fuses or copies around it) is what counts. Results go to
bench/results/transformer_parts.json.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import contextlib
import statistics

import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops
import numpy as np

import ampzoo.engine.metrics as M
import ampzoo.models.transformer as T
from bench.common import alternate, bench_config, pop_option, ratio, save_result, train_step


def replaced_forms():
    """{name: context manager that swaps one part back}; entered while the variant's network is built."""

    @contextlib.contextmanager
    def patch(obj, name, value):
        old = getattr(obj, name)
        setattr(obj, name, value)
        try:
            yield
        finally:
            setattr(obj, name, old)

    def logits_3d(self, x):  # ops.matmul of a 3-D activation with the 2-D table: broadcast to every sentence
        return ops.matmul(x, ops.cast(self.embed.embedding_table, x.dtype).T).reshape(
            -1, self.embed.embedding_table.shape[0])

    def heads_sliced(self, x, parts):  # one head-major tensor, then sliced into Q, K, V
        b, t, _ = x.shape
        y = x.reshape(b, t, parts, self.h, self.dh).transpose(2, 0, 3, 1, 4)
        return tuple(y[i] for i in range(parts)) if parts > 1 else y[0]

    class MindSporeLoss(nn.Cell):  # nn.CrossEntropyLoss: log-softmax and a dense one-hot target
        def __init__(self, eps, ignore):
            super().__init__()
            self.ce = nn.CrossEntropyLoss(ignore_index=ignore, label_smoothing=eps)

        def construct(self, logits, labels):
            return self.ce(logits, labels)

    def mindspore_dense(d_in, d_out):
        return nn.Dense(d_in, d_out, weight_init="XavierUniform")

    return {
        "nn.LayerNorm (MindSpore's LayerNormGrad)": patch(T, "LayerNorm", lambda d: nn.LayerNorm((d,), epsilon=1e-5)),
        "nn.Dense (BiasAddGrad, 3-D reshapes)": patch(T, "Dense", mindspore_dense),
        "nn.CrossEntropyLoss": patch(M, "LabelSmoothedCrossEntropy", MindSporeLoss),
        "3-D tied projection (ops.matmul broadcast)": patch(T.Transformer, "logits", logits_3d),
        "Q, K, V sliced from one head-major tensor": patch(T.MultiHeadAttention, "heads", heads_sliced),
    }


def config():
    return bench_config(["recipe=transformer_tiny_multi30k_o0", "setting=cased_4k"], smoke=False)


def main(argv) -> dict:
    rounds, argv = pop_option(argv, "--rounds", 6)
    steps, argv = pop_option(argv, "--steps", 2)
    length, argv = pop_option(argv, "--length", 16)
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = config()
    rng = np.random.RandomState(0)
    batch = [ms.Tensor(rng.randint(4, cfg.model.num_classes, (128, length)).astype(np.int32)) for _ in range(3)]
    cells = {"kept (every part in its fast form)": train_step(cfg, 60, 1000)}
    for name, swap in replaced_forms().items():
        with swap:
            cells[name] = train_step(cfg, 60, 1000)
    runs = {name: (lambda c=cell: c(*batch)[0].asnumpy()) for name, cell in cells.items()}
    for fn in runs.values():
        fn()  # compile
    times = alternate(runs, rounds, steps)
    kept = times["kept (every part in its fast form)"]
    result = {"shape": f"128x{length}", "rounds": rounds, "steps_per_round": steps, "variants": {}}
    for name, ts in times.items():
        result["variants"][name] = {"ms": round(statistics.median(ts), 1), "time_vs_kept": ratio(ts, kept)}
        print(name, result["variants"][name], flush=True)
    save_result("transformer_parts", result)
    return result


if __name__ == "__main__":
    run(main)
