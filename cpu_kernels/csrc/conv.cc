// Convolution forward and backward for MindSpore's CPU backend, as AOT custom ops (cpu_kernels/cells.py), on
// runtime.cc's pool, engine and stream (runtime.h).
//
// MindSpore 2.10's own CPU Conv2D kernels hand oneDNN plain NCHW memory, so oneDNN can only run its im2col +
// sgemm path (x64:gemm:jit). Given `any` layouts, the same oneDNN library picks its direct blocked kernels
// (jit:avx2, brgconv), the ones PyTorch runs (a ResNet-18 step 1.22x faster, bench.speed). These ops do what PyTorch
// does: reorder NCHW to the kernel's layout, run it, reorder back. They link to MindSpore's bundled libdnnl
// (threadpool runtime), so oneDNN runs on a small pool of our own threads.
//
// Each exported function is one op: ConvFwd_sS_pP (x, w -> y), ConvBwd_sS_pP (x, w, dy -> dx, dw) and
// ConvBwdW_sS_pP (x, w, dy -> dw: a network's first layer, whose input takes no gradient), for stride S and
// symmetric padding P. fp32 or fp16 tensors, fp32 accumulation. Primitives are cached by shape, dtype and mode.
//
// fp16 tensors (AMP's O2/O3) come in and go out as fp16: this file converts them itself (F16C or AVX-512
// conversions on the pool's threads), so no MindSpore Cast runs around a convolution. oneDNN's own f16 reorders
// run a reference loop on a CPU without AVX512-FP16 (docs/benchmarks.md); a conversion here is a pass over memory.
// How an fp16 convolution multiplies (CpuCompute):
// - fp32: its inputs are converted to fp32 and it runs oneDNN's fp32 kernel, so it computes what MindSpore's
//   Cast + fp32 Conv2D computes;
// - bf16 (runtime.cpu_compute=bf16, on a CPU with AVX512-BF16): its inputs are rounded to bf16 and it runs
//   oneDNN's bf16 kernel, which multiplies pairs of bf16 in hardware (vdpbf16ps) and accumulates in fp32. On an
//   AMD EPYC (Zen 4) that runs much faster than fp32; the operands keep 8 bits of mantissa, not fp16's 11.
//   bf16_backward: the same in the backward passes (dx, dw) only, the forward in fp32. On small planes a bf16
//   weight gradient is one oneDNN matmul over an im2col of x instead (MatmulWeights).
// Either way each output (y, dx, dw) is accumulated in fp32 and rounded once to fp16. oneDNN's AMX kernels (a
// Xeon with AMX) take and give channels-last tensors: there an fp16 activation in the blocked layout is converted
// and reordered in one pass each way (Arg's `fused`), not a conversion and then a reorder.
#include <immintrin.h>
#include <oneapi/dnnl/dnnl.hpp>
#include <oneapi/dnnl/dnnl_threadpool.hpp>
#include <oneapi/dnnl/dnnl_threadpool_iface.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "aot.h"
#include "half.h"
#include "runtime.h"

