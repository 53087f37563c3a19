// All-reduce of one buffer over the GPUs of a group, in ONE kernel that loads
// and stores the peers' memory directly (the transport's PeerRegion). No
// host-side state changes from call to call, no events and no side streams:
// the handler is command-buffer compatible and a captured call replays
// correctly, because all flow control lives in device memory.
//
// Work split. Element range [0, N) is cut into `blocks` chunks; block b of
// every rank handles chunk b and talks only to block b of the peers. The
// grid is a function of (N, dtype, n, algorithm) alone, so every rank runs
// the same grid for the same call.
//
//   one-shot: push the chunk of x into every peer's slot, signal; wait for
//     every peer's chunk; sum all ranks' chunks.
//   two-shot: push slice q of the chunk to rank q (reduce-scatter), signal,
//     wait; sum own slice r, write it to y and store it into every peer's y
//     (all-gather), signal, wait. A peer whose y its peers cannot reach
//     (memory that peer access does not map) gets the slice in its slot and
//     copies it into y itself after the wait.
//
// Every sum runs over ranks 0, 1, ..., n-1 in fp32 and rounds once, so the
// result is bitwise identical on every rank and from run to run.
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
// writes NaN over its block's chunk and returns: nothing hangs.
//
// Lamport one-shot (algorithm 2, messages up to LamportSlotBytes): the same
// sum without flags. Every word of its slots holds kLamportEmpty while no
// message is in flight; a rank stores its canonical data (an input half
// equal to 0x8000, i.e. -0.0, is sent as +0.0; an fp32 word equal to
// kLamportEmpty, a denormal, as -0.0) into its peers' slots, and a peer
// polls each 16-byte pack of its own copy until no lane is empty, adds it
// and writes the empty pattern back. That saves the fence, the flag store
// and the flag's round trip of the one-shot. Slot reuse: the kernel of call
// s + 2 on rank q writes parity s & 1 again only after its call s + 1
// kernel read our call-(s + 1) data, which our call-(s + 1) kernel sent
// after our call-s kernel had emptied parity s & 1. Its grid is always
// kLamportBlocks blocks, so the per-block call counters that pick the parity
// stay in step. The argument holds for whole kernels (which block covers
// which bytes depends on the size), with at least one element per call (a
// call of none launches nothing on any rank). A timeout breaks it: a late
// message may fill a slot its reader gave up on. So a Lamport wait that
// times out sets a sticky poison word on its device and on its peers, and
// every later Lamport kernel there writes NaN instead of reading its slots.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "handlers.h"
#include "ops_common.h"
#include "transport/reduce.cuh"
#include "transport/signal.cuh"

