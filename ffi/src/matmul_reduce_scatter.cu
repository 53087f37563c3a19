// GEMM -> ReduceScatter: y = sum_r x_r[block rank] @ w without a tail.
// Rank r first computes the partial products owned by its peers (schedule
// order), pushing each row chunk to its owner as soon as it is done; its own
// block comes last and folds the received partials into the GEMM through
// cuBLASLt's C input (beta = 1), chunk by chunk, so nothing but (for n > 2)
// a small add of the remaining partials follows the last GEMM.
#include "ops_common.h"

namespace jfo {
namespace {

constexpr OpId kOp = OpId::kMatmulReduceScatter;

ffi::Error MatmulReduceScatterImpl(cudaStream_t stream, int ordinal,
                                   Buffer_Type x, Buffer_Type w, Result_Type y,
                                   I32Span group_ordinals, int32_t n,
                                   int32_t timeout_ms, I32Span order,
                                   int32_t chunks) {
  auto group = FindGroup(kOp, group_ordinals, n, ordinal);
  if (group.has_error()) return group.error();
  JFO_RETURN_IF_ERROR(CheckCommon(kOp, timeout_ms, chunks));
  JFO_RETURN_IF_ERROR(CheckOrder(kOp, order, n, /*own_first=*/false));
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
  JFO_RETURN_IF_ERROR(CheckShape(kOp, "y", *y, m, cols));

  Channel ch;
  JFO_RETURN_IF_ERROR(ch.Begin(kOp, *group, timeout_ms, stream));
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

  for (int i = 0; i + 1 < n; ++i) {
    const int b = row[i];
    for (int c = 0; c < chunks; ++c) {
      const int64_t r0 = SplitStart(m, chunks, c), r1 = SplitStart(m, chunks, c + 1);
      char* part = staging + (i * m + r0) * row_y;
      JFO_RETURN_IF_ERROR(RowGemm(ch, dtype, r1 - r0, cols, k,
                                  xp + (b * m + r0) * row_x, wp, nullptr, part));
      auto done = ch.Mark();
      if (done.has_error()) return done.error();
      auto sent = ch.Send(b, r0 * row_y, part, (r1 - r0) * row_y, *done);
      if (sent.has_error()) return sent.error();
    }
  }
  // Own block: y_c = x_c w + partial of the first peer (C input), then the
  // partials of any further peers.
  for (int c = 0; c < chunks; ++c) {
    const int64_t r0 = SplitStart(m, chunks, c), r1 = SplitStart(m, chunks, c + 1);
    std::vector<const void*> rest;
    const void* fused = nullptr;
    for (int i = 0; i + 1 < n; ++i) {
      auto landed = ch.Arrival(row[i], c);
      if (landed.has_error()) return landed.error();
      JFO_RETURN_IF_ERROR(ch.WaitOn(*landed));
      const char* partial = ch.RecvSlot(row[i]) + r0 * row_y;
      if (fused == nullptr) {
        fused = partial;
      } else {
        rest.push_back(partial);
      }
    }
    JFO_RETURN_IF_ERROR(RowGemm(ch, dtype, r1 - r0, cols, k,
                                xp + (r * m + r0) * row_x, wp, fused,
                                yp + r0 * row_y));
    if (!rest.empty()) {
      JFO_RETURN_IF_ERROR(AddInto(ch, dtype, yp + r0 * row_y, rest,
                                  (r1 - r0) * cols));
    }
  }
  return ch.End({{y->untyped_data(), y->element_count(), dtype}});
}

}  // namespace

JFO_DEFINE_INITIALIZE(JfoMatmulReduceScatterInitialize, kOp);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoMatmulReduceScatter, MatmulReduceScatterImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()         // XLA's stream for this device
        .Ctx<ffi::DeviceOrdinal>()      // local CUDA ordinal
        .Arg<Buffer_Type>()             // x [n*m, K]: row block b goes to rank b
        .Arg<Buffer_Type>()             // w [K, N]
        .Ret<Buffer_Type>()             // y [m, N]: this rank's summed block
        .Attr<I32Span>("group_ordinals")  // [G*n] CUDA ordinals by rank
        .Attr<int32_t>("n")             // ranks per group
        .Attr<int32_t>("timeout_ms")    // bound of every wait
        .Attr<I32Span>("order")         // [n*n] row r: blocks, own block last
        .Attr<int32_t>("chunks"));      // row chunks (signals) per block

}  // namespace jfo
