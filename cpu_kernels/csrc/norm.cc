// Training-mode BatchNorm for MindSpore's CPU backend, forward and backward, as AOT custom ops (cpu_kernels/cells.py;
// cpu_kernels/build.py builds it into one library with conv.cc and pool.cc).
//
// MindSpore 2.10's CPU BatchNorm and BatchNormGrad took 153 ms of a ResNet-34 CIFAR-stem step at batch 32, where
// PyTorch's took 75 ms. These loops work a channel at a time, on the pool of conv.cc's threads: a channel's
// slice (batch x H x W floats, at most 128 KB in ResNet-34 at that shape) is read once from memory and stays in
// the core's cache for the passes after the first.
//
// BatchNormFwd (x, gamma, beta, moving_mean, moving_var, hyper -> y, mean, invstd, new_mean, new_var): float32
// x in NCHW or blocked (N, C/B, H, W, B), B 8 or 16 (conv.cc's layouts); hyper = (momentum, eps).
// y = gamma (x - mean) invstd + beta with the batch's mean and biased variance, invstd = 1 / sqrt(var + eps).
// new_* = momentum moving + (1 - momentum) batch, with the unbiased variance: what MindSpore's BatchNorm writes
// into its moving statistics.
// BatchNormBwd (x, gamma, mean, invstd, dy -> dx, dgamma, dbeta, and three zero tensors: the gradients of the
// forward's moving statistics and hyper, which a custom op's bprop must return).
// Sums are taken in float over 8 lanes within a row of W x H and in double across rows.
// x, y, dy and dx may be float16 (O2 keeps BatchNorm in fp32 but its neighbours are fp16): they are converted
// to float32 on the way in and rounded to float16 on the way out (conv.cc's conversions), so the op computes
// in fp32 as a keep-list Cell does, without a MindSpore Cast on either side. The statistics stay float32.
// In the blocked layout of 16 channels on an AVX-512 CPU, the passes read and write float16 themselves (a
// position's 16 channels are one vcvtph2ps): the same sums in the same order, so the same numbers, without the
// float32 copies of x, y, dy and dx (a third of the memory traffic; those copies were half BatchNorm's time).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <vector>

#include <immintrin.h>

#include "aot.h"
#include "runtime.h"

namespace {

// sum of p[0..n) (f(v) of each), in 8 float lanes the compiler vectorizes
template <typename F>
double Sum(const float *p, int64_t n, F f) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += f(p[i + k], i + k);
  double s = 0;
  for (; i < n; ++i) s += f(p[i], i);
  for (int k = 0; k < 8; ++k) s += acc[k];
  return s;
}

// Channels [c0, c1) of one op, on one thread
void Forward(const float *x, const float *gamma, const float *beta, const float *mm, const float *mv, float momentum,
             float eps, float *y, float *mean, float *invstd, float *nm, float *nv, int64_t batch, int64_t channels,
             int64_t plane, int64_t c0, int64_t c1) {
  const double count = static_cast<double>(batch * plane);
  for (int64_t c = c0; c < c1; ++c) {
    double s = 0;
    for (int64_t n = 0; n < batch; ++n)
      s += Sum(x + (n * channels + c) * plane, plane, [](float v, int64_t) { return v; });
    const float m = static_cast<float>(s / count);
    double q = 0;
    for (int64_t n = 0; n < batch; ++n)
      q += Sum(x + (n * channels + c) * plane, plane, [m](float v, int64_t) { return (v - m) * (v - m); });
    const double var = q / count;
    const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
    const float scale = gamma[c] * inv, shift = beta[c] - m * scale;
    for (int64_t n = 0; n < batch; ++n) {
      const float *in = x + (n * channels + c) * plane;
      float *out = y + (n * channels + c) * plane;
      for (int64_t i = 0; i < plane; ++i) out[i] = in[i] * scale + shift;
    }
    mean[c] = m;
    invstd[c] = inv;
    const double unbiased = count > 1 ? q / (count - 1) : var;
    nm[c] = momentum * mm[c] + (1 - momentum) * m;
    nv[c] = momentum * mv[c] + (1 - momentum) * static_cast<float>(unbiased);
  }
}

