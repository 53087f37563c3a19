// A decode step through every block of the Transformer, as one kernel
// (tensor-parallel size 1, bf16, at most kMaxBatch rows).
//
// At one token per step each block reads its weights once and does little
// else, so a step's floor is the weights' bytes over HBM bandwidth. XLA runs
// a block as 15-17 kernels, and every kernel boundary leaves HBM idle while
// the next kernel starts and its first loads travel: the 1B model's step took
// twice its floor. Here one persistent kernel (a CTA per SM, co-resident by a
// cooperative launch) runs the blocks' five stages in turn, separated by grid
// barriers:
//
//   A  RMSNorm, x @ W_qkv, rotary embeddings; the new k and v into the cache
//   B  attention over the cache (split along positions; the last CTA of a
//      head group combines the splits)
//   C  x += attention @ W_out
//   D  RMSNorm, x @ W_gate_up, SwiGLU
//   E  x += act @ W_down
//
// The weights come in a layout prepared once for this kernel
// (models/transformer_decode_cuda.py): each work item's columns contiguous,
// [items, k, columns], so an item is one stream of 32 KiB chunks. Each CTA
// copies its chunks with TMA bulk copies into a ring of shared-memory slots
// that runs ahead of the arithmetic across stage and layer boundaries: while
// a CTA waits at a grid barrier or attends, its next weights are in flight.
// Nothing in the weights' stream depends on the step's data.
//
// Every wait is bounded: a grid barrier or a copy that does not complete
// within timeout_ms prints which CTA and stage waited and traps, so the step
// ends in a CUDA error, never in wrong numbers.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "handlers.h"

namespace jfo {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBatch = 4;
constexpr int kMaxLayers = 64;
constexpr int kMaxQueriesPerKv = 8;
constexpr int kChunkBytes = 32768;
constexpr int kControlBytes = 4096;  // the barrier counter and the head groups' arrivals
// Columns of one work item in each weight stage. QKV items hold 16 rotary
// pairs of one head: columns j0..j0+15 of its first half, then the same of
// its second half, so that the rotation happens in the item's epilogue.
constexpr int kQkvColumns = 32;
constexpr int kOutColumns = 16;
constexpr int kGateUpColumns = 64;  // 32 hidden units, gate and up interleaved
constexpr int kDownColumns = 16;
constexpr int kMaxColumns = 64;
constexpr int kStages = 4;  // weight stages a layer: QKV, out, gate/up, down

struct LayerCache {
  __nv_bfloat16* k;  // [batch, kv, cache_len, head_dim]
  __nv_bfloat16* v;
};

struct WeightStage {
  const __nv_bfloat16* w;  // [layers, items, k, columns]
  int items;
  int k;
  int columns;
  int rows_per_chunk;
  int chunks_per_item;
};

struct Params {
  int layers, batch, d, heads, kv_heads, head_dim, mlp, cache_len;
  int q_per_kv, max_splits, ring_slots;
  float eps, rope_theta;
  uint64_t timeout_ns;
  const __nv_bfloat16* x_in;  // [batch, d]
  const int32_t* pos;         // scalar
  const float* attn_norm;     // [layers, d]
  const float* mlp_norm;      // [layers, d]
  WeightStage stages[kStages];
  __nv_bfloat16* x_out;  // [batch, d]: the residual stream from stage C of layer 0 on
  // The workspace's parts.
  unsigned* barrier;       // grid barrier arrivals, zeroed before each launch
  unsigned* arrivals;      // [batch * kv]: splits done per head group
  float* q;                // [batch, heads, head_dim], rotated, bf16-rounded
  float* partials;         // [batch * kv, max_splits, q_per_kv, head_dim + 2]
  __nv_bfloat16* attended; // [batch, heads * head_dim]
  __nv_bfloat16* act;      // [batch, mlp]
  // Shared-memory layout (byte offsets), decided on the host.
  int operand_offset, reduce_offset, result_offset, scalar_offset, mbar_offset;
  LayerCache caches[kMaxLayers];
};

// ---------------------------------------------------------------------------
// Device helpers: clock, grid barrier, mbarriers and bulk copies.

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned LoadAcquireGpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __noinline__ void TimedOut(const char* what, int layer, unsigned seen,
                                      unsigned expected) {
  printf("jax_flashoverlap transformer_decode: CTA %d timed out waiting for %s in layer %d "
         "(at %u of %u); trapping so that the step fails instead of returning wrong data\n",
         static_cast<int>(blockIdx.x), what, layer, seen, expected);
  __trap();
}

// The count-th barrier of this launch: every CTA's writes before it are
// visible to every CTA after it.
__device__ void GridBarrier(const Params& p, unsigned count, const char* what, int layer) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(p.barrier, 1u);
    const unsigned expected = count * gridDim.x;
    const uint64_t start = GlobalTimerNs();
    unsigned seen;
    while ((seen = LoadAcquireGpu(p.barrier)) < expected) {
      if (GlobalTimerNs() - start > p.timeout_ns) TimedOut(what, layer, seen, expected);
    }
    __threadfence();
  }
  __syncthreads();
}

