// y = x * scale: the smallest CUDA op, used to check that a build's kernels
// load and run on the target GPU before the fused ops are tried.
#include "handlers.h"

namespace jfo {
namespace {

__global__ void ScaleKernel(const float* x, float* y, float scale, size_t n) {
  size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    y[i] = x[i] * scale;
  }
}

ffi::Error ScaleImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x,
                     ffi::ResultBuffer<ffi::F32> y, float scale) {
  const size_t n = x.element_count();
  if (y->element_count() != n) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap scale: x has " + std::to_string(n) +
        " elements but y has " + std::to_string(y->element_count()));
  }
  const int blocks = static_cast<int>(std::min<size_t>((n + 255) / 256, 4096));
  if (blocks > 0) {
    ScaleKernel<<<blocks, 256, 0, stream>>>(x.typed_data(), y->typed_data(),
                                            scale, n);
  }
  JFO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoScale, ScaleImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()          // XLA's stream
        .Arg<ffi::Buffer<ffi::F32>>()    // x
        .Ret<ffi::Buffer<ffi::F32>>()    // y = x * scale
        .Attr<float>("scale"),           // multiplier
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jfo
