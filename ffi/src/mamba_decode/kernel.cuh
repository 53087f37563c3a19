// The Mamba-2 decode kernel: every block of a decode step (stages in
// ../mamba_decode.cu). Its weight stream, GEMVs, norms and handoffs are the
// Transformer decode kernel's (../transformer_decode/), driven through that
// kernel's Params (MambaParams::core) with two weight stages of its four.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "../transformer_decode/handoff.cuh"
#include "../transformer_decode/params.cuh"
#include "../transformer_decode/stages.cuh"
#include "../transformer_decode/sync.cuh"

namespace jfo {
namespace mamba_decode {

using transformer_decode::kMaxBatch;
using transformer_decode::kMaxLayers;
using transformer_decode::kOperandPad;
using transformer_decode::kThreads;
using transformer_decode::kWarps;
using transformer_decode::Params;

// Columns of one work item of in_proj and of out_proj: 16, the MMA tile, so
// that 1.3B's 532 in_proj items spread over 132 SMs 4 or 5 a CTA (items of
// 64 would leave one CTA two of 133).
constexpr int kItemColumns = 16;
constexpr int kMaxGroups = 8;
constexpr int kMaxConvWidth = 8;
// A mixer item's state: head_dim x state floats over the CTA's threads, at
// most kMaxStatePerThread a thread (held in registers across the polls).
constexpr int kMaxStatePerThread = 64;

// One layer's recurrent state, updated in place.
struct LayerState {
  __nv_bfloat16* conv;  // [conv_width, batch, channels]: position t's inputs in row t mod width
  float* ssm;           // [batch, heads, head_dim, state]
};

// Schedule choices (MambaParams::schedule, bit flags;
// models.mamba_decode_cuda.SCHEDULE).
// The CTAs with one more in_proj item than the rest take no out_proj item
// and no mixer item: each CTA's bytes a layer as even as the items allow.
constexpr int kBalancedItems = 1;
// A mixer item issues all its loads of in_proj's outputs before it polls
// any: one round trip to L2 where there were one per value.
constexpr int kLoadsTogether = 2;
// A mixer item loads what in_proj does not produce (the convolution's older
// rows, its weights and bias, dt's bias, A and D) before it polls, so that
// one round trip to HBM overlaps the wait for the slowest in_proj item; each
// value's loads otherwise follow its poll, a chain of round trips while the
// weight stream keeps HBM busy.
constexpr int kInputsFirst = 4;
// A mixer item hands its gated output over before it stores the SSM state
// (read only by the next step), so that the handoff does not queue behind
// the state's stores (32 KB a head at 1.3B).
constexpr int kOutputFirst = 8;
constexpr int kAllSchedule = kBalancedItems | kLoadsTogether | kInputsFirst | kOutputFirst;

// With a trace (Params::trace): each CTA's clock at these points of each
// layer, and the *WaitNs entries, thread 0's waits for weight copies in the
// stage; a row of transformer_decode::kTraceEvents values, whose last two
// (kIssueNs, kWarp1CopyWaitNs) the ring records
// (models.mamba_decode_cuda.TRACE_EVENTS names them in this order).
enum MambaTraceEvent {
  kAtLayerStart,
  kAtNormed,
  kAtInProjDone,
  kAtMixerReady,  // its last mixer item's inputs polled
  kAtMixerDone,
  kAtGatedNormed,
  kAtOutProjDone,
  kInProjWaitNs,
  kOutProjWaitNs,
};
static_assert(static_cast<int>(kOutProjWaitNs) < static_cast<int>(transformer_decode::kIssueNs),
              "a trace row's events");

struct MambaParams {
  // d, layers, batch, eps, the input and output, the norms' weights
  // (attn_norm), the weight stages (0: in_proj, 1: out_proj; 2 and 3 empty),
  // the ring and the handoffs' workspace, as the Transformer kernel has them.
  Params core;
  int inner, heads, head_dim, state, groups, conv_width;
  int state_per_thread;  // head_dim * state / threads with state (a power of two)
  // in_proj's outputs as the kernel orders them ([x, B, C, dt, z], each part
  // padded to kItemColumns): where each part starts, and a row's columns.
  int x_at, b_at, c_at, dt_at, z_at, in_columns;
  const float* conv_weight;  // [layers, conv_width, channels]
  const float* conv_bias;    // [layers, channels]
  const float* dt_bias;      // [layers, heads]
  const float* a_log;        // [layers, heads]
  const float* d_skip;       // [layers, heads]
  const float* gate_norm;    // [layers, inner], the gated norm's weight
  int mixer_offset;          // shared memory of a mixer item: floats [head_dim + 2 state + 2]
  int schedule;              // the k*First, kBalancedItems and kLoadsTogether bits
  LayerState states[kMaxLayers];
};

// A layer's handoffs (bf16): in_proj's outputs [batch, in_columns], the
// gated SSD output [batch, inner], the block's output [batch, d].
__device__ __forceinline__ size_t HandoffsPerLayer(const MambaParams& m) {
  return static_cast<size_t>(m.core.batch) * (m.in_columns + m.inner + m.core.d);
}

__device__ __forceinline__ __nv_bfloat16* InProjOf(const MambaParams& m, int layer) {
  return m.core.handoffs + layer * HandoffsPerLayer(m);
}

__device__ __forceinline__ __nv_bfloat16* GatedOf(const MambaParams& m, int layer) {
  return InProjOf(m, layer) + static_cast<size_t>(m.core.batch) * m.in_columns;
}

// The last layer's goes to the kernel's output.
__device__ __forceinline__ __nv_bfloat16* BlockOutputOf(const MambaParams& m, int layer) {
  return layer + 1 < m.core.layers
             ? GatedOf(m, layer) + static_cast<size_t>(m.core.batch) * m.inner
             : m.core.x_out;
}

__device__ __forceinline__ const __nv_bfloat16* BlockInputOf(const MambaParams& m, int layer) {
  return layer == 0 ? m.core.x_in : BlockOutputOf(m, layer - 1);
}

// An in_proj item's 16 columns for the mixer, rounded to bf16 as XLA's GEMM
// output is.
template <int B>
__device__ void InProjEpilogue(const MambaParams& m, int layer, int item, const float* result) {
  __nv_bfloat16* out = InProjOf(m, layer) + item * kItemColumns;
  if (threadIdx.x < B * kItemColumns) {
    const int b = threadIdx.x / kItemColumns, c = threadIdx.x % kItemColumns;
    out[static_cast<size_t>(b) * m.in_columns + c] =
        transformer_decode::HandoffValue(result[threadIdx.x]);
  }
  __syncthreads();
}

__device__ __forceinline__ float Silu(float v) { return v / (1.f + __expf(-v)); }

// jax.nn.softplus: log(1 + e^v), without overflow.
__device__ __forceinline__ float Softplus(float v) {
  return fmaxf(v, 0.f) + log1pf(__expf(-fabsf(v)));
}

// One mixer item: batch row b's head h, from in_proj's outputs to the gated
// SSD output (models.mamba_decode_pallas.mixer_step_xla's arithmetic, then
// y * silu(z)). Thread t holds channel t / (state / S) of the head and S
// consecutive state entries of it; the state and the convolution's older
// rows are read before the polls.
template <int S>
__device__ void MixerItem(const MambaParams& m, int layer, int item, int pos, float* mix) {
  const Params& p = m.core;
  const int hd = m.head_dim, n = m.state, heads = m.heads;
  const int b = item / heads, h = item % heads;
  const int hpg = heads / m.groups, g = h / hpg, in_group = h % hpg;
  const int per_group = hpg * hd + 2 * n, channels = m.groups * per_group;
  const int width = m.conv_width;
  const int sharers = n / S;  // threads of one channel, consecutive lanes
  const int t = threadIdx.x, ch = t / sharers, part = t % sharers;
  const bool holds_state = t < hd * sharers;
  float* act = mix;                   // [hd + 2n]: x, B, C of the item
  float* step = mix + hd + 2 * n;     // dt, decay

  float s[S];
  float* state = m.states[layer].ssm +
                 ((static_cast<size_t>(b) * heads + h) * hd + ch) * n + part * S;
  if (holds_state) {
    if constexpr (S % 4 == 0) {
#pragma unroll
      for (int i = 0; i < S; i += 4) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(state + i));
        s[i] = v.x, s[i + 1] = v.y, s[i + 2] = v.z, s[i + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < S; ++i) s[i] = __ldcg(state + i);
    }
  }
  // Item channel j: x (j < hd), B, C; its convolution channel and in_proj column.
  auto conv_channel = [&](int j) {
    return g * per_group + (j < hd ? in_group * hd + j : hpg * hd + (j - hd));
  };
  auto in_column = [&](int j) {
    return j < hd ? m.x_at + h * hd + j
                  : (j < hd + n ? m.b_at + g * n + (j - hd) : m.c_at + g * n + (j - hd - n));
  };
  const float* w = m.conv_weight + static_cast<size_t>(layer) * width * channels;
  const float* bias = m.conv_bias + static_cast<size_t>(layer) * channels;
  __nv_bfloat16* ring = m.states[layer].conv;
  const int items = hd + 2 * n;
  const __nv_bfloat16* in = InProjOf(m, layer) + static_cast<size_t>(b) * m.in_columns;
  // Item channel j's convolution over positions pos-width+1 .. pos-1, and
  // the weight of its last tap (position pos).
  auto older = [&](int j) {
    const int c = conv_channel(j);
    float v = bias[c];
#pragma unroll
    for (int i = 0; i < kMaxConvWidth - 1; ++i) {
      if (i < width - 1) {
        const int row = (pos + 1 + i) % width;
        v = fmaf(w[i * channels + c],
                 __bfloat162float(ring[(static_cast<size_t>(row) * p.batch + b) * channels + c]),
                 v);
      }
    }
    return v;
  };
  auto last_tap = [&](int j) { return w[(width - 1) * channels + conv_channel(j)]; };
  constexpr int kLoadsAhead = 2;
  const bool reads_dt = t == 0, reads_z = holds_state && part == 0;
  const bool first = m.schedule & kInputsFirst;
  const int head_at = layer * heads + h;  // in dt_bias, a_log and d_skip
  float older_ahead[kLoadsAhead] = {}, tap_ahead[kLoadsAhead] = {};
  float dt_bias = 0.f, a_log = 0.f, d_skip = 0.f;
  if (first) {
#pragma unroll
    for (int r = 0; r < kLoadsAhead; ++r) {
      const int j = t + r * kThreads;
      if (j < items) older_ahead[r] = older(j), tap_ahead[r] = last_tap(j);
    }
    if (reads_dt) dt_bias = m.dt_bias[head_at], a_log = m.a_log[head_at];
    if (reads_z) d_skip = m.d_skip[head_at];
  }
  // With kLoadsTogether: the first loads of this thread's in_proj values
  // (its first kLoadsAhead channels, dt, z), before the loads above
  // complete; polled below.
  using transformer_decode::ElementOf;
  using transformer_decode::LoadHandoff;
  using transformer_decode::Ready;
  using transformer_decode::VectorOf;
  const bool together = m.schedule & kLoadsTogether;
  uint4 ahead[kLoadsAhead], dt_ahead = {}, z_ahead = {};
  if (together) {
#pragma unroll
    for (int r = 0; r < kLoadsAhead; ++r) {
      const int j = t + r * kThreads;
      ahead[r] = j < items ? LoadHandoff(p, VectorOf(in + in_column(j))) : uint4{};
    }
    if (reads_dt) dt_ahead = LoadHandoff(p, VectorOf(in + m.dt_at + h));
    if (reads_z) z_ahead = LoadHandoff(p, VectorOf(in + m.z_at + h * hd + ch));
  }
  // In_proj's value at `src`, from its first load `first` if issued above.
  auto ready = [&](const __nv_bfloat16* src, const uint4& first_load, bool issued) {
    if (!issued) return transformer_decode::ReadyValue(p, src, layer);
    const __nv_bfloat16* vector = VectorOf(src);
    return ElementOf(Ready(p, vector, first_load, layer), static_cast<int>(src - vector));
  };
  for (int j = t + (first ? kLoadsAhead * kThreads : 0); j < items; j += kThreads) {
    act[j] = older(j);
  }
  // Position pos's input of channel j: the convolution's last tap, SiLU,
  // and the input into its ring row, which no item reads this step (B and
  // C by the group's first head).
  auto take = [&](int j, float now, float older_sum, float tap) {
    act[j] = Silu(fmaf(tap, now, older_sum));
    if (j < hd || in_group == 0) {
      const int c = conv_channel(j);
      ring[(static_cast<size_t>(pos % width) * p.batch + b) * channels + c] = __float2bfloat16(now);
    }
  };
#pragma unroll
  for (int r = 0; r < kLoadsAhead; ++r) {
    const int j = t + r * kThreads;
    if (j < items) {
      const float now = ready(in + in_column(j), ahead[r], together);
      take(j, now, first ? older_ahead[r] : act[j], first ? tap_ahead[r] : last_tap(j));
    }
  }
  for (int j = t + kLoadsAhead * kThreads; j < items; j += kThreads) {
    take(j, ready(in + in_column(j), {}, false), act[j], last_tap(j));
  }
  if (reads_dt) {
    const float now = ready(in + m.dt_at + h, dt_ahead, together);
    const float dt = Softplus(now + (first ? dt_bias : m.dt_bias[head_at]));
    step[0] = dt;
    step[1] = __expf(-dt * __expf(first ? a_log : m.a_log[head_at]));
  }
  const float z = reads_z ? ready(in + m.z_at + h * hd + ch, z_ahead, together) : 0.f;
  __syncthreads();
  transformer_decode::Mark(p, layer, kAtMixerReady);
  if (holds_state) {
    const float x = act[ch], dx = step[0] * x, decay = step[1];
    float y = 0.f;
#pragma unroll
    for (int i = 0; i < S; ++i) {
      const int k = part * S + i;
      s[i] = fmaf(decay, s[i], dx * act[hd + k]);
      y = fmaf(s[i], act[hd + n + k], y);
    }
    auto store_state = [&] {
      if constexpr (S % 4 == 0) {
#pragma unroll
        for (int i = 0; i < S; i += 4) {
          __stcg(reinterpret_cast<float4*>(state + i),
                 make_float4(s[i], s[i + 1], s[i + 2], s[i + 3]));
        }
      } else {
#pragma unroll
        for (int i = 0; i < S; ++i) __stcg(state + i, s[i]);
      }
    };
    const bool output_first = m.schedule & kOutputFirst;
    if (!output_first) store_state();
    for (int offset = sharers / 2; offset > 0; offset /= 2) {
      y += __shfl_xor_sync(0xffffffffu, y, offset);
    }
    if (part == 0) {
      const float skip = first ? d_skip : m.d_skip[head_at];
      const float out = transformer_decode::Bf16Round(fmaf(skip, x, y));
      GatedOf(m, layer)[static_cast<size_t>(b) * m.inner + h * hd + ch] =
          transformer_decode::HandoffValue(out * Silu(z));
    }
    if (output_first) store_state();
  }
  __syncthreads();  // act and step are the next item's
}

// operand[b][k] = bf16(gated[b][k] / rms(gated[b] over k's group) * weight[k])
// (models.layers.rms_norm with the gate already applied), the gated values
// handed over by the mixer items.
template <int B>
__device__ void GatedNormInto(const MambaParams& m, int layer, __nv_bfloat16* operand,
                              float* scalars) {
  const Params& p = m.core;
  const int inner = m.inner, width = inner / m.groups, combos = B * m.groups;
  transformer_decode::GatherInto<B>(p, GatedOf(m, layer), inner, operand, layer);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int c = 0; c < combos; ++c) {  // in a fixed order: the same sums every run
    const int b = c / m.groups, g = c % m.groups;
    const __nv_bfloat16* row = operand + transformer_decode::OperandAt(inner, b, g * width);
    float sum = 0.f;
    for (int k = threadIdx.x; k < width; k += kThreads) {
      const float v = __bfloat162float(row[k]);
      sum = fmaf(v, v, sum);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) scalars[warp * combos + c] = sum;
  }
  __syncthreads();
  if (threadIdx.x < combos) {
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += scalars[w * combos + threadIdx.x];
    scalars[kWarps * combos + threadIdx.x] = rsqrtf(total / width + p.eps);
  }
  __syncthreads();
  const float* weight = m.gate_norm + static_cast<size_t>(layer) * inner;
  for (int k = threadIdx.x; k < inner; k += kThreads) {
    const float wk = __ldg(weight + k);
#pragma unroll
    for (int b = 0; b < B; ++b) {
      __nv_bfloat16* at = operand + transformer_decode::OperandAt(inner, b, k);
      const float scale = scalars[kWarps * combos + b * m.groups + k / width];
      *at = __float2bfloat16(__bfloat162float(*at) * scale * wk);
    }
  }
  __syncthreads();
}

