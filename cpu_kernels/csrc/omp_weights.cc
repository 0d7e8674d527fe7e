// A convolution's bf16 weight gradient in a oneDNN built on OpenMP (conv.cc's direct backward-weights pass).
//
// MindSpore's libdnnl runs oneDNN's threadpool runtime. There oneDNN's direct bf16 backward-weights kernel
// (jit_bf16:avx512_core_bf16) cannot share one transposition of x and dy between its threads (a build flag,
// DNNL_THR_SYNC), so it transposes them again for every pair of 16-channel blocks it computes. Built on OpenMP
// (the runtime PyTorch's oneDNN uses) the same kernel transposes each once (docs/benchmarks.md, ninth round). This
// file loads such a build (onednn-cpu-gomp from PyPI, linked beside the extension by cpu_kernels.build as
// libdnnl_omp.so) with RTLD_DEEPBIND, so it binds to itself and not to
// MindSpore's oneDNN beside it, and calls its C API. conv.cc hands it x and dy in bf16 and dw in fp32, in the
// blocked layouts its own backward-weights pass chose; the result is the same kernel's, summed in another order.
// Where the library is missing or refuses a shape, conv.cc runs its own pass. runtime.cpu_weight_grad=threadpool
// turns it off.
#include <dlfcn.h>
#include <unistd.h>
#include <oneapi/dnnl/dnnl.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "runtime.h"

// exported by oneDNN 3, not in its public headers (its graph API declares it the same way)
extern "C" dnnl_status_t dnnl_memory_desc_create_with_string_tag(dnnl_memory_desc_t *, int, const dnnl_dims_t,
                                                                 dnnl_data_type_t, const char *);

namespace {

#define AMP_ZOO_OMP_FNS(X)                            \
  X(dnnl_version)                                     \
  X(dnnl_engine_create)                               \
  X(dnnl_stream_create)                               \
  X(dnnl_stream_wait)                                 \
  X(dnnl_stream_destroy)                              \
  X(dnnl_memory_desc_create_with_tag)                 \
  X(dnnl_memory_desc_destroy)                         \
  X(dnnl_convolution_forward_primitive_desc_create)   \
  X(dnnl_convolution_backward_weights_primitive_desc_create) \
  X(dnnl_primitive_desc_query)                        \
  X(dnnl_primitive_desc_destroy)                      \
  X(dnnl_primitive_create)                            \
  X(dnnl_primitive_destroy)                           \
  X(dnnl_primitive_execute)                           \
  X(dnnl_memory_create)                               \
  X(dnnl_memory_set_data_handle)                      \
  X(dnnl_memory_destroy)                              \
  X(dnnl_memory_desc_create_with_string_tag)

struct Library {
#define AMP_ZOO_OMP_FIELD(name) decltype(&::name) name = nullptr;
  AMP_ZOO_OMP_FNS(AMP_ZOO_OMP_FIELD)
#undef AMP_ZOO_OMP_FIELD
  void (*omp_set_num_threads)(int) = nullptr;
  int (*omp_get_max_threads)() = nullptr;
  dnnl_engine_t engine = nullptr;
  std::string status;  // what runs, or why not
  bool ok = false;

