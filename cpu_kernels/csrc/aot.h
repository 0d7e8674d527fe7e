// The entry points MindSpore calls: an AOT custom op (ops.Custom(func="libcpu_kernels.so:Name", func_type="aot"),
// cpu_kernels/cells.py) is `extern "C" int Name(int nparam, void **params, int *ndims, int64_t **shapes,
// const char **dtypes, void *stream, void *extra)`: the op's inputs, then its outputs, each with its rank, shape
// and dtype name ("float32", "float16", ...); 0 is success. Each op file writes the work as a function of the
// first five (AOT_ARGS) and names its entry points with AMP_ZOO_AOT.
#pragma once
#include <cstdint>

// The arguments a kernel function takes, and the same passed on
#define AOT_ARGS int n, void **params, int *ndims, int64_t **shapes, const char **dtypes
#define AOT_PASS n, params, ndims, shapes, dtypes

// AMP_ZOO_AOT(Name, Call(AOT_PASS, ...)): the entry point Name, which returns that call
#define AMP_ZOO_AOT(NAME, CALL) \
  extern "C" int NAME(AOT_ARGS, void *, void *) { return CALL; }

// The elements of the op's first tensor (its shape's product)
inline int64_t AotCount(int *ndims, int64_t **shapes) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  return n;
}
