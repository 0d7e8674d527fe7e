// Convolution forward and backward for MindSpore's CPU backend, as AOT custom ops (cpu_kernels/cells.py).
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
// - bf16 (AMP_ZOO_CPU_COMPUTE=bf16, on a CPU with AVX512-BF16): its inputs are rounded to bf16 and it runs
//   oneDNN's bf16 kernel, which multiplies pairs of bf16 in hardware (vdpbf16ps) and accumulates in fp32. On an
//   AMD EPYC (Zen 4) that runs much faster than fp32; the operands keep 8 bits of mantissa, not fp16's 11.
//   bf16_backward: the same in the backward passes (dx, dw) only, the forward in fp32. On small planes a bf16
//   weight gradient is one oneDNN matmul over an im2col of x instead (MatmulWeights).
// Either way each output (y, dx, dw) is accumulated in fp32 and rounded once to fp16. oneDNN's AMX kernels (a
// Xeon with AMX) take and give channels-last tensors: there an fp16 activation in the blocked layout is converted
// and reordered in one pass each way (Arg's `fused`), not a conversion and then a reorder.
#include <immintrin.h>
#include <sched.h>
#include <oneapi/dnnl/dnnl.hpp>
#include <oneapi/dnnl/dnnl_threadpool.hpp>
#include <oneapi/dnnl/dnnl_threadpool_iface.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

struct AmpZooOmpWeights;  // omp_weights.cc
extern "C" AmpZooOmpWeights *AmpZooOmpWeightsMake(const int64_t *xd, const int64_t *wd, const int64_t *yd,
                                                  int64_t s, int64_t p, const char *x_tag, const char *dy_tag,
                                                  const char *dw_tag, const char *impl);
extern "C" bool AmpZooOmpWeightsRun(AmpZooOmpWeights *w, const void *x, const void *dy, void *dw);
extern "C" void AmpZooOmpWeightsFree(AmpZooOmpWeights *w);
void AmpZooHalfToFloatHere(const uint16_t *s, float *d, int64_t n);
void AmpZooFloatToHalfHere(const float *s, uint16_t *d, int64_t n);

namespace {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

// A fixed pool for oneDNN's threadpool runtime: the calling thread works too. A parallel region's n pieces are
// claimed one at a time by whichever thread comes first, the caller included, so a worker the kernel scheduler has
// descheduled (another process busy on these cores) never holds the region up: the caller takes its pieces, and
// the region costs at most what one thread would. Between regions a worker spins for a while
// (AMP_ZOO_POOL_SPIN_US, default 200 us), as OpenMP's threads do, then sleeps: a training step runs many short
// regions back to back, and waking a sleeping thread costs tens of microseconds. Once the machine is busy (a
// region that the caller finished alone while its workers were runnable but not running) the pool stops spinning
// for the next 1,000 regions, as OpenMP's passive wait policy does: spinning threads would take the very cores
// the other process is waiting for. (A region counts when it lasted more than twice the spin: a spinning worker
// would have joined it had it been running.)
class Pool : public dnnl::threadpool_interop::threadpool_iface {
 public:
  explicit Pool(int n, int spin_us) : n_(n < 1 ? 1 : n), spin_(std::chrono::microseconds(spin_us)) {
    for (int t = 1; t < n_; ++t) workers_.emplace_back([this] { Work(); });
  }
  ~Pool() override {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto &w : workers_) w.join();
  }
  int get_num_threads() const override { return n_; }
  bool get_in_parallel() const override { return in_parallel_; }
  uint64_t get_flags() const override { return 0; }  // synchronous: parallel_for returns when all is done
  void parallel_for(int n, const std::function<void(int, int)> &fn) override {
    if (n <= 1 || n_ == 1 || in_parallel_) {
      for (int i = 0; i < n; ++i) fn(i, n);
      return;
    }
    std::lock_guard<std::mutex> one(busy_);  // one parallel region at a time
    const uint64_t gen = (generation_.load(std::memory_order_relaxed) + 1) & kGenMask;
    {
      std::lock_guard<std::mutex> lk(m_);
      job_ = &fn;
      done_.store(0, std::memory_order_relaxed);
      // the ticket a piece is claimed with: generation, pieces, next piece (a worker that comes late for a
      // region cannot claim a piece of the next one: its generation differs)
      ticket_.store((gen << 40) | (static_cast<uint64_t>(n) << 20), std::memory_order_release);
      generation_.store(gen, std::memory_order_release);
    }
    wake_.notify_all();
    const auto start = std::chrono::steady_clock::now();
    const int mine = Claim(gen);
    // the caller ran every piece of a region long enough for a spinning worker to have joined: none was running
    const bool alone = mine == n && std::chrono::steady_clock::now() - start > 2 * spin_;
    const bool spin = quiet_.load(std::memory_order_relaxed) == 0;
    if (!Spin(spin, [&] { return done_.load(std::memory_order_acquire) == n; })) {
      std::unique_lock<std::mutex> lk(m_);
      finished_.wait(lk, [&] { return done_.load(std::memory_order_acquire) == n; });
    }
    job_ = nullptr;
    if (alone && spin) {  // every worker was away: the cores are busy with something else
      quiet_.store(1000, std::memory_order_relaxed);
    } else if (!spin) {
      quiet_.fetch_sub(1, std::memory_order_relaxed);
    }
  }