namespace {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

// A tensor given in the user's plain layout, and the kernel's layout (the same buffer when they agree). A tensor
// whose dtype is not the kernel's is staged: converted into a buffer of its own layout on the way in, and out of
// it on the way out. An fp32 weight of an fp16 convolution (O2's master weight, taken as stored) goes through
// fp16 both ways, so it computes what a Cast to fp16 and back would give.
enum Stage {
  kNone,
  kHalfFloat,      // fp16 <-> fp32
  kHalfBf16,       // fp16 -> bf16 (an input)
  kFloatHalfBf16,  // fp32 -> fp16 -> bf16 (an input)
  kFloatHalfFloat  // fp32 -> fp16 -> fp32, either way
};

struct Arg {
  memory user, inner;
  dnnl::reorder to_inner, to_user;
  bool reorder = false;
  bool fused = false;  // fp16 nChw16c <-> the kernel's nhwc in one pass (a bf16 pass: BlockedHalfToNhwcBf16)
  Stage stage = kNone;
  std::vector<char> staged;
  void *out = nullptr;
  // plain: the user's layout in the kernel's dtype; want: the kernel's layout; bf16: a pass of a bf16 mode
  void Init(const memory::desc &plain, const memory::desc &want, Stage how, bool bf16 = false) {
    auto &e = AmpZooEngine();
    stage = how;
    const memory::dims d = plain.get_dims();
    fused = bf16 && (stage == kHalfBf16 || stage == kHalfFloat) && d.size() == 4 && d[1] % 16 == 0 &&
            plain == memory::desc(d, plain.get_data_type(), tag::nChw16c) &&
            want == memory::desc(d, plain.get_data_type(), tag::nhwc);
    if (stage != kNone && !fused) staged.resize(plain.get_size());
    user = memory(plain, e, DNNL_MEMORY_NONE);
    reorder = plain != want;
    inner = reorder ? memory(want, e) : user;
    if (reorder && !fused) {
      to_inner = dnnl::reorder(user, inner);
      to_user = dnnl::reorder(inner, user);
    }
  }
  // the fused pass over the n*hw positions, split between the pool's threads
  void Fused(const std::function<void(int64_t, int64_t, int64_t, int64_t)> &f) {
    const memory::dims d = user.get_desc().get_dims();
    const int64_t rows = d[0] * d[2] * d[3], hw = d[2] * d[3], c = d[1];
    const int threads = rows * c >= (1 << 15) ? AmpZooThreads() : 1;
    if (threads == 1) return f(hw, c, 0, rows);
    AmpZooParallel(threads, [&](int t, int k) { f(hw, c, rows * t / k, rows * (t + 1) / k); });
  }
  int64_t Count() const {
    return static_cast<int64_t>(staged.size()) / (stage == kHalfFloat || stage == kFloatHalfFloat ? 4 : 2);
  }
  void In(void *p) {  // user data into the kernel's layout
    if (fused) {
      const auto *h = static_cast<const uint16_t *>(p);
      auto *to = static_cast<uint16_t *>(inner.get_data_handle());
      return Fused([&](int64_t hw, int64_t c, int64_t a, int64_t b) { AmpZooBlockedHalfToNhwcBf16(h, to, hw, c, a, b); });
    }
    if (stage != kNone) {
      const int64_t n = Count();
      auto *to16 = reinterpret_cast<uint16_t *>(staged.data());
      auto *to32 = reinterpret_cast<float *>(staged.data());
      const auto *h = static_cast<const uint16_t *>(p);
      const auto *f = static_cast<const float *>(p);
      if (stage == kHalfFloat)
        AmpZooHalfToFloat(h, to32, n);
      else if (stage == kHalfBf16)
        AmpZooSplit(n, [&](int64_t a, int64_t b) { AmpZooHalfToBf16Here(h + a, to16 + a, b - a); });
      else if (stage == kFloatHalfBf16)
        AmpZooSplit(n, [&](int64_t a, int64_t b) { AmpZooFloatToBf16Here(f + a, to16 + a, b - a); });
      else
        AmpZooRoundThroughHalf(f, to32, n);
      p = staged.data();
    }
    user.set_data_handle(p);
    if (reorder) to_inner.execute(AmpZooStream(), user, inner);
  }
  void Bind(void *p) {  // an output (fp32 in the kernel): it writes here, or into `inner` and Out() reorders
    out = p;
    if (!fused) user.set_data_handle(stage == kNone ? p : static_cast<void *>(staged.data()));
  }
  void Out() {
    if (fused) {
      AmpZooStream().wait();
      const auto *f = static_cast<const float *>(inner.get_data_handle());
      auto *to = static_cast<uint16_t *>(out);
      return Fused([&](int64_t hw, int64_t c, int64_t a, int64_t b) { AmpZooNhwcFloatToBlockedHalf(f, to, hw, c, a, b); });
    }
    if (reorder) to_user.execute(AmpZooStream(), inner, user);
    if (stage == kNone) return;
    AmpZooStream().wait();
    const auto *f = reinterpret_cast<const float *>(staged.data());
    if (stage == kHalfFloat)
      AmpZooFloatToHalf(f, static_cast<uint16_t *>(out), Count());
    else
      AmpZooRoundThroughHalf(f, static_cast<float *>(out), Count());
  }
};

// A tensor's logical NCHW dims and its layout: rank 4 is plain NCHW; rank 5 is oneDNN's blocked nChw16c or
// nChw8c, (N, C/B, H, W, B) with channel c at block c / B, lane c % B (ResNet's activations on the CPU: the
// layout the kernels run in, so no reorder is needed between layers)
memory::dims Dims(const int64_t *s, int rank) {
  return rank == 5 ? memory::dims{s[0], s[1] * s[4], s[2], s[3]} : memory::dims{s[0], s[1], s[2], s[3]};
}

int64_t Block(const int64_t *s, int rank) { return rank == 5 ? s[4] : 0; }

// the user layout of a rank and block (undef: one these ops do not take)
tag Layout(int64_t block) {
  return block == 0 ? tag::nchw : block == 16 ? tag::nChw16c : block == 8 ? tag::nChw8c : tag::undef;
}

using Key = std::vector<int64_t>;

// Two rows of a matmul's B in oneDNN's blocked bf16 layout (BA16a64b2a: pairs of rows interleaved, element by
// element): 16 values of row 2q (a) and 16 of row 2q + 1 (b) -> 32 interleaved values at d. A null row is zeros.
__attribute__((target("avx512f"))) void InterleaveRows(const uint16_t *a, const uint16_t *b, uint16_t *d) {
  // the maskz forms: g++ 12 warns of the unmasked ones' undefined source (as in H2F512)
  const __m512i lo = a ? _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a)))
                       : _mm512_setzero_si512();
  const __m512i hi = b ? _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b)))
                       : _mm512_setzero_si512();
  _mm512_storeu_si512(d, _mm512_or_si512(lo, _mm512_maskz_slli_epi32(0xffff, hi, 16)));
}

// Backward weights of a bf16 convolution as one oneDNN matmul: dw [OC, KH*KW*IC] = dy^T [OC, P] col [P, KH*KW*IC],
// P = N*OH*OW, col the im2col of x (a row per output position, (kh, kw, ic) along it). oneDNN's direct bf16
// backward-weights kernel, under the threadpool runtime MindSpore's libdnnl is built with, cannot share one
// transposition of x between threads, so it transposes x again for every 16 output channels: on ResNet-34's
// 8x8 and 4x4 layers it took 1.5 and 2.4 times as long as the same work as a bf16 matmul (docs/benchmarks.md).
// Used for convolutions wider than 1x1 with blocked (16-channel) x and dy, in the bf16 modes only: of stride 1
// and an output plane of 64 positions or fewer; and where oneDNN has no AMX (its AVX512-BF16 kernel: an AMD
// EPYC), also of stride 2 (1.3-4x) and of planes up to 14x14 (ResNet-34's 224x224 third stage, 1.5x).
// The operands are laid out as the matmul reads them fastest: dy^T row by row (each output channel's positions
// contiguous), and col written straight into oneDNN's blocked layout for B (where the matmul asks for
// BA16a64b2a, as its AVX512-BF16 kernel does), so the matmul copies neither (docs/benchmarks.md, eighth round).
struct MatmulWeights {
  static bool Applies(const memory::dims &wd, const memory::dims &yd, tag xl, tag yl, int64_t s) {
    const int64_t plane = yd[2] * yd[3];
    const bool wide = !AmpZooOneDnnRunsAmx() && (s == 2 || (s == 1 && plane <= 196));
    return AmpZooMatmulWeights() && ((s == 1 && plane <= 64) || wide) && xl == tag::nChw16c &&
           yl == tag::nChw16c && wd[2] * wd[3] > 1;
  }
  // Where the direct kernel runs on oneDNN's OpenMP build (no AMX, Conv::OmpWeights), it beats the matmul on
  // stride-1 planes of 64 positions or more and stride-2 planes of more than 64 (ResNet-34's 8x8 and 14x14
  // stride-1 layers, 1.25-1.29 times the forward pass's time against 1.49-1.51; docs/benchmarks.md, tenth
  // round); the matmul stays for the smaller planes (7x7 and 4x4: 1.8-2.1 against 2.4-3.3)
  static bool OpenMpFirst(const memory::dims &yd, int64_t s) {
    const int64_t plane = yd[2] * yd[3];
    return !AmpZooOneDnnRunsAmx() && (s == 1 ? plane >= 64 : plane > 64);
  }

