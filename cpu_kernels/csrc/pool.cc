// Max-pooling for MindSpore's CPU backend, forward and backward, as AOT custom ops (cpu_kernels/cells.py;
// built into one library with conv.cc): LeNet's 2x2 with stride 2, and the ImageNet stem's 3x3 with stride 2
// and padding 1 (ResNet), the latter also in the blocked layout of 16 channels its neighbours keep.
//
// MindSpore 2.10's CPU MaxPoolGrad took 4.4 of a LeNet step's 10 ms of op time, and the gradient written out in
// MindSpore ops (a reshape, a transpose, an argmax, a one-hot) still 2.2 ms; PyTorch's pooling backward takes
// 0.2 ms. These loops make one pass over the input each way, as PyTorch's kernels do (0.4 ms each way for a
// LeNet batch's first pooling, 64x6x28x28, on one core).
//
// MaxPool2x2Fwd (x -> y) and MaxPool2x2Bwd (x, dy -> dx): NCHW, float32 or float16, even or odd H and W (the
// last odd row or column is dropped, as MindSpore's "valid" pooling does). The gradient goes to the first
// maximum of each window in row-major order, as MindSpore's kernel and PyTorch's do; a NaN counts as the
// maximum, so it reaches the loss and the loss scaler sees the overflow.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "aot.h"
#include "runtime.h"
#endif

namespace {

float Half(uint16_t h) {  // IEEE binary16 to float, exact
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (!man) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while (!(man & 0x400));
    bits = sign | ((112 - e) << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The value of a float32 or float16 element, read from its bits (the buffers are handled as bits, so the
// selections below need no branch)
float Value(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
float Value(uint16_t bits) { return Half(bits); }

// One window (a, b over c, d) that holds a NaN: the index 0-3 of its first NaN or first maximum.
int First(float a, float b, float c, float d) {
  const float v[4] = {a, b, c, d};
  int at = 0;
  for (int k = 1; k < 4 && v[at] == v[at]; ++k)
    if (v[k] > v[at] || v[k] != v[k]) at = k;
  return at;
}

// Bit k set where element k of the window equals its maximum; 0 when the window holds a NaN. On SSE2 in vector
// registers: written with scalar comparisons, g++ branched on the last one, which mispredicts on real data
#ifdef __SSE2__
int Equal(float a, float b, float c, float d) {
  const __m128 v = _mm_setr_ps(a, b, c, d), half = _mm_max_ps(v, _mm_movehl_ps(v, v));
  const __m128 top = _mm_max_ps(half, _mm_shuffle_ps(half, half, 1));
  const int nan = _mm_movemask_ps(_mm_cmpunord_ps(v, v));  // maxps drops a NaN, this loop must not
  return _mm_movemask_ps(_mm_cmpeq_ps(v, _mm_shuffle_ps(top, top, 0))) & -(nan == 0);
}
#else
int Equal(float a, float b, float c, float d) {
  const float m = std::max(std::max(a, b), std::max(c, d));
  return (a == m) | (b == m) << 1 | (c == m) << 2 | (d == m) << 3;
}
#endif

// y[n, c, i, j] = x at the window's first maximum; with dy, dx gets dy there and 0 at the window's other three.
// Windows j0..j1-1 of the output row at `out`, whose top input row starts at `top`.
// Branch-free: with a branch per comparison, which mispredicts on real activations, they ran 2.6x slower.
template <typename U>
void Windows(const U *x, U *y, const U *dy, U *dx, int64_t top, int64_t out, int64_t w, int64_t j0, int64_t j1) {
  const U *r0 = x + top, *r1 = r0 + w;
  for (int64_t j = j0; j < j1; ++j) {
    const U v[4] = {r0[2 * j], r0[2 * j + 1], r1[2 * j], r1[2 * j + 1]};
    const float a = Value(v[0]), b = Value(v[1]), c = Value(v[2]), d = Value(v[3]);
    // the first element equal to the maximum; none is when the window holds a NaN (rare: predicts well)
    int at = __builtin_ctz(Equal(a, b, c, d) | 16);
    if (at == 4) at = First(a, b, c, d);
    const U m0 = -U(at == 0), m1 = -U(at == 1), m2 = -U(at == 2), m3 = -U(at == 3);  // all ones or 0
    if (dx) {
      const U g = dy[out + j];
      U *d0 = dx + top + 2 * j, *d1 = d0 + w;
      d0[0] = g & m0, d0[1] = g & m1, d1[0] = g & m2, d1[1] = g & m3;
    } else {
      y[out + j] = (v[0] & m0) | (v[1] & m1) | (v[2] & m2) | (v[3] & m3);
    }
  }
}

template <typename U>
void Pool(const U *x, U *y, const U *dy, U *dx, int64_t planes, int64_t h, int64_t w) {
  const int64_t oh = h / 2, ow = w / 2;
  if (dx && (h % 2 || w % 2)) std::memset(dx, 0, sizeof(U) * planes * h * w);  // the dropped row or column
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t i = 0; i < oh; ++i) Windows(x, y, dy, dx, (p * h + 2 * i) * w, (p * oh + i) * ow, w, 0, ow);
}

#if defined(__x86_64__) && defined(__GNUC__)
// Pool 8 windows at a time on AVX2 (F16C converts float16 rows to float32 and back, exactly): LeNet's first
// pooling (64x6x28x28) takes 70 us forward and 105 us backward in float32, against 400 us each way in Windows'
// loop (700 us in float16; one core, AMD EPYC). Rows are split into even and odd columns (a, b on the top row,
// c, d below) and the first maximum is picked by masks in Equal's order; a block of 8 windows that holds a NaN
// goes through Windows. Rows of at least 8 windows only (Dispatch). The selections are of bits (float16 values
// round-trip float32 exactly), so the results are the scalar loop's exactly.
#define AVX2 __attribute__((target("avx2,f16c")))
AVX2 inline __m256 Load(const float *p) { return _mm256_loadu_ps(p); }
AVX2 inline __m256 Load(const uint16_t *p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}
AVX2 inline void Store(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
AVX2 inline void Store(uint16_t *p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i *>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
AVX2 inline __m256 Even(__m256 lo, __m256 hi) {  // elements 0, 2, ..., 14 of lo:hi
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xd8));
}
AVX2 inline __m256 Odd(__m256 lo, __m256 hi) {  // elements 1, 3, ..., 15
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xdd)), 0xd8));
}
// Even's inverse on a pair: (e, o) back to 16 interleaved elements e0 o0 e1 o1 ... at out
template <typename T>
AVX2 inline void Interleave(__m256 e, __m256 o, T *out) {
  e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xd8));
  o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xd8));
  Store(out, _mm256_unpacklo_ps(e, o));
  Store(out + 8, _mm256_unpackhi_ps(e, o));
}