// dbeta = sum dy, dgamma = sum dy xhat, dx = gamma invstd (dy - dbeta / count - xhat dgamma / count)
void Backward(const float *x, const float *gamma, const float *mean, const float *invstd, const float *dy, float *dx,
              float *dgamma, float *dbeta, int64_t batch, int64_t channels, int64_t plane, int64_t c0, int64_t c1) {
  const double count = static_cast<double>(batch * plane);
  for (int64_t c = c0; c < c1; ++c) {
    const float m = mean[c], inv = invstd[c];
    double sdy = 0, sdyx = 0;
    for (int64_t n = 0; n < batch; ++n) {
      const int64_t at = (n * channels + c) * plane;
      const float *g = dy + at, *in = x + at;
      sdy += Sum(g, plane, [](float v, int64_t) { return v; });
      sdyx += Sum(g, plane, [in, m](float v, int64_t i) { return v * (in[i] - m); });
    }
    const float db = static_cast<float>(sdy), dg = static_cast<float>(sdyx * inv);
    const float k = gamma[c] * inv, mean_dy = static_cast<float>(sdy / count);
    const float slope = static_cast<float>(sdyx / count) * inv * inv;  // times (x - mean): xhat dgamma / count
    for (int64_t n = 0; n < batch; ++n) {
      const int64_t at = (n * channels + c) * plane;
      const float *g = dy + at, *in = x + at;
      float *out = dx + at;
      for (int64_t i = 0; i < plane; ++i) out[i] = k * (g[i] - mean_dy - (in[i] - m) * slope);
    }
    dgamma[c] = dg;
    dbeta[c] = db;
  }
}

// The same two passes over blocked x (N, C/B, H, W, B): one block of B channels at a time, its B lanes side by
// side (the compiler vectorizes across them). Sums are taken in float over up to 256 positions and in double
// across them.
constexpr int64_t kChunk = 256;

// sums[l] += f(offset of (n, cb, i, l)) over n and i, for the block cb
template <int B, typename F>
void LaneSums(int64_t batch, int64_t blocks, int64_t plane, int64_t cb, double *sums, F f) {
  for (int64_t n = 0; n < batch; ++n) {
    const int64_t row = (n * blocks + cb) * plane * B;
    for (int64_t i0 = 0; i0 < plane; i0 += kChunk) {
      float acc[B] = {};
      const int64_t i1 = i0 + kChunk < plane ? i0 + kChunk : plane;
      for (int64_t i = i0; i < i1; ++i)
        for (int l = 0; l < B; ++l) acc[l] += f(row + i * B + l, l);
      for (int l = 0; l < B; ++l) sums[l] += acc[l];
    }
  }
}

// From here to the AVX-512 loops' end: no fused multiply-add (fp-contract=off), so that the float32 loops and the
// float16 ones below, which AVX-512 could fuse, round alike.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// A block's statistics from its mean m and lane sums q of (x - m)^2: the output's scale and shift, the batch's
// mean and invstd, and the new moving statistics
template <int B>
void BlockStats(const double *q, double count, const float *gamma, const float *beta,
                const float *mm, const float *mv, float momentum, float eps, int64_t cb, const float *m, float *scale,
                float *shift, float *mean, float *invstd, float *nm, float *nv) {
  for (int l = 0; l < B; ++l) {
    const int64_t c = cb * B + l;
    const double var = q[l] / count;
    const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
    scale[l] = gamma[c] * inv;
    shift[l] = beta[c] - m[l] * scale[l];
    mean[c] = m[l];
    invstd[c] = inv;
    const double unbiased = count > 1 ? q[l] / (count - 1) : var;
    nm[c] = momentum * mm[c] + (1 - momentum) * m[l];
    nv[c] = momentum * mv[c] + (1 - momentum) * static_cast<float>(unbiased);
  }
}