  Library() {
    Dl_info self;
    if (!dladdr(reinterpret_cast<void *>(&AnchorForDladdr), &self) || !self.dli_fname) {
      status = "not found (dladdr)";
      return;
    }
    std::string path(self.dli_fname);
    path = path.substr(0, path.rfind('/') + 1) + "libdnnl_omp.so";
    if (access(path.c_str(), F_OK) != 0) {
      status = "not installed (" + path + ")";
      return;
    }
    void *h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (!h) {
      const char *why = dlerror();
      status = "refused: " + std::string(why ? why : path);
      return;
    }
#define AMP_ZOO_OMP_LOAD(name) name = reinterpret_cast<decltype(&::name)>(dlsym(h, #name));
    AMP_ZOO_OMP_FNS(AMP_ZOO_OMP_LOAD)
#undef AMP_ZOO_OMP_LOAD
    omp_set_num_threads = reinterpret_cast<void (*)(int)>(dlsym(h, "omp_set_num_threads"));
    omp_get_max_threads = reinterpret_cast<int (*)()>(dlsym(h, "omp_get_max_threads"));
    bool all = omp_set_num_threads && omp_get_max_threads;
#define AMP_ZOO_OMP_CHECK(name) all = all && name;
    AMP_ZOO_OMP_FNS(AMP_ZOO_OMP_CHECK)
#undef AMP_ZOO_OMP_CHECK
    if (!all) {
      status = "refused: " + path + " lacks part of oneDNN 3's C API";
      dlclose(h);
      return;
    }
    const dnnl_version_t *v = dnnl_version();
    const std::string version = std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                                std::to_string(v->patch);
    // the release requirements-data.txt pins (onednn-cpu-gomp==2023.2.0): its C API, and the values of the enums
    // this file passes, are the ones it was checked against; another release is refused, not trusted
    if (v->major != 3 || v->minor != 2 || v->cpu_runtime != DNNL_RUNTIME_OMP) {
      status = "refused: " + path + " is oneDNN " + version + ", not the pinned oneDNN 3.2 on OpenMP";
      dlclose(h);
      return;
    }
    if (dnnl_engine_create(&engine, dnnl_cpu, 0) != dnnl_success) {
      status = "refused: its CPU engine failed";
      return;
    }
    status = "oneDNN " + version + " (OpenMP)";
    ok = true;
  }
  static void AnchorForDladdr() {}
};

Library &Lib() {
  static Library lib;
  return lib;
}

}  // namespace

// One backward-weights primitive of the OpenMP build, on one thread. conv.cc runs one per pool thread, each on
// its share of the batch, and sums their dw: with one thread there is no OpenMP team, so no libgomp worker spins
// after it on cores the pool needs next (libgomp reads its spin count once, when MindSpore loads it), and oneDNN's
// one-thread kernel transposes x and dy once. Tags are oneDNN's string tags ("aBcd16b": nChw16c).
struct AmpZooOmpWeights {
  dnnl_stream_t stream = nullptr;
  dnnl_primitive_t prim = nullptr;
  dnnl_memory_t x = nullptr, dy = nullptr, dw = nullptr;
};

namespace {

// Runs f with this thread's OpenMP thread count at 1, as oneDNN reads it (omp_get_max_threads), then restores it
template <typename F>
auto OneThread(Library &L, F f) {
  struct Restore {
    Library &L;
    int was;
    ~Restore() { L.omp_set_num_threads(was); }
  } restore{L, L.omp_get_max_threads()};
  L.omp_set_num_threads(1);
  return f();
}

void Destroy(Library &L, AmpZooOmpWeights *w) {
  for (auto m : {w->x, w->dy, w->dw})
    if (m) L.dnnl_memory_destroy(m);
  if (w->prim) L.dnnl_primitive_destroy(w->prim);
  if (w->stream) L.dnnl_stream_destroy(w->stream);
  delete w;
}

}  // namespace

