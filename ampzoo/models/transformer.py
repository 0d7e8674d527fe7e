"""Encoder-decoder Transformer (Vaswani et al. 2017), with attention written as Cells.

MindSpore's nn.Transformer computes its attention softmax as a function, so a keep-list cannot reach it
and under O2 all of its attention runs in fp16. Here Softmax (which takes the scores and the additive mask and
scales them itself), LayerNorm and the two attention matmuls (`BatchMatMul`) are Cells: `amp.keep_fp32:
[LayerNorm, Softmax]` keeps them fp32, and `force_fp16: [BatchMatMul]` puts the attention matmuls in fp16 at O1.

Shared source/target embeddings (a joint subword vocabulary), tied to the output projection; sinusoidal
positions; post-norm as in the paper, or pre-norm (`norm_first`). Token id 0 is padding. Dropout as in
fairseq: `dropout` on embeddings and sublayer outputs, `attention_dropout` on attention weights and
`activation_dropout` after the FFN's ReLU (0 by default, as fairseq's).

Speed (each choice measured on a CPU step: docs/benchmarks.md, "The Transformer at real scale"): every
matmul is 2-D (a 3-D activation times a 2-D weight makes MindSpore broadcast the weight to every sentence, and
reduce it again in the backward); self-attention projects Q, K and V in one matmul; masks are additive biases
built once.

Decoding (`ampzoo/models/decoding.py`) runs `decode_step`: one target position per call, with the keys and values of
earlier positions in fixed-shape caches (rows, heads, max_len, head dim) per layer, so graph mode compiles
once per source shape, and only the top candidates of the last position leave the device.
"""
import math

import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops
import numpy as np
from mindspore import Tensor
from mindspore.common.initializer import Normal, XavierUniform

from ampzoo.errors import ConfigError
from ampzoo.registry import CELLS, MODELS
from ampzoo.models.layers import Add, AttentionSoftmax

PAD = 0
NEG = -1e4  # additive mask: exp(-1e4) is 0 in fp32 and the value is finite in fp16


@CELLS.register()
class BatchMatMul(nn.Cell):
    """ops.BatchMatMul as a Cell, so precision lists can name the attention matmuls."""

    def __init__(self, transpose_b: bool = False):
        super().__init__()
        self.transpose_b = transpose_b
        self.op = ops.BatchMatMul(transpose_b=transpose_b)

    def construct(self, a, b):
        return self.op(a, b)


def row_sum(x):
    """Sum over all leading axes as a matmul with ones: faster than ReduceSum/BiasAddGrad on a CPU."""
    x = x.reshape(-1, x.shape[-1])
    return ops.matmul(ops.ones((1, x.shape[0]), x.dtype), x).reshape(-1)


class AffineFunction(nn.Cell):
    """x @ w.T + b with its backward written out (weights come in as inputs, so the Cell holding them keeps
    them): the bias gradient as a matmul instead of MindSpore's BiasAddGrad."""

    def __init__(self):
        super().__init__()
        self.matmul, self.bias_add = ops.MatMul(transpose_b=True), ops.BiasAdd()
        self.matmul_nn, self.matmul_tn = ops.MatMul(), ops.MatMul(transpose_a=True)

    def construct(self, x, w, b):
        return self.bias_add(self.matmul(x, w), b)

    def bprop(self, x, w, b, out, dout):
        return self.matmul_nn(dout, w), self.matmul_tn(dout, x), row_sum(dout)


class Dense(nn.Dense):
    """nn.Dense (a subclass: keep-lists naming Dense reach it; same parameters) as one 2-D affine map over the last
    axis, AffineFunction on the weight cast to the activations' dtype."""

    def __init__(self, d_in, d_out):
        super().__init__(d_in, d_out, weight_init=XavierUniform())
        self.affine = AffineFunction()

    def construct(self, x):
        x2 = x.reshape(-1, self.in_channels)
        y = self.affine(x2, ops.cast(self.weight, x.dtype), ops.cast(self.bias, x.dtype))
        return y.reshape(x.shape[:-1] + (self.out_channels,))