 private:
  static constexpr uint64_t kGenMask = (uint64_t{1} << 24) - 1;
  static constexpr uint64_t kField = (uint64_t{1} << 20) - 1;

  // Claim and run pieces of region `gen` until none is left; returns how many this thread ran
  int Claim(uint64_t gen) {
    int ran = 0;
    in_parallel_ = true;
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      const uint64_t n = (t >> 20) & kField, i = t & kField;
      if ((t >> 40) != gen || i >= n) break;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      (*job_)(static_cast<int>(i), static_cast<int>(n));  // the region is not done until this piece is: job_ holds
      ++ran;
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<int>(n)) {
        std::lock_guard<std::mutex> lk(m_);  // the caller may be asleep on finished_
        finished_.notify_one();
      }
    }
    in_parallel_ = false;
    return ran;
  }
  // Busy-wait up to spin_ for ready() (not at all when `spin` is false); false if it did not come
  template <typename F>
  bool Spin(bool spin, F ready) const {
    if (!spin || spin_.count() == 0) return ready();
    const auto until = std::chrono::steady_clock::now() + spin_;
    for (int i = 1;; ++i) {
      if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      if (i % 64 == 0 && std::chrono::steady_clock::now() > until) return ready();
    }
  }
  void Work() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const bool spin = quiet_.load(std::memory_order_relaxed) == 0;
      if (!Spin(spin, [&] { return generation_.load(std::memory_order_acquire) != seen; })) {
        std::unique_lock<std::mutex> lk(m_);
        wake_.wait(lk, [&] { return stop_ || generation_.load(std::memory_order_acquire) != seen; });
        if (stop_) return;
      }
      seen = generation_.load(std::memory_order_acquire);
      Claim(seen);
    }
  }
  int n_;
  std::chrono::microseconds spin_;
  std::vector<std::thread> workers_;
  std::mutex m_, busy_;
  std::condition_variable wake_, finished_;
  const std::function<void(int, int)> *job_ = nullptr;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> done_{0};
  std::atomic<int> quiet_{0};  // regions left without spinning (the machine was found busy)
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;
  static thread_local bool in_parallel_;
};
thread_local bool Pool::in_parallel_ = false;

// The pool's size: AMP_ZOO_CONV_THREADS where set, else the cores this process may run on (its affinity mask,
// which msrun's core binding and taskset set), divided among msrun's workers when they share the machine's cores
int Threads() {
  const char *env = std::getenv("AMP_ZOO_CONV_THREADS");
  if (env) {
    const int n = std::atoi(env);
    return n > 0 ? n : 1;
  }
  cpu_set_t mask;
  int n = sched_getaffinity(0, sizeof(mask), &mask) == 0 ? CPU_COUNT(&mask)
                                                           : static_cast<int>(std::thread::hardware_concurrency());
  const char *workers = std::getenv("MS_WORKER_NUM");
  const int all = static_cast<int>(std::thread::hardware_concurrency());
  if (workers && std::atoi(workers) > 1 && n >= all) n /= std::min(std::atoi(workers), n);  // not bound per worker
  return n > 0 ? n : 1;
}

