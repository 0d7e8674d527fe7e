// What every op file shares (runtime.cc): the thread pool oneDNN's threadpool runtime runs on, its engine and
// stream, the fp16 and bf16 conversions over arrays, what the CPU and oneDNN's ISA allow, and the kernels'
// settings. The op files (conv.cc, pool.cc, norm.cc, ...) include this header and nothing of each other.
#pragma once
#include <oneapi/dnnl/dnnl.hpp>
#include <oneapi/dnnl/dnnl_threadpool_iface.hpp>

#include <cstdint>
#include <functional>

// The pool: fn(t, n) for t < n on at most AmpZooThreads() threads, the caller's included; AmpZooSplit runs
// f(begin, end) over [0, n) in one piece a thread when n is large enough to pay for waking them
dnnl::threadpool_interop::threadpool_iface *AmpZooPool();
int AmpZooThreads();
void AmpZooParallel(int n, const std::function<void(int, int)> &fn);
void AmpZooSplit(int64_t n, const std::function<void(int64_t, int64_t)> &f);
// oneDNN's CPU engine, and the stream that runs its primitives on the pool
dnnl::engine &AmpZooEngine();
dnnl::stream &AmpZooStream();

// fp16 bits <-> fp32 over n elements: on the pool's threads, or on this thread (Here); fp32 rounded to the
// nearest fp16 values (d may be s). The conversion is AVX-512, F16C or portable code (AmpZooHalfIsa: 2, 1, 0)
void AmpZooHalfToFloat(const uint16_t *s, float *d, int64_t n);
void AmpZooFloatToHalf(const float *s, uint16_t *d, int64_t n);
void AmpZooHalfToFloatHere(const uint16_t *s, float *d, int64_t n);
void AmpZooFloatToHalfHere(const float *s, uint16_t *d, int64_t n);
void AmpZooRoundThroughHalf(const float *s, float *d, int64_t n);
void AmpZooRoundThroughHalfHere(const float *s, float *d, int64_t n);
int AmpZooHalfIsa();

// bf16, only where AmpZooCompute() is not 0 (the CPU has AVX512-BF16): fp16 (half) or fp32 -> bf16 bits on the
// pool's threads, fp32 through the nearest fp16 first, as an fp32 master weight used by an fp16 layer is; the same
// on this thread; and the fp16 activations of a blocked-layout layer to and from the channels-last tensors of
// oneDNN's AMX kernels in one pass each way (rows [r0, r1) of the n*hw positions, c channels in blocks of 16)
void AmpZooToBf16(const void *s, bool half, uint16_t *d, int64_t n);
void AmpZooHalfToBf16Here(const uint16_t *s, uint16_t *d, int64_t n);
void AmpZooFloatToBf16Here(const float *s, uint16_t *d, int64_t n);
void AmpZooBlockedHalfToNhwcBf16(const uint16_t *x, uint16_t *d, int64_t hw, int64_t c, int64_t r0, int64_t r1);
void AmpZooNhwcFloatToBlockedHalf(const float *y, uint16_t *d, int64_t hw, int64_t c, int64_t r0, int64_t r1);

// A (1,) scale tensor's value: fp32, or fp16 (PyNative casts a Cell's tensors); NaN if neither
float AmpZooScale(const char *dtype, int ndim, const int64_t *shape, const void *p);

// How fp16 convolutions and Dense layers multiply now: 0 fp32, 1 bf16, 2 bf16 in the backward passes only (each
// only where the CPU has AVX512-BF16 under oneDNN's ISA cap); whether oneDNN runs AMX here
int AmpZooCompute();
bool AmpZooOneDnnRunsAmx();
// Whether a small bf16 weight gradient may run as one matmul, and the direct one in oneDNN's OpenMP build
// (runtime.cpu_weight_grad, through cpu_kernels.configure)
bool AmpZooMatmulWeights();
bool AmpZooOpenMpWeights();

// A bf16 convolution's weight gradient in the OpenMP build of oneDNN (omp_weights.cc): made for one shape and
// layout (nullptr where that oneDNN is not loaded or cannot), run (false: it could not), freed
struct AmpZooOmpWeights;
extern "C" AmpZooOmpWeights *AmpZooOmpWeightsMake(const int64_t *xd, const int64_t *wd, const int64_t *yd,
                                                  int64_t s, int64_t p, const char *x_tag, const char *dy_tag,
                                                  const char *dw_tag, const char *impl);
extern "C" bool AmpZooOmpWeightsRun(AmpZooOmpWeights *w, const void *x, const void *dy, void *dw);
extern "C" void AmpZooOmpWeightsFree(AmpZooOmpWeights *w);
