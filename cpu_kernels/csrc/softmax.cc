// Softmax over the last axis (the attention's, ampzoo/models/transformer.py) as AOT custom ops (cpu_kernels/cells.py:
// CpuSoftmax), for float32 or float16, computing in float32 whatever comes in (as O2's keep-list runs it) and
// rounding each output once. At O2 MindSpore ran Casts on both sides of the fp32 Softmax and of its gradient.
//
// SoftmaxFwd (x [..., D] -> y): exp(x - max) / sum over each row; a NaN or inf in a row makes the row NaN, as
//   MindSpore's does (the loss scale's overflow check must see it)
// SoftmaxBwd (y, dy -> dx): y * (dy - sum(dy * y)) over each row
// ScaledSoftmaxFwd (x, bias, scale -> y): softmax(x * scale + bias), the attention's probabilities in one pass;
//   bias fp32 or x's dtype, broadcast to x as numpy does (the padding mask (B, 1, 1, S), the causal (T, T)),
//   scale an fp32 (1,). At O2 MindSpore ran the scaling and the mask's addition as fp16 Mul and Add, and their
//   gradients as another Mul, all several times slower than in fp32
// ScaledSoftmaxBwd (y, dy, scale -> dx): scale * y * (dy - sum(dy * y))
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "aot.h"
#include "runtime.h"

namespace {

// 1 float32, 2 float16, 0 anything else; the first nparam tensors alike, all of one shape
int Kind(int nparam, int *ndims, int64_t **shapes, const char **dtypes) {
  const int kind = !std::strcmp(dtypes[0], "float32") ? 1 : !std::strcmp(dtypes[0], "float16") ? 2 : 0;
  if (ndims[0] < 1) return 0;
  for (int i = 1; i < nparam; ++i) {
    if (std::strcmp(dtypes[i], dtypes[0]) || ndims[i] != ndims[0]) return 0;
    for (int k = 0; k < ndims[0]; ++k)
      if (shapes[i][k] != shapes[0][k]) return 0;
  }
  return kind;
}

// fn(row index, inputs as float32, output as float32, d) for each row of d values, on the pool's threads when
// there is enough work; float16 rows are converted in and out of per-thread buffers
template <int In, typename F>
void ForRows(void **params, int *ndims, int64_t **shapes, bool half, F fn) {
  const int64_t d = shapes[0][ndims[0] - 1];
  int64_t rows = 1;
  for (int i = 0; i + 1 < ndims[0]; ++i) rows *= shapes[0][i];
  auto run = [&](int64_t a, int64_t b) {
    std::vector<float> buf(half ? (In + 1) * d : 0);
    for (int64_t r = a; r < b; ++r) {
      const float *in[In];
      float *out;
      for (int k = 0; k < In; ++k) {
        if (half) {
          AmpZooHalfToFloatHere(static_cast<const uint16_t *>(params[k]) + r * d, buf.data() + k * d, d);
          in[k] = buf.data() + k * d;
        } else {
          in[k] = static_cast<const float *>(params[k]) + r * d;
        }
      }
      out = half ? buf.data() + In * d : static_cast<float *>(params[In]) + r * d;
      fn(r, in, out, d);
      if (half) AmpZooFloatToHalfHere(out, static_cast<uint16_t *>(params[In]) + r * d, d);
    }
  };
  const int threads = rows * d >= (1 << 14) ? AmpZooThreads() : 1;
  if (threads == 1) return run(0, rows);
  AmpZooParallel(threads, [&](int t, int k) { run(rows * t / k, rows * (t + 1) / k); });
}

// y = softmax(x) over d values (y may be x); a NaN is kept as the maximum, so its row comes out NaN
void SoftmaxRow(const float *x, float *y, int64_t d) {
  float m = x[0];
  for (int64_t i = 1; i < d; ++i)
    if (x[i] > m || x[i] != x[i]) m = x[i];
  float sum = 0.0f;
  for (int64_t i = 0; i < d; ++i) sum += (y[i] = std::exp(x[i] - m));
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < d; ++i) y[i] *= inv;
}

// dx = scale * y * (dy - sum(dy * y)) over d values: softmax's gradient, of scores scaled by `scale`
void SoftmaxGradRow(const float *y, const float *dy, float *dx, int64_t d, float scale) {
  float dot = 0.0f;
  for (int64_t i = 0; i < d; ++i) dot += dy[i] * y[i];
  for (int64_t i = 0; i < d; ++i) dx[i] = scale * y[i] * (dy[i] - dot);
}

int Forward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const int kind = nparam == 2 ? Kind(nparam, ndims, shapes, dtypes) : 0;
  if (!kind) return 1;
  ForRows<1>(params, ndims, shapes, kind == 2,
             [](int64_t, const float **in, float *y, int64_t d) { SoftmaxRow(in[0], y, d); });
  return 0;
}

