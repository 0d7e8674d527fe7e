"""Encoder-decoder Transformer (Vaswani et al. 2017), with attention written as Cells.

MindSpore's nn.Transformer computes its attention softmax as a function, so a keep-list cannot reach it
and under O2 all of its attention runs in fp16. Here Softmax, LayerNorm and the two attention matmuls
(`BatchMatMul`) are Cells: `amp.keep_fp32: [LayerNorm, Softmax]` keeps them fp32, and `force_fp16:
[BatchMatMul]` puts the attention matmuls in fp16 at O1.

Shared source/target embeddings (a joint subword vocabulary), tied to the output projection; sinusoidal
positions; post-norm as in the paper, or pre-norm (`norm_first`). Token id 0 is padding.
"""
import math

import numpy as np

import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops
from mindspore import Tensor
from mindspore.common.initializer import Normal, XavierUniform

from amp.names import register_cell
from models import register_model

PAD = 0
NEG = -1e4  # additive mask: exp(-1e4) is 0 in fp32 and the value is finite in fp16


@register_cell
class BatchMatMul(nn.Cell):
    """ops.BatchMatMul as a Cell, so precision lists can name the attention matmuls."""

    def __init__(self, transpose_b: bool = False):
        super().__init__()
        self.op = ops.BatchMatMul(transpose_b=transpose_b)

    def construct(self, a, b):
        return self.op(a, b)


def dense(d_in, d_out):
    return nn.Dense(d_in, d_out, weight_init=XavierUniform())


@register_cell
class MultiHeadAttention(nn.Cell):
    def __init__(self, d_model: int, heads: int, dropout: float):
        super().__init__()
        self.h, self.dh = heads, d_model // heads
        self.scale = 1.0 / math.sqrt(self.dh)
        self.q, self.k, self.v, self.o = (dense(d_model, d_model) for _ in range(4))
        self.scores = BatchMatMul(transpose_b=True)
        self.context = BatchMatMul()
        self.softmax = nn.Softmax(axis=-1)
        self.dropout = nn.Dropout(p=dropout)

    def split(self, x):
        b, t, _ = x.shape
        return x.reshape(b, t, self.h, self.dh).transpose(0, 2, 1, 3)

    def construct(self, x, memory, bias):
        b, t, d = x.shape
        q, k, v = self.split(self.q(x)), self.split(self.k(memory)), self.split(self.v(memory))
        scores = self.scores(q, k) * self.scale + ops.cast(bias, q.dtype)
        probs = self.dropout(self.softmax(scores))
        out = self.context(ops.cast(probs, v.dtype), v).transpose(0, 2, 1, 3).reshape(b, t, d)
        return self.o(out)


class FeedForward(nn.Cell):
    def __init__(self, d_model, ffn, dropout):
        super().__init__()
        self.fc1, self.fc2 = dense(d_model, ffn), dense(ffn, d_model)
        self.relu, self.dropout = nn.ReLU(), nn.Dropout(p=dropout)

    def construct(self, x):
        return self.fc2(self.dropout(self.relu(self.fc1(x))))


class Sublayer(nn.Cell):
    """Residual around one sublayer, with post-norm (x + f(x) then LayerNorm) or pre-norm."""

    def __init__(self, d_model, dropout, norm_first):
        super().__init__()
        self.norm = nn.LayerNorm((d_model,), epsilon=1e-6)
        self.dropout = nn.Dropout(p=dropout)
        self.norm_first = norm_first

    def construct(self, x, fx):
        return x + self.dropout(fx) if self.norm_first else self.norm(x + self.dropout(fx))


class EncoderLayer(nn.Cell):
    def __init__(self, d_model, heads, ffn, dropout, norm_first):
        super().__init__()
        self.attn, self.ff = MultiHeadAttention(d_model, heads, dropout), FeedForward(d_model, ffn, dropout)
        self.res1, self.res2 = Sublayer(d_model, dropout, norm_first), Sublayer(d_model, dropout, norm_first)
        self.norm_first = norm_first

    def construct(self, x, src_bias):
        h = self.res1.norm(x) if self.norm_first else x
        x = self.res1(x, self.attn(h, h, src_bias))
        h = self.res2.norm(x) if self.norm_first else x
        return self.res2(x, self.ff(h))


