// The runtime every op file shares (runtime.h): the thread pool, oneDNN's engine and stream on it, the fp16 and
// bf16 conversions over arrays, the CPU's and oneDNN's ISA, and how fp16 layers multiply (AmpZooCompute).
//
// The op files link MindSpore's bundled libdnnl (its threadpool runtime), so oneDNN runs its primitives on this
// pool of our own threads, not on MindSpore's.
#include <immintrin.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>
#include <oneapi/dnnl/dnnl.hpp>
#include <oneapi/dnnl/dnnl_threadpool.hpp>
#include <oneapi/dnnl/dnnl_threadpool_iface.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "half.h"
#include "runtime.h"

namespace {

// The CPU time other processes take on the cores this process may run on, in cores, since the last call: the
// busy time of those cores (/proc/stat: user, nice, system, irq, softirq, steal) less this process's own
// (getrusage). -1 where /proc/stat cannot be read, or the last call was more than `fresh` ago (the pool was idle
// meanwhile: what ran then says nothing of now). Its own threads (data loading, MindSpore's) never count.
class Others {
 public:
  double Cores(std::chrono::steady_clock::duration fresh) {
    const double busy = BusySeconds(), mine = OwnSeconds();
    const auto now = std::chrono::steady_clock::now();
    double cores = -1;
    if (busy >= 0 && last_busy_ >= 0 && now - last_ <= fresh) {
      const double wall = std::chrono::duration<double>(now - last_).count();
      if (wall > 0) cores = std::max(0.0, (busy - last_busy_) - (mine - last_mine_)) / wall;
    }
    last_busy_ = busy, last_mine_ = mine, last_ = now;
    return cores;
  }

 private:
  static double OwnSeconds() {
    rusage use;
    if (getrusage(RUSAGE_SELF, &use) != 0) return 0;
    return use.ru_utime.tv_sec + use.ru_stime.tv_sec + 1e-6 * (use.ru_utime.tv_usec + use.ru_stime.tv_usec);
  }
  static double BusySeconds() {  // over the cores of this process's affinity mask
    cpu_set_t mask;
    if (sched_getaffinity(0, sizeof(mask), &mask) != 0) return -1;
    FILE *f = std::fopen("/proc/stat", "r");
    if (!f) return -1;
    static const double tick = 1.0 / std::max(1L, sysconf(_SC_CLK_TCK));
    char line[512];
    double busy = 0;
    bool any = false;
    while (std::fgets(line, sizeof(line), f)) {
      int cpu;
      unsigned long long user, nice, system, idle, iowait, irq, softirq, steal;
      if (std::sscanf(line, "cpu%d %llu %llu %llu %llu %llu %llu %llu %llu", &cpu, &user, &nice, &system, &idle,
                      &iowait, &irq, &softirq, &steal) != 9 ||
          cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &mask))
        continue;
      busy += tick * static_cast<double>(user + nice + system + irq + softirq + steal);
      any = true;
    }
    std::fclose(f);
    return any ? busy : -1;
  }
  double last_busy_ = -1, last_mine_ = 0;
  std::chrono::steady_clock::time_point last_;
};

// A fixed pool for oneDNN's threadpool runtime: the calling thread works too. A parallel region's n pieces are
// claimed one at a time by whichever thread comes first, the caller included, so a worker that has not started
// never holds the region up. Between regions a worker spins for a while (runtime.cpu_pool_spin_us, default 200 us),
// as OpenMP's threads do, then sleeps: a training step runs many short regions back to back, and waking a sleeping
// thread costs tens of microseconds.
//
// On a shared machine (another process busy on these cores) the pool's threads would compete with that process
// for the cores, and a region would wait for whichever of them the scheduler set aside: a worker preempted holding a
// piece, or the caller itself. So every kWindow the pool measures how many cores other processes took (Others) and
// lets only as many of its threads work as the cores left (at least the caller); the others sleep. A region's pieces
// are the same either way, so are its numbers. On 2 cores beside one busy process the caller runs every region
// alone: a step costs what it costs on one thread, as OpenMP's dynamic adjustment (OMP_DYNAMIC) would have it.
class Pool : public dnnl::threadpool_interop::threadpool_iface {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr auto kWindow = std::chrono::milliseconds(200);

