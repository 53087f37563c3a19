// The decode kernel's stages: the weight GEMVs with their prologues (norms)
// and epilogues (rotary embeddings, residual adds, SwiGLU), and the attention.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

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

// operand[b][k] = bf16(x[b][k] / rms(x[b]) * weight[k]), as models.layers.rms_norm.
template <int B>
__device__ void NormInto(const Params& p, const __nv_bfloat16* x, const float* weight,
                         __nv_bfloat16* operand, float* scalars) {
  float sums[B] = {};
  for (int k = threadIdx.x; k < p.d; k += kThreads) {
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const __nv_bfloat16 v = __ldcg(x + static_cast<size_t>(b) * p.d + k);
      operand[OperandAt(p.d, b, k)] = v;
      const float f = __bfloat162float(v);
      sums[b] = fmaf(f, f, sums[b]);
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
  for (int k = threadIdx.x; k < p.d; k += kThreads) {
    const float wk = weight[k];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      __nv_bfloat16& v = operand[OperandAt(p.d, b, k)];
      v = __float2bfloat16(__bfloat162float(v) * scalars[kWarps * B + b] * wk);
    }
  }
  __syncthreads();
}

// operand[b][k] = src[b][k] (bf16 [batch, n] written by other CTAs).
template <int B>
__device__ void GatherInto(const __nv_bfloat16* src, int n, __nv_bfloat16* operand) {
  for (int k = threadIdx.x; k < n; k += kThreads) {
#pragma unroll
    for (int b = 0; b < B; ++b) {
      operand[OperandAt(n, b, k)] = __ldcg(src + static_cast<size_t>(b) * n + k);
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
      continue;
    }
    // models.transformer.rope: theta ** (-2i / h), angle = pos * frequency.
    const float frequency = powf(p.rope_theta, -static_cast<float>(2 * dim1) / h);
    float sine, cosine;
    sincosf(static_cast<float>(pos) * frequency, &sine, &cosine);
    const float r1 = Bf16Round(x1 * cosine - x2 * sine);
    const float r2 = Bf16Round(x2 * cosine + x1 * sine);
    if (role == p.q_per_kv) {  // k
      __nv_bfloat16* k = p.caches[layer].k +
                         ((static_cast<size_t>(b) * p.kv_heads + g) * p.cache_len + pos) * h;
      k[dim1] = __float2bfloat16(r1);
      k[dim2] = __float2bfloat16(r2);
    } else {
      float* q = p.q + (static_cast<size_t>(b) * p.heads + g * p.q_per_kv + role) * h;
      q[dim1] = r1;
      q[dim2] = r2;
    }
  }
  __syncthreads();
}

// x[b][n0 + c] += bf16(result[b][c]), in bf16 as the model's residual adds.
template <int B, int C>
__device__ void ResidualEpilogue(const __nv_bfloat16* residual, __nv_bfloat16* x_out, int d,
                                 int n0, const float* result) {
  for (int t = threadIdx.x; t < B * C; t += kThreads) {
    const int b = t / C, c = t % C;
    const size_t at = static_cast<size_t>(b) * d + n0 + c;
    x_out[at] = __float2bfloat16(LoadBf16(residual + at) + Bf16Round(result[t]));
  }
  __syncthreads();
}

// act[b][u0 + u] = bf16(silu(gate) * up) of the item's 32 units.
template <int B>
__device__ void SwigluEpilogue(const Params& p, int u0, const float* result) {
  constexpr int kUnits = kGateUpColumns / 2;
  for (int t = threadIdx.x; t < B * kUnits; t += kThreads) {
    const int b = t / kUnits, u = t % kUnits;
    const float gate = Bf16Round(result[b * kGateUpColumns + 2 * u]);
    const float up = Bf16Round(result[b * kGateUpColumns + 2 * u + 1]);
    p.act[static_cast<size_t>(b) * p.mlp + u0 + u] =
        __float2bfloat16(gate / (1.f + __expf(-gate)) * up);
  }
  __syncthreads();
}

// Stage B: attention of each head group over positions 0..pos, in splits
// of positions; the last split of a group to finish combines them.

// A lane's N (2 or 4) consecutive bf16 of a cache row, raw, in one load.
template <int N>
struct LaneRow {
  static_assert(N == 2 || N == 4, "a lane holds 2 or 4 channels");
  using Raw = std::conditional_t<N == 4, uint2, unsigned>;
  Raw raw;