int SpinMicroseconds() {
  const char *env = std::getenv("AMP_ZOO_POOL_SPIN_US");
  int us = env ? std::atoi(env) : 200;
  return us > 0 ? us : 0;
}

struct Runtime {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  Pool pool{Threads(), SpinMicroseconds()};
  dnnl::stream stream = dnnl::threadpool_interop::make_stream(engine, &pool);
};

Runtime &RT() {
  static Runtime rt;
  return rt;
}

// fp16 <-> fp32 conversions, exact one way and rounded to nearest even the other (an fp32 value past fp16's
// range becomes inf, as MindSpore's Cast makes it: the loss scale's overflow check then sees it), 16 lanes at a
// time on AVX-512, 8 with F16C, else one at a time in portable code
float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while (!(m & 0x400u));
    bits = sign | ((112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToHalfBits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0);  // inf, NaN
  if (x >= 0x477ff000u) return sign | 0x7c00u;                                    // rounds past 65504: inf
  if (x < 0x38800000u) {  // an fp16 subnormal or zero: add 0.5 to land the bits in place, rounding to even
    float a;
    std::memcpy(&a, &x, 4);
    a += 0.5f;
    uint32_t b;
    std::memcpy(&b, &a, 4);
    return sign | static_cast<uint16_t>(b - 0x3f000000u);
  }
  const uint32_t odd = (x >> 13) & 1;
  x += 0xc8000fffu + odd;  // rebias the exponent (-112 << 23) and round to nearest even
  return sign | static_cast<uint16_t>(x >> 13);
}

__attribute__((target("avx512f,avx2,f16c"))) void H2F512(const uint16_t *s, float *d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(d + i, _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(s + i))));
  for (; i < n; ++i) d[i] = _cvtsh_ss(s[i]);
}

__attribute__((target("avx512f,avx2,f16c"))) void F2H512(const float *s, uint16_t *d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(d + i),
                        _mm512_maskz_cvtps_ph(0xffff, _mm512_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) d[i] = _cvtss_sh(s[i], _MM_FROUND_TO_NEAREST_INT);
}

__attribute__((target("avx2,f16c"))) void H2F256(const uint16_t *s, float *d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s + i))));
  for (; i < n; ++i) d[i] = _cvtsh_ss(s[i]);
}

__attribute__((target("avx2,f16c"))) void F2H256(const float *s, uint16_t *d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i *>(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) d[i] = _cvtss_sh(s[i], _MM_FROUND_TO_NEAREST_INT);
}

// fp16 or fp32 -> bf16 bits, rounded to nearest even (only where CpuCompute is bf16: the CPU has AVX512-BF16)
uint16_t FloatToBf16Bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN stays NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

__attribute__((target("avx512f,avx512bf16,avx2,f16c"))) void H2B512(const uint16_t *s, uint16_t *d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 f = _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(s + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(d + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f)));
  }
  for (; i < n; ++i) d[i] = FloatToBf16Bits(_cvtsh_ss(s[i]));
}

// fp32 -> the nearest fp16 -> bf16, or back to fp32: an fp32 master weight used by an fp16 convolution takes the
// values MindSpore's Cast to fp16 gives it, and its fp32 gradient the values an fp16 gradient would hold
__attribute__((target("avx512f,avx512bf16,avx2,f16c"))) void F2H2B512(const float *s, uint16_t *d, int64_t n) {
  int64_t i = 0;
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (; i + 16 <= n; i += 16) {
    const __m512 f = _mm512_maskz_cvtph_ps(0xffff, _mm512_maskz_cvtps_ph(0xffff, _mm512_loadu_ps(s + i), kRound));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(d + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f)));
  }
  for (; i < n; ++i) d[i] = FloatToBf16Bits(_cvtsh_ss(_cvtss_sh(s[i], _MM_FROUND_TO_NEAREST_INT)));
}

