// y = x, and the leading bytes of a few arrays fetched into L2 on the way.
//
// A decode step's weight GEMMs read every weight once, at HBM bandwidth, and
// between them run short kernels bound by latency (norms, rotary
// embeddings, attention over a short cache, tensor parallelism's
// all-reduce) during which HBM idles. Started before such a stretch, bulk
// L2 prefetches fetch the next GEMM's weights in that idle time, and the GEMM
// finds them in L2. The TMA unit does the fetching: the kernel only issues
// one prefetch per chunk and exits, so it holds the stream for about a
// launch, and nothing waits for the fetches. The arrays are only read.
// Before Hopper (no bulk prefetch) the kernel issues nothing: y = x alone.
#include <algorithm>
#include <string>

#include "handlers.h"

namespace jfo {
namespace {

constexpr int kMaxArrays = 8;
// Bytes per prefetch instruction: large enough that a few hundred threads
// cover an L2's worth, small enough to spread the chunks over the L2 slices.
constexpr uint64_t kChunkBytes = 64 * 1024;
constexpr int kThreads = 128;

struct PrefetchList {
  const char* data[kMaxArrays];
  uint64_t bytes[kMaxArrays];  // multiples of 16, as the bulk copy unit requires
  int count;
};

__global__ void __launch_bounds__(kThreads) PrefetchToL2Kernel(PrefetchList list) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The kernel after this one reads nothing it writes: it may start now.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
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
  // Launched early (programmatic serialization), this kernel may start
  // before the one ahead of it ends. The kernel after this one waits only
  // for this one: ending after the one ahead keeps what it wrote visible.
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
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
  uint64_t left = static_cast<uint64_t>(max_bytes), total = 0;
  for (size_t i = 0; i < arrays.size() && left >= 16; ++i) {
    auto array = arrays.get<ffi::AnyBuffer>(i);
    if (!array.has_value()) return array.error();
    const uint64_t bytes = std::min<uint64_t>(array->size_bytes(), left) & ~uint64_t{15};
    const auto address = reinterpret_cast<uintptr_t>(array->untyped_data());
    if (bytes == 0 || address % 16) continue;  // nothing to fetch, or not a bulk-copy address
    list.data[list.count] = static_cast<const char*>(array->untyped_data());
    list.bytes[list.count++] = bytes;
    left -= bytes;
    total += bytes;
  }
  if (list.count == 0) return ffi::Error::Success();
  const uint64_t chunks = (total + kChunkBytes - 1) / kChunkBytes;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(std::min<uint64_t>((chunks + kThreads - 1) / kThreads,
                                                                  64)), 1, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.stream = stream;
  // It reads nothing the kernel ahead writes: it may start before that one ends.
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  JFO_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, PrefetchToL2Kernel, list));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoPrefetchToL2, PrefetchToL2Impl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()      // XLA's stream
        .Arg<ffi::AnyBuffer>()       // x
        .RemainingArgs()             // the arrays to prefetch, in order
        .Ret<ffi::AnyBuffer>()       // y = x (aliased)
        .Attr<int64_t>("max_bytes"), // the bytes fetched, over all arrays, at most
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jfo
