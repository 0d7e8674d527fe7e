// A Transformer's token embedding, as AOT custom ops (cpu_kernels/cells.py: embed_op; ampzoo.models.transformer).
//
// EmbedFwd (table, ids, positions, scale -> y): y[b, t] = table[ids[b, t]] * scale + positions[t], a Transformer's
// token embedding scaled and added to its positions (ampzoo.models.transformer.TokenEmbedding), the table float32 as
// stored, the positions float32 (or float16, where a precision flag cast them), y float32 or float16. In
// float16 each value is rounded where MindSpore's float16 ops round it (the row, the scale, their product, the
// position, the sum), so y is O2's embedding bit for bit, without
// its Cast of the whole table, its float16 Mul and Add and their gradients (several times slower than float32).
// EmbedBwd (dy, ids, scale, table -> dtable): dtable[v] = the sum over the positions holding token v of
// dy * scale (rounded to float16 with float16 dy, as the Mul's gradient is), summed in float32 in the positions'
// order; table only gives the shape.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "aot.h"
#include "runtime.h"

namespace {

constexpr int64_t kChunk = 2048;

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
  if (n * d < (1 << 15)) {  // too little to pay for waking the pool's threads
    run(0, n);
  } else {
    AmpZooParallel(AmpZooThreads(), [&](int t, int k) { run(n * t / k, n * (t + 1) / k); });
  }
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
// Two names for the forward, one a dtype, each with its own gradient (conv.cc's CONV_OPS says why)
AMP_ZOO_AOT(EmbedFwd, EmbedForward(AOT_PASS))
AMP_ZOO_AOT(EmbedFwdHalf, EmbedForward(AOT_PASS))
AMP_ZOO_AOT(EmbedBwd, EmbedBackward(AOT_PASS))
