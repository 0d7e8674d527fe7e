// A decoding step's own ops (ampzoo/models/decoding.py, IncrementalDecoder) as AOT custom ops (cpu_kernels/cells.py:
// log_softmax_top_k_op, cached_attention_op).
//
// A beam-search step's last ops in one pass over each row: over a vocabulary of 10,000, MindSpore's CPU graph ran
// LogSoftmax, the Add of the special tokens' -inf, two max reductions, two gathers and two TopKs, a third of the
// decoding time.
//
// LogSoftmaxTopK (logits [rows, V] float32 or float16, specials [V] float32 -> values [rows, k] float32,
//   ids [rows, k] int32): the k largest of log_softmax(logits) + specials, largest first (the lower id first among
//   equal values, as a stable sort); k is the outputs' width. log_softmax is taken over the logits alone, as
//   ops.log_softmax(logits) + specials gives it; the order is that of logits + specials (the same order but
//   where the subtraction of the log-sum-exp rounds two values together).
//
// The self-attention of one position against the cache of the earlier ones, with the cache's reorder and write:
// MindSpore's graph gathered the whole (rows, heads, max_len, dh) cache for the reorder, scattered the new key
// and value into a copy of it, and multiplied over all max_len positions, masked: more than half the step.
// This copies and reads positions 0..t only.
//
// CachedSelfAttention (qkv [R, 1, 3 h dh], keys and values [R, h, L, dh], reorder [R] int32, t [1] int32,
//   scale [1] float32 or float16 -> context [R, 1, h dh], keys' and values' [R, h, L, dh]): row r continues the
//   hypothesis of row reorder[r], so its positions 0..t-1 are that row's, and position t is this step's key and
//   value (qkv's second and third thirds, head-major as the Dense makes them). The query (the first third)
//   attends to positions 0..t: softmax(q k^T x scale) v, which is what the causal mask leaves of the full
//   product. Positions after t are not written: the next step copies 0..t. float32, or float16 throughout, with
//   the unfused graph's roundings: the scores and the probabilities rounded to float16, the sums in float32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <functional>
#include <limits>
#include <vector>

#include "aot.h"
#include "runtime.h"

namespace {

// The row loops below vectorize only without trapping math (a float compare, a float-to-int conversion); they
// raise no floating-point exception anyone reads. target_clones: AVX-512 where the CPU has it, else AVX2 or SSE2.
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#define AMP_ZOO_VECTOR __attribute__((target_clones("avx512f", "avx2", "default")))

// e^x for x <= 0 (a logit less the row's maximum), within 3e-7 relative, 0 far below: a polynomial the compiler
// vectorizes, where libm's exp runs one value at a time (it was most of this op's time)
inline float ExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

constexpr int64_t kLanes = 16;

// The row's log-sum-exp: its maximum, then the sum of e^(x - max), each in 16 lanes (no single running value)
AMP_ZOO_VECTOR float LogSumExp(const float *x, int64_t n) {
  float lanes[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = x[i + l] > lanes[l] ? x[i + l] : lanes[l];
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < kLanes; ++l) top = lanes[l] > top ? lanes[l] : top;
  for (int64_t j = i; j < n; ++j) top = x[j] > top ? x[j] : top;
  float sums[kLanes] = {};
  for (i = 0; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) sums[l] += ExpNonPositive(x[i + l] - top);
  double sum = 0.0;
  for (int64_t j = i; j < n; ++j) sum += ExpNonPositive(x[j] - top);
  for (int64_t l = 0; l < kLanes; ++l) sum += sums[l];
  return top + static_cast<float>(std::log(sum));
}

// The largest of x[i] + specials[i] over one block of kLanes
AMP_ZOO_VECTOR float BlockMax(const float *x, const float *specials) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < kLanes; ++l) {
    const float v = x[l] + specials[l];
    m = v > m ? v : m;
  }
  return m;
}