// A block's backward coefficients from its lane sums of dy and of dy (x - mean): dx = k (dy - mean_dy - (x - mean)
// slope), and the parameters' gradients
template <int B>
void GradStats(const double *sdy, const double *sdyx, double count, const float *gamma, const float *inv, int64_t cb,
               float *k, float *mean_dy, float *slope, float *dgamma, float *dbeta) {
  for (int l = 0; l < B; ++l) {
    const int64_t c = cb * B + l;
    k[l] = gamma[c] * inv[l];
    mean_dy[l] = static_cast<float>(sdy[l] / count);
    slope[l] = static_cast<float>(sdyx[l] / count) * inv[l] * inv[l];
    dgamma[c] = static_cast<float>(sdyx[l] * inv[l]);
    dbeta[c] = static_cast<float>(sdy[l]);
  }
}

template <int B>
void ForwardBlocked(const float *x, const float *gamma, const float *beta, const float *mm, const float *mv,
                    float momentum, float eps, float *y, float *mean, float *invstd, float *nm, float *nv,
                    int64_t batch, int64_t blocks, int64_t plane, int64_t b0, int64_t b1) {
  const double count = static_cast<double>(batch * plane);
  for (int64_t cb = b0; cb < b1; ++cb) {
    double s[B] = {}, q[B] = {};
    LaneSums<B>(batch, blocks, plane, cb, s, [x](int64_t at, int) { return x[at]; });
    float m[B], scale[B], shift[B];
    for (int l = 0; l < B; ++l) m[l] = static_cast<float>(s[l] / count);
    LaneSums<B>(batch, blocks, plane, cb, q, [x, &m](int64_t at, int l) { return (x[at] - m[l]) * (x[at] - m[l]); });
    BlockStats<B>(q, count, gamma, beta, mm, mv, momentum, eps, cb, m, scale, shift, mean, invstd, nm, nv);
    for (int64_t n = 0; n < batch; ++n) {
      const int64_t row = (n * blocks + cb) * plane * B;
      for (int64_t i = 0; i < plane; ++i)
        for (int l = 0; l < B; ++l) y[row + i * B + l] = x[row + i * B + l] * scale[l] + shift[l];
    }
  }
}

template <int B>
void BackwardBlocked(const float *x, const float *gamma, const float *mean, const float *invstd, const float *dy,
                     float *dx, float *dgamma, float *dbeta, int64_t batch, int64_t blocks, int64_t plane, int64_t b0,
                     int64_t b1) {
  const double count = static_cast<double>(batch * plane);
  for (int64_t cb = b0; cb < b1; ++cb) {
    const float *m = mean + cb * B, *inv = invstd + cb * B;
    double sdy[B] = {}, sdyx[B] = {};
    LaneSums<B>(batch, blocks, plane, cb, sdy, [dy](int64_t at, int) { return dy[at]; });
    LaneSums<B>(batch, blocks, plane, cb, sdyx, [dy, x, m](int64_t at, int l) { return dy[at] * (x[at] - m[l]); });
    float k[B], mean_dy[B], slope[B];
    GradStats<B>(sdy, sdyx, count, gamma, inv, cb, k, mean_dy, slope, dgamma, dbeta);
    for (int64_t n = 0; n < batch; ++n) {
      const int64_t row = (n * blocks + cb) * plane * B;
      for (int64_t i = 0; i < plane; ++i)
        for (int l = 0; l < B; ++l) {
          const int64_t at = row + i * B + l;
          dx[at] = k[l] * (dy[at] - mean_dy[l] - (x[at] - m[l]) * slope[l]);
        }
    }
  }
}

// ForwardBlocked<16> and BackwardBlocked<16> on float16 x, y, dy and dx, read and written as they are: each
// position's 16 lanes convert in one instruction. The arithmetic is theirs, operation for operation (a product
// and a sum are rounded apart, as the scalar code compiles without FMA), so the results are bit for bit those of
// the float32 loops on the converted tensors, rounded once to float16 (the pragma above keeps g++ from fusing
// a product and a sum into one FMA, which AVX-512 has).
#define AMP_ZOO_AVX512 __attribute__((target("avx512f,avx2,f16c")))

