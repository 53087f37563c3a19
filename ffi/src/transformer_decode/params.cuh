// The decode kernel's launch parameters and layout constants
// (ffi/src/transformer_decode.cu).
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

namespace jfo {
namespace transformer_decode {

// 256 threads, up to 255 registers each: at 512 (128 registers) the
// attention and the splits' combine spilled into the GEMVs' loops.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBatch = 4;
constexpr int kMaxLayers = 64;
constexpr int kMaxQueriesPerKv = 8;
constexpr int kMinChunkBytes = 16384;
// The grid barrier's counter, the head groups' arrivals and QKV items done.
constexpr int kControlBytes = 4096;
// With stage_times, after the control block: the launch's start and end,
// then per grid barrier (4 a layer: models.transformer_decode_cuda.
// BARRIERS_PER_LAYER) the last CTA's arrival and CTA 0's release (%globaltimer, ns).
constexpr int kTimesBytes = 8192;
// Columns of one work item in each weight stage. QKV items hold 16 rotary
// pairs of one head: columns j0..j0+15 of its first half, then the same of
// its second half, so that the rotation happens in the item's epilogue.
constexpr int kQkvColumns = 32;
constexpr int kOutColumns = 16;
constexpr int kGateUpColumns = 64;  // 32 hidden units, gate and up interleaved
constexpr int kDownColumns = 16;
constexpr int kMaxColumns = 64;
// The GEMV operand's rows in shared memory are k + kOperandPad long, so
// that the batch rows' loads of one k fall in different banks.
constexpr int kOperandPad = 8;
constexpr int kStages = 4;  // weight stages a layer: QKV, out, gate/up, down

// The kernel's optional paths (Params::options, bit flags;
// models.transformer_decode_cuda.OPTIONS): all on by default, measured
// faster together; 0 is the kernel with grid barriers and fences between
// stages, kept for comparison. Paths tried and removed: docs/design.md,
// "The one-kernel decode step".
constexpr int kEvictFirstWeights = 1;  // the weights' copies marked evict-first in L2
constexpr int kResidualAhead = 4;      // the residual adds' inputs loaded before the GEMV
constexpr int kKvBeforeCount = 8;      // an attention item's cache rows loaded before its wait
constexpr int kOrderedAtomics = 16;    // release/acquire atomics in place of fences
constexpr int kPolledHandoffs = 64;    // per-layer outputs polled, no grid barriers (handoff.cuh)
constexpr int kAllOptions = kEvictFirstWeights | kResidualAhead | kKvBeforeCount |
                             kOrderedAtomics | kPolledHandoffs;

// With stage_times 2, each CTA's clock at these points of each layer
// (thread 0's %globaltimer, ns), and the time it waited for weight copies.
// A trace row holds kTraceEvents values; another kernel on this machinery
// (the Mamba-2 one) names its own events below kIssueNs.
enum TraceEvent {
  kLayerStart,
  kQkvNormed,
  kQkvDone,
  kAttentionReady,  // its first attention item's q there (or its KV head counted)
  kSplitDone,       // its last split's partial stored and counted
  kAttentionDone,   // and the group combined where it was the last
  kAttentionArrived,  // at the grid barrier after it
  kOutStart,
  kOutGathered,
  kOutDone,
  kOutArrived,
  kGateUpStart,
  kGateUpNormed,
  kGateUpDone,
  kGateUpArrived,
  kDownStart,
  kDownGathered,
  kDownDone,
  kDownArrived,
  // Not times: the ns thread 0 waited for weight copies in each stage.
  kQkvCopyWaitNs,
  kOutCopyWaitNs,
  kGateUpCopyWaitNs,
  kDownCopyWaitNs,
  kIssueNs,           // thread 0 issuing copies, in the layer
  kWarp1CopyWaitNs,   // thread 32's waits for copies, in the layer
  kTraceEvents
};
constexpr int kMaxTraceCtas = 256;

// Tensor parallelism (exchange.cuh): this rank's place and the receive
// areas of out's and down's partial sums. One rank: ranks 1, the rest unused.
constexpr int kMaxTensorRanks = 8;
// A rank's first wait for a peer's partials that timed out, for the host's
// error (host-mapped memory; `set` written last).
struct ExchangeFailure {
  volatile int set;
  int rank, peer, peer_device, layer;
};
struct Exchange {
  int rank, ranks;
  // This rank's receive area, bf16 [2 parities][layers][2 stages][ranks][batch][d]
  // (the own rank's rows unused), and every other rank's (null for this one).
  __nv_bfloat16* recv;
  __nv_bfloat16* send[kMaxTensorRanks];
  unsigned* launches;  // this rank's launches so far, kept across launches
  // Non-zero once a wait of this rank's group timed out, kept across
  // launches until jax_flashoverlap.reset(): every rank's, so that a timed
  // out rank marks them all.
  unsigned* failed[kMaxTensorRanks];
  ExchangeFailure* report;  // this rank's
  uint64_t timeout_ns;      // of a wait for a peer's partials
  int ordinals[kMaxTensorRanks];  // each rank's CUDA device, for the timeout's message
};

struct LayerCache {
  __nv_bfloat16* k;  // [batch, kv, cache_len, head_dim]
  __nv_bfloat16* v;
};

struct WeightStage {
  const __nv_bfloat16* w;  // [layers, items, k, columns], each item in 16x16 MMA tiles
  int items;
  int k;
  int columns;
  int rows_per_chunk;
  int chunks_per_item;
  int first_cta = 0;  // the CTA of item 0: items go round the grid from it
};

struct Params {
  int layers, batch, d, heads, kv_heads, head_dim, mlp, cache_len;
  int q_per_kv, max_splits, ring_slots;
  int chunk_bytes;  // a slot's bytes: a multiple of kMinChunkBytes
  int options;  // kEvictFirstWeights | ...
  float eps;
  uint64_t timeout_ns;
  const __nv_bfloat16* x_in;  // [batch, d]
  const int32_t* pos;         // scalar
  const float* rope_frequencies;  // [head_dim / 2], the model's (models.layers.rope_frequencies)
  const float* attn_norm;     // [layers, d]
  const float* mlp_norm;      // [layers, d]
  WeightStage stages[kStages];
  __nv_bfloat16* x_out;  // [batch, d]: the residual stream from stage C of layer 0 on
  // The workspace's parts.
  unsigned* barrier;       // grid barrier arrivals, zeroed before each launch
  unsigned long long* stage_times;  // nullptr, or kTimesBytes zeroed before the launch
  unsigned long long* trace;  // nullptr, or [layers, kMaxTraceCtas, kTraceEvents] zeroed
  unsigned* arrivals;      // [batch * kv]: splits done per head group, over the launch's layers
  unsigned* qkv_done;      // [kv]: QKV items done per KV head, over the launch's layers
  float* q;                // [batch, heads, head_dim], rotated, bf16-rounded
  float* partials;         // [batch * kv, max_splits, q_per_kv, head_dim + 2]
  // With kPolledHandoffs: each layer's stage outputs (handoff.cuh), and
  // the CTAs that have filled their share with kHandoffEmpty.
  __nv_bfloat16* handoffs;
  size_t handoff_bytes;
  unsigned* cleared;
  __nv_bfloat16* attended; // [batch, heads * head_dim]
  __nv_bfloat16* act;      // [batch, mlp]
  Exchange exchange;
  // Shared-memory layout (byte offsets), decided on the host.
  int operand_offset, reduce_offset, result_offset, scalar_offset, mbar_offset;
  LayerCache caches[kMaxLayers];
};

// Host side: the workspace's layout.

inline size_t AlignUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// A weight stage of `items` items of [k, columns] (bf16 at w, per layer
// [items, k, columns]) streamed in chunks of chunk_bytes.
inline WeightStage WeightStageOf(const void* w, int64_t items, int64_t k, int columns,
                                 int chunk_bytes) {
  WeightStage st;
  st.w = static_cast<const __nv_bfloat16*>(w);
  st.items = static_cast<int>(items);
  st.k = static_cast<int>(k);
  st.columns = columns;
  st.rows_per_chunk = chunk_bytes / (columns * static_cast<int>(sizeof(__nv_bfloat16)));
  st.chunks_per_item = (st.k + st.rows_per_chunk - 1) / st.rows_per_chunk;
  return st;
}

// The layers' handoff buffers (handoff.cuh), at the workspace's end.
inline size_t HandoffBytes(int64_t layers, int64_t batch, int64_t d, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, int64_t mlp) {
  return AlignUp(layers * batch * (2 * d + mlp + 3 * heads * head_dim + 2 * kv_heads * head_dim) *
                     2, 256);
}

// A receive area's bytes (Exchange::recv).
inline size_t ExchangeBytes(int64_t layers, int64_t batch, int64_t d, int64_t ranks) {
  return AlignUp(2 * layers * 2 * ranks * batch * d * 2, 256);
}

// The workspace's bytes (models/transformer_decode_cuda.py computes the same
// from the same shapes; the handler checks the buffer it gets).
inline size_t TransformerDecodeWorkspaceBytes(int64_t layers, int64_t batch, int64_t d,
                                              int64_t heads, int64_t kv_heads, int64_t head_dim,
                                              int64_t mlp, int64_t max_splits) {
  const int64_t qpk = heads / kv_heads;
  return kControlBytes + kTimesBytes + AlignUp(batch * heads * head_dim * 4, 256) +
         AlignUp(batch * kv_heads * max_splits * qpk * (head_dim + 2) * 4, 256) +
         AlignUp(batch * heads * head_dim * 2, 256) + AlignUp(batch * mlp * 2, 256) +
         HandoffBytes(layers, batch, d, heads, kv_heads, head_dim, mlp);
}

}  // namespace transformer_decode
}  // namespace jfo
