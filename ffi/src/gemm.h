// Row-major GEMM on cuBLASLt, loaded at run time (dlopen) so the extension
// imports where cuBLAS is absent. Leading dimensions are explicit so chunked
// schedules can address row blocks of larger matrices.
#pragma once

#include <string>

#include "common.h"

namespace jfo {

// D[M, N] = X[M, K] @ W[K, N] (+ C[M, N] when c != nullptr), fp32 accumulate.
struct GemmArgs {
  ffi::DataType dtype;
  int64_t m, n, k;
  const void* x; int64_t ldx;
  const void* w; int64_t ldw;
  const void* c; int64_t ldc;
  void* d; int64_t ldd;
};

// Creates this device's handle (call outside the execute stage).
ffi::Error GemmInit(int ordinal);
// With `only_if_new`, launches only if this problem has no plan yet (see
// Channel::Run: first launches must precede a call's waits).
ffi::Error Gemm(int ordinal, const GemmArgs& args, void* workspace,
                size_t workspace_bytes, cudaStream_t stream,
                bool only_if_new = false);
// Where to dlopen cuBLASLt from if the default soname is not loaded.
void SetCublasLtPath(const std::string& path);

}  // namespace jfo
