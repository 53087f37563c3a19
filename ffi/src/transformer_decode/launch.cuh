// The launch of a persistent decode kernel (this directory's and
// ../mamba_decode's): a CTA per SM, its shared memory set up once.
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <set>
#include <string>
#include <tuple>

#include "../common.h"

namespace jfo {
namespace transformer_decode {

// kernel(arg) on `grid` CTAs of `threads` threads with `shared` bytes of
// dynamic shared memory; `cooperative`: every CTA resident at once, which
// the grid barriers and polls rely on. `op` names the kernel in errors.
template <typename Arg>
ffi::Error LaunchPersistent(const char* op, void (*kernel)(Arg), const Arg& arg,
                            cudaStream_t stream, int device, int grid, int threads,
                            size_t shared, bool cooperative) {
  {
    // Once per kernel, device and shared-memory size: a call's host time is
    // time the GPU may wait for (one launch a decode step).
    static std::mutex mu;
    static std::set<std::tuple<const void*, int, size_t>> ready;
    std::lock_guard<std::mutex> lock(mu);
    const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, shared);
    if (!ready.count(key)) {
      // The most any launch may take, so that no later size is refused.
      JFO_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, DeviceInfoOf(device).max_shared));
      int per_sm = 0;
      JFO_CUDA_RETURN_IF_ERROR(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared));
      if (per_sm < 1) {
        return ffi::Error::Internal(std::string(op) + "the kernel does not fit an SM with " +
                                    std::to_string(shared) + " bytes of shared memory");
      }
      ready.insert(key);
    }
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid, 1, 1);
  config.blockDim = dim3(threads, 1, 1);
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeCooperative;
  attrs[0].val.cooperative = cooperative ? 1 : 0;
  config.attrs = attrs;
  config.numAttrs = 1;
  JFO_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, kernel, arg));
  return ffi::Error::Success();
}

}  // namespace transformer_decode
}  // namespace jfo
