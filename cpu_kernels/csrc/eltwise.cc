// The element-wise ops between ResNet's convolutions, as AOT custom ops (cpu_kernels/cells.py: CpuReLU,
// CpuAddReLU, CpuAdd, CpuDropout), in float32 or float16. MindSpore's CPU kernels for ReLU, ReluGrad and Add run
// several times slower in float16 than in float32 (docs/benchmarks.md), which made O2's ResNet step slower than O0's. These are one
// pass over memory each, in either dtype: float16 is converted a chunk at a time, computed in float32 and
// rounded back, so they read and write half the bytes of float32.
//
// ReluFwd (x -> y): max(x, 0), NaN kept (an overflow must reach the loss scale's check).
// ReluBwd (y, dy -> dx): dy where y > 0, else 0. In float16 both select on the bits, with no conversion.
// AddReluFwd (a, b -> y): max(a + b, 0), the sum rounded once; AddReluBwd (y, dy -> dx): as ReluBwd, the gradient
// of both a and b.
// AddFwd (a, b -> y): a + b, rounded once (a Transformer's residual sum; its gradient is dy to both, no kernel).
// MaskMulFwd (x, m -> y): x * m with m float32 whatever x's dtype (dropout: m is 0 or 1/keep, drawn in float32
// by MindSpore's Dropout; MindSpore's float16 Dropout and DropoutGrad run many times slower than in float32).
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "aot.h"
#include "runtime.h"

namespace {

constexpr int64_t kChunk = 2048;

// f(begin, end) over [0, n): in one piece per pool thread when `many` (enough work to pay for waking them), else
// on this thread
template <typename F>
void Pieces(int64_t n, bool many, F f) {
  const int threads = many ? AmpZooThreads() : 1;
  if (threads == 1) return f(0, n);
  AmpZooParallel(threads, [&](int t, int k) { f(n * t / k, n * (t + 1) / k); });
}

// f(inputs as float, output as float, count) over [0, n) in chunks, on the pool's threads: float32 tensors are
// handed over as they are, float16 ones converted into and out of per-thread chunks
template <int In, typename F>
void Map(void **params, int64_t n, bool half, F f) {
  auto run = [&](int64_t a, int64_t b) {
    if (!half) {
      const float *in[In];
      for (int k = 0; k < In; ++k) in[k] = static_cast<const float *>(params[k]) + a;
      f(in, static_cast<float *>(params[In]) + a, b - a);
      return;
    }
    float buffers[In + 1][kChunk];
    for (int64_t c = a; c < b; c += kChunk) {
      const int64_t m = c + kChunk < b ? kChunk : b - c;
      const float *in[In];
      for (int k = 0; k < In; ++k) {
        AmpZooHalfToFloatHere(static_cast<const uint16_t *>(params[k]) + c, buffers[k], m);
        in[k] = buffers[k];
      }
      f(in, buffers[In], m);
      AmpZooFloatToHalfHere(buffers[In], static_cast<uint16_t *>(params[In]) + c, m);
    }
  };
  Pieces(n, n >= (1 << 15), run);
}

// 1 float32, 2 float16, 0 anything else; every tensor of the op alike
int Kind(int nparam, const char **dtypes) {
  const int kind = !std::strcmp(dtypes[0], "float32") ? 1 : !std::strcmp(dtypes[0], "float16") ? 2 : 0;
  for (int i = 1; i < nparam; ++i)
    if (std::strcmp(dtypes[i], dtypes[0])) return 0;
  return kind;
}


// float16 ReLU on the bits: a value is kept or zeroed, never computed, so no conversion is needed. Negative
// (sign set) and not NaN (magnitude past inf's 0x7c00) -> +0, as the float32 loop does; y > 0: sign clear, not
// zero and not NaN. g++ vectorizes both loops at -O3.
bool HalfZeroed(uint16_t h) { return (h & 0x8000u) && (h & 0x7fffu) <= 0x7c00u; }
bool HalfPositive(uint16_t h) { return h != 0 && h <= 0x7c00u; }

int Relu(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const int kind = Kind(nparam, dtypes);
  if (nparam != 2 || !kind) return 1;
  const int64_t n = AotCount(ndims, shapes);
  if (kind == 2) {
    const auto *x = static_cast<const uint16_t *>(params[0]);
    auto *y = static_cast<uint16_t *>(params[1]);
    Pieces(n, n >= (1 << 15), [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) y[i] = HalfZeroed(x[i]) ? 0 : x[i];
    });
    return 0;
  }
  Map<1>(params, n, false, [](const float **in, float *out, int64_t m) {
    const float *x = in[0];
    for (int64_t i = 0; i < m; ++i) out[i] = !(x[i] <= 0.0f) ? x[i] : 0.0f;  // NaN kept
  });
  return 0;
}

int ReluGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const int kind = Kind(nparam, dtypes);
  if (nparam != 3 || !kind) return 1;
  const int64_t n = AotCount(ndims, shapes);
  if (kind == 2) {
    const auto *y = static_cast<const uint16_t *>(params[0]), *dy = static_cast<const uint16_t *>(params[1]);
    auto *dx = static_cast<uint16_t *>(params[2]);
    Pieces(n, n >= (1 << 15), [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        const uint16_t g = dy[i];  // loaded either way: a select the compiler vectorizes, not a branch a value
        dx[i] = HalfPositive(y[i]) ? g : 0;
      }
    });
    return 0;
  }
  Map<2>(params, n, false, [](const float **in, float *out, int64_t m) {
    const float *y = in[0], *dy = in[1];
    for (int64_t i = 0; i < m; ++i) {
      const float g = dy[i];  // loaded either way, so the loop is a select the compiler vectorizes
      out[i] = y[i] > 0.0f ? g : 0.0f;
    }
  });
  return 0;
}

// Whether the first two tensors have one shape (the binary ops take no broadcasting)
bool SameShape(int *ndims, int64_t **shapes) {
  if (ndims[0] != ndims[1]) return false;
  for (int i = 0; i < ndims[0]; ++i)
    if (shapes[0][i] != shapes[1][i]) return false;
  return true;
}

int AddRelu(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const int kind = Kind(nparam, dtypes);
  if (nparam != 3 || !kind || !SameShape(ndims, shapes)) return 1;
  Map<2>(params, AotCount(ndims, shapes), kind == 2, [](const float **in, float *out, int64_t m) {
    const float *a = in[0], *b = in[1];
    for (int64_t i = 0; i < m; ++i) {
      const float v = a[i] + b[i];
      out[i] = !(v <= 0.0f) ? v : 0.0f;
    }
  });
  return 0;
}

int Add(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const int kind = Kind(nparam, dtypes);
  if (nparam != 3 || !kind || !SameShape(ndims, shapes)) return 1;
  Map<2>(params, AotCount(ndims, shapes), kind == 2, [](const float **in, float *out, int64_t m) {
    const float *a = in[0], *b = in[1];
    for (int64_t i = 0; i < m; ++i) out[i] = a[i] + b[i];
  });
  return 0;
}

int MaskMul(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 3 || !SameShape(ndims, shapes) || std::strcmp(dtypes[1], "float32") ||
      std::strcmp(dtypes[2], dtypes[0]))
    return 1;
  const bool half = !std::strcmp(dtypes[0], "float16");
  if (!half && std::strcmp(dtypes[0], "float32")) return 1;
  const int64_t n = AotCount(ndims, shapes);
  const float *m = static_cast<const float *>(params[1]);
  auto run = [&](int64_t a, int64_t b) {
    if (!half) {
      const float *x = static_cast<const float *>(params[0]);
      float *y = static_cast<float *>(params[2]);
      for (int64_t i = a; i < b; ++i) y[i] = x[i] * m[i];
      return;
    }
    float buffer[kChunk];
    for (int64_t c = a; c < b; c += kChunk) {
      const int64_t len = c + kChunk < b ? kChunk : b - c;
      AmpZooHalfToFloatHere(static_cast<const uint16_t *>(params[0]) + c, buffer, len);
      for (int64_t i = 0; i < len; ++i) buffer[i] *= m[c + i];
      AmpZooFloatToHalfHere(buffer, static_cast<uint16_t *>(params[2]) + c, len);
    }
  };
  Pieces(n, n >= (1 << 15), run);
  return 0;
}

}  // namespace

// Return codes (MindSpore reports them): 1 a count, shape or dtype these ops do not take
AMP_ZOO_AOT(ReluFwd, Relu(AOT_PASS))
AMP_ZOO_AOT(ReluBwd, ReluGrad(AOT_PASS))
AMP_ZOO_AOT(AddReluFwd, AddRelu(AOT_PASS))
AMP_ZOO_AOT(AddReluBwd, ReluGrad(AOT_PASS))
AMP_ZOO_AOT(AddFwd, Add(AOT_PASS))
AMP_ZOO_AOT(MaskMulFwd, MaskMul(AOT_PASS))
