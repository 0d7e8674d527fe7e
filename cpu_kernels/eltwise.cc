// The element-wise ops between ResNet's convolutions, as AOT custom ops (cpu_kernels/cells.py: CpuReLU,
// CpuAddReLU, CpuAdd, CpuDropout), in float32 or float16. MindSpore's CPU kernels for ReLU, ReluGrad and Add run several times slower
// in float16 than in float32 (docs/benchmarks.md), which made O2's ResNet step slower than O0's. These are one
// pass over memory each, in either dtype: float16 is converted a chunk at a time, computed in float32 and
// rounded back, so they read and write half the bytes of float32.
//
// ReluFwd (x -> y): max(x, 0), NaN kept (an overflow must reach the loss scale's check).
// ReluBwd (y, dy -> dx): dy where y > 0, else 0.
// AddReluFwd (a, b -> y): max(a + b, 0), the sum rounded once; AddReluBwd (y, dy -> dx): as ReluBwd, the gradient
// of both a and b.
// AddFwd (a, b -> y): a + b, rounded once (a Transformer's residual sum; its gradient is dy to both, no kernel).
// MaskMulFwd (x, m -> y): x * m with m float32 whatever x's dtype (dropout: m is 0 or 1/keep, drawn in float32
// by MindSpore's Dropout; MindSpore's float16 Dropout and DropoutGrad run many times slower than in float32).
// UnscaleSum (g, scale -> g * (1 / scale), the sum of that): the loss-scale step's unscale and its overflow check
// in one pass over a float32 gradient, where MindSpore runs a Mul and a ReduceSum (the sum is inf or NaN when any
// element is: the step tests it with isfinite, as amp.loss_scale.finite_sum does).
#include <cstdint>
#include <cstring>
#include <functional>

void AmpZooParallel(int n, const std::function<void(int, int)> &fn);  // conv.cc
int AmpZooThreads();
void AmpZooHalfToFloatHere(const uint16_t *s, float *d, int64_t n);
void AmpZooFloatToHalfHere(const float *s, uint16_t *d, int64_t n);

namespace {

constexpr int64_t kChunk = 2048;

// f(inputs as float, output as float, count) over [0, n) in chunks, on the pool's threads: float32 tensors are
// handed over as they are, float16 ones converted into and out of per-thread chunks
template <int In, typename F>
void Map(void **params, int64_t n, bool half, F f) {
  const int threads = n >= (1 << 15) ? AmpZooThreads() : 1;
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
  if (threads == 1) return run(0, n);
  AmpZooParallel(threads, [&](int t, int k) { run(n * t / k, n * (t + 1) / k); });
}

// 1 float32, 2 float16, 0 anything else; every tensor of the op alike
int Kind(int nparam, const char **dtypes) {
  const int kind = !std::strcmp(dtypes[0], "float32") ? 1 : !std::strcmp(dtypes[0], "float16") ? 2 : 0;
  for (int i = 1; i < nparam; ++i)
    if (std::strcmp(dtypes[i], dtypes[0])) return 0;
  return kind;
}

int64_t Count(int *ndims, int64_t **shapes) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  return n;
}

int Relu(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const int kind = Kind(nparam, dtypes);
  if (nparam != 2 || !kind) return 1;
  Map<1>(params, Count(ndims, shapes), kind == 2, [](const float **in, float *out, int64_t m) {
    const float *x = in[0];
    for (int64_t i = 0; i < m; ++i) out[i] = !(x[i] <= 0.0f) ? x[i] : 0.0f;  // NaN kept
  });
  return 0;
}

int ReluGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const int kind = Kind(nparam, dtypes);
  if (nparam != 3 || !kind) return 1;
  Map<2>(params, Count(ndims, shapes), kind == 2, [](const float **in, float *out, int64_t m) {
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
  Map<2>(params, Count(ndims, shapes), kind == 2, [](const float **in, float *out, int64_t m) {
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
  Map<2>(params, Count(ndims, shapes), kind == 2, [](const float **in, float *out, int64_t m) {
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
  const int64_t n = Count(ndims, shapes);
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
  const int threads = n >= (1 << 15) ? AmpZooThreads() : 1;
  if (threads == 1) {
    run(0, n);
  } else {
    AmpZooParallel(threads, [&](int t, int k) { run(n * t / k, n * (t + 1) / k); });
  }
  return 0;
}

int UnscaleSum(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 4) return 1;
  for (int i = 0; i < nparam; ++i)
    if (std::strcmp(dtypes[i], "float32")) return 1;
  const int64_t n = Count(ndims, shapes);
  const float *g = static_cast<const float *>(params[0]);
  const float inv = 1.0f / static_cast<const float *>(params[1])[0];  // as MindSpore's Reciprocal, then Mul
  float *out = static_cast<float *>(params[2]);
  const int threads = n >= (1 << 16) ? AmpZooThreads() : 1;
  double parts[64] = {};
  auto run = [&](int t, int k) {
    const int64_t a = n * t / k, b = n * (t + 1) / k;
    float acc[16] = {};
    int64_t i = a;
    for (; i + 16 <= b; i += 16)
      for (int l = 0; l < 16; ++l) {
        out[i + l] = g[i + l] * inv;
        acc[l] += out[i + l];
      }
    double sum = 0;
    for (; i < b; ++i) {
      out[i] = g[i] * inv;
      sum += out[i];
    }
    for (int l = 0; l < 16; ++l) sum += acc[l];
    parts[t] = sum;
  };
  if (threads == 1) {
    run(0, 1);
  } else {
    AmpZooParallel(threads < 64 ? threads : 64, run);
  }
  double total = 0;
  for (int t = 0; t < 64; ++t) total += parts[t];
  static_cast<float *>(params[3])[0] = static_cast<float>(total);
  return 0;
}

}  // namespace

// Return codes (MindSpore reports them): 1 a count, shape or dtype these ops do not take
extern "C" int ReluFwd(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return Relu(n, params, ndims, shapes, dtypes);
}
extern "C" int ReluBwd(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return ReluGrad(n, params, ndims, shapes, dtypes);
}
extern "C" int AddReluFwd(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return AddRelu(n, params, ndims, shapes, dtypes);
}
extern "C" int AddReluBwd(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return ReluGrad(n, params, ndims, shapes, dtypes);
}
extern "C" int AddFwd(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return Add(n, params, ndims, shapes, dtypes);
}
extern "C" int MaskMulFwd(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                          void *) {
  return MaskMul(n, params, ndims, shapes, dtypes);
}
extern "C" int UnscaleSumOp(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                            void *) {
  return UnscaleSum(n, params, ndims, shapes, dtypes);
}
