// GEMM -> ReduceScatter: y = sum_r x_r[block rank] @ w without a tail.
// Rank r first computes the partial products owned by its peers (schedule
// order), pushing each row chunk to its owner as soon as it is done; its own
// block comes last. Two ways to fold the received partials into it:
//  - as cuBLASLt's C input (beta = 1), chunk by chunk: no extra pass, but each
//    chunk's GEMM waits until that chunk arrived from every peer;
//  - after it (`add_after`): the own GEMM needs nothing and starts at once,
//    then one elementwise pass adds the partials (FlashOverlap's order), so a
//    transfer is exposed only where it outlasts the own block's GEMM.
#include "ops_common.h"

namespace jfo {
namespace {

constexpr OpId kOp = OpId::kMatmulReduceScatter;

ffi::Error MatmulReduceScatterImpl(cudaStream_t stream, int ordinal,
                                   Buffer_Type x, Buffer_Type w, Result_Type y,
                                   I32Span group_ordinals, int32_t n,
                                   int32_t timeout_ms, I32Span order,
                                   int32_t chunks, int32_t add_after,
                                   int32_t waits_on_xla_stream) {
  auto group = FindGroup(kOp, group_ordinals, n, ordinal);
  if (group.has_error()) return group.error();
  JFO_RETURN_IF_ERROR(CheckCommon(kOp, timeout_ms, chunks));
  JFO_RETURN_IF_ERROR(CheckOrder(kOp, order, n, /*own_first=*/false));
  JFO_RETURN_IF_ERROR(CheckSwitch(kOp, "add_after", add_after));
  JFO_RETURN_IF_ERROR(
      CheckSwitch(kOp, "waits_on_xla_stream", waits_on_xla_stream));
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
  JFO_RETURN_IF_ERROR(ch.Begin(kOp, *group, timeout_ms, stream));
  // Every wait here precedes the XLA-stream GEMM or add that reads it.
  ch.set_waits_on_xla_stream(waits_on_xla_stream != 0);
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
        .Attr<int32_t>("waits_on_xla_stream"));  // 1: see Channel::Arrival

}  // namespace jfo
