// The decode kernel's weight stages: the GEMVs with their prologues (norms,
// gathers) and epilogues (rotary embeddings, residual adds, SwiGLU). The
// attention stage is attention.cuh.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "exchange.cuh"
#include "handoff.cuh"
#include "params.cuh"
#include "sync.cuh"

namespace jfo {
namespace transformer_decode {

__device__ __forceinline__ float Bf16Round(float v) {
  return __bfloat162float(__float2bfloat16(v));
}

// Loads bypassing L1: what other CTAs wrote during this launch.
__device__ __forceinline__ float LoadBf16(const __nv_bfloat16* p) {
  return __bfloat162float(__ldcg(p));
}

// GEMV stages: out[b][c] = sum_k operand[b][k] * w_item[k][c] on the tensor
// cores, operand the bf16 [batch][k + kOperandPad] in shared memory, the
// sums left in `result` [batch][C].
//
// An item's [k, C] weights come as 16x16 tiles (k-tile major, then column
// tile), each in the order of mma.m16n8k16's A fragment for the tile
// transposed (16 columns by 16 k): lane l's 8 values are contiguous, one
// 16-byte shared load a lane and tile, no bank conflicts (prepared by
// models/transformer_decode_cuda.py). The batch rows are the MMA's n (8:
// rows past the batch are zeros), so a chunk costs a few instructions a warp
// where CUDA-core FMAs cost ~25 a 16-byte word and held the stream below
// what the memory gives (scripts/hbm_stream_probe.cu).

constexpr int kTile = 16;

// Where operand[b][k] of a stage with k = n lies in shared memory.
__device__ __forceinline__ int OperandAt(int n, int b, int k) {
  return b * (n + kOperandPad) + k;
}

__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint4& a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

template <int C, int B>
__device__ void ItemProduct(const Params& p, Ring& ring, const WeightStage& st, int layer,
                            const __nv_bfloat16* operand, float* reduce, float* result) {
  constexpr int kColumnTiles = C / kTile;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;  // the fragments' row group, and thread in it
  // Lane (g, t) brings batch row g's k pairs 2t and 2t + 8 of each k-tile
  // (the B fragment); rows past the batch bring zeros.
  const __nv_bfloat16* row = operand + OperandAt(st.k, min(g, B - 1), 2 * t);
  float acc[kColumnTiles][4] = {};
  for (int chunk = 0; chunk < st.chunks_per_item; ++chunk) {
    const int row0 = chunk * st.rows_per_chunk;
    const int k_tiles = min(st.rows_per_chunk, st.k - row0) / kTile;
    const uint4* w = ring.Wait(p, layer);
    for (int kt = warp; kt < k_tiles; kt += kWarps) {
      const int k0 = row0 + kt * kTile;
      unsigned b0 = 0, b1 = 0;
      if (g < B) {
        b0 = *reinterpret_cast<const unsigned*>(row + k0);
        b1 = *reinterpret_cast<const unsigned*>(row + k0 + 8);
      }
#pragma unroll
      for (int ct = 0; ct < kColumnTiles; ++ct) {
        MmaBf16(acc[ct], w[(kt * kColumnTiles + ct) * 32 + lane], b0, b1);
      }
    }
    ring.Release(p);
  }
  // Lane (g, t) holds columns g and g + 8 of each tile for batch rows 2t
  // and 2t + 1: each warp's sums, then the warps'.
#pragma unroll
  for (int ct = 0; ct < kColumnTiles; ++ct) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int b = 2 * t + i;
      if (b < B) {
        float* sums = reduce + (warp * B + b) * C + ct * kTile;
        sums[g] = acc[ct][i];
        sums[g + 8] = acc[ct][2 + i];
      }
    }
  }
  __syncthreads();
  for (int at = threadIdx.x; at < B * C; at += kThreads) {
    float sum = 0.f;
#pragma unroll 4
    for (int w = 0; w < kWarps; ++w) sum += reduce[w * B * C + at];
    result[at] = sum;
  }
  __syncthreads();
}

// bf16 a 16-byte load: the operands' rows are multiples of it.
constexpr int kVector = 8;

__device__ __forceinline__ uint4* VectorAt(__nv_bfloat16* p) { return reinterpret_cast<uint4*>(p); }