  int64_t n, ic, h, w, oc, oh, ow, kh, kw, p, st;
  bool half;     // dw in fp16, else fp32 holding fp16 values (an fp32 master weight taken as stored)
  bool blocked;  // col in BA16a64b2a (padded to 32 rows, the padding zeros), else row-major [P, KH*KW*IC]
  dnnl::matmul mm;
  memory a, b, c;
  std::vector<uint16_t> xb, col, dyt;
  std::vector<float> dw;

  MatmulWeights(const memory::dims &xd, const memory::dims &wd, const memory::dims &yd, int64_t pad, int64_t stride,
                bool w_half)
      : n(xd[0]), ic(xd[1]), h(xd[2]), w(xd[3]), oc(wd[0]), oh(yd[2]), ow(yd[3]), kh(wd[2]), kw(wd[3]), p(pad),
        st(stride), half(w_half) {}

  // the matmul and its buffers, at the first backward pass (a shape seen in evaluation alone never needs them)
  void Init() {
    auto &e = AmpZooEngine();
    const int64_t rows = n * oh * ow, k = kh * kw * ic;
    memory::desc ad({oc, rows}, dt::bf16, memory::dims{rows, 1}), cd({oc, k}, dt::f32, memory::dims{k, 1});
    memory::desc plain({rows, k}, dt::bf16, memory::dims{k, 1}), packed({rows, k}, dt::bf16, tag::BA16a64b2a);
    dnnl::matmul::primitive_desc pd(e, ad, memory::desc({rows, k}, dt::bf16, tag::any), cd);
    blocked = k % 64 == 0 && pd.weights_desc() == packed;
    if (!blocked) pd = dnnl::matmul::primitive_desc(e, ad, plain, cd);
    mm = dnnl::matmul(pd);
    xb.resize(n * ic * h * w);
    col.assign(pd.weights_desc().get_size() / sizeof(uint16_t), 0);
    dyt.resize(rows * oc);
    dw.resize(oc * k);
    a = memory(ad, e, dyt.data());
    b = memory(pd.weights_desc(), e, col.data());
    c = memory(cd, e, dw.data());
  }

  // x, dy fp16 blocked; dw_out OIHW in the weight's dtype
  void Run(const uint16_t *x, const uint16_t *dy, void *dw_out) {
    if (dw.empty()) Init();
    const int64_t icb = ic / 16, ocb = oc / 16, plane = oh * ow, rows = n * plane, k = kh * kw * ic;
    const int64_t padded = (rows + 31) / 32 * 32;  // col's rows in the blocked layout
    auto threads = [](int64_t count, const std::function<void(int64_t, int64_t)> &f) {
      AmpZooParallel(AmpZooThreads(),
                             [&](int t, int m) { f(count * t / m, count * (t + 1) / m); });
    };
    AmpZooSplit(static_cast<int64_t>(xb.size()), [&](int64_t i, int64_t j) { AmpZooHalfToBf16Here(x + i, xb.data() + i, j - i); });
    // the 16 channels of block cb of x at output row r's tap (i, j), or null: a tap in the padding, or no row
    auto tap = [&](int64_t r, int64_t i, int64_t j, int64_t cb) -> const uint16_t * {
      if (r >= rows) return nullptr;
      const int64_t img = r / plane, iy = r % plane / ow * st + i - p, ix = r % ow * st + j - p;
      if (iy < 0 || iy >= h || ix < 0 || ix >= w) return nullptr;
      return xb.data() + (((img * icb + cb) * h + iy) * w + ix) * 16;
    };
    if (blocked) {  // a pair of rows at a time: element (r, m) at (m / 64, r / 32, r % 32 / 2, m % 64, r % 2)
      threads(padded / 2, [&](int64_t q0, int64_t q1) {
        for (int64_t q = q0; q < q1; ++q) {
          const int64_t r = 2 * q;
          uint16_t *pair = col.data() + r / 32 * 2048 + r % 32 / 2 * 128;
          for (int64_t i = 0; i < kh; ++i)
            for (int64_t j = 0; j < kw; ++j)
              for (int64_t cb = 0; cb < icb; ++cb) {
                const int64_t m = (i * kw + j) * ic + cb * 16;
                InterleaveRows(tap(r, i, j, cb), tap(r + 1, i, j, cb), pair + m / 64 * padded * 64 + m % 64 * 2);
              }
        }
      });
    } else {
      threads(rows, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t i = 0; i < kh; ++i)
            for (int64_t j = 0; j < kw; ++j)
              for (int64_t cb = 0; cb < icb; ++cb) {
                uint16_t *to = col.data() + r * k + (i * kw + j) * ic + cb * 16;
                const uint16_t *from = tap(r, i, j, cb);
                if (from)
                  std::memcpy(to, from, 16 * sizeof(uint16_t));
                else
                  std::memset(to, 0, 16 * sizeof(uint16_t));
              }
      });
    }
    threads(n * ocb, [&](int64_t t0, int64_t t1) {  // dy^T: block (img, cb) of dy, [plane, 16] -> [16, plane]
      std::vector<uint16_t> block(plane * 16);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t img = t / ocb, cb = t % ocb;
        AmpZooHalfToBf16Here(dy + t * plane * 16, block.data(), plane * 16);
        for (int64_t l = 0; l < 16; ++l) {
          uint16_t *row = dyt.data() + (cb * 16 + l) * rows + img * plane;
          for (int64_t i = 0; i < plane; ++i) row[i] = block[i * 16 + l];
        }
      }
    });
    mm.execute(AmpZooStream(), {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    AmpZooStream().wait();
    threads(oc, [&](int64_t o0, int64_t o1) {  // (kh, kw, ic) -> OIHW, rounded to fp16 once
      std::vector<float> t(k);
      for (int64_t o = o0; o < o1; ++o) {
        const float *from = dw.data() + o * k;
        for (int64_t ci = 0; ci < ic; ++ci)
          for (int64_t ij = 0; ij < kh * kw; ++ij) t[ci * kh * kw + ij] = from[ij * ic + ci];
        if (half)
          AmpZooFloatToHalfHere(t.data(), static_cast<uint16_t *>(dw_out) + o * k, k);
        else
          AmpZooRoundThroughHalfHere(t.data(), static_cast<float *>(dw_out) + o * k, k);
      }
    });
  }
};

