// A decode step through every block of the Transformer, as one kernel
// (tensor-parallel size 1, bf16, at most kMaxBatch rows).
//
// At one token per step each block reads its weights once and does little
// else, so a step's floor is the weights' bytes over HBM bandwidth. XLA runs
// a block as 15-17 kernels, and every kernel boundary leaves HBM idle while
// the next kernel starts and its first loads travel: the 1B model's step took
// twice its floor. Here one persistent kernel (a CTA per SM, co-resident by a
// cooperative launch) runs the blocks' five stages in turn:
//
//   A  RMSNorm, x @ W_qkv, rotary embeddings; the new k and v into the cache
//   B  attention over the cache (split along positions; the last CTA of a
//      head group combines the splits)
//   C  x += attention @ W_out
//   D  RMSNorm, x @ W_gate_up, SwiGLU
//   E  x += act @ W_down
//
// By default (kPolledHandoffs) a stage leaves its outputs in per-layer
// buffers that the next stage polls (transformer_decode/handoff.cuh): no
// grid barrier and no fence between stages, each CTA going on as soon as
// what it reads is there. Without it, grid barriers separate the stages and
// an attention item waits on a count of its KV head's QKV items.
//
// The weights come in a layout prepared once for this kernel
// (models/transformer_decode_cuda.py): each work item's columns contiguous,
// [items, k, columns], as 16x16 tiles in the tensor cores' fragment order, so
// an item is one stream of chunks (chunk_bytes, 32 KiB by default) and a
// chunk's GEMV is a few mma.sync a warp. Each CTA copies its chunks with TMA
// bulk copies into a ring of shared-memory slots that runs ahead of the
// arithmetic across stage and layer boundaries: while a CTA waits or
// attends, its next weights are in flight. Measurements:
// docs/measurements.md (sessions 36-38).
//
// Every wait is bounded: a poll, a count, a grid barrier or a copy that does
// not complete within timeout_ms prints which CTA and layer waited and
// traps, so the step ends in a CUDA error, never in wrong numbers.
#include <cuda_bf16.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "handlers.h"
#include "transformer_decode/attention.cuh"
#include "transformer_decode/params.cuh"
#include "transformer_decode/stages.cuh"
#include "transformer_decode/sync.cuh"

namespace jfo {
namespace {

using namespace transformer_decode;  // NOLINT: this file is the op built on them

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
  if (Polled(p)) ClearHandoffs(p);

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
                                       layer);
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
                                        residual_ahead, input, layer);
    }
    Mark(p, layer, kDownDone);
    ring.RecordWaits(p, layer, kDownCopyWaitNs);
    ring.RecordLayer(p, layer);
    if (barriers_between && layer + 1 < p.layers) {
      GridBarrier(p, ++barriers, "the down stage", layer, kDownArrived);
    }
  }
  if (p.stage_times && threadIdx.x == 0) atomicMax(p.stage_times + 1, GlobalTimerNs());
#endif
}

// ---------------------------------------------------------------------------
// Host side.