// The fp16 activations of a bf16 convolution between its blocked neighbours and oneDNN's AMX kernels, which
// take and give channels-last (nhwc) tensors: one pass each way instead of a conversion and a reorder. Rows
// [r0, r1) of the n*hw positions; c channels in c/16 blocks of 16 lanes. The values are H2B512's and F2H512's.
__attribute__((target("avx512f,avx512bf16,avx2,f16c"))) void BlockedHalfToNhwcBf16(const uint16_t *x, uint16_t *d,
                                                                                  int64_t hw, int64_t c, int64_t r0,
                                                                                  int64_t r1) {
  const int64_t blocks = c / 16;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t *from = x + ((r / hw) * blocks * hw + r % hw) * 16;
    for (int64_t cb = 0; cb < blocks; ++cb) {
      const __m512 f =
          _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(from + cb * hw * 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i *>(d + r * c + cb * 16),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f)));
    }
  }
}

__attribute__((target("avx512f,avx2,f16c"))) void NhwcFloatToBlockedHalf(const float *y, uint16_t *d, int64_t hw,
                                                                         int64_t c, int64_t r0, int64_t r1) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const int64_t blocks = c / 16;
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t *to = d + ((r / hw) * blocks * hw + r % hw) * 16;
    for (int64_t cb = 0; cb < blocks; ++cb)
      _mm256_storeu_si256(reinterpret_cast<__m256i *>(to + cb * hw * 16),
                          _mm512_maskz_cvtps_ph(0xffff, _mm512_loadu_ps(y + r * c + cb * 16), kRound));
  }
}

// s rounded to the nearest fp16 values into d (d may be s), on this thread
void RoundThroughHalf(const float *s, float *d, int64_t n) {
  constexpr int64_t kChunk = 1024;
  uint16_t h[kChunk];
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t m = std::min(kChunk, n - i);
    AmpZooFloatToHalfHere(s + i, h, m);
    AmpZooHalfToFloatHere(h, d + i, m);
  }
}

void H2FPortable(const uint16_t *s, float *d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = HalfBitsToFloat(s[i]);
}

void F2HPortable(const float *s, uint16_t *d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = FloatToHalfBits(s[i]);
}

// which conversion this CPU runs: 2 AVX-512, 1 F16C, 0 portable (AMP_ZOO_HALF_ISA caps it, for the tests)
int HalfIsa() {
  static const int isa = [] {
    __builtin_cpu_init();
    int best = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c") ? 2
               : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") ? 1 : 0;
    const char *cap = std::getenv("AMP_ZOO_HALF_ISA");
    return cap && std::atoi(cap) < best ? std::max(0, std::atoi(cap)) : best;
  }();
  return isa;
}

// Whether oneDNN runs bf16 dot products here: its effective ISA (the CPU's, under ONEDNN_MAX_CPU_ISA) has them
bool OneDnnRunsBf16() {
  using isa = dnnl::cpu_isa;
  switch (dnnl::get_effective_cpu_isa()) {
    case isa::isa_default: case isa::sse41: case isa::avx: case isa::avx2: case isa::avx2_vnni:
    case isa::avx2_vnni_2: case isa::avx512_core: case isa::avx512_core_vnni:
      return false;
    default:
      return true;
  }
}

// Whether oneDNN runs AMX here (its effective ISA holds every feature of avx10_1_512_amx): its bf16 kernels are
// then brgemm kernels on channels-last tensors, not the AVX512-BF16 direct ones
bool OneDnnRunsAmx() {
  const auto amx = static_cast<unsigned>(dnnl::cpu_isa::avx10_1_512_amx);
  return (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & amx) == amx;
}