// nullptr where the library is missing, or gives these shapes and layouts no kernel named impl (conv.cc's own)
extern "C" AmpZooOmpWeights *AmpZooOmpWeightsMake(const int64_t *xd, const int64_t *wd, const int64_t *yd,
                                                  int64_t s, int64_t p, const char *x_tag, const char *dy_tag,
                                                  const char *dw_tag, const char *impl) {
  Library &L = Lib();
  if (!L.ok) return nullptr;
  return OneThread(L, [&]() -> AmpZooOmpWeights * {
    dnnl_dims_t x_dims, w_dims, y_dims, st{s, s}, dil{0, 0}, pad{p, p};
    for (int i = 0; i < 4; ++i) x_dims[i] = xd[i], w_dims[i] = wd[i], y_dims[i] = yd[i];
    dnnl_memory_desc_t xm = nullptr, dym = nullptr, dwm = nullptr, wm = nullptr;
    dnnl_primitive_desc_t hint = nullptr, pd = nullptr;
    AmpZooOmpWeights *out = nullptr;
    bool ok = L.dnnl_memory_desc_create_with_string_tag(&xm, 4, x_dims, dnnl_bf16, x_tag) == dnnl_success &&
              L.dnnl_memory_desc_create_with_string_tag(&dym, 4, y_dims, dnnl_bf16, dy_tag) == dnnl_success &&
              L.dnnl_memory_desc_create_with_string_tag(&dwm, 4, w_dims, dnnl_f32, dw_tag) == dnnl_success &&
              L.dnnl_memory_desc_create_with_tag(&wm, 4, w_dims, dnnl_bf16, dnnl_format_tag_any) == dnnl_success &&
              L.dnnl_convolution_forward_primitive_desc_create(&hint, L.engine, dnnl_forward_training,
                                                               dnnl_convolution_direct, xm, wm, nullptr, dym, st,
                                                               dil, pad, pad, nullptr) == dnnl_success &&
              L.dnnl_convolution_backward_weights_primitive_desc_create(&pd, L.engine, dnnl_convolution_direct,
                                                                        xm, dwm, nullptr, dym, st, dil, pad, pad,
                                                                        hint, nullptr) == dnnl_success;
    const char *got = nullptr;
    if (ok) ok = L.dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &got) == dnnl_success && got &&
                 !std::strcmp(got, impl);
    if (ok) {
      out = new (std::nothrow) AmpZooOmpWeights;
      ok = out && L.dnnl_stream_create(&out->stream, L.engine, dnnl_stream_default_flags) == dnnl_success &&
           L.dnnl_primitive_create(&out->prim, pd) == dnnl_success &&
           L.dnnl_memory_create(&out->x, xm, L.engine, DNNL_MEMORY_NONE) == dnnl_success &&
           L.dnnl_memory_create(&out->dy, dym, L.engine, DNNL_MEMORY_NONE) == dnnl_success &&
           L.dnnl_memory_create(&out->dw, dwm, L.engine, DNNL_MEMORY_NONE) == dnnl_success;
      if (!ok && out) Destroy(L, out), out = nullptr;
    }
    if (pd) L.dnnl_primitive_desc_destroy(pd);
    if (hint) L.dnnl_primitive_desc_destroy(hint);
    for (auto m : {xm, dym, dwm, wm})
      if (m) L.dnnl_memory_desc_destroy(m);
    return out;
  });
}

// dw = the weight gradient of x and dy (its share of the batch), on the calling thread; false if oneDNN failed
extern "C" bool AmpZooOmpWeightsRun(AmpZooOmpWeights *w, const void *x, const void *dy, void *dw) {
  Library &L = Lib();
  L.dnnl_memory_set_data_handle(w->x, const_cast<void *>(x));
  L.dnnl_memory_set_data_handle(w->dy, const_cast<void *>(dy));
  L.dnnl_memory_set_data_handle(w->dw, dw);
  dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, w->x}, {DNNL_ARG_DIFF_DST, w->dy}, {DNNL_ARG_DIFF_WEIGHTS, w->dw}};
  return OneThread(L, [&] {
    return L.dnnl_primitive_execute(w->prim, w->stream, 3, args) == dnnl_success &&
           L.dnnl_stream_wait(w->stream) == dnnl_success;
  });
}

// frees what AmpZooOmpWeightsMake made (nullptr: nothing)
extern "C" void AmpZooOmpWeightsFree(AmpZooOmpWeights *w) {
  if (w) Destroy(Lib(), w);
}

// "oneDNN 3.2.0 (OpenMP)", or why not (make doctor, cpu_kernels.weight_gradients)
extern "C" const char *AmpZooOmpWeightsStatus() {
  static const std::string on_amx = "not used: MindSpore's oneDNN runs AMX here, channels-last";
  static const std::string off = "off (runtime.cpu_weight_grad=threadpool)";
  return AmpZooOneDnnRunsAmx() ? on_amx.c_str() : !AmpZooOpenMpWeights() ? off.c_str() : Lib().status.c_str();
}
