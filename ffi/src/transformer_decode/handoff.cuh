// Where the decode kernel's stages leave what the next stage reads, and how
// that stage reads it.
//
// With kPolledHandoffs (the default) every layer's outputs have their own
// buffers in the workspace (Params::handoffs), filled with kHandoffEmpty at
// the launch's start, and the next stage polls the values themselves until
// none is kHandoffEmpty: no fence, no grid barrier, and a CTA starts as soon
// as what it reads is there (a fence before a count waited ~1.5-3 us for
// the SM's writes while the weights streamed). No value a stage writes is kHandoffEmpty (HandoffValue). A poll that
// waits past the timeout traps. Without it, the stages write buffers every
// layer reuses (the residual stream in place in x_out), and a grid barrier
// between stages makes the writes visible.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "params.cuh"
#include "sync.cuh"

namespace jfo {
namespace transformer_decode {

// bf16 0xFFFF: a NaN's bit pattern that HandoffValue never writes.
constexpr unsigned short kHandoffEmpty = 0xFFFF;

__device__ __forceinline__ bool Polled(const Params& p) {
  return p.options & kPolledHandoffs;
}

// A layer's handoff buffers, in bf16 elements from its first: x after the
// attention's residual add [B, d], the SwiGLU's output [B, mlp], x after the
// MLP's residual add [B, d], the attention's output [B, heads * head_dim],
// the rotated q in float32 [B, heads, head_dim] (2 elements a value), and
// the new k and v rows [B, kv_heads, 2, head_dim].
__device__ __forceinline__ __nv_bfloat16* HandoffsOf(const Params& p, int layer) {
  const size_t per_layer = static_cast<size_t>(p.batch) *
                           (2 * p.d + p.mlp + 3 * p.heads * p.head_dim +
                            2 * p.kv_heads * p.head_dim);
  return p.handoffs + layer * per_layer;
}

__device__ __forceinline__ __nv_bfloat16* XAfterAttentionOf(const Params& p, int layer) {
  return Polled(p) ? HandoffsOf(p, layer) : p.x_out;
}

__device__ __forceinline__ __nv_bfloat16* ActOf(const Params& p, int layer) {
  return Polled(p) ? HandoffsOf(p, layer) + p.batch * p.d : p.act;
}

// The last layer's goes to the kernel's output.
__device__ __forceinline__ __nv_bfloat16* XAfterMlpOf(const Params& p, int layer) {
  return Polled(p) && layer + 1 < p.layers
             ? HandoffsOf(p, layer) + p.batch * (p.d + p.mlp)
             : p.x_out;
}

__device__ __forceinline__ __nv_bfloat16* AttendedOf(const Params& p, int layer) {
  return Polled(p) ? HandoffsOf(p, layer) + p.batch * (2 * p.d + p.mlp) : p.attended;
}

__device__ __forceinline__ float* QOf(const Params& p, int layer) {
  return Polled(p) ? reinterpret_cast<float*>(HandoffsOf(p, layer) +
                                              p.batch * (2 * p.d + p.mlp + p.heads * p.head_dim))
                   : p.q;
}

// Batch row b's new k (kv = 0) or v (kv = 1) row of KV head g.
__device__ __forceinline__ __nv_bfloat16* NewRowOf(const Params& p, int layer, int b, int g,
                                                   int kv) {
  return HandoffsOf(p, layer) + p.batch * (2 * p.d + p.mlp + 3 * p.heads * p.head_dim) +
         ((static_cast<size_t>(b) * p.kv_heads + g) * 2 + kv) * p.head_dim;
}

// The blocks' input of `layer`: the launch's x, or the previous layer's.
__device__ __forceinline__ const __nv_bfloat16* LayerInputOf(const Params& p, int layer) {
  return layer == 0 ? p.x_in : XAfterMlpOf(p, layer - 1);
}

// What a stage writes for the next: never kHandoffEmpty.
__device__ __forceinline__ __nv_bfloat16 HandoffValue(float v) {
  __nv_bfloat16_raw raw = __float2bfloat16(v);
  if (raw.x == kHandoffEmpty) raw.x = 0x7FFF;
  return raw;
}

// The same for float32 values: never all bits set.
__device__ __forceinline__ float HandoffFloat(float v) {
  return __float_as_uint(v) == 0xFFFFFFFFu ? __uint_as_float(0x7FFFFFFFu) : v;
}

// Every CTA its share of `count` 16-byte words, every bit set (kHandoffEmpty).
__device__ inline void FillEmpty(void* start, size_t count) {
  auto* words = static_cast<uint4*>(start);
  for (size_t i = blockIdx.x * static_cast<size_t>(kThreads) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * kThreads) {
    words[i] = make_uint4(~0u, ~0u, ~0u, ~0u);
  }
}

// Every CTA its share of the handoff buffers, kHandoffEmpty (then
// CountCleared: no CTA writes a handoff before all are counted).
__device__ inline void ClearHandoffs(const Params& p) {
  FillEmpty(p.handoffs, p.handoff_bytes / sizeof(uint4));
}

// After the CTA's clearing: counted in p.cleared.
__device__ inline void CountCleared(const Params& p) {
  __syncthreads();
  if (threadIdx.x == 0) Arrive(p, p.cleared);
}

// N 32-bit words at src (aligned to their size), a load that reaches L2.
template <int N>
__device__ __forceinline__ void LoadWords(const void* src, unsigned (&w)[N]) {
  static_assert(N == 1 || N == 2 || N == 4, "1, 2 or 4 words");
  if constexpr (N == 1) {
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(w[0]) : "l"(src) : "memory");
  } else if constexpr (N == 2) {
    asm volatile("ld.relaxed.gpu.global.v2.u32 {%0, %1}, [%2];"
                 : "=r"(w[0]), "=r"(w[1]) : "l"(src) : "memory");
  } else {
    asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(src) : "memory");
  }
}

