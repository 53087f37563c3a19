// AllGather -> GEMM: y = concat_r(x_r) @ w without an exposed gather.
// Rank r multiplies its own shard first (it needs nothing), meanwhile every
// peer's shard arrives chunk by chunk on copy engines; each peer chunk is
// multiplied as soon as its signal landed. The gathered x (the backward
// residual) is assembled by a copy engine alongside.
#include "ops_common.h"

namespace jfo {
namespace {

constexpr OpId kOp = OpId::kAllGatherMatmul;

ffi::Error AllGatherMatmulImpl(cudaStream_t stream, int ordinal,
                               Buffer_Type x, Buffer_Type w, Result_Type y,
                               Result_Type x_gathered, I32Span group_ordinals,
                               int32_t n, int32_t timeout_ms, I32Span order,
                               int32_t chunks, int32_t waits_on_xla_stream) {
  auto group = FindGroup(kOp, group_ordinals, n, ordinal);
  if (group.has_error()) return group.error();
  JFO_RETURN_IF_ERROR(CheckCommon(kOp, timeout_ms, chunks));
  JFO_RETURN_IF_ERROR(CheckOrder(kOp, order, n, /*own_first=*/true));
  JFO_RETURN_IF_ERROR(
      CheckSwitch(kOp, "waits_on_xla_stream", waits_on_xla_stream));
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
  JFO_RETURN_IF_ERROR(ch.Begin(kOp, *group, timeout_ms, stream));
  // Every wait here precedes the XLA-stream GEMM that reads its chunk.
  ch.set_waits_on_xla_stream(waits_on_xla_stream != 0);
  const size_t es = DataTypeBytes(dtype);
  const size_t row_x = k * es, row_y = cols * es;
  JFO_RETURN_IF_ERROR(ch.CheckCapacity(m * row_x, 0));
  const int r = ch.rank();
  const char* xp = static_cast<const char*>(x.untyped_data());
  const void* wp = w.untyped_data();
  char* yp = static_cast<char*>(y->untyped_data());
  char* gp = static_cast<char*>(x_gathered->untyped_data());
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
  const Channel::Output outs[] = {
      {y->untyped_data(), y->element_count(), dtype},
      {x_gathered->untyped_data(), x_gathered->element_count(), dtype}};
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
        .Attr<int32_t>("waits_on_xla_stream"));  // 1: see Channel::Arrival

}  // namespace jfo