namespace jfo {
namespace {

constexpr OpId kOp = OpId::kAllReduce;
// Threads per block: the flag kernels' blocks each stream a chunk over
// NVLink, so more warps keep more stores in flight; the Lamport kernel's
// blocks poll.
constexpr int kFlagThreads = 1024;
constexpr int kLamportThreads = 512;
// kAllReduceMinBlockBytes (transport.h) per block before another block joins
// (up to kArMaxBlocks): few spinning CTAs for small messages. To be measured.
constexpr size_t kMinBlockBytes = kAllReduceMinBlockBytes;
// The Lamport kernel spreads a message over at least this many of its
// kLamportBlocks blocks (the measured split up to 256 KiB), more from
// kMinBlockBytes per block.
constexpr size_t kLamportMinActiveBlocks = 16;
enum Algorithm : int32_t { kOneShot = 0, kTwoShot = 1, kLamport = 2 };

std::atomic<uint64_t> g_host_calls{0};
std::atomic<uint64_t> g_direct_gathers{0};

struct Args {
  const void* x;
  void* y;
  size_t elements;  // N
  size_t chunk;     // elements per block; a multiple of 16 bytes
  size_t slice;     // two-shot: elements per rank within a chunk, likewise
  int n, rank;
  // Two-shot: what this rank's mailboxes on its peers say (see Mailbox).
  unsigned long long gather_to;
  uint64_t timeout_ns;
  TimeoutRecord info;  // op, rank, ordinal, timeout_ms of a timeout report
  PeerRegion region;
};

__device__ __forceinline__ bool IsPeer(const Args& a, int q) {
  return q < a.n && q != a.rank;
}

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

// Lane q waits for peer q's flag of `kind` to reach seq[q] until `deadline`;
// then the barrier hands the acquired data to the whole block. Sets *failed
// (shared) on a timeout and reports it.
__device__ void Wait(const Args& a, int kind, const uint32_t* seq,
                     uint64_t deadline, int* failed) {
  const int q = threadIdx.x;
  if (IsPeer(a, q)) {
    const uint32_t* flag =
        a.region.recv_flag[q] + kind * a.region.flag_kind_stride + blockIdx.x;
    for (;;) {
      const uint32_t seen = signal::LoadAcquire(flag);
      if (signal::Reached(seen, seq[q])) break;
      if (signal::GlobalTimerNs() > deadline) {
        *failed = 1;
        signal::RecordTimeout(a.region.record, a.region.record_lock, a.info, q,
                              a.region.ordinals[q], seq[q], seen);
        break;
      }
    }
  }
  __syncthreads();
}

// Two-shot mailboxes: how a rank tells each peer where to store its slice
// of the result. Before its reduce-scatter signal, lane q writes `gather_to`
// (this call's y, which the peers then store into directly, or
// kGatherIntoSlot) into the last bytes of this rank's stripe on peer q.
// After its wait, the peer's lane takes it with an atomic swap to
// kMailboxTaken. A rank whose call failed swaps kMailboxTaken into its own
// mailboxes: finding kMailboxTaken there, it knows that the peer took its y
// and may still be storing into it, so it waits (bounded) for that peer's
// all-gather signal before the kernel ends and XLA may reuse y; a peer that
// comes later finds kMailboxTaken and gives up without touching y.
constexpr unsigned long long kMailboxTaken = 0;
constexpr unsigned long long kGatherIntoSlot = 1;
constexpr size_t kMailboxBytes = 16;  // keeps the stripe's data 16-byte aligned

__device__ __forceinline__ unsigned long long* Mailbox(const char* stripe,
                                                       const Args& a) {
  return reinterpret_cast<unsigned long long*>(
      const_cast<char*>(stripe) + a.region.stripe_bytes - kMailboxBytes);
}

template <typename T, bool kVector, int kAlgorithm>
__global__ void __launch_bounds__(kFlagThreads) AllReduceKernel(Args a) {
  __shared__ uint32_t seq[kArMaxRanks];
  __shared__ int failed;
  const int b = blockIdx.x;
  const uint64_t deadline = signal::GlobalTimerNs() + a.timeout_ns;
  if (threadIdx.x == 0) failed = 0;
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
  // Stripe b of the current parity of rank q's slot here / ours on q.
  auto stripe = [&](const char* slot, int q) {
    return reinterpret_cast<T*>(const_cast<char*>(slot) +
                                (seq[q] & 1) * a.region.parity_bytes +
                                b * a.region.stripe_bytes);
  };
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
                              a.region.ordinals[q], seq[q], seq[q]);
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
    const T nan = static_cast<T>(__int_as_float(0x7fc00000));
    for (size_t i = threadIdx.x; i < count; i += blockDim.x) y[i] = nan;
  }
}

// Lamport slots. One element's bits (16-bit elements in the low half of a
// word) are "empty" when they hold kLamportEmpty's lane; canonical data never
// does: -0.0 in 16 bits becomes +0.0, and the fp32 denormal becomes -0.0.
template <typename T>
using Bits = std::conditional_t<sizeof(T) == 2, uint16_t, uint32_t>;

template <typename T>
__device__ __forceinline__ bool IsEmptyBits(Bits<T> b) {
  return b == static_cast<Bits<T>>(kLamportEmpty);
}

