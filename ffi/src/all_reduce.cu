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
//     wait; sum own slice r, write it to y and push it to every peer
//     (all-gather), signal, wait; copy the peers' reduced slices into y.
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
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>

#include "handlers.h"
#include "ops_common.h"
#include "transport/reduce.cuh"
#include "transport/signal.cuh"

namespace jfo {
namespace {

constexpr OpId kOp = OpId::kAllReduce;
constexpr int kThreads = 512;
// Bytes per block before another block joins (up to kArMaxBlocks): few
// spinning CTAs for small messages. To be measured.
constexpr size_t kMinBlockBytes = 16u << 10;
enum Algorithm : int32_t { kOneShot = 0, kTwoShot = 1 };

std::atomic<uint64_t> g_host_calls{0};

struct Args {
  const void* x;
  void* y;
  size_t elements;  // N
  size_t chunk;     // elements per block; a multiple of 16 bytes
  size_t slice;     // two-shot: elements per rank within a chunk, likewise
  int n, rank;
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

template <typename T, bool kVector, int kAlgorithm>
__global__ void __launch_bounds__(kThreads) AllReduceKernel(Args a) {
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
    for (int q = 0; q < a.n; ++q) {
      if (q == a.rank) continue;
      const T* src = x + begin(q);
      T* dst = out(q) + begin(q);
      reduce::ReduceRange<T, kVector>(&src, 1, &dst, 1, begin(q + 1) - begin(q));
    }
    Signal(a, kArData, seq);
    Wait(a, kArData, seq, deadline, &failed);
    const size_t own = begin(a.rank);
    if (!failed) {
      int nd = 0;
      dsts[nd++] = y + own;
      for (int q = 0; q < a.n; ++q) {
        srcs[q] = in(q) + own;
        if (q != a.rank) dsts[nd++] = out(q) + own;
      }
      reduce::ReduceRange<T, kVector>(srcs, a.n, dsts, nd, begin(a.rank + 1) - own);
      Signal(a, kArGathered, seq);
      Wait(a, kArGathered, seq, deadline, &failed);
    }
    if (!failed) {
      for (int q = 0; q < a.n; ++q) {
        if (q == a.rank) continue;
        const T* src = in(q) + begin(q);
        T* dst = y + begin(q);
        reduce::ReduceRange<T, kVector>(&src, 1, &dst, 1, begin(q + 1) - begin(q));
      }
    }
  }
  if (failed) {  // a peer is missing: make the wrong result visible
    const T nan = static_cast<T>(__int_as_float(0x7fc00000));
    for (size_t i = threadIdx.x; i < count; i += blockDim.x) y[i] = nan;
  }
}

using KernelFn = void (*)(Args);

// [vector][algorithm]
template <typename T>
constexpr KernelFn kKernels[2][2] = {
    {AllReduceKernel<T, false, kOneShot>, AllReduceKernel<T, false, kTwoShot>},
    {AllReduceKernel<T, true, kOneShot>, AllReduceKernel<T, true, kTwoShot>}};

KernelFn PickKernel(ffi::DataType dtype, bool vector, int algorithm) {
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
      for (int algorithm : {kOneShot, kTwoShot}) {
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
  if (algorithm != kOneShot && algorithm != kTwoShot) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap all_reduce: algorithm must be 0 (one-shot) or 1 "
        "(two-shot), got " + std::to_string(algorithm));
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
  const size_t want = (elements * es + kMinBlockBytes - 1) / kMinBlockBytes;
  const size_t blocks0 =
      std::min<size_t>(std::max<size_t>(want, 1), kArMaxBlocks);
  Args a{};
  a.chunk = RoundUp((elements + blocks0 - 1) / blocks0, pack);
  // Recounted so that no block is empty.
  const unsigned blocks =
      static_cast<unsigned>((elements + a.chunk - 1) / a.chunk);
  a.slice = RoundUp((a.chunk + n - 1) / n, pack);
  if (a.chunk * es > region->stripe_bytes) {
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
  // Ranks may differ here: both variants split, place and round alike.
  const bool vector = reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(a.y) % 16 == 0;
  PickKernel(dtype, vector, algorithm)<<<blocks, kThreads, 0, stream>>>(a);
  JFO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace

uint64_t AllReduceHostCalls() {
  return g_host_calls.load(std::memory_order_relaxed);
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
        .Attr<int32_t>("algorithm"),      // 0: one-shot, 1: two-shot
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jfo
