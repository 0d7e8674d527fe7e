// LayerNorm over the last axis (ampzoo/models/transformer.py's LayerNorm) as AOT custom ops (cpu_kernels/cells.py:
// layer_norm_op), for float32 or float16 activations and float32 or float16 gamma and beta, computing in float32
// whatever comes in (as O2's keep-list runs it), each output rounded once to its dtype. MindSpore's LayerNorm
// forward is one kernel, but its backward was written out of ReduceMean, Sub and Mul ops (about a fifth of a
// Transformer-Tiny step), and at O2 Casts ran on both sides of every LayerNorm.
//
// LayerNormFwd (x [..., D], gamma [D], beta [D] -> y, mean [rows], rstd [rows]): y = (x - mean) * rstd * gamma +
//   beta, rstd = 1 / sqrt(var + eps), var the biased variance of the row; eps is the last input, a (1,) tensor
// LayerNormBwd (x, gamma, mean, rstd, dy -> dx, dgamma, dbeta)
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "aot.h"
#include "runtime.h"

namespace {

bool IsHalf(const char *dtype) { return !std::strcmp(dtype, "float16"); }
bool Supported(const char *dtype) { return IsHalf(dtype) || !std::strcmp(dtype, "float32"); }

// Row r of a tensor as float32: the row itself, or converted into buf
const float *Row(const void *p, bool half, int64_t r, int64_t d, float *buf) {
  if (!half) return static_cast<const float *>(p) + r * d;
  AmpZooHalfToFloatHere(static_cast<const uint16_t *>(p) + r * d, buf, d);
  return buf;
}

void PutRow(const float *v, void *p, bool half, int64_t r, int64_t d) {
  if (half) {
    AmpZooFloatToHalfHere(v, static_cast<uint16_t *>(p) + r * d, d);
  } else {
    std::memcpy(static_cast<float *>(p) + r * d, v, d * sizeof(float));
  }
}

std::vector<float> Vector(const void *p, bool half, int64_t d) {
  std::vector<float> v(d);
  if (half) {
    AmpZooHalfToFloatHere(static_cast<const uint16_t *>(p), v.data(), d);
  } else {
    std::memcpy(v.data(), p, d * sizeof(float));
  }
  return v;
}

// fn(thread, first row, end row) over the rows, split over the pool's threads when there is enough work; returns
// how many threads took part
int ForRows(int64_t rows, int64_t d, const std::function<void(int, int64_t, int64_t)> &fn) {
  const int threads = rows * d >= (1 << 14) ? AmpZooThreads() : 1;
  if (threads == 1) {
    fn(0, 0, rows);
  } else {
    AmpZooParallel(threads, [&](int t, int k) { fn(t, rows * t / k, rows * (t + 1) / k); });
  }
  return threads;
}

int64_t Rows(int ndim, const int64_t *shape) {
  int64_t r = 1;
  for (int i = 0; i + 1 < ndim; ++i) r *= shape[i];
  return r;
}

// params: x, gamma, beta, eps, y, mean, rstd
int Forward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 7 || ndims[0] < 1 || ndims[1] != 1 || ndims[2] != 1) return 1;
  const int64_t d = shapes[0][ndims[0] - 1], rows = Rows(ndims[0], shapes[0]);
  if (shapes[1][0] != d || shapes[2][0] != d || std::strcmp(dtypes[1], dtypes[2]) || std::strcmp(dtypes[4], dtypes[0]))
    return 1;
  if (!Supported(dtypes[0]) || !Supported(dtypes[1]) || !Supported(dtypes[3]) || std::strcmp(dtypes[5], "float32") ||
      std::strcmp(dtypes[6], "float32"))
    return 1;
  const bool half = IsHalf(dtypes[0]);
  const float eps = Vector(params[3], IsHalf(dtypes[3]), 1)[0];  // PyNative's O2 may hand it over in float16
  const std::vector<float> gamma = Vector(params[1], IsHalf(dtypes[1]), d), beta = Vector(params[2], IsHalf(dtypes[2]), d);
  float *mean = static_cast<float *>(params[5]), *rstd = static_cast<float *>(params[6]);
  ForRows(rows, d, [&](int, int64_t a, int64_t b) {
    std::vector<float> in(d), out(d);
    for (int64_t r = a; r < b; ++r) {
      const float *x = Row(params[0], half, r, d, in.data());
      float sum = 0.0f;
      for (int64_t i = 0; i < d; ++i) sum += x[i];
      const float m = sum / d;
      float sq = 0.0f;
      for (int64_t i = 0; i < d; ++i) sq += (x[i] - m) * (x[i] - m);
      const float s = 1.0f / std::sqrt(sq / d + eps);
      for (int64_t i = 0; i < d; ++i) out[i] = (x[i] - m) * s * gamma[i] + beta[i];
      PutRow(out.data(), params[4], half, r, d);
      mean[r] = m;
      rstd[r] = s;
    }
  });
  return 0;
}

