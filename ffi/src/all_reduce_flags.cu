// The all-reduce's one-shot and two-shot kernel (algorithms 0 and 1; the
// op is in all_reduce.cu): data moves through the peers' slots, and flags
// in device memory say when it is there.
//
// Flow control. Block b keeps, per peer q, a call counter seq[q][b] in
// device memory; a call raises it to s and uses slot parity s & 1. A signal
// is a release store of s into the peer's flag for (kind, us, b); a wait is
// an acquire load until the flag reaches s, bounded by %globaltimer. Block b
// exists in a call of any size (a smaller grid leaves the higher counters
// alone), so its counters advance in lockstep on both sides of a pair.
//
// Why a rank never overwrites data a peer still reads. Rank r writes the
// parity-p stripe b of its slot on q at its call s (s & 1 == p) and next at
// call s + 2 of block b. Before that, r's block b finished call s + 1 and
// there waited for q's call-(s + 1) signal of block b. q sends that signal
// from its call-(s + 1) kernel, which starts only after q's call-s kernel
// ended (same stream), and that kernel did all q's reads of the parity-p
// stripe b. Stripe b belongs to block b alone, so no other block (of a call
// with another grid) ever reads or writes it. Within a call, the one-shot
// and reduce-scatter data and the all-gather data use disjoint parts of the
// stripe (slice q vs. slice r). This holds if a device runs its calls one at
// a time, in the same order on every rank of a group, as XLA's stream order
// (and command buffers in their default LHS/serial mode) guarantees.
//
// A wait that times out records who was missing (check_device_errors()),
// marks the region failed on this device and its peers, writes NaN over its
// block's chunk and returns: nothing hangs. A kernel that starts on a failed
// region writes NaN and sends nothing (PeerRegion::region_failed).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "all_reduce.h"
#include "transport/reduce.cuh"
#include "transport/signal.cuh"