// operand[b][k] = bf16(x[b][k] / rms(x[b]) * weight[k]), as models.layers.rms_norm;
// x another stage's (handoff.cuh) unless it is the launch's input.
template <int B>
__device__ void NormInto(const Params& p, const __nv_bfloat16* x, const float* weight,
                         __nv_bfloat16* operand, float* scalars, int layer) {
  float sums[B] = {};
  for (int k = threadIdx.x * kVector; k < p.d; k += kThreads * kVector) {
    uint4 loaded[B];
#pragma unroll
    for (int b = 0; b < B; ++b) loaded[b] = LoadHandoff(p, x + static_cast<size_t>(b) * p.d + k);
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const uint4 raw = x == p.x_in ? loaded[b]
                                    : Ready(p, x + static_cast<size_t>(b) * p.d + k, loaded[b],
                                            layer);
      *VectorAt(operand + OperandAt(p.d, b, k)) = raw;
      const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int i = 0; i < kVector / 2; ++i) {
        const float2 f = __bfloat1622float2(pairs[i]);
        sums[b] = fmaf(f.y, f.y, fmaf(f.x, f.x, sums[b]));
      }
    }
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int b = 0; b < B; ++b) {
    float v = sums[b];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) scalars[warp * B + b] = v;
  }
  __syncthreads();
  if (threadIdx.x < B) {
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += scalars[w * B + threadIdx.x];
    scalars[kWarps * B + threadIdx.x] = rsqrtf(total / p.d + p.eps);
  }
  __syncthreads();
  for (int k = threadIdx.x * kVector; k < p.d; k += kThreads * kVector) {
    float wk[kVector];
#pragma unroll
    for (int i = 0; i < kVector; ++i) wk[i] = __ldg(weight + k + i);
#pragma unroll
    for (int b = 0; b < B; ++b) {
      auto* pairs = reinterpret_cast<__nv_bfloat162*>(operand + OperandAt(p.d, b, k));
      const float scale = scalars[kWarps * B + b];
#pragma unroll
      for (int i = 0; i < kVector / 2; ++i) {
        const float2 f = __bfloat1622float2(pairs[i]);
        pairs[i] = __floats2bfloat162_rn(f.x * scale * wk[2 * i], f.y * scale * wk[2 * i + 1]);
      }
    }
  }
  __syncthreads();
}

// operand[b][k] = src[b][k] (bf16 [batch, n], n a multiple of kVector,
// handed over by other CTAs). A thread's loads of a round are all issued
// before any is checked.
template <int B>
__device__ void GatherInto(const Params& p, const __nv_bfloat16* src, int n,
                           __nv_bfloat16* operand, int layer) {
  constexpr int kRound = 4;
  const int per_row = n / kVector, vectors = B * per_row;
  for (int v0 = threadIdx.x; v0 < vectors; v0 += kThreads * kRound) {
    uint4 loaded[kRound];
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      const int v = v0 + i * kThreads;
      if (v < vectors) loaded[i] = LoadHandoff(p, src + static_cast<size_t>(v) * kVector);
    }
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      const int v = v0 + i * kThreads;
      if (v < vectors) {
        const int b = v / per_row, k = v % per_row * kVector;
        *VectorAt(operand + OperandAt(n, b, k)) =
            Ready(p, src + static_cast<size_t>(v) * kVector, loaded[i], layer);
      }
    }
  }
  __syncthreads();
}

// The QKV items of one KV head (its query heads, k and v, HD / 32 items each).
__device__ __forceinline__ int QkvItemsPerKvHead(const Params& p) {
  return (p.q_per_kv + 2) * (p.head_dim / kQkvColumns);
}

// Stage A's epilogue: one QKV item's 32 columns, rotated (q, k) and stored.

