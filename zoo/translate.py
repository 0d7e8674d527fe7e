"""Decoding (greedy and beam search with a length penalty) and BLEU with sacrebleu.

Decoding runs the decoder on a fixed-shape token buffer (batch x max_len) every step, so graph mode
compiles it once per source shape; the search itself runs on the host in numpy.
"""
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np

from data.translation import BOS, EOS, PAD


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's ((5 + length) / 6) ** alpha (Wu et al. 2016), as in Vaswani et al. with alpha 0.6."""
    return ((5.0 + length) / 6.0) ** alpha


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def no_specials(logp: np.ndarray) -> np.ndarray:
    """Padding and BOS are never generated."""
    logp = logp.copy()
    logp[:, [PAD, BOS]] = -np.inf
    return logp


def beam_search(step: Callable[[np.ndarray, int], np.ndarray], batch: int, beam: int, max_len: int,
                alpha: float = 0.6) -> List[List[int]]:
    """step(tokens (batch*beam, max_len), t) -> next-token log-probabilities (batch*beam, vocab) at position t.

    Returns, per sentence, the finished hypothesis with the best length-normalised score (tokens after BOS,
    without EOS); hypotheses that never finish compete at max_len."""
    tokens = np.full((batch * beam, max_len), PAD, np.int32)
    tokens[:, 0] = BOS
    scores = np.zeros((batch, beam))
    scores[:, 1:] = -np.inf  # at t=0 all beams are the same: keep one
    finished: List[List] = [[] for _ in range(batch)]
    for t in range(max_len - 1):
        logp = no_specials(step(tokens, t)).reshape(batch, beam, -1)
        vocab = logp.shape[-1]
        cand = (scores[:, :, None] + logp).reshape(batch, -1)
        order = np.argsort(-cand, axis=1)[:, : 2 * beam]
        new_tokens = tokens.copy()
        for b in range(batch):
            kept = 0
            for idx in order[b]:
                score = cand[b, idx]
                if not np.isfinite(score):
                    break
                src_beam, token = divmod(int(idx), vocab)
                row = b * beam + src_beam
                if token == EOS:
                    if len(finished[b]) < beam:
                        hyp = tokens[row, 1:t + 1].tolist()
                        finished[b].append((score / length_penalty(t + 1, alpha), hyp))
                    continue
                new_tokens[b * beam + kept] = tokens[row]
                new_tokens[b * beam + kept, t + 1] = token
                scores[b, kept] = score
                kept += 1
                if kept == beam:
                    break
            scores[b, kept:] = -np.inf
        tokens = new_tokens
        best_open = scores.max(1) / length_penalty(max_len - 1, alpha)  # no open hypothesis can beat this
        if all(len(f) >= beam and max(s for s, _ in f) >= best_open[b] for b, f in enumerate(finished)):
            break
    out = []
    for b in range(batch):
        pool = finished[b] or [(scores[b, k] / length_penalty(max_len - 1, alpha), tokens[b * beam + k, 1:].tolist())
                               for k in range(beam) if np.isfinite(scores[b, k])]
        out.append(max(pool, key=lambda x: x[0])[1])
    return out


def greedy(step: Callable[[np.ndarray, int], np.ndarray], batch: int, max_len: int) -> List[List[int]]:
    tokens = np.full((batch, max_len), PAD, np.int32)
    tokens[:, 0] = BOS
    done = np.zeros(batch, bool)
    for t in range(max_len - 1):
        nxt = no_specials(step(tokens, t)).argmax(-1)
        tokens[:, t + 1] = np.where(done, PAD, nxt)
        done |= nxt == EOS
        if done.all():
            break
    out = []
    for row in tokens[:, 1:].tolist():
        row = row[:row.index(EOS)] if EOS in row else row
        out.append([x for x in row if x != PAD])
    return out


def bleu(hypotheses: List[str], references: List[str]) -> float:
    import sacrebleu
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


def translate(net, cfg, split: str = "test", beam: int = 4, alpha: float = 0.6, out: Optional[Path] = None) -> dict:
    """Decode a split with the trained network; BLEU against the untokenized references (sacrebleu 13a)."""
    import mindspore as ms
    import mindspore.nn as nn

    from data.translation import encode_pairs, params

    model = net
    while not hasattr(model, "encode"):  # look through the policy's CastOutput wrapper
        model = model.cell

    class Encode(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.model = model

        def construct(self, src):
            return self.model.encode(src)

    class Decode(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.model = model

        def construct(self, tgt, memory, src_bias):
            return ms.ops.cast(self.model.decode(tgt, memory, src_bias), ms.float32)

    encode, decode = Encode(), Decode()
    net.set_train(False)
    examples, pairs, sp = encode_pairs(cfg.dataset, split)
    max_len = params(cfg.dataset)["max_len"]
    hyps = []
    size = cfg.dataset.eval_batch_size
    for i in range(0, len(examples), size):
        chunk = examples[i:i + size]
        src_len = max(len(e[0]) for e in chunk)
        src = np.stack([np.pad(e[0], (0, src_len - len(e[0]))) for e in chunk])
        k = max(1, beam)
        memory, src_bias = encode(ms.Tensor(np.repeat(src, k, axis=0)))

        def step(tokens, t):
            return log_softmax(decode(ms.Tensor(tokens), memory, src_bias).asnumpy()[:, t])
        ids = beam_search(step, len(chunk), k, max_len, alpha) if beam > 1 else greedy(step, len(chunk), max_len)
        hyps.extend(sp.decode(h) for h in ids)
    refs = [tgt for _, tgt in pairs][: len(hyps)]
    if out is not None:
        Path(out).write_text("\n".join(hyps) + "\n", encoding="utf-8")
    return {"bleu": bleu(hyps, refs), "sentences": len(hyps), "beam": beam, "length_penalty": alpha}