// T: float or uint16_t (float16 bits); U: the same element as Windows handles it (uint32_t or uint16_t)
template <typename T, typename U>
AVX2 void PoolAvx2(const U *xs, U *ys, const U *dys, U *dxs, int64_t planes, int64_t h, int64_t w) {
  const T *x = reinterpret_cast<const T *>(xs), *dy = reinterpret_cast<const T *>(dys);
  T *y = reinterpret_cast<T *>(ys), *dx = reinterpret_cast<T *>(dxs);
  const int64_t oh = h / 2, ow = w / 2;
  const __m256 ones = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  if (dx && (h % 2 || w % 2)) std::memset(dx, 0, sizeof(T) * planes * h * w);  // the dropped row or column
  for (int64_t p = 0; p < planes; ++p) {
    for (int64_t i = 0; i < oh; ++i) {
      const int64_t top = (p * h + 2 * i) * w, out = (p * oh + i) * ow;
      const T *r0 = x + top, *r1 = r0 + w;
      // blocks of 8 windows; a row's last ow % 8 windows in a block that overlaps the one before it (each
      // window writes the same y, or the same four dx, twice)
      for (int64_t next = 0; next < ow; next += 8) {
        const int64_t j = std::min(next, ow - 8);
        const __m256 t0 = Load(r0 + 2 * j), t1 = Load(r0 + 2 * j + 8);
        const __m256 b0 = Load(r1 + 2 * j), b1 = Load(r1 + 2 * j + 8);
        const __m256 a = Even(t0, t1), b = Odd(t0, t1), c = Even(b0, b1), d = Odd(b0, b1);
        const __m256 nan = _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q));
        if (_mm256_movemask_ps(nan)) {  // rare: the scalar loop takes these 8 windows
          _mm256_zeroupper();  // g++ leaves it out, and the SSE code in Windows then runs 4x slower (AMD EPYC)
          Windows(xs, ys, dys, dxs, top, out, w, j, j + 8);
          continue;
        }
        const __m256 m = _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d));
        const __m256 ea = _mm256_cmp_ps(a, m, _CMP_EQ_OQ), eb = _mm256_cmp_ps(b, m, _CMP_EQ_OQ);
        const __m256 ec = _mm256_cmp_ps(c, m, _CMP_EQ_OQ), ab = _mm256_or_ps(ea, eb);
        const __m256 m1 = _mm256_andnot_ps(ea, eb), m2 = _mm256_andnot_ps(ab, ec);
        const __m256 m3 = _mm256_andnot_ps(_mm256_or_ps(ab, ec), ones);
        if (dx) {
          const __m256 g = Load(dy + out + j);
          Interleave(_mm256_and_ps(g, ea), _mm256_and_ps(g, m1), dx + top + 2 * j);
          Interleave(_mm256_and_ps(g, m2), _mm256_and_ps(g, m3), dx + top + w + 2 * j);
        } else {  // the first maximum's bits (-0 and +0 compare equal: the first of them, as Equal picks)
          const __m256 v = _mm256_blendv_ps(_mm256_blendv_ps(d, c, m2), b, m1);
          Store(y + out + j, _mm256_blendv_ps(v, a, ea));
        }
      }
    }
  }
  _mm256_zeroupper();  // for the SSE code that runs next in this thread
}
#undef AVX2
// init: this runs as the library loads
const bool kAvx2 = (__builtin_cpu_init(), __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"));
template <typename U>
void PoolFast(const U *x, U *y, const U *dy, U *dx, int64_t planes, int64_t h, int64_t w) {
  if constexpr (sizeof(U) == 4)
    PoolAvx2<float>(x, y, dy, dx, planes, h, w);
  else
    PoolAvx2<uint16_t>(x, y, dy, dx, planes, h, w);
}
#else
const bool kAvx2 = false;
template <typename U>
void PoolFast(const U *, U *, const U *, U *, int64_t, int64_t, int64_t) {}
#endif

// float to a float32 element's bits (the 3x3 loops run on float32: Pool3x3)
template <typename U>
U Bits(float f);
template <>
uint32_t Bits<uint32_t>(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// 3x3 max-pooling, stride 2, padding 1 (the ResNet ImageNet stem's; torchvision's nn.MaxPool2d(3, 2, 1)).
// MindSpore 2.10 runs it as MaxPool3DWithArgmax: 70 ms of a ResNet-34 224x224 batch-8 step, where PyTorch
// takes 32 ms for both directions. The padding never wins (it is -inf, as in both frameworks); the gradient
// goes to each window's first maximum in row-major order, and a NaN counts as the maximum.
//
// The larger of m and v, or v when it is a NaN (so a NaN stays the maximum); no branch, so it vectorizes
inline float Max(float m, float v) { return (v > m) | (v != v) ? v : m; }

// Forward: each window's maximum, as a column-wise maximum of its (up to) three rows in `row` (w floats), then
// the maximum of three neighbours in that row. Maxima are exact, so the order gives the same value.
template <typename U>
void Max3x3(const U *x, U *y, float *row, int64_t planes, int64_t h, int64_t w) {
  const int64_t oh = (h - 1) / 2 + 1, ow = (w - 1) / 2 + 1;
  for (int64_t p = 0; p < planes; ++p) {
    const U *plane = x + p * h * w;
    for (int64_t i = 0; i < oh; ++i) {
      const int64_t r0 = std::max<int64_t>(2 * i - 1, 0), r1 = std::min<int64_t>(2 * i + 2, h);
      const U *a = plane + r0 * w;
      for (int64_t c = 0; c < w; ++c) row[c] = Value(a[c]);
      for (int64_t r = r0 + 1; r < r1; ++r) {
        const U *b = plane + r * w;
        for (int64_t c = 0; c < w; ++c) row[c] = Max(row[c], Value(b[c]));
      }
      U *out = y + (p * oh + i) * ow;
      out[0] = Bits<U>(w > 1 ? Max(row[0], row[1]) : row[0]);  // column -1 is padding
      const int64_t inner = (w - 2) / 2;  // outputs 1..inner have all three columns inside the image
      for (int64_t j = 1; j <= inner; ++j) out[j] = Bits<U>(Max(Max(row[2 * j - 1], row[2 * j]), row[2 * j + 1]));
      if (inner + 1 < ow) out[ow - 1] = Bits<U>(Max(row[w - 2], row[w - 1]));  // even w: the last window's two
    }
  }
}

// The index in a window (row-major, n columns a row) of its first element equal to m; with m a NaN, its first
// NaN. A bit per element and the lowest set bit: no branch to mispredict on real activations.
template <typename U>
inline unsigned First(const U *top, int64_t w, int64_t rows, int64_t n, float m) {
  unsigned hit = 0, k = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c, ++k) hit |= unsigned(Value(top[r * w + c]) == m) << k;
  if (!hit)  // m is a NaN (y is one of the window's elements)
    for (int64_t r = 0, k = 0; r < rows; ++r)
      for (int64_t c = 0; c < n; ++c, ++k) hit |= unsigned(Value(top[r * w + c]) != Value(top[r * w + c])) << k;
  return __builtin_ctz(hit | 512u);
}

// Backward: dx = the sum of dy over the windows whose first maximum an element is (windows overlap by a row and
// a column), accumulated in float32 in `acc` (h x w floats) and rounded once. The maximum's position is the
// first element equal to y. Windows inside the image take an unrolled path.
template <typename U>
void Grad3x3(const U *x, const U *y, const U *dy, U *dx, float *acc, int64_t planes, int64_t h, int64_t w) {
  const int64_t oh = (h - 1) / 2 + 1, ow = (w - 1) / 2 + 1;
  for (int64_t p = 0; p < planes; ++p) {
    const U *plane = x + p * h * w, *ys = y + p * oh * ow, *gs = dy + p * oh * ow;
    std::fill(acc, acc + h * w, 0.0f);
    for (int64_t i = 0; i < oh; ++i) {
      const int64_t r0 = std::max<int64_t>(2 * i - 1, 0), rows = std::min<int64_t>(2 * i + 2, h) - r0;
      for (int64_t j = 0; j < ow; ++j) {
        const int64_t c0 = std::max<int64_t>(2 * j - 1, 0), n = std::min<int64_t>(2 * j + 2, w) - c0;
        const float m = Value(ys[i * ow + j]);
        const U *top = plane + r0 * w + c0;
        if (rows == 3 && n == 3) {
          const U *a = top, *b = a + w, *c = b + w;
          unsigned at = __builtin_ctz((Value(a[0]) == m) | (Value(a[1]) == m) << 1 | (Value(a[2]) == m) << 2 |
                                      (Value(b[0]) == m) << 3 | (Value(b[1]) == m) << 4 | (Value(b[2]) == m) << 5 |
                                      (Value(c[0]) == m) << 6 | (Value(c[1]) == m) << 7 | (Value(c[2]) == m) << 8 |
                                      512);
          if (at == 9) at = First(top, w, rows, n, m);  // a NaN
          if (at < 9) acc[r0 * w + c0 + at / 3 * w + at % 3] += Value(gs[i * ow + j]);
        } else {
          const unsigned at = First(top, w, rows, n, m);  // 9: no element is y (cannot happen: y is the maximum)
          if (at < rows * n) acc[(r0 + at / n) * w + c0 + at % n] += Value(gs[i * ow + j]);
        }
      }
    }
    U *d = dx + p * h * w;
    for (int64_t k = 0; k < h * w; ++k) d[k] = Bits<U>(acc[k]);
  }
}

// fn(in, out) on planes [p0, p1) of float32 or float16 tensors: params[0..k) the inputs and params[k] the output,
// a plane of each `sizes[i]` elements. float32 planes are handed over where they are; float16 ones are converted
// to float32 a plane at a time (F16C or AVX-512, conv.cc) and the output back, so the loops run on float32 (the
// selections are of values that round-trip exactly; a gradient's sums are rounded once, to nearest even).
void FloatPlanes(void **params, bool f32, const std::vector<int64_t> &sizes, int64_t p0, int64_t p1,
                 const std::function<void(float *const *in, float *out)> &fn) {
  const size_t k = sizes.size() - 1;
  std::vector<std::vector<float>> buffers(f32 ? 0 : sizes.size());
  for (size_t i = 0; i < buffers.size(); ++i) buffers[i].resize(sizes[i]);
  std::vector<float *> in(k);
  for (int64_t p = p0; p < p1; ++p) {
    for (size_t i = 0; i < k; ++i) {
      in[i] = f32 ? static_cast<float *>(params[i]) + p * sizes[i] : buffers[i].data();
      if (!f32) AmpZooHalfToFloatHere(static_cast<const uint16_t *>(params[i]) + p * sizes[i], in[i], sizes[i]);
    }
    float *out = f32 ? static_cast<float *>(params[k]) + p * sizes[k] : buffers[k].data();
    fn(in.data(), out);
    if (!f32) AmpZooFloatToHalfHere(out, static_cast<uint16_t *>(params[k]) + p * sizes[k], sizes[k]);
  }
}

uint32_t *AsBits(float *v) { return reinterpret_cast<uint32_t *>(v); }  // a float32 buffer as the loops' bits

// The 2x2 op on planes [p0, p1) of buffers of element type U: params are x, y (forward); x, dy, dx (backward)
template <typename U>
void Dispatch(void **params, bool backward, int64_t p0, int64_t p1, int64_t h, int64_t w) {
  const auto at = [&](int i, int64_t n) { return static_cast<U *>(params[i]) + p0 * n; };
  const int64_t in = h * w, out = (h / 2) * (w / 2);
  U *y = backward ? nullptr : at(1, out), *dy = backward ? at(1, out) : nullptr, *dx = backward ? at(2, in) : nullptr;
  if (kAvx2 && w / 2 >= 8)  // rows of 8 windows or more: LeNet's first pooling, not its second
    PoolFast(at(0, in), y, dy, dx, p1 - p0, h, w);
  else
    Pool(at(0, in), y, dy, dx, p1 - p0, h, w);
}

// 2x2 over planes [p0, p1), split between the pool's threads by the caller. float16 rows too short for the AVX2
// loop (LeNet's second pooling) go through FloatPlanes, as Pool3x3's do: the same bits, where reading each
// value through Half() cost 3x the float32 loop.
void Pool2x2(void **params, bool backward, bool f32, int64_t p0, int64_t p1, int64_t h, int64_t w) {
  if (f32) return Dispatch<uint32_t>(params, backward, p0, p1, h, w);
  if (kAvx2 && w / 2 >= 8) return Dispatch<uint16_t>(params, backward, p0, p1, h, w);
  const int64_t in = h * w, out = (h / 2) * (w / 2);
  uint32_t *none = nullptr;
  if (backward)
    FloatPlanes(params, false, {in, out, in}, p0, p1,
                [&](float *const *v, float *dx) { Pool(AsBits(v[0]), none, AsBits(v[1]), AsBits(dx), 1, h, w); });
  else
    FloatPlanes(params, false, {in, out}, p0, p1,
                [&](float *const *v, float *y) { Pool(AsBits(v[0]), AsBits(y), none, none, 1, h, w); });
}

// 3x3 over planes [p0, p1), split between the pool's threads by the caller, through FloatPlanes: reading float16
// bits through Half() a value at a time cost the ResNet-34 224x224 stem's pooling 5-15x its float32 time.
void Pool3x3(void **params, bool backward, bool f32, int64_t p0, int64_t p1, int64_t h, int64_t w) {
  const int64_t in = h * w, out = ((h - 1) / 2 + 1) * ((w - 1) / 2 + 1);
  std::vector<float> scratch(backward ? in : w);
  if (backward)
    FloatPlanes(params, f32, {in, out, out, in}, p0, p1, [&](float *const *v, float *dx) {
      Grad3x3(AsBits(v[0]), AsBits(v[1]), AsBits(v[2]), AsBits(dx), scratch.data(), 1, h, w);
    });
  else
    FloatPlanes(params, f32, {in, out}, p0, p1,
                [&](float *const *v, float *y) { Max3x3(AsBits(v[0]), AsBits(y), scratch.data(), 1, h, w); });
}

// 3x3 in the blocked layout of 16 channels (N, C/16, H, W, 16: cells.block_for on an AVX-512 CPU), the one the
// stem's BatchNorm and ReLU hand on, so no reorder runs on either side of the pooling. A position's 16 channels
// are one AVX-512 register; the windows, the NaN rule and the order of the sums are those of Max3x3 and Grad3x3
// lane by lane, so the values are the same bits as the NCHW loops'. `xs` is one plane of h x w positions in
// float32 (an fp16 plane is converted first, as in Pool3x3).
#if defined(__x86_64__)
#define AMP_ZOO_AVX512 __attribute__((target("avx512f")))
AMP_ZOO_AVX512 inline __m512 Max16(__m512 m, __m512 v) {  // Max() on 16 lanes: v where v > m or v is a NaN
  const __mmask16 take = _mm512_cmp_ps_mask(v, m, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(take, m, v);
}

// Forward: as Max3x3, the column-wise maximum of a window row's (up to) three rows into `row` (w positions),
// then the maximum of three neighbours in it.
AMP_ZOO_AVX512 void MaxBlocked16(const float *xs, float *y, float *row, int64_t h, int64_t w) {
  const int64_t oh = (h - 1) / 2 + 1, ow = (w - 1) / 2 + 1;
  for (int64_t i = 0; i < oh; ++i) {
    const int64_t r0 = std::max<int64_t>(2 * i - 1, 0), r1 = std::min<int64_t>(2 * i + 2, h);
    for (int64_t c = 0; c < w; ++c) {
      __m512 m = _mm512_loadu_ps(xs + (r0 * w + c) * 16);
      for (int64_t r = r0 + 1; r < r1; ++r) m = Max16(m, _mm512_loadu_ps(xs + (r * w + c) * 16));
      _mm512_storeu_ps(row + c * 16, m);
    }
    float *out = y + i * ow * 16;
    for (int64_t j = 0; j < ow; ++j) {
      const int64_t c0 = std::max<int64_t>(2 * j - 1, 0), c1 = std::min<int64_t>(2 * j + 2, w);
      __m512 m = _mm512_loadu_ps(row + c0 * 16);
      for (int64_t c = c0 + 1; c < c1; ++c) m = Max16(m, _mm512_loadu_ps(row + c * 16));
      _mm512_storeu_ps(out + j * 16, m);
    }
  }
}

// Backward: acc (h x w positions, zeroed) += dy at each window's first maximum, lane by lane: its first position
// equal to y, or with y a NaN its first NaN.
AMP_ZOO_AVX512 void GradBlocked16(const float *xs, const float *ys, const float *gs, float *acc, int64_t h,
                                  int64_t w) {
  const int64_t oh = (h - 1) / 2 + 1, ow = (w - 1) / 2 + 1;
  for (int64_t i = 0; i < oh; ++i) {
    const int64_t r0 = std::max<int64_t>(2 * i - 1, 0), r1 = std::min<int64_t>(2 * i + 2, h);
    for (int64_t j = 0; j < ow; ++j) {
      const int64_t c0 = std::max<int64_t>(2 * j - 1, 0), c1 = std::min<int64_t>(2 * j + 2, w);
      const __m512 m = _mm512_loadu_ps(ys + (i * ow + j) * 16), g = _mm512_loadu_ps(gs + (i * ow + j) * 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q);
      __mmask16 open = 0xffff;  // lanes whose maximum is not found yet
      for (int64_t r = r0; r < r1 && open; ++r)
        for (int64_t c = c0; c < c1 && open; ++c) {
          const __m512 v = _mm512_loadu_ps(xs + (r * w + c) * 16);
          const __mmask16 hit = open & (_mm512_cmp_ps_mask(v, m, _CMP_EQ_OQ) |
                                        (nan & _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)));
          float *a = acc + (r * w + c) * 16;
          _mm512_storeu_ps(a, _mm512_mask_add_ps(_mm512_loadu_ps(a), hit, _mm512_loadu_ps(a), g));
          open &= static_cast<__mmask16>(~hit);
        }
    }
  }
}

// The blocked 3x3 over planes [p0, p1) of N*C/16, through FloatPlanes: x -> y (forward); x, y, dy -> dx
// (backward)
void Pool3x3Blocked(void **params, bool backward, bool f32, int64_t p0, int64_t p1, int64_t h, int64_t w) {
  const int64_t in = h * w * 16, out = ((h - 1) / 2 + 1) * ((w - 1) / 2 + 1) * 16;
  if (backward) {
    FloatPlanes(params, f32, {in, out, out, in}, p0, p1, [&](float *const *v, float *dx) {
      std::fill(dx, dx + in, 0.0f);
      GradBlocked16(v[0], v[1], v[2], dx, h, w);
    });
    return;
  }
  std::vector<float> row(w * 16);
  FloatPlanes(params, f32, {in, out}, p0, p1,
              [&](float *const *v, float *y) { MaxBlocked16(v[0], y, row.data(), h, w); });
}
#endif

// The blocked 3x3 (rank 5: N, C/16, H, W, 16, on an AVX-512 CPU; cells.CpuMaxPool3x3 reorders other blocks to
// NCHW), planes split between the pool's threads
int RunBlocked(int nparam, void **params, int64_t **shapes, const char **dtypes, bool backward) {
#if defined(__x86_64__)
  for (int i = 1; i < nparam; ++i)
    if (std::strcmp(dtypes[i], dtypes[0])) return 1;
  const int64_t *s = shapes[0], planes = s[0] * s[1];
  const bool f32 = !std::strcmp(dtypes[0], "float32");
  if ((!f32 && std::strcmp(dtypes[0], "float16")) || s[4] != 16 || !__builtin_cpu_supports("avx512f")) return 1;
  const int threads = planes > 1 && planes * s[2] * s[3] * 16 >= (1 << 15) ? AmpZooThreads() : 1;
  AmpZooParallel(threads, [&](int t, int k) {
    Pool3x3Blocked(params, backward, f32, planes * t / k, planes * (t + 1) / k, s[2], s[3]);
  });
  return 0;
#else
  (void)nparam, (void)params, (void)shapes, (void)dtypes, (void)backward;
  return 1;
#endif
}

// Return codes (MindSpore reports them): 1 a rank or dtype these ops do not take (shapes come from the
// op's shape function, cells.py). Forward x -> y; backward x, dy -> dx (2x2) or x, y, dy -> dx (3x3)
int Run(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool backward, bool k3) {
  if (nparam != (backward ? (k3 ? 4 : 3) : 2)) return 1;
  if (k3 && ndims[0] == 5) return RunBlocked(nparam, params, shapes, dtypes, backward);
  if (ndims[0] != 4) return 1;
  for (int i = 1; i < nparam; ++i)
    if (std::strcmp(dtypes[i], dtypes[0])) return 1;
  const int64_t *s = shapes[0], planes = s[0] * s[1];
  const bool f32 = !std::strcmp(dtypes[0], "float32");
  if (!f32 && std::strcmp(dtypes[0], "float16")) return 1;
  if (k3) {  // the stem's pooling: planes split between the pool's threads
    const int threads = planes > 1 && planes * s[2] * s[3] >= (1 << 15) ? AmpZooThreads() : 1;
    AmpZooParallel(threads, [&](int t, int k) {
      Pool3x3(params, backward, f32, planes * t / k, planes * (t + 1) / k, s[2], s[3]);
    });
    return 0;
  }
  // 2x2: planes split between the pool's threads likewise
  const int threads = planes > 1 && planes * s[2] * s[3] >= (1 << 15) ? AmpZooThreads() : 1;
  AmpZooParallel(threads, [&](int t, int k) {
    Pool2x2(params, backward, f32, planes * t / k, planes * (t + 1) / k, s[2], s[3]);
  });
  return 0;
}

}  // namespace

AMP_ZOO_AOT(MaxPool2x2Fwd, Run(AOT_PASS, false, false))

AMP_ZOO_AOT(MaxPool2x2Bwd, Run(AOT_PASS, true, false))

AMP_ZOO_AOT(MaxPool3x3Fwd, Run(AOT_PASS, false, true))

AMP_ZOO_AOT(MaxPool3x3Bwd, Run(AOT_PASS, true, true))
