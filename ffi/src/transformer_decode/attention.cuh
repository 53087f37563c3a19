// The decode kernel's attention stage: each head group over the cache's
// positions 0..pos, in splits of positions, one item a CTA; the group's
// last split to finish combines them.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "handoff.cuh"
#include "params.cuh"
#include "stages.cuh"
#include "sync.cuh"

namespace jfo {
namespace transformer_decode {

// A lane's N (2 or 4) consecutive bf16 of a cache row, raw, in one load.
template <int N>
struct LaneRow {
  static_assert(N == 2 || N == 4, "a lane holds 2 or 4 channels");
  using Raw = std::conditional_t<N == 4, uint2, unsigned>;
  Raw raw;

  __device__ __forceinline__ void Load(const __nv_bfloat16* p) {
    raw = __ldcg(reinterpret_cast<const Raw*>(p));
  }

  // A handed-over row's (handoff.cuh), polled until it is there.
  __device__ __forceinline__ void Poll(const Params& p, const __nv_bfloat16* src, int layer) {
    unsigned words[N / 2];
    LoadWords(src, words);
    PollWords<N / 2, false>(p, src, words, layer);
    memcpy(&raw, words, sizeof(raw));
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

// The group's splits combined: attended[b][(g * qpk + j) * HD + e]
// (AttendedOf the layer) in bf16. A round's loads (kSplits splits) are all
// issued before any is used: one round trip for up to kSplits splits.
template <int HD>
__device__ void CombineGroup(const Params& p, int count, int b, int g,
                             __nv_bfloat16* attended) {
  constexpr int kSplits = 16;
  const int qpk = p.q_per_kv, warp_floats = qpk * (HD + 2);
  const float* group = p.partials + (static_cast<size_t>(b) * p.kv_heads + g) * p.max_splits *
                                        warp_floats;
  for (int t = threadIdx.x; t < qpk * HD; t += kThreads) {
    const int j = t / HD, e = t % HD;
    const float* mine = group + j * (HD + 2);
    float big = -INFINITY, sum = 0.f, out = 0.f;
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
      // Every split has a position, so its max is finite.
      float round_big = big;
#pragma unroll
      for (int i = 0; i < kSplits; ++i) round_big = fmaxf(round_big, m[i]);
      const float rescale = __expf(big - round_big);  // 0 in the first round
      sum *= rescale;
      out *= rescale;
#pragma unroll
      for (int i = 0; i < kSplits; ++i) {
        const float factor = s0 + i < count ? __expf(m[i] - round_big) : 0.f;
        sum = fmaf(l[i], factor, sum);
        out = fmaf(o[i], factor, out);
      }
      big = round_big;
    }
    attended[static_cast<size_t>(b) * p.heads * HD + (g * qpk + j) * HD + e] =
        HandoffValue(out / sum);
  }
}

// Each item (batch row, KV head, split) starts once its KV head's q is
// there (polled from QOf; without kPolledHandoffs, once p.qkv_done counts
// the head's QKV items), and leaves its partial in p.partials: per query
// head of the group, o [HD] (not normalized), then m and l (the running max
// and sum of the softmax). The group's last item to arrive (p.arrivals)
// combines them into AttendedOf.
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
  const bool kv_early = p.options & kKvBeforeCount;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int bg = item / splits.count, split = item % splits.count;
    const int b = bg / p.kv_heads, g = bg % p.kv_heads;
    const int p0 = split * splits.length, p1 = min(pos + 1, p0 + splits.length);
    const size_t head = (static_cast<size_t>(b) * p.kv_heads + g) * p.cache_len;
    const __nv_bfloat16* kc = p.caches[layer].k + head * HD + lane * kPerLane;
    const __nv_bfloat16* vc = p.caches[layer].v + head * HD + lane * kPerLane;
    LaneRow<kPerLane> keys[kInFlight], values[kInFlight], new_key, new_value;
    // A round's loads of earlier steps' rows, all issued before any is used.
    auto load_round = [&](int base) {
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        const int position = base + i * kWarps;
        if (position < p1 && position != pos) {
          keys[i].Load(kc + static_cast<size_t>(position) * HD);
          values[i].Load(vc + static_cast<size_t>(position) * HD);
        }
      }
    };
    // With kKvBeforeCount, the first round's before the wait.
    const int first = p0 + warp;
    if (kv_early) load_round(first);
    if (!Polled(p)) {
      WaitForCount(p, p.qkv_done + g, QkvItemsPerKvHead(p) * (layer + 1),
                   "the QKV items of its KV head", layer);
    }
    float q[QPK][kPerLane], m[QPK], l[QPK];
    float o[QPK][kPerLane];
    {
      const float* q_src = QOf(p, layer) + (static_cast<size_t>(b) * p.heads + g * qpk) * HD +
                           lane * kPerLane;
      unsigned words[QPK][kPerLane];
#pragma unroll
      for (int j = 0; j < QPK; ++j) LoadWords(q_src + j * HD, words[j]);  // all, then checked
#pragma unroll
      for (int j = 0; j < QPK; ++j) {
        if (Polled(p)) PollWords<kPerLane, true>(p, q_src + j * HD, words[j], layer);
        m[j] = -INFINITY;
        l[j] = 0.f;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          o[j][e] = 0.f;
          q[j][e] = __uint_as_float(words[j][e]);
        }
      }
    }
    if (item == blockIdx.x) Mark(p, layer, kAttentionReady);
    // Position pos is this step's (the warp's if pos - first is a multiple
    // of kWarps): polled from its handoff, or read from the cache once its
    // KV head is counted.
    if (pos < p1 && pos >= first && (pos - first) % kWarps == 0) {
      if (Polled(p)) {
        new_key.Poll(p, NewRowOf(p, layer, b, g, 0) + lane * kPerLane, layer);
        new_value.Poll(p, NewRowOf(p, layer, b, g, 1) + lane * kPerLane, layer);
      } else {
        new_key.Load(kc + static_cast<size_t>(pos) * HD);
        new_value.Load(vc + static_cast<size_t>(pos) * HD);
      }
    }
    for (int base = first; base < p1; base += kWarps * kInFlight) {
      if (!kv_early || base != first) load_round(base);
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        const int position = base + i * kWarps;
        if (position >= p1) break;
        float kv[kPerLane], vv[kPerLane];
        // Copies selected by value: a reference to either would put the
        // round's rows in local memory.
        LaneRow<kPerLane> key = keys[i], value = values[i];
        if (position == pos) {
          key = new_key;
          value = new_value;
        }
        key.Unpack(kv);
        value.Unpack(vv);
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
      for (int w = 0; w < kWarps; ++w) {
        big = fmaxf(big, scratch[w * warp_floats + j * (HD + 2) + HD]);
      }
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
    const bool fenced_atomics = !(p.options & kOrderedAtomics);
    if (fenced_atomics) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      const unsigned before = fenced_atomics ? atomicAdd(p.arrivals + bg, 1u)
                                             : AddAcquireRelease(p.arrivals + bg, 1u);
      // The count runs over the launch's layers: a reset here could land
      // after the next layer's first arrival (no barrier orders them).
      *last = before == static_cast<unsigned>(splits.count * (layer + 1) - 1);
    }
    __syncthreads();
    Mark(p, layer, kSplitDone);
    if (*last) {
      if (fenced_atomics) __threadfence();
      CombineGroup<HD>(p, splits.count, b, g, AttendedOf(p, layer));
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