__device__ __forceinline__ unsigned SharedAddress(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void MbarrierInit(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SharedAddress(bar)) : "memory");
}

__device__ __forceinline__ bool MbarrierTryWait(uint64_t* bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(SharedAddress(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// One bulk copy of `bytes` (a multiple of 16) from global into a slot,
// completing the slot's mbarrier phase.
__device__ __forceinline__ void BulkLoad(void* slot, const void* src, unsigned bytes,
                                         uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(SharedAddress(bar)), "r"(bytes) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(SharedAddress(slot)), "l"(src), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
}
#endif

__device__ __forceinline__ float Bf16Round(float v) {
  return __bfloat162float(__float2bfloat16(v));
}

// Loads bypassing L1: what other CTAs wrote during this launch.
__device__ __forceinline__ float LoadBf16(const __nv_bfloat16* p) {
  return __bfloat162float(__ldcg(p));
}

// ---------------------------------------------------------------------------
// The weights' stream. Each CTA's chunks, in the order it consumes them:
// layer by layer, stage by stage, its items (blockIdx.x, + gridDim.x, ...)
// and each item's chunks in order.

__device__ __forceinline__ int ItemsOfCta(int items) {
  const int cta = blockIdx.x;
  return cta < items ? (items - cta + gridDim.x - 1) / gridDim.x : 0;
}

// Where thread 0's next copy comes from. It only moves forward, one chunk
// at a time, as the copies are issued.
struct ChunkCursor {
  int layer = 0, stage = 0, item = 0, chunk = 0;  // item: the CTA's own count in the stage

  __device__ void Start(const Params& p) { SkipEmpty(p); }

  __device__ bool Done(const Params& p) const { return layer >= p.layers; }

  __device__ void Advance(const Params& p) {
    if (++chunk == p.stages[stage].chunks_per_item) {
      chunk = 0;
      ++item;
      SkipEmpty(p);
    }
  }

  __device__ void Locate(const Params& p, const void** src, unsigned* bytes) const {
    const WeightStage& st = p.stages[stage];
    const int row0 = chunk * st.rows_per_chunk;
    const int rows = min(st.rows_per_chunk, st.k - row0);
    const size_t item_elements = static_cast<size_t>(st.k) * st.columns;
    const int index = blockIdx.x + item * gridDim.x;
    *src = st.w + (static_cast<size_t>(layer) * st.items + index) * item_elements +
           static_cast<size_t>(row0) * st.columns;
    *bytes = static_cast<unsigned>(rows) * st.columns * sizeof(__nv_bfloat16);
  }

 private:
  // Past the stages (and layers) where this CTA has no item left.
  __device__ void SkipEmpty(const Params& p) {
    while (layer < p.layers && blockIdx.x + item * gridDim.x >= p.stages[stage].items) {
      item = 0;
      if (++stage == kStages) {
        stage = 0;
        ++layer;
      }
    }
  }
};

struct Ring {
  unsigned char* slots;
  uint64_t* bars;
  int count;
  int next = 0;    // the chunk the CTA consumes next
  int issued = 0;  // chunks issued (thread 0)
  ChunkCursor cursor;

  // Thread 0: the next chunk into its slot (chunk c goes to slot c % count).
  __device__ void IssueNext(const Params& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cursor.Done(p)) return;
    const void* src;
    unsigned bytes;
    cursor.Locate(p, &src, &bytes);
    const int slot = issued % count;
    BulkLoad(slots + static_cast<size_t>(slot) * kChunkBytes, src, bytes, bars + slot);
    cursor.Advance(p);
    ++issued;
#endif
  }

  // Waits for the next chunk; returns its slot.
  __device__ const uint4* Wait(const Params& p, int layer) {
    const int slot = next % count;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned parity = (next / count) & 1;
    if (!MbarrierTryWait(bars + slot, parity)) {
      const uint64_t start = GlobalTimerNs();
      while (!MbarrierTryWait(bars + slot, parity)) {
        if (GlobalTimerNs() - start > p.timeout_ns) TimedOut("a weight copy", layer, next, issued);
      }
    }
#endif
    return reinterpret_cast<const uint4*>(slots + static_cast<size_t>(slot) * kChunkBytes);
  }

  // Every thread is done with the chunk it waited for: its slot takes the
  // chunk `count` ahead.
  __device__ void Release(const Params& p) {
    __syncthreads();
    if (threadIdx.x == 0) IssueNext(p);
    ++next;
  }
};

// ---------------------------------------------------------------------------
// GEMV stages: out[b][c] = sum_k operand[k][b] * w_item[k][c], operand the
// bf16 [k][batch] in shared memory, the sums left in `result` [batch][C].

template <int B>
__device__ __forceinline__ void AddProducts(float (&acc)[B][8], uint4 packed,
                                            const __nv_bfloat16* operand_row) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
  float w[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    w[2 * i] = f.x;
    w[2 * i + 1] = f.y;
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
    const float xb = __bfloat162float(operand_row[b]);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[b][j] = fmaf(xb, w[j], acc[b][j]);
  }
}

template <int C, int B>
__device__ void ItemProduct(const Params& p, Ring& ring, const WeightStage& st, int layer,
                            const __nv_bfloat16* operand, float* reduce, float* result) {
  constexpr int kGroups = C / 8;  // 16-byte vectors a row
  float acc[B][8] = {};
  for (int chunk = 0; chunk < st.chunks_per_item; ++chunk) {
    const int row0 = chunk * st.rows_per_chunk;
    const int rows = min(st.rows_per_chunk, st.k - row0);
    const uint4* w = ring.Wait(p, layer);
    const __nv_bfloat16* rows_operand = operand + static_cast<size_t>(row0) * B;
    for (int v = threadIdx.x; v < rows * kGroups; v += kThreads) {
      AddProducts<B>(acc, w[v], rows_operand + (v / kGroups) * B);
    }
    ring.Release(p);
  }
  // Lanes kGroups apart hold the same columns: sum them, then the warps.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int b = 0; b < B; ++b) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float v = acc[b][j];
#pragma unroll
      for (int offset = kGroups; offset < 32; offset *= 2) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
      }
      if (lane < kGroups) reduce[(warp * B + b) * C + lane * 8 + j] = v;
    }
  }
  __syncthreads();
  for (int t = threadIdx.x; t < B * C; t += kThreads) {
    float sum = 0.f;
#pragma unroll 4
    for (int w = 0; w < kWarps; ++w) sum += reduce[w * B * C + t];
    result[t] = sum;
  }
  __syncthreads();
}