// How fp16 convolutions and Dense layers (matmul.cc) multiply here (see the top of this file): 0 fp32; 1 bf16
// (AMP_ZOO_CPU_COMPUTE=bf16), 2 bf16 in the backward passes only (AMP_ZOO_CPU_COMPUTE=bf16_backward), each only
// where the CPU has AVX512-BF16 under oneDNN's ISA cap (runtime.cpu_compute sets the variable: models/layers.py).
// Read at each lookup, so a process (a test) can run each; cpu_kernels.cpu_compute() is the same rule.
int Bf16Compute() {
  static const bool bf16 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("f16c") && OneDnnRunsBf16();
  }();
  const char *env = std::getenv("AMP_ZOO_CPU_COMPUTE");
  if (!bf16 || !env) return 0;
  return !std::strcmp(env, "bf16") ? 1 : !std::strcmp(env, "bf16_backward") ? 2 : 0;
}

// f(begin, end) over [0, n) in one piece per pool thread when n is large enough to pay for waking them
void Split(int64_t n, const std::function<void(int64_t, int64_t)> &f) {
  const int threads = n >= (1 << 16) ? RT().pool.get_num_threads() : 1;
  if (threads == 1) return f(0, n);
  RT().pool.parallel_for(threads, [&](int t, int k) {
    const int64_t a = (n * t / k) & ~int64_t{15}, b = t + 1 == k ? n : (n * (t + 1) / k) & ~int64_t{15};
    f(a, b);
  });
}

}  // namespace

// fp16 bits <-> fp32 over n elements on this thread (eltwise.cc converts chunk by chunk)
void AmpZooHalfToFloatHere(const uint16_t *s, float *d, int64_t n) {
  const int isa = HalfIsa();
  (isa == 2 ? H2F512 : isa == 1 ? H2F256 : H2FPortable)(s, d, n);
}

void AmpZooFloatToHalfHere(const float *s, uint16_t *d, int64_t n) {
  const int isa = HalfIsa();
  (isa == 2 ? F2H512 : isa == 1 ? F2H256 : F2HPortable)(s, d, n);
}

// fp32 values rounded to the nearest fp16 values, on the pool's threads (d may be s; matmul.cc uses it too)
void AmpZooRoundThroughHalf(const float *s, float *d, int64_t n) {
  Split(n, [&](int64_t a, int64_t b) { RoundThroughHalf(s + a, d + a, b - a); });
}

// the same on the pool's threads (norm.cc uses them)
int AmpZooHalfIsa() { return HalfIsa(); }

// whether MindSpore's oneDNN runs AMX here (omp_weights.cc's status)
bool AmpZooOneDnnRunsAmx() { return OneDnnRunsAmx(); }

void AmpZooHalfToFloat(const uint16_t *s, float *d, int64_t n) {
  const int isa = HalfIsa();
  Split(n, [&](int64_t a, int64_t b) { (isa == 2 ? H2F512 : isa == 1 ? H2F256 : H2FPortable)(s + a, d + a, b - a); });
}

void AmpZooFloatToHalf(const float *s, uint16_t *d, int64_t n) {
  const int isa = HalfIsa();
  Split(n, [&](int64_t a, int64_t b) { (isa == 2 ? F2H512 : isa == 1 ? F2H256 : F2HPortable)(s + a, d + a, b - a); });
}