template <typename T>
__device__ __forceinline__ Bits<T> CanonicalBits(Bits<T> b) {
  if constexpr (sizeof(T) == 2) {
    return IsEmptyBits<T>(b) ? Bits<T>(0) : b;
  } else {
    return IsEmptyBits<T>(b) ? 0x80000000u : b;
  }
}

// The same per 32-bit word and per 16-byte pack.
template <typename T>
__device__ __forceinline__ bool IsEmptyWord(uint32_t w) {
  if constexpr (sizeof(T) == 2) {
    return IsEmptyBits<T>(w & 0xffffu) | IsEmptyBits<T>(w >> 16);
  } else {
    return IsEmptyBits<T>(w);
  }
}

template <typename T>
__device__ __forceinline__ uint32_t CanonicalWord(uint32_t w) {
  if constexpr (sizeof(T) == 2) {
    return CanonicalBits<T>(w & 0xffffu) |
           (static_cast<uint32_t>(CanonicalBits<T>(w >> 16)) << 16);
  } else {
    return CanonicalBits<T>(w);
  }
}

template <typename T>
__device__ __forceinline__ bool HasEmptyLane(uint4 v) {
  // `|`, not `||`: no branch per lane.
  return IsEmptyWord<T>(v.x) | IsEmptyWord<T>(v.y) | IsEmptyWord<T>(v.z) |
         IsEmptyWord<T>(v.w);
}

template <typename T>
__device__ __forceinline__ uint4 Canonical(uint4 v) {
  return {CanonicalWord<T>(v.x), CanonicalWord<T>(v.y), CanonicalWord<T>(v.z),
          CanonicalWord<T>(v.w)};
}

// Loads and stores that go to memory every time: the slots are written over
// NVLink.
__device__ __forceinline__ uint4 LoadVolatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void StoreVolatile(uint4* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Polls until `ready(value)` or the deadline; on a timeout (or another
// thread's) sets *failed and returns the last value read. A timeout poisons
// the Lamport slots of this device and of every peer (see the top).
template <typename V, typename Load, typename Ready>
__device__ __forceinline__ V Poll(Load load, Ready ready, const Args& a, int q,
                                  uint32_t expected, uint64_t deadline,
                                  int* failed) {
  for (;;) {
    const V v = load();
    if (ready(v)) return v;
    if (*reinterpret_cast<volatile int*>(failed)) return v;
    if (signal::GlobalTimerNs() > deadline) {
      *reinterpret_cast<volatile int*>(failed) = 1;
      signal::StoreRelease(a.region.lamport_poison, 1u);
      for (int p = 0; p < a.n; ++p) {
        if (p != a.rank) signal::StoreRelease(a.region.lamport_poison_peer[p], 1u);
      }
      TimeoutRecord info = a.info;
      info.op = static_cast<int32_t>(OpId::kAllReduceLamport);
      signal::RecordTimeout(a.region.record, a.region.record_lock, info, q,
                            a.region.ordinals[q], expected, 0);
      return v;
    }
  }
}

template <typename T>
__device__ __forceinline__ float BitsToFloat(Bits<T> b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(__ushort_as_bfloat16(b));
  } else if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__ushort_as_half(b));
  } else {
    return __uint_as_float(b);
  }
}