// out[a][b] = the products of rows a of dy and b of col (bf16) over the n positions of each of `images`, in 16
// lanes (oneDNN's bf16 dot product, vdpbf16ps: positions 2l and 2l + 1 of each 32 in lane l). Image g's rows
// start at dy + g * dy_img (rows dy_ld apart) and col + g * n (rows col_ld apart)
template <int BO, int BK>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void DotBlock(const uint16_t *dy, int64_t dy_ld, int64_t dy_img,
                                                                    const uint16_t *col, int64_t col_ld, int64_t images,
                                                                    int64_t n, float *out) {
  __m512 r[BO][BK];
  for (int a = 0; a < BO; ++a)
    for (int b = 0; b < BK; ++b) r[a][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < images; ++g)
    for (int64_t q = 0; q < n; q += 32) {
      const __mmask32 m = n - q >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << (n - q)) - 1);
      __m512bh c[BK];
      for (int b = 0; b < BK; ++b)
        c[b] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, col + b * col_ld + g * n + q));
      for (int a = 0; a < BO; ++a) {
        const __m512bh d = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, dy + g * dy_img + a * dy_ld + q));
        for (int b = 0; b < BK; ++b) r[a][b] = _mm512_dpbf16_ps(r[a][b], d, c[b]);
      }
    }
  for (int a = 0; a < BO; ++a)
    for (int b = 0; b < BK; ++b) _mm512_storeu_ps(out + (a * 4 + b) * 16, r[a][b]);
}

template <int BO>
void DotBlockK(int bk, const uint16_t *dy, int64_t dy_ld, int64_t dy_img, const uint16_t *col, int64_t col_ld,
               int64_t images, int64_t n, float *out) {
  switch (bk) {
    case 4: return DotBlock<BO, 4>(dy, dy_ld, dy_img, col, col_ld, images, n, out);
    case 3: return DotBlock<BO, 3>(dy, dy_ld, dy_img, col, col_ld, images, n, out);
    case 2: return DotBlock<BO, 2>(dy, dy_ld, dy_img, col, col_ld, images, n, out);
    default: return DotBlock<BO, 1>(dy, dy_ld, dy_img, col, col_ld, images, n, out);
  }
}

