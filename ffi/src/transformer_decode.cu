// A decode step through every block of the Transformer, as one kernel
// (bf16, at most kMaxBatch rows).
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
// attends, its next weights are in flight.
//
// Across tensor ranks each rank runs the kernel on its share of the heads
// and of the MLP's units, and out's and down's partial sums are exchanged in
// those stages' epilogues (transformer_decode/exchange.cuh): ranks on GPUs
// of one process (group_ordinals, n), each storing into the others' memory
// (peer access), or, to test the exchange on one GPU, emulated ranks
// (emulated_ranks: each a launch of its own on a share of the SMs, the
// operands stacked by rank). Neither has run on a GPU yet.
//
// Every wait is bounded. A wait for another tensor rank that times out
// turns the step's outputs to NaN on every rank and fails the group's later
// steps on the host, naming the ranks (exchange.cuh). A wait inside the
// GPU (a poll, a count, a grid barrier or a copy) that does not complete
// within timeout_ms prints which CTA and layer waited and traps: no peer
// is missing there, so the kernel itself is wrong, and the step ends in a
// CUDA error, never in wrong numbers.
#include <cuda_bf16.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <string>
#include <tuple>

#include "handlers.h"
#include "transformer_decode/host.cuh"
#include "transformer_decode/params.cuh"
#ifdef JFO_WITH_CUBLASLT
#include "transport/transport.h"
#endif

