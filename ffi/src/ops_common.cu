#include "ops_common.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <vector>

namespace jfo {
namespace {

constexpr int kMaxAddSources = 8;

struct AddSources {
  const void* p[kMaxAddSources];
  int count;
};

// d = first + the sources (first may be d itself).
template <typename T>
__global__ void AddIntoKernel(T* d, const T* first, AddSources srcs, size_t elements) {
  size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < elements;
       i += stride) {
    float acc = static_cast<float>(first[i]);
    for (int j = 0; j < srcs.count; ++j) {
      acc += static_cast<float>(static_cast<const T*>(srcs.p[j])[i]);
    }
    d[i] = static_cast<T>(acc);
  }
}

std::string Where(OpId op) {
  return std::string("jax_flashoverlap ") + OpName(op) + ": ";
}

}  // namespace

ffi::Error CheckDtypes(OpId op, std::initializer_list<ffi::DataType> types) {
  ffi::DataType first = *types.begin();
  for (ffi::DataType t : types) {
    if (t != first || !IsSupportedFloat(t)) {
      return ffi::Error::InvalidArgument(
          Where(op) + "operands and results must share one dtype among "
          "bfloat16, float16, float32 (got XLA dtypes " +
          std::to_string(static_cast<int>(first)) + " and " +
          std::to_string(static_cast<int>(t)) + ")");
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckShape(OpId op, const char* name, const Buffer_Type& b,
                      int64_t rows, int64_t cols) {
  auto dims = b.dimensions();
  if (dims.size() == 2 && dims[0] == rows && dims[1] == cols) {
    return ffi::Error::Success();
  }
  return ffi::Error::InvalidArgument(
      Where(op) + name + " has shape " + DimsToString(b) + ", expected [" +
      std::to_string(rows) + ", " + std::to_string(cols) + "]");
}

ffi::Error CheckOrder(OpId op, I32Span order, int n, bool own_first) {
  if (static_cast<int64_t>(order.size()) != static_cast<int64_t>(n) * n) {
    return ffi::Error::InvalidArgument(
        Where(op) + "order has " + std::to_string(order.size()) +
        " entries, expected n*n = " + std::to_string(n * n));
  }
  for (int r = 0; r < n; ++r) {
    std::vector<bool> seen(n, false);
    for (int i = 0; i < n; ++i) {
      int v = order[r * n + i];
      if (v < 0 || v >= n || seen[v]) {
        return ffi::Error::InvalidArgument(
            Where(op) + "order row " + std::to_string(r) +
            " is not a permutation of 0.." + std::to_string(n - 1));
      }
      seen[v] = true;
    }
    if (order[r * n + (own_first ? 0 : n - 1)] != r) {
      return ffi::Error::InvalidArgument(
          Where(op) + "order row " + std::to_string(r) + " must " +
          (own_first ? "start" : "end") + " with " + std::to_string(r));
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckCommon(OpId op, int32_t timeout_ms, int32_t chunks) {
  if (timeout_ms <= 0 || chunks < 1 || chunks > 64) {
    return ffi::Error::InvalidArgument(
        Where(op) + "need timeout_ms > 0 and 1 <= chunks <= 64, got " +
        std::to_string(timeout_ms) + " and " + std::to_string(chunks));
  }
  return ffi::Error::Success();
}

ffi::Error CheckInnerDim(OpId op, int64_t k) {
  if (k >= 1) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(Where(op) + "x and w share no inner dimension (K = " +
                                     std::to_string(k) + "); K must be at least 1");
}

ffi::Error CheckSwitch(OpId op, const char* name, int32_t value) {
  if (value == 0 || value == 1) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(Where(op) + name + " must be 0 or 1, got " +
                                     std::to_string(value));
}

ffi::Error OpInitialize(OpId op, OpSetup setup, int ordinal,
                        ffi::Dictionary attrs) {
  auto ordinals = attrs.get<I32Span>("group_ordinals");
  auto n = attrs.get<int32_t>("n");
  auto timeout_ms = attrs.get<int32_t>("timeout_ms");
  if (ordinals.has_error()) return ordinals.error();
  if (n.has_error()) return n.error();
  if (timeout_ms.has_error()) return timeout_ms.error();
  auto group = FindGroup(op, *ordinals, *n, ordinal);
  if (group.has_error()) return group.error();
  JFO_RETURN_IF_ERROR(EnsureGroupReady(op, *group, *timeout_ms));
  DeviceGuard guard(ordinal);
  return setup(ordinal);
}

ffi::Error FusedOpSetup(int ordinal) {
  cudaFuncAttributes attrs;
  JFO_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attrs, AddIntoKernel<__nv_bfloat16>));
  JFO_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attrs, AddIntoKernel<__half>));
  JFO_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attrs, AddIntoKernel<float>));
  return GemmInit(ordinal);
}

