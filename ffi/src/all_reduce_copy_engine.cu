// All-reduce of one buffer as a two-shot on the copy engines, for large
// messages. The one-kernel two-shot (all_reduce.cu) moves every byte with SM
// stores: on 2 H200s its pattern took 103 us for 32 MiB each way, where the
// copy engines moved the same bytes in 90.2 (scripts/nvlink_probe.cu,
// nvlink_probe_2xh200.json). Not one kernel: it records events and uses the
// transport's side streams, so XLA cannot capture it in a command buffer.
//
// The message is cut into `chunks` equal chunks and each chunk into n parts;
// rank q owns part q of every chunk.
//   reduce-scatter: at the call start, every chunk's part q is copied from x
//     into rank q's receive slot (one copy-engine queue per peer, in chunk
//     order);
//   own part: as each chunk's parts arrive, y = the ranks' parts summed in
//     rank order in float32 (one kernel on XLA's stream), then copied to
//     every peer's slot;
//   all-gather: each peer's reduced part is copied from the slot into y.
// Chunk i's sum and sends overlap chunk i+1's arrival. Every part is summed
// once, by its owner, so every rank holds the same bits.
#include <algorithm>

#include "handlers.h"
#include "ops_common.h"
#include "transport/fingerprint.h"

namespace jfo {
namespace {

constexpr OpId kOp = OpId::kAllReduceCopyEngine;

class CopyEngineSchedule {
 public:
  CopyEngineSchedule(Channel& ch, ffi::DataType dtype, const char* x, char* y,
                     int64_t elements, int chunks)
      : ch_(ch), dtype_(dtype), x_(x), y_(y), elements_(elements),
        chunks_(chunks), es_(DataTypeBytes(dtype)),
        rs_index_(chunks), ag_index_(chunks) {}

  ffi::Error Run() {
    for (int i = 0; i < chunks_; ++i) {
      for (int j = 1; j < ch_.n(); ++j) {
        const int q = Peer(j);
        const Rows p = Part(i, q);
        auto index = ch_.Send(q, p.begin * es_, x_ + p.begin * es_,
                              p.size() * es_, nullptr);
        if (index.has_error()) return index.error();
        rs_index_[i] = *index;
      }
    }
    for (int i = 0; i < chunks_; ++i) JFO_RETURN_IF_ERROR(ReduceOwnPart(i));
    for (int i = 0; i < chunks_; ++i) JFO_RETURN_IF_ERROR(ReceiveReduced(i));
    return ffi::Error::Success();
  }

 private:
  // Part q of chunk i, in elements; interior bounds on 16-byte boundaries.
  Rows Part(int chunk, int q) const {
    const int64_t align = std::max<int64_t>(1, 16 / static_cast<int64_t>(es_));
    const int64_t parts = static_cast<int64_t>(chunks_) * ch_.n();
    const int64_t k = static_cast<int64_t>(chunk) * ch_.n() + q;
    auto bound = [&](int64_t i) {
      return i == parts ? elements_ : elements_ * i / parts / align * align;
    };
    return {bound(k), bound(k + 1)};
  }
  int Peer(int j) const { return (ch_.rank() + j) % ch_.n(); }

  ffi::Error ReduceOwnPart(int chunk) {
    const Rows p = Part(chunk, ch_.rank());
    const size_t offset = p.begin * es_;
    std::vector<const void*> ranks(ch_.n());
    for (int r = 0; r < ch_.n(); ++r) {
      if (r == ch_.rank()) {
        ranks[r] = x_ + offset;
        continue;
      }
      char* part = ch_.RecvSlot(r) + offset;
      auto landed = ch_.Arrival(r, rs_index_[chunk], nullptr, {part, p.size() * es_});
      if (landed.has_error()) return landed.error();
      JFO_RETURN_IF_ERROR(ch_.WaitOn(*landed));
      ranks[r] = part;
    }
    const void* first = ranks.front();
    ranks.erase(ranks.begin());
    JFO_RETURN_IF_ERROR(SumInto(ch_, dtype_, y_ + offset, first, ranks, p.size()));
    auto done = ch_.Mark();
    if (done.has_error()) return done.error();
    for (int j = 1; j < ch_.n(); ++j) {
      auto index = ch_.Send(Peer(j), offset, y_ + offset, p.size() * es_, *done);
      if (index.has_error()) return index.error();
      ag_index_[chunk] = *index;
    }
    return ffi::Error::Success();
  }