namespace jfo {
namespace all_reduce {
namespace {

// Called by the whole block after its stores of this phase: lane q raises
// peer q's flag of `kind` to seq[q]. The barrier orders every thread's
// stores before the lane's system-scope fence and release store.
__device__ void Signal(const Args& a, int kind, const uint32_t* seq) {
  __syncthreads();
  const int q = threadIdx.x;
  if (!IsPeer(a, q)) return;
  __threadfence_system();
  signal::StoreRelease(
      a.region.send_flag[q] + kind * a.region.flag_kind_stride + blockIdx.x,
      seq[q]);
}

__device__ __forceinline__ unsigned long long* Mailbox(const char* stripe,
                                                       const Args& a) {
  return reinterpret_cast<unsigned long long*>(
      const_cast<char*>(stripe) + a.region.stripe_bytes - kMailboxBytes);
}

// The sender's CallFingerprint, in the mailbox's last 8 bytes.
__device__ __forceinline__ uint32_t* FingerprintWord(const char* stripe, const Args& a) {
  return reinterpret_cast<uint32_t*>(const_cast<char*>(stripe) + a.region.stripe_bytes -
                                     sizeof(uint64_t));
}

// Stripe b of the parity of call seq of a slot (this block's).
__device__ __forceinline__ const char* Stripe(const char* slot, uint32_t seq, const Args& a) {
  return slot + (seq & 1) * a.region.parity_bytes + blockIdx.x * a.region.stripe_bytes;
}

// Lane q waits for peer q's flag of `kind` to reach seq[q] until `deadline`,
// and for kArData checks that the message is of this call (the peer's
// fingerprint); then the barrier hands the acquired data to the whole block.
// Sets *failed (shared) on a timeout or another call, and reports it.
__device__ void Wait(const Args& a, int kind, const uint32_t* seq,
                     uint64_t deadline, int* failed) {
  const int q = threadIdx.x;
  if (IsPeer(a, q)) {
    const uint32_t* flag =
        a.region.recv_flag[q] + kind * a.region.flag_kind_stride + blockIdx.x;
    TimeoutRecord info = a.info;
    uint32_t expected = seq[q], seen;
    for (;;) {
      seen = signal::LoadAcquire(flag);
      // A peer leads by at most one call (see the top): two is out of step.
      const bool ahead = signal::Reached(seen, seq[q] + 2);
      if (signal::Reached(seen, seq[q]) && !ahead) {
        if (kind != kArData) break;
        const uint32_t theirs =
            signal::LoadAcquire(FingerprintWord(Stripe(a.region.recv[q], seq[q], a), a));
        if (theirs == a.fingerprint) break;
        info.cause = kCallMismatch;
        expected = a.fingerprint;
        seen = theirs;
      } else if (ahead) {
        info.cause = kOutOfStep;
      } else if (signal::GlobalTimerNs() <= deadline) {
        continue;
      }
      *failed = 1;
      signal::FailRegion(a.region, a.n, a.rank);
      signal::RecordTimeout(a.region.record, a.region.record_lock, info, q,
                            a.region.ids[q], expected, seen);
      break;
    }
  }
  __syncthreads();
}

template <typename T, bool kVector, int kAlgorithm>
__global__ void __launch_bounds__(kFlagThreads) AllReduceKernel(Args a) {
  __shared__ uint32_t seq[kArMaxRanks];
  __shared__ int failed;
  const int b = blockIdx.x;
  const uint64_t deadline = signal::GlobalTimerNs() + a.timeout_ns;
  if (threadIdx.x == 0) failed = signal::RegionFailed(a.region);
  if (IsPeer(a, threadIdx.x)) {
    const int q = threadIdx.x;
    seq[q] = a.region.seq[q][b] + 1;
    a.region.seq[q][b] = seq[q];
  }
  __syncthreads();

  const size_t lo = b * a.chunk;
  const size_t count = min(a.elements, lo + a.chunk) - lo;
  const T* x = static_cast<const T*>(a.x) + lo;
  T* y = static_cast<T*>(a.y) + lo;
  const T nan = static_cast<T>(__int_as_float(0x7fc00000));
  if (failed) {  // an earlier timeout: the counters of a pair may not agree
    for (size_t i = threadIdx.x; i < count; i += blockDim.x) y[i] = nan;
    return;
  }
  // Stripe b of the current parity of rank q's slot here / ours on q.
  auto stripe = [&](const char* slot, int q) {
    return reinterpret_cast<T*>(const_cast<char*>(Stripe(slot, seq[q], a)));
  };
  // Before the data signal (Signal's fence orders it before the flag).
  if (IsPeer(a, threadIdx.x)) {
    *FingerprintWord(Stripe(a.region.send[threadIdx.x], seq[threadIdx.x], a), a) =
        a.fingerprint;
  }
  auto in = [&](int q) -> const T* {
    return q == a.rank ? x : stripe(a.region.recv[q], q);
  };
  auto out = [&](int q) { return stripe(a.region.send[q], q); };
  const T* srcs[kArMaxRanks];
  T* dsts[kArMaxRanks];

  if (kAlgorithm == kOneShot) {
    int nd = 0;
    for (int q = 0; q < a.n; ++q) {
      if (q != a.rank) dsts[nd++] = out(q);
    }
    reduce::ReduceRange<T, kVector>(&x, 1, dsts, nd, count);
    Signal(a, kArData, seq);
    Wait(a, kArData, seq, deadline, &failed);
    if (!failed) {
      for (int q = 0; q < a.n; ++q) srcs[q] = in(q);
      reduce::ReduceRange<T, kVector>(srcs, a.n, &y, 1, count);
    }
  } else {
    // Slice q of the chunk: [begin(q), begin(q + 1)), possibly empty.
    auto begin = [&](int q) { return min(q * a.slice, count); };
    auto slot_base = [&](const char* slot, int q) {
      return reinterpret_cast<const char*>(stripe(slot, q));
    };
    __shared__ T* gather_dst[kArMaxRanks];  // where our slice goes on rank q
    for (int q = 0; q < a.n; ++q) {
      if (q == a.rank) continue;
      const T* src = x + begin(q);
      T* dst = out(q) + begin(q);
      reduce::ReduceRange<T, kVector>(&src, 1, &dst, 1, begin(q + 1) - begin(q));
    }
    const int q = threadIdx.x;
    if (IsPeer(a, q)) *Mailbox(slot_base(a.region.send[q], q), a) = a.gather_to;
    Signal(a, kArData, seq);
    Wait(a, kArData, seq, deadline, &failed);
    if (!failed && IsPeer(a, q)) {
      const unsigned long long to = atomicExch_system(
          Mailbox(slot_base(a.region.recv[q], q), a), kMailboxTaken);
      if (to == kMailboxTaken) {  // q gave up: its y is no longer its output
        failed = 1;
        TimeoutRecord info = a.info;
        info.op = static_cast<int32_t>(OpId::kAllReduceAbandoned);
        signal::RecordTimeout(a.region.record, a.region.record_lock, info, q,
                              a.region.ids[q], seq[q], seq[q]);
      } else if (to == kGatherIntoSlot) {
        gather_dst[q] = out(q);
      } else {
        gather_dst[q] = reinterpret_cast<T*>(to) + lo;
      }
    }
    __syncthreads();
    const size_t own = begin(a.rank);
    if (!failed) {
      int nd = 0;
      dsts[nd++] = y + own;
      for (int p = 0; p < a.n; ++p) {
        srcs[p] = in(p) + own;
        if (p != a.rank) dsts[nd++] = gather_dst[p] + own;
      }
      reduce::ReduceRange<T, kVector>(srcs, a.n, dsts, nd, begin(a.rank + 1) - own);
      Signal(a, kArGathered, seq);
      Wait(a, kArGathered, seq, deadline, &failed);
    }
    if (!failed && a.gather_to == kGatherIntoSlot) {
      for (int p = 0; p < a.n; ++p) {
        if (p == a.rank) continue;
        const T* src = in(p) + begin(p);
        T* dst = y + begin(p);
        reduce::ReduceRange<T, kVector>(&src, 1, &dst, 1, begin(p + 1) - begin(p));
      }
    }
    if (failed && IsPeer(a, q) && a.gather_to != kGatherIntoSlot &&
        atomicExch_system(Mailbox(slot_base(a.region.send[q], q), a),
                          kMailboxTaken) == kMailboxTaken) {
      // q took our y: let its stores land before XLA may reuse y.
      const uint32_t* flag = a.region.recv_flag[q] +
                             kArGathered * a.region.flag_kind_stride + b;
      const uint64_t again = signal::GlobalTimerNs() + a.timeout_ns;
      while (!signal::Reached(signal::LoadAcquire(flag), seq[q]) &&
             signal::GlobalTimerNs() < again) {
      }
    }
    __syncthreads();
  }
  if (failed) {  // a peer is missing: make the wrong result visible
    for (size_t i = threadIdx.x; i < count; i += blockDim.x) y[i] = nan;
  }
}

// [vector][algorithm]
template <typename T>
constexpr KernelFn kKernels[2][2] = {
    {AllReduceKernel<T, false, kOneShot>, AllReduceKernel<T, false, kTwoShot>},
    {AllReduceKernel<T, true, kOneShot>, AllReduceKernel<T, true, kTwoShot>}};

}  // namespace

KernelFn FlagKernel(ffi::DataType dtype, bool vector, Algorithm algorithm) {
  switch (dtype) {
    case ffi::DataType::BF16: return kKernels<__nv_bfloat16>[vector][algorithm];
    case ffi::DataType::F16: return kKernels<__half>[vector][algorithm];
    default: return kKernels<float>[vector][algorithm];
  }
}

}  // namespace all_reduce
}  // namespace jfo