// operand[k][b] = bf16(x[b][k] / rms(x[b]) * weight[k]), as models.layers.rms_norm.
template <int B>
__device__ void NormInto(const Params& p, const __nv_bfloat16* x, const float* weight,
                         __nv_bfloat16* operand, float* scalars) {
  float sums[B] = {};
  for (int k = threadIdx.x; k < p.d; k += kThreads) {
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const __nv_bfloat16 v = __ldcg(x + static_cast<size_t>(b) * p.d + k);
      operand[k * B + b] = v;
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
      const float f = __bfloat162float(operand[k * B + b]);
      operand[k * B + b] = __float2bfloat16(f * scalars[kWarps * B + b] * wk);
    }
  }
  __syncthreads();
}

// operand[k][b] = src[b][k] (bf16 [batch, n] written by other CTAs).
template <int B>
__device__ void GatherInto(const __nv_bfloat16* src, int n, __nv_bfloat16* operand) {
  for (int k = threadIdx.x; k < n; k += kThreads) {
#pragma unroll
    for (int b = 0; b < B; ++b) operand[k * B + b] = __ldcg(src + static_cast<size_t>(b) * n + k);
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------
// Stage A's epilogue: one QKV item's 32 columns, rotated (q, k) and stored.

template <int B>
__device__ void QkvEpilogue(const Params& p, int layer, int item, int pos, const float* result) {
  const int h = p.head_dim, blocks = h / kQkvColumns;  // items a head
  const int group_items = (p.q_per_kv + 2) * blocks;
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

// ---------------------------------------------------------------------------
// Stage B: attention of each head group over positions 0..pos.

// A lane's N (2 or 4) consecutive bf16 of a cache row, in one load.
template <int N>
__device__ __forceinline__ void LoadLane(const __nv_bfloat16* p, float (&out)[N]) {
  static_assert(N == 2 || N == 4, "a lane holds 2 or 4 channels");
  if constexpr (N == 4) {
    const uint2 raw = __ldcg(reinterpret_cast<const uint2*>(p));
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
  } else {
    const unsigned raw = __ldcg(reinterpret_cast<const unsigned*>(p));
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw));
    out[0] = a.x, out[1] = a.y;
  }
}

struct Splits {
  int count, length;
};

__device__ Splits SplitsFor(const Params& p, int positions) {
  const int groups = p.batch * p.kv_heads;
  // At most one item per CTA.
  int count = min(p.max_splits, max(1, static_cast<int>(gridDim.x) / groups));
  count = min(count, (positions + 15) / 16);
  const int length = (positions + count - 1) / count;
  return {(positions + length - 1) / length, length};
}

template <int HD>
__device__ void Attend(const Params& p, int layer, int pos, float* shared_scratch,
                       int* shared_flag) {
  constexpr int kPerLane = HD / 32;
  const int qpk = p.q_per_kv;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const Splits splits = SplitsFor(p, pos + 1);
  const int items = p.batch * p.kv_heads * splits.count;
  const float scale = rsqrtf(static_cast<float>(HD));
  // Per warp: m [qpk], l [qpk], o [qpk][HD].
  const int warp_floats = qpk * (HD + 2);
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int bg = item / splits.count, split = item % splits.count;
    const int b = bg / p.kv_heads, g = bg % p.kv_heads;
    const int p0 = split * splits.length, p1 = min(pos + 1, p0 + splits.length);
    float q[kMaxQueriesPerKv][kPerLane], m[kMaxQueriesPerKv], l[kMaxQueriesPerKv];
    float o[kMaxQueriesPerKv][kPerLane];
#pragma unroll
    for (int j = 0; j < kMaxQueriesPerKv; ++j) {
      m[j] = -INFINITY;
      l[j] = 0.f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        o[j][e] = 0.f;
        q[j][e] = j < qpk ? __ldcg(p.q + (static_cast<size_t>(b) * p.heads + g * qpk + j) * HD +
                                   lane * kPerLane + e)
                          : 0.f;
      }
    }
    const size_t head = (static_cast<size_t>(b) * p.kv_heads + g) * p.cache_len;
    const __nv_bfloat16* kc = p.caches[layer].k + head * HD + lane * kPerLane;
    const __nv_bfloat16* vc = p.caches[layer].v + head * HD + lane * kPerLane;
    for (int position = p0 + warp; position < p1; position += kWarps) {
      float kv[kPerLane], vv[kPerLane];
      LoadLane<kPerLane>(kc + static_cast<size_t>(position) * HD, kv);
      LoadLane<kPerLane>(vc + static_cast<size_t>(position) * HD, vv);
#pragma unroll
      for (int j = 0; j < kMaxQueriesPerKv; ++j) {
        if (j >= qpk) break;
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) s = fmaf(q[j][e], kv[e], s);
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
        s *= scale;
        const float m_new = fmaxf(m[j], s);
        const float alpha = __expf(m[j] - m_new), weight = __expf(s - m_new);
        l[j] = l[j] * alpha + weight;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) o[j][e] = fmaf(o[j][e], alpha, weight * vv[e]);
        m[j] = m_new;
      }
    }
    float* mine = shared_scratch + warp * warp_floats;
