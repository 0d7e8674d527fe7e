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
// symmetric padding P. fp32 or fp16 tensors, fp32 compute. Primitives are cached by shape and dtype.
#include <oneapi/dnnl/dnnl.hpp>
#include <oneapi/dnnl/dnnl_threadpool.hpp>
#include <oneapi/dnnl/dnnl_threadpool_iface.hpp>

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

namespace {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

// A fixed pool for oneDNN's threadpool runtime: the calling thread works too. Between calls a worker first
// spins for a while (AMP_ZOO_POOL_SPIN_US, default 200 us), as OpenMP's threads do, then sleeps: a training step
// runs many short parallel regions back to back (reorders, kernels, BatchNorm channels), and waking a
// sleeping thread costs tens of microseconds each time. The caller waits for the workers the same way.
class Pool : public dnnl::threadpool_interop::threadpool_iface {
 public:
  explicit Pool(int n, int spin_us) : n_(n < 1 ? 1 : n), spin_(std::chrono::microseconds(spin_us)) {
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
  bool get_in_parallel() const override { return in_parallel_; }
  uint64_t get_flags() const override { return 0; }  // synchronous: parallel_for returns when all is done
  void parallel_for(int n, const std::function<void(int, int)> &fn) override {
    if (n <= 1 || n_ == 1 || in_parallel_) {
      for (int i = 0; i < n; ++i) fn(i, n);
      return;
    }
    std::lock_guard<std::mutex> one(busy_);  // one parallel region at a time
    {
      std::lock_guard<std::mutex> lk(m_);
      job_ = &fn;
      job_n_ = n;
      pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    Run(0);
    if (!Spin([this] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> lk(m_);
      done_.wait(lk, [this] { return pending_.load(std::memory_order_acquire) == 0; });
    }
    job_ = nullptr;
  }

 private:
  // Busy-wait up to spin_ for ready(); false if it did not come
  template <typename F>
  bool Spin(F ready) const {
    if (spin_.count() == 0) return ready();
    const auto until = std::chrono::steady_clock::now() + spin_;
    for (int i = 1;; ++i) {
      if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      if (i % 64 == 0 && std::chrono::steady_clock::now() > until) return ready();
    }
  }
  void Run(int t) {  // static split: oneDNN hands out one balanced chunk per thread, so thread t takes its own
    in_parallel_ = true;
    for (int i = t; i < job_n_; i += n_) (*job_)(i, job_n_);
    in_parallel_ = false;
  }
  void Work(int t) {
    uint64_t seen = 0;
    for (;;) {
      if (!Spin([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
        std::unique_lock<std::mutex> lk(m_);
        wake_.wait(lk, [&] { return stop_ || generation_.load(std::memory_order_acquire) != seen; });
        if (stop_) return;
      }
      seen = generation_.load(std::memory_order_acquire);
      Run(t);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lk(m_);  // the caller may be asleep on done_
        done_.notify_one();
      }
    }
  }
  int n_;
  std::chrono::microseconds spin_;
  std::vector<std::thread> workers_;
  std::mutex m_, busy_;
  std::condition_variable wake_, done_;
  const std::function<void(int, int)> *job_ = nullptr;
  int job_n_ = 0;
  std::atomic<int> pending_{0};
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;
  static thread_local bool in_parallel_;
};
thread_local bool Pool::in_parallel_ = false;

int Threads() {
  const char *env = std::getenv("AMP_ZOO_CONV_THREADS");
  int n = env ? std::atoi(env) : static_cast<int>(std::thread::hardware_concurrency());
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

// A tensor given in the user's plain layout, and the kernel's layout (the same buffer when they agree).
struct Arg {
  memory user, inner;
  dnnl::reorder to_inner, to_user;
  bool reorder = false;
  void Init(const memory::desc &plain, const memory::desc &want) {
    auto &e = RT().engine;
    user = memory(plain, e, DNNL_MEMORY_NONE);
    reorder = plain != want;
    inner = reorder ? memory(want, e) : user;
    if (reorder) {
      to_inner = dnnl::reorder(user, inner);
      to_user = dnnl::reorder(inner, user);
    }
  }
  void In(void *p) {  // user data into the kernel's layout
    user.set_data_handle(p);
    if (reorder) to_inner.execute(RT().stream, user, inner);
  }
  void Bind(void *p) {  // an output: the kernel writes here, or into `inner` and Out() reorders
    user.set_data_handle(p);
  }
  void Out() {
    if (reorder) to_user.execute(RT().stream, inner, user);
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

struct Conv {
  std::mutex m;
  dnnl::convolution_forward fwd;
  dnnl::convolution_backward_data bwd_data;
  dnnl::convolution_backward_weights bwd_weights;
  Arg x, w, y;             // forward
  Arg dy_d, w_d, dx;       // backward data
  Arg x_w, dy_w, dw;       // backward weights

  Conv(const memory::dims &xd, const memory::dims &wd, const memory::dims &yd, tag xl, tag yl, int64_t s, int64_t p,
       dt xt, dt wt) {
    auto &e = RT().engine;
    memory::dims st{s, s}, pad{p, p};
    // fp16 tensors (AMP) are converted by the reorders into and out of the fp32 kernel, as MindSpore's CPU
    // Conv2D casts around its fp32 kernel: y has x's dtype, dx x's, dw w's
    memory::desc x_plain(xd, xt, xl), w_plain(wd, wt, tag::oihw), y_plain(yd, xt, yl);
    memory::desc x_any(xd, dt::f32, tag::any), w_any(wd, dt::f32, tag::any), y_any(yd, dt::f32, tag::any);
    auto alg = dnnl::algorithm::convolution_direct;
    dnnl::convolution_forward::primitive_desc f(e, dnnl::prop_kind::forward_training, alg, x_any, w_any, y_any, st,
                                                pad, pad);
    dnnl::convolution_backward_data::primitive_desc bd(e, alg, x_any, w_any, y_any, st, pad, pad, f);
    dnnl::convolution_backward_weights::primitive_desc bw(e, alg, x_any, w_any, y_any, st, pad, pad, f);
    fwd = dnnl::convolution_forward(f);
    bwd_data = dnnl::convolution_backward_data(bd);
    bwd_weights = dnnl::convolution_backward_weights(bw);
    x.Init(x_plain, f.src_desc());
    w.Init(w_plain, f.weights_desc());
    y.Init(y_plain, f.dst_desc());
    dy_d.Init(y_plain, bd.diff_dst_desc());
    w_d.Init(w_plain, bd.weights_desc());
    dx.Init(x_plain, bd.diff_src_desc());
    x_w.Init(x_plain, bw.src_desc());
    dy_w.Init(y_plain, bw.diff_dst_desc());
    dw.Init(w_plain, bw.diff_weights_desc());
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
    x_w.In(xp);
    dw.Bind(dwp);
    // backward weights reads dy in its own layout; when that is backward data's, its reorder is reused
    bool shared = dxp && dy_w.reorder && dy_d.reorder && dy_w.inner.get_desc() == dy_d.inner.get_desc();
    if (!shared) dy_w.In(dyp);
    bwd_weights.execute(st, {{DNNL_ARG_SRC, x_w.inner}, {DNNL_ARG_DIFF_DST, shared ? dy_d.inner : dy_w.inner},
                             {DNNL_ARG_DIFF_WEIGHTS, dw.inner}});
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
  Key k{xd[0], xd[1], xd[2], xd[3], Block(xs, xr), wd[0], wd[2], wd[3], yd[2], yd[3], Block(ys, yr), s, p,
        static_cast<int64_t>(xt), static_cast<int64_t>(wt)};
  std::lock_guard<std::mutex> lk(m);
  auto &c = cache[k];
  if (!c) c.reset(new Conv(xd, wd, yd, xl, yl, s, p, xt, wt));
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

// x in one layout -> y, the same tensor in another (plain NCHW <-> blocked, fp32 or fp16): a oneDNN reorder
int Reorder(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  dt t = Dtype(dtypes[0]);
  if (nparam != 2 || t == dt::undef || Dtype(dtypes[1]) != t || !Rank(ndims[0]) || !Rank(ndims[1])) return 1;
  const tag from = Layout(Block(shapes[0], ndims[0])), to = Layout(Block(shapes[1], ndims[1]));
  const memory::dims d = Dims(shapes[0], ndims[0]);
  if (from == tag::undef || to == tag::undef || d != Dims(shapes[1], ndims[1])) return 1;
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
