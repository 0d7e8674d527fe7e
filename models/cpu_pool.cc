// 2x2 max-pooling with stride 2, forward and backward, for MindSpore's CPU backend, as AOT custom ops
// (models/cpu_conv.py builds it into one library with cpu_conv.cc).
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
#ifdef __SSE2__
#include <emmintrin.h>
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
// Branch-free: with a branch per comparison, which mispredicts on real activations, they ran 2.6x slower.
template <typename U>
void Pool(const U *x, U *y, const U *dy, U *dx, int64_t planes, int64_t h, int64_t w) {
  const int64_t oh = h / 2, ow = w / 2;
  if (dx && (h % 2 || w % 2)) std::memset(dx, 0, sizeof(U) * planes * h * w);  // the dropped row or column
  for (int64_t p = 0; p < planes; ++p) {
    for (int64_t i = 0; i < oh; ++i) {
      const int64_t top = (p * h + 2 * i) * w, out = (p * oh + i) * ow;
      const U *r0 = x + top, *r1 = r0 + w;
      for (int64_t j = 0; j < ow; ++j) {
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
  }
}

// Return codes (MindSpore reports them): 1 a rank or dtype these ops do not take (shapes come from the
// op's shape function, cpu_conv.py: dy and dx are x's, halved and whole)
int Run(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool backward) {
  if (nparam != (backward ? 3 : 2) || ndims[0] != 4) return 1;
  for (int i = 1; i < nparam; ++i)
    if (std::strcmp(dtypes[i], dtypes[0])) return 1;
  const int64_t *s = shapes[0], planes = s[0] * s[1];
  const bool f32 = !std::strcmp(dtypes[0], "float32");
  if (!f32 && std::strcmp(dtypes[0], "float16")) return 1;
  void *x = params[0], *out = params[nparam - 1], *dy = backward ? params[1] : nullptr;
  if (f32)
    Pool<uint32_t>(static_cast<uint32_t *>(x), backward ? nullptr : static_cast<uint32_t *>(out),
                   static_cast<uint32_t *>(dy), backward ? static_cast<uint32_t *>(out) : nullptr, planes, s[2], s[3]);
  else
    Pool<uint16_t>(static_cast<uint16_t *>(x), backward ? nullptr : static_cast<uint16_t *>(out),
                   static_cast<uint16_t *>(dy), backward ? static_cast<uint16_t *>(out) : nullptr, planes, s[2], s[3]);
  return 0;
}

}  // namespace

extern "C" int MaxPool2x2Fwd(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return Run(n, params, ndims, shapes, dtypes, false);
}

extern "C" int MaxPool2x2Bwd(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return Run(n, params, ndims, shapes, dtypes, true);
}