template <typename T, bool kVector>
__global__ void __launch_bounds__(kLamportThreads) LamportAllReduceKernel(Args a) {
  constexpr int kN = 16 / sizeof(T);
  __shared__ uint32_t seq[kArMaxRanks];
  __shared__ int failed;
  const int b = blockIdx.x;
  const uint64_t deadline = signal::GlobalTimerNs() + a.timeout_ns;
  if (threadIdx.x == 0) {
    failed = *reinterpret_cast<volatile uint32_t*>(a.region.lamport_poison) != 0;
  }
  if (IsPeer(a, threadIdx.x)) {
    const int q = threadIdx.x;
    seq[q] = a.region.lamport_seq[q][b] + 1;
    a.region.lamport_seq[q][b] = seq[q];
  }
  __syncthreads();

  const size_t lo = min(b * a.chunk, a.elements);
  const size_t count = min(a.elements, lo + a.chunk) - lo;
  if (count == 0) return;  // the whole block: its counters moved on anyway
  const T* x = static_cast<const T*>(a.x) + lo;
  T* y = static_cast<T*>(a.y) + lo;
  const T nan = static_cast<T>(__int_as_float(0x7fc00000));
  if (failed) {  // poisoned by an earlier timeout: the slots are not to be read
    for (size_t i = threadIdx.x; i < count; i += blockDim.x) y[i] = nan;
    return;
  }
  auto slot = [&](const char* base, int q) {
    return reinterpret_cast<T*>(const_cast<char*>(base) +
                                (seq[q] & 1) * a.region.lamport_parity_bytes) +
           lo;
  };
  const size_t packs = kVector ? count / kN : 0;
  const uint4 empty = {kLamportEmpty, kLamportEmpty, kLamportEmpty,
                       kLamportEmpty};

  // 1. Our canonical data into every peer's slot.
  if constexpr (kVector) {
    for (size_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const uint4 v =
          Canonical<T>(__ldg(reinterpret_cast<const uint4*>(x) + p));
      for (int q = 0; q < a.n; ++q) {
        if (q == a.rank) continue;
        StoreVolatile(
            reinterpret_cast<uint4*>(slot(a.region.lamport_send[q], q)) + p, v);
      }
    }
  }
  for (size_t i = packs * kN + threadIdx.x; i < count; i += blockDim.x) {
    const Bits<T> v = CanonicalBits<T>(reinterpret_cast<const Bits<T>*>(x)[i]);
    for (int q = 0; q < a.n; ++q) {
      if (q == a.rank) continue;
      reinterpret_cast<volatile Bits<T>*>(slot(a.region.lamport_send[q], q))[i] = v;
    }
  }

  // 2. Every rank's data in rank order, each peer's slot emptied after.
  if constexpr (kVector) {
    for (size_t p = threadIdx.x; p < packs; p += blockDim.x) {
      float acc[kN];
      for (int q = 0; q < a.n; ++q) {
        uint4 v;
        if (q == a.rank) {
          v = Canonical<T>(__ldg(reinterpret_cast<const uint4*>(x) + p));
        } else {
          uint4* src =
              reinterpret_cast<uint4*>(slot(a.region.lamport_recv[q], q)) + p;
          v = Poll<uint4>([&] { return LoadVolatile(src); },
                          [](uint4 u) { return !HasEmptyLane<T>(u); }, a, q,
                          seq[q], deadline, &failed);
          StoreVolatile(src, empty);
        }
        if (q == 0) {
          reduce::Pack16<T>::Load(v, acc);
        } else {
          reduce::Pack16<T>::Add(v, acc);
        }
      }
      reinterpret_cast<uint4*>(y)[p] = reduce::Pack16<T>::Round(acc);
    }
  }
  for (size_t i = packs * kN + threadIdx.x; i < count; i += blockDim.x) {
    float acc = 0.0f;
    for (int q = 0; q < a.n; ++q) {
      Bits<T> v;
      if (q == a.rank) {
        v = CanonicalBits<T>(reinterpret_cast<const Bits<T>*>(x)[i]);
      } else {
        volatile Bits<T>* src = reinterpret_cast<volatile Bits<T>*>(
                                    slot(a.region.lamport_recv[q], q)) + i;
        v = Poll<Bits<T>>([&] { return *src; },
                          [](Bits<T> u) { return !IsEmptyBits<T>(u); }, a, q,
                          seq[q], deadline, &failed);
        *src = static_cast<Bits<T>>(kLamportEmpty);
      }
      const float f = BitsToFloat<T>(v);
      acc = q == 0 ? f : acc + f;
    }
    y[i] = static_cast<T>(acc);
  }
  __syncthreads();
  if (failed) {  // a peer is missing: make the wrong result visible
    for (size_t i = threadIdx.x; i < count; i += blockDim.x) y[i] = nan;
  }
}

