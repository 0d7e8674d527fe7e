// The element-wise ops between ResNet's convolutions, as AOT custom ops (cpu_kernels/cells.py: CpuReLU,
// CpuAddReLU, CpuAdd, CpuDropout), in float32 or float16. MindSpore's CPU kernels for ReLU, ReluGrad and Add run several times slower
// in float16 than in float32 (docs/benchmarks.md), which made O2's ResNet step slower than O0's. These are one
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
// UnscaleSum (g, scale -> g * (1 / scale), the sum of that): the loss-scale step's unscale and its overflow check
// in one pass over a float32 gradient, where MindSpore runs a Mul and a ReduceSum (the sum is inf or NaN when any
// element is: the step tests it with isfinite, as amp.loss_scale.finite_sum does).
// UnscaledSum (g, scale -> the sum of g * (1 / scale)): the same sum, reading g only, where the optimizer unscales
// the gradient itself as it updates (optim.cc's MomentumUpdate), so no unscaled copy is written.
// EmbedFwd (table, ids, positions, scale -> y): y[b, t] = table[ids[b, t]] * scale + positions[t], a Transformer's
// token embedding scaled and added to its positions (models.transformer.TokenEmbedding), the table float32 as
// stored, the positions float32 (or float16, where a precision flag cast them), y float32 or float16. In float16 each value is rounded where MindSpore's float16 ops round
// it (the row, the scale, their product, the position, the sum), so y is O2's embedding bit for bit, without
// its Cast of the whole table, its float16 Mul and Add and their gradients (several times slower than float32).
// EmbedBwd (dy, ids, scale, table -> dtable): dtable[v] = the sum over the positions holding token v of
// dy * scale (rounded to float16 with float16 dy, as the Mul's gradient is), summed in float32 in the positions'
// order; table only gives the shape.
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

void AmpZooParallel(int n, const std::function<void(int, int)> &fn);  // conv.cc
int AmpZooThreads();
void AmpZooHalfToFloatHere(const uint16_t *s, float *d, int64_t n);
void AmpZooFloatToHalfHere(const float *s, uint16_t *d, int64_t n);
void AmpZooRoundThroughHalf(const float *s, float *d, int64_t n);  // conv.cc: to the nearest fp16 values
float AmpZooScale(const char *dtype, int ndim, const int64_t *shape, const void *p);  // softmax.cc

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

int64_t Count(int *ndims, int64_t **shapes) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  return n;
}

// float16 ReLU on the bits: a value is kept or zeroed, never computed, so no conversion is needed. Negative
// (sign set) and not NaN (magnitude past inf's 0x7c00) -> +0, as the float32 loop does; y > 0: sign clear, not
// zero and not NaN. g++ vectorizes both loops at -O3.
bool HalfZeroed(uint16_t h) { return (h & 0x8000u) && (h & 0x7fffu) <= 0x7c00u; }
bool HalfPositive(uint16_t h) { return h != 0 && h <= 0x7c00u; }

int Relu(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const int kind = Kind(nparam, dtypes);
  if (nparam != 2 || !kind) return 1;
  const int64_t n = Count(ndims, shapes);
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
  const int64_t n = Count(ndims, shapes);
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
  Pieces(n, n >= (1 << 15), run);
  return 0;
}

// g * (1 / scale) into out (unless Write is false), and the sum of it: UnscaleSum (nparam 4) and UnscaledSum (3)
template <bool Write>
int UnscaleSum(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != (Write ? 4 : 3)) return 1;
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
        const float v = g[i + l] * inv;
        if (Write) out[i + l] = v;
        acc[l] += v;
      }
    double sum = 0;
    for (; i < b; ++i) {
      const float v = g[i] * inv;
      if (Write) out[i] = v;
      sum += v;
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
  static_cast<float *>(params[nparam - 1])[0] = static_cast<float>(total);
  return 0;
}

// ids int32 (..., T) with table (V, d) and positions (T, d); the count of ids, else 0
int64_t EmbedShapes(int *ndims, int64_t **shapes, const char **dtypes, int64_t ids_at, int64_t table_at) {
  if (std::strcmp(dtypes[ids_at], "int32") || ndims[table_at] != 2 || ndims[ids_at] < 1) return 0;
  int64_t n = 1;
  for (int i = 0; i < ndims[ids_at]; ++i) n *= shapes[ids_at][i];
  return n;
}

int EmbedForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  // float16 table or positions: a precision flag's Cast (PyNative casts a Cell's tensors; graph mode the positions)
  const bool table_half = !std::strcmp(dtypes[0], "float16"), pos_half = !std::strcmp(dtypes[2], "float16");
  if (nparam != 5 || (!table_half && std::strcmp(dtypes[0], "float32")) ||
      (!pos_half && std::strcmp(dtypes[2], "float32")))
    return 1;
  const int64_t n = EmbedShapes(ndims, shapes, dtypes, 1, 0), vocab = shapes[0][0], d = shapes[0][1];
  const int64_t t = ndims[1] >= 1 ? shapes[1][ndims[1] - 1] : 0;
  if (!n || ndims[2] != 2 || shapes[2][0] != t || shapes[2][1] != d) return 1;
  const bool half = !std::strcmp(dtypes[4], "float16");
  if (!half && std::strcmp(dtypes[4], "float32")) return 1;
  const float scale = AmpZooScale(dtypes[3], ndims[3], shapes[3], params[3]);
  if (scale != scale) return 1;
  float s = scale;  // the scale as the float16 Mul sees it
  if (half) AmpZooRoundThroughHalf(&s, &s, 1);
  const int32_t *ids = static_cast<const int32_t *>(params[1]);
  auto run = [&](int64_t a, int64_t b) {
    float row[kChunk], p[kChunk];
    for (int64_t r = a; r < b; ++r) {
      const int32_t id = ids[r];
      for (int64_t c = 0; c < d; c += kChunk) {
        const int64_t m = c + kChunk < d ? kChunk : d - c;
        float *out32 = half ? row : static_cast<float *>(params[4]) + r * d + c;
        if (id < 0 || id >= vocab) {  // as MindSpore's Gather: zeros for an id outside the table
          std::memset(row, 0, m * sizeof(float));
        } else if (table_half) {
          AmpZooHalfToFloatHere(static_cast<const uint16_t *>(params[0]) + id * d + c, row, m);
        } else {
          std::memcpy(row, static_cast<const float *>(params[0]) + id * d + c, m * sizeof(float));
        }
        if (pos_half)
          AmpZooHalfToFloatHere(static_cast<const uint16_t *>(params[2]) + (r % t) * d + c, p, m);
        else
          std::memcpy(p, static_cast<const float *>(params[2]) + (r % t) * d + c, m * sizeof(float));
        if (half) {  // each operand and each result an fp16 value, as O2's Cast, Mul and Add give them
          AmpZooRoundThroughHalf(row, row, m);
          for (int64_t i = 0; i < m; ++i) row[i] *= s;
          AmpZooRoundThroughHalf(row, row, m);
          AmpZooRoundThroughHalf(p, p, m);
          for (int64_t i = 0; i < m; ++i) row[i] += p[i];
          AmpZooFloatToHalfHere(row, static_cast<uint16_t *>(params[4]) + r * d + c, m);
        } else {
          for (int64_t i = 0; i < m; ++i) out32[i] = row[i] * s;  // then the Add: two roundings, as two ops
          for (int64_t i = 0; i < m; ++i) out32[i] += p[i];
        }
      }
    }
  };
  Pieces(n, n * d >= (1 << 15), run);
  return 0;
}

int EmbedBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const bool out_half = !std::strcmp(dtypes[4], "float16");  // the table's dtype (fp16 where PyNative cast it)
  if (nparam != 5 || std::strcmp(dtypes[3], dtypes[4]) || (!out_half && std::strcmp(dtypes[4], "float32")))
    return 1;
  const int64_t n = EmbedShapes(ndims, shapes, dtypes, 1, 3), vocab = shapes[3][0], d = shapes[3][1];
  const bool half = !std::strcmp(dtypes[0], "float16");
  if (!n || (!half && std::strcmp(dtypes[0], "float32"))) return 1;
  const float scale = AmpZooScale(dtypes[2], ndims[2], shapes[2], params[2]);
  if (scale != scale) return 1;
  const int32_t *ids = static_cast<const int32_t *>(params[1]);
  std::vector<float> sums(out_half ? vocab * d : 0);  // summed in float32 either way
  float *dtable = out_half ? sums.data() : static_cast<float *>(params[4]);
  float s = scale;  // as the float16 Mul's gradient sees it
  if (half) AmpZooRoundThroughHalf(&s, &s, 1);
  // each thread its own columns of every row, through the positions in order: the same sums whatever the threads
  auto run = [&](int64_t c0, int64_t c1) {
    for (int64_t v = 0; v < vocab; ++v) std::memset(dtable + v * d + c0, 0, (c1 - c0) * sizeof(float));
    float g[kChunk];
    for (int64_t r = 0; r < n; ++r) {
      const int32_t id = ids[r];
      if (id < 0 || id >= vocab) continue;
      for (int64_t c = c0; c < c1; c += kChunk) {
        const int64_t m = c + kChunk < c1 ? kChunk : c1 - c;
        if (half) {
          AmpZooHalfToFloatHere(static_cast<const uint16_t *>(params[0]) + r * d + c, g, m);
          for (int64_t i = 0; i < m; ++i) g[i] *= s;
          AmpZooRoundThroughHalf(g, g, m);
        } else {
          const float *dy = static_cast<const float *>(params[0]) + r * d + c;
          for (int64_t i = 0; i < m; ++i) g[i] = dy[i] * s;
        }
        float *to = dtable + id * d + c;
        for (int64_t i = 0; i < m; ++i) to[i] += g[i];
      }
    }
  };
  const int threads = n * d >= (1 << 15) && d >= 32 ? AmpZooThreads() : 1;
  if (threads == 1) {
    run(0, d);
  } else {  // columns in blocks of 16 (a cache line of float32) per thread
    AmpZooParallel(threads, [&](int k, int of) {
      run(d / 16 * k / of * 16, k + 1 == of ? d : d / 16 * (k + 1) / of * 16);
    });
  }
  if (out_half) AmpZooFloatToHalfHere(dtable, static_cast<uint16_t *>(params[4]), vocab * d);
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
  return UnscaleSum<true>(n, params, ndims, shapes, dtypes);
}
extern "C" int UnscaledSumOp(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                             void *) {
  return UnscaleSum<false>(n, params, ndims, shapes, dtypes);
}
// Two names for the forward, one a dtype, each with its own gradient (conv.cc's CONV_FWD says why)
extern "C" int EmbedFwd(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return EmbedForward(n, params, ndims, shapes, dtypes);
}
extern "C" int EmbedFwdHalf(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return EmbedForward(n, params, ndims, shapes, dtypes);
}
extern "C" int EmbedBwd(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return EmbedBackward(n, params, ndims, shapes, dtypes);
}