// params: x, gamma, mean, rstd, dy, dx, dgamma, dbeta
int Backward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 8 || ndims[0] < 1 || ndims[1] != 1) return 1;
  const int64_t d = shapes[0][ndims[0] - 1], rows = Rows(ndims[0], shapes[0]);
  if (shapes[1][0] != d || Rows(ndims[4], shapes[4]) != rows || shapes[4][ndims[4] - 1] != d) return 1;
  if (!Supported(dtypes[0]) || !Supported(dtypes[1]) || std::strcmp(dtypes[4], dtypes[0]) ||
      std::strcmp(dtypes[5], dtypes[0]) || std::strcmp(dtypes[6], dtypes[1]) || std::strcmp(dtypes[7], dtypes[1]) ||
      !Supported(dtypes[2]) || !Supported(dtypes[3]))
    return 1;
  const bool half = IsHalf(dtypes[0]);
  const std::vector<float> gamma = Vector(params[1], IsHalf(dtypes[1]), d);
  const std::vector<float> mean_v = Vector(params[2], IsHalf(dtypes[2]), rows), rstd_v = Vector(params[3], IsHalf(dtypes[3]), rows);
  const float *mean = mean_v.data(), *rstd = rstd_v.data();
  const int most = AmpZooThreads();
  std::vector<float> dgamma_parts(static_cast<size_t>(most) * d, 0.0f), dbeta_parts(static_cast<size_t>(most) * d, 0.0f);
  const int used = ForRows(rows, d, [&](int t, int64_t a, int64_t b) {
    std::vector<float> xin(d), gin(d), xhat(d), dxhat(d), out(d);
    float *dg = dgamma_parts.data() + t * d, *db = dbeta_parts.data() + t * d;
    for (int64_t r = a; r < b; ++r) {
      const float *x = Row(params[0], half, r, d, xin.data());
      const float *g = Row(params[4], half, r, d, gin.data());
      const float m = mean[r], s = rstd[r];
      float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
      for (int64_t i = 0; i < d; ++i) {
        xhat[i] = (x[i] - m) * s;
        dxhat[i] = g[i] * gamma[i];
        sum_dxhat += dxhat[i];
        sum_dxhat_xhat += dxhat[i] * xhat[i];
        dg[i] += g[i] * xhat[i];
        db[i] += g[i];
      }
      const float mean_dxhat = sum_dxhat / d, mean_dxhat_xhat = sum_dxhat_xhat / d;
      for (int64_t i = 0; i < d; ++i) out[i] = s * (dxhat[i] - mean_dxhat - xhat[i] * mean_dxhat_xhat);
      PutRow(out.data(), params[5], half, r, d);
    }
  });
  std::vector<float> dgamma(d, 0.0f), dbeta(d, 0.0f);
  for (int t = 0; t < used; ++t)
    for (int64_t i = 0; i < d; ++i) {
      dgamma[i] += dgamma_parts[t * d + i];
      dbeta[i] += dbeta_parts[t * d + i];
    }
  PutRow(dgamma.data(), params[6], IsHalf(dtypes[6]), 0, d);
  PutRow(dbeta.data(), params[7], IsHalf(dtypes[7]), 0, d);
  return 0;
}

}  // namespace

// Return codes (MindSpore reports them): 1 a count, shape or dtype these ops do not take
AMP_ZOO_AOT(LayerNormFwd, Forward(AOT_PASS))
AMP_ZOO_AOT(LayerNormBwd, Backward(AOT_PASS))