  ffi::Error ReceiveReduced(int chunk) {
    for (int j = 1; j < ch_.n(); ++j) {
      const int q = Peer(j);
      const Rows p = Part(chunk, q);
      JFO_RETURN_IF_ERROR(
          CopyOutOnArrival(ch_, q, ag_index_[chunk], y_, p.begin * es_, p.size() * es_));
    }
    return ffi::Error::Success();
  }

  Channel& ch_;
  ffi::DataType dtype_;
  const char* x_;
  char* y_;
  int64_t elements_;
  int chunks_;
  size_t es_;
  std::vector<int> rs_index_, ag_index_;  // message index of each chunk
};

ffi::Error AllReduceCopyEngineImpl(cudaStream_t stream, int ordinal,
                                   Buffer_Type x, Result_Type y,
                                   I32Span group_ordinals, int32_t n,
                                   int32_t timeout_ms, int32_t chunks) {
  auto group = FindGroup(kOp, group_ordinals, n, ordinal);
  if (group.has_error()) return group.error();
  // One chunk records 2(n-1)+1 events: at most 64 chunks stay inside the
  // per-call budget up to 8 ranks.
  JFO_RETURN_IF_ERROR(CheckCommon(kOp, timeout_ms, chunks));
  const auto dtype = x.element_type();
  JFO_RETURN_IF_ERROR(CheckDtypes(kOp, {dtype, y->element_type()}));
  const int64_t elements = static_cast<int64_t>(x.element_count());
  if (static_cast<int64_t>(y->element_count()) != elements) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap all_reduce (copy engines): x " + DimsToString(x) +
        " and y " + DimsToString(*y) + " differ in size");
  }
  if (elements == 0) return ffi::Error::Success();

  Channel ch;
  const uint32_t fingerprint = CallFingerprint(OpName(kOp))
                                  .Option("dtype", static_cast<int>(dtype))
                                  .Option("elements", elements)
                                  .Option("chunks", chunks)
                                  .Seal();
  JFO_RETURN_IF_ERROR(ch.Begin(kOp, *group, timeout_ms, stream, fingerprint));
  // Each peer's parts land at their own offsets: a slot holds the message.
  JFO_RETURN_IF_ERROR(ch.CheckCapacity(elements * DataTypeBytes(dtype), 0));
  CopyEngineSchedule schedule(ch, dtype, static_cast<const char*>(x.untyped_data()),
                              static_cast<char*>(y->untyped_data()), elements, chunks);
  JFO_RETURN_IF_ERROR(ch.Run([&] { return schedule.Run(); }));
  return ch.End({{y->untyped_data(), y->element_count(), dtype}});
}

}  // namespace

JFO_DEFINE_INITIALIZE(JfoAllReduceCopyEngineInitialize, kOp, FusedOpSetup);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoAllReduceCopyEngine, AllReduceCopyEngineImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()           // XLA's stream for this device
        .Ctx<ffi::DeviceOrdinal>()        // local CUDA ordinal
        .Arg<Buffer_Type>()               // x: any shape, read as flat
        .Ret<Buffer_Type>()               // y: x's shape, the sum over ranks
        .Attr<I32Span>("group_ordinals")  // [G*n] CUDA ordinals by rank
        .Attr<int32_t>("n")               // ranks per group
        .Attr<int32_t>("timeout_ms")      // bound of every wait
        .Attr<int32_t>("chunks"));        // pipeline depth, 1..64

}  // namespace jfo