WeightStage StageOf(const ffi::AnyBuffer& w, int columns, int chunk_bytes) {
  const auto dims = w.dimensions();  // [layers, items, k, columns]
  WeightStage st;
  st.w = static_cast<const __nv_bfloat16*>(w.untyped_data());
  st.items = static_cast<int>(dims[1]);
  st.k = static_cast<int>(dims[2]);
  st.columns = columns;
  st.rows_per_chunk = chunk_bytes / (columns * static_cast<int>(sizeof(__nv_bfloat16)));
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
ffi::Error Launch(cudaStream_t stream, int device, const Params& p, int grid, size_t shared) {
  auto kernel = TransformerDecodeKernel<B, HD>;
  // Once per device, kernel and shared-memory size: a call's host time is
  // time the GPU may wait for (one launch a decode step).
  static std::mutex mu;
  static std::set<std::tuple<int, size_t>> ready;
  std::lock_guard<std::mutex> lock(mu);
  if (!ready.count({device, shared})) {
    // The most any launch may take, so that no later size is refused.
    JFO_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, DeviceInfoOf(device).max_shared));
    int per_sm = 0;
    JFO_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared));
    if (per_sm < 1) {
      return ffi::Error::Internal("jax_flashoverlap transformer_decode: the kernel does not fit "
                                  "an SM with " + std::to_string(shared) +
                                  " bytes of shared memory");
    }
    ready.insert({device, shared});
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
                                 int32_t timeout_ms, int32_t stage_times,
                                 int32_t chunk_bytes, int32_t ring_slots, int32_t options) {
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
      kv_heads < 1 || heads % kv_heads || (heads / kv_heads) & (heads / kv_heads - 1) ||
      heads / kv_heads > kMaxQueriesPerKv ||
      pos.element_type() != ffi::DataType::S32 || pos.element_count() != 1 ||
      max_splits < 1 || timeout_ms < 1) {
    return ffi::Error::InvalidArgument(
        op + "needs 1 <= batch <= " + std::to_string(kMaxBatch) + ", 1 <= layers <= " +
        std::to_string(kMaxLayers) + ", heads a multiple of kv_heads by 1, 2, 4 or " +
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
  if (chunk_bytes < kMinChunkBytes || chunk_bytes % kMinChunkBytes || chunk_bytes > (1 << 20)) {
    return ffi::Error::InvalidArgument(op + "chunk_bytes must be a multiple of " +
                                       std::to_string(kMinChunkBytes) + " up to 1 MiB");
  }
  p.chunk_bytes = chunk_bytes;
  if (options & ~kAllOptions || stage_times < 0 || stage_times > 2) {
    return ffi::Error::InvalidArgument(op + "unknown options or stage_times: " +
                                       std::to_string(options) + ", " +
                                       std::to_string(stage_times));
  }
  p.options = options;
  p.eps = eps;
  p.rope_theta = rope_theta;
  p.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000ull;
  p.x_in = static_cast<const __nv_bfloat16*>(x.untyped_data());
  p.pos = static_cast<const int32_t*>(pos.untyped_data());
  p.attn_norm = static_cast<const float*>(attn_norm.untyped_data());
  p.mlp_norm = static_cast<const float*>(mlp_norm.untyped_data());
  p.stages[0] = StageOf(w_qkv, kQkvColumns, chunk_bytes);
  p.stages[1] = StageOf(w_out, kOutColumns, chunk_bytes);
  p.stages[2] = StageOf(w_gate_up, kGateUpColumns, chunk_bytes);
  p.stages[3] = StageOf(w_down, kDownColumns, chunk_bytes);
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

  const size_t need = TransformerDecodeWorkspaceBytes(layers, batch, d, heads, kv_heads,
                                                      head_dim, mlp, max_splits);
  const size_t trace_bytes = stage_times == 2 ? static_cast<size_t>(layers) * kMaxTraceCtas *
                                                    kTraceEvents * 8 : 0;
  if (workspace->size_bytes() < need + trace_bytes) {
    return ffi::Error::InvalidArgument(op + "the workspace holds " +
                                       std::to_string(workspace->size_bytes()) + " bytes, " +
                                       std::to_string(need + trace_bytes) + " needed");
  }
  auto* base = static_cast<unsigned char*>(workspace->untyped_data());
  p.barrier = reinterpret_cast<unsigned*>(base);
  p.stage_times = stage_times ? reinterpret_cast<unsigned long long*>(base + kControlBytes)
                              : nullptr;
  p.trace = trace_bytes ? reinterpret_cast<unsigned long long*>(base + need) : nullptr;
  size_t offset = kControlBytes + kTimesBytes;
  p.cleared = p.barrier + 16;
  p.arrivals = p.barrier + 32;
  p.qkv_done = p.arrivals + batch * kv_heads;
  if (static_cast<size_t>(32 + (batch + 1) * kv_heads) * sizeof(unsigned) > kControlBytes) {
    return ffi::Error::InvalidArgument(op + "too many head groups for the control block");
  }
  p.q = reinterpret_cast<float*>(base + offset);
  offset += AlignUp(batch * heads * head_dim * 4, 256);
  p.partials = reinterpret_cast<float*>(base + offset);
  offset += AlignUp(batch * kv_heads * max_splits * qpk * (head_dim + 2) * 4, 256);
  p.attended = reinterpret_cast<__nv_bfloat16*>(base + offset);
  offset += AlignUp(batch * heads * head_dim * 2, 256);
  p.act = reinterpret_cast<__nv_bfloat16*>(base + offset);
  offset += AlignUp(batch * mlp * 2, 256);
  p.handoffs = reinterpret_cast<__nv_bfloat16*>(base + offset);
  p.handoff_bytes = HandoffBytes(layers, batch, d, heads, kv_heads, head_dim, mlp);

  int device = 0;
  JFO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const DeviceInfo info = DeviceInfoOf(device);
  if (info.major < 9) {
    return ffi::Error::InvalidArgument(op + "needs a Hopper or later GPU (TMA bulk copies)");
  }
  // Shared memory: the operand (bf16 [batch][k + pad], or the attention's
  // per-warp partials), the reductions, then the ring with what is left.
  const size_t operand = AlignUp(std::max<size_t>(
      static_cast<size_t>(std::max<int64_t>({d, heads * head_dim, mlp}) + kOperandPad) *
          batch * 2,
      static_cast<size_t>(kWarps) * qpk * (head_dim + 2) * 4), 128);
  const size_t reduce = static_cast<size_t>(kWarps) * batch * kMaxColumns * 4;
  const size_t result = static_cast<size_t>(batch) * kMaxColumns * 4;
  const size_t scalars = ((kWarps + 1) * kMaxBatch + 4) * 4;
  const size_t fixed = operand + reduce + result + AlignUp(scalars, 16);
  const size_t budget = static_cast<size_t>(info.max_shared);
  // Each slot: a chunk and its mbarrier.
  const int fit = static_cast<int>(std::min<size_t>(
      16, budget > fixed ? (budget - fixed) / (chunk_bytes + 8) : 0));
  if (fit < 2) {
    return ffi::Error::InvalidArgument(op + "these shapes leave no shared memory for the weights' "
                                       "ring; use a smaller batch");
  }
  if (ring_slots < 0 || ring_slots == 1 || ring_slots > fit) {
    return ffi::Error::InvalidArgument(op + "ring_slots must be 0 (as many as fit) or 2 to " +
                                       std::to_string(fit) + " at these shapes, got " +
                                       std::to_string(ring_slots));
  }
  const int slots = ring_slots ? ring_slots : fit;
  p.ring_slots = slots;
  size_t at = static_cast<size_t>(slots) * chunk_bytes;
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

  JFO_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(base, 0, kControlBytes + (stage_times ? kTimesBytes : 0), stream));
  const int grid = info.sms;
  if (trace_bytes) {
    if (grid > kMaxTraceCtas) {
      return ffi::Error::InvalidArgument(op + "a trace holds " + std::to_string(kMaxTraceCtas) +
                                         " CTAs; this GPU has " + std::to_string(grid) + " SMs");
    }
    JFO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.trace, 0, trace_bytes, stream));
  }
#define JFO_LAUNCH_BATCH(B)                                            \
  case B:                                                              \
    return head_dim == 64 ? Launch<B, 64>(stream, device, p, grid, at)         \
                          : Launch<B, 128>(stream, device, p, grid, at);
  switch (batch) {
    JFO_LAUNCH_BATCH(1)
    JFO_LAUNCH_BATCH(2)
    JFO_LAUNCH_BATCH(3)
    default:
      return head_dim == 64 ? Launch<4, 64>(stream, device, p, grid, at)
                            : Launch<4, 128>(stream, device, p, grid, at);
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
        .Attr<int32_t>("timeout_ms")
        .Attr<int32_t>("stage_times")  // 1: the barriers' times in the workspace; 2: and a trace
        .Attr<int32_t>("chunk_bytes")  // a shared-memory slot of the weights' stream
        .Attr<int32_t>("ring_slots")   // the ring's slots; 0: as many as fit (up to 16)
        .Attr<int32_t>("options"));  // kEvictFirstWeights | ... (params.cuh)

}  // namespace jfo
