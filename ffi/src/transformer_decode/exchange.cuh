// Tensor parallelism inside the decode kernel. Each rank holds its share of
// the heads and of the MLP's units (the layers' own tensor-parallel split),
// so out's and down's GEMVs leave each rank a partial sum of every column.
// Every rank runs the same out and down items over its own rows, and the
// CTAs that run an item on the ranks exchange its partials in the item's
// epilogue: each stores its bf16 partials into every other rank's receive
// area and polls for theirs, and each adds all of them in rank order, so
// every rank holds the same residual stream, as after an all-reduce of the
// bf16 partials summed in float32.
//
// A peer may store into this rank's area before this rank's launch starts,
// so the areas outlive a launch: two parities, by launch count. Launch n
// reads parity n & 1 and empties parity (n + 1) & 1, which the peers fill in
// their launch n + 1 only after they read this launch's partials, which this
// rank stores after its emptying (fenced at system scope). The peers'
// values are polled like the handoffs (handoff.cuh: kHandoffEmpty until
// stored), each poll bounded.
//
// A poll that times out does not end the launch: a trap would end the CUDA
// context, and its message, printed from the device, may never reach the
// host. It reports the rank, the peer and the layer to the host
// (ExchangeFailure), marks every rank of the group failed, and stands NaN
// for the partial. A failed rank takes every later partial as NaN without
// waiting, so the launch runs to its end with NaN in every row that depends
// on a missing sum, on every rank, and so do its later launches (graph
// replays included) until jax_flashoverlap.reset(). The host refuses the
// group's steps meanwhile (transformer_decode.cu).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "handoff.cuh"
#include "params.cuh"
#include "sync.cuh"

namespace jfo {
namespace transformer_decode {

enum ExchangeStage { kOutExchange = 0, kDownExchange = 1 };

__device__ __forceinline__ bool TensorParallel(const Params& p) { return p.exchange.ranks > 1; }

// Where rank `sender`'s partial of batch row b, column `column` lies in a
// receive area.
__device__ __forceinline__ size_t ExchangeAt(const Params& p, unsigned parity, int layer,
                                             ExchangeStage stage, int sender, int b,
                                             int column) {
  return ((((static_cast<size_t>(parity) * p.layers + layer) * 2 + stage) * p.exchange.ranks +
           sender) * p.batch + b) * p.d + column;
}

// The launch's count (every CTA, before any CTA may advance it).
__device__ __forceinline__ unsigned LaunchCount(const Params& p) {
  return TensorParallel(p) ? *reinterpret_cast<volatile unsigned*>(p.exchange.launches) : 0u;
}

// Every thread, before the CTA counts its clearing: its share of the
// receive area's parity that the peers fill in their next launch, emptied,
// and fenced so that those stores precede every exchange store of this
// launch (ordered after the clearing's count) in every GPU's view.
__device__ inline void EmptyNextExchange(const Params& p, unsigned parity) {
  const size_t per_parity = static_cast<size_t>(p.layers) * 2 * p.exchange.ranks * p.batch * p.d;
  FillEmpty(p.exchange.recv + (parity ^ 1u) * per_parity,
            per_parity * sizeof(__nv_bfloat16) / sizeof(uint4));
  __threadfence_system();
}

__device__ __forceinline__ bool GroupFailed(const Params& p) {
  return *reinterpret_cast<volatile unsigned*>(p.exchange.failed[p.exchange.rank]) != 0u;
}

// The first timed-out poll of this rank reports; every one marks the group.
__device__ __noinline__ inline void PeerTimedOut(const Params& p, int peer, int layer) {
  const Exchange& e = p.exchange;
  if (atomicCAS(e.failed[e.rank], 0u, 1u) == 0u) {
    ExchangeFailure* r = e.report;
    r->rank = e.rank;
    r->peer = peer;
    r->peer_device = e.ordinals[peer];
    r->layer = layer;
    __threadfence_system();  // the fields before `set`
    r->set = 1;
  }
  for (int q = 0; q < e.ranks; ++q) {
    if (q != e.rank) atomicExch_system(e.failed[q], 1u);
  }
}

__device__ __forceinline__ uint4 LoadSystem(const __nv_bfloat16* src) {
  uint4 v;
  asm volatile("ld.relaxed.sys.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src) : "memory");
  return v;
}

__device__ __forceinline__ void StoreSystem(__nv_bfloat16* dst, __nv_bfloat16 value) {
  const unsigned short bits = __bfloat16_as_ushort(value);
  asm volatile("st.relaxed.sys.global.b16 [%0], %1;" ::"l"(dst), "h"(bits) : "memory");
}

// Rank `peer`'s partial at src (this rank's receive area), polled until
// stored; NaN once the group failed.
__device__ inline float PeerPartial(const Params& p, const __nv_bfloat16* src, int peer,
                                    int layer) {
  const __nv_bfloat16* vector = VectorOf(src);
  uint4 v = LoadSystem(vector);
  if (HasEmpty(v)) {
    const uint64_t start = GlobalTimerNs();
    do {
      if (GroupFailed(p)) return __int_as_float(0x7FFFFFFF);
      if (GlobalTimerNs() - start > p.exchange.timeout_ns) {
        PeerTimedOut(p, peer, layer);
        return __int_as_float(0x7FFFFFFF);
      }
      v = LoadSystem(vector);
    } while (HasEmpty(v));
  }
  return ElementOf(v, static_cast<int>(src - vector));
}

// This rank's partial `own` (bf16-rounded) of batch row b, column `column`
// to every peer, then the sum of every rank's in rank order, bf16-rounded.
__device__ inline float SummedOverRanks(const Params& p, float own, unsigned parity, int layer,
                                        ExchangeStage stage, int b, int column) {
  const Exchange& e = p.exchange;
  const __nv_bfloat16 sent = HandoffValue(own);
  for (int q = 0; q < e.ranks; ++q) {
    if (q != e.rank) StoreSystem(e.send[q] + ExchangeAt(p, parity, layer, stage, e.rank, b, column), sent);
  }
  float total = 0.f;
  for (int q = 0; q < e.ranks; ++q) {
    total += q == e.rank ? __bfloat162float(sent)
                         : PeerPartial(p, e.recv + ExchangeAt(p, parity, layer, stage, q, b, column),
                                       q, layer);
  }
  // A failed group's partials may be a call out of step: none is used.
  if (GroupFailed(p)) return __int_as_float(0x7FFFFFFF);
  return __bfloat162float(__float2bfloat16(total));
}

}  // namespace transformer_decode
}  // namespace jfo