int Backward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const int kind = nparam == 3 ? Kind(nparam, ndims, shapes, dtypes) : 0;
  if (!kind) return 1;
  ForRows<2>(params, ndims, shapes, kind == 2,
             [](int64_t, const float **in, float *dx, int64_t d) { SoftmaxGradRow(in[0], in[1], dx, d, 1.0f); });
  return 0;
}

// The row-major offset into a bias broadcast to x [..., d] of each of x's rows, numpy's rules (a bias axis of 1,
// or missing on the left, repeats), and the bias's own step along the last axis (1, or 0 when it is 1 wide);
// false when the shapes do not broadcast
bool BiasRows(int xr, const int64_t *xs, int br, const int64_t *bs, std::vector<int64_t> *rows, int64_t *last) {
  if (br < 1 || br > xr) return false;
  std::vector<int64_t> stride(xr, 0);
  int64_t step = 1;
  for (int i = br - 1; i >= 0; --i) {
    const int xi = xr - br + i;
    if (bs[i] != 1 && bs[i] != xs[xi]) return false;
    stride[xi] = bs[i] == 1 ? 0 : step;
    step *= bs[i];
  }
  *last = stride[xr - 1];
  int64_t n = 1;
  for (int i = 0; i + 1 < xr; ++i) n *= xs[i];
  rows->resize(n);
  for (int64_t r = 0; r < n; ++r) {
    int64_t rest = r, at = 0;
    for (int i = xr - 2; i >= 0; --i) {
      at += rest % xs[i] * stride[i];
      rest /= xs[i];
    }
    (*rows)[r] = at;
  }
  return true;
}

// params: x, bias, scale, y
int ScaledForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 4) return 1;
  int nd[2] = {ndims[0], ndims[3]};
  int64_t *sh[2] = {shapes[0], shapes[3]};
  const char *ty[2] = {dtypes[0], dtypes[3]};
  const int kind = Kind(2, nd, sh, ty);
  const float scale = AmpZooScale(dtypes[2], ndims[2], shapes[2], params[2]);
  const bool bias_half = !std::strcmp(dtypes[1], "float16");
  std::vector<int64_t> rows;
  int64_t last = 0;
  if (!kind || scale != scale || (!bias_half && std::strcmp(dtypes[1], "float32")) ||
      !BiasRows(ndims[0], shapes[0], ndims[1], shapes[1], &rows, &last))
    return 1;
  std::vector<float> bias32;  // an fp16 bias (small: a mask) converted once
  const float *bias = static_cast<const float *>(params[1]);
  if (bias_half) {
    int64_t n = 1;
    for (int i = 0; i < ndims[1]; ++i) n *= shapes[1][i];
    bias32.resize(n);
    AmpZooHalfToFloatHere(static_cast<const uint16_t *>(params[1]), bias32.data(), n);
    bias = bias32.data();
  }
  void *io[2] = {params[0], params[3]};
  ForRows<1>(io, nd, sh, kind == 2, [&](int64_t r, const float **in, float *y, int64_t d) {
    const float *x = in[0], *b = bias + rows[r];
    for (int64_t i = 0; i < d; ++i) y[i] = x[i] * scale + b[i * last];
    SoftmaxRow(y, y, d);
  });
  return 0;
}

// params: y, dy, scale, dx
int ScaledBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 4) return 1;
  int nd[3] = {ndims[0], ndims[1], ndims[3]};
  int64_t *sh[3] = {shapes[0], shapes[1], shapes[3]};
  const char *ty[3] = {dtypes[0], dtypes[1], dtypes[3]};
  const int kind = Kind(3, nd, sh, ty);
  const float scale = AmpZooScale(dtypes[2], ndims[2], shapes[2], params[2]);
  if (!kind || scale != scale) return 1;
  void *io[3] = {params[0], params[1], params[3]};
  ForRows<2>(io, nd, sh, kind == 2, [scale](int64_t, const float **in, float *dx, int64_t d) {
    SoftmaxGradRow(in[0], in[1], dx, d, scale);
  });
  return 0;
}

}  // namespace

// Return codes (MindSpore reports them): 1 a count, shape or dtype these ops do not take
AMP_ZOO_AOT(SoftmaxFwd, Forward(AOT_PASS))
AMP_ZOO_AOT(SoftmaxBwd, Backward(AOT_PASS))
AMP_ZOO_AOT(ScaledSoftmaxFwd, ScaledForward(AOT_PASS))
AMP_ZOO_AOT(ScaledSoftmaxBwd, ScaledBackward(AOT_PASS))