// the 16 lanes' sum, in pairs (a fixed order)
float SumLanes(const float *v) {
  float t[8];
  for (int l = 0; l < 8; ++l) t[l] = v[l] + v[l + 8];
  return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

// The weight gradient of a convolution between plain (NCHW) fp16 layers in the bf16 modes (LeNet's two: too few
// channels for a 16-channel block), the kernels' own: dw[o, (c, i, j)] = the sum over images and output positions
// q of dy[img, o, q] x[img, c, tap(q, i, j)], bf16-rounded operands in the bf16 dot product oneDNN's kernels use
// (fp32 sums). oneDNN's kernels for these layers cut the batch into a parallel region per image (an im2col and a
// gemm each): 66 of a LeNet step's 110 regions, whose pieces the pool's caller runs one after another on a busy
// machine, where they cost the step more than one thread does (bench/results/busy-2026-12-07-zen4). Here one
// region: a thread owns a share of dw's (c, i, j) columns, takes their im2col over the whole batch, and sums
// 4 x 4 blocks of dw in 16 lanes; each sum runs in the same order on any number of threads, so the result depends
// neither on the threads nor on how busy the machine is. runtime.cpu_weight_grad=direct gives them back to oneDNN.
struct PlainWeights {
  int64_t n, ic, h, w, oc, oh, ow, kh, kw, p, st;
  bool half;  // dw in fp16, else fp32 holding fp16 values (an fp32 master weight taken as stored)
  std::vector<uint16_t> xb, dyb;               // x and dy rounded to bf16
  std::vector<std::vector<uint16_t>> cols;     // each thread's im2col: its columns' rows over every position
  std::vector<float> dw;                       // [OC, IC*KH*KW] (OIHW)

  // plain x and dy, and an im2col of at most 4M values (8 MB; LeNet's at batch 128: 2.5M): a larger plain layer
  // (a width that is not a multiple of 16) keeps oneDNN's kernels, which need no im2col of the whole batch
  static bool Applies(const memory::dims &xd, const memory::dims &wd, const memory::dims &yd, tag xl, tag yl) {
    return xl == tag::nchw && yl == tag::nchw && wd[1] * wd[2] * wd[3] * xd[0] * yd[2] * yd[3] <= (int64_t{1} << 22);
  }

  PlainWeights(const memory::dims &xd, const memory::dims &wd, const memory::dims &yd, int64_t pad, int64_t stride,
               bool w_half)
      : n(xd[0]), ic(xd[1]), h(xd[2]), w(xd[3]), oc(wd[0]), oh(yd[2]), ow(yd[3]), kh(wd[2]), kw(wd[3]), p(pad),
        st(stride), half(w_half) {}

  // rows [k0, k1) of the im2col: x's channel c at tap (i, j) of every output position, zeros in the padding
  __attribute__((target("avx512f,avx512bw"))) void Im2col(int64_t k0, int64_t k1, uint16_t *col) const {
    const int64_t plane = oh * ow, rows = n * plane;
    for (int64_t kk = k0; kk < k1; ++kk) {
      const int64_t c = kk / (kh * kw), i = kk / kw % kh, j = kk % kw;
      // the positions whose tap falls inside a row: ox * st + j - p in [0, w)
      const int64_t last = w - 1 + p - j, lo = std::min(ow, std::max<int64_t>(0, (p - j + st - 1) / st)),
                    hi = last < 0 ? lo : std::max(lo, std::min(ow, last / st + 1));
      for (int64_t img = 0; img < n; ++img)
        for (int64_t oy = 0; oy < oh; ++oy) {
          uint16_t *to = col + (kk - k0) * rows + img * plane + oy * ow;
          const int64_t iy = oy * st + i - p;
          if (iy < 0 || iy >= h) {
            for (int64_t ox = 0; ox < ow; ++ox) to[ox] = 0;
            continue;
          }
          const int64_t row = ((img * ic + c) * h + iy) * w;  // x's row; its tap ox is row + ox * st + j - p
          if (st == 1 && j >= p) {  // 32 at a time (lo is 0): the row's values before hi, zeros after
            const uint16_t *line = xb.data() + row + j - p;
            for (int64_t ox = 0; ox < ow; ox += 32) {
              const int64_t a = std::max(lo, ox), e = std::min(hi, ox + 32), len = std::min<int64_t>(32, ow - ox);
              const __mmask32 in = e > a ? static_cast<__mmask32>(((uint64_t{1} << (e - a)) - 1) << (a - ox)) : 0;
              const __mmask32 all = static_cast<__mmask32>((uint64_t{1} << len) - 1);
              _mm512_mask_storeu_epi16(to + ox, all, _mm512_maskz_loadu_epi16(in, line + ox));
            }
            continue;
          }
          for (int64_t ox = 0; ox < lo; ++ox) to[ox] = 0;
          for (int64_t ox = lo; ox < hi; ++ox) to[ox] = xb[row + ox * st + j - p];
          for (int64_t ox = hi; ox < ow; ++ox) to[ox] = 0;
        }
    }
  }

  void Run(const uint16_t *x, const uint16_t *dy, void *dw_out) {
    const int64_t plane = oh * ow, k = ic * kh * kw, threads = AmpZooThreads();
    xb.resize(n * ic * h * w), dyb.resize(n * oc * plane), dw.resize(oc * k), cols.resize(threads);
    AmpZooToBf16(x, true, xb.data(), static_cast<int64_t>(xb.size()));
    AmpZooToBf16(dy, true, dyb.data(), static_cast<int64_t>(dyb.size()));
    AmpZooParallel(static_cast<int>(threads), [&](int t, int m) {
      const int64_t k0 = k * t / m, k1 = k * (t + 1) / m, nk = k1 - k0, rows = n * plane;
      if (nk == 0) return;
      std::vector<uint16_t> &col = cols[t];
      col.resize(nk * rows);
      Im2col(k0, k1, col.data());
      float out[16 * 16];
      for (int64_t o = 0; o < oc; o += 4)
        for (int64_t b = 0; b < nk; b += 4) {
          const int bo = static_cast<int>(std::min<int64_t>(4, oc - o));
          const int bk = static_cast<int>(std::min<int64_t>(4, nk - b));
          const uint16_t *dy_o = dyb.data() + o * plane, *col_b = col.data() + b * rows;
          switch (bo) {
            case 4: DotBlockK<4>(bk, dy_o, plane, oc * plane, col_b, rows, n, plane, out); break;
            case 3: DotBlockK<3>(bk, dy_o, plane, oc * plane, col_b, rows, n, plane, out); break;
            case 2: DotBlockK<2>(bk, dy_o, plane, oc * plane, col_b, rows, n, plane, out); break;
            default: DotBlockK<1>(bk, dy_o, plane, oc * plane, col_b, rows, n, plane, out);
          }
          for (int a = 0; a < bo; ++a)
            for (int c = 0; c < bk; ++c) dw[(o + a) * k + k0 + b + c] = SumLanes(out + (a * 4 + c) * 16);
        }
    });
    if (half)  // rounded to fp16 once
      AmpZooFloatToHalf(dw.data(), static_cast<uint16_t *>(dw_out), oc * k);
    else
      AmpZooRoundThroughHalf(dw.data(), static_cast<float *>(dw_out), oc * k);
  }
};

struct Conv {
  std::mutex m;
  dnnl::convolution_forward fwd;
  dnnl::convolution_backward_data bwd_data;
  dnnl::convolution_backward_weights bwd_weights;
  Arg x, w, y;             // forward
  Arg dy_d, w_d, dx;       // backward data
  Arg x_w, dy_w, dw;       // backward weights
  std::unique_ptr<MatmulWeights> mm_dw;  // or backward weights as a matmul (bf16 modes, MatmulWeights::Applies)
  std::unique_ptr<PlainWeights> plain_dw;  // or the kernels' own, between plain layers (bf16 modes)
  // or the same direct kernel in oneDNN on OpenMP (omp_weights.cc): a primitive per pool thread, each on images
  // [omp_from[i], omp_from[i + 1]), the dw of all but the first summed into the first's
  std::vector<AmpZooOmpWeights *> omp_dw;
  std::vector<int64_t> omp_from;
  std::vector<float> omp_parts;
  void FreeOmp() {
    for (auto *w : omp_dw) AmpZooOmpWeightsFree(w);
    omp_dw.clear();
  }
  ~Conv() { FreeOmp(); }
  // dw.inner = the weight gradient of x_w.inner and dy, the parts at once on the pool's threads and summed; false
  // (and from then on MindSpore's oneDNN) where the OpenMP build failed
  bool OmpWeights(const memory &dy) {
    AmpZooStream().wait();
    const auto *xb = static_cast<const uint16_t *>(x_w.inner.get_data_handle());
    const auto *dyb = static_cast<const uint16_t *>(dy.get_data_handle());
    auto *out = static_cast<float *>(dw.inner.get_data_handle());
    const int64_t n = omp_from.back(), x_img = x_w.inner.get_desc().get_size() / 2 / n,
                  y_img = dy.get_desc().get_size() / 2 / n, size = dw.inner.get_desc().get_size() / 4;
    std::atomic<bool> ok{true};
    AmpZooParallel(static_cast<int>(omp_dw.size()), [&](int i, int) {
      float *to = i == 0 ? out : omp_parts.data() + (i - 1) * size;
      if (!AmpZooOmpWeightsRun(omp_dw[i], xb + omp_from[i] * x_img, dyb + omp_from[i] * y_img, to)) ok = false;
    });
    if (!ok) {
      FreeOmp();
      return false;
    }
    if (omp_dw.size() > 1)
      AmpZooSplit(size, [&](int64_t a, int64_t b) {
        for (size_t k = 1; k < omp_dw.size(); ++k) {
          const float *part = omp_parts.data() + (k - 1) * size;
          for (int64_t j = a; j < b; ++j) out[j] += part[j];
        }
      });
    return true;
  }

  // mode (AmpZooCompute): 0 fp32 compute, 1 bf16 in all three passes, 2 bf16 in the two backward passes only
  Conv(const memory::dims &xd, const memory::dims &wd, const memory::dims &yd, tag xl, tag yl, int64_t s, int64_t p,
       dt xt, dt wt, int mode) {
    auto &e = AmpZooEngine();
    memory::dims st{s, s}, pad{p, p};
    // y has x's dtype, dx x's, dw w's. A pass reads its inputs in fp32, or bf16 (an fp16 convolution in a bf16
    // mode), and writes its outputs in fp32; Arg stages what differs. With fp16 x, an fp32 w holds fp16 values
    // inside, and dw fp16 values.
    const bool xh = xt == dt::f16, wh = wt == dt::f16, bf_fwd = mode == 1, bf_bwd = mode != 0;
    auto read = [&](bool half, bool bf16) {
      if (half) return bf16 ? kHalfBf16 : kHalfFloat;
      if (xh) return bf16 ? kFloatHalfBf16 : kFloatHalfFloat;
      return kNone;
    };
    auto wrote = [&](bool half) { return half ? kHalfFloat : xh ? kFloatHalfFloat : kNone; };
    const dt f_in = bf_fwd ? dt::bf16 : dt::f32, b_in = bf_bwd ? dt::bf16 : dt::f32;
    memory::desc x_out(xd, dt::f32, xl), w_out(wd, dt::f32, tag::oihw), y_out(yd, dt::f32, yl);
    memory::desc x_any32(xd, dt::f32, tag::any), w_any32(wd, dt::f32, tag::any), y_any32(yd, dt::f32, tag::any);
    auto any = [](const memory::dims &d, dt t) { return memory::desc(d, t, tag::any); };
    auto alg = dnnl::algorithm::convolution_direct;
    auto train = dnnl::prop_kind::forward_training;
    dnnl::convolution_forward::primitive_desc f(e, train, alg, any(xd, f_in), any(wd, f_in), y_any32, st, pad, pad);
    dnnl::convolution_forward::primitive_desc hint(e, train, alg, any(xd, b_in), any(wd, b_in), any(yd, b_in), st,
                                                   pad, pad);
    dnnl::convolution_backward_data::primitive_desc bd(e, alg, x_any32, any(wd, b_in), any(yd, b_in), st, pad, pad,
                                                       hint);
    fwd = dnnl::convolution_forward(f);
    bwd_data = dnnl::convolution_backward_data(bd);
    x.Init(memory::desc(xd, f_in, xl), f.src_desc(), read(xh, bf_fwd), bf_fwd);
    w.Init(memory::desc(wd, f_in, tag::oihw), f.weights_desc(), read(wh, bf_fwd));
    y.Init(y_out, f.dst_desc(), wrote(xh), bf_fwd);
    dy_d.Init(memory::desc(yd, b_in, yl), bd.diff_dst_desc(), read(xh, bf_bwd), bf_bwd);
    w_d.Init(memory::desc(wd, b_in, tag::oihw), bd.weights_desc(), read(wh, bf_bwd));
    dx.Init(x_out, bd.diff_src_desc(), wrote(xh), bf_bwd);
    if (bf_bwd && xh && AmpZooMatmulWeights() && PlainWeights::Applies(xd, wd, yd, xl, yl)) {  // LeNet's layers
      plain_dw.reset(new PlainWeights(xd, wd, yd, p, s, wh));
      return;
    }
    const bool matmul = bf_bwd && xh && MatmulWeights::Applies(wd, yd, xl, yl, s);
    dnnl::convolution_backward_weights::primitive_desc bw(e, alg, any(xd, b_in), w_any32, any(yd, b_in), st, pad,
                                                          pad, hint);
    // bf16 blocked layers where oneDNN has no AMX: the direct kernel on OpenMP, when its library is there (on
    // the layers the matmul fits, only where it beats the matmul)
    if (bf_bwd && AmpZooOpenMpWeights() && !AmpZooOneDnnRunsAmx() && (!matmul || MatmulWeights::OpenMpFirst(yd, s)) &&
        bw.src_desc() == memory::desc(xd, dt::bf16, tag::nChw16c) &&
        bw.diff_dst_desc() == memory::desc(yd, dt::bf16, tag::nChw16c) &&
        bw.diff_weights_desc() == memory::desc(wd, dt::f32, tag::OIhw16i16o)) {
      const int64_t parts = std::min<int64_t>(AmpZooThreads(), xd[0]);
      for (int64_t i = 0; i <= parts; ++i) omp_from.push_back(xd[0] * i / parts);
      for (int64_t i = 0; i < parts; ++i) {
        memory::dims xi = xd, yi = yd;
        xi[0] = yi[0] = omp_from[i + 1] - omp_from[i];
        AmpZooOmpWeights *w = AmpZooOmpWeightsMake(xi.data(), wd.data(), yi.data(), s, p, "aBcd16b", "aBcd16b",
                                                   "ABcd16b16a", bw.impl_info_str());
        if (!w) break;  // the OpenMP build is missing or chose another kernel: MindSpore's oneDNN runs it
        omp_dw.push_back(w);
      }
      if (static_cast<int64_t>(omp_dw.size()) < parts) FreeOmp();
      omp_parts.resize((omp_dw.empty() ? 0 : parts - 1) * bw.diff_weights_desc().get_size() / sizeof(float));
    }
    if (matmul && omp_dw.empty()) {  // then no direct backward-weights kernel (or the OpenMP one is missing, off
                                     // or refused the layer)
      mm_dw.reset(new MatmulWeights(xd, wd, yd, p, s, wh));
      return;
    }
    bwd_weights = dnnl::convolution_backward_weights(bw);  // also where the OpenMP one fails at run time
    x_w.Init(memory::desc(xd, b_in, xl), bw.src_desc(), read(xh, bf_bwd), bf_bwd);
    dy_w.Init(memory::desc(yd, b_in, yl), bw.diff_dst_desc(), read(xh, bf_bwd), bf_bwd);
    dw.Init(w_out, bw.diff_weights_desc(), wrote(wh));
  }

  void Forward(void *xp, void *wp, void *yp) {
    std::lock_guard<std::mutex> lk(m);
    auto &st = AmpZooStream();
    x.In(xp);
    w.In(wp);
    y.Bind(yp);
    fwd.execute(st, {{DNNL_ARG_SRC, x.inner}, {DNNL_ARG_WEIGHTS, w.inner}, {DNNL_ARG_DST, y.inner}});
    y.Out();
    st.wait();
  }

  // dxp null: the weights' gradient only (the network's first layer, whose input takes no gradient)
  void Backward(void *xp, void *wp, void *dyp, void *dxp, void *dwp) {
    std::lock_guard<std::mutex> lk(m);
    auto &st = AmpZooStream();
    if (dxp) {
      dy_d.In(dyp);
      w_d.In(wp);
      dx.Bind(dxp);
      bwd_data.execute(st, {{DNNL_ARG_DIFF_DST, dy_d.inner}, {DNNL_ARG_WEIGHTS, w_d.inner},
                            {DNNL_ARG_DIFF_SRC, dx.inner}});
      dx.Out();
    }
    if (plain_dw) {
      plain_dw->Run(static_cast<const uint16_t *>(xp), static_cast<const uint16_t *>(dyp), dwp);
      st.wait();
      return;
    }
    if (mm_dw) {  // waits for the stream itself
      mm_dw->Run(static_cast<const uint16_t *>(xp), static_cast<const uint16_t *>(dyp), dwp);
      return;
    }
    x_w.In(xp);
    dw.Bind(dwp);
    // backward weights reads dy in its own layout; when that is backward data's, staged the same way, backward
    // data's copy is reused (its conversion to bf16, its reorder)
    bool shared = dxp && dy_w.stage == dy_d.stage && dy_w.fused == dy_d.fused &&
                  dy_w.inner.get_desc() == dy_d.inner.get_desc();
    if (!shared) dy_w.In(dyp);
    const memory &dy_in = shared ? dy_d.inner : dy_w.inner;
    if (omp_dw.empty() || !OmpWeights(dy_in)) {
      bwd_weights.execute(st, {{DNNL_ARG_SRC, x_w.inner}, {DNNL_ARG_DIFF_DST, dy_in},
                               {DNNL_ARG_DIFF_WEIGHTS, dw.inner}});
    }
    dw.Out();
    st.wait();
  }
};

// x and y in their layouts (rank 4 or 5: Dims), w OIHW; nullptr for a layout these ops do not take
Conv *Lookup(const int64_t *xs, int xr, const int64_t *ws, const int64_t *ys, int yr, int64_t s, int64_t p, dt xt,
             dt wt) {
  static std::mutex m;
  static std::map<Key, std::unique_ptr<Conv>> cache;
  const tag xl = Layout(Block(xs, xr)), yl = Layout(Block(ys, yr));
  if (xl == tag::undef || yl == tag::undef) return nullptr;
  memory::dims xd = Dims(xs, xr), wd(ws, ws + 4), yd = Dims(ys, yr);
  const int bf16 = xt == dt::f16 ? AmpZooCompute() : 0;  // fp32 convolutions (O0) always multiply in fp32
  const int64_t dw = bf16 ? AmpZooMatmulWeights() + 2 * AmpZooOpenMpWeights() + 4 * AmpZooThreads() : 0;
  Key k{xd[0], xd[1], xd[2], xd[3], Block(xs, xr), wd[0], wd[2], wd[3], yd[2], yd[3], Block(ys, yr), s, p,
        static_cast<int64_t>(xt), static_cast<int64_t>(wt), bf16, dw};  // dw: how its weight gradient runs
  std::lock_guard<std::mutex> lk(m);
  auto &c = cache[k];
  if (!c) c.reset(new Conv(xd, wd, yd, xl, yl, s, p, xt, wt, bf16));
  return c.get();
}

bool Rank(int r) { return r == 4 || r == 5; }

// float32 or float16 (dt::undef: anything else)
dt Dtype(const char *name) {
  return !std::strcmp(name, "float32") ? dt::f32 : !std::strcmp(name, "float16") ? dt::f16 : dt::undef;
}

// Return codes (MindSpore reports them): 1 a rank or dtype these ops do not take, 2 oneDNN refused the shapes
int Forward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, int64_t s, int64_t p) {
  dt xt = Dtype(dtypes[0]), wt = Dtype(dtypes[1]);
  if (nparam != 3 || xt == dt::undef || wt == dt::undef || Dtype(dtypes[2]) != xt) return 1;
  if (!Rank(ndims[0]) || ndims[1] != 4 || !Rank(ndims[2])) return 1;
  try {
    Conv *c = Lookup(shapes[0], ndims[0], shapes[1], shapes[2], ndims[2], s, p, xt, wt);
    if (!c) return 1;
    c->Forward(params[0], params[1], params[2]);
  } catch (const dnnl::error &) {
    return 2;
  }
  return 0;
}

