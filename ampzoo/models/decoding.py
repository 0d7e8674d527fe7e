"""Decoding (greedy and beam search) and BLEU with sacrebleu (13a on detokenized text, and multi-bleu.perl's).

Incremental: the encoder runs once per batch, on each sentence once (not once per beam); each step feeds one
token per hypothesis through `Transformer.decode_step`, whose self-attention keys and values live in a
fixed-shape cache on the device (reordered there when beams swap), and returns only the top 2 x beam candidates
of each row. Sentences are sorted by length into batches of `decode.batch_size`, all of one shape, so graph
mode compiles one encoder and one step graph per split, and a step moves (rows x 2 x beam) numbers to the host,
not (rows x max_len x vocabulary).

The search itself (which candidates survive, when a sentence is done) runs on the host, vectorised in numpy,
and is shared with `full_recompute_step`, the reference that re-runs the whole decoder on the token buffer at
every step: tests and bench/lab/decode.py check that both give the same hypotheses.
"""
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import mindspore as ms
import mindspore.nn as nn
import numpy as np
import sacrebleu

from ampzoo.data.translation import BOS, EOS, PAD, encode_pairs, params

# step(last_tokens (rows,), t, reorder (rows,)) -> (log-probabilities (rows, k), token ids (rows, k)) of the
# best k next tokens at position t + 1, after reordering the hypotheses' state by `reorder`.
Step = Callable[[np.ndarray, int, np.ndarray], Tuple[np.ndarray, np.ndarray]]


def length_penalty(length: int, alpha: float, form: str = "gnmt") -> float:
    """gnmt: ((5 + length) / 6) ** alpha (Wu et al. 2016; Vaswani et al. with alpha 0.6).
    fairseq: length ** alpha (--lenpen), length counting EOS."""
    return length ** alpha if form == "fairseq" else ((5.0 + length) / 6.0) ** alpha


def beam_search(step: Step, batch: int, beam: int, max_len: int, alpha: float = 0.6,
                form: str = "gnmt") -> List[List[int]]:
    """Returns, per sentence, the finished hypothesis with the best length-normalised score (tokens after BOS,
    without EOS); hypotheses that never finish compete at max_len. A sentence is done once `beam` hypotheses
    have finished (fairseq's rule); the search stops when every sentence is done."""
    rows = batch * beam
    tokens = np.full((rows, max_len), PAD, np.int32)
    tokens[:, 0] = BOS
    scores = np.full((batch, beam), -np.inf)
    scores[:, 0] = 0.0  # at t=0 all beams are the same: keep one
    finished: List[List] = [[] for _ in range(batch)]
    reorder = np.arange(rows, dtype=np.int32)
    first_row = np.arange(batch)[:, None] * beam
    for t in range(max_len - 1):
        values, ids = step(tokens[:, t], t, reorder)
        k = values.shape[1]
        cand = (scores[:, :, None] + values.reshape(batch, beam, k)).reshape(batch, -1)
        order = np.argsort(-cand, axis=1, kind="stable")[:, : 2 * beam]  # the best 2 x beam of each sentence
        score = np.take_along_axis(cand, order, 1)
        src_row = first_row + order // k
        token = ids[src_row, order % k]
        done = np.array([len(f) >= beam for f in finished])  # done sentences' rows idle until the batch is
        live = np.isfinite(score) & ~done[:, None]
        grows = live & (token != EOS)
        rank = np.cumsum(grows, 1)  # in score order, candidates that extend a hypothesis, up to and with this one
        # EOS ends a hypothesis if it comes before the beam is full (at most one EOS per source row, so the
        # 2 x beam candidates always fill it); a sentence keeps its first `beam` finished hypotheses
        for b, i in zip(*np.nonzero(live & (token == EOS) & (rank < beam))):
            if len(finished[b]) < beam:
                normalised = score[b, i] / length_penalty(t + 1, alpha, form)
                finished[b].append((normalised, tokens[src_row[b, i], 1:t + 1].tolist()))
        b, i = np.nonzero(grows & (rank <= beam))
        dest = first_row[b, 0] + rank[b, i] - 1
        reorder = np.arange(rows, dtype=np.int32)
        reorder[dest] = src_row[b, i]
        tokens = tokens[reorder]
        tokens[dest, t + 1] = token[b, i]
        scores = np.full((batch, beam), -np.inf)
        scores.reshape(-1)[dest] = score[b, i]
        if all(len(f) >= beam for f in finished):
            break
    out = []
    for b in range(batch):
        pool = finished[b] or [(scores[b, j] / length_penalty(max_len - 1, alpha, form),
                                tokens[b * beam + j, 1:].tolist())
                               for j in range(beam) if np.isfinite(scores[b, j])]
        out.append(max(pool, key=lambda x: x[0])[1])
    return out