class DecoderLayer(nn.Cell):
    def __init__(self, d_model, heads, ffn, dropout, norm_first):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, heads, dropout)
        self.cross_attn = MultiHeadAttention(d_model, heads, dropout)
        self.ff = FeedForward(d_model, ffn, dropout)
        self.res1, self.res2, self.res3 = (Sublayer(d_model, dropout, norm_first) for _ in range(3))
        self.norm_first = norm_first

    def construct(self, x, memory, tgt_bias, src_bias):
        h = self.res1.norm(x) if self.norm_first else x
        x = self.res1(x, self.self_attn(h, h, tgt_bias))
        h = self.res2.norm(x) if self.norm_first else x
        x = self.res2(x, self.cross_attn(h, memory, src_bias))
        h = self.res3.norm(x) if self.norm_first else x
        return self.res3(x, self.ff(h))


def sinusoids(length: int, d_model: int) -> np.ndarray:
    pos = np.arange(length)[:, None]
    i = np.arange(d_model // 2)[None, :]
    angle = pos / np.power(10000.0, 2 * i / d_model)
    table = np.zeros((length, d_model), np.float32)
    table[:, 0::2], table[:, 1::2] = np.sin(angle), np.cos(angle)
    return table


class Transformer(nn.Cell):
    def __init__(self, vocab_size, d_model=512, heads=8, ffn=2048, encoder_layers=6, decoder_layers=6,
                 dropout=0.1, norm_first=False, max_len=256):
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(vocab_size, d_model, embedding_table=Normal(d_model ** -0.5), padding_idx=PAD)
        self.positions = Tensor(sinusoids(max_len, d_model))
        self.dropout = nn.Dropout(p=dropout)
        self.encoder = nn.CellList([EncoderLayer(d_model, heads, ffn, dropout, norm_first)
                                    for _ in range(encoder_layers)])
        self.decoder = nn.CellList([DecoderLayer(d_model, heads, ffn, dropout, norm_first)
                                    for _ in range(decoder_layers)])
        self.norm_first = norm_first
        self.enc_norm = nn.LayerNorm((d_model,), epsilon=1e-6)  # used with pre-norm only
        self.dec_norm = nn.LayerNorm((d_model,), epsilon=1e-6)

    def embed_tokens(self, tokens):
        t = tokens.shape[1]
        x = self.embed(tokens) * math.sqrt(self.d_model) + self.positions[:t]
        return self.dropout(x)

    def encode(self, src):
        src_bias = ops.cast(ops.equal(src, PAD), ms.float32).expand_dims(1).expand_dims(1) * NEG  # (B,1,1,S)
        x = self.embed_tokens(src)
        for layer in self.encoder:
            x = layer(x, src_bias)
        if self.norm_first:
            x = self.enc_norm(x)
        return x, src_bias

    def decode(self, tgt, memory, src_bias):
        t = tgt.shape[1]
        causal = ops.triu(ops.ones((t, t), ms.float32), 1) * NEG  # (T,T): no peeking ahead
        tgt_bias = causal.expand_dims(0).expand_dims(0)
        x = self.embed_tokens(tgt)
        for layer in self.decoder:
            x = layer(x, memory, tgt_bias, src_bias)
        if self.norm_first:
            x = self.dec_norm(x)
        return ops.matmul(x, ops.cast(self.embed.embedding_table, x.dtype).T)  # tied output projection

    def construct(self, src, tgt_in):
        memory, src_bias = self.encode(src)
        return self.decode(tgt_in, memory, src_bias)


@register_model
def transformer(num_classes: int = 8000, d_model: int = 512, heads: int = 8, ffn: int = 2048,
                encoder_layers: int = 6, decoder_layers: int = 6, dropout: float = 0.1, norm_first: bool = False,
                max_len: int = 256) -> Transformer:
    """`num_classes` is the (shared) vocabulary size."""
    return Transformer(num_classes, d_model, heads, ffn, encoder_layers, decoder_layers, dropout, norm_first,
                       max_len)
