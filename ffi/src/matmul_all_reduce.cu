// GEMM -> AllReduce with a small tail. Rows are processed in chunks of
// decreasing size (attribute chunk_rows). Each chunk is reduce-scattered
// (rank q owns part q of the chunk's rows) and then all-gathered:
//   S(i): compute the parts of chunk i that peers own, push each to its owner;
//   O(i): own part = x w + the peers' partials (cuBLASLt C input), push the
//         reduced part to every peer, which copies it into its y.
// The GEMM stream runs S(0), S(1), O(0), S(2), O(1), ..., O(C-1): a partial
// is needed one step after it was computed, so its transfer hides behind
// S(i+1); what remains after the last GEMM is the all-gather of the last
// (smallest) chunk's part.
#include "ops_common.h"

namespace jfo {
namespace {

constexpr OpId kOp = OpId::kMatmulAllReduce;

class AllReduceSchedule {
 public:
  AllReduceSchedule(Channel& ch, ffi::DataType dtype, const char* x,
                    const void* w, char* y, int64_t k, int64_t cols,
                    std::vector<int64_t> chunk_start)
      : ch_(ch), dtype_(dtype), x_(x), w_(w), y_(y), k_(k), cols_(cols),
        es_(DataTypeBytes(dtype)), start_(std::move(chunk_start)),
        rs_index_(start_.size()), ag_index_(start_.size()) {}

  ffi::Error Run() {
    const int chunks = static_cast<int>(start_.size()) - 1;
    JFO_RETURN_IF_ERROR(SendPartials(0));
    for (int i = 0; i < chunks; ++i) {
      if (i + 1 < chunks) JFO_RETURN_IF_ERROR(SendPartials(i + 1));
      JFO_RETURN_IF_ERROR(ReduceOwnPart(i));
      // Waits are issued in message order: RS(i) above, then AG(i - 1).
      if (i > 0) JFO_RETURN_IF_ERROR(ReceiveReduced(i - 1));
    }
    return ReceiveReduced(chunks - 1);
  }

 private:
  Rows Part(int chunk, int q) const {
    return SplitRows(start_[chunk], start_[chunk + 1] - start_[chunk], ch_.n(),
                     q);
  }
  int Peer(int j) const { return (ch_.rank() + j) % ch_.n(); }
  size_t RowX() const { return k_ * es_; }
  size_t RowY() const { return cols_ * es_; }

  ffi::Error SendPartials(int chunk) {
    char* staging = ch_.Staging();
    for (int j = 1; j < ch_.n(); ++j) {
      const int q = Peer(j);
      const Rows p = Part(chunk, q);
      char* out = staging + p.begin * RowY();
      JFO_RETURN_IF_ERROR(RowGemm(ch_, dtype_, p.size(), cols_, k_,
                                  x_ + p.begin * RowX(), w_, nullptr, out));
      auto done = ch_.Mark();
      if (done.has_error()) return done.error();
      auto index = ch_.Send(q, p.begin * RowY(), out,
                            p.size() * RowY(), *done);
      if (index.has_error()) return index.error();
      rs_index_[chunk] = *index;
    }
    return ffi::Error::Success();
  }

  ffi::Error ReduceOwnPart(int chunk) {
    const Rows p = Part(chunk, ch_.rank());
    std::vector<int> peers;
    for (int j = 1; j < ch_.n(); ++j) peers.push_back(Peer(j));
    char* out = y_ + p.begin * RowY();
    JFO_RETURN_IF_ERROR(GemmPlusPartials(ch_, dtype_, p.size(), cols_, k_,
                                         x_ + p.begin * RowX(), w_, out, peers,
                                         rs_index_[chunk], p.begin * RowY()));
    auto done = ch_.Mark();
    if (done.has_error()) return done.error();
    for (int j = 1; j < ch_.n(); ++j) {
      auto index =
          ch_.Send(Peer(j), p.begin * RowY(), out, p.size() * RowY(), *done);
      if (index.has_error()) return index.error();
      ag_index_[chunk] = *index;
    }
    return ffi::Error::Success();
  }