def greedy(step: Step, batch: int, max_len: int) -> List[List[int]]:
    tokens = np.full((batch, max_len), PAD, np.int32)
    tokens[:, 0] = BOS
    done = np.zeros(batch, bool)
    keep = np.arange(batch, dtype=np.int32)
    for t in range(max_len - 1):
        nxt = step(tokens[:, t], t, keep)[1][:, 0]
        tokens[:, t + 1] = np.where(done, PAD, nxt)
        done |= nxt == EOS
        if done.all():
            break
    out = []
    for row in tokens[:, 1:].tolist():
        row = row[:row.index(EOS)] if EOS in row else row
        out.append([x for x in row if x != PAD])
    return out


def bleu(hypotheses: List[str], references: List[str], lowercase: bool = False) -> float:
    return signed_bleu(hypotheses, references, lowercase)[0]


def signed_bleu(hypotheses: List[str], references: List[str], lowercase: bool) -> Tuple[float, str]:
    """sacrebleu's corpus BLEU and its signature (which says how it was scored)."""
    metric = sacrebleu.BLEU(lowercase=lowercase)
    return float(metric.corpus_score(hypotheses, [references]).score), str(metric.get_signature())


def multi_bleu(hypotheses: List[str], references: List[str]) -> Tuple[float, str]:
    """BLEU as multi-bleu.perl and fairseq's scorer compute it on text already tokenized (and lowercased):
    corpus n-gram precisions 1-4 on whitespace tokens, their geometric mean, the brevity penalty, no smoothing
    (a zero precision gives 0). sacrebleu with tokenize='none' and smooth_method='none' is exactly that."""
    metric = sacrebleu.BLEU(tokenize="none", smooth_method="none", force=True)
    return float(metric.corpus_score(hypotheses, [references]).score), str(metric.get_signature())


def scores(hypotheses: List[str], pairs, tokenized: Optional[Tuple[List[str], List[str]]] = None) -> dict:
    """Cased and lowercased BLEU of the hypotheses against the raw references of (source, reference) pairs,
    with sacrebleu's signatures (which say how each was scored); with `tokenized` (the hypotheses and references
    as lowercased Moses tokens), bleu_moses_lc too: multi-bleu.perl's BLEU, the Multi30k papers' number."""
    refs = [tgt for _, tgt in pairs][: len(hypotheses)]
    out = {}
    for key, lowercase in (("bleu", False), ("bleu_lowercase", True)):
        out[key], out[f"signature{key[4:]}"] = signed_bleu(hypotheses, refs, lowercase)
    if tokenized is not None:
        out["bleu_moses_lc"], out["signature_moses_lc"] = multi_bleu(*tokenized)
    return out


def unwrap(net):
    """The Transformer under the policy's CastOutput wrappers."""
    while not hasattr(net, "decode_step"):
        net = net.cell
    return net


class IncrementalDecoder:
    """Graph-mode Cells around a trained Transformer for one beam width: `start` once per batch, then `next` per
    position, returning the best 2 x beam candidates of each row. Greedy (beam 1) never reorders rows, so its
    step has no cache gather."""

    def __init__(self, net, beam: int):
        model, beam = unwrap(net), max(1, beam)
        specials = np.zeros(model.embed.embedding_table.shape[0], np.float32)
        specials[[PAD, BOS]] = -np.inf  # padding and BOS are never generated

        class Start(nn.Cell):
            def __init__(self):
                super().__init__(auto_prefix=False)
                self.model = model

            def construct(self, src):
                return self.model.start_decoding(src, beam)

        class Next(nn.Cell):
            def __init__(self):
                super().__init__(auto_prefix=False)
                self.model, self.k, self.reorders = model, 2 * beam, beam > 1
                self.specials = ms.Tensor(specials)

            def construct(self, token, t, reorder, cache, cross, src_bias):
                reorder = reorder if self.reorders else None  # a Python constant: greedy never reorders
                return self.model.next_candidates(token, t, cache, cross, src_bias, self.specials, self.k, reorder)

        self.ms, self.start_cell, self.next_cell = ms, Start(), Next()
        self.max_len, self.beam = model.max_len, beam

    def search(self, src: np.ndarray, alpha: float, form: str, max_len: int) -> List[List[int]]:
        ms, beam = self.ms, self.beam
        cross, src_bias, cache = self.start_cell(ms.Tensor(src))
        # mutable: a tuple input is otherwise a graph constant, and every new cache would compile the step again
        state, cross = {"cache": ms.mutable(cache)}, ms.mutable(cross)

        def step(last, t, reorder):
            values, ids, cache = self.next_cell(ms.Tensor(last), ms.Tensor(t, ms.int32), ms.Tensor(reorder),
                                                state["cache"], cross, src_bias)
            state["cache"] = ms.mutable(cache)
            return values.asnumpy(), ids.asnumpy()
        max_len = min(max_len, self.max_len)
        return beam_search(step, len(src), beam, max_len, alpha, form) if beam > 1 else greedy(step, len(src), max_len)