  explicit Pool(int n, int spin_us) : n_(n < 1 ? 1 : n), active_(n_), spin_(std::chrono::microseconds(spin_us)) {
    for (int t = 1; t < n_; ++t) workers_.emplace_back([this, t] { Work(t); });
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
  // the windows in which other processes took a core or more of this pool's
  int busy() const { return found_busy_.load(std::memory_order_relaxed); }
  bool get_in_parallel() const override { return in_parallel_; }
  uint64_t get_flags() const override { return 0; }  // synchronous: parallel_for returns when all is done
  void parallel_for(int n, const std::function<void(int, int)> &fn) override {
    if (n <= 1 || n_ == 1 || in_parallel_) {
      for (int i = 0; i < n; ++i) fn(i, n);
      return;
    }
    Measure();
    if (active_.load(std::memory_order_relaxed) == 1) {  // the machine is busy: the caller alone
      in_parallel_ = true;
      for (int i = 0; i < n; ++i) fn(i, n);
      in_parallel_ = false;
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
    Claim(gen);
    if (!Spin([&] { return done_.load(std::memory_order_acquire) == n; })) {
      std::unique_lock<std::mutex> lk(m_);
      finished_.wait(lk, [&] { return done_.load(std::memory_order_acquire) == n; });
    }
    job_ = nullptr;
  }

 private:
  static constexpr uint64_t kGenMask = (uint64_t{1} << 24) - 1;
  static constexpr uint64_t kField = (uint64_t{1} << 20) - 1;

  // Once a window: the threads that may work, the cores other processes left (half a core or more counts as one)
  void Measure() {
    const auto now = Clock::now().time_since_epoch().count();
    if (now < next_.load(std::memory_order_relaxed) || !measuring_.try_lock()) return;
    std::lock_guard<std::mutex> lk(measuring_, std::adopt_lock);
    if (now < next_.load(std::memory_order_relaxed)) return;
    next_.store(now + std::chrono::duration_cast<Clock::duration>(kWindow).count(), std::memory_order_relaxed);
    const double others = others_.Cores(2 * kWindow);
    if (others < 0) {  // unknown, or the pool was idle: all its threads until the next window says otherwise
      active_.store(n_, std::memory_order_relaxed);
      return;
    }
    const int taken = static_cast<int>(others + 0.5);
    if (taken > 0) found_busy_.fetch_add(1, std::memory_order_relaxed);
    active_.store(std::max(1, n_ - taken), std::memory_order_relaxed);
  }
  // Claim and run pieces of region `gen` until none is left
  void Claim(uint64_t gen) {
    in_parallel_ = true;
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      const uint64_t n = (t >> 20) & kField, i = t & kField;
      if ((t >> 40) != gen || i >= n) break;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      (*job_)(static_cast<int>(i), static_cast<int>(n));  // the region is not done until this piece is: job_ holds
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<int>(n)) {
        std::lock_guard<std::mutex> lk(m_);  // the caller may be asleep on finished_
        finished_.notify_one();
      }
    }
    in_parallel_ = false;
  }
  // Busy-wait up to spin_ for ready(); false if it did not come
  template <typename F>
  bool Spin(F ready) const {
    if (spin_.count() == 0) return ready();
    const auto until = Clock::now() + spin_;
    for (int i = 1;; ++i) {
      if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      if (i % 64 == 0 && Clock::now() > until) return ready();
    }
  }
  // Worker t (1 .. n_-1): each region while it may work (t < active_), else it sleeps until the next
  void Work(int t) {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const bool may = t < active_.load(std::memory_order_relaxed);  // one that may not sleeps at once
      if (!may || !Spin([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
        std::unique_lock<std::mutex> lk(m_);
        wake_.wait(lk, [&] { return stop_ || generation_.load(std::memory_order_acquire) != seen; });
        if (stop_) return;
      }
      seen = generation_.load(std::memory_order_acquire);
      if (t < active_.load(std::memory_order_relaxed)) Claim(seen);
    }
  }
  int n_;
  std::atomic<int> active_;  // the threads that may work (the caller's included): n_ less the cores others take
  std::chrono::microseconds spin_;
  std::vector<std::thread> workers_;
  std::mutex m_, busy_, measuring_;
  std::condition_variable wake_, finished_;
  const std::function<void(int, int)> *job_ = nullptr;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> done_{0};
  std::atomic<int> found_busy_{0};
  std::atomic<int64_t> next_{0};  // Clock ticks: the next window's measurement
  Others others_;
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;
  static thread_local bool in_parallel_;
};
thread_local bool Pool::in_parallel_ = false;

// The kernels' settings, set by cpu_kernels.configure (AmpZooConfigure) when a network is built or configured,
// read where a kernel runs; the defaults are a network built outside a command's configure()
struct Settings {
  std::atomic<int> compute{0};    // asked for: 0 fp32, 1 bf16, 2 bf16 in the backward passes (Bf16Compute)
  std::atomic<int> half_isa{2};   // the highest conversion to use: 2 AVX-512, 1 F16C, 0 portable (HalfIsa)
  std::atomic<int> matmul_dw{1};  // a small bf16 weight gradient may run as one matmul (conv.cc's MatmulWeights)
  std::atomic<int> omp_dw{1};     // the direct one may run in oneDNN's OpenMP build (omp_weights.cc)
  int threads = 0;                // the pool's threads; 0: the cores this process may run on
  int spin_us = 200;              // how long an idle pool thread spins before it sleeps
};

Settings &Set() {
  static Settings s;
  return s;
}

// The pool's size: `asked`, else the cores this process may run on (its affinity mask, which msrun's core
// binding and taskset set; cpu_kernels.configure shares them among msrun's workers on one machine)
int Threads(int asked) {
  if (asked > 0) return asked;
  cpu_set_t mask;
  const int n = sched_getaffinity(0, sizeof(mask), &mask) == 0 ? CPU_COUNT(&mask)
                                                                 : static_cast<int>(std::thread::hardware_concurrency());
  return n > 0 ? n : 1;
}

// The pool, and the stream that runs oneDNN's primitives on it, made at first use with the settings, and made
// again by AmpZooConfigure when the threads or the spin change (between steps: no kernel runs meanwhile)
struct Runtime {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::unique_ptr<Pool> pool;
  dnnl::stream stream;
  int threads = 0, spin_us = 0;

