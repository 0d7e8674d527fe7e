// oneDNN's bf16 convolution passes on ResNet-34's shapes, timed standalone on two threads, under the two threading
// runtimes oneDNN is built with: MindSpore 2.10's bundled libdnnl 3.10 (threadpool runtime, on a pool of our own,
// conv.cc's Pool) and onednn-cpu-gomp 2023.2.0 from PyPI (oneDNN 3.2, GNU OpenMP: the runtime PyTorch's oneDNN
// uses). Median of 30 runs of each pass, after 3 warm-up runs; inputs in the layouts the kernels choose.
//
// Built by hand, not by the project (onednn-cpu-gomp is not a dependency):
//   pip download --no-deps onednn-cpu-gomp==2023.2.0 && unzip onednn_cpu_gomp-*.whl -d gomp
//   OpenMP:     g++ -O2 -std=c++17 -DOMP -I<omp config> -I.venv/include onednn_runtime.cc -o omp \
//                 -Lgomp/onednn_cpu_gomp-2023.2.0.data/data/lib -l:libdnnl.so.3 -Wl,-rpath,<that lib> -fopenmp
//   threadpool: g++ -O2 -std=c++17 -I<threadpool config> -I.venv/include onednn_runtime.cc -o tp \
//                 -L<mindspore/lib> -l:libdnnl.so.3 -Wl,-rpath,<mindspore/lib> -pthread
// where <... config> holds oneapi/dnnl/dnnl_config.h with DNNL_CPU_RUNTIME and DNNL_CPU_THREADING_RUNTIME set to
// DNNL_RUNTIME_OMP or DNNL_RUNTIME_THREADPOOL (cpu_kernels/build.py writes the threadpool one), and pool.inc is
// conv.cc's Pool class. Run: OMP_NUM_THREADS=2 ./omp N C H OC; ./tp N C H OC (3x3, stride 1, padding 1).
#include <oneapi/dnnl/dnnl.hpp>
#ifndef OMP
#include <oneapi/dnnl/dnnl_threadpool.hpp>
#include <oneapi/dnnl/dnnl_threadpool_iface.hpp>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
namespace {
#include "pool.inc"
}
#endif
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
using namespace dnnl; using tag = memory::format_tag; using dt = memory::data_type;
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char **argv) {
  int N = atoi(argv[1]), C = atoi(argv[2]), H = atoi(argv[3]), OC = atoi(argv[4]);
  engine e(engine::kind::cpu, 0);
#ifdef OMP
  stream s(e);
#else
  static Pool pool(2, 200);
  stream s = threadpool_interop::make_stream(e, &pool);
#endif
  memory::dims st{1, 1}, pad{1, 1};
  auto any = [](memory::dims d, dt t) { return memory::desc(d, t, tag::any); };
  memory::dims xd{N, C, H, H}, wd{OC, C, 3, 3}, yd{N, OC, H, H};
  auto alg = algorithm::convolution_direct;
  convolution_forward::primitive_desc f(e, prop_kind::forward_training, alg, any(xd, dt::bf16), any(wd, dt::bf16), any(yd, dt::f32), st, pad, pad);
  convolution_forward::primitive_desc hint(e, prop_kind::forward_training, alg, any(xd, dt::bf16), any(wd, dt::bf16), any(yd, dt::bf16), st, pad, pad);
  convolution_backward_data::primitive_desc bd(e, alg, any(xd, dt::f32), any(wd, dt::bf16), any(yd, dt::bf16), st, pad, pad, hint);
  convolution_backward_weights::primitive_desc bw(e, alg, any(xd, dt::bf16), any(wd, dt::f32), any(yd, dt::bf16), st, pad, pad, hint);
  auto fill = [&](memory m) { auto *q = (uint16_t*)m.get_data_handle(); size_t n = m.get_desc().get_size()/2; for (size_t i=0;i<n;++i) q[i]=0x3f80 ^ (i & 0x7f); return m; };
  memory fx = fill(memory(f.src_desc(), e)), fw = fill(memory(f.weights_desc(), e)), fy(f.dst_desc(), e);
  memory ddy = fill(memory(bd.diff_dst_desc(), e)), dw = fill(memory(bd.weights_desc(), e)), ddx(bd.diff_src_desc(), e);
  memory wx = fill(memory(bw.src_desc(), e)), wdy = fill(memory(bw.diff_dst_desc(), e)), wdw(bw.diff_weights_desc(), e);
  convolution_forward pf(f); convolution_backward_data pb(bd); convolution_backward_weights pw(bw);
  auto time = [&](auto run) { std::vector<double> t; for (int i = 0; i < 33; ++i) { double a = now(); run(); s.wait(); if (i >= 3) t.push_back(now() - a); } std::sort(t.begin(), t.end()); return t[15] * 1e3; };
  double a = time([&] { pf.execute(s, {{DNNL_ARG_SRC, fx}, {DNNL_ARG_WEIGHTS, fw}, {DNNL_ARG_DST, fy}}); });
  double b = time([&] { pb.execute(s, {{DNNL_ARG_DIFF_DST, ddy}, {DNNL_ARG_WEIGHTS, dw}, {DNNL_ARG_DIFF_SRC, ddx}}); });
  double c = time([&] { pw.execute(s, {{DNNL_ARG_SRC, wx}, {DNNL_ARG_DIFF_DST, wdy}, {DNNL_ARG_DIFF_WEIGHTS, wdw}}); });
  printf("%-6s N%d C%d H%d: fwd %.2f bwd_data %.2f bwd_weights %.2f ms (%s)\n",
#ifdef OMP
  "omp",
#else
  "tpool",
#endif
  N, C, H, a, b, c, bw.impl_info_str());
}
