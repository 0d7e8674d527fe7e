// A Transformer's affine maps (ampzoo/models/transformer.py: Dense, the tied output projection) as AOT custom ops
// (cpu_kernels/cells.py: affine_op, linear_op), for float32 or float16 activations and float32 or float16
// weights. MindSpore's CPU MatMul in float16 casts its inputs to float32, multiplies and casts back, with a
// slower Cast kernel each way (docs/benchmarks.md, "Mixed precision on the CPU"), and an O2 Dense casts its
// float32 weight to float16 every step and the weight's gradient back. These ops take the weight as it is
// stored (float32 master weights at O2) and the activations as they come, convert float16 to float32 themselves
// (AVX-512 or F16C, conv.cc), run oneDNN's sgemm on the pool's threads, and round each float16 output once.
//
// The numbers are O2's: the weight is rounded to float16 before it multiplies a float16 activation, and a
// float32 weight's gradient is rounded through float16 (an fp16 gradient past 65504 is inf, as the cast graph
// makes it, so the loss scale's overflow check still sees it).
//
// With float16 activations on a CPU with AVX512-BF16, runtime.cpu_compute=bf16 (cpu_kernels.configure, runtime.cc's
// Bf16Compute) rounds the operands on to bf16 and runs oneDNN's bf16 matmul (vdpbf16ps, fp32 sums; GemmBf16),
// which multiplies twice as many pairs an instruction as fp32 FMA. bf16_backward does so in the backward only.
// The attention's batched products stay in fp32 (a head's 16 x 32 x 16 products are too small to gain).
//
// AffineFwd (x [M,K], w [N,K], b [N] -> y [M,N]): y = x w^T + b
// AffineBwd (x, w, dy -> dx [M,K], dw [N,K], db [N]): dx = dy w, dw = dy^T x, db = the column sums of dy
// LinearFwd (x, w -> y), LinearBwd (x, w, dy -> dx, dw): the same without a bias; LinearFwd32 returns float32
// (the logits, which the loss reads in float32: no Cast of a tokens x vocabulary tensor each way)
#include <oneapi/dnnl/dnnl.hpp>
#include <oneapi/dnnl/dnnl_threadpool.hpp>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "aot.h"
#include "runtime.h"

namespace {

bool IsHalf(const char *dtype) { return !std::strcmp(dtype, "float16"); }
bool Supported(const char *dtype) { return IsHalf(dtype) || !std::strcmp(dtype, "float32"); }

// A tensor as float32: itself, or its float16 values converted into `buf`. round_half: a float32 tensor rounded to
// float16 first (a float32 weight meeting float16 activations, as O2's Cast would give the MatMul)
const float *AsFloat(const void *p, const char *dtype, int64_t n, bool round_half, std::vector<float> *buf) {
  if (!IsHalf(dtype) && !round_half) return static_cast<const float *>(p);
  buf->resize(n);
  if (IsHalf(dtype)) {
    AmpZooHalfToFloat(static_cast<const uint16_t *>(p), buf->data(), n);
  } else {
    AmpZooRoundThroughHalf(static_cast<const float *>(p), buf->data(), n);
  }
  return buf->data();
}

// A float32 result into its output tensor: float16 rounded once; float32 as it is, or rounded through float16
// (via_half: a float32 tensor of a float16 computation, such as a float32 weight's gradient)
void Store(float *result, void *out, const char *dtype, int64_t n, bool via_half) {
  if (IsHalf(dtype)) {
    AmpZooFloatToHalf(result, static_cast<uint16_t *>(out), n);
    return;
  }
  if (result != out) std::memcpy(out, result, n * sizeof(float));
  if (via_half) AmpZooRoundThroughHalf(static_cast<float *>(out), static_cast<float *>(out), n);
}

// Where a float32 result is written: the output itself when it is float32, else a scratch buffer
float *Target(void *out, const char *dtype, int64_t n, std::vector<float> *buf) {
  if (!IsHalf(dtype)) return static_cast<float *>(out);
  buf->resize(n);
  return buf->data();
}

// Row-major C [M,N] = alpha op(A) op(B) + beta C on the pool's threads
bool Gemm(char ta, char tb, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
          int64_t ldb, float beta, float *C, int64_t ldc) {
  return dnnl::threadpool_interop::sgemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc, AmpZooPool()) ==
         dnnl::status::success;
}