class NormFunction(nn.Cell):
    """(x - mean) / std * gamma + beta over the last axis: MindSpore's LayerNorm op forward, the backward
    written out: its CPU LayerNormGrad is slow, and a Transformer-Tiny step has 20 of them
    (docs/benchmarks.md, "The Transformer at real scale")."""

    def __init__(self, epsilon: float):
        super().__init__()
        self.epsilon = epsilon
        self.norm = ops.LayerNorm(-1, -1, epsilon)

    def construct(self, x, gamma, beta):
        return self.norm(x, gamma, beta)  # (y, mean, a per-row statistic)

    def bprop(self, x, gamma, beta, out, dout):
        # The op's third output is the variance on CPU but documented as rstd since MindSpore 2.3 (Ascend's
        # returns rstd): recompute the statistics from x, so the gradient is right on every backend. In
        # float32 whatever x's dtype: at O3 the squared deviations of activations of a few hundred overflow fp16
        # and the gradient came out 0 (the forward op computes its statistics in fp32 too).
        xf, g = ops.cast(x, ms.float32), ops.cast(dout[0], ms.float32)
        centred = xf - xf.mean(-1, keep_dims=True)
        inv_std = ops.rsqrt((centred * centred).mean(-1, keep_dims=True) + self.epsilon)
        x_hat = centred * inv_std
        dx_hat = g * ops.cast(gamma, ms.float32)
        dx = inv_std * (dx_hat - dx_hat.mean(-1, keep_dims=True) - x_hat * (dx_hat * x_hat).mean(-1, keep_dims=True))
        return ops.cast(dx, x.dtype), ops.cast(row_sum(g * x_hat), gamma.dtype), ops.cast(row_sum(g), beta.dtype)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm over the last axis: still a LayerNorm for keep-lists (a subclass), with the same parameters
    (gamma, beta), running NormFunction."""

    def __init__(self, d_model: int, epsilon: float = 1e-5):
        super().__init__((d_model,), epsilon=epsilon)
        self.function = NormFunction(epsilon)

    def construct(self, x):
        return self.function(x, ops.cast(self.gamma, x.dtype), ops.cast(self.beta, x.dtype))[0]


class Dropout(nn.Cell):
    """nn.Dropout that is not in the graph at all when p is 0."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.drop = nn.Dropout(p=p) if p > 0 else None

    def construct(self, x):
        if self.p > 0:  # a Python constant: the graph holds one branch
            return self.drop(x)
        return x


@CELLS.register()
class MultiHeadAttention(nn.Cell):
    """Self-attention projects Q, K, V in one matmul (`qkv`); cross-attention Q alone and K, V together (`kv`)."""

    def __init__(self, d_model: int, heads: int, dropout: float, self_attention: bool = True):
        super().__init__()
        self.h, self.dh, self.self_attention = heads, d_model // heads, self_attention
        if self_attention:
            self.qkv = Dense(d_model, 3 * d_model)
        else:
            self.q, self.kv = Dense(d_model, d_model), Dense(d_model, 2 * d_model)
        self.o = Dense(d_model, d_model)
        self.scores = BatchMatMul(transpose_b=True)
        self.context = BatchMatMul()
        self.softmax = AttentionSoftmax(1.0 / math.sqrt(self.dh))
        self.dropout = Dropout(dropout)
        if self_attention:  # decoding: one position against the cache of earlier ones (DecoderLayer.step)
            self.cached = CachedSelfAttention(heads, self.dh)

    def heads(self, x, parts):
        return split_heads(x, parts, self.h, self.dh)

    def attend(self, q, k, v, bias):
        probs = self.dropout(self.softmax(self.scores(q, k), bias))  # softmax(scores / sqrt(dh) + bias)
        return self.o(merge_heads(self.context(ops.cast(probs, v.dtype), v)))

    def construct(self, x, memory, bias):
        if self.self_attention:
            q, k, v = self.heads(self.qkv(x), 3)
        else:
            q = self.heads(self.q(x), 1)
            k, v = self.heads(self.kv(memory), 2)
        return self.attend(q, k, v, bias)


def split_heads(x, parts: int, h: int, dh: int):
    """(B, T, parts*h*dh) -> parts x (B, h, T, dh). ops.split, not slicing a head-major tensor: MindSpore's CPU
    StridedSlice is slow."""
    b, t, _ = x.shape
    split = ops.split(x, h * dh, -1) if parts > 1 else (x,)
    out = tuple(y.reshape(b, t, h, dh).transpose(0, 2, 1, 3) for y in split)
    return out if parts > 1 else out[0]