namespace {

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
    auto &e = RT().engine;
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
    const int threads = rows * c >= (1 << 15) ? RT().pool.get_num_threads() : 1;
    if (threads == 1) return f(hw, c, 0, rows);
    RT().pool.parallel_for(threads, [&](int t, int k) { f(hw, c, rows * t / k, rows * (t + 1) / k); });
  }
  int64_t Count() const {
    return static_cast<int64_t>(staged.size()) / (stage == kHalfFloat || stage == kFloatHalfFloat ? 4 : 2);
  }
  void In(void *p) {  // user data into the kernel's layout
    if (fused) {
      const auto *h = static_cast<const uint16_t *>(p);
      auto *to = static_cast<uint16_t *>(inner.get_data_handle());
      return Fused([&](int64_t hw, int64_t c, int64_t a, int64_t b) { BlockedHalfToNhwcBf16(h, to, hw, c, a, b); });
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
        Split(n, [&](int64_t a, int64_t b) { H2B512(h + a, to16 + a, b - a); });
      else if (stage == kFloatHalfBf16)
        Split(n, [&](int64_t a, int64_t b) { F2H2B512(f + a, to16 + a, b - a); });
      else
        AmpZooRoundThroughHalf(f, to32, n);
      p = staged.data();
    }
    user.set_data_handle(p);
    if (reorder) to_inner.execute(RT().stream, user, inner);
  }
  void Bind(void *p) {  // an output (fp32 in the kernel): it writes here, or into `inner` and Out() reorders
    out = p;
    if (!fused) user.set_data_handle(stage == kNone ? p : static_cast<void *>(staged.data()));
  }
  void Out() {
    if (fused) {
      RT().stream.wait();
      const auto *f = static_cast<const float *>(inner.get_data_handle());
      auto *to = static_cast<uint16_t *>(out);
      return Fused([&](int64_t hw, int64_t c, int64_t a, int64_t b) { NhwcFloatToBlockedHalf(f, to, hw, c, a, b); });
    }
    if (reorder) to_user.execute(RT().stream, inner, user);
    if (stage == kNone) return;
    RT().stream.wait();
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
    const char *env = std::getenv("AMP_ZOO_CONV_MATMUL_DW");  // "0": oneDNN's direct kernel (tests compare)
    const int64_t plane = yd[2] * yd[3];
    const bool wide = !OneDnnRunsAmx() && (s == 2 || (s == 1 && plane <= 196));
    return !(env && !std::strcmp(env, "0")) && ((s == 1 && plane <= 64) || wide) && xl == tag::nChw16c &&
           yl == tag::nChw16c && wd[2] * wd[3] > 1;
  }
  // Where the direct kernel runs on oneDNN's OpenMP build (no AMX, Conv::OmpWeights), it beats the matmul on
  // stride-1 planes of 64 positions or more and stride-2 planes of more than 64 (ResNet-34's 8x8 and 14x14
  // stride-1 layers, 1.25-1.29 times the forward pass's time against 1.49-1.51; docs/benchmarks.md, tenth
  // round); the matmul stays for the smaller planes (7x7 and 4x4: 1.8-2.1 against 2.4-3.3)
  static bool OpenMpFirst(const memory::dims &yd, int64_t s) {
    const int64_t plane = yd[2] * yd[3];
    return !OneDnnRunsAmx() && (s == 1 ? plane >= 64 : plane > 64);
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
    auto &e = RT().engine;
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
      RT().pool.parallel_for(RT().pool.get_num_threads(),
                             [&](int t, int m) { f(count * t / m, count * (t + 1) / m); });
    };
    Split(static_cast<int64_t>(xb.size()), [&](int64_t i, int64_t j) { H2B512(x + i, xb.data() + i, j - i); });
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
        H2B512(dy + t * plane * 16, block.data(), plane * 16);
        for (int64_t l = 0; l < 16; ++l) {
          uint16_t *row = dyt.data() + (cb * 16 + l) * rows + img * plane;
          for (int64_t i = 0; i < plane; ++i) row[i] = block[i * 16 + l];
        }
      }
    });
    mm.execute(RT().stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    RT().stream.wait();
    threads(oc, [&](int64_t o0, int64_t o1) {  // (kh, kw, ic) -> OIHW, rounded to fp16 once
      std::vector<float> t(k);
      for (int64_t o = o0; o < o1; ++o) {
        const float *from = dw.data() + o * k;
        for (int64_t ci = 0; ci < ic; ++ci)
          for (int64_t ij = 0; ij < kh * kw; ++ij) t[ci * kh * kw + ij] = from[ij * ic + ci];
        if (half)
          AmpZooFloatToHalfHere(t.data(), static_cast<uint16_t *>(dw_out) + o * k, k);
        else
          RoundThroughHalf(t.data(), static_cast<float *>(dw_out) + o * k, k);
      }
    });
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
    RT().stream.wait();
    const auto *xb = static_cast<const uint16_t *>(x_w.inner.get_data_handle());
    const auto *dyb = static_cast<const uint16_t *>(dy.get_data_handle());
    auto *out = static_cast<float *>(dw.inner.get_data_handle());
    const int64_t n = omp_from.back(), x_img = x_w.inner.get_desc().get_size() / 2 / n,
                  y_img = dy.get_desc().get_size() / 2 / n, size = dw.inner.get_desc().get_size() / 4;
    std::atomic<bool> ok{true};
    RT().pool.parallel_for(static_cast<int>(omp_dw.size()), [&](int i, int) {
      float *to = i == 0 ? out : omp_parts.data() + (i - 1) * size;
      if (!AmpZooOmpWeightsRun(omp_dw[i], xb + omp_from[i] * x_img, dyb + omp_from[i] * y_img, to)) ok = false;
    });
    if (!ok) {
      FreeOmp();
      return false;
    }
    if (omp_dw.size() > 1)
      Split(size, [&](int64_t a, int64_t b) {
        for (size_t k = 1; k < omp_dw.size(); ++k) {
          const float *part = omp_parts.data() + (k - 1) * size;
          for (int64_t j = a; j < b; ++j) out[j] += part[j];
        }
      });
    return true;
  }

  // mode (Bf16Compute): 0 fp32 compute, 1 bf16 in all three passes, 2 bf16 in the two backward passes only
  Conv(const memory::dims &xd, const memory::dims &wd, const memory::dims &yd, tag xl, tag yl, int64_t s, int64_t p,
       dt xt, dt wt, int mode) {
    auto &e = RT().engine;
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
    const bool matmul = bf_bwd && xh && MatmulWeights::Applies(wd, yd, xl, yl, s);
    dnnl::convolution_backward_weights::primitive_desc bw(e, alg, any(xd, b_in), w_any32, any(yd, b_in), st, pad,
                                                          pad, hint);
    // bf16 blocked layers where oneDNN has no AMX: the direct kernel on OpenMP, when its library is there (on
    // the layers the matmul fits, only where it beats the matmul)
    if (bf_bwd && !OneDnnRunsAmx() && (!matmul || MatmulWeights::OpenMpFirst(yd, s)) &&
        bw.src_desc() == memory::desc(xd, dt::bf16, tag::nChw16c) &&
        bw.diff_dst_desc() == memory::desc(yd, dt::bf16, tag::nChw16c) &&
        bw.diff_weights_desc() == memory::desc(wd, dt::f32, tag::OIhw16i16o)) {
      const int64_t parts = std::min<int64_t>(RT().pool.get_num_threads(), xd[0]);
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
    auto &st = RT().stream;
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
    auto &st = RT().stream;
    if (dxp) {
      dy_d.In(dyp);
      w_d.In(wp);
      dx.Bind(dxp);
      bwd_data.execute(st, {{DNNL_ARG_DIFF_DST, dy_d.inner}, {DNNL_ARG_WEIGHTS, w_d.inner},
                            {DNNL_ARG_DIFF_SRC, dx.inner}});
      dx.Out();
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
  const int bf16 = xt == dt::f16 ? Bf16Compute() : 0;  // fp32 convolutions (O0) always multiply in fp32
  Key k{xd[0], xd[1], xd[2], xd[3], Block(xs, xr), wd[0], wd[2], wd[3], yd[2], yd[3], Block(ys, yr), s, p,
        static_cast<int64_t>(xt), static_cast<int64_t>(wt), bf16};
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
  const int threads = RT().pool.get_num_threads();
  RT().pool.parallel_for(threads, [&](int t, int k) { rows(n * blocks * t / k, n * blocks * (t + 1) / k); });
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
      memory src({d, t, from}, RT().engine, DNNL_MEMORY_NONE), dst({d, t, to}, RT().engine, DNNL_MEMORY_NONE);
      r.reset(new std::tuple<memory, memory, dnnl::reorder>(src, dst, dnnl::reorder(src, dst)));
    }
    auto &[src, dst, reorder] = *r;
    src.set_data_handle(params[0]);
    dst.set_data_handle(params[1]);
    reorder.execute(RT().stream, src, dst);
    RT().stream.wait();
  } catch (const dnnl::error &) {
    return 2;
  }
  return 0;
}

}  // namespace