// The k largest of x + specials into (best, where), largest first, the lower id first among equals: a block
// whose maximum does not pass the k-th best so far is skipped whole
void TopKOfRow(const float *x, const float *specials, int64_t n, int64_t k, float *best, int32_t *where) {
  int64_t filled = 0;
  auto offer = [&](int64_t i) {
    const float v = x[i] + specials[i];
    if (filled == k && !(v > best[k - 1])) return;
    int64_t j = filled < k ? filled++ : k - 1;
    while (j > 0 && v > best[j - 1]) {
      best[j] = best[j - 1];
      where[j] = where[j - 1];
      --j;
    }
    best[j] = v;
    where[j] = static_cast<int32_t>(i);
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    if (filled == k && !(BlockMax(x + i, specials + i) > best[k - 1])) continue;
    for (int64_t l = 0; l < kLanes; ++l) offer(i + l);
  }
  for (; i < n; ++i) offer(i);
}

#pragma GCC pop_options

int TopK(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 2 || ndims[3] != 2) return 1;
  const int64_t rows = shapes[0][0], V = shapes[0][1], k = shapes[2][1];
  if (shapes[1][0] != V || shapes[2][0] != rows || shapes[3][0] != rows || shapes[3][1] != k || k < 1 || k > V)
    return 1;
  const bool half = !std::strcmp(dtypes[0], "float16");
  if ((!half && std::strcmp(dtypes[0], "float32")) || std::strcmp(dtypes[1], "float32") ||
      std::strcmp(dtypes[2], "float32") || std::strcmp(dtypes[3], "int32"))
    return 1;
  const float *specials = static_cast<const float *>(params[1]);
  float *values = static_cast<float *>(params[2]);
  int32_t *ids = static_cast<int32_t *>(params[3]);
  auto run = [&](int64_t a, int64_t b) {
    std::vector<float> buf(half ? V : 0);
    for (int64_t r = a; r < b; ++r) {
      const float *x;
      if (half) {
        AmpZooHalfToFloatHere(static_cast<const uint16_t *>(params[0]) + r * V, buf.data(), V);
        x = buf.data();
      } else {
        x = static_cast<const float *>(params[0]) + r * V;
      }
      const float lse = LogSumExp(x, V);
      float *best = values + r * k;
      int32_t *where = ids + r * k;
      TopKOfRow(x, specials, V, k, best, where);
      for (int64_t j = 0; j < k; ++j) best[j] = (x[where[j]] - lse) + specials[where[j]];
    }
  };
  const int threads = rows * V >= (1 << 15) ? AmpZooThreads() : 1;
  if (threads == 1) {
    run(0, rows);
  } else {
    AmpZooParallel(threads, [&](int t, int n) { run(rows * t / n, rows * (t + 1) / n); });
  }
  return 0;
}

// n values of a float32 or float16 tensor, as float32 (into buf, or in place)
const float *AsFloat(const void *p, int64_t at, int64_t n, bool half, float *buf) {
  if (!half) return static_cast<const float *>(p) + at;
  AmpZooHalfToFloatHere(static_cast<const uint16_t *>(p) + at, buf, n);
  return buf;
}

bool Shape(int ndim, const int64_t *shape, std::initializer_list<int64_t> want) {
  if (ndim != static_cast<int>(want.size())) return false;
  for (int64_t w : want)
    if (*shape++ != w) return false;
  return true;
}