namespace jfo {
namespace {

using namespace transformer_decode;  // NOLINT: this file is the op built on them

// One rank's launch: its parameters, shared-memory bytes and grid.
struct RankLaunch {
  Params p = {};
  size_t shared = 0;
  int grid = 0;
  size_t trace_bytes = 0;
};

struct Attrs {
  int32_t heads, kv_heads, max_splits;
  float eps;
  int32_t timeout_ms, stage_times, chunk_bytes, ring_slots, options, emulated_ranks;
};

// Checks rank `group.rank`'s operands and lays out its launch (the caches'
// contents copied where XLA could not alias them, on `stream`). Emulated
// ranks take slice `group.rank` of the stacked operands.
ffi::ErrorOr<RankLaunch> PlanRank(cudaStream_t stream, int device, const TensorGroup& group,
                                  const Attrs& a,
                                  const ffi::AnyBuffer& x, const ffi::AnyBuffer& pos,
                                  const ffi::AnyBuffer& rope_frequencies,
                                  const ffi::AnyBuffer& attn_norm, const ffi::AnyBuffer& mlp_norm,
                                  const ffi::AnyBuffer* weights, ffi::RemainingArgs& caches_in,
                                  ffi::AnyBuffer& x_out, ffi::AnyBuffer& workspace,
                                  ffi::RemainingRets& caches_out) {
  static const std::string op = "jax_flashoverlap transformer_decode: ";
  // The stacked operands' slice: ranks are emulated, or each on its own GPU.
  const int ranks = a.emulated_ranks, rank = ranks > 1 ? group.rank : 0;
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
  const int32_t heads = a.heads, kv_heads = a.kv_heads;
  if (batch < 1 || batch > kMaxBatch || layers < 1 || layers > kMaxLayers || heads < 1 ||
      kv_heads < 1 || heads % kv_heads || (heads / kv_heads) & (heads / kv_heads - 1) ||
      heads / kv_heads > kMaxQueriesPerKv ||
      pos.element_type() != ffi::DataType::S32 || pos.element_count() != 1 ||
      a.max_splits < 1 || a.timeout_ms < 1) {
    return ffi::Error::InvalidArgument(
        op + "needs 1 <= batch <= " + std::to_string(kMaxBatch) + ", 1 <= layers <= " +
        std::to_string(kMaxLayers) + ", heads a multiple of kv_heads by 1, 2, 4 or " +
        std::to_string(kMaxQueriesPerKv) + ", an int32 position and max_splits, timeout_ms >= 1");
  }
  if (caches_in.size() != static_cast<size_t>(2 * layers) || caches_out.size() != caches_in.size()) {
    return ffi::Error::InvalidArgument(op + "expected a k and a v cache per layer");
  }
  auto first_buffer = caches_in.get<ffi::AnyBuffer>(0);
  if (first_buffer.has_error()) return first_buffer.error();
  JFO_ASSIGN_OR_RETURN(const Part first, PartOf(*first_buffer, "the caches", rank, ranks));
  const int64_t* cd = first.dims;  // [batch, kv, cache_len, head_dim]
  if (first.rank != 4 || cd[0] != batch || cd[1] != kv_heads) {
    return ffi::Error::InvalidArgument(op + "caches must be [batch, kv_heads, length, head_dim]");
  }
  const int64_t cache_len = cd[2], head_dim = cd[3];
  if (head_dim != 64 && head_dim != 128) {
    return ffi::Error::InvalidArgument(op + "head_dim must be 64 or 128, got " +
                                       std::to_string(head_dim));
  }
  if (rope_frequencies.element_type() != ffi::DataType::F32 ||
      rope_frequencies.element_count() != static_cast<size_t>(head_dim / 2)) {
    return ffi::Error::InvalidArgument(op + "rope_frequencies must be float32 [head_dim / 2], "
                                            "got " + DimsToString(rope_frequencies));
  }
  const int64_t qpk = heads / kv_heads;
  Part w[kStages];
  const char* names[kStages] = {"w_qkv", "w_out", "w_gate_up", "w_down"};
  for (int s = 0; s < kStages; ++s) {
    JFO_ASSIGN_OR_RETURN(w[s], PartOf(weights[s], names[s], rank, ranks));
  }
  const int64_t mlp = w[3].rank == 4 ? w[3].dims[2] : 0;
  if (d % kOutColumns || d % 8 || mlp < 1 || mlp % (kGateUpColumns / 2)) {
    return ffi::Error::InvalidArgument(op + "d must be a multiple of 16 and the MLP width of 32");
  }
  JFO_RETURN_IF_ERROR(CheckWeight(w[0], "w_qkv", layers,
                                  kv_heads * (qpk + 2) * head_dim / kQkvColumns, d, kQkvColumns));
  JFO_RETURN_IF_ERROR(CheckWeight(w[1], "w_out", layers, d / kOutColumns, heads * head_dim,
                                  kOutColumns));
  JFO_RETURN_IF_ERROR(CheckWeight(w[2], "w_gate_up", layers, 2 * mlp / kGateUpColumns, d,
                                  kGateUpColumns));
  JFO_RETURN_IF_ERROR(CheckWeight(w[3], "w_down", layers, d / kDownColumns, mlp, kDownColumns));

  RankLaunch launch;
  Params& p = launch.p;
  p.layers = static_cast<int>(layers);
  p.batch = static_cast<int>(batch);
  p.d = static_cast<int>(d);
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = static_cast<int>(head_dim);
  p.mlp = static_cast<int>(mlp);
  p.cache_len = static_cast<int>(cache_len);
  p.q_per_kv = static_cast<int>(qpk);
  p.max_splits = a.max_splits;
  if (a.chunk_bytes < kMinChunkBytes || a.chunk_bytes % kMinChunkBytes ||
      a.chunk_bytes > (1 << 20)) {
    return ffi::Error::InvalidArgument(op + "chunk_bytes must be a multiple of " +
                                       std::to_string(kMinChunkBytes) + " up to 1 MiB");
  }
  p.chunk_bytes = a.chunk_bytes;
  if (a.options & ~kAllOptions || a.stage_times < 0 || a.stage_times > 2) {
    return ffi::Error::InvalidArgument(op + "unknown options or stage_times: " +
                                       std::to_string(a.options) + ", " +
                                       std::to_string(a.stage_times));
  }
  if (group.ranks > 1 && !(a.options & kPolledHandoffs)) {
    return ffi::Error::InvalidArgument(op + "tensor ranks exchange their partials only with "
                                            "polled handoffs (option 64)");
  }
  p.options = a.options;
  p.eps = a.eps;
  // A wait inside the GPU may be behind one for a peer's partials, which
  // may take its whole bound before it gives up: twice the bound there.
  p.exchange.timeout_ns = static_cast<uint64_t>(a.timeout_ms) * 1000000ull;
  p.timeout_ns = p.exchange.timeout_ns * (group.ranks > 1 ? 2 : 1);
  p.x_in = static_cast<const __nv_bfloat16*>(x.untyped_data());
  p.pos = static_cast<const int32_t*>(pos.untyped_data());
  p.rope_frequencies = static_cast<const float*>(rope_frequencies.untyped_data());
  p.attn_norm = static_cast<const float*>(attn_norm.untyped_data());
  p.mlp_norm = static_cast<const float*>(mlp_norm.untyped_data());
  const int columns[kStages] = {kQkvColumns, kOutColumns, kGateUpColumns, kDownColumns};
  for (int s = 0; s < kStages; ++s) p.stages[s] = StageOf(w[s], columns[s], a.chunk_bytes);
  JFO_ASSIGN_OR_RETURN(const Part out, PartOf(x_out, "x_out", rank, ranks));
  if (!out.Is(ffi::DataType::BF16, {batch, d})) {
    return ffi::Error::InvalidArgument(op + "x_out must be bf16 [batch, d] a rank, got " +
                                       PartDims(out));
  }
  p.x_out = reinterpret_cast<__nv_bfloat16*>(out.data);
  for (int64_t i = 0; i < 2 * layers; ++i) {
    auto in_buffer = caches_in.get<ffi::AnyBuffer>(i);
    auto out_buffer = caches_out.get<ffi::AnyBuffer>(i);
    if (in_buffer.has_error()) return in_buffer.error();
    if (out_buffer.has_error()) return out_buffer.error();
    JFO_ASSIGN_OR_RETURN(const Part in, PartOf(*in_buffer, "the caches", rank, ranks));
    JFO_ASSIGN_OR_RETURN(const Part updated, PartOf(**out_buffer, "the caches", rank, ranks));
    if (in.type != ffi::DataType::BF16 || !in.SameShape(first) || !updated.SameShape(first)) {
      return ffi::Error::InvalidArgument(op + "cache " + std::to_string(i) + " is " +
                                         PartDims(in) + ", expected bf16 like the first");
    }
    if (updated.data != in.data) {
      // Not aliased (XLA could not donate it): start from the input's contents.
      JFO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(updated.data, in.data, in.bytes,
                                               cudaMemcpyDeviceToDevice, stream));
    }
    auto* data = reinterpret_cast<__nv_bfloat16*>(updated.data);
    if (i % 2 == 0) p.caches[i / 2].k = data; else p.caches[i / 2].v = data;
  }