// The pool, for the loops of norm.cc: fn(t, n) for t < n, on n threads at most
void AmpZooParallel(int n, const std::function<void(int, int)> &fn) { RT().pool.parallel_for(n, fn); }
int AmpZooThreads() { return RT().pool.get_num_threads(); }
dnnl::threadpool_interop::threadpool_iface *AmpZooPool() { return &RT().pool; }  // matmul.cc's sgemm
dnnl::engine &AmpZooEngine() { return RT().engine; }  // matmul.cc's bf16 matmuls
dnnl::stream &AmpZooStream() { return RT().stream; }
// fp16 (half) or fp32 -> bf16 bits on the pool's threads; fp32 goes through the nearest fp16 first, as an fp32
// master weight used by an fp16 layer does. Only where the bf16 mode runs (AVX512-BF16)
void AmpZooToBf16(const void *s, bool half, uint16_t *d, int64_t n) {
  Split(n, [&](int64_t i, int64_t j) {
    if (half)
      H2B512(static_cast<const uint16_t *>(s) + i, d + i, j - i);
    else
      F2H2B512(static_cast<const float *>(s) + i, d + i, j - i);
  });
}
// How an fp16 convolution multiplies now (Bf16Compute: 0, 1, 2), for cpu_kernels' tests and make doctor
extern "C" int AmpZooBf16Compute() { return Bf16Compute(); }
// The pool's threads (Threads()), for cpu_kernels.pool_threads
extern "C" int AmpZooPoolThreads() { return RT().pool.get_num_threads(); }

