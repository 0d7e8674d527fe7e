"""A PyTorch reference for the Multi30k Transformer-Tiny run: the same model, data, batches and schedule trained
with PyTorch eager (bench-only peer), its val BLEU per epoch beside our run's.

    python -m bench.lab.torch_multi30k OUT_DIR [--epochs 20] [--ours RUN_DIR] [dataset.path=...] [overrides]

At `setting=cased_4k` (pinned), the setting its recorded comparison in docs/benchmarks.md was taken at, as its
loop has no gradient accumulation: raw cased text, 8,000-piece sentencepiece, one 4,096-token batch an update.
The same as `recipe=transformer_tiny_multi30k_o0 setting=cased_4k`, read from that recipe:
- model: 4+4 post-norm layers, d_model 128, 4 heads, FFN 256, tied embeddings N(0, d^-0.5) scaled by sqrt(d),
  sinusoidal positions, no final LayerNorm (fairseq's post-norm), dropout 0.3 on embeddings and sublayer
  outputs only; Xavier-uniform weights, zero biases (PyTorch's own random numbers: another initialisation);
- data: ampzoo.data.translation's sentencepiece vocabulary and token batches, in the run's batch order per epoch
  (ampzoo.data.sampling.epoch_order with runtime.seed): the very batches our run trained on, in the same order;
- optimization: Adam (betas, eps from the recipe), the recipe's inverse-sqrt learning rate per step
  (ampzoo.engine.optim.lr_schedule), label smoothing 0.1 over the vocabulary ignoring padding, fp32;
- evaluation: greedy decoding of val (ampzoo.models.decoding.greedy, up to max_len tokens), scored with
  ampzoo.models.decoding.bleu
  (sacrebleu 13a, lowercased and cased) on detokenized output against the raw references: what bench.multi30k
  reports per epoch for our run.
Writes OUT_DIR/curve.json (resumable: a checkpoint per epoch, `last.pt`) and, with --ours, a plot of both curves
OUT_DIR/curve.png and the comparison in OUT_DIR/compare.json.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import json
import math
import time
from pathlib import Path

import numpy as np

from ampzoo.cli import pop_option
from ampzoo.data.sampling import epoch_order
from ampzoo.data.translation import encode_pairs, make_batches, params
from ampzoo.engine.optim import lr_schedule, scaled_lr
from ampzoo.errors import fail
from bench.common import bench_config
from bench.multi30k import plot, split_cfg
from ampzoo.models.decoding import decode_batches, greedy, scores
from ampzoo.models.transformer import sinusoids


def build_peer(vocab: int, d: int, heads: int, ffn: int, layers: int, dropout: float, max_len: int):
    """Our Transformer in PyTorch (see the module docstring)."""
    import torch
    import torch.nn as tnn

    class Peer(tnn.Module):
        def __init__(self):
            super().__init__()
            self.embed = tnn.Embedding(vocab, d, padding_idx=0)
            self.core = tnn.Transformer(d, heads, layers, layers, ffn, dropout=dropout, batch_first=True)
            self.core.encoder.norm = self.core.decoder.norm = None  # post-norm: no final LayerNorm
            for layer in [*self.core.encoder.layers, *self.core.decoder.layers]:
                layer.dropout.p = 0.0  # no dropout after the ReLU
                for attn in (layer.self_attn, getattr(layer, "multihead_attn", None)):
                    if attn is not None:
                        attn.dropout = 0.0  # nor on attention weights
            for name, p in self.core.named_parameters():
                (tnn.init.xavier_uniform_ if p.dim() > 1 else tnn.init.zeros_)(p) if "norm" not in name else None
            tnn.init.normal_(self.embed.weight, 0, d ** -0.5)
            self.register_buffer("pe", torch.from_numpy(sinusoids(max_len, d)))  # our model's own table
            self.drop = tnn.Dropout(dropout)
            self.causal = self.core.generate_square_subsequent_mask(max_len)

        def embed_tokens(self, x):
            return self.drop(self.embed(x) * math.sqrt(d) + self.pe[: x.shape[1]])

        def encode(self, src):
            return self.core.encoder(self.embed_tokens(src), src_key_padding_mask=src.eq(0)), src.eq(0)

        def decode(self, tgt, memory, src_pad):
            t = tgt.shape[1]
            h = self.core.decoder(self.embed_tokens(tgt), memory, tgt_mask=self.causal[:t, :t], tgt_is_causal=True,
                                  memory_key_padding_mask=src_pad)
            return h @ self.embed.weight.T

        def forward(self, src, tgt):
            return self.decode(tgt, *self.encode(src))
    return Peer()


def peer_step(model, src):
    """The peer as an ampzoo.models.decoding Step for one batch: its own prefix, the whole of it decoded again each
    step."""
    import torch

    memory, src_pad = model.encode(src)
    prefix = []

    def step(last, t, keep):
        prefix.append(torch.from_numpy(np.asarray(last)).long())
        logits = model.decode(torch.stack(prefix, 1), memory, src_pad)[:, -1]
        ids = logits.argmax(-1, keepdim=True)
        return torch.log_softmax(logits, -1).gather(1, ids).numpy(), ids.numpy()
    return step


def greedy_bleu(model, cfg, split_cfg) -> dict:
    """Greedy val decoding with the peer, scored as bench.multi30k scores our checkpoints at beam 1."""
    import torch

    model.eval()
    examples, pairs, sp = encode_pairs(split_cfg.dataset, "test")
    max_len = params(split_cfg.dataset)["max_len"]
    hyps, t0 = [""] * len(examples), time.perf_counter()
    with torch.no_grad():
        for take, src in decode_batches(examples, min(cfg.decode.batch_size, len(examples))):
            step = peer_step(model, torch.from_numpy(src).long())
            for j, h in zip(take, greedy(step, len(src), max_len)[: len(take)]):
                hyps[j] = sp.decode(h)
    model.train()
    return {**scores(hyps, pairs), "decode_s": round(time.perf_counter() - t0, 1)}


def config(overrides):
    """The run the reference copies: the O0 recipe at setting=cased_4k, with the command line's overrides."""
    cfg = bench_config(["recipe=transformer_tiny_multi30k_o0", "setting=cased_4k", *overrides], smoke=False)
    if cfg.trainer.update_freq != 1:
        fail(f"trainer.update_freq={cfg.trainer.update_freq}: the reference trains one batch an update (give 1)")
    return cfg