using KernelFn = void (*)(Args);

// [vector][algorithm]
template <typename T>
constexpr KernelFn kKernels[2][2] = {
    {AllReduceKernel<T, false, kOneShot>, AllReduceKernel<T, false, kTwoShot>},
    {AllReduceKernel<T, true, kOneShot>, AllReduceKernel<T, true, kTwoShot>}};

template <typename T>
constexpr KernelFn kLamportKernels[2] = {LamportAllReduceKernel<T, false>,
                                         LamportAllReduceKernel<T, true>};

KernelFn PickKernel(ffi::DataType dtype, bool vector, int algorithm) {
  if (algorithm == kLamport) {
    switch (dtype) {
      case ffi::DataType::BF16: return kLamportKernels<__nv_bfloat16>[vector];
      case ffi::DataType::F16: return kLamportKernels<__half>[vector];
      default: return kLamportKernels<float>[vector];
    }
  }
  switch (dtype) {
    case ffi::DataType::BF16: return kKernels<__nv_bfloat16>[vector][algorithm];
    case ffi::DataType::F16: return kKernels<__half>[vector][algorithm];
    default: return kKernels<float>[vector][algorithm];
  }
}

// Loads every variant now: a kernel loaded lazily at its first launch can
// block that launch until the device is idle, i.e. until a spinning peer
// kernel gives up (see Channel::Run).
ffi::Error AllReduceSetup(int ordinal) {
  (void)ordinal;  // OpInitialize made it the current device
  cudaFuncAttributes attrs;
  for (auto dtype : {ffi::DataType::BF16, ffi::DataType::F16,
                     ffi::DataType::F32}) {
    for (bool vector : {false, true}) {
      for (int algorithm : {kOneShot, kTwoShot, kLamport}) {
        JFO_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(
            &attrs, PickKernel(dtype, vector, algorithm)));
      }
    }
  }
  return ffi::Error::Success();
}

size_t RoundUp(size_t v, size_t m) { return (v + m - 1) / m * m; }

