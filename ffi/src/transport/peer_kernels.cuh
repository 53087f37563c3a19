// Device side of the peer transport: the bounded flag wait and the NaN fill
// after a timeout. Included by peer.cu only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jfo {
namespace internal {

// Filled by a wait kernel that timed out, read by the host on the next call.
struct TimeoutRecord {
  volatile int32_t set;
  int32_t op, rank, ordinal, peer_rank, peer_ordinal, timeout_ms;
  uint32_t expected, seen;
};

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];"
               : "=r"(v) : "l"(p) : "memory");
  return v;
}

// One thread: a spinning CTA must not starve the GEMM (or NCCL) of SMs.
__global__ void WaitFlagKernel(const uint32_t* flag, uint32_t expected,
                               uint64_t timeout_ns, uint32_t* fail_call,
                               uint32_t call_id, TimeoutRecord* record,
                               TimeoutRecord info) {
  const uint64_t start = GlobalTimerNs();
  uint32_t seen;
  for (;;) {
    seen = LoadAcquire(flag);
    if (static_cast<int32_t>(seen - expected) >= 0) return;
    // Another wait of this call already timed out: stop, outputs are NaN.
    if (*reinterpret_cast<volatile uint32_t*>(fail_call) == call_id) return;
    if (GlobalTimerNs() - start > timeout_ns) break;
  }
  if (atomicExch(fail_call, call_id) == call_id) return;
  record->op = info.op;
  record->rank = info.rank;
  record->ordinal = info.ordinal;
  record->peer_rank = info.peer_rank;
  record->peer_ordinal = info.peer_ordinal;
  record->timeout_ms = info.timeout_ms;
  record->expected = expected;
  record->seen = seen;
  __threadfence_system();
  record->set = 1;
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