// Row-major C [M,N] (fp32) = op(A) op(B) (+ bias [N], fp32) with A and B in bf16: one oneDNN matmul, which
// multiplies bf16 pairs in hardware (vdpbf16ps) and sums in fp32. Primitives are cached by shape.
bool GemmBf16(char ta, char tb, int64_t M, int64_t N, int64_t K, const uint16_t *A, const uint16_t *B,
              const float *bias, float *C) {
  using memory = dnnl::memory;
  using dt = memory::data_type;
  struct Entry {
    std::mutex m;
    dnnl::matmul mm;
    dnnl::matmul::primitive_desc pd;
  };
  static std::mutex m;
  static std::map<std::vector<int64_t>, std::shared_ptr<Entry>> cache;  // shared: a clear() frees none in use
  std::shared_ptr<Entry> e;
  try {
    std::lock_guard<std::mutex> lk(m);
    if (cache.size() > 512) cache.clear();  // token counts vary from batch to batch: keep the cache bounded
    auto &slot = cache[{ta, tb, M, N, K, bias != nullptr}];
    if (!slot) {
      memory::desc ad({M, K}, dt::bf16, ta == 'N' ? memory::dims{K, 1} : memory::dims{1, M}),
          bd({K, N}, dt::bf16, tb == 'N' ? memory::dims{N, 1} : memory::dims{1, K}),
          cd({M, N}, dt::f32, memory::dims{N, 1}), biasd({1, N}, dt::f32, memory::dims{N, 1});
      auto u = std::make_shared<Entry>();
      u->pd = bias ? dnnl::matmul::primitive_desc(AmpZooEngine(), ad, bd, biasd, cd)
                   : dnnl::matmul::primitive_desc(AmpZooEngine(), ad, bd, cd);
      u->mm = dnnl::matmul(u->pd);
      slot = std::move(u);
    }
    e = slot;
  } catch (const dnnl::error &) {
    return false;
  }
  try {
    std::lock_guard<std::mutex> lk(e->m);
    auto &eng = AmpZooEngine();
    memory a(e->pd.src_desc(), eng, const_cast<uint16_t *>(A)), b(e->pd.weights_desc(), eng, const_cast<uint16_t *>(B)),
        c(e->pd.dst_desc(), eng, C);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}};
    if (bias) args[DNNL_ARG_BIAS] = memory(e->pd.bias_desc(), eng, const_cast<float *>(bias));
    e->mm.execute(AmpZooStream(), args);
    AmpZooStream().wait();
  } catch (const dnnl::error &) {
    return false;
  }
  return true;
}

// Whether an fp16 layer's pass multiplies in bf16 here (runtime.cpu_compute, conv.cc's Bf16Compute: 1 in
// every pass, 2 in the backward passes only; 0 where the CPU lacks AVX512-BF16)
bool Bf16(bool half, bool backward) {
  if (!half) return false;
  const int mode = AmpZooCompute();
  return mode == 1 || (mode == 2 && backward);
}

// A tensor as bf16 bits in `buf`: float16 values, or float32 ones rounded to float16 first
const uint16_t *AsBf16(const void *p, const char *dtype, int64_t n, std::vector<uint16_t> *buf) {
  buf->resize(n);
  AmpZooToBf16(p, IsHalf(dtype), buf->data(), n);
  return buf->data();
}

// params: x, w, [b], y. 0 on success. The output may be float32 with float16 activations (the logits, which
// the loss takes in float32): it then holds float16 values, as a Cast after a float16 MatMul would
int Forward(bool bias, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const int out = bias ? 3 : 2;
  if (nparam != out + 1 || ndims[0] != 2 || ndims[1] != 2 || shapes[0][1] != shapes[1][1]) return 1;
  if (bias && (ndims[2] != 1 || shapes[2][0] != shapes[1][0] || std::strcmp(dtypes[2], dtypes[1]))) return 1;
  for (int i = 0; i < nparam; ++i)
    if (!Supported(dtypes[i])) return 1;
  if (!IsHalf(dtypes[0]) && IsHalf(dtypes[out])) return 1;
  const int64_t M = shapes[0][0], K = shapes[0][1], N = shapes[1][0];
  const bool half = IsHalf(dtypes[0]);  // float16 activations: every value in and out is a float16 value
  thread_local std::vector<float> xb, wb, bb, yb;
  if (Bf16(half, false)) {
    thread_local std::vector<uint16_t> x16, w16;
    float *y = Target(params[out], dtypes[out], M * N, &yb);
    const float *b = bias ? AsFloat(params[2], dtypes[2], N, true, &bb) : nullptr;
    if (!GemmBf16('N', 'T', M, N, K, AsBf16(params[0], dtypes[0], M * K, &x16),
                  AsBf16(params[1], dtypes[1], N * K, &w16), b, y))
      return 2;
    Store(y, params[out], dtypes[out], M * N, true);
    return 0;
  }
  const float *x = AsFloat(params[0], dtypes[0], M * K, false, &xb);
  const float *w = AsFloat(params[1], dtypes[1], N * K, half, &wb);
  float *y = Target(params[out], dtypes[out], M * N, &yb);
  if (bias) {
    const float *b = AsFloat(params[2], dtypes[2], N, half, &bb);
    for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * N, b, N * sizeof(float));
  }
  if (!Gemm('N', 'T', M, N, K, x, K, w, K, bias ? 1.0f : 0.0f, y, N)) return 2;
  Store(y, params[out], dtypes[out], M * N, half);
  return 0;
}