// MindSpore's graph mode gave two ops of one AOT function name one gradient between them (every 3x3 convolution
// took the first layer's weight-only backward), so each forward the Python side builds differently has a name of
// its own: First (the network's first layer: its gradient computes dw alone) and B (a blocked output: its shape
// function differs), all four running the same code
#define CONV_FWD(NAME, S, P)                                                                                   \
  extern "C" int NAME##_s##S##_p##P(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes,  \
                                     void *, void *) {                                                        \
    return Forward(n, params, ndims, shapes, dtypes, S, P);                                                   \
  }
#define CONV_OPS(S, P)                                                                                          \
  CONV_FWD(ConvFwd, S, P)                                                                                       \
  CONV_FWD(ConvFwdB, S, P)                                                                                      \
  CONV_FWD(ConvFwdFirst, S, P)                                                                                  \
  CONV_FWD(ConvFwdFirstB, S, P)                                                                                 \
  extern "C" int ConvBwd_s##S##_p##P(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, \
                                      void *, void *) {                                                       \
    return n == 5 ? Backward(n, params, ndims, shapes, dtypes, S, P) : 1;                                     \
  }                                                                                                           \
  extern "C" int ConvBwdW_s##S##_p##P(int n, void **params, int *ndims, int64_t **shapes,                    \
                                       const char **dtypes, void *, void *) {                                 \
    return n == 4 ? Backward(n, params, ndims, shapes, dtypes, S, P) : 1;                                     \
  }

CONV_OPS(1, 0)
CONV_OPS(1, 1)
CONV_OPS(1, 2)
CONV_OPS(1, 3)
CONV_OPS(2, 0)
CONV_OPS(2, 1)
CONV_OPS(2, 2)
CONV_OPS(2, 3)

// Two names for one op, each with its own gradient (see CONV_FWD)
extern "C" int ToBlocked(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return Reorder(n, params, ndims, shapes, dtypes);
}
extern "C" int ToPlain(int n, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return Reorder(n, params, ndims, shapes, dtypes);
}
