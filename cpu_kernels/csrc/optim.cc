// MomentumUpdate (w, accum, g, lr, momentum, decay, unscale -> done): one parameter's step of SGD with momentum
// and weight decay, in one pass over memory, for ampzoo.engine.optim.Momentum on the CPU.
//
//   g'     = g * unscale + decay * w      (unscale 1 and decay 0 leave g as it is)
//   accum  = accum * momentum + g'
//   w     -= accum * lr                   (Nesterov, MomentumUpdateNesterov: w -= g' * lr + accum * momentum * lr)
//
// nn.Momentum runs these as up to four ops: the decay's Mul and AddN, the loss scale's Mul and ApplyMomentum,
// and it reads the weight through a second Load, which makes MindSpore copy every decayed weight twice a step
// (TensorMove). This op writes w and accum where they are, as ApplyMomentum does: cells.py declares it a
// side-effect op, so MindSpore hands it the parameters themselves and orders it after their last reader. Its
// output is a (1,) float32 that says it ran. w, accum and g are float32; lr, momentum, decay and unscale float32
// tensors of one element (a scalar or (1,)). Each product is rounded before its sum (no fused multiply-add), so with unscale 1 the numbers are
// nn.Momentum's own.
#include <cstdint>
#include <cstring>
#include <functional>

#include "aot.h"
#include "runtime.h"

#pragma GCC optimize("fp-contract=off")

namespace {

int Update(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool nesterov) {
  if (nparam != 8) return 1;
  for (int i = 0; i < nparam; ++i)
    if (std::strcmp(dtypes[i], "float32")) return 1;
  int64_t n = 1;
  for (int d = 0; d < ndims[0]; ++d) n *= shapes[0][d];
  for (int k = 1; k < 3; ++k) {
    int64_t m = 1;
    for (int d = 0; d < ndims[k]; ++d) m *= shapes[k][d];
    if (m != n) return 1;
  }
  float *__restrict w = static_cast<float *>(params[0]);
  float *__restrict accum = static_cast<float *>(params[1]);
  const float *__restrict g = static_cast<const float *>(params[2]);
  const float lr = static_cast<const float *>(params[3])[0], momentum = static_cast<const float *>(params[4])[0];
  const float decay = static_cast<const float *>(params[5])[0], unscale = static_cast<const float *>(params[6])[0];
  auto run = [&](int64_t a, int64_t b) {
    if (nesterov) {
      for (int64_t i = a; i < b; ++i) {
        const float step = g[i] * unscale + w[i] * decay;
        accum[i] = accum[i] * momentum + step;
        w[i] -= step * lr + accum[i] * momentum * lr;
      }
    } else {
      for (int64_t i = a; i < b; ++i) {
        const float step = g[i] * unscale + w[i] * decay;
        accum[i] = accum[i] * momentum + step;
        w[i] -= accum[i] * lr;
      }
    }
  };
  const int threads = n >= (1 << 16) ? AmpZooThreads() : 1;
  if (threads == 1) {
    run(0, n);
  } else {
    AmpZooParallel(threads, [&](int t, int k) { run(n * t / k, n * (t + 1) / k); });
  }
  static_cast<float *>(params[7])[0] = 1.0f;
  return 0;
}

}  // namespace

AMP_ZOO_AOT(MomentumUpdate, Update(AOT_PASS, false))

AMP_ZOO_AOT(MomentumUpdateNesterov, Update(AOT_PASS, true))
