// GEMM -> ReduceScatter: y = sum_r x_r[block rank] @ w without a tail.
// Rank r first computes the partial products owned by its peers (schedule
// order), pushing each row chunk to its owner as soon as it is done; its own
// block comes last. Two ways to fold the received partials into it:
//  - as cuBLASLt's C input (beta = 1), chunk by chunk: no extra pass, but each
//    chunk's GEMM waits until that chunk arrived from every peer;
//  - after it (`add_after`): the own GEMM needs nothing and starts at once,
//    then one elementwise pass adds the partials (FlashOverlap's order), so a
//    transfer is exposed only where it outlasts the own block's GEMM.
// Or, with `tile_signalled` (experimental, built with CUTLASS): one GEMM over
// all n*m rows, uncut, whose epilogue counts finished tiles per row block of
// kTileGemmRows; each peer's rows go out on the copy engines as their
// counters complete, while later rows compute, then one pass sums the own
// block and the peers' partials into y.
#include <algorithm>
#include <array>
#include <vector>

#include "ops_common.h"
#include "tile_gemm.h"
#include "transport/fingerprint.h"

namespace jfo {
namespace {

constexpr OpId kOp = OpId::kMatmulReduceScatter;

// The tile-signalled schedule (see the top): staging holds the GEMM's [n*m,
// N] product, then its counters. `order_row`: this rank's schedule row.
ffi::Error TileSignalled(Channel& ch, ffi::DataType dtype, int64_t m, int64_t cols,
                         int64_t k, const void* x, const void* w, void* y,
                         const int* order_row) {
#ifndef JFO_WITH_CUTLASS
  return ch.Refuse(TileGemmNotBuilt("matmul_reduce_scatter", "REDUCE_SCATTER_GEMM"));
#else
  if (dtype != ffi::DataType::BF16) {
    return ch.Refuse(ffi::Error::InvalidArgument(
        "jax_flashoverlap matmul_reduce_scatter: tile_signalled takes bf16 operands only"));
  }
  const int n = ch.n(), r = ch.rank();
  const int64_t rows = n * m;
  const size_t row_y = cols * DataTypeBytes(dtype);
  const size_t product_bytes = (rows * row_y + 255) / 256 * 256;
  const int64_t counters = TileGemmCounters(rows);
  JFO_RETURN_IF_ERROR(
      ch.CheckCapacity(m * row_y, product_bytes + counters * sizeof(uint32_t)));
  char* product = ch.Staging();
  auto* counter = reinterpret_cast<uint32_t*>(product + product_bytes);
  size_t ws_bytes = 0;
  void* ws = ch.GemmWorkspace(&ws_bytes);
  const TileGemmArgs gemm{rows, cols, k, x, w, product, counter};
  if (ffi::Error why = CheckTileGemm(ch.ordinal(), gemm); why.failure()) {
    return ch.Refuse(std::move(why));
  }
  const uint32_t written = TileGemmTilesPerRowBlock(cols);
  // Block b in pieces of the counters' row blocks: (counter, first row, end
  // row). The same pieces on every rank, so each peer expects what it gets.
  auto pieces = [&](int b) {
    std::vector<std::array<int64_t, 3>> out;
    for (int64_t g = b * m / kTileGemmRows; g * kTileGemmRows < (b + 1) * m; ++g) {
      out.push_back({g, std::max<int64_t>(g * kTileGemmRows, b * m),
                     std::min<int64_t>((g + 1) * kTileGemmRows, (b + 1) * m)});
    }
    return out;
  };
  const int received = static_cast<int>(pieces(r).size());
  return ch.Run([&]() -> ffi::Error {
    JFO_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(counter, 0, counters * sizeof(uint32_t), ch.stream()));
    auto zeroed = ch.Mark();
    if (zeroed.has_error()) return zeroed.error();
    // The GEMM before the sends' counter waits (Channel::SendWhen). The
    // rehearsal launches it once per device: that first launch may load the
    // kernel, which must come before any call's waits (Channel::Run).
    if (!ch.rehearsal() || FirstTileGemmOn(ch.ordinal(), TileKernel::kSignalling)) {
      JFO_RETURN_IF_ERROR(TileGemm(ch.ordinal(), gemm, ws, ws_bytes, ch.stream()));
    }
    for (int i = 0; i + 1 < n; ++i) {
      const int b = order_row[i];
      for (const auto& [g, begin, end] : pieces(b)) {
        auto sent = ch.SendWhen(b, (begin - b * m) * row_y, product + begin * row_y,
                                (end - begin) * row_y, *zeroed, counter + g, written);
        if (sent.has_error()) return sent.error();
      }
    }
    std::vector<const void*> partials;
    for (int i = 0; i + 1 < n; ++i) {
      const int q = order_row[i];
      // A peer's messages land in order (one send stream, flags are epochs).
      auto landed = ch.Arrival(q, received - 1);
      if (landed.has_error()) return landed.error();
      JFO_RETURN_IF_ERROR(ch.WaitOn(*landed));
      partials.push_back(ch.RecvSlot(q));
    }
    return SumInto(ch, dtype, y, product + r * m * row_y, partials, m * cols);
  });
#endif
}

ffi::Error MatmulReduceScatterImpl(cudaStream_t stream, int ordinal,
                                   Buffer_Type x, Buffer_Type w, Result_Type y,
                                   I32Span group_ordinals, int32_t n,
                                   int32_t timeout_ms, I32Span order,
                                   int32_t chunks, int32_t add_after,
                                   int32_t waits_on_xla_stream, int32_t tile_signalled) {
  auto group = FindGroup(kOp, group_ordinals, n, ordinal);
  if (group.has_error()) return group.error();
  JFO_RETURN_IF_ERROR(CheckCommon(kOp, timeout_ms, chunks));
  JFO_RETURN_IF_ERROR(CheckOrder(kOp, order, n, /*own_first=*/false));
  JFO_RETURN_IF_ERROR(CheckSwitch(kOp, "add_after", add_after));
  JFO_RETURN_IF_ERROR(
      CheckSwitch(kOp, "waits_on_xla_stream", waits_on_xla_stream));
  JFO_RETURN_IF_ERROR(CheckSwitch(kOp, "tile_signalled", tile_signalled));
  const auto dtype = x.element_type();
  JFO_RETURN_IF_ERROR(
      CheckDtypes(kOp, {dtype, w.element_type(), y->element_type()}));
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || xd[0] % n != 0) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap matmul_reduce_scatter: need x [n*m, K] with n = " +
        std::to_string(n) + " and w [K, N], got " + DimsToString(x) +
        " and " + DimsToString(w));
  }
  const int64_t m = xd[0] / n, k = xd[1], cols = wd[1];
  JFO_RETURN_IF_ERROR(CheckInnerDim(kOp, k));
  JFO_RETURN_IF_ERROR(CheckShape(kOp, "y", *y, m, cols));

  Channel ch;
  const uint32_t fingerprint = CallFingerprint(OpName(kOp))
                                  .Buffer("x", x)
                                  .Buffer("w", w)
                                  .Option("order", order)
                                  .Option("chunks", chunks)
                                  .Option("add_after", add_after)
                                  .Option("tile_signalled", tile_signalled)
                                  .Seal();
  JFO_RETURN_IF_ERROR(ch.Begin(kOp, *group, timeout_ms, stream, fingerprint));
  // Every wait here precedes the XLA-stream GEMM or add that reads it.
  ch.set_waits_on_xla_stream(waits_on_xla_stream != 0);
  if (tile_signalled) {
    JFO_RETURN_IF_ERROR(TileSignalled(ch, dtype, m, cols, k, x.untyped_data(),
                                      w.untyped_data(), y->untyped_data(),
                                      order.begin() + ch.rank() * n));
    return ch.End({{y->untyped_data(), y->element_count(), dtype}});
  }
  const size_t es = DataTypeBytes(dtype);
  const size_t row_x = k * es, row_y = cols * es;
  // Staging holds the partial for each peer, by position in the schedule.
  JFO_RETURN_IF_ERROR(ch.CheckCapacity(m * row_y, (n - 1) * m * row_y));
  const int r = ch.rank();
  const char* xp = static_cast<const char*>(x.untyped_data());
  const void* wp = w.untyped_data();
  char* yp = static_cast<char*>(y->untyped_data());
  char* staging = ch.Staging();
  const int* row = order.begin() + r * n;

  JFO_RETURN_IF_ERROR(ch.Run([&]() -> ffi::Error {
    for (int i = 0; i + 1 < n; ++i) {
      const int b = row[i];
      for (int c = 0; c < chunks; ++c) {
        const Rows p = SplitRows(0, m, chunks, c);
        char* part = staging + (i * m + p.begin) * row_y;
        JFO_RETURN_IF_ERROR(RowGemm(ch, dtype, p.size(), cols, k,
                                    xp + (b * m + p.begin) * row_x, wp,
                                    nullptr, part));
        auto done = ch.Mark();
        if (done.has_error()) return done.error();
        auto sent =
            ch.Send(b, p.begin * row_y, part, p.size() * row_y, *done);
        if (sent.has_error()) return sent.error();
      }
    }
    const std::vector<int> peers(row, row + n - 1);
    if (add_after) {
      JFO_RETURN_IF_ERROR(RowGemm(ch, dtype, m, cols, k, xp + r * m * row_x,
                                  wp, nullptr, yp));
      std::vector<const void*> partials;
      for (int q : peers) {
        // A peer's messages land in order (one send stream, flags are
        // epochs), so its last chunk implies the others.
        auto landed = ch.Arrival(q, chunks - 1);
        if (landed.has_error()) return landed.error();
        JFO_RETURN_IF_ERROR(ch.WaitOn(*landed));
        partials.push_back(ch.RecvSlot(q));
      }
      return AddInto(ch, dtype, yp, partials, m * cols);
    }
    // Own block last, each chunk summed with the peers' partials.
    for (int c = 0; c < chunks; ++c) {
      const Rows p = SplitRows(0, m, chunks, c);
      JFO_RETURN_IF_ERROR(GemmPlusPartials(
          ch, dtype, p.size(), cols, k, xp + (r * m + p.begin) * row_x, wp,
          yp + p.begin * row_y, peers, c, p.begin * row_y));
    }
    return ffi::Error::Success();
  }));
  return ch.End({{y->untyped_data(), y->element_count(), dtype}});
}

}  // namespace

JFO_DEFINE_INITIALIZE(JfoMatmulReduceScatterInitialize, kOp, FusedOpSetup);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoMatmulReduceScatter, MatmulReduceScatterImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()         // XLA's stream for this device
        .Ctx<ffi::DeviceOrdinal>()      // local CUDA ordinal
        .Arg<Buffer_Type>()             // x [n*m, K]: block b for rank b
        .Arg<Buffer_Type>()             // w [K, N]
        .Ret<Buffer_Type>()             // y [m, N]: this rank's summed block
        .Attr<I32Span>("group_ordinals")  // [G*n] CUDA ordinals by rank
        .Attr<int32_t>("n")             // ranks per group
        .Attr<int32_t>("timeout_ms")    // bound of every wait
        .Attr<I32Span>("order")         // [n*n] row r: blocks, own block last
        .Attr<int32_t>("chunks")        // row chunks (signals) per block
        .Attr<int32_t>("add_after")     // 1: add the partials after the own GEMM
        .Attr<int32_t>("waits_on_xla_stream")  // 1: see Channel::Arrival
        .Attr<int32_t>("tile_signalled"));  // 1: one tile GEMM (see the top)

}  // namespace jfo