  __device__ __forceinline__ void Load(const __nv_bfloat16* p) {
    raw = __ldcg(reinterpret_cast<const Raw*>(p));
  }

  __device__ __forceinline__ void Unpack(float (&out)[N]) const {
    const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 f = __bfloat1622float2(pairs[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};

struct Splits {
  int count, length;
};

// The fewest positions a split takes.
constexpr int kMinSplitPositions = 32;

__device__ inline Splits SplitsFor(const Params& p, int positions) {
  const int groups = p.batch * p.kv_heads;
  int count = min(p.max_splits, max(1, static_cast<int>(gridDim.x) / groups));
  count = min(count, (positions + kMinSplitPositions - 1) / kMinSplitPositions);
  const int length = (positions + count - 1) / count;
  return {(positions + length - 1) / length, length};
}

// The group's splits combined: p.attended[b][(g * qpk + j) * HD + e] in
// bf16. Every split's loads of a round are issued before any is used.
template <int HD>
__device__ void CombineGroup(const Params& p, int count, int b, int g) {
  constexpr int kSplits = 8;
  const int qpk = p.q_per_kv, warp_floats = qpk * (HD + 2);
  const float* group = p.partials + (static_cast<size_t>(b) * p.kv_heads + g) * p.max_splits *
                                        warp_floats;
  for (int t = threadIdx.x; t < qpk * HD; t += kThreads) {
    const int j = t / HD, e = t % HD;
    const float* mine = group + j * (HD + 2);
    float big = -INFINITY;
    for (int s0 = 0; s0 < count; s0 += kSplits) {
#pragma unroll
      for (int i = 0; i < kSplits; ++i) {
        if (s0 + i < count) big = fmaxf(big, __ldcg(mine + (s0 + i) * warp_floats + HD));
      }
    }
    float sum = 0.f, out = 0.f;
    for (int s0 = 0; s0 < count; s0 += kSplits) {
      float m[kSplits], l[kSplits], o[kSplits];
#pragma unroll
      for (int i = 0; i < kSplits; ++i) {
        const float* theirs = mine + (s0 + i) * warp_floats;
        const bool in = s0 + i < count;
        m[i] = in ? __ldcg(theirs + HD) : -INFINITY;
        l[i] = in ? __ldcg(theirs + HD + 1) : 0.f;
        o[i] = in ? __ldcg(theirs + e) : 0.f;
      }
#pragma unroll
      for (int i = 0; i < kSplits; ++i) {
        const float factor = s0 + i < count ? __expf(m[i] - big) : 0.f;
        sum = fmaf(l[i], factor, sum);
        out = fmaf(o[i], factor, out);
      }
    }
    p.attended[static_cast<size_t>(b) * p.heads * HD + (g * qpk + j) * HD + e] =
        __float2bfloat16(out / sum);
  }
}

// Each item (batch row, KV head, split) starts once its KV head's QKV items
// are done (p.qkv_done: no grid barrier between the stages), and leaves its
// partial in p.partials: per query head of the group, o [HD] (not
// normalized), then m and l (the running max and sum of the softmax). The
// group's last item to arrive (p.arrivals) combines them into p.attended.
template <int HD, int QPK>
__device__ void AttendGroups(const Params& p, int layer, int pos, float* scratch,
                             int* last) {
  constexpr int kPerLane = HD / 32;
  // Positions a warp loads before it computes (fewer where the query heads
  // take the registers).
  constexpr int kInFlight = QPK >= 8 ? 4 : 8;
  constexpr int qpk = QPK;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const Splits splits = SplitsFor(p, pos + 1);
  const int items = p.batch * p.kv_heads * splits.count;
  const float scale = rsqrtf(static_cast<float>(HD));
  const int warp_floats = qpk * (HD + 2);
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int bg = item / splits.count, split = item % splits.count;
    const int b = bg / p.kv_heads, g = bg % p.kv_heads;
    WaitForCount(p, p.qkv_done + g, QkvItemsPerKvHead(p) * (layer + 1),
                 "the QKV items of its KV head", layer);
    const int p0 = split * splits.length, p1 = min(pos + 1, p0 + splits.length);
    const size_t head = (static_cast<size_t>(b) * p.kv_heads + g) * p.cache_len;
    const __nv_bfloat16* kc = p.caches[layer].k + head * HD + lane * kPerLane;
    const __nv_bfloat16* vc = p.caches[layer].v + head * HD + lane * kPerLane;
    float q[QPK][kPerLane], m[QPK], l[QPK];
    float o[QPK][kPerLane];
#pragma unroll
    for (int j = 0; j < QPK; ++j) {
      m[j] = -INFINITY;
      l[j] = 0.f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        o[j][e] = 0.f;
        q[j][e] = __ldcg(p.q + (static_cast<size_t>(b) * p.heads + g * qpk + j) * HD +
                         lane * kPerLane + e);
      }
    }
    for (int base = p0 + warp; base < p1; base += kWarps * kInFlight) {
      LaneRow<kPerLane> keys[kInFlight], values[kInFlight];
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {  // every load first: one round trip
        const int position = base + i * kWarps;
        if (position < p1) {
          keys[i].Load(kc + static_cast<size_t>(position) * HD);
          values[i].Load(vc + static_cast<size_t>(position) * HD);
        }
      }
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        if (base + i * kWarps >= p1) break;
        float kv[kPerLane], vv[kPerLane];
        keys[i].Unpack(kv);
        values[i].Unpack(vv);
#pragma unroll
        for (int j = 0; j < QPK; ++j) {
          float s = 0.f;
#pragma unroll
          for (int e = 0; e < kPerLane; ++e) s = fmaf(q[j][e], kv[e], s);
#pragma unroll
          for (int offset = 16; offset > 0; offset /= 2) {
            s += __shfl_xor_sync(0xffffffffu, s, offset);
          }
          s *= scale;
          const float m_new = fmaxf(m[j], s);
          const float alpha = __expf(m[j] - m_new), weight = __expf(s - m_new);
          l[j] = l[j] * alpha + weight;
#pragma unroll
          for (int e = 0; e < kPerLane; ++e) o[j][e] = fmaf(o[j][e], alpha, weight * vv[e]);
          m[j] = m_new;
        }
      }
    }
    float* mine = scratch + warp * warp_floats;
#pragma unroll
    for (int j = 0; j < QPK; ++j) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) mine[j * (HD + 2) + lane * kPerLane + e] = o[j][e];
      if (lane == 0) {
        mine[j * (HD + 2) + HD] = m[j];
        mine[j * (HD + 2) + HD + 1] = l[j];
      }
    }
    __syncthreads();
    // The split's partial: the warps combined (a warp without positions has m = -inf).
    float* partial = p.partials + (static_cast<size_t>(bg) * p.max_splits + split) * warp_floats;
    for (int t = threadIdx.x; t < qpk * HD; t += kThreads) {
      const int j = t / HD, e = t % HD;
      float big = -INFINITY;
      for (int w = 0; w < kWarps; ++w) big = fmaxf(big, scratch[w * warp_floats + j * (HD + 2) + HD]);
      float sum = 0.f, out = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        const float* theirs = scratch + w * warp_floats + j * (HD + 2);
        if (theirs[HD] == -INFINITY) continue;
        const float factor = __expf(theirs[HD] - big);
        sum = fmaf(theirs[HD + 1], factor, sum);
        out = fmaf(theirs[e], factor, out);
      }
      partial[j * (HD + 2) + e] = out;
      if (e == 0) {
        partial[j * (HD + 2) + HD] = big;
        partial[j * (HD + 2) + HD + 1] = sum;
      }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      *last = atomicAdd(p.arrivals + bg, 1u) == static_cast<unsigned>(splits.count - 1);
    }
    __syncthreads();
    if (*last) {
      __threadfence();
      CombineGroup<HD>(p, splits.count, b, g);
      if (threadIdx.x == 0) p.arrivals[bg] = 0;  // for the next layer
    }
    __syncthreads();
  }
}

// Attention with the group's query heads known at compile time (the
// registers a lane holds grow with them).
template <int HD>
__device__ void Attend(const Params& p, int layer, int pos, float* scratch, int* last) {
  switch (p.q_per_kv) {
    case 1: return AttendGroups<HD, 1>(p, layer, pos, scratch, last);
    case 2: return AttendGroups<HD, 2>(p, layer, pos, scratch, last);
    case 4: return AttendGroups<HD, 4>(p, layer, pos, scratch, last);
    default: return AttendGroups<HD, 8>(p, layer, pos, scratch, last);
  }
}

}  // namespace transformer_decode
}  // namespace jfo