def merge_heads(x):
    """(B, h, T, dh) -> (B, T, h*dh)."""
    b, h, t, dh = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * dh)


class CachedSelfAttention(nn.Cell):
    """A decoding step's self-attention against the cache: (qkv (R, 1, 3 h dh) of this position, keys and values
    (R, h, max_len, dh), reorder (R,) int32 or None, t (1,) int32, at_t (R, h, 3), bias (1, 1, 1, max_len)) -> the
    context (R, 1, h dh) before the output projection, and the cache with row r continuing row reorder[r] (None:
    its own) and this position's key and value written at t. `bias` masks the positions after t; at_t indexes
    (row, head, t). Its own scores, softmax and context Cells are the attention's classes, so precision lists reach
    them alike."""

    def __init__(self, heads: int, dh: int):
        super().__init__()
        self.h, self.dh = heads, dh
        self.scale = 1.0 / math.sqrt(dh)
        self.scores, self.context = BatchMatMul(transpose_b=True), BatchMatMul()
        self.softmax = AttentionSoftmax(self.scale)

    def construct(self, qkv, keys, values, reorder, t, at_t, bias):
        if reorder is not None:
            keys, values = ops.gather(keys, reorder, 0), ops.gather(values, reorder, 0)
        q, k, v = split_heads(qkv, 3, self.h, self.dh)
        # write this position: a scatter (a masked blend of the whole cache broadcasts it every step)
        keys = ops.tensor_scatter_update(keys, at_t, k.squeeze(2))
        values = ops.tensor_scatter_update(values, at_t, v.squeeze(2))
        probs = self.softmax(self.scores(q, keys), bias)
        return merge_heads(self.context(ops.cast(probs, values.dtype), values)), keys, values


class FeedForward(nn.Cell):
    def __init__(self, d_model, ffn, activation_dropout):
        super().__init__()
        self.fc1, self.fc2 = Dense(d_model, ffn), Dense(ffn, d_model)
        self.relu, self.dropout = nn.ReLU(), Dropout(activation_dropout)

    def construct(self, x):
        return self.fc2(self.dropout(self.relu(self.fc1(x))))


class Sublayer(nn.Cell):
    """Residual around one sublayer, with post-norm (x + f(x) then LayerNorm) or pre-norm."""

    def __init__(self, d_model, dropout, norm_first):
        super().__init__()
        self.norm = LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first
        self.add = Add()

    def construct(self, x, fx):
        return self.add(x, self.dropout(fx)) if self.norm_first else self.norm(self.add(x, self.dropout(fx)))

    def pre(self, x):
        """The sublayer's input: x, or with pre-norm its norm."""
        return self.norm(x) if self.norm_first else x

    def split(self, x):
        """(the sublayer's input, the residual): the one place this unit reads x twice, so that a build of the unit
        for another device may sum the two gradients its own way."""
        return self.pre(x), x


class EncoderLayer(nn.Cell):
    def __init__(self, d_model, heads, ffn, dropout, attention_dropout, activation_dropout, norm_first):
        super().__init__()
        self.attn = MultiHeadAttention(d_model, heads, attention_dropout)
        self.ff = FeedForward(d_model, ffn, activation_dropout)
        self.res1, self.res2 = Sublayer(d_model, dropout, norm_first), Sublayer(d_model, dropout, norm_first)

    def construct(self, x, src_bias):
        h, x = self.res1.split(x)
        x = self.res1(x, self.attn(h, h, src_bias))
        h, x = self.res2.split(x)
        return self.res2(x, self.ff(h))


