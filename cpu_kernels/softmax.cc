// Softmax over the last axis (the attention's, models/transformer.py) as AOT custom ops (cpu_kernels/cells.py:
// CpuSoftmax), for float32 or float16, computing in float32 whatever comes in (as O2's keep-list runs it) and
// rounding each output once. At O2 MindSpore ran Casts on both sides of the fp32 Softmax and of its gradient.
//
// SoftmaxFwd (x [..., D] -> y): exp(x - max) / sum over each row; a NaN or inf in a row makes the row NaN, as
//   MindSpore's does (the loss scale's overflow check must see it)
// SoftmaxBwd (y, dy -> dx): y * (dy - sum(dy * y)) over each row
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

void AmpZooParallel(int n, const std::function<void(int, int)> &fn);  // conv.cc
int AmpZooThreads();
void AmpZooHalfToFloatHere(const uint16_t *s, float *d, int64_t n);
void AmpZooFloatToHalfHere(const float *s, uint16_t *d, int64_t n);

namespace {

// 1 float32, 2 float16, 0 anything else; every tensor of the op alike, all of one shape
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

// fn(row, inputs as float32, output as float32) for each row of d values, on the pool's threads when there is
// enough work; float16 rows are converted in and out of per-thread buffers
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
      fn(in, out, d);
      if (half) AmpZooFloatToHalfHere(out, static_cast<uint16_t *>(params[In]) + r * d, d);
    }
  };
  const int threads = rows * d >= (1 << 14) ? AmpZooThreads() : 1;
  if (threads == 1) return run(0, rows);
  AmpZooParallel(threads, [&](int t, int k) { run(rows * t / k, rows * (t + 1) / k); });
}

int Forward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const int kind = nparam == 2 ? Kind(nparam, ndims, shapes, dtypes) : 0;
  if (!kind) return 1;
  ForRows<1>(params, ndims, shapes, kind == 2, [](const float **in, float *y, int64_t d) {
    const float *x = in[0];
    float m = x[0];
    for (int64_t i = 1; i < d; ++i)
      if (x[i] > m || x[i] != x[i]) m = x[i];  // a NaN is kept as the maximum, so the row comes out NaN
    float sum = 0.0f;
    for (int64_t i = 0; i < d; ++i) sum += (y[i] = std::exp(x[i] - m));
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < d; ++i) y[i] *= inv;
  });
  return 0;
}

int Backward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const int kind = nparam == 3 ? Kind(nparam, ndims, shapes, dtypes) : 0;
  if (!kind) return 1;
  ForRows<2>(params, ndims, shapes, kind == 2, [](const float **in, float *dx, int64_t d) {
    const float *y = in[0], *dy = in[1];
    float dot = 0.0f;
    for (int64_t i = 0; i < d; ++i) dot += dy[i] * y[i];
    for (int64_t i = 0; i < d; ++i) dx[i] = y[i] * (dy[i] - dot);
  });
  return 0;
}

}  // namespace

// Return codes (MindSpore reports them): 1 a count, shape or dtype these ops do not take
extern "C" int SoftmaxFwd(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return Forward(n, params, ndims, shapes, dtypes);
}
extern "C" int SoftmaxBwd(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return Backward(n, params, ndims, shapes, dtypes);
}