template <int B>
__device__ void QkvEpilogue(const Params& p, int layer, int item, int pos, const float* result) {
  const int h = p.head_dim, blocks = h / kQkvColumns;  // items a head
  const int group_items = QkvItemsPerKvHead(p);
  const int g = item / group_items, role = (item % group_items) / blocks;
  const int j0 = (item % blocks) * (kQkvColumns / 2);
  for (int t = threadIdx.x; t < B * (kQkvColumns / 2); t += kThreads) {
    const int b = t / (kQkvColumns / 2), i = t % (kQkvColumns / 2);
    const float x1 = Bf16Round(result[b * kQkvColumns + i]);
    const float x2 = Bf16Round(result[b * kQkvColumns + kQkvColumns / 2 + i]);
    const int dim1 = j0 + i, dim2 = h / 2 + j0 + i;
    if (role == p.q_per_kv + 1) {  // v: no rotation
      __nv_bfloat16* v = p.caches[layer].v +
                         ((static_cast<size_t>(b) * p.kv_heads + g) * p.cache_len + pos) * h;
      v[dim1] = __float2bfloat16(x1);
      v[dim2] = __float2bfloat16(x2);
      if (Polled(p)) {  // and for this step's attention
        __nv_bfloat16* row = NewRowOf(p, layer, b, g, 1);
        row[dim1] = HandoffValue(x1);
        row[dim2] = HandoffValue(x2);
      }
      continue;
    }
    // models.layers.rope: angle = pos * frequency. The host's table, not
    // theta ** (-2i / h) here: any rope scaling comes with it, and the
    // frequencies are the model's own float32 values.
    const float frequency = p.rope_frequencies[dim1];
    float sine, cosine;
    sincosf(static_cast<float>(pos) * frequency, &sine, &cosine);
    const float r1 = Bf16Round(x1 * cosine - x2 * sine);
    const float r2 = Bf16Round(x2 * cosine + x1 * sine);
    if (role == p.q_per_kv) {  // k
      __nv_bfloat16* k = p.caches[layer].k +
                         ((static_cast<size_t>(b) * p.kv_heads + g) * p.cache_len + pos) * h;
      k[dim1] = __float2bfloat16(r1);
      k[dim2] = __float2bfloat16(r2);
      if (Polled(p)) {
        __nv_bfloat16* row = NewRowOf(p, layer, b, g, 0);
        row[dim1] = HandoffValue(r1);
        row[dim2] = HandoffValue(r2);
      }
    } else {
      float* q = QOf(p, layer) + (static_cast<size_t>(b) * p.heads + g * p.q_per_kv + role) * h;
      q[dim1] = HandoffFloat(r1);
      q[dim2] = HandoffFloat(r2);
    }
  }
  __syncthreads();
}

// A residual add's element: thread t < B * C holds batch row t / C, column
// n0 + t % C of the [batch, d] residual stream.
template <int B, int C>
__device__ __forceinline__ size_t ResidualAt(int d, int n0) {
  static_assert(B * C <= kThreads, "a thread an element");
  return static_cast<size_t>(threadIdx.x / C) * d + n0 + threadIdx.x % C;
}

// The residual's element of this thread (ResidualAt), read before the item's
// GEMV (kResidualAhead) so that its load is not in the stage's tail.
template <int B, int C>
__device__ __forceinline__ float ResidualInput(const Params& p, const __nv_bfloat16* residual,
                                               int n0, int layer) {
  if (threadIdx.x >= B * C) return 0.f;
  const __nv_bfloat16* at = residual + ResidualAt<B, C>(p.d, n0);
  return Polled(p) && residual != p.x_in ? ReadyValue(p, at, layer) : LoadBf16(at);
}

// x_out[b][n0 + c] = residual + bf16(result[b][c]), in bf16 as the model's
// residual adds; `ahead`: ResidualInput's value, else the residual is read here.
// Across tensor ranks, result is this rank's partial, and the sum of every
// rank's (exchange.cuh) takes its place.
template <int B, int C>
__device__ void ResidualEpilogue(const Params& p, const __nv_bfloat16* residual,
                                 __nv_bfloat16* x_out, int n0, const float* result, bool ahead,
                                 float input, int layer, ExchangeStage stage, unsigned parity) {
  if (!ahead) input = ResidualInput<B, C>(p, residual, n0, layer);
  if (threadIdx.x < B * C) {
    float sum = Bf16Round(result[threadIdx.x]);
    if (TensorParallel(p)) {
      sum = SummedOverRanks(p, sum, parity, layer, stage, threadIdx.x / C, n0 + threadIdx.x % C);
    }
    x_out[ResidualAt<B, C>(p.d, n0)] = HandoffValue(input + sum);
  }
  __syncthreads();
}

// act[b][u0 + u] = bf16(silu(gate) * up) of the item's 32 units.
template <int B>
__device__ void SwigluEpilogue(const Params& p, __nv_bfloat16* act, int u0, const float* result) {
  constexpr int kUnits = kGateUpColumns / 2;
  for (int t = threadIdx.x; t < B * kUnits; t += kThreads) {
    const int b = t / kUnits, u = t % kUnits;
    const float gate = Bf16Round(result[b * kGateUpColumns + 2 * u]);
    const float up = Bf16Round(result[b * kGateUpColumns + 2 * u + 1]);
    act[static_cast<size_t>(b) * p.mlp + u0 + u] = HandoffValue(gate / (1.f + __expf(-gate)) * up);
  }
  // The next item's reduce barrier alone would order `result`; the CTA
  // leaves in step because without this barrier (and ResidualEpilogue's)
  // the step was no faster.
  __syncthreads();
}

}  // namespace transformer_decode
}  // namespace jfo