class DecoderLayer(nn.Cell):
    def __init__(self, d_model, heads, ffn, dropout, attention_dropout, activation_dropout, norm_first):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, heads, attention_dropout)
        self.cross_attn = MultiHeadAttention(d_model, heads, attention_dropout, self_attention=False)
        self.ff = FeedForward(d_model, ffn, activation_dropout)
        self.res1, self.res2, self.res3 = (Sublayer(d_model, dropout, norm_first) for _ in range(3))

    def construct(self, x, memory, tgt_bias, src_bias):
        h, x = self.res1.split(x)
        x = self.res1(x, self.self_attn(h, h, tgt_bias))
        h, x = self.res2.split(x)
        x = self.res2(x, self.cross_attn(h, memory, src_bias))
        h, x = self.res3.split(x)
        return self.res3(x, self.ff(h))

    def step(self, x, keys, values, cross_k, cross_v, src_bias, reorder, t, at_t, self_bias):
        """One position x (B, 1, d) against the cached keys/values (B, h, max_len, dh) of earlier positions, row b
        continuing the hypothesis of row reorder[b] (None: its own). t (1,) is this position; at_t (B, h, 3)
        indexes (row, head, t) and self_bias masks the positions after t. Returns x and the updated cache."""
        attn = self.self_attn
        context, keys, values = attn.cached(attn.qkv(self.res1.pre(x)), keys, values, reorder, t, at_t, self_bias)
        x = self.res1(x, attn.o(context))
        q = self.cross_attn.heads(self.cross_attn.q(self.res2.pre(x)), 1)
        x = self.res2(x, self.cross_attn.attend(q, cross_k, cross_v, src_bias))
        return self.res3(x, self.ff(self.res3.pre(x))), keys, values


def sinusoids(length: int, d_model: int) -> np.ndarray:
    pos = np.arange(length)[:, None]
    i = np.arange(d_model // 2)[None, :]
    angle = pos / np.power(10000.0, 2 * i / d_model)
    table = np.zeros((length, d_model), np.float32)
    table[:, 0::2], table[:, 1::2] = np.sin(angle), np.cos(angle)
    return table


class TokenEmbedding(nn.Embedding):
    """nn.Embedding (a subclass: the same table, which the tied output projection reads): embedding(ids, positions)
    is each token's row scaled by `scale` (sqrt(d_model)) plus its position."""

    def __init__(self, vocab_size, d_model):
        super().__init__(vocab_size, d_model, embedding_table=Normal(d_model ** -0.5), padding_idx=PAD)
        self.scale = math.sqrt(d_model)

    def construct(self, ids, positions):
        return super().construct(ids) * self.scale + positions


class TiedProjection(nn.Cell):
    """The output projection tied to the embedding: x (rows, d) @ table^T -> logits (rows, vocab), one 2-D matmul
    on the table cast to x's dtype."""

    def __init__(self):
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x, table):
        return self.matmul(x, ops.cast(table, x.dtype))