def full_recompute_step(net, src: np.ndarray, beam: int, max_len: int, candidates: int) -> Step:
    """The reference: every step re-runs the whole decoder on all tokens so far (no cache), on the host's
    token buffer reordered with the search."""
    model = unwrap(net)
    k = max(1, beam)
    memory, src_bias = model.encode(ms.Tensor(np.repeat(src, k, axis=0)))
    buffer = np.full((len(src) * k, max_len), PAD, np.int32)

    def step(last, t, reorder):
        buffer[:] = buffer[reorder]
        buffer[:, t] = last
        logits = model.decode(ms.Tensor(buffer[:, :t + 1]), memory, src_bias).asnumpy()
        logits = logits.reshape(len(buffer), t + 1, -1)[:, t].astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        logp[:, [PAD, BOS]] = -np.inf
        ids = np.argsort(-logp, axis=1, kind="stable")[:, :candidates]
        return np.take_along_axis(logp, ids, 1).astype(np.float32), ids
    return step


def decode_batches(examples, size: int):
    """(indices, sources) for decoding: sentences sorted by length (a batch finishes together) in batches of
    `size`, every batch `size` rows (the last padded with copies) and as wide as the longest source of the
    split, so graph mode compiles the encoder and the step once for the whole split."""
    lengths = np.array([len(e[0]) for e in examples])
    order = np.argsort(lengths, kind="stable")
    width = int(lengths.max())
    for i in range(0, len(order), size):
        take = order[i:i + size]
        rows = np.concatenate([take, np.full(size - len(take), take[-1])])
        yield take, np.stack([np.pad(examples[j][0], (0, width - len(examples[j][0]))) for j in rows])


def translate(net, cfg, split: str = "test", beam: int = 4, alpha: float = 0.6, out: Optional[Path] = None,
              form: Optional[str] = None) -> dict:
    """Decode a split with the trained network; BLEU against the untokenized references (sacrebleu 13a), cased
    and lowercased, and multi-bleu.perl's on lowercased Moses tokens (bleu_moses_lc)."""
    form = form or str(cfg.decode.length_norm)
    net.set_train(False)
    examples, pairs, sp = encode_pairs(cfg.dataset, split)
    max_len = params(cfg.dataset)["max_len"]
    decoder = IncrementalDecoder(net, beam)
    hyps, hyps_tok, tokens, t0 = [""] * len(examples), [""] * len(examples), 0, time.perf_counter()
    for take, src in decode_batches(examples, min(cfg.decode.batch_size, len(examples))):
        ids = decoder.search(src, alpha, form, max_len)[: len(take)]
        tokens += sum(len(h) + 1 for h in ids)
        for j, h in zip(take, ids):
            hyps[j], hyps_tok[j] = sp.decode(h), sp.decode_tokenized(h)
    seconds = time.perf_counter() - t0
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)  # a folder the command line named, checked writable
        Path(out).write_text("\n".join(hyps) + "\n", encoding="utf-8")
    refs_tok = [sp.tokenized(tgt) for _, tgt in pairs][: len(hyps)]
    return {**scores(hyps, pairs, (hyps_tok, refs_tok)), "sentences": len(hyps),
            "beam": beam, "length_penalty": alpha, "length_norm": form, "decode_s": round(seconds, 2),
            "sentences_per_s": round(len(hyps) / seconds, 1), "tokens_per_s": round(tokens / seconds, 1)}