#pragma unroll
    for (int j = 0; j < kMaxQueriesPerKv; ++j) {
      if (j >= qpk) break;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) mine[j * (HD + 2) + lane * kPerLane + e] = o[j][e];
      if (lane == 0) {
        mine[j * (HD + 2) + HD] = m[j];
        mine[j * (HD + 2) + HD + 1] = l[j];
      }
    }
    __syncthreads();
    // The split's partial: the warps combined.
    float* partial = p.partials + (static_cast<size_t>(bg) * p.max_splits + split) * warp_floats;
    for (int t = threadIdx.x; t < qpk * HD; t += kThreads) {
      const int j = t / HD, e = t % HD;
      float big = -INFINITY;
      for (int w = 0; w < kWarps; ++w) big = fmaxf(big, shared_scratch[w * warp_floats + j * (HD + 2) + HD]);
      float sum = 0.f, out = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        const float* theirs = shared_scratch + w * warp_floats + j * (HD + 2);
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
      *shared_flag = atomicAdd(p.arrivals + bg, 1u) == static_cast<unsigned>(splits.count - 1);
    }
    __syncthreads();
    if (*shared_flag) {  // the group's last split: combine them all
      __threadfence();
      const float* group = p.partials + static_cast<size_t>(bg) * p.max_splits * warp_floats;
      for (int t = threadIdx.x; t < qpk * HD; t += kThreads) {
        const int j = t / HD, e = t % HD;
        float big = -INFINITY;
        for (int s = 0; s < splits.count; ++s) {
          big = fmaxf(big, __ldcg(group + s * warp_floats + j * (HD + 2) + HD));
        }
        float sum = 0.f, out = 0.f;
        for (int s = 0; s < splits.count; ++s) {
          const float* theirs = group + s * warp_floats + j * (HD + 2);
          const float factor = __expf(__ldcg(theirs + HD) - big);
          sum = fmaf(__ldcg(theirs + HD + 1), factor, sum);
          out = fmaf(__ldcg(theirs + e), factor, out);
        }
        p.attended[static_cast<size_t>(b) * p.heads * HD + (g * qpk + j) * HD + e] =
            __float2bfloat16(out / sum);
      }
      if (threadIdx.x == 0) p.arrivals[bg] = 0;  // for the next layer
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------

template <int B, int HD>
__global__ void __launch_bounds__(kThreads, 1) TransformerDecodeKernel(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char shared[];
  Ring ring;
  ring.slots = shared;
  ring.bars = reinterpret_cast<uint64_t*>(shared + p.mbar_offset);
  ring.count = p.ring_slots;
  ring.cursor.Start(p);
  auto* operand = reinterpret_cast<__nv_bfloat16*>(shared + p.operand_offset);
  auto* reduce = reinterpret_cast<float*>(shared + p.reduce_offset);
  auto* result = reinterpret_cast<float*>(shared + p.result_offset);
  auto* scalars = reinterpret_cast<float*>(shared + p.scalar_offset);
  int* flag = reinterpret_cast<int*>(scalars + (kWarps + 1) * kMaxBatch);

  if (threadIdx.x == 0) {
    for (int s = 0; s < ring.count; ++s) MbarrierInit(ring.bars + s);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    for (int c = 0; c < ring.count; ++c) ring.IssueNext(p);
  }
  __syncthreads();

  const int pos = *p.pos;
  if (pos < 0 || pos >= p.cache_len) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
      printf("jax_flashoverlap transformer_decode: position %d outside the cache [0, %d)\n",
             pos, p.cache_len);
    }
    __trap();
  }
  unsigned barriers = 0;
  const WeightStage& qkv = p.stages[0];
  const WeightStage& out = p.stages[1];
  const WeightStage& gate_up = p.stages[2];
  const WeightStage& down = p.stages[3];
  for (int layer = 0; layer < p.layers; ++layer) {
    const __nv_bfloat16* residual = layer == 0 ? p.x_in : p.x_out;
    // A: the attention's norm, QKV, rotation; k and v into the cache.
    if (ItemsOfCta(qkv.items)) NormInto<B>(p, residual, p.attn_norm + layer * p.d, operand, scalars);
    for (int item = blockIdx.x; item < qkv.items; item += gridDim.x) {
      ItemProduct<kQkvColumns, B>(p, ring, qkv, layer, operand, reduce, result);
      QkvEpilogue<B>(p, layer, item, pos, result);
    }
    GridBarrier(p, ++barriers, "the QKV stage", layer);
    // B: attention.
    Attend<HD>(p, layer, pos, reinterpret_cast<float*>(operand), flag);
    GridBarrier(p, ++barriers, "the attention stage", layer);
    // C: x = residual + attention @ W_out.
    if (ItemsOfCta(out.items)) GatherInto<B>(p.attended, p.heads * HD, operand);
    for (int item = blockIdx.x; item < out.items; item += gridDim.x) {
      ItemProduct<kOutColumns, B>(p, ring, out, layer, operand, reduce, result);
      ResidualEpilogue<B, kOutColumns>(residual, p.x_out, p.d, item * kOutColumns, result);
    }
    GridBarrier(p, ++barriers, "the attention output stage", layer);
    // D: the MLP's norm, gate/up, SwiGLU.
    if (ItemsOfCta(gate_up.items)) NormInto<B>(p, p.x_out, p.mlp_norm + layer * p.d, operand, scalars);
    for (int item = blockIdx.x; item < gate_up.items; item += gridDim.x) {
      ItemProduct<kGateUpColumns, B>(p, ring, gate_up, layer, operand, reduce, result);
      SwigluEpilogue<B>(p, item * (kGateUpColumns / 2), result);
    }
    GridBarrier(p, ++barriers, "the gate/up stage", layer);
    // E: x += act @ W_down.
    if (ItemsOfCta(down.items)) GatherInto<B>(p.act, p.mlp, operand);
    for (int item = blockIdx.x; item < down.items; item += gridDim.x) {
      ItemProduct<kDownColumns, B>(p, ring, down, layer, operand, reduce, result);
      ResidualEpilogue<B, kDownColumns>(p.x_out, p.x_out, p.d, item * kDownColumns, result);
    }
    if (layer + 1 < p.layers) GridBarrier(p, ++barriers, "the down stage", layer);
  }