def top_k(x, k: int, rows_per_set: int = 50):
    """ops.topk over the last axis, faster than MindSpore's CPU TopK over a vocabulary. The columns are split
    into sets (column j and every (width / rows_per_set)-th after it); the top k of a row lie in the k sets with
    the largest maxima, so: one max per set (a contiguous max over a (rows_per_set, sets) grid), then topk over
    those k sets' values only; the same result as ops.topk (docs/benchmarks.md has the timing)."""
    rows, width = x.shape
    n = rows_per_set
    if width < 4 * k * n:  # too few sets to save anything
        return ops.topk(x, k)
    if width % n:
        x = ops.concat([x, ops.full((rows, n - width % n), float("-inf"), dtype=x.dtype)], 1)
    sets = x.shape[1] // n
    grid = x.reshape(rows, n, sets)  # grid[r, i, j] = x[r, i * sets + j]: set j is column j of the grid
    _, best = ops.topk(ops.amax(grid, 1), k)  # (rows, k) sets
    picked = ops.gather_elements(grid, 2, ops.broadcast_to(best.reshape(rows, 1, k), (rows, n, k)))
    values, pos = ops.topk(picked.reshape(rows, -1), k)
    return values, (pos // k) * sets + ops.gather_elements(best, 1, pos % k)


class TopCandidates(nn.Cell):
    """(logits (rows, V) fp32, specials (V,) fp32, k) -> the k largest of log_softmax(logits) + specials (rows, k),
    largest first, and their ids: a search step's end. It runs in fp32 at every amp level (`runs_fp32`, which
    ampzoo.amp.policy reads): the hypotheses' scores are sums of these."""
    runs_fp32 = True

    def construct(self, logits, specials, k):
        return top_k(ops.log_softmax(logits, -1) + specials, k)


class Transformer(nn.Cell):
    def __init__(self, vocab_size, d_model=512, heads=8, ffn=2048, encoder_layers=6, decoder_layers=6,
                 dropout=0.1, norm_first=False, max_len=256, attention_dropout=0.0, activation_dropout=0.0):
        super().__init__()
        self.d_model, self.heads, self.max_len = d_model, heads, max_len
        self.embed = TokenEmbedding(vocab_size, d_model)
        self.positions = Tensor(sinusoids(max_len, d_model))
        self.causal = Tensor(np.triu(np.full((max_len, max_len), NEG, np.float32), 1))  # no peeking ahead
        self.dropout = Dropout(dropout)
        layer_args = (d_model, heads, ffn, dropout, attention_dropout, activation_dropout, norm_first)
        self.encoder = nn.CellList([EncoderLayer(*layer_args) for _ in range(encoder_layers)])
        self.decoder = nn.CellList([DecoderLayer(*layer_args) for _ in range(decoder_layers)])
        self.norm_first = norm_first
        self.enc_norm = LayerNorm(d_model)  # used with pre-norm only
        self.dec_norm = LayerNorm(d_model)
        self.project = TiedProjection()
        self.top = TopCandidates()

    def embed_tokens(self, tokens, positions):
        return self.dropout(self.embed(tokens, positions))

    def encode(self, src):
        src_bias = ops.cast(ops.equal(src, PAD), ms.float32).expand_dims(1).expand_dims(1) * NEG  # (B,1,1,S)
        x = self.embed_tokens(src, self.positions[:src.shape[1]])
        for layer in self.encoder:
            x = layer(x, src_bias)
        if self.norm_first:
            x = self.enc_norm(x)
        return x, src_bias

    def logits(self, x):
        """Tied output projection as one 2-D matmul over all positions: (..., d) -> (positions, vocab), flat.
        Flat because reshaping a tokens x vocabulary tensor copies it in MindSpore's CPU graphs (about 1 GB of
        a 4,096-token training graph's memory went to such copies)."""
        if self.norm_first:
            x = self.dec_norm(x)
        return self.project(x.reshape(-1, self.d_model), self.embed.embedding_table)

    def decode(self, tgt, memory, src_bias):
        t = tgt.shape[1]
        tgt_bias = self.causal[:t, :t]
        x = self.embed_tokens(tgt, self.positions[:t])
        for layer in self.decoder:
            x = layer(x, memory, tgt_bias, src_bias)
        return self.logits(x)

    def construct(self, src, tgt_in):
        """Logits (B * T, vocab), one row per target position (the loss takes flat rows)."""
        memory, src_bias = self.encode(src)
        return self.decode(tgt_in, memory, src_bias)

    # Incremental decoding (eval only): see ampzoo/models/decoding.py. States are flat tuples of per-layer tensors
    # (k0, v0, k1, v1, ...): slicing one stacked tensor is a StridedSlice, which is slow on a CPU.
    def start_decoding(self, src, beam: int = 1):
        """Cross-attention keys/values of the encoder output per layer, the source bias, and an empty
        self-attention cache per layer (B * beam, h, max_len, dh): the encoder runs once per sentence and its
        results are repeated for the sentence's `beam` hypotheses (rows b * beam ... b * beam + beam - 1)."""
        memory, src_bias = self.encode(src)
        cross = ()
        for layer in self.decoder:
            cross = cross + layer.cross_attn.heads(layer.cross_attn.kv(memory), 2)
        if beam > 1:
            cross = tuple(ops.repeat_interleave(c, beam, 0) for c in cross)
            src_bias = ops.repeat_interleave(src_bias, beam, 0)
        empty = ops.zeros((src.shape[0] * beam, self.heads, self.max_len, self.d_model // self.heads), cross[0].dtype)
        return cross, src_bias, tuple(empty for _ in cross)

    def decode_step(self, token, t, cache, cross, src_bias, reorder=None):
        """token (B,) at position t (a 0-d int32 tensor) -> log-probabilities (B, vocab) and the new cache; row b
        continues the hypothesis of row reorder[b] (None: each its own, as greedy decoding)."""
        logits, new_cache = self.decode_step_logits(token, t, cache, cross, src_bias, reorder)
        return ops.log_softmax(logits, -1), new_cache

    def next_candidates(self, token, t, cache, cross, src_bias, specials, k: int, reorder=None):
        """decode_step's end for a search: the k best next tokens of each row (TopCandidates: log-probabilities
        plus `specials`, and ids), and the new cache."""
        logits, new_cache = self.decode_step_logits(token, t, cache, cross, src_bias, reorder)
        # specials (0 or -inf, exact in any dtype) come in fp16 when an O2 model's method is called with them
        values, ids = self.top(logits, ops.cast(specials, ms.float32), k)
        return values, ids, new_cache

    def decode_step_logits(self, token, t, cache, cross, src_bias, reorder=None):
        """decode_step's logits (B, vocab), fp32, before the log-softmax."""
        b = token.shape[0]
        rows = ops.broadcast_to(ops.arange(b, dtype=ms.int32).reshape(b, 1, 1), (b, self.heads, 1))
        heads = ops.broadcast_to(ops.arange(self.heads, dtype=ms.int32).reshape(1, -1, 1), (b, self.heads, 1))
        at_t = ops.concat([rows, heads, ops.broadcast_to(t.reshape(1, 1, 1), (b, self.heads, 1))], -1)
        self_bias = ops.cast(ops.arange(self.max_len, dtype=ms.int32) > t, ms.float32).reshape(1, 1, 1, -1) * NEG
        x = self.embed_tokens(token.reshape(-1, 1), ops.gather(self.positions, t.reshape(1), 0))
        new_cache = ()
        for i, layer in enumerate(self.decoder):
            x, keys, values = layer.step(x, cache[2 * i], cache[2 * i + 1], cross[2 * i], cross[2 * i + 1],
                                         src_bias, reorder, t.reshape(1), at_t, self_bias)
            new_cache = new_cache + (keys, values)
        return ops.cast(self.logits(x), ms.float32), new_cache


def check_transformer(args: dict, data=None) -> None:
    """d_model, heads and max_len the model can be built with, and (given the data config) positions for
    the data's longest sentence."""
    d_model, heads, max_len = args["d_model"], args["heads"], args["max_len"]
    for key in ("d_model", "heads", "ffn", "encoder_layers", "decoder_layers", "max_len"):
        if args[key] < 1:
            raise ConfigError(f"model.params.{key}={args[key]} must be at least 1")
    for key in ("dropout", "attention_dropout", "activation_dropout"):
        if not 0 <= args[key] < 1:
            raise ConfigError(f"model.params.{key}={args[key]} must be from 0 to below 1")
    if d_model % heads:
        raise ConfigError(f"model.params.d_model={d_model} must be divisible by model.params.heads={heads}")
    if d_model % 2:
        raise ConfigError(f"model.params.d_model={d_model} must be even (sinusoidal positions pair sin and cos)")
    if max_len < 2:
        raise ConfigError(f"model.params.max_len={max_len} must be at least 2")
    data_len = (data.params.get("max_len") if data is not None else None) or 0
    if data_len > max_len:
        raise ConfigError(f"model.params.max_len={max_len} is shorter than dataset.params.max_len={data_len}: the "
                          f"model has no positions for the longest sentences; raise model.params.max_len")


@MODELS.register(check=check_transformer)
def transformer(num_classes: int = 8000, d_model: int = 512, heads: int = 8, ffn: int = 2048,
                encoder_layers: int = 6, decoder_layers: int = 6, dropout: float = 0.1, norm_first: bool = False,
                max_len: int = 256, attention_dropout: float = 0.0, activation_dropout: float = 0.0) -> Transformer:
    """`num_classes` is the (shared) vocabulary size."""
    check_transformer(dict(d_model=d_model, heads=heads, ffn=ffn, encoder_layers=encoder_layers,
                           decoder_layers=decoder_layers, max_len=max_len, dropout=dropout,
                           attention_dropout=attention_dropout, activation_dropout=activation_dropout))
    return Transformer(num_classes, d_model, heads, ffn, encoder_layers, decoder_layers, dropout, norm_first,
                       max_len, attention_dropout, activation_dropout)