ffi::Error RowGemm(Channel& ch, ffi::DataType dtype, int64_t rows, int64_t n,
                   int64_t k, const void* x, const void* w, const void* c,
                   void* d) {
  size_t ws_bytes = 0;
  void* ws = ch.GemmWorkspace(&ws_bytes);
  GemmArgs g{dtype, rows, n, k, x, k, w, n, c, n, d, n};
  return Gemm(ch.ordinal(), g, ws, ws_bytes, ch.stream(), ch.rehearsal());
}

ffi::Error GemmPlusPartials(Channel& ch, ffi::DataType dtype, int64_t rows,
                            int64_t n, int64_t k, const void* x, const void* w,
                            void* out, const std::vector<int>& peers,
                            int index, size_t offset) {
  std::vector<const void*> partials;
  for (int q : peers) {
    char* partial = ch.RecvSlot(q) + offset;
    auto landed = ch.Arrival(q, index, nullptr,
                             {partial, static_cast<size_t>(rows * n) * DataTypeBytes(dtype)});
    if (landed.has_error()) return landed.error();
    JFO_RETURN_IF_ERROR(ch.WaitOn(*landed));
    partials.push_back(partial);
  }
  const void* c = partials.empty() ? nullptr : partials.front();
  JFO_RETURN_IF_ERROR(RowGemm(ch, dtype, rows, n, k, x, w, c, out));
  if (partials.size() < 2) return ffi::Error::Success();
  partials.erase(partials.begin());
  return AddInto(ch, dtype, out, partials, rows * n);
}

ffi::Error AddInto(Channel& ch, ffi::DataType dtype, void* d,
                   const std::vector<const void*>& srcs, size_t elements) {
  return SumInto(ch, dtype, d, d, srcs, elements);
}

ffi::Error CopyOutOnArrival(Channel& ch, int peer_rank, int index, char* dst, size_t offset,
                            size_t bytes, cudaEvent_t after) {
  auto landed = ch.Arrival(peer_rank, index, after);
  if (landed.has_error()) return landed.error();
  return ch.CopyLocal(dst + offset, ch.RecvSlot(peer_rank) + offset, bytes, *landed);
}

ffi::Error SumInto(Channel& ch, ffi::DataType dtype, void* d, const void* first,
                   const std::vector<const void*>& srcs, size_t elements) {
  if (ch.rehearsal() || (srcs.empty() && first == d)) return ffi::Error::Success();
  const int blocks = static_cast<int>(std::min<size_t>((elements + 255) / 256, 1024));
  if (blocks == 0) return ffi::Error::Success();
  // Groups of kMaxAddSources: the first group adds to `first`, the rest to d.
  for (size_t begin = 0; begin == 0 || begin < srcs.size(); begin += kMaxAddSources) {
    AddSources s{};
    s.count = static_cast<int>(
        std::min<size_t>(kMaxAddSources, srcs.size() - std::min(begin, srcs.size())));
    for (int j = 0; j < s.count; ++j) s.p[j] = srcs[begin + j];
    const void* from = begin == 0 ? first : d;
    switch (dtype) {
      case ffi::DataType::BF16:
        AddIntoKernel<<<blocks, 256, 0, ch.stream()>>>(
            static_cast<__nv_bfloat16*>(d), static_cast<const __nv_bfloat16*>(from), s,
            elements);
        break;
      case ffi::DataType::F16:
        AddIntoKernel<<<blocks, 256, 0, ch.stream()>>>(
            static_cast<__half*>(d), static_cast<const __half*>(from), s, elements);
        break;
      default:
        AddIntoKernel<<<blocks, 256, 0, ch.stream()>>>(
            static_cast<float*>(d), static_cast<const float*>(from), s, elements);
    }
    JFO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return ffi::Error::Success();
}

}  // namespace jfo