#endif
}

// ---------------------------------------------------------------------------
// Host side.

struct DeviceInfo {
  int sms = 0, major = 0, max_shared = 0;
};

DeviceInfo InfoOf(int device) {
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

size_t AlignUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// The workspace's bytes (models/transformer_decode_cuda.py computes the same
// from the same shapes; the handler checks the buffer it gets).
size_t TransformerDecodeWorkspaceBytes(int64_t batch, int64_t heads, int64_t kv_heads,
                                       int64_t head_dim, int64_t mlp, int64_t max_splits) {
  const int64_t qpk = heads / kv_heads;
  return kControlBytes + AlignUp(batch * heads * head_dim * 4, 256) +
         AlignUp(batch * kv_heads * max_splits * qpk * (head_dim + 2) * 4, 256) +
         AlignUp(batch * heads * head_dim * 2, 256) + AlignUp(batch * mlp * 2, 256);
}

WeightStage StageOf(const ffi::AnyBuffer& w, int columns) {
  const auto dims = w.dimensions();  // [layers, items, k, columns]
  WeightStage st;
  st.w = static_cast<const __nv_bfloat16*>(w.untyped_data());
  st.items = static_cast<int>(dims[1]);
  st.k = static_cast<int>(dims[2]);
  st.columns = columns;
  st.rows_per_chunk = kChunkBytes / (columns * static_cast<int>(sizeof(__nv_bfloat16)));
  st.chunks_per_item = (st.k + st.rows_per_chunk - 1) / st.rows_per_chunk;
  return st;
}

ffi::Error CheckWeight(const ffi::AnyBuffer& w, const char* name, int64_t layers, int64_t items,
                       int64_t k, int64_t columns) {
  const auto dims = w.dimensions();
  if (w.element_type() != ffi::DataType::BF16 || dims.size() != 4 || dims[0] != layers ||
      dims[1] != items || dims[2] != k || dims[3] != columns) {
    return ffi::Error::InvalidArgument(
        std::string("jax_flashoverlap transformer_decode: ") + name + " must be bf16 [" +
        std::to_string(layers) + ", " + std::to_string(items) + ", " + std::to_string(k) +
        ", " + std::to_string(columns) + "] (prepared by models.transformer_decode_cuda), got " +
        DimsToString(w));
  }
  return ffi::Error::Success();
}

template <int B, int HD>
ffi::Error Launch(cudaStream_t stream, const Params& p, int grid, size_t shared) {
  auto kernel = TransformerDecodeKernel<B, HD>;
  JFO_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  int per_sm = 0;
  JFO_CUDA_RETURN_IF_ERROR(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared));
  if (per_sm < 1) {
    return ffi::Error::Internal("jax_flashoverlap transformer_decode: the kernel does not fit "
                                "an SM with " + std::to_string(shared) + " bytes of shared memory");
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid, 1, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeCooperative;  // every CTA resident: the grid barriers rely on it
  attrs[0].val.cooperative = 1;
  config.attrs = attrs;
  config.numAttrs = 1;
  JFO_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, kernel, p));
  return ffi::Error::Success();
}

