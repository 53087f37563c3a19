// The decode kernel's waits and copies: the grid barrier, and the ring of
// shared-memory slots its weights stream through (TMA bulk copies, one
// mbarrier a slot). Every wait is bounded by %globaltimer.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstdio>

#include "../device_clock.cuh"
#include "params.cuh"

namespace jfo {
namespace transformer_decode {

__device__ __forceinline__ unsigned LoadAcquireGpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __noinline__ inline void TimedOut(const char* what, int layer, unsigned seen,
                                      unsigned expected) {
  printf("jax_flashoverlap transformer_decode: CTA %d timed out waiting for %s in layer %d "
         "(at %u of %u); trapping so that the step fails instead of returning wrong data\n",
         static_cast<int>(blockIdx.x), what, layer, seen, expected);
  __trap();
}

// One thread: until *counter >= target (other CTAs' atomicAdds after their
// writes), bounded by the timeout; their writes visible to it after.
__device__ inline void SpinUntilAtLeast(const Params& p, const unsigned* counter,
                                        unsigned target, const char* what, int layer) {
  const uint64_t start = GlobalTimerNs();
  unsigned seen;
  while ((seen = LoadAcquireGpu(counter)) < target) {
    if (GlobalTimerNs() - start > p.timeout_ns) TimedOut(what, layer, seen, target);
  }
  // The acquiring load, then the CTA's __syncthreads, order the others'
  // writes before the CTA's reads (as CUTLASS's grid barriers wait).
  if (!(p.options & kOrderedAtomics)) __threadfence();
}

// One thread, after a __syncthreads: *counter += value, releasing the
// CTA's writes before it (as CUTLASS's grid barriers do; no separate fence).
__device__ __forceinline__ void AddRelease(unsigned* counter, unsigned value) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(counter), "r"(value) : "memory");
}

// The same, returning the old value and acquiring the writes it saw released.
__device__ __forceinline__ unsigned AddAcquireRelease(unsigned* counter, unsigned value) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old) : "l"(counter), "r"(value) : "memory");
  return old;
}

// One thread, after a __syncthreads: counts the CTA's arrival, its writes
// before it released.
__device__ __forceinline__ void Arrive(const Params& p, unsigned* counter) {
  if (p.options & kOrderedAtomics) {
    AddRelease(counter, 1u);
  } else {
    __threadfence();
    atomicAdd(counter, 1u);
  }
}

// With stage_times 2: this layer's `event` of this CTA is `value`.
__device__ __forceinline__ void Record(const Params& p, int layer, int event, uint64_t value) {
  if (p.trace) {
    p.trace[(static_cast<size_t>(layer) * kMaxTraceCtas + blockIdx.x) * kTraceEvents + event] =
        value;
  }
}

// Thread 0, with stage_times 2: this layer's clock at `event`.
__device__ __forceinline__ void Mark(const Params& p, int layer, int event) {
  if (p.trace && threadIdx.x == 0) Record(p, layer, event, GlobalTimerNs());
}

// The count-th barrier of this launch: every CTA's writes before it are
// visible to every CTA after it.
__device__ inline void GridBarrier(const Params& p, unsigned count, const char* what, int layer,
                                   TraceEvent arrived) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (p.stage_times) atomicMax(p.stage_times + 2 * count, GlobalTimerNs());
    Arrive(p, p.barrier);
    if (p.trace) Record(p, layer, arrived, GlobalTimerNs());
    SpinUntilAtLeast(p, p.barrier, count * gridDim.x, what, layer);
    if (p.stage_times && blockIdx.x == 0) p.stage_times[2 * count + 1] = GlobalTimerNs();
  }
  __syncthreads();
}

// Thread 0, then the CTA: until *counter >= target, the other CTAs' writes
// before their counts visible to every thread after it.
__device__ inline void WaitForCount(const Params& p, const unsigned* counter, unsigned target,
                                    const char* what, int layer) {
  if (threadIdx.x == 0) SpinUntilAtLeast(p, counter, target, what, layer);
  __syncthreads();
}