// Whether a word holds an empty value (kFloats: an empty float, else an
// empty bf16 in either half).
template <int N, bool kFloats>
__device__ __forceinline__ bool HasEmptyWord(const unsigned (&w)[N]) {
  bool any = false;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    any |= kFloats ? w[i] == 0xFFFFFFFFu
                   : (w[i] & 0xFFFFu) == kHandoffEmpty || (w[i] >> 16) == kHandoffEmpty;
  }
  return any;
}

// `w`, an earlier LoadWords of src, loaded again until no word is empty.
template <int N, bool kFloats>
__device__ inline void PollWords(const Params& p, const void* src, unsigned (&w)[N], int layer) {
  if (!HasEmptyWord<N, kFloats>(w)) return;
  const uint64_t start = GlobalTimerNs();
  do {
    if (GlobalTimerNs() - start > p.timeout_ns) {
      TimedOut("a value another CTA hands over", layer, 0, 1);
    }
    LoadWords(src, w);
  } while (HasEmptyWord<N, kFloats>(w));
}

// 8 bf16 at p (16-byte aligned), a load that reaches L2 each time.
__device__ __forceinline__ uint4 LoadRelaxed(const __nv_bfloat16* p) {
  unsigned w[4];
  LoadWords(p, w);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ bool HasEmpty(const uint4& v) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
  return HasEmptyWord<4, false>(w);
}

// 8 bf16 at src (16-byte aligned): with polling, `first` (an earlier
// LoadRelaxed of src) or later loads until none is empty; without, `first`.
__device__ inline uint4 Ready(const Params& p, const __nv_bfloat16* src, uint4 first,
                              int layer) {
  if (!Polled(p) || !HasEmpty(first)) return first;
  unsigned w[4] = {first.x, first.y, first.z, first.w};
  PollWords<4, false>(p, src, w, layer);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The first load of 8 bf16 that Ready then checks.
__device__ __forceinline__ uint4 LoadHandoff(const Params& p, const __nv_bfloat16* src) {
  return Polled(p) ? LoadRelaxed(src) : __ldcg(reinterpret_cast<const uint4*>(src));
}

// The 16-byte-aligned vector of 8 bf16 that holds *src.
__device__ __forceinline__ const __nv_bfloat16* VectorOf(const __nv_bfloat16* src) {
  return src - (reinterpret_cast<uintptr_t>(src) / 2) % 8;
}

// Element i of 8 bf16, as float.
__device__ __forceinline__ float ElementOf(const uint4& v, int i) {
  // Selected, not indexed: an indexed register array would live in local memory.
  const unsigned word = i < 4 ? (i < 2 ? v.x : v.y) : (i < 6 ? v.z : v.w);
  return __uint_as_float((i & 1 ? word >> 16 : word & 0xFFFFu) << 16);
}

// One bf16 that another CTA wrote: polled until it is not empty.
__device__ inline float ReadyValue(const Params& p, const __nv_bfloat16* src, int layer) {
  const __nv_bfloat16* vector = VectorOf(src);
  const uint4 v = Ready(p, vector, LoadHandoff(p, vector), layer);
  return ElementOf(v, static_cast<int>(src - vector));
}

}  // namespace transformer_decode
}  // namespace jfo