  const size_t need = TransformerDecodeWorkspaceBytes(layers, batch, d, heads, kv_heads,
                                                      head_dim, mlp, a.max_splits);
  launch.trace_bytes = a.stage_times == 2 ? static_cast<size_t>(layers) * kMaxTraceCtas *
                                                kTraceEvents * 8 : 0;
  JFO_ASSIGN_OR_RETURN(const Part space, PartOf(workspace, "the workspace", rank, ranks));
  if (space.bytes < need + launch.trace_bytes) {
    return ffi::Error::InvalidArgument(op + "the workspace holds " + std::to_string(space.bytes) +
                                       " bytes a rank, " +
                                       std::to_string(need + launch.trace_bytes) + " needed");
  }
  auto* base = reinterpret_cast<unsigned char*>(space.data);
  p.barrier = reinterpret_cast<unsigned*>(base);
  p.stage_times = a.stage_times ? reinterpret_cast<unsigned long long*>(base + kControlBytes)
                                : nullptr;
  p.trace = launch.trace_bytes ? reinterpret_cast<unsigned long long*>(base + need) : nullptr;
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
  offset += AlignUp(batch * kv_heads * a.max_splits * qpk * (head_dim + 2) * 4, 256);
  p.attended = reinterpret_cast<__nv_bfloat16*>(base + offset);
  offset += AlignUp(batch * heads * head_dim * 2, 256);
  p.act = reinterpret_cast<__nv_bfloat16*>(base + offset);
  offset += AlignUp(batch * mlp * 2, 256);
  p.handoffs = reinterpret_cast<__nv_bfloat16*>(base + offset);
  p.handoff_bytes = HandoffBytes(layers, batch, d, heads, kv_heads, head_dim, mlp);

  p.exchange.rank = group.rank;
  p.exchange.ranks = group.ranks;
  if (group.ranks > 1) {
    for (int q = 0; q < group.ranks; ++q) {
      JFO_ASSIGN_OR_RETURN(const ExchangeArea area, ExchangeAreaOf(group, q, layers, batch, d));
      p.exchange.ordinals[q] = group.ordinals[q];
      p.exchange.failed[q] = area.failed;
      if (q == group.rank) {
        p.exchange.recv = area.recv;
        p.exchange.launches = area.launches;
        p.exchange.report = area.report;
      } else {
        p.exchange.send[q] = area.recv;
      }
    }
  }