ffi::Error TransformerDecodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer pos,
                                 ffi::AnyBuffer attn_norm, ffi::AnyBuffer mlp_norm,
                                 ffi::AnyBuffer w_qkv, ffi::AnyBuffer w_out,
                                 ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                                 ffi::RemainingArgs caches_in, ffi::Result<ffi::AnyBuffer> x_out,
                                 ffi::Result<ffi::AnyBuffer> workspace,
                                 ffi::RemainingRets caches_out, int32_t heads, int32_t kv_heads,
                                 int32_t max_splits, float eps, float rope_theta,
                                 int32_t timeout_ms) {
  const std::string op = "jax_flashoverlap transformer_decode: ";
  const auto xd = x.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || xd.size() != 2) {
    return ffi::Error::InvalidArgument(op + "x must be bf16 [batch, d], got " + DimsToString(x));
  }
  const int64_t batch = xd[0], d = xd[1];
  const auto nd = attn_norm.dimensions();
  if (attn_norm.element_type() != ffi::DataType::F32 || nd.size() != 2 || nd[1] != d ||
      mlp_norm.element_type() != ffi::DataType::F32 ||
      mlp_norm.dimensions().size() != 2 || mlp_norm.dimensions()[0] != nd[0] ||
      mlp_norm.dimensions()[1] != d) {
    return ffi::Error::InvalidArgument(op + "the norms' weights must be float32 [layers, d]");
  }
  const int64_t layers = nd[0];
  if (batch < 1 || batch > kMaxBatch || layers < 1 || layers > kMaxLayers || heads < 1 ||
      kv_heads < 1 || heads % kv_heads || heads / kv_heads > kMaxQueriesPerKv ||
      pos.element_type() != ffi::DataType::S32 || pos.element_count() != 1 ||
      max_splits < 1 || timeout_ms < 1) {
    return ffi::Error::InvalidArgument(
        op + "needs 1 <= batch <= " + std::to_string(kMaxBatch) + ", 1 <= layers <= " +
        std::to_string(kMaxLayers) + ", heads a multiple of kv_heads by at most " +
        std::to_string(kMaxQueriesPerKv) + ", an int32 position and max_splits, timeout_ms >= 1");
  }
  if (caches_in.size() != static_cast<size_t>(2 * layers) || caches_out.size() != caches_in.size()) {
    return ffi::Error::InvalidArgument(op + "expected a k and a v cache per layer");
  }
  auto first = caches_in.get<ffi::AnyBuffer>(0);
  if (first.has_error()) return first.error();
  const auto cd = first->dimensions();  // [batch, kv, cache_len, head_dim]
  if (cd.size() != 4 || cd[0] != batch || cd[1] != kv_heads) {
    return ffi::Error::InvalidArgument(op + "caches must be [batch, kv_heads, length, head_dim]");
  }
  const int64_t cache_len = cd[2], head_dim = cd[3];
  if (head_dim != 64 && head_dim != 128) {
    return ffi::Error::InvalidArgument(op + "head_dim must be 64 or 128, got " +
                                       std::to_string(head_dim));
  }
  const int64_t qpk = heads / kv_heads;
  const auto w_mlp = w_down.dimensions();
  const int64_t mlp = w_mlp.size() == 4 ? w_mlp[2] : 0;
  if (d % kOutColumns || d % 8 || mlp < 1 || mlp % (kGateUpColumns / 2)) {
    return ffi::Error::InvalidArgument(op + "d must be a multiple of 16 and the MLP width of 32");
  }
  JFO_RETURN_IF_ERROR(CheckWeight(w_qkv, "w_qkv", layers,
                                  kv_heads * (qpk + 2) * head_dim / kQkvColumns, d, kQkvColumns));
  JFO_RETURN_IF_ERROR(CheckWeight(w_out, "w_out", layers, d / kOutColumns, heads * head_dim,
                                  kOutColumns));
  JFO_RETURN_IF_ERROR(CheckWeight(w_gate_up, "w_gate_up", layers, 2 * mlp / kGateUpColumns, d,
                                  kGateUpColumns));
  JFO_RETURN_IF_ERROR(CheckWeight(w_down, "w_down", layers, d / kDownColumns, mlp, kDownColumns));

  Params p = {};
  p.layers = static_cast<int>(layers);
  p.batch = static_cast<int>(batch);
  p.d = static_cast<int>(d);
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = static_cast<int>(head_dim);
  p.mlp = static_cast<int>(mlp);
  p.cache_len = static_cast<int>(cache_len);
  p.q_per_kv = static_cast<int>(qpk);
  p.max_splits = max_splits;
  p.eps = eps;
  p.rope_theta = rope_theta;
  p.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000ull;
  p.x_in = static_cast<const __nv_bfloat16*>(x.untyped_data());
  p.pos = static_cast<const int32_t*>(pos.untyped_data());
  p.attn_norm = static_cast<const float*>(attn_norm.untyped_data());
  p.mlp_norm = static_cast<const float*>(mlp_norm.untyped_data());
  p.stages[0] = StageOf(w_qkv, kQkvColumns);
  p.stages[1] = StageOf(w_out, kOutColumns);
  p.stages[2] = StageOf(w_gate_up, kGateUpColumns);
  p.stages[3] = StageOf(w_down, kDownColumns);
  p.x_out = static_cast<__nv_bfloat16*>(x_out->untyped_data());
  for (int64_t i = 0; i < 2 * layers; ++i) {
    auto in = caches_in.get<ffi::AnyBuffer>(i);
    auto out = caches_out.get<ffi::AnyBuffer>(i);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    const auto dims = in->dimensions();
    if (in->element_type() != ffi::DataType::BF16 || dims.size() != 4 || dims[0] != batch ||
        dims[1] != kv_heads || dims[2] != cache_len || dims[3] != head_dim) {
      return ffi::Error::InvalidArgument(op + "cache " + std::to_string(i) + " is " +
                                         DimsToString(*in) + ", expected bf16 like the first");
    }
    if ((*out)->untyped_data() != in->untyped_data()) {
      // Not aliased (XLA could not donate it): start from the input's contents.
      JFO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync((*out)->untyped_data(), in->untyped_data(),
                                               in->size_bytes(), cudaMemcpyDeviceToDevice,
                                               stream));
    }
    auto* data = static_cast<__nv_bfloat16*>((*out)->untyped_data());
    if (i % 2 == 0) p.caches[i / 2].k = data; else p.caches[i / 2].v = data;
  }

  const size_t need = TransformerDecodeWorkspaceBytes(batch, heads, kv_heads, head_dim, mlp,
                                                      max_splits);
  if (workspace->size_bytes() < need) {
    return ffi::Error::InvalidArgument(op + "the workspace holds " +
                                       std::to_string(workspace->size_bytes()) + " bytes, " +
                                       std::to_string(need) + " needed");
  }
  auto* base = static_cast<unsigned char*>(workspace->untyped_data());
  p.barrier = reinterpret_cast<unsigned*>(base);
  p.arrivals = p.barrier + 32;
  if (static_cast<size_t>(32 + batch * kv_heads) * sizeof(unsigned) > kControlBytes) {
    return ffi::Error::InvalidArgument(op + "too many head groups for the control block");
  }
  size_t offset = kControlBytes;
  p.q = reinterpret_cast<float*>(base + offset);
  offset += AlignUp(batch * heads * head_dim * 4, 256);
  p.partials = reinterpret_cast<float*>(base + offset);
  offset += AlignUp(batch * kv_heads * max_splits * qpk * (head_dim + 2) * 4, 256);
  p.attended = reinterpret_cast<__nv_bfloat16*>(base + offset);
  offset += AlignUp(batch * heads * head_dim * 2, 256);
  p.act = reinterpret_cast<__nv_bfloat16*>(base + offset);

  int device = 0;
  JFO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const DeviceInfo info = InfoOf(device);
  if (info.major < 9) {
    return ffi::Error::InvalidArgument(op + "needs a Hopper or later GPU (TMA bulk copies)");
  }
  // Shared memory: the operand (bf16 [k][batch], or the attention's per-warp
  // partials), the reductions, then the ring with what is left.
  const size_t operand = AlignUp(std::max<size_t>(
      static_cast<size_t>(std::max<int64_t>({d, heads * head_dim, mlp})) * batch * 2,
      static_cast<size_t>(kWarps) * qpk * (head_dim + 2) * 4), 128);
  const size_t reduce = static_cast<size_t>(kWarps) * batch * kMaxColumns * 4;
  const size_t result = static_cast<size_t>(batch) * kMaxColumns * 4;
  const size_t scalars = ((kWarps + 1) * kMaxBatch + 4) * 4;
  const size_t fixed = operand + reduce + result + AlignUp(scalars, 16);
  const size_t budget = static_cast<size_t>(info.max_shared);
  // Each slot: a chunk and its mbarrier.
  const int slots = static_cast<int>(std::min<size_t>(
      16, budget > fixed ? (budget - fixed) / (kChunkBytes + 8) : 0));
  if (slots < 2) {
    return ffi::Error::InvalidArgument(op + "these shapes leave no shared memory for the weights' "
                                       "ring; use a smaller batch");
  }
  p.ring_slots = slots;
  size_t at = static_cast<size_t>(slots) * kChunkBytes;
  p.operand_offset = static_cast<int>(at);
  at += operand;
  p.reduce_offset = static_cast<int>(at);
  at += reduce;
  p.result_offset = static_cast<int>(at);
  at += result;
  p.scalar_offset = static_cast<int>(at);
  at += AlignUp(scalars, 16);
  p.mbar_offset = static_cast<int>(at);
  at += static_cast<size_t>(slots) * 8;

  JFO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(base, 0, kControlBytes, stream));
  const int grid = info.sms;