AMP_ZOO_AVX512 inline __m512 Load16(const uint16_t *p) {
  return _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
}

AMP_ZOO_AVX512 inline void Store16(uint16_t *p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(p),
                      _mm512_maskz_cvtps_ph(0xffff, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

AMP_ZOO_AVX512 inline void AddTo(double *sums, __m512 acc) {
  float lanes[16];
  _mm512_storeu_ps(lanes, acc);
  for (int l = 0; l < 16; ++l) sums[l] += lanes[l];
}

// LaneSums<16> of x (m null) or of (x - m)^2
AMP_ZOO_AVX512 void HalfLaneSums(const uint16_t *x, const float *m, int64_t batch, int64_t blocks, int64_t plane,
                                 int64_t cb, double *sums) {
  const __m512 mean = m ? _mm512_loadu_ps(m) : _mm512_setzero_ps();
  for (int64_t n = 0; n < batch; ++n) {
    const uint16_t *row = x + (n * blocks + cb) * plane * 16;
    for (int64_t i0 = 0; i0 < plane; i0 += kChunk) {
      __m512 acc = _mm512_setzero_ps();
      const int64_t i1 = i0 + kChunk < plane ? i0 + kChunk : plane;
      for (int64_t i = i0; i < i1; ++i) {
        const __m512 v = Load16(row + i * 16);
        if (m) {
          const __m512 d = _mm512_sub_ps(v, mean);
          acc = _mm512_add_ps(acc, _mm512_mul_ps(d, d));
        } else {
          acc = _mm512_add_ps(acc, v);
        }
      }
      AddTo(sums, acc);
    }
  }
}

AMP_ZOO_AVX512 void ForwardHalf16(const uint16_t *x, const float *gamma, const float *beta, const float *mm,
                                  const float *mv, float momentum, float eps, uint16_t *y, float *mean, float *invstd,
                                  float *nm, float *nv, int64_t batch, int64_t blocks, int64_t plane, int64_t b0,
                                  int64_t b1) {
  const double count = static_cast<double>(batch * plane);
  for (int64_t cb = b0; cb < b1; ++cb) {
    double s[16] = {}, q[16] = {};
    HalfLaneSums(x, nullptr, batch, blocks, plane, cb, s);
    float m[16], scale[16], shift[16];
    for (int l = 0; l < 16; ++l) m[l] = static_cast<float>(s[l] / count);
    HalfLaneSums(x, m, batch, blocks, plane, cb, q);
    BlockStats<16>(q, count, gamma, beta, mm, mv, momentum, eps, cb, m, scale, shift, mean, invstd, nm, nv);
    const __m512 k = _mm512_loadu_ps(scale), b = _mm512_loadu_ps(shift);
    for (int64_t n = 0; n < batch; ++n) {
      const int64_t row = (n * blocks + cb) * plane * 16;
      for (int64_t i = 0; i < plane; ++i)
        Store16(y + row + i * 16, _mm512_add_ps(_mm512_mul_ps(Load16(x + row + i * 16), k), b));
    }
  }
}

AMP_ZOO_AVX512 void BackwardHalf16(const uint16_t *x, const float *gamma, const float *mean, const float *invstd,
                                   const uint16_t *dy, uint16_t *dx, float *dgamma, float *dbeta, int64_t batch,
                                   int64_t blocks, int64_t plane, int64_t b0, int64_t b1) {
  const double count = static_cast<double>(batch * plane);
  for (int64_t cb = b0; cb < b1; ++cb) {
    const float *m = mean + cb * 16, *inv = invstd + cb * 16;
    const __m512 mv = _mm512_loadu_ps(m);
    double sdy[16] = {}, sdyx[16] = {};
    for (int64_t n = 0; n < batch; ++n) {
      const int64_t row = (n * blocks + cb) * plane * 16;
      for (int64_t i0 = 0; i0 < plane; i0 += kChunk) {
        __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
        const int64_t i1 = i0 + kChunk < plane ? i0 + kChunk : plane;
        for (int64_t i = i0; i < i1; ++i) {
          const __m512 g = Load16(dy + row + i * 16);
          a = _mm512_add_ps(a, g);
          b = _mm512_add_ps(b, _mm512_mul_ps(g, _mm512_sub_ps(Load16(x + row + i * 16), mv)));
        }
        AddTo(sdy, a);
        AddTo(sdyx, b);
      }
    }
    float k[16], mean_dy[16], slope[16];
    GradStats<16>(sdy, sdyx, count, gamma, inv, cb, k, mean_dy, slope, dgamma, dbeta);
    const __m512 kv = _mm512_loadu_ps(k), md = _mm512_loadu_ps(mean_dy), sl = _mm512_loadu_ps(slope);
    for (int64_t n = 0; n < batch; ++n) {
      const int64_t row = (n * blocks + cb) * plane * 16;
      for (int64_t i = 0; i < plane; ++i) {
        const int64_t at = row + i * 16;
        const __m512 centred = _mm512_mul_ps(_mm512_sub_ps(Load16(x + at), mv), sl);
        Store16(dx + at, _mm512_mul_ps(kv, _mm512_sub_ps(_mm512_sub_ps(Load16(dy + at), md), centred)));
      }
    }
  }
}

#pragma GCC pop_options

// Split channels over the pool's threads
void Channels(int64_t channels, const std::function<void(int64_t, int64_t)> &work) {
  const int threads = AmpZooThreads();
  AmpZooParallel(threads, [&](int t, int n) { work(channels * t / n, channels * (t + 1) / n); });
}

bool Is(const char *dtype, const char *name) { return !std::strcmp(dtype, name); }

// The dtypes these ops take: float32 everywhere, or float16 for the tensors in `io` (all of them alike)
bool Dtypes(int nparam, const char **dtypes, std::initializer_list<int> io) {
  const bool half = Is(dtypes[*io.begin()], "float16");
  for (int i = 0; i < nparam; ++i) {
    bool in_io = false;
    for (int k : io) in_io = in_io || k == i;
    if (!Is(dtypes[i], in_io && half ? "float16" : "float32")) return false;
  }
  return true;
}

// A float32 view of an op's tensor: the tensor itself, or (float16) a staging buffer of this thread's, filled
// from it (In) or rounded back into it (Out)
struct View {
  float *p;
  void *user;
  int64_t n;
  bool half;
  View(std::vector<float> &buffer, void *tensor, int64_t count, bool fp16, bool in)
      : p(static_cast<float *>(tensor)), user(tensor), n(count), half(fp16) {
    if (!half) return;
    if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
    p = buffer.data();
    if (in) AmpZooHalfToFloat(static_cast<const uint16_t *>(user), p, n);
  }
  void Out() {
    if (half) AmpZooFloatToHalf(p, static_cast<uint16_t *>(user), n);
  }
};

thread_local std::vector<float> stage[3];

// Return codes (MindSpore reports them): 1 a rank, count or dtype these ops do not take
int Normalize(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 11 || !Dtypes(nparam, dtypes, {0, 6})) return 1;
  const int64_t *s = shapes[0], batch = s[0], blocks = s[1], plane = s[2] * s[3];
  const int64_t channels = ndims[0] == 5 ? blocks * s[4] : blocks;
  const int64_t count = batch * channels * plane;
  const bool half = Is(dtypes[0], "float16");
  if (half && ndims[0] == 5 && s[4] == 16 && AmpZooHalfIsa() == 2) {
    auto f = [&](int i) { return static_cast<float *>(params[i]); };
    const float momentum = f(5)[0], eps = f(5)[1];
    Channels(blocks, [&](int64_t b0, int64_t b1) {
      ForwardHalf16(static_cast<const uint16_t *>(params[0]), f(1), f(2), f(3), f(4), momentum, eps,
                    static_cast<uint16_t *>(params[6]), f(7), f(8), f(9), f(10), batch, blocks, plane, b0, b1);
    });
    return 0;
  }
  View x(stage[0], params[0], count, half, true), y(stage[1], params[6], count, half, false);
  auto f = [&](int i) { return i == 0 ? x.p : i == 6 ? y.p : static_cast<float *>(params[i]); };
  const float momentum = f(5)[0], eps = f(5)[1];
  if (ndims[0] == 5 && (s[4] == 16 || s[4] == 8)) {  // blocked: split by block of s[4] channels
    Channels(blocks, [&](int64_t b0, int64_t b1) {
      (s[4] == 16 ? ForwardBlocked<16> : ForwardBlocked<8>)(f(0), f(1), f(2), f(3), f(4), momentum, eps, f(6), f(7),
                                                           f(8), f(9), f(10), batch, blocks, plane, b0, b1);
    });
  } else if (ndims[0] == 4) {
    Channels(channels, [&](int64_t c0, int64_t c1) {
      Forward(f(0), f(1), f(2), f(3), f(4), momentum, eps, f(6), f(7), f(8), f(9), f(10), batch, channels, plane, c0,
              c1);
    });
  } else {
    return 1;
  }
  y.Out();
  return 0;
}

int NormalizeGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 11 || !Dtypes(nparam, dtypes, {0, 4, 5})) return 1;
  const int64_t *s = shapes[0], batch = s[0], blocks = s[1], plane = s[2] * s[3];
  const int64_t channels = ndims[0] == 5 ? blocks * s[4] : blocks;
  const int64_t count = batch * channels * plane;
  const bool half = Is(dtypes[0], "float16");
  if (half && ndims[0] == 5 && s[4] == 16 && AmpZooHalfIsa() == 2) {
    auto f = [&](int i) { return static_cast<float *>(params[i]); };
    Channels(blocks, [&](int64_t b0, int64_t b1) {
      BackwardHalf16(static_cast<const uint16_t *>(params[0]), f(1), f(2), f(3),
                     static_cast<const uint16_t *>(params[4]), static_cast<uint16_t *>(params[5]), f(6), f(7), batch,
                     blocks, plane, b0, b1);
    });
    std::memset(f(8), 0, sizeof(float) * channels);
    std::memset(f(9), 0, sizeof(float) * channels);
    std::memset(f(10), 0, sizeof(float) * 2);
    return 0;
  }
  View x(stage[0], params[0], count, half, true), dy(stage[1], params[4], count, half, true),
      dx(stage[2], params[5], count, half, false);
  auto f = [&](int i) { return i == 0 ? x.p : i == 4 ? dy.p : i == 5 ? dx.p : static_cast<float *>(params[i]); };
  if (ndims[0] == 5 && (s[4] == 16 || s[4] == 8)) {
    Channels(blocks, [&](int64_t b0, int64_t b1) {
      (s[4] == 16 ? BackwardBlocked<16> : BackwardBlocked<8>)(f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7), batch,
                                                             blocks, plane, b0, b1);
    });
  } else if (ndims[0] == 4) {
    Channels(channels, [&](int64_t c0, int64_t c1) {
      Backward(f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7), batch, channels, plane, c0, c1);
    });
  } else {
    return 1;
  }
  dx.Out();
  std::memset(f(8), 0, sizeof(float) * channels);  // d moving_mean
  std::memset(f(9), 0, sizeof(float) * channels);  // d moving_var
  std::memset(f(10), 0, sizeof(float) * 2);        // d hyper
  return 0;
}

}  // namespace

AMP_ZOO_AOT(BatchNormFwd, Normalize(AOT_PASS))
AMP_ZOO_AOT(BatchNormBwd, NormalizeGrad(AOT_PASS))