// params: qkv, keys, values, reorder, t, scale, context, keys', values'
int CachedAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 9 || ndims[1] != 4) return 1;
  const int64_t R = shapes[1][0], H = shapes[1][1], L = shapes[1][2], D = shapes[1][3];
  const bool half = !std::strcmp(dtypes[0], "float16");
  if (!half && std::strcmp(dtypes[0], "float32")) return 1;
  for (int i : {1, 2, 6, 7, 8})
    if (std::strcmp(dtypes[i], dtypes[0])) return 1;
  if (!Shape(ndims[0], shapes[0], {R, 1, 3 * H * D}) || !Shape(ndims[2], shapes[2], {R, H, L, D}) ||
      !Shape(ndims[3], shapes[3], {R}) || !Shape(ndims[4], shapes[4], {1}) ||
      !Shape(ndims[6], shapes[6], {R, 1, H * D}) || !Shape(ndims[7], shapes[7], {R, H, L, D}) ||
      !Shape(ndims[8], shapes[8], {R, H, L, D}) || std::strcmp(dtypes[3], "int32") || std::strcmp(dtypes[4], "int32"))
    return 1;
  const float scale = AmpZooScale(dtypes[5], ndims[5], shapes[5], params[5]);
  const int32_t *reorder = static_cast<const int32_t *>(params[3]);
  const int64_t t = *static_cast<const int32_t *>(params[4]);
  if (scale != scale || t < 0 || t >= L) return 1;
  for (int64_t r = 0; r < R; ++r)
    if (reorder[r] < 0 || reorder[r] >= R) return 1;
  const int64_t es = half ? 2 : 4, HD = H * D;
  const char *qkv = static_cast<const char *>(params[0]);
  auto run = [&](int64_t a, int64_t b) {
    std::vector<float> q(D), kbuf(half ? (t + 1) * D : 0), vbuf(half ? (t + 1) * D : 0), p(t + 1), ctx(D);
    for (int64_t r = a; r < b; ++r) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t from = ((reorder[r] * H + h) * L) * D * es, to = ((r * H + h) * L) * D * es;
        const char *here = qkv + (r * 3 * HD + h * D) * es;  // this row's query of head h; HD on: its key, value
        char *keys = static_cast<char *>(params[7]) + to, *values = static_cast<char *>(params[8]) + to;
        std::memcpy(keys, static_cast<const char *>(params[1]) + from, t * D * es);
        std::memcpy(values, static_cast<const char *>(params[2]) + from, t * D * es);
        std::memcpy(keys + t * D * es, here + HD * es, D * es);
        std::memcpy(values + t * D * es, here + 2 * HD * es, D * es);
        const float *qf = AsFloat(here, 0, D, half, q.data());
        const float *kf = AsFloat(keys, 0, (t + 1) * D, half, kbuf.data());
        const float *vf = AsFloat(values, 0, (t + 1) * D, half, vbuf.data());
        for (int64_t i = 0; i <= t; ++i) {
          float dot = 0.0f;
          for (int64_t j = 0; j < D; ++j) dot += qf[j] * kf[i * D + j];
          p[i] = dot;
        }
        if (half) AmpZooRoundThroughHalf(p.data(), p.data(), t + 1);  // as a float16 tensor holds it
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i <= t; ++i) {  // a NaN is kept as the maximum: its row comes out NaN, as Softmax's
          p[i] *= scale;
          if (p[i] > m || p[i] != p[i]) m = p[i];
        }
        float sum = 0.0f;
        for (int64_t i = 0; i <= t; ++i) sum += (p[i] = std::exp(p[i] - m));
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i <= t; ++i) p[i] *= inv;
        if (half) AmpZooRoundThroughHalf(p.data(), p.data(), t + 1);  // as a float16 tensor holds it
        std::fill(ctx.begin(), ctx.end(), 0.0f);
        for (int64_t i = 0; i <= t; ++i)
          for (int64_t j = 0; j < D; ++j) ctx[j] += p[i] * vf[i * D + j];
        char *out = static_cast<char *>(params[6]) + (r * HD + h * D) * es;
        if (half) {
          AmpZooFloatToHalfHere(ctx.data(), reinterpret_cast<uint16_t *>(out), D);
        } else {
          std::memcpy(out, ctx.data(), D * es);
        }
      }
    }
  };
  const int threads = R * H * (t + 1) * D >= (1 << 14) ? AmpZooThreads() : 1;
  if (threads == 1) {
    run(0, R);
  } else {
    AmpZooParallel(threads, [&](int i, int n) { run(R * i / n, R * (i + 1) / n); });
  }
  return 0;
}

}  // namespace

// Return codes (MindSpore reports them): 1 a count, shape, dtype or index these ops do not take
AMP_ZOO_AOT(LogSoftmaxTopK, TopK(AOT_PASS))
AMP_ZOO_AOT(CachedSelfAttention, CachedAttention(AOT_PASS))
