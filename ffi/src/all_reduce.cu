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
// The kernels: all_reduce_flags.cu (one-shot, two-shot: data through the
// peers' slots, flags for when it is there) and all_reduce_lamport.cu (one
// shot without flags, for small messages). This file picks one, sizes its
// grid and launches it.
#include <algorithm>
#include <atomic>

#include "all_reduce.h"
#include "handlers.h"
#include "transport/fingerprint.h"

namespace jfo {
namespace {

using namespace all_reduce;  // NOLINT: the op's own kernels and launch shapes

constexpr OpId kOp = OpId::kAllReduce;

std::atomic<uint64_t> g_host_calls{0};
std::atomic<uint64_t> g_direct_gathers{0};

KernelFn PickKernel(ffi::DataType dtype, bool vector, int algorithm) {
  return algorithm == kLamport ? LamportKernel(dtype, vector)
                               : FlagKernel(dtype, vector, static_cast<Algorithm>(algorithm));
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
  if (algorithm == kLamport && elements * es > region->lamport_data_bytes) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap all_reduce: the Lamport one-shot takes messages up "
        "to " + std::to_string(region->lamport_data_bytes >> 10) +
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
  a.info.ordinal = group->ids[group->rank];
  a.info.timeout_ms = timeout_ms;
  a.region = *region;
  a.fingerprint = CallFingerprint(OpName(kOp))
                      .Option("dtype", static_cast<int>(dtype))
                      .Option("elements", static_cast<int64_t>(elements))
                      .Option("algorithm", algorithm)
                      .Seal();
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
  JFO_RETURN_IF_ERROR(ApplyFault(kOp, *group, stream));
  PickKernel(dtype, vector, algorithm)<<<blocks, threads, 0, stream>>>(a);
  const cudaError_t launched = cudaGetLastError();
  if (launched != cudaSuccess) {
    // The peers' kernels run and wait for this one's data: a fault.
    const std::string why = std::string("jax_flashoverlap all_reduce: "
                                        "launch failed: ") +
                            cudaGetErrorString(launched);
    MarkFailed(group->ids, why);
    return ffi::Error::Internal(why);
  }
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
