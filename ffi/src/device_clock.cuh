// The GPU's global clock, in nanoseconds: what every bounded wait on the
// device reads (the transport's signals, the decode kernel's barriers).
#pragma once

#include <cstdint>

namespace jfo {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace jfo