ffi::Error AllReduceImpl(cudaStream_t stream, int ordinal, Buffer_Type x,
                         Result_Type y, I32Span group_ordinals, int32_t n,
                         int32_t timeout_ms, int32_t algorithm) {
  g_host_calls.fetch_add(1, std::memory_order_relaxed);
  auto group = FindGroup(kOp, group_ordinals, n, ordinal);
  if (group.has_error()) return group.error();
  JFO_RETURN_IF_ERROR(CheckCommon(kOp, timeout_ms, 1));
  const auto dtype = x.element_type();
  JFO_RETURN_IF_ERROR(CheckDtypes(kOp, {dtype, y->element_type()}));
  if (algorithm != kOneShot && algorithm != kTwoShot &&
      algorithm != kLamport) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap all_reduce: algorithm must be 0 (one-shot), 1 "
        "(two-shot) or 2 (Lamport one-shot), got " +
        std::to_string(algorithm));
  }
  const size_t elements = x.element_count();
  if (y->element_count() != elements) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap all_reduce: x " + DimsToString(x) + " and y " +
        DimsToString(*y) + " differ in size");
  }
  if (elements == 0) return ffi::Error::Success();
  auto region = AllReduceRegion(kOp, *group, timeout_ms);
  if (region.has_error()) return region.error();

  // The split depends on nothing rank-specific (see the top of the file).
  const size_t es = DataTypeBytes(dtype);
  const size_t pack = 16 / es;
  if (algorithm == kLamport && elements * es > region->lamport_parity_bytes) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap all_reduce: the Lamport one-shot takes messages up "
        "to " + std::to_string(region->lamport_parity_bytes >> 10) +
        " KiB per rank in a process with this many CUDA devices, got " +
        std::to_string(elements * es) + " bytes; use algorithm='one_shot'");
  }
  const size_t want = (elements * es + kMinBlockBytes - 1) / kMinBlockBytes;
  const size_t blocks0 =
      algorithm == kLamport
          ? std::clamp<size_t>(want, kLamportMinActiveBlocks, kLamportBlocks)
          : std::min<size_t>(std::max<size_t>(want, 1), kArMaxBlocks);
  Args a{};
  a.chunk = RoundUp((elements + blocks0 - 1) / blocks0, pack);
  // Recounted so that no block is empty; the Lamport grid never changes
  // (its per-block counters must move together), empty blocks included.
  const unsigned blocks =
      algorithm == kLamport
          ? kLamportBlocks
          : static_cast<unsigned>((elements + a.chunk - 1) / a.chunk);
  a.slice = RoundUp((a.chunk + n - 1) / n, pack);
  if (algorithm != kLamport && a.chunk * es + kMailboxBytes > region->stripe_bytes) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap all_reduce: " + std::to_string(elements * es) +
        " bytes per rank need slots of " +
        std::to_string(a.chunk * es * kArMaxBlocks >> 20) +
        " MiB (two per peer) in the all-reduce region, which has slots of " +
        std::to_string(region->stripe_bytes * kArMaxBlocks >> 20) +
        " MiB; raise JAX_FLASHOVERLAP_WORKSPACE_MB (a quarter of the "
        "workspace is the all-reduce region) before the first CUDA op of the "
        "process, or use impl='xla'");
  }
  a.x = x.untyped_data();
  a.y = y->untyped_data();
  a.elements = elements;
  a.n = n;
  a.rank = group->rank;
  a.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000ull;
  a.info.op = static_cast<int32_t>(kOp);
  a.info.rank = group->rank;
  a.info.ordinal = ordinal;
  a.info.timeout_ms = timeout_ms;
  a.region = *region;
  // The peers' vector stores into y need it 16-byte aligned, whatever their
  // own buffers are.
  a.gather_to = algorithm == kTwoShot &&
                        reinterpret_cast<uintptr_t>(a.y) % 16 == 0 &&
                        PeerStoresAllowed(a.y, *group)
                    ? reinterpret_cast<uintptr_t>(a.y)
                    : kGatherIntoSlot;
  if (a.gather_to != kGatherIntoSlot) {
    g_direct_gathers.fetch_add(1, std::memory_order_relaxed);
  }
  // Ranks may differ here: both variants split, place and round alike.
  const bool vector = reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(a.y) % 16 == 0;
  const int threads = algorithm == kLamport ? kLamportThreads : kFlagThreads;
  PickKernel(dtype, vector, algorithm)<<<blocks, threads, 0, stream>>>(a);
  JFO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace

uint64_t AllReduceHostCalls() {
  return g_host_calls.load(std::memory_order_relaxed);
}

uint64_t AllReduceDirectGathers() {
  return g_direct_gathers.load(std::memory_order_relaxed);
}

JFO_DEFINE_INITIALIZE(JfoAllReduceInitialize, kOp, AllReduceSetup);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoAllReduce, AllReduceImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()           // XLA's stream for this device
        .Ctx<ffi::DeviceOrdinal>()        // local CUDA ordinal
        .Arg<Buffer_Type>()               // x: any shape, read as flat
        .Ret<Buffer_Type>()               // y: x's shape, the sum over ranks
        .Attr<I32Span>("group_ordinals")  // [G*n] CUDA ordinals by rank
        .Attr<int32_t>("n")               // ranks per group
        .Attr<int32_t>("timeout_ms")      // bound of every wait
        .Attr<int32_t>("algorithm"),      // 0: one-shot, 1: two-shot, 2: Lamport
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jfo
