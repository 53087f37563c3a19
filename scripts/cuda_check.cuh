// CHECK_CUDA(call): the standalone probes' error check; prints where and why,
// then exits.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(call)                                             \
  do {                                                               \
    cudaError_t e = (call);                                          \
    if (e != cudaSuccess) {                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__,         \
                   cudaGetErrorString(e));                           \
      std::exit(1);                                                  \
    }                                                                \
  } while (0)
