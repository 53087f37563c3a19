// Elementwise sums of several ranks' buffers, shared by the all-reduce
// kernels (single-process in ../all_reduce.cu, NVSHMEM in
// ../nvshmem/hierarchical_all_reduce.cu): fp32 accumulation in a fixed
// order and one rounding, so every rank gets the same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

namespace jfo {
namespace reduce {

// Loads bypass L1: a peer rewrites the slots between calls, and loads of x
// read each element once anyway.
template <typename T>
__device__ __forceinline__ float LoadFloat(const T* p) {
  return static_cast<float>(__ldcg(p));
}

// 16 bytes of T as floats and back (round to nearest even, like a scalar
// static_cast, so vector and tail paths round alike).
template <typename T>
struct Pack16 {
  static constexpr int kN = 16 / sizeof(T);
  static __device__ __forceinline__ void Load(uint4 raw, float (&acc)[kN]) {
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kN; ++i) acc[i] = static_cast<float>(v[i]);
  }
  static __device__ __forceinline__ void Add(uint4 raw, float (&acc)[kN]) {
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kN; ++i) acc[i] += static_cast<float>(v[i]);
  }
  static __device__ __forceinline__ uint4 Round(const float (&acc)[kN]) {
    uint4 raw;
    T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = static_cast<T>(acc[i]);
    return raw;
  }
};

// dsts[d][i] = srcs[0][i] + ... + srcs[nsrc-1][i] for i < count, by the whole
// block: in that order, in fp32, rounded once (nsrc == 1 copies the bits).
// kVector: every pointer is 16-byte aligned; the last count % (16 / sizeof T)
// elements take the scalar path.
template <typename T, bool kVector>
__device__ void ReduceRange(const T* const* srcs, int nsrc, T* const* dsts,
                            int ndst, size_t count) {
  constexpr int kN = Pack16<T>::kN;
  size_t done = 0;
  if constexpr (kVector) {
    const size_t packs = count / kN;
    for (size_t p = threadIdx.x; p < packs; p += blockDim.x) {
      uint4 raw = __ldcg(reinterpret_cast<const uint4*>(srcs[0]) + p);
      if (nsrc > 1) {
        float acc[kN];
        Pack16<T>::Load(raw, acc);
        for (int s = 1; s < nsrc; ++s) {
          Pack16<T>::Add(__ldcg(reinterpret_cast<const uint4*>(srcs[s]) + p),
                         acc);
        }
        raw = Pack16<T>::Round(acc);
      }
      for (int d = 0; d < ndst; ++d) reinterpret_cast<uint4*>(dsts[d])[p] = raw;
    }
    done = packs * kN;
  }
  for (size_t i = done + threadIdx.x; i < count; i += blockDim.x) {
    T v = __ldcg(srcs[0] + i);
    if (nsrc > 1) {
      float acc = static_cast<float>(v);
      for (int s = 1; s < nsrc; ++s) acc += LoadFloat(srcs[s] + i);
      v = static_cast<T>(acc);
    }
    for (int d = 0; d < ndst; ++d) dsts[d][i] = v;
  }
}

}  // namespace reduce
}  // namespace jfo