  const DeviceInfo info = SmallestOf(group, device);
  if (info.major < 9) {
    return ffi::Error::InvalidArgument(op + "needs a Hopper or later GPU (TMA bulk copies)" +
                                       (group.ranks > 1 ? " on every tensor rank" : ""));
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
      16, budget > fixed ? (budget - fixed) / (a.chunk_bytes + 8) : 0));
  if (fit < 2) {
    return ffi::Error::InvalidArgument(op + "these shapes leave no shared memory for the weights' "
                                       "ring; use a smaller batch");
  }
  if (a.ring_slots < 0 || a.ring_slots == 1 || a.ring_slots > fit) {
    return ffi::Error::InvalidArgument(op + "ring_slots must be 0 (as many as fit) or 2 to " +
                                       std::to_string(fit) + " at these shapes, got " +
                                       std::to_string(a.ring_slots));
  }
  const int slots = a.ring_slots ? a.ring_slots : fit;
  p.ring_slots = slots;
  size_t at = static_cast<size_t>(slots) * a.chunk_bytes;
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
  launch.shared = at;
  launch.grid = info.sms / ranks;
  if (launch.trace_bytes && launch.grid > kMaxTraceCtas) {
    return ffi::Error::InvalidArgument(op + "a trace holds " + std::to_string(kMaxTraceCtas) +
                                       " CTAs; this GPU has " + std::to_string(info.sms) +
                                       " SMs");
  }
  // The control block (and times, trace) zeroed before the launch.
  JFO_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(base, 0, kControlBytes + (a.stage_times ? kTimesBytes : 0), stream));
  if (launch.trace_bytes) {
    JFO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.trace, 0, launch.trace_bytes, stream));
  }
  return launch;
}

// The test hook jax_flashoverlap.faults.inject_fault, where the build has
// the transport: a fault due now on `device` makes the rank that `stream`
// runs start late ("stall", enqueued here), or not run at all (true).
ffi::ErrorOr<bool> InjectedFault(int device, cudaStream_t stream) {
#ifdef JFO_WITH_CUBLASLT
  int stall_ms = 0;
  const FaultKind kind = TakeFault(TransportId(device), &stall_ms);
  if (kind == FaultKind::kStall) JFO_RETURN_IF_ERROR(Stall(stream, stall_ms));
  return kind == FaultKind::kError || kind == FaultKind::kSkip;
#else
  return false;
#endif
}

ffi::Error SkippedRank(int rank) {
  return ffi::Error::Internal("jax_flashoverlap transformer_decode: injected fault: tensor rank " +
                              std::to_string(rank) + " did not run");
}

