// The all-reduce's Lamport one-shot kernel (algorithm 2; the op is in
// all_reduce.cu).
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
// times out marks the region failed on its device and on its peers, and
// every later all-reduce kernel there writes NaN instead of reading its
// slots (PeerRegion::region_failed), until reset.
//
// Each block also sends its call's fingerprint in its header (a 16-byte pack
// after the slot's data, emptied like the data), and the receiving block
// fails the call when the peer's differs: counters alone would pair two
// different calls (another size or dtype on one rank) and sum unrelated
// bytes. Header and data are polled alike, so both are of the same call.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "all_reduce.h"
#include "transport/reduce.cuh"
#include "transport/signal.cuh"

namespace jfo {
namespace all_reduce {
namespace {

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
// thread's) sets *failed and returns the last value read. A timeout fails
// the region of this device and of every peer (see the top).
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
      signal::FailRegion(a.region, a.n, a.rank);
      TimeoutRecord info = a.info;
      info.op = static_cast<int32_t>(OpId::kAllReduceLamport);
      signal::RecordTimeout(a.region.record, a.region.record_lock, info, q,
                            a.region.ids[q], expected, 0);
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
  if (threadIdx.x == 0) failed = signal::RegionFailed(a.region);
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
  if (failed) {  // an earlier timeout: the slots are not to be read
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
  // This block's header in the current parity of a slot.
  auto header = [&](const char* base, int q) {
    return reinterpret_cast<uint4*>(const_cast<char*>(base) +
                                    (seq[q] & 1) * a.region.lamport_parity_bytes +
                                    a.region.lamport_data_bytes) + b;
  };
  if (IsPeer(a, threadIdx.x)) {  // never empty: see CallFingerprint::Seal
    const int q = threadIdx.x;
    StoreVolatile(header(a.region.lamport_send[q], q),
                  {a.fingerprint, a.fingerprint, a.fingerprint, a.fingerprint});
  }

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

  // 2. Peer q's header (lane q), then every rank's data in rank order, each
  // peer's slot emptied after.
  if (IsPeer(a, threadIdx.x)) {
    const int q = threadIdx.x;
    uint4* src = header(a.region.lamport_recv[q], q);
    const uint4 theirs = Poll<uint4>([&] { return LoadVolatile(src); },
                                     [](uint4 u) { return !HasEmptyLane<T>(u); }, a, q,
                                     seq[q], deadline, &failed);
    StoreVolatile(src, empty);
    if (!HasEmptyLane<T>(theirs) && theirs.x != a.fingerprint) {
      *reinterpret_cast<volatile int*>(&failed) = 1;
      signal::FailRegion(a.region, a.n, a.rank);
      TimeoutRecord info = a.info;
      info.op = static_cast<int32_t>(OpId::kAllReduceLamport);
      info.cause = kCallMismatch;
      signal::RecordTimeout(a.region.record, a.region.record_lock, info, q,
                            a.region.ids[q], a.fingerprint, theirs.x);
    }
  }
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

template <typename T>
constexpr KernelFn kLamportKernels[2] = {LamportAllReduceKernel<T, false>,
                                         LamportAllReduceKernel<T, true>};

}  // namespace

KernelFn LamportKernel(ffi::DataType dtype, bool vector) {
  switch (dtype) {
    case ffi::DataType::BF16: return kLamportKernels<__nv_bfloat16>[vector];
    case ffi::DataType::F16: return kLamportKernels<__half>[vector];
    default: return kLamportKernels<float>[vector];
  }
}

}  // namespace all_reduce
}  // namespace jfo
