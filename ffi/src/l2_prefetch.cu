// y = x, and the leading bytes of a few arrays fetched into L2 on the way.
//
// A decode step's weight GEMMs read every weight once, at HBM bandwidth, and
// between them run short kernels bound by latency (norms, rotary
// embeddings, attention over a short cache, tensor parallelism's
// all-reduce) during which HBM idles. Started before such a stretch, bulk
// L2 prefetches fetch the next GEMM's weights in that idle time, and the GEMM
// finds them in L2. The TMA units do the fetching, each at a fraction of HBM's
// bandwidth and only while its CTA stays resident: one warp on every SM
// issues the chunks, on a side stream forked from XLA's at the call, so that
// XLA's next kernels run while the fetches do. Nothing joins the side
// stream back: the arrays are only read, and a prefetch changes no value.
// Before Hopper (no bulk prefetch) the kernel issues nothing: y = x alone.
#include <algorithm>
#include <mutex>
#include <string>
#include <unordered_map>

#include "handlers.h"

namespace jfo {
namespace {

constexpr int kMaxArrays = 8;
// Bytes per prefetch instruction: small enough that every SM's TMA unit
// gets a share of a few MiB, large enough to keep the instructions few.
constexpr uint64_t kChunkBytes = 16 * 1024;
constexpr int kThreads = 32;  // one warp a CTA, one CTA an SM

struct PrefetchList {
  const char* data[kMaxArrays];
  uint64_t bytes[kMaxArrays];  // multiples of 16, as the bulk copy unit requires
  int count;
};

__global__ void __launch_bounds__(kThreads) PrefetchToL2Kernel(PrefetchList list) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint64_t threads = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint64_t chunk = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int a = 0; a < list.count; ++a) {
    const uint64_t chunks = (list.bytes[a] + kChunkBytes - 1) / kChunkBytes;
    for (; chunk < chunks; chunk += threads) {
      const uint64_t offset = chunk * kChunkBytes;
      const uint64_t rest = list.bytes[a] - offset;
      const uint32_t size = static_cast<uint32_t>(rest < kChunkBytes ? rest : kChunkBytes);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(list.data[a] + offset),
                   "r"(size)
                   : "memory");
    }
    chunk -= chunks;  // this thread's index into the next array's chunks
  }
#endif
}

// Per device: the side stream the prefetches run on, the event that forks
// it from XLA's stream at each call, and the SMs to spread the chunks over.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;
  int sms = 0;
};

ffi::Error DeviceSideStream(SideStream** out) {
  static std::mutex mu;
  static std::unordered_map<int, SideStream> streams;
  int device = 0;
  JFO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  SideStream& side = streams[device];
  if (side.stream == nullptr) {
    JFO_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&side.sms, cudaDevAttrMultiProcessorCount, device));
    JFO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&side.fork, cudaEventDisableTiming));
    JFO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&side.stream, cudaStreamNonBlocking));
  }
  *out = &side;
  return ffi::Error::Success();
}

ffi::Error PrefetchToL2Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingArgs arrays,
                            ffi::Result<ffi::AnyBuffer> y, int64_t max_bytes) {
  if (arrays.size() > kMaxArrays) {
    return ffi::Error::InvalidArgument("jax_flashoverlap prefetch_to_l2: at most " +
                                       std::to_string(kMaxArrays) + " arrays, got " +
                                       std::to_string(arrays.size()));
  }
  if (max_bytes < 0) {
    return ffi::Error::InvalidArgument("jax_flashoverlap prefetch_to_l2: max_bytes must be >= 0");
  }
  if (y->size_bytes() != x.size_bytes()) {
    return ffi::Error::InvalidArgument("jax_flashoverlap prefetch_to_l2: y and x differ in size");
  }
  if (y->untyped_data() != x.untyped_data()) {  // y is meant to alias x
    JFO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), x.size_bytes(),
                                             cudaMemcpyDeviceToDevice, stream));
  }
  PrefetchList list = {};
  uint64_t left = static_cast<uint64_t>(max_bytes);
  for (size_t i = 0; i < arrays.size() && left >= 16; ++i) {
    auto array = arrays.get<ffi::AnyBuffer>(i);
    if (!array.has_value()) return array.error();
    const uint64_t bytes = std::min<uint64_t>(array->size_bytes(), left) & ~uint64_t{15};
    const auto address = reinterpret_cast<uintptr_t>(array->untyped_data());
    if (bytes == 0 || address % 16) continue;  // nothing to fetch, or not a bulk-copy address
    list.data[list.count] = static_cast<const char*>(array->untyped_data());
    list.bytes[list.count++] = bytes;
    left -= bytes;
  }
  if (list.count == 0) return ffi::Error::Success();
  SideStream* side = nullptr;
  JFO_RETURN_IF_ERROR(DeviceSideStream(&side));
  // Forked here, the fetches start once what XLA queued before this call is
  // done (the GEMM ahead has its weights), not before.
  JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(side->fork, stream));
  JFO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side->stream, side->fork, 0));
  PrefetchToL2Kernel<<<side->sms, kThreads, 0, side->stream>>>(list);
  JFO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace

// Not command-buffer compatible: the side stream it forks never joins back,
// which a captured graph does not allow.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoPrefetchToL2, PrefetchToL2Impl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()       // XLA's stream
        .Arg<ffi::AnyBuffer>()        // x
        .RemainingArgs()              // the arrays to prefetch, in order
        .Ret<ffi::AnyBuffer>()        // y = x (aliased)
        .Attr<int64_t>("max_bytes"));  // the bytes fetched, over all arrays, at most

}  // namespace jfo