// params: x, w, dy, dx, dw, [db]. 0 on success. dx in x's dtype, dw and db in w's; dy in either (a float32 dy
// meeting float16 activations is rounded to float16 first, as the Cast's backward would)
int Backward(bool bias, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != (bias ? 6 : 5) || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2) return 1;
  const int64_t M = shapes[0][0], K = shapes[0][1], N = shapes[1][0];
  if (shapes[1][1] != K || shapes[2][0] != M || shapes[2][1] != N) return 1;
  for (int i = 0; i < nparam; ++i)
    if (!Supported(dtypes[i])) return 1;
  if (std::strcmp(dtypes[3], dtypes[0]) || std::strcmp(dtypes[4], dtypes[1]) ||
      (bias && std::strcmp(dtypes[5], dtypes[1])))
    return 1;
  const bool half = IsHalf(dtypes[0]);
  thread_local std::vector<float> xb, wb, gb, dxb, dwb, dbb, ones;
  if (Bf16(half, true)) {
    thread_local std::vector<uint16_t> x16, w16, g16, ones16;
    const uint16_t *x = AsBf16(params[0], dtypes[0], M * K, &x16), *w = AsBf16(params[1], dtypes[1], N * K, &w16),
                   *dy = AsBf16(params[2], dtypes[2], M * N, &g16);
    float *dx = Target(params[3], dtypes[3], M * K, &dxb), *dw = Target(params[4], dtypes[4], N * K, &dwb);
    if (!GemmBf16('N', 'N', M, K, N, dy, w, nullptr, dx) || !GemmBf16('T', 'N', N, K, M, dy, x, nullptr, dw))
      return 2;
    Store(dx, params[3], dtypes[3], M * K, true);
    Store(dw, params[4], dtypes[4], N * K, true);
    if (bias) {
      float *db = Target(params[5], dtypes[5], N, &dbb);
      ones16.assign(M, 0x3f80);  // bf16 1.0
      if (!GemmBf16('N', 'N', 1, N, M, ones16.data(), dy, nullptr, db)) return 2;
      Store(db, params[5], dtypes[5], N, true);
    }
    return 0;
  }
  const float *x = AsFloat(params[0], dtypes[0], M * K, false, &xb);
  const float *w = AsFloat(params[1], dtypes[1], N * K, half, &wb);
  const float *dy = AsFloat(params[2], dtypes[2], M * N, half, &gb);
  float *dx = Target(params[3], dtypes[3], M * K, &dxb);
  float *dw = Target(params[4], dtypes[4], N * K, &dwb);
  if (!Gemm('N', 'N', M, K, N, dy, N, w, K, 0.0f, dx, K)) return 2;
  if (!Gemm('T', 'N', N, K, M, dy, N, x, K, 0.0f, dw, K)) return 2;
  Store(dx, params[3], dtypes[3], M * K, half);
  Store(dw, params[4], dtypes[4], N * K, half);
  if (bias) {  // the column sums as a (1 x M) (M x N) product: sgemm's blocking beats a strided loop
    float *db = Target(params[5], dtypes[5], N, &dbb);
    ones.assign(M, 1.0f);
    if (!Gemm('N', 'N', 1, N, M, ones.data(), M, dy, N, 0.0f, db, N)) return 2;
    Store(db, params[5], dtypes[5], N, half);
  }
  return 0;
}

}  // namespace