__device__ __forceinline__ unsigned SharedAddress(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// The mbarrier and bulk-copy instructions exist from sm_90 on; below, these
// compile to nothing (the kernels that call them trap there first).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define JFO_SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define JFO_SM90_ASM(...) (void)0
#endif

__device__ __forceinline__ void MbarrierInit(uint64_t* bar, unsigned arrivals) {
  JFO_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SharedAddress(bar)),
               "r"(arrivals) : "memory");
}

__device__ __forceinline__ bool MbarrierTryWait(uint64_t* bar, unsigned parity) {
  unsigned done = 1;
  JFO_SM90_ASM(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(SharedAddress(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// An L2 policy for data read once: its lines are the first evicted, so
// that a stream of weights does not push out what is read again (the KV
// caches, the norms' weights, the activations).
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy = 0;
  JFO_SM90_ASM("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// `bytes` (a multiple of 16) from global into a slot in one bulk copy,
// completing the slot's mbarrier phase; with a policy (not 0), under it.
__device__ __forceinline__ void BulkLoad(void* slot, const void* src, unsigned bytes,
                                         uint64_t* bar, uint64_t policy) {
  JFO_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(SharedAddress(bar)), "r"(bytes) : "memory");
  if (policy) {
    JFO_SM90_ASM(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1], %2, [%3], %4;"
        ::"r"(SharedAddress(slot)), "l"(src), "r"(bytes), "r"(SharedAddress(bar)), "l"(policy)
        : "memory");
  } else {
    JFO_SM90_ASM(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(SharedAddress(slot)), "l"(src), "r"(bytes), "r"(SharedAddress(bar))
        : "memory");
  }
}

// The weights' stream. Each CTA's chunks, in the order it consumes them:
// layer by layer, stage by stage, its items (FirstItemOf, + gridDim.x, ...)
// and each item's chunks in order.

__device__ __forceinline__ int ItemsOfCta(int items, int first_item = blockIdx.x) {
  return first_item < items ? (items - first_item + gridDim.x - 1) / gridDim.x : 0;
}

// The CTA's first item of a stage whose item 0 is CTA st.first_cta's.
__device__ __forceinline__ int FirstItemOf(const WeightStage& st) {
  return (blockIdx.x + gridDim.x - st.first_cta) % gridDim.x;
}

// Where the CTA's next copy comes from (thread 0's). It only moves
// forward, one chunk at a time, as they are issued; within an item a step
// is an add (the issuing thread's time is on every chunk's path).
struct ChunkCursor {
  int layer = 0, stage = 0, item = 0, chunk = 0;  // item: the CTA's own count in the stage
  const unsigned char* src = nullptr;  // the next chunk's first byte
  unsigned bytes = 0;                  // and its size
  unsigned full_bytes = 0, last_bytes = 0;  // the item's chunks, and its last
  int chunks = 0;                           // the item's

  __device__ void Start(const Params& p) {
    SkipEmpty(p);
    if (!Done(p)) LocateItem(p);
  }

  __device__ bool Done(const Params& p) const { return layer >= p.layers; }

  __device__ void Advance(const Params& p) {
    if (++chunk < chunks) {
      src += full_bytes;
      if (chunk == chunks - 1) bytes = last_bytes;
      return;
    }
    chunk = 0;
    ++item;
    SkipEmpty(p);
    if (!Done(p)) LocateItem(p);
  }

 private:
  // Chunk 0 of the CTA's item `item` of `stage` in `layer`.
  __device__ void LocateItem(const Params& p) {
    const WeightStage& st = p.stages[stage];
    const size_t item_elements = static_cast<size_t>(st.k) * st.columns;
    const int index = FirstItemOf(st) + item * gridDim.x;
    src = reinterpret_cast<const unsigned char*>(
        st.w + (static_cast<size_t>(layer) * st.items + index) * item_elements);
    chunks = st.chunks_per_item;
    full_bytes = static_cast<unsigned>(st.rows_per_chunk) * st.columns * sizeof(__nv_bfloat16);
    last_bytes = static_cast<unsigned>(st.k - (chunks - 1) * st.rows_per_chunk) * st.columns *
                 sizeof(__nv_bfloat16);
    bytes = chunks == 1 ? last_bytes : full_bytes;
  }

  // Past the stages (and layers) where this CTA has no item left.
  __device__ void SkipEmpty(const Params& p) {
    while (layer < p.layers &&
           FirstItemOf(p.stages[stage]) + item * gridDim.x >= p.stages[stage].items) {
      item = 0;
      if (++stage == kStages) {
        stage = 0;
        ++layer;
      }
    }
  }
};

// The slots hold the next `count` chunks, each slot refilled as soon as
// the CTA is done with it: HBM streams on while the CTA waits or attends.
// The ring's state that says where copies come from is thread 0's.
struct Ring {
  unsigned char* slots;
  uint64_t* bars;
  int count;
  int next = 0;    // the chunk the CTA consumes next
  int next_slot = 0;         // its slot (next % count)
  unsigned next_parity = 0;  // and the phase parity it waits for ((next / count) & 1)
  int issued = 0;            // chunks issued (thread 0's count)
  int issue_slot = 0;        // the next one's slot (issued % count)
  // Registers every thread holds for the whole launch: kept few and narrow.
  bool evict_first = false;  // the copies under EvictFirstPolicy
  unsigned waited_ns = 0;    // this thread's waits for copies in a layer, with a trace
  unsigned issue_ns = 0;     // thread 0's time issuing them in a layer, with a trace
  ChunkCursor cursor;

  // Thread 0, before any copy: the slots' mbarriers.
  __device__ void InitBarriers() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    for (int s = 0; s < count; ++s) MbarrierInit(bars + s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
  }

  // Thread 0, once the barriers are initialized: the first chunks into every slot.
  __device__ void Fill(const Params& p) {
    for (int c = 0; c < count; ++c) IssueNext(p);
  }

  // Thread 0: the next chunk into its slot (chunk c goes to slot c % count).
  __device__ void IssueNext(const Params& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x != 0 || cursor.Done(p)) return;
    BulkLoad(slots + static_cast<size_t>(issue_slot) * p.chunk_bytes, cursor.src, cursor.bytes,
             bars + issue_slot, evict_first ? EvictFirstPolicy() : 0);
    cursor.Advance(p);
    ++issued;
    if (++issue_slot == count) issue_slot = 0;
#endif
  }

  // Waits for the next chunk; returns its slot.
  __device__ const uint4* Wait(const Params& p, int layer) {
    const int slot = next_slot;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned parity = next_parity;
    // try_wait itself may wait a while before it fails: the trace times it too.
    const uint64_t traced = p.trace ? GlobalTimerNs() : 0;
    if (!MbarrierTryWait(bars + slot, parity)) {
      const uint64_t start = GlobalTimerNs();
      while (!MbarrierTryWait(bars + slot, parity)) {
        if (GlobalTimerNs() - start > p.timeout_ns) TimedOut("a weight copy", layer, next, issued);
      }
    }
    if (p.trace) waited_ns += static_cast<unsigned>(GlobalTimerNs() - traced);
#endif
    return reinterpret_cast<const uint4*>(slots + static_cast<size_t>(slot) * p.chunk_bytes);
  }

  // Thread 0, with a trace: its waits since the last record, as `event`.
  __device__ void RecordWaits(const Params& p, int layer, int event) {
    if (p.trace && threadIdx.x == 0) {
      Record(p, layer, event, waited_ns);
      waited_ns = 0;
    }
  }

  // With a trace, at a layer's end: thread 0's issuing, thread 32's waits.
  __device__ void RecordLayer(const Params& p, int layer) {
    if (p.trace && threadIdx.x == 0) {
      Record(p, layer, kIssueNs, issue_ns);
      issue_ns = 0;
    }
    if (p.trace && threadIdx.x == 32) {
      Record(p, layer, kWarp1CopyWaitNs, waited_ns);
      waited_ns = 0;
    }
  }

  // Every thread is done with the chunk it waited for: its slot takes the
  // chunk `count` ahead. A CTA barrier: an mbarrier arrival per warp, thread
  // 0 waiting for the slot's, was 1.04-1.06x slower.
  __device__ void Release(const Params& p) {
    __syncthreads();
    const uint64_t traced = p.trace && threadIdx.x == 0 ? GlobalTimerNs() : 0;
    IssueNext(p);
    if (traced) issue_ns += static_cast<unsigned>(GlobalTimerNs() - traced);
    ++next;
    if (++next_slot == count) {
      next_slot = 0;
      next_parity ^= 1;
    }
  }
};

}  // namespace transformer_decode
}  // namespace jfo