  void Make(int n, int spin) {
    stream = dnnl::stream();
    pool.reset(new Pool(n, spin));
    stream = dnnl::threadpool_interop::make_stream(engine, pool.get());
    threads = n, spin_us = spin;
  }
};

std::mutex made_mutex;
bool made = false;

Runtime &RT() {
  static Runtime rt;
  static std::once_flag once;
  std::call_once(once, [] {
    std::lock_guard<std::mutex> lk(made_mutex);
    rt.Make(Threads(Set().threads), Set().spin_us);
    made = true;
  });
  return rt;
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

// which conversion this CPU runs: 2 AVX-512, 1 F16C, 0 portable, at most the setting's (the tests compare them)
int HalfIsa() {
  static const int best = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c") ? 2
           : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") ? 1 : 0;
  }();
  return std::max(0, std::min(best, Set().half_isa.load(std::memory_order_relaxed)));
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

// How fp16 convolutions and Dense layers (matmul.cc) multiply here (see conv.cc's top): 0 fp32; 1 bf16, 2 bf16
// in the backward passes only, as the settings ask (runtime.cpu_compute), each only where the CPU has AVX512-BF16
// under oneDNN's ISA cap. cpu_kernels.cpu_compute() is the same rule.
int Bf16Compute() {
  static const bool bf16 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("f16c") && OneDnnRunsBf16();
  }();
  return bf16 ? Set().compute.load(std::memory_order_relaxed) : 0;
}

// f(begin, end) over [0, n) in one piece per pool thread when n is large enough to pay for waking them
void Split(int64_t n, const std::function<void(int64_t, int64_t)> &f) {
  const int threads = n >= (1 << 16) ? RT().pool->get_num_threads() : 1;
  if (threads == 1) return f(0, n);
  RT().pool->parallel_for(threads, [&](int t, int k) {
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


// The pool, for the loops of norm.cc: fn(t, n) for t < n, on n threads at most
void AmpZooParallel(int n, const std::function<void(int, int)> &fn) { RT().pool->parallel_for(n, fn); }
int AmpZooThreads() { return RT().pool->get_num_threads(); }
dnnl::threadpool_interop::threadpool_iface *AmpZooPool() { return RT().pool.get(); }  // matmul.cc's sgemm
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
extern "C" int AmpZooPoolThreads() { return RT().pool->get_num_threads(); }
// The windows (0.2 s) in which other processes took a core or more of the pool's, for cpu_kernels.pool_busy
extern "C" int AmpZooPoolBusy() { return RT().pool->busy(); }

void AmpZooSplit(int64_t n, const std::function<void(int64_t, int64_t)> &f) { Split(n, f); }
void AmpZooRoundThroughHalfHere(const float *s, float *d, int64_t n) { RoundThroughHalf(s, d, n); }
void AmpZooHalfToBf16Here(const uint16_t *s, uint16_t *d, int64_t n) { H2B512(s, d, n); }
void AmpZooFloatToBf16Here(const float *s, uint16_t *d, int64_t n) { F2H2B512(s, d, n); }
void AmpZooBlockedHalfToNhwcBf16(const uint16_t *x, uint16_t *d, int64_t hw, int64_t c, int64_t r0, int64_t r1) {
  BlockedHalfToNhwcBf16(x, d, hw, c, r0, r1);
}
void AmpZooNhwcFloatToBlockedHalf(const float *y, uint16_t *d, int64_t hw, int64_t c, int64_t r0, int64_t r1) {
  NhwcFloatToBlockedHalf(y, d, hw, c, r0, r1);
}
int AmpZooCompute() { return Bf16Compute(); }

// A (1,) scale tensor's value: fp32, or fp16 where a precision flag cast it (PyNative casts a Cell's tensors); NaN
// if neither (softmax.cc and decode.cc read their scales with it)
float AmpZooScale(const char *dtype, int ndim, const int64_t *shape, const void *p) {
  if (ndim != 1 || shape[0] != 1) return NAN;
  if (!std::strcmp(dtype, "float32")) return *static_cast<const float *>(p);
  float f = NAN;
  if (!std::strcmp(dtype, "float16")) AmpZooHalfToFloatHere(static_cast<const uint16_t *>(p), &f, 1);
  return f;
}

bool AmpZooMatmulWeights() { return Set().matmul_dw.load(std::memory_order_relaxed) != 0; }
bool AmpZooOpenMpWeights() { return Set().omp_dw.load(std::memory_order_relaxed) != 0; }

// cpu_kernels.configure: the settings of the kernels that run from now on; the pool is made again when its
// threads or spin change. compute 0 fp32, 1 bf16, 2 bf16_backward; threads 0: the cores this process may run on
extern "C" void AmpZooConfigure(int compute, int threads, int spin_us, int half_isa, int matmul_dw, int omp_dw) {
  Settings &s = Set();
  s.compute = compute, s.half_isa = half_isa, s.matmul_dw = matmul_dw, s.omp_dw = omp_dw;
  s.threads = threads, s.spin_us = spin_us > 0 ? spin_us : 0;
  std::lock_guard<std::mutex> lk(made_mutex);
  const int n = Threads(s.threads);
  if (made && (RT().threads != n || RT().spin_us != s.spin_us)) RT().Make(n, s.spin_us);
}