  ffi::Error ReceiveReduced(int chunk) {
    for (int j = 1; j < ch_.n(); ++j) {
      const int q = Peer(j);
      const Rows p = Part(chunk, q);
      auto landed = ch_.Arrival(q, ag_index_[chunk]);
      if (landed.has_error()) return landed.error();
      JFO_RETURN_IF_ERROR(ch_.CopyLocal(y_ + p.begin * RowY(),
                                        ch_.RecvSlot(q) + p.begin * RowY(),
                                        p.size() * RowY(), *landed));
    }
    return ffi::Error::Success();
  }

  Channel& ch_;
  ffi::DataType dtype_;
  const char* x_;
  const void* w_;
  char* y_;
  int64_t k_, cols_;
  size_t es_;
  std::vector<int64_t> start_;  // chunk c is rows [start_[c], start_[c+1])
  std::vector<int> rs_index_, ag_index_;  // message index of each chunk
};

ffi::Error MatmulAllReduceImpl(cudaStream_t stream, int ordinal,
                               Buffer_Type x, Buffer_Type w, Result_Type y,
                               I32Span group_ordinals, int32_t n,
                               int32_t timeout_ms, I32Span chunk_rows) {
  auto group = FindGroup(kOp, group_ordinals, n, ordinal);
  if (group.has_error()) return group.error();
  JFO_RETURN_IF_ERROR(CheckCommon(kOp, timeout_ms, 1));
  const auto dtype = x.element_type();
  JFO_RETURN_IF_ERROR(
      CheckDtypes(kOp, {dtype, w.element_type(), y->element_type()}));
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0]) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap matmul_all_reduce: need x [m, K] and w [K, N], got " +
        DimsToString(x) + " and " + DimsToString(w));
  }
  const int64_t m = xd[0], k = xd[1], cols = wd[1];
  JFO_RETURN_IF_ERROR(CheckInnerDim(kOp, k));
  JFO_RETURN_IF_ERROR(CheckShape(kOp, "y", *y, m, cols));
  std::vector<int64_t> start = {0};
  bool positive = chunk_rows.size() > 0;
  for (int32_t rows : chunk_rows) {
    positive = positive && rows >= 1;
    start.push_back(start.back() + rows);
  }
  if (!positive || start.back() != m) {
    std::string sizes;
    for (int32_t rows : chunk_rows) sizes += " " + std::to_string(rows);
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap matmul_all_reduce: chunk_rows [" + sizes +
        " ] must be positive and sum to m = " + std::to_string(m));
  }

  Channel ch;
  JFO_RETURN_IF_ERROR(ch.Begin(kOp, *group, timeout_ms, stream));
  const size_t bytes = m * cols * DataTypeBytes(dtype);
  JFO_RETURN_IF_ERROR(ch.CheckCapacity(bytes, bytes));
  AllReduceSchedule schedule(
      ch, dtype, static_cast<const char*>(x.untyped_data()), w.untyped_data(),
      static_cast<char*>(y->untyped_data()), k, cols, std::move(start));
  JFO_RETURN_IF_ERROR(ch.Run([&] { return schedule.Run(); }));
  return ch.End({{y->untyped_data(), y->element_count(), dtype}});
}

}  // namespace

JFO_DEFINE_INITIALIZE(JfoMatmulAllReduceInitialize, kOp, FusedOpSetup);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoMatmulAllReduce, MatmulAllReduceImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()         // XLA's stream for this device
        .Ctx<ffi::DeviceOrdinal>()      // local CUDA ordinal
        .Arg<Buffer_Type>()             // x [m, K]
        .Arg<Buffer_Type>()             // w [K, N]
        .Ret<Buffer_Type>()             // y [m, N]: sum over ranks of x @ w
        .Attr<I32Span>("group_ordinals")  // [G*n] CUDA ordinals by rank
        .Attr<int32_t>("n")             // ranks per group
        .Attr<int32_t>("timeout_ms")    // bound of every wait
        .Attr<I32Span>("chunk_rows"));  // row count per chunk, sums to m

}  // namespace jfo