// Return codes (MindSpore reports them): 1 a count, shape or dtype these ops do not take, 2 oneDNN failed
AMP_ZOO_AOT(AffineFwd, Forward(true, AOT_PASS))
AMP_ZOO_AOT(AffineBwd, Backward(true, AOT_PASS))
AMP_ZOO_AOT(LinearFwd, Forward(false, AOT_PASS))
AMP_ZOO_AOT(LinearBwd, Backward(false, AOT_PASS))
AMP_ZOO_AOT(LinearFwd32, Forward(false, AOT_PASS))

// Batched products over equal leading axes (the attention's scores and context, ampzoo/models/transformer.py's
// BatchMatMul): a [..., M, K] or [..., K, M] (ta), b [..., K, N] or [..., N, K] (tb) -> y [..., M, N], all in
// one dtype, float32 or float16; each product a sequential sgemm, the products split over the pool's threads.
// BmmFwdNN and BmmFwdNT are the forward ops (cells.py gives them their gradients); BmmNN, BmmNT, BmmTN the same
// products for the backward (graph mode gives two custom ops of one name one gradient, conv.cc).
namespace {

int Batched(char ta, char tb, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 3 || ndims[0] < 2 || ndims[0] != ndims[1] || ndims[2] != ndims[0]) return 1;
  const int r = ndims[0];
  int64_t batch = 1;
  for (int i = 0; i + 2 < r; ++i) {
    if (shapes[0][i] != shapes[1][i] || shapes[2][i] != shapes[0][i]) return 1;
    batch *= shapes[0][i];
  }
  for (int i = 0; i < 3; ++i)
    if (!Supported(dtypes[i]) || std::strcmp(dtypes[i], dtypes[0])) return 1;
  const int64_t M = ta == 'N' ? shapes[0][r - 2] : shapes[0][r - 1], K = ta == 'N' ? shapes[0][r - 1] : shapes[0][r - 2];
  const int64_t N = tb == 'N' ? shapes[1][r - 1] : shapes[1][r - 2];
  if ((tb == 'N' ? shapes[1][r - 2] : shapes[1][r - 1]) != K || shapes[2][r - 2] != M || shapes[2][r - 1] != N) return 1;
  const bool half = IsHalf(dtypes[0]);
  const int64_t sa = M * K, sb = K * N, sy = M * N;
  const int threads = batch * sy * K >= (1 << 16) ? AmpZooThreads() : 1;
  std::atomic<bool> ok{true};  // written by any thread whose sgemm fails
  auto run = [&](int64_t first, int64_t last) {
    std::vector<float> a, b, y;
    if (half) {
      a.resize(sa);
      b.resize(sb);
      y.resize(sy);
    }
    for (int64_t i = first; i < last; ++i) {
      const float *pa, *pb;
      float *py;
      if (half) {
        AmpZooHalfToFloatHere(static_cast<const uint16_t *>(params[0]) + i * sa, a.data(), sa);
        AmpZooHalfToFloatHere(static_cast<const uint16_t *>(params[1]) + i * sb, b.data(), sb);
        pa = a.data(), pb = b.data(), py = y.data();
      } else {
        pa = static_cast<const float *>(params[0]) + i * sa;
        pb = static_cast<const float *>(params[1]) + i * sb;
        py = static_cast<float *>(params[2]) + i * sy;
      }
      const int64_t lda = ta == 'N' ? K : M, ldb = tb == 'N' ? N : K;
      if (dnnl_sgemm(ta, tb, M, N, K, 1.0f, pa, lda, pb, ldb, 0.0f, py, N) != dnnl_success) ok = false;
      if (half) AmpZooFloatToHalfHere(py, static_cast<uint16_t *>(params[2]) + i * sy, sy);
    }
  };
  if (threads == 1) {
    run(0, batch);
  } else {
    AmpZooParallel(threads, [&](int t, int k) { run(batch * t / k, batch * (t + 1) / k); });
  }
  return ok ? 0 : 2;
}

}  // namespace

#define AMP_ZOO_BMM(NAME, TA, TB)                                                                                 \
  AMP_ZOO_AOT(NAME, Batched(TA, TB, AOT_PASS))
AMP_ZOO_BMM(BmmFwdNN, 'N', 'N')
AMP_ZOO_BMM(BmmFwdNT, 'N', 'T')
AMP_ZOO_BMM(BmmNN, 'N', 'N')
AMP_ZOO_BMM(BmmNT, 'N', 'T')
AMP_ZOO_BMM(BmmTN, 'T', 'N')
