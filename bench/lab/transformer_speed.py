"""Transformer-Tiny train step: ours against PyTorch eager's nn.Transformer, same shapes, same machine.

    python -m bench.lab.transformer_speed [--rounds 8] [--steps 3] [--settings 0,1,2,3,4] [--shapes 16,32]
                                          [--compute fp32,bf16]

Both sides: 4+4 layers, d_model 128, 4 heads, FFN 256, post-norm (no final LayerNorm), vocabulary 8,000 with tied
embeddings, sinusoidal positions, dropout 0.3 on embeddings and sublayer outputs (none on attention weights or
after the ReLU, as fairseq), label-smoothed (0.1) cross-entropy ignoring padding, Adam (0.9, 0.98). Batches are
128 sentences x 16 and x 32 tokens of random ids. Ours runs at `setting=cased_4k` (pinned): the peer's vocabulary
of 8,000 and one batch an update, as its recorded figures were taken. Ours is the driver's own train step
(bench.common.train_step: the recipe's policy, loss scale and optimizer) at each AMP setting; PyTorch runs fp32
(its CPU peer), the same model bench.lab.torch_multi30k trains for the quality comparison. Variants run in turn,
`steps` steps each per round; a ratio is the median of per-round ratios, so drift on a shared machine cancels.
Each of our settings keeps its compiled graphs (about 3 GB each at 128 x 32), so a run with every setting holds
some 18 GB: measure O0 against PyTorch alone (`--settings 0`) for the headline ratio, then the AMP settings.
--compute fp32,bf16 times each AMP setting once per runtime.cpu_compute value (how its fp16 Dense layers
multiply; bench.speed's option), side by side. PyTorch is a bench-only dependency (`pip install torch`);
without it the peer rows say so.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import statistics
import time

import mindspore as ms
import numpy as np

from ampzoo.errors import fail
from ampzoo.runtime import onednn_note
from bench.common import (alternate, bench_config, pop_option, ratio, ratio_ci, save_result, train_step,
                          under_compute)
from bench.lab.torch_multi30k import build_peer

SHAPES = [(128, 16), (128, 32)]
# (name, recipe, overrides): the recipe settings, and what MindSpore offers to shrink O2's cost on a CPU
SETTINGS = [
    ("O0 fp32", "transformer_tiny_multi30k_o0", []),
    ("O2 recipe (LayerNorm, Softmax fp32; dynamic scale)", "transformer_tiny_multi30k_o2", []),
    ("O2, no loss scale", "transformer_tiny_multi30k_o2", ["amp.loss_scale.type=none"]),
    ("O3 (all fp16; dynamic scale)", "transformer_tiny_multi30k_o2", ["amp.level=O3", "amp.keep_fp32=[]"]),
    ("O1 (Dense and attention matmuls fp16; dynamic scale)", "transformer_tiny_multi30k_o2",
     ["amp.level=O1", "amp.keep_fp32=[]", "amp.force_fp16=[BatchMatMul]"]),
]


def torch_step(batch: int, length: int, vocab: int = 8000, d: int = 128):
    """The PyTorch peer of bench.lab.torch_multi30k (nn.Transformer layers as our model: post-norm without final
    LayerNorms, tied embeddings, dropout where fairseq has it) at these shapes; returns a function running one
    step."""
    import torch
    import torch.nn as tnn

    torch.manual_seed(0)
    model = build_peer(vocab, d, 4, 256, 4, 0.3, 64).train()
    opt = torch.optim.Adam(model.parameters(), 1e-3, betas=(0.9, 0.98))
    loss_fn = tnn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
    g = torch.Generator().manual_seed(0)
    src, tgt_in, tgt_out = (torch.randint(4, vocab, (batch, length), generator=g) for _ in range(3))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(src, tgt_in).reshape(-1, vocab), tgt_out.reshape(-1))
        loss.backward()
        opt.step()
        return float(loss)
    return step


def our_config(recipe: str, overrides):
    """The recipe itself (not its smoke block) at setting=cased_4k, with a variant's overrides."""
    return bench_config([f"recipe={recipe}", "setting=cased_4k", *overrides], smoke=False)


def our_step(recipe: str, overrides, batch: int, length: int):
    cfg = our_config(recipe, overrides)
    cell = train_step(cfg, 60, 1000)
    rng = np.random.RandomState(0)
    inputs = [ms.Tensor(rng.randint(4, cfg.model.num_classes, (batch, length)).astype(np.int32)) for _ in range(3)]

    def step():
        return float(cell(*inputs)[0].asnumpy())
    return step


def main(argv) -> dict:
    rounds, argv = pop_option(argv, "--rounds", 8)
    steps, argv = pop_option(argv, "--steps", 3)
    chosen, argv = pop_option(argv, "--settings", list(range(len(SETTINGS))),
                              lambda v: [int(i) for i in v.split(",")])
    computes, argv = pop_option(argv, "--compute", None, lambda v: v.split(","))
    lengths, argv = pop_option(argv, "--shapes", [t for _, t in SHAPES], lambda v: [int(i) for i in v.split(",")])
    if 0 not in chosen or any(i not in range(len(SETTINGS)) for i in chosen):
        fail(f"--settings takes indices of {[name for name, _, _ in SETTINGS]} and must include 0 (O0, the base)")
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        import torch
        peer_note = f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads, fp32, eager"
    except ImportError:
        torch, peer_note = None, "PyTorch is not installed (pip install torch): no peer measured"
    result = {"rounds": rounds, "steps_per_round": steps, "peer": peer_note, "onednn": onednn_note(), "shapes": {}}
    for batch, length in [(128, t) for t in lengths]:
        variants = {}
        for i in chosen:
            step = our_step(SETTINGS[i][1], SETTINGS[i][2], batch, length)
            for mode in (computes if computes and i else [None]):
                variants[SETTINGS[i][0] + (f", {mode}" if mode else "")] = under_compute(mode, step) if mode else step
        if torch is not None:
            variants["PyTorch nn.Transformer fp32"] = torch_step(batch, length)
        compile_s = {}
        for name, fn in variants.items():  # first call: compile (ours) and warm-up
            t0 = time.perf_counter()
            fn()
            compile_s[name] = round(time.perf_counter() - t0, 1)
        times = alternate(variants, rounds, steps)
        base = times["O0 fp32"]
        peer = times.get("PyTorch nn.Transformer fp32")
        rows = {}
        for name, ts in times.items():
            rows[name] = {"ms": round(statistics.median(ts), 1), "first_call_s": compile_s[name],
                          "time_vs_O0": ratio(ts, base), "time_vs_O0_95ci": ratio_ci(ts, base)}
            if peer is not None:
                rows[name]["time_vs_pytorch"] = ratio(ts, peer)
                rows[name]["time_vs_pytorch_95ci"] = ratio_ci(ts, peer)
        key = f"{batch}x{length}"
        result["shapes"][key] = rows
        for name, row in rows.items():
            print(f"{key} {name}: {row}", flush=True)
    from cpu_kernels import cpu_compute, has_ops
    result["cpu_compute"] = cpu_compute() if has_ops() else None  # how the fp16 Dense layers multiplied
    save_result("transformer_speed" + ("" if len(chosen) == len(SETTINGS) else "_" + "_".join(map(str, chosen))),
                result)
    return result


if __name__ == "__main__":
    run(main)