def main(argv) -> dict:
    try:
        import torch
    except ImportError:
        fail("the PyTorch reference needs torch (bench-only): pip install torch")
    epochs, argv = pop_option(argv, "--epochs", 20)
    ours_dir, argv = pop_option(argv, "--ours", "", str)
    if not argv or "=" in argv[0]:
        fail(f"give an output directory first; got {argv[0] if argv else 'nothing'}")
    out, argv = Path(argv[0]), argv[1:]
    cfg = config(argv)
    if cfg.dataset.path is None:
        fail("dataset.path must point at the Multi30k files (the reference is for the real corpus)")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.runtime.seed)
    torch.set_num_threads(2)

    p = params(cfg.dataset)
    examples, _, _ = encode_pairs(cfg.dataset, "train")
    batches = make_batches(examples, sorted(p["buckets"]), cfg.dataset.max_tokens, cfg.dataset.batch_size, True)
    m = cfg.model.params
    model = build_peer(cfg.model.num_classes, m.d_model, m.heads, m.ffn, m.encoder_layers, m.dropout, m.max_len)
    opt = torch.optim.Adam(model.parameters(), 1.0, betas=tuple(cfg.optimizer.betas), eps=cfg.optimizer.eps)
    lrs = lr_schedule(cfg.schedule, scaled_lr(cfg.optimizer, cfg.dataset.batch_size), len(batches), epochs)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=cfg.trainer.ignore_index,
                                        label_smoothing=cfg.trainer.label_smoothing)
    val = split_cfg(cfg, "val")

    curve_file, ckpt = out / "curve.json", out / "last.pt"
    curve = json.loads(curve_file.read_text()) if curve_file.is_file() else {}
    if ckpt.is_file():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["rng"])
    done = len(curve)
    model.train()
    for epoch in range(done, epochs):
        t0, tokens, losses = time.perf_counter(), 0, []
        for i, b in enumerate(epoch_order(len(batches), cfg.runtime.seed, epoch)):
            step = epoch * len(batches) + i
            for group in opt.param_groups:
                group["lr"] = float(lrs[step])
            src, tgt_in, tgt_out = (torch.from_numpy(x).long() for x in batches[b])
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(src, tgt_in).reshape(-1, cfg.model.num_classes), tgt_out.reshape(-1))
            loss.backward()
            opt.step()
            losses.append(loss.item())
            tokens += int((tgt_out != 0).sum())
        train_s = time.perf_counter() - t0
        record = {"step": (epoch + 1) * len(batches), "train_loss": round(float(np.mean(losses)), 4),
                  "train_s": round(train_s, 1), "target_tokens_per_s": round(tokens / train_s, 1),
                  **greedy_bleu(model, cfg, val)}
        curve[str(epoch + 1)] = record
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()}, ckpt)
        curve_file.write_text(json.dumps(curve, indent=2))
        print(f"epoch {epoch + 1}: loss {record['train_loss']:.3f}, val BLEU {record['bleu_lowercase']:.2f} "
              f"lowercased, {record['bleu']:.2f} cased ({train_s:.0f} s)", flush=True)

    result = {"reference": curve}
    if ours_dir:
        ours = json.loads((Path(ours_dir) / "multi30k_curve.json").read_text())
        both = sorted(set(map(int, ours)) & set(map(int, curve)))
        result["compare"] = [{"epoch": e, "ours": ours[str(e)]["bleu_lowercase"],
                              "pytorch": curve[str(e)]["bleu_lowercase"]} for e in both]
        plot([("ours (MindSpore, O0)", {e: ours[e] for e in map(str, both)}, "bleu_lowercase"),
              ("PyTorch eager reference", curve, "bleu_lowercase")], out / "curve.png",
             "Transformer-Tiny, Multi30k en-de: our run against a PyTorch reference",
             "epoch (140 updates of <= 4,096 tokens; the same batches in the same order)",
             "val BLEU, lowercased (greedy)")
        (out / "compare.json").write_text(json.dumps(result["compare"], indent=2))
        for row in result["compare"]:
            print(f"epoch {row['epoch']}: ours {row['ours']:.2f}, PyTorch {row['pytorch']:.2f}")
    return result


if __name__ == "__main__":
    run(main)