#define JFO_LAUNCH_BATCH(B)                                            \
  case B:                                                              \
    return head_dim == 64 ? Launch<B, 64>(stream, p, grid, at)         \
                          : Launch<B, 128>(stream, p, grid, at);
  switch (batch) {
    JFO_LAUNCH_BATCH(1)
    JFO_LAUNCH_BATCH(2)
    JFO_LAUNCH_BATCH(3)
    default:
      return head_dim == 64 ? Launch<4, 64>(stream, p, grid, at) : Launch<4, 128>(stream, p, grid, at);
  }
#undef JFO_LAUNCH_BATCH
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoTransformerDecode, TransformerDecodeImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()
        .Arg<ffi::AnyBuffer>()  // x [batch, d] bf16: the blocks' input
        .Arg<ffi::AnyBuffer>()  // pos: int32 scalar, this token's position
        .Arg<ffi::AnyBuffer>()  // attention norms' weights [layers, d] float32
        .Arg<ffi::AnyBuffer>()  // MLP norms' weights [layers, d] float32
        .Arg<ffi::AnyBuffer>()  // w_qkv [layers, items, d, 32]
        .Arg<ffi::AnyBuffer>()  // w_out [layers, d / 16, heads * head_dim, 16]
        .Arg<ffi::AnyBuffer>()  // w_gate_up [layers, 2 * mlp / 64, d, 64]
        .Arg<ffi::AnyBuffer>()  // w_down [layers, d / 16, mlp, 16]
        .RemainingArgs()        // k, v cache of each layer [batch, kv, length, head_dim]
        .Ret<ffi::AnyBuffer>()  // x [batch, d] bf16: the blocks' output
        .Ret<ffi::AnyBuffer>()  // workspace (u8)
        .RemainingRets()        // the caches, aliased to the inputs
        .Attr<int32_t>("heads")
        .Attr<int32_t>("kv_heads")
        .Attr<int32_t>("max_splits")
        .Attr<float>("eps")
        .Attr<float>("rope_theta")
        .Attr<int32_t>("timeout_ms"));

}  // namespace jfo
