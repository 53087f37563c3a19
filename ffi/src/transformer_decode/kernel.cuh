// The decode kernel: every block of a Transformer decode step (the stages
// and how they hand over are described in ../transformer_decode.cu).
#pragma once

#include <cuda_bf16.h>

#include "attention.cuh"
#include "exchange.cuh"
#include "handoff.cuh"
#include "params.cuh"
#include "stages.cuh"
#include "sync.cuh"

namespace jfo {
namespace transformer_decode {

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
  int* last = reinterpret_cast<int*>(scalars + (kWarps + 1) * kMaxBatch);

  if (threadIdx.x == 0) {
    if (p.stage_times && blockIdx.x == 0) p.stage_times[0] = GlobalTimerNs();
    ring.InitBarriers();
    ring.evict_first = p.options & kEvictFirstWeights;
  }
  __syncthreads();
  ring.Fill(p);
  // Polled residuals are read ahead too: their poll then overlaps the GEMV.
  const bool residual_ahead = p.options & (kResidualAhead | kPolledHandoffs);
  const bool barriers_between = !Polled(p);
  // Across tensor ranks: this launch's parity of the receive areas (exchange.cuh).
  const unsigned launch = LaunchCount(p);
  const unsigned parity = launch & 1u;
  if (Polled(p)) {
    ClearHandoffs(p);
    if (TensorParallel(p)) EmptyNextExchange(p, parity);
    CountCleared(p);
  }

  const int pos = *p.pos;
  if (pos < 0 || pos >= p.cache_len) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
      printf("jax_flashoverlap transformer_decode: position %d outside the cache [0, %d)\n",
             pos, p.cache_len);
    }
    __trap();
  }
  unsigned barriers = 0;
  const WeightStage &qkv = p.stages[0], &out = p.stages[1];
  const WeightStage &gate_up = p.stages[2], &down = p.stages[3];
  for (int layer = 0; layer < p.layers; ++layer) {
    const __nv_bfloat16* x = LayerInputOf(p, layer);
    __nv_bfloat16* x_attention = XAfterAttentionOf(p, layer);
    Mark(p, layer, kLayerStart);
    // A: the attention's norm, QKV, rotation; k and v into the cache.
    if (ItemsOfCta(qkv.items)) {
      NormInto<B>(p, x, p.attn_norm + layer * p.d, operand, scalars, layer);
    }
    Mark(p, layer, kQkvNormed);
    for (int item = blockIdx.x; item < qkv.items; item += gridDim.x) {
      ItemProduct<kQkvColumns, B>(p, ring, qkv, layer, operand, reduce, result);
      if (Polled(p) && layer == 0) {  // a late CTA's clearing must not erase what this writes
        WaitForCount(p, p.cleared, gridDim.x, "the handoffs' clearing", layer);
      }
      QkvEpilogue<B>(p, layer, item, pos, result);
      // The epilogue's writes (it ends in a sync), then the count.
      if (!Polled(p) && threadIdx.x == 0) Arrive(p, p.qkv_done + item / QkvItemsPerKvHead(p));
    }
    Mark(p, layer, kQkvDone);
    ring.RecordWaits(p, layer, kQkvCopyWaitNs);
    if (Polled(p) && layer == 0) {  // every handoff cleared before any is polled
      WaitForCount(p, p.cleared, gridDim.x, "the handoffs' clearing", layer);
      // Every CTA's emptying of the receive areas before this CTA's first
      // store into a peer's, in every GPU's view (exchange.cuh).
      if (TensorParallel(p)) __threadfence_system();
    }
    // B: attention, each item once its KV head's q and new row are there.
    Attend<HD>(p, layer, pos, reinterpret_cast<float*>(operand), last);
    Mark(p, layer, kAttentionDone);
    if (barriers_between) GridBarrier(p, ++barriers, "the attention stage", layer, kAttentionArrived);
    // C: x + attention @ W_out.
    Mark(p, layer, kOutStart);
    if (ItemsOfCta(out.items)) GatherInto<B>(p, AttendedOf(p, layer), p.heads * HD, operand, layer);
    Mark(p, layer, kOutGathered);
    for (int item = blockIdx.x; item < out.items; item += gridDim.x) {
      const int n0 = item * kOutColumns;
      const float input =
          residual_ahead ? ResidualInput<B, kOutColumns>(p, x, n0, layer) : 0.f;
      ItemProduct<kOutColumns, B>(p, ring, out, layer, operand, reduce, result);
      ResidualEpilogue<B, kOutColumns>(p, x, x_attention, n0, result, residual_ahead, input,
                                       layer, kOutExchange, parity);
    }
    Mark(p, layer, kOutDone);
    ring.RecordWaits(p, layer, kOutCopyWaitNs);
    if (barriers_between) {
      GridBarrier(p, ++barriers, "the attention output stage", layer, kOutArrived);
    }
    // D: the MLP's norm, gate/up, SwiGLU.
    Mark(p, layer, kGateUpStart);
    if (ItemsOfCta(gate_up.items)) {
      NormInto<B>(p, x_attention, p.mlp_norm + layer * p.d, operand, scalars, layer);
    }
    Mark(p, layer, kGateUpNormed);
    for (int item = blockIdx.x; item < gate_up.items; item += gridDim.x) {
      ItemProduct<kGateUpColumns, B>(p, ring, gate_up, layer, operand, reduce, result);
      SwigluEpilogue<B>(p, ActOf(p, layer), item * (kGateUpColumns / 2), result);
    }
    Mark(p, layer, kGateUpDone);
    ring.RecordWaits(p, layer, kGateUpCopyWaitNs);
    if (barriers_between) GridBarrier(p, ++barriers, "the gate/up stage", layer, kGateUpArrived);
    // E: x + act @ W_down.
    Mark(p, layer, kDownStart);
    if (ItemsOfCta(down.items)) GatherInto<B>(p, ActOf(p, layer), p.mlp, operand, layer);
    Mark(p, layer, kDownGathered);
    for (int item = blockIdx.x; item < down.items; item += gridDim.x) {
      const int n0 = item * kDownColumns;
      const float input =
          residual_ahead ? ResidualInput<B, kDownColumns>(p, x_attention, n0, layer) : 0.f;
      ItemProduct<kDownColumns, B>(p, ring, down, layer, operand, reduce, result);
      ResidualEpilogue<B, kDownColumns>(p, x_attention, XAfterMlpOf(p, layer), n0, result,
                                        residual_ahead, input, layer, kDownExchange, parity);
    }
    Mark(p, layer, kDownDone);
    ring.RecordWaits(p, layer, kDownCopyWaitNs);
    ring.RecordLayer(p, layer);
    if (barriers_between && layer + 1 < p.layers) {
      GridBarrier(p, ++barriers, "the down stage", layer, kDownArrived);
    }
  }
  if (p.stage_times && threadIdx.x == 0) atomicMax(p.stage_times + 1, GlobalTimerNs());
  // Every CTA read the count before it counted its clearing, which CTA 0
  // waited for in layer 0.
  if (TensorParallel(p) && blockIdx.x == 0 && threadIdx.x == 0) *p.exchange.launches = launch + 1;
#endif
}

}  // namespace transformer_decode
}  // namespace jfo
