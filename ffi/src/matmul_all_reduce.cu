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
// Or, with `tile_signalled` (experimental, built with CUTLASS): rank r owns
// rows SplitRows(0, m, n, r). One tile GEMM per side of that part computes
// the peers' rows, uncut, and the copy engines send each peer its rows as
// the epilogue's counters complete (Channel::SendWhen); then the own part,
// in the shrinking chunks of chunk_rows, is x w + the peers' partials, each
// chunk sent on to every peer as soon as it is summed, while the next one
// computes. The tail is the last own chunk's all-gather.
#include <algorithm>
#include <array>
#include <vector>

#include "ops_common.h"
#include "tile_gemm.h"
#include "transport/fingerprint.h"

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
      JFO_RETURN_IF_ERROR(CopyOutOnArrival(ch_, q, ag_index_[chunk], y_, p.begin * RowY(),
                                           p.size() * RowY()));
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

#ifdef JFO_WITH_CUTLASS
// The tile-signalled schedule (see the top). Every rank derives what each
// peer sends it from the same layout, so message indices need no exchange.
class TileSignalledAllReduce {
 public:
  TileSignalledAllReduce(Channel& ch, ffi::DataType dtype, int64_t m, int64_t cols,
                         int64_t k, const char* x, const void* w, char* y,
                         std::vector<int64_t> chunk_start)
      : ch_(ch), dtype_(dtype), m_(m), cols_(cols), k_(k), x_(x), w_(w), y_(y),
        row_y_(cols * DataTypeBytes(dtype)),
        product_bytes_((m * row_y_ + 255) / 256 * 256),
        chunk_start_(std::move(chunk_start)) {}

  // Staging: the peers' rows of the product at their own row positions,
  // then the counters of the GEMMs on both sides of the own part.
  size_t StagingBytes() const {
    return product_bytes_ + (TileGemmCounters(m_) + 1) * sizeof(uint32_t);
  }

  // Refuses, before anything is sent, what the tile GEMM cannot run.
  ffi::Error Check() const {
    if (dtype_ != ffi::DataType::BF16) {
      return ch_.Refuse(ffi::Error::InvalidArgument(
          "jax_flashoverlap matmul_all_reduce: tile_signalled takes bf16 operands only"));
    }
    for (const Side& side : Sides(ch_.rank())) {
      if (side.rows.size() == 0) continue;
      if (ffi::Error why = CheckTileGemm(ch_.ordinal(), Gemm(side)); why.failure()) {
        return ch_.Refuse(std::move(why));
      }
    }
    // Checked here, not when a send fails halfway through the call.
    size_t messages = 0;
    for (int j = 1; j < ch_.n(); ++j) {
      messages = std::max(messages, Pieces(ch_.rank(), (ch_.rank() + j) % ch_.n()).size() +
                                        chunk_start_.size() - 1);
    }
    if (messages > static_cast<size_t>(kMaxMessagesPerCall)) {
      return ch_.Refuse(ffi::Error::InvalidArgument(
          "jax_flashoverlap matmul_all_reduce: tile_signalled would send " +
          std::to_string(messages) + " messages to a peer (a row block of " +
          std::to_string(kTileGemmRows) + " rows each), more than " +
          std::to_string(kMaxMessagesPerCall) +
          "; set cuda_policy.MATMUL_ALL_REDUCE_GEMM = 'row_blocks'"));
    }
    return ffi::Error::Success();
  }