// inputs x, w, dy; outputs dx, dw (nparam 5: ConvBwd), or dw alone (nparam 4: ConvBwdW); the exports check nparam
int Backward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, int64_t s, int64_t p) {
  dt xt = Dtype(dtypes[0]), wt = Dtype(dtypes[1]);
  const bool data = nparam == 5;
  if (xt == dt::undef || wt == dt::undef || Dtype(dtypes[2]) != xt || (data && Dtype(dtypes[3]) != xt) ||
      Dtype(dtypes[nparam - 1]) != wt)
    return 1;
  if (!Rank(ndims[0]) || ndims[1] != 4 || !Rank(ndims[2])) return 1;
  try {
    Conv *c = Lookup(shapes[0], ndims[0], shapes[1], shapes[2], ndims[2], s, p, xt, wt);
    if (!c) return 1;
    c->Backward(params[0], params[1], params[2], data ? params[3] : nullptr, params[nparam - 1]);
  } catch (const dnnl::error &) {
    return 2;
  }
  return 0;
}

// fp16 plain NCHW <-> blocked (N, C/B, H, W, B), moved as 16-bit values (no conversion), a (n, block) at a time
// on the pool's threads: oneDNN's f16 reorder runs a reference loop where the CPU lacks AVX512-FP16
void Relayout16(const uint16_t *x, uint16_t *y, const memory::dims &d, int64_t block, bool to_blocked) {
  const int64_t n = d[0], blocks = d[1] / block, plane = d[2] * d[3];
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {  // r = (n, block)
      const int64_t base = r * block * plane;  // the same offset in both layouts
      for (int64_t l = 0; l < block; ++l)
        for (int64_t i = 0; i < plane; ++i) {
          const int64_t plain_at = base + l * plane + i, blocked_at = base + i * block + l;
          if (to_blocked)
            y[blocked_at] = x[plain_at];
          else
            y[plain_at] = x[blocked_at];
        }
    }
  };
  const int threads = AmpZooThreads();
  AmpZooParallel(threads, [&](int t, int k) { rows(n * blocks * t / k, n * blocks * (t + 1) / k); });
}