template <int B, int S>
__global__ void __launch_bounds__(kThreads, 1) MambaDecodeKernel(const __grid_constant__ MambaParams m) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace transformer_decode;  // NOLINT: the Transformer kernel's parts
  const Params& p = m.core;
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
  auto* mix = reinterpret_cast<float*>(shared + m.mixer_offset);

  if (threadIdx.x == 0) {
    ring.InitBarriers();
    ring.evict_first = p.options & kEvictFirstWeights;
  }
  __syncthreads();
  ring.Fill(p);
  ClearHandoffs(p);
  CountCleared(p);

  const int pos = *p.pos;
  if (pos < 0) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
      printf("jax_flashoverlap mamba_decode: negative position %d\n", pos);
    }
    __trap();
  }
  const WeightStage &in_proj = p.stages[0], &out_proj = p.stages[1];
  const int mixer_items = p.batch * m.heads;
  // The mixer's items go round the grid as out_proj's do.
  const int first_out = FirstItemOf(out_proj);
  for (int layer = 0; layer < p.layers; ++layer) {
    Mark(p, layer, kAtLayerStart);
    const __nv_bfloat16* x = BlockInputOf(m, layer);
    // A: the norm and in_proj.
    if (ItemsOfCta(in_proj.items)) {
      NormInto<B>(p, x, p.attn_norm + layer * p.d, operand, scalars, layer);
    }
    Mark(p, layer, kAtNormed);
    for (int item = blockIdx.x; item < in_proj.items; item += gridDim.x) {
      ItemProduct<kItemColumns, B>(p, ring, in_proj, layer, operand, reduce, result);
      if (layer == 0) {  // a late CTA's clearing must not erase what this writes
        WaitForCount(p, p.cleared, gridDim.x, "the handoffs' clearing", layer);
      }
      InProjEpilogue<B>(m, layer, item, result);
    }
    ring.RecordWaits(p, layer, kInProjWaitNs);
    Mark(p, layer, kAtInProjDone);
    if (layer == 0) {  // every handoff cleared before any is polled
      WaitForCount(p, p.cleared, gridDim.x, "the handoffs' clearing", layer);
    }
    // B: the convolution, the SSM state's update, the skip and the gate.
    for (int item = first_out; item < mixer_items; item += gridDim.x) {
      MixerItem<S>(m, layer, item, pos, mix);
    }
    Mark(p, layer, kAtMixerDone);
    // C: the gated norm, out_proj and the residual add.
    if (ItemsOfCta(out_proj.items, first_out)) GatedNormInto<B>(m, layer, operand, scalars);
    Mark(p, layer, kAtGatedNormed);
    for (int item = first_out; item < out_proj.items; item += gridDim.x) {
      const int n0 = item * kItemColumns;
      const float input = ResidualInput<B, kItemColumns>(p, x, n0, layer);
      ItemProduct<kItemColumns, B>(p, ring, out_proj, layer, operand, reduce, result);
      ResidualEpilogue<B, kItemColumns>(p, x, BlockOutputOf(m, layer), n0, result,
                                        /*ahead=*/true, input, layer, kOutExchange, 0u);
    }
    ring.RecordWaits(p, layer, kOutProjWaitNs);
    Mark(p, layer, kAtOutProjDone);
    ring.RecordLayer(p, layer);
  }
#endif
}

}  // namespace mamba_decode
}  // namespace jfo
