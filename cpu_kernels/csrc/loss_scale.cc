// The loss scale's unscale, as AOT custom ops (cpu_kernels/cells.py: unscale_sum_op, unscaled_sum_op; used by
// amp.loss_scale).
//
// UnscaleSum (g, scale -> g * (1 / scale), the sum of that): the loss-scale step's unscale and its overflow check
// in one pass over a float32 gradient, where MindSpore runs a Mul and a ReduceSum (the sum is inf or NaN when any
// element is: the step tests it with isfinite, as amp.loss_scale.finite_sum does).
// UnscaledSum (g, scale -> the sum of g * (1 / scale)): the same sum, reading g only, where the optimizer unscales
// the gradient itself as it updates (optim.cc's MomentumUpdate), so no unscaled copy is written.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "aot.h"
#include "runtime.h"

namespace {

// g * (1 / scale) into out (unless Write is false), and the sum of it: UnscaleSum (nparam 4) and UnscaledSum (3)
template <bool Write>
int UnscaleSum(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != (Write ? 4 : 3)) return 1;
  for (int i = 0; i < nparam; ++i)
    if (std::strcmp(dtypes[i], "float32")) return 1;
  const int64_t n = AotCount(ndims, shapes);
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

}  // namespace

// Return codes (MindSpore reports them): 1 a count, shape or dtype these ops do not take
AMP_ZOO_AOT(UnscaleSumOp, UnscaleSum<true>(AOT_PASS))
AMP_ZOO_AOT(UnscaledSumOp, UnscaleSum<false>(AOT_PASS))