// x in one layout -> y, the same tensor in another (plain NCHW <-> blocked, fp32 or fp16): a oneDNN reorder for
// fp32, Relayout16 for fp16
int Reorder(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  dt t = Dtype(dtypes[0]);
  if (nparam != 2 || t == dt::undef || Dtype(dtypes[1]) != t || !Rank(ndims[0]) || !Rank(ndims[1])) return 1;
  const tag from = Layout(Block(shapes[0], ndims[0])), to = Layout(Block(shapes[1], ndims[1]));
  const memory::dims d = Dims(shapes[0], ndims[0]);
  if (from == tag::undef || to == tag::undef || d != Dims(shapes[1], ndims[1])) return 1;
  if (t == dt::f16 && from != to) {
    const bool to_blocked = from == tag::nchw;
    const int64_t block = to_blocked ? Block(shapes[1], ndims[1]) : Block(shapes[0], ndims[0]);
    if (from != tag::nchw && to != tag::nchw) return 1;  // blocked -> blocked of another width: not used
    Relayout16(static_cast<const uint16_t *>(params[0]), static_cast<uint16_t *>(params[1]), d, block, to_blocked);
    return 0;
  }
  static std::mutex m;
  static std::map<Key, std::unique_ptr<std::tuple<memory, memory, dnnl::reorder>>> cache;
  Key k{d[0], d[1], d[2], d[3], static_cast<int64_t>(from), static_cast<int64_t>(to), static_cast<int64_t>(t)};
  std::lock_guard<std::mutex> lk(m);
  auto &r = cache[k];
  try {
    if (!r) {
      memory src({d, t, from}, AmpZooEngine(), DNNL_MEMORY_NONE), dst({d, t, to}, AmpZooEngine(), DNNL_MEMORY_NONE);
      r.reset(new std::tuple<memory, memory, dnnl::reorder>(src, dst, dnnl::reorder(src, dst)));
    }
    auto &[src, dst, reorder] = *r;
    src.set_data_handle(params[0]);
    dst.set_data_handle(params[1]);
    reorder.execute(AmpZooStream(), src, dst);
    AmpZooStream().wait();
  } catch (const dnnl::error &) {
    return 2;
  }
  return 0;
}

}  // namespace