  ffi::Error Run() {
    const int n = ch_.n(), r = ch_.rank();
    uint32_t* counters = Counters();
    JFO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
        counters, 0, (TileGemmCounters(m_) + 1) * sizeof(uint32_t), ch_.stream()));
    auto zeroed = ch_.Mark();
    if (zeroed.has_error()) return zeroed.error();
    size_t ws_bytes = 0;
    void* ws = ch_.GemmWorkspace(&ws_bytes);
    for (const Side& side : Sides(r)) {
      if (side.rows.size() == 0) continue;
      // The rehearsal launches one GEMM once per device, to load the kernel
      // before any call's waits (Channel::Run).
      if (ch_.rehearsal() && !FirstTileGemmOn(ch_.ordinal(), TileKernel::kSignalling)) break;
      JFO_RETURN_IF_ERROR(TileGemm(ch_.ordinal(), Gemm(side), ws, ws_bytes, ch_.stream()));
      if (ch_.rehearsal()) break;
    }
    auto tiles_done = ch_.Mark();
    if (tiles_done.has_error()) return tiles_done.error();
    const uint32_t written = TileGemmTilesPerRowBlock(cols_);
    for (int j = 1; j < n; ++j) {
      const int q = (r + j) % n;
      for (const Piece& p : Pieces(r, q)) {
        auto sent = ch_.SendWhen(q, p.rows.begin * row_y_, Product(p.rows.begin),
                                 p.rows.size() * row_y_, *zeroed, p.counter, written);
        if (sent.has_error()) return sent.error();
      }
    }
    const int chunks = static_cast<int>(chunk_start_.size()) - 1;
    for (int c = 0; c < chunks; ++c) {
      JFO_RETURN_IF_ERROR(ReduceOwnChunk(c));
      if (c > 0) JFO_RETURN_IF_ERROR(ReceiveReduced(c - 1, *tiles_done));
    }
    return ReceiveReduced(chunks - 1, *tiles_done);
  }

 private:
  struct Side {
    Rows rows;
    int64_t first_counter;  // its counters' index in Counters()
  };
  // Rows [begin, end) of one GEMM side, sent on when `counter` is complete.
  struct Piece {
    Rows rows;
    const uint32_t* counter;
  };

  Rows Part(int q) const { return SplitRows(0, m_, ch_.n(), q); }
  // The rows after rank `s`'s own part, then those before it: the peers'
  // rows, in the order its GEMMs compute them.
  std::array<Side, 2> Sides(int s) const {
    const Rows own = Part(s);
    const Rows after{own.end, m_}, before{0, own.begin};
    return {Side{after, 0}, Side{before, TileGemmCounters(after.size())}};
  }
  uint32_t* Counters() const {
    return reinterpret_cast<uint32_t*>(ch_.Staging() + product_bytes_);
  }
  char* Product(int64_t row) const { return ch_.Staging() + row * row_y_; }
  TileGemmArgs Gemm(const Side& side) const {
    return {side.rows.size(), cols_, k_, x_ + side.rows.begin * k_ * DataTypeBytes(dtype_),
            w_, Product(side.rows.begin), Counters() + side.first_counter};
  }
  // What rank `s` sends rank `d` of its product: d's part, cut at the
  // counters' row blocks of the side that holds it.
  std::vector<Piece> Pieces(int s, int d) const {
    const Rows part = Part(d);
    const Side side = Sides(s)[d > s ? 0 : 1];
    std::vector<Piece> out;
    for (int64_t g = (part.begin - side.rows.begin) / kTileGemmRows;
         side.rows.begin + g * kTileGemmRows < part.end; ++g) {
      const int64_t block = side.rows.begin + g * kTileGemmRows;
      out.push_back({{std::max(block, part.begin), std::min(block + kTileGemmRows, part.end)},
                     Counters() + side.first_counter + g});
    }
    return out;
  }
  // Rank q's own chunk c: its part cut in chunk_rows' proportions.
  Rows OwnChunk(int q, int c) const {
    const Rows part = Part(q);
    auto at = [&](int i) { return part.begin + part.size() * chunk_start_[i] / m_; };
    return {at(c), at(c + 1)};
  }

  ffi::Error ReduceOwnChunk(int c) {
    const int n = ch_.n(), r = ch_.rank();
    const Rows rows = OwnChunk(r, c);
    char* out = y_ + rows.begin * row_y_;
    // An empty chunk (fewer rows than ranks) still sends its (empty) message.
    if (rows.size() > 0) JFO_RETURN_IF_ERROR(SumOwnChunk(rows, out));
    auto done = ch_.Mark();
    if (done.has_error()) return done.error();
    for (int j = 1; j < n; ++j) {
      auto sent = ch_.Send((r + j) % n, rows.begin * row_y_, out, rows.size() * row_y_, *done);
      if (sent.has_error()) return sent.error();
    }
    return ffi::Error::Success();
  }

  // out = the own rows' x w + the peers' partials of them, once landed.
  // These waits precede the XLA-stream GEMM that reads their messages: on
  // the XLA stream, behind the tile GEMMs, they take none of its SMs.
  ffi::Error SumOwnChunk(const Rows& rows, char* out) {
    const int n = ch_.n(), r = ch_.rank();
    ch_.set_waits_on_xla_stream(true);
    std::vector<const void*> partials;
    for (int j = 1; j < n; ++j) {
      const int q = (r + j) % n;
      // The last of q's pieces that overlaps these rows (they land in order).
      const auto pieces = Pieces(q, r);
      int last = 0;
      while (last + 1 < static_cast<int>(pieces.size()) &&
             pieces[last + 1].rows.begin < rows.end) {
        ++last;
      }
      char* partial = ch_.RecvSlot(q) + rows.begin * row_y_;
      auto landed = ch_.Arrival(q, last, nullptr, {partial, rows.size() * row_y_});
      if (landed.has_error()) return landed.error();
      JFO_RETURN_IF_ERROR(ch_.WaitOn(*landed));
      partials.push_back(partial);
    }
    ch_.set_waits_on_xla_stream(false);
    const void* first = partials.empty() ? nullptr : partials.front();
    JFO_RETURN_IF_ERROR(RowGemm(ch_, dtype_, rows.size(), cols_, k_,
                                x_ + rows.begin * k_ * DataTypeBytes(dtype_), w_, first, out));
    if (partials.size() > 1) {
      partials.erase(partials.begin());
      return AddInto(ch_, dtype_, out, partials, rows.size() * cols_);
    }
    return ffi::Error::Success();
  }

  // Copies each peer's summed chunk c into y once it landed. Only a copy
  // engine reads it, so its wait is on a side stream, from `tiles_done`:
  // not spinning beside the tile GEMMs.
  ffi::Error ReceiveReduced(int c, cudaEvent_t tiles_done) {
    const int n = ch_.n(), r = ch_.rank();
    for (int j = 1; j < n; ++j) {
      const int q = (r + j) % n;
      const Rows rows = OwnChunk(q, c);
      const int index = static_cast<int>(Pieces(q, r).size()) + c;
      JFO_RETURN_IF_ERROR(CopyOutOnArrival(ch_, q, index, y_, rows.begin * row_y_,
                                           rows.size() * row_y_, tiles_done));
    }
    return ffi::Error::Success();
  }

  Channel& ch_;
  ffi::DataType dtype_;
  int64_t m_, cols_, k_;
  const char* x_;
  const void* w_;
  char* y_;
  size_t row_y_, product_bytes_;
  std::vector<int64_t> chunk_start_;  // as AllReduceSchedule's
};
#endif  // JFO_WITH_CUTLASS

