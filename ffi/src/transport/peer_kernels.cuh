// Device side of the peer transport: the bounded flag wait, the NaN fill
// after a timeout and the injected stall. Included by channel.cu only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "signal.cuh"

namespace jfo {
namespace internal {

// Thread 0 waits; one warp at most, as a spinning CTA must not starve the
// GEMM (or NCCL) of SMs. If the message is not there (the call failed), the
// block fills `missing_bytes` at `missing`, the receive slot's bytes that the
// call goes on to compute from, with 0xFF: NaN in every floating type. So
// what the call computes from a slot holding an earlier call's message, and
// may forward to its peers, is NaN, never plausible numbers.
__global__ void WaitFlagKernel(const uint32_t* flag, uint32_t expected,
                               WaitReport report, unsigned char* missing,
                               size_t missing_bytes) {
  __shared__ bool arrived;
  if (threadIdx.x == 0) arrived = signal::WaitChannelFlag(flag, expected, report);
  __syncthreads();
  if (arrived || missing == nullptr) return;
  // Whole elements (4 or 2 bytes) at a time where the range allows: a late
  // copy landing meanwhile leaves each element old, new or NaN, not mixed.
  const auto align = reinterpret_cast<uintptr_t>(missing) | missing_bytes;
  if ((align & 3) == 0) {
    auto* words = reinterpret_cast<uint32_t*>(missing);
    for (size_t i = threadIdx.x; i < missing_bytes / 4; i += blockDim.x) words[i] = ~0u;
  } else if ((align & 1) == 0) {
    auto* halves = reinterpret_cast<uint16_t*>(missing);
    for (size_t i = threadIdx.x; i < missing_bytes / 2; i += blockDim.x) halves[i] = 0xFFFF;
  } else {
    for (size_t i = threadIdx.x; i < missing_bytes; i += blockDim.x) missing[i] = 0xFF;
  }
}

// Holds the stream for `ns` (the "stall" of the fault-injection hook).
__global__ void SleepKernel(uint64_t ns) {
  const uint64_t start = signal::GlobalTimerNs();
  while (signal::GlobalTimerNs() - start < ns) {
  }
}

// Sets `words` 32-bit words to `value` (the Lamport slots' empty pattern).
__global__ void FillWordsKernel(uint32_t* p, size_t words, uint32_t value) {
  size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words;
       i += stride) {
    p[i] = value;
  }
}

template <typename T>
__global__ void FillIfFailedKernel(T* a, size_t na, T* b, size_t nb, T value,
                                   const uint32_t* fail_call,
                                   uint32_t call_id) {
  if (*fail_call != call_id) return;
  size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < na + nb;
       i += stride) {
    (i < na ? a[i] : b[i - na]) = value;
  }
}

}  // namespace internal
}  // namespace jfo
