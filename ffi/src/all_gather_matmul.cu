// AllGather -> GEMM: y = concat_r(x_r) @ w without an exposed gather.
// Rank r multiplies its own shard first (it needs nothing), meanwhile every
// peer's shard arrives chunk by chunk on copy engines; each peer chunk is
// multiplied as soon as its signal landed. The gathered x (the backward
// residual) is assembled by a copy engine alongside.
// Or, with `tile_signalled` (experimental, built with CUTLASS, 2 ranks): the
// peer sends its shard into this rank's receive slot, at its rows of one
// [n*m, K] frame, a copy engine brings the own shard into the frame's other
// rows, and one gathering tile GEMM (tile_gemm.h) runs over the whole frame
// from the own rows on, its load warp waiting (bounded) for each chunk's
// flag before it reads those rows: no GEMM cut per chunk, no XLA-stream wait.
#include <algorithm>

#include "ops_common.h"
#include "tile_gemm.h"
#include "transport/fingerprint.h"

namespace jfo {
namespace {

constexpr OpId kOp = OpId::kAllGatherMatmul;

#ifdef JFO_WITH_CUTLASS
// The tile-signalled schedule (see the top) on `ch`'s two ranks: x [m, K]
// this rank's shard, y [2m, N], gathered [2m, K] or null. Each shard comes
// in `chunks` equal blocks (the GEMM's waits take equal blocks: fewer
// chunks where m does not divide).
ffi::Error TileSignalled(Channel& ch, int64_t m, int64_t cols, int64_t k, const char* x,
                         const void* w, void* y, char* gathered, int chunks) {
  const int n = ch.n(), r = ch.rank(), q = 1 - r;
  const size_t row_x = k * DataTypeBytes(ffi::DataType::BF16);
  chunks = std::min(chunks, RowArrivals::kMaxBlocks / n);
  while (m % chunks != 0) --chunks;
  const int64_t block_rows = m / chunks;
  // The frame: the peer's sends land in its slot at the peer's rows.
  char* frame = ch.RecvSlot(q);
  GatherGemmArgs args;
  args.gemm = {n * m, cols, k, frame, w, y, nullptr};
  // The first whole tile of own rows: a tile that also holds peer rows
  // would wait for the peer's last chunk first.
  args.first_row = (r * m + kTileGemmRows - 1) / kTileGemmRows * kTileGemmRows;
  if (args.first_row >= n * m) args.first_row = 0;
  RowArrivals& arrivals = args.arrivals;
  arrivals.block_rows = static_cast<int32_t>(block_rows);
  arrivals.blocks = n * chunks;
  if (ffi::Error why = CheckGatherGemm(ch.ordinal(), args); why.failure()) {
    return ch.Refuse(std::move(why));
  }
  size_t ws_bytes = 0;
  void* ws = ch.GemmWorkspace(&ws_bytes);
  return ch.Run([&]() -> ffi::Error {
    arrivals.blocks = n * chunks;  // the rehearsal waits for none
    for (int c = 0; c < chunks; ++c) {
      const size_t offset = (r * m + c * block_rows) * row_x;
      auto sent = ch.Send(q, offset, x + c * block_rows * row_x, block_rows * row_x, nullptr);
      if (sent.has_error()) return sent.error();
      auto copied = ch.CopyLocalFlagged(frame + offset, x + c * block_rows * row_x,
                                        block_rows * row_x);
      if (copied.has_error()) return copied.error();
      for (const auto& [rank, wait] :
           {std::pair{r, *copied}, std::pair{q, ch.ArrivalFlag(q, c)}}) {
        const int b = rank * chunks + c;
        arrivals.flag[b] = wait.flag;
        arrivals.expected[b] = wait.expected;
        arrivals.peer_rank[b] = rank;
        arrivals.peer_ordinal[b] = wait.report.info.peer_ordinal;
        arrivals.report = wait.report;  // the same but for the peer's fields
      }
    }
    // The rehearsal launches it once per device, without waits (nothing
    // arrives in a rehearsal), to load the kernel before any call's waits
    // (Channel::Run); the real pass overwrites y.
    if (ch.rehearsal()) arrivals.blocks = 0;
    if (!ch.rehearsal() || FirstTileGemmOn(ch.ordinal(), TileKernel::kGathering)) {
      JFO_RETURN_IF_ERROR(GatherGemm(ch.ordinal(), args, ws, ws_bytes, ch.stream()));
    }
    if (gathered != nullptr) {
      // The residual: the own rows at once, the peer's once the GEMM has
      // read them (so no wait kernel holds an SM beside it). That copy is
      // exposed; forward-only calls ask for no residual.
      JFO_RETURN_IF_ERROR(ch.CopyLocal(gathered + r * m * row_x, x, m * row_x, nullptr));
      auto read = ch.Mark();
      if (read.has_error()) return read.error();
      JFO_RETURN_IF_ERROR(ch.CopyLocal(gathered + q * m * row_x, frame + q * m * row_x,
                                       m * row_x, *read));
    }
    return ffi::Error::Success();
  });
}
#endif  // JFO_WITH_CUTLASS

ffi::Error AllGatherMatmulImpl(cudaStream_t stream, int ordinal,
                               Buffer_Type x, Buffer_Type w, Result_Type y,
                               Result_Type x_gathered, I32Span group_ordinals,
                               int32_t n, int32_t timeout_ms, I32Span order,
                               int32_t chunks, int32_t waits_on_xla_stream,
                               int32_t tile_signalled) {
  auto group = FindGroup(kOp, group_ordinals, n, ordinal);
  if (group.has_error()) return group.error();
  JFO_RETURN_IF_ERROR(CheckCommon(kOp, timeout_ms, chunks));
  JFO_RETURN_IF_ERROR(CheckOrder(kOp, order, n, /*own_first=*/true));
  JFO_RETURN_IF_ERROR(
      CheckSwitch(kOp, "waits_on_xla_stream", waits_on_xla_stream));
  JFO_RETURN_IF_ERROR(CheckSwitch(kOp, "tile_signalled", tile_signalled));
  const auto dtype = x.element_type();
  JFO_RETURN_IF_ERROR(CheckDtypes(kOp, {dtype, w.element_type(),
                                        y->element_type(),
                                        x_gathered->element_type()}));
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0]) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap all_gather_matmul: need x [m, K] and w [K, N], got " +
        DimsToString(x) + " and " + DimsToString(w));
  }
  const int64_t m = xd[0], k = xd[1], cols = wd[1];
  JFO_RETURN_IF_ERROR(CheckInnerDim(kOp, k));
  JFO_RETURN_IF_ERROR(CheckShape(kOp, "y", *y, n * m, cols));
  // x_gathered is the backward pass's residual; a forward-only call asks for
  // none ([0, K]) and saves the copy-engine traffic of assembling it.
  const bool gather = x_gathered->element_count() > 0;
  JFO_RETURN_IF_ERROR(
      CheckShape(kOp, "x_gathered", *x_gathered, gather ? n * m : 0, k));

  Channel ch;
  const uint32_t fingerprint = CallFingerprint(OpName(kOp))
                                  .Buffer("x", x)
                                  .Buffer("w", w)
                                  .Buffer("x_gathered", *x_gathered)
                                  .Option("order", order)
                                  .Option("chunks", chunks)
                                  .Option("tile_signalled", tile_signalled)
                                  .Seal();
  JFO_RETURN_IF_ERROR(ch.Begin(kOp, *group, timeout_ms, stream, fingerprint));
  // Every wait here precedes the XLA-stream GEMM that reads its chunk.
  ch.set_waits_on_xla_stream(waits_on_xla_stream != 0);
  const size_t es = DataTypeBytes(dtype);
  const size_t row_x = k * es, row_y = cols * es;
  const int r = ch.rank();
  const char* xp = static_cast<const char*>(x.untyped_data());
  const void* wp = w.untyped_data();
  char* yp = static_cast<char*>(y->untyped_data());
  char* gp = static_cast<char*>(x_gathered->untyped_data());
  const Channel::Output outs[] = {
      {y->untyped_data(), y->element_count(), dtype},
      {x_gathered->untyped_data(), x_gathered->element_count(), dtype}};
  if (tile_signalled) {
#ifndef JFO_WITH_CUTLASS
    return ch.Refuse(TileGemmNotBuilt("all_gather_matmul", "ALL_GATHER_GEMM"));
#else
    if (dtype != ffi::DataType::BF16 || n != 2) {
      return ch.Refuse(ffi::Error::InvalidArgument(
          "jax_flashoverlap all_gather_matmul: tile_signalled takes bf16 operands on 2 "
          "ranks, got " + std::to_string(n) + " ranks; set cuda_policy.ALL_GATHER_GEMM = "
          "'row_blocks'"));
    }
    JFO_RETURN_IF_ERROR(ch.CheckCapacity(n * m * row_x, 0));
    JFO_RETURN_IF_ERROR(
        TileSignalled(ch, m, cols, k, xp, wp, yp, gather ? gp : nullptr, chunks));
    return ch.End({outs[0], outs[1]});
#endif
  }
  JFO_RETURN_IF_ERROR(ch.CheckCapacity(m * row_x, 0));
  const int* row = order.begin() + r * n;

  JFO_RETURN_IF_ERROR(ch.Run([&]() -> ffi::Error {
    // Push this shard to every peer, chunk by chunk, in schedule order.
    for (int i = 1; i < n; ++i) {
      for (int c = 0; c < chunks; ++c) {
        const Rows p = SplitRows(0, m, chunks, c);
        auto sent = ch.Send(row[i], p.begin * row_x, xp + p.begin * row_x,
                            p.size() * row_x, nullptr);
        if (sent.has_error()) return sent.error();
      }
    }
    if (gather) {
      JFO_RETURN_IF_ERROR(
          ch.CopyLocal(gp + r * m * row_x, xp, m * row_x, nullptr));
    }
    JFO_RETURN_IF_ERROR(
        RowGemm(ch, dtype, m, cols, k, xp, wp, nullptr, yp + r * m * row_y));
    for (int i = 1; i < n; ++i) {
      const int q = row[i];
      const char* slot = ch.RecvSlot(q);
      for (int c = 0; c < chunks; ++c) {
        const Rows p = SplitRows(0, m, chunks, c);
        auto landed = ch.Arrival(q, c);
        if (landed.has_error()) return landed.error();
        JFO_RETURN_IF_ERROR(ch.WaitOn(*landed));
        JFO_RETURN_IF_ERROR(RowGemm(ch, dtype, p.size(), cols, k,
                                    slot + p.begin * row_x, wp, nullptr,
                                    yp + (q * m + p.begin) * row_y));
        if (gather) {
          JFO_RETURN_IF_ERROR(ch.CopyLocal(gp + (q * m + p.begin) * row_x,
                                           slot + p.begin * row_x,
                                           p.size() * row_x, *landed));
        }
      }
    }
    return ffi::Error::Success();
  }));
  return ch.End({outs[0], outs[1]});
}

}  // namespace

JFO_DEFINE_INITIALIZE(JfoAllGatherMatmulInitialize, kOp, FusedOpSetup);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoAllGatherMatmul, AllGatherMatmulImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()         // XLA's stream for this device
        .Ctx<ffi::DeviceOrdinal>()      // local CUDA ordinal
        .Arg<Buffer_Type>()             // x [m, K]: this rank's rows
        .Arg<Buffer_Type>()             // w [K, N]
        .Ret<Buffer_Type>()             // y [n*m, N]
        .Ret<Buffer_Type>()             // x_gathered [n*m, K], or [0, K]
        .Attr<I32Span>("group_ordinals")  // [G*n] CUDA ordinals by rank
        .Attr<int32_t>("n")             // ranks per group
        .Attr<int32_t>("timeout_ms")    // bound of every wait
        .Attr<I32Span>("order")         // [n*n] row r: shards rank r computes
        .Attr<int32_t>("chunks")        // row chunks (signals) per shard
        .Attr<int32_t>("waits_on_xla_stream")  // 1: see Channel::Arrival
        .Attr<int32_t>("tile_signalled"));  // 1: one gathering tile GEMM (see the top)

}  // namespace jfo