ffi::Error MatmulAllReduceImpl(cudaStream_t stream, int ordinal,
                               Buffer_Type x, Buffer_Type w, Result_Type y,
                               I32Span group_ordinals, int32_t n,
                               int32_t timeout_ms, I32Span chunk_rows,
                               int32_t tile_signalled) {
  auto group = FindGroup(kOp, group_ordinals, n, ordinal);
  if (group.has_error()) return group.error();
  JFO_RETURN_IF_ERROR(CheckCommon(kOp, timeout_ms, 1));
  JFO_RETURN_IF_ERROR(CheckSwitch(kOp, "tile_signalled", tile_signalled));
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
  const uint32_t fingerprint = CallFingerprint(OpName(kOp))
                                  .Buffer("x", x)
                                  .Buffer("w", w)
                                  .Option("chunk_rows", chunk_rows)
                                  .Option("tile_signalled", tile_signalled)
                                  .Seal();
  JFO_RETURN_IF_ERROR(ch.Begin(kOp, *group, timeout_ms, stream, fingerprint));
  const size_t bytes = m * cols * DataTypeBytes(dtype);
  if (tile_signalled) {
#ifndef JFO_WITH_CUTLASS
    return ch.Refuse(TileGemmNotBuilt("matmul_all_reduce", "MATMUL_ALL_REDUCE_GEMM"));
#else
    TileSignalledAllReduce schedule(ch, dtype, m, cols, k,
                                    static_cast<const char*>(x.untyped_data()),
                                    w.untyped_data(), static_cast<char*>(y->untyped_data()),
                                    std::move(start));
    JFO_RETURN_IF_ERROR(ch.CheckCapacity(bytes, schedule.StagingBytes()));
    JFO_RETURN_IF_ERROR(schedule.Check());
    JFO_RETURN_IF_ERROR(ch.Run([&] { return schedule.Run(); }));
    return ch.End({{y->untyped_data(), y->element_count(), dtype}});
#endif
  }
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
        .Attr<I32Span>("chunk_rows")    // row count per chunk, sums to m
        .Attr<int32_t>("tile_signalled"));  // 1: tile GEMMs (see the top)

}  // namespace jfo