// MindSpore's graph mode gave two ops of one AOT function name one gradient between them (every 3x3 convolution
// took the first layer's weight-only backward), so each forward the Python side builds differently has a name of
// its own: First (the network's first layer: its gradient computes dw alone) and B (a blocked output: its shape
// function differs), all four running the same code
#define CONV_OPS(S, P)                                                                \
  AMP_ZOO_AOT(ConvFwd_s##S##_p##P, Forward(AOT_PASS, S, P))                           \
  AMP_ZOO_AOT(ConvFwdB_s##S##_p##P, Forward(AOT_PASS, S, P))                          \
  AMP_ZOO_AOT(ConvFwdFirst_s##S##_p##P, Forward(AOT_PASS, S, P))                      \
  AMP_ZOO_AOT(ConvFwdFirstB_s##S##_p##P, Forward(AOT_PASS, S, P))                     \
  AMP_ZOO_AOT(ConvBwd_s##S##_p##P, n == 5 ? Backward(AOT_PASS, S, P) : 1)             \
  AMP_ZOO_AOT(ConvBwdW_s##S##_p##P, n == 4 ? Backward(AOT_PASS, S, P) : 1)

CONV_OPS(1, 0)
CONV_OPS(1, 1)
CONV_OPS(1, 2)
CONV_OPS(1, 3)
CONV_OPS(2, 0)
CONV_OPS(2, 1)
CONV_OPS(2, 2)
CONV_OPS(2, 3)

// Two names for one op, each with its own gradient (see CONV_OPS)
AMP_ZOO_AOT(ToBlocked, Reorder(AOT_PASS))
AMP_ZOO_AOT(ToPlain, Reorder(AOT_PASS))
