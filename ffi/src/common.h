// Aliases and helpers shared by every handler (the TransformerEngine pattern):
// one error macro, one place that maps XLA dtypes to CUDA ones.
#pragma once

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jfo {

namespace ffi = xla::ffi;

using Buffer_Type = ffi::AnyBuffer;
using Result_Type = ffi::Result<ffi::AnyBuffer>;
using Error_Type = ffi::Error;
using FFI_Stream_Type = ffi::PlatformStream<cudaStream_t>;
using I32Span = ffi::Span<const int32_t>;

// Returns an ffi::Error naming the failing call and its location, so a
// failure on one of several GPUs can be traced without a debugger.
#define JFO_CUDA_RETURN_IF_ERROR(expr)                                       \
  do {                                                                       \
    cudaError_t jfo_err_ = (expr);                                           \
    if (jfo_err_ != cudaSuccess) {                                           \
      return ::xla::ffi::Error::Internal(                                    \
          std::string("jax_flashoverlap: ") + #expr + " failed at " +        \
          __FILE__ + ":" + std::to_string(__LINE__) + ": " +                 \
          cudaGetErrorString(jfo_err_));                                     \
    }                                                                        \
  } while (0)

// Propagates a failed ffi::Error (or the error of an ErrorOr) to the caller.
#define JFO_RETURN_IF_ERROR(expr)                  \
  do {                                             \
    ::xla::ffi::Error jfo_status_ = (expr);        \
    if (jfo_status_.failure()) return jfo_status_; \
  } while (0)

// Declares `lhs` from the value of an ffi::ErrorOr, or returns its error.
#define JFO_CONCAT_INNER(a, b) a##b
#define JFO_CONCAT(a, b) JFO_CONCAT_INNER(a, b)
#define JFO_ASSIGN_OR_RETURN(lhs, expr) \
  JFO_ASSIGN_OR_RETURN_IMPL(JFO_CONCAT(jfo_or_, __LINE__), lhs, expr)
#define JFO_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (tmp.has_error()) return tmp.error();        \
  lhs = std::move(*tmp)

// Sets the current device for a scope (XLA's threads may expect theirs back).
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) {
    cudaGetDevice(&saved_);
    cudaSetDevice(ordinal);
  }
  ~DeviceGuard() { cudaSetDevice(saved_); }

 private:
  int saved_ = 0;
};

// What the kernels' launches ask of a device, read once per device (a
// decode step's host time is time its GPU may wait for).
struct DeviceInfo {
  int sms = 0, major = 0, max_shared = 0;  // max_shared: a block's opt-in bytes
};

inline DeviceInfo DeviceInfoOf(int device) {
  static std::mutex mu;
  static std::vector<DeviceInfo> infos;
  std::lock_guard<std::mutex> lock(mu);
  if (device >= static_cast<int>(infos.size())) infos.resize(device + 1);
  DeviceInfo& info = infos[device];
  if (info.sms == 0) {
    cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&info.max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  return info;
}

inline bool IsSupportedFloat(ffi::DataType t) {
  return t == ffi::DataType::BF16 || t == ffi::DataType::F16 ||
         t == ffi::DataType::F32;
}

inline cudaDataType_t ToCudaDataType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return CUDA_R_16BF;
    case ffi::DataType::F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

inline size_t DataTypeBytes(ffi::DataType t) { return ffi::ByteWidth(t); }

inline std::string DimsToString(const Buffer_Type& b) {
  std::string s = "[";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return s + "]";
}

}  // namespace jfo