ffi::Error TransformerDecodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer pos,
                                 ffi::AnyBuffer rope_frequencies, ffi::AnyBuffer attn_norm,
                                 ffi::AnyBuffer mlp_norm, ffi::AnyBuffer w_qkv,
                                 ffi::AnyBuffer w_out, ffi::AnyBuffer w_gate_up,
                                 ffi::AnyBuffer w_down,
                                 ffi::RemainingArgs caches_in, ffi::Result<ffi::AnyBuffer> x_out,
                                 ffi::Result<ffi::AnyBuffer> workspace,
                                 ffi::RemainingRets caches_out, int32_t heads, int32_t kv_heads,
                                 int32_t max_splits, float eps, int32_t timeout_ms,
                                 int32_t stage_times, int32_t chunk_bytes, int32_t ring_slots,
                                 int32_t options, int32_t emulated_ranks,
                                 I32Span group_ordinals, int32_t n) {
  const Attrs attrs{heads,       kv_heads,    max_splits, eps,     timeout_ms,
                    stage_times, chunk_bytes, ring_slots, options, emulated_ranks};
  if (emulated_ranks < 1 || emulated_ranks > kMaxTensorRanks || (emulated_ranks > 1 && n > 1)) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap transformer_decode: emulated_ranks must be 1 (off) to " +
        std::to_string(kMaxTensorRanks) + " and 1 where the tensor ranks have GPUs of their "
        "own, got " + std::to_string(emulated_ranks) + " (tensor size " + std::to_string(n) +
        ")");
  }
  int device = 0;
  JFO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  TensorGroup group;
  if (n > 1) {
    JFO_ASSIGN_OR_RETURN(group, TensorGroupOf(group_ordinals, n, device));
  }
  if (emulated_ranks > 1) group = EmulatedGroup(0, emulated_ranks, device);
  if (group.ranks > 1) {
    const Ordinals ordinals = OrdinalsOf(group);
    const std::string failed = ExchangeFailures(&ordinals);
    if (!failed.empty()) return ffi::Error::Internal(failed);
  }
  const ffi::AnyBuffer weights[kStages] = {w_qkv, w_out, w_gate_up, w_down};
  RankLaunch launches[kMaxTensorRanks];
  for (int rank = 0; rank < emulated_ranks; ++rank) {
    if (emulated_ranks > 1) group = EmulatedGroup(rank, emulated_ranks, device);
    JFO_ASSIGN_OR_RETURN(launches[rank],
                         PlanRank(stream, device, group, attrs, x, pos, rope_frequencies,
                                  attn_norm, mlp_norm, weights, caches_in, *x_out, *workspace,
                                  caches_out));
  }
  if (emulated_ranks == 1) {
    if (group.ranks > 1) {
      JFO_ASSIGN_OR_RETURN(const bool skip, InjectedFault(device, stream));
      if (skip) return SkippedRank(group.rank);
    }
    const RankLaunch& only = launches[0];
    return Launch(stream, device, only.p, only.grid, only.shared, /*cooperative=*/true);
  }
  // Ranks 1.. on streams of their own, after everything enqueued so far
  // (the control blocks' fills, the caches' copies), and XLA's stream after
  // every rank that was launched, even when a later launch failed (they
  // write into this call's buffers until they end). The ranks poll each
  // other, so they must run side by side: not under CUDA_LAUNCH_BLOCKING or
  // a profiler that serializes kernels (then their polls time out, and the
  // step's outputs are NaN). An injected fault hits the last rank.
  std::lock_guard<std::mutex> one_step(EmulationLock(device));
  JFO_ASSIGN_OR_RETURN(const RankStreams side, RankStreamsOf(device));
  JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(side.start, stream));
  for (int rank = 1; rank < emulated_ranks; ++rank) {
    JFO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side.streams[rank], side.start, 0));
  }
  const int last = emulated_ranks - 1;
  JFO_ASSIGN_OR_RETURN(const bool skip_last, InjectedFault(device, side.streams[last]));
  ffi::Error launched = ffi::Error::Success();
  int side_ranks = 0;  // ranks 1.. launched
  for (int rank = 0; rank < emulated_ranks - skip_last && !launched.failure(); ++rank) {
    const RankLaunch& launch = launches[rank];
    launched = Launch(rank ? side.streams[rank] : stream, device, launch.p, launch.grid,
                      launch.shared, /*cooperative=*/false);
    if (rank && !launched.failure()) side_ranks = rank;
  }
  for (int rank = 1; rank <= side_ranks; ++rank) {
    JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(side.done[rank], side.streams[rank]));
    JFO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, side.done[rank], 0));
  }
  if (skip_last && !launched.failure()) return SkippedRank(last);
  return launched;
}

}  // namespace

std::string TransformerDecodeFailures() { return ExchangeFailures(nullptr); }

std::string ResetTransformerDecode() { return ResetExchangeAreas(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoTransformerDecode, TransformerDecodeImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()
        .Arg<ffi::AnyBuffer>()  // x [batch, d] bf16: the blocks' input
        .Arg<ffi::AnyBuffer>()  // pos: int32 scalar, this token's position
        .Arg<ffi::AnyBuffer>()  // rotary frequencies [head_dim / 2] float32
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
        .Attr<int32_t>("timeout_ms")
        .Attr<int32_t>("stage_times")  // 1: the barriers' times in the workspace; 2: and a trace
        .Attr<int32_t>("chunk_bytes")  // a shared-memory slot of the weights' stream
        .Attr<int32_t>("ring_slots")   // the ring's slots; 0: as many as fit (up to 16)
        .Attr<int32_t>("options")      // kEvictFirstWeights | ... (params.cuh)
        // 1, or the tensor ranks emulated on this GPU, each a launch on a
        // share of the SMs: the weights, caches, x_out and workspace are
        // stacked by rank (first axis), each rank with its heads and units.
        .Attr<int32_t>("emulated_ranks")
        // The tensor ranks' CUDA ordinals ([groups * n], each group by
        // rank; empty at n = 1) and n (jax_flashoverlap.group_call).
        .Attr<I32Span>("group_ordinals")
        .Attr<int32_t>("n"));

}  // namespace jfo
