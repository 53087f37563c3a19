// Pieces shared by the handlers: the initialize stage, attribute
// validation, and for the three fused GEMM+collective ops the row split of
// chunked schedules and the GEMM / add calls on the channel's workspace.
#pragma once

#include <initializer_list>
#include <utility>

#include "gemm.h"
#include "transport/transport.h"

namespace jfo {

// Initialize stage of every op: per-device workspace, peer access and the
// group rendezvous, all outside the execute stage, then the op's own
// `setup(ordinal)` (loading its kernels, see Channel::Run on lazy loading).
using OpSetup = ffi::Error (*)(int ordinal);
ffi::Error OpInitialize(OpId op, OpSetup setup, int ordinal,
                        ffi::Dictionary attrs);
// The fused GEMM ops' setup: their helper kernels and the cuBLASLt handle.
ffi::Error FusedOpSetup(int ordinal);

#define JFO_DEFINE_INITIALIZE(symbol, op, setup)                       \
  static ffi::Error symbol##Impl(int ordinal, ffi::Dictionary attrs) { \
    return OpInitialize(op, setup, ordinal, std::move(attrs));         \
  }                                                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                       \
      symbol, symbol##Impl,                                            \
      ffi::Ffi::BindInitialize()                                       \
          .Ctx<ffi::DeviceOrdinal>() /* ordinal */                     \
          .Attrs() /* group_ordinals, n, timeout_ms, ... */)

// K, the GEMM's inner dimension, is at least 1: cuBLASLt has no layout for
// an empty one, and an error in the call would be a fault (the same on every
// rank, so refused before the call starts).
ffi::Error CheckInnerDim(OpId op, int64_t k);

// Same floating dtype for every operand, one of bf16/f16/f32.
ffi::Error CheckDtypes(OpId op, std::initializer_list<ffi::DataType> types);
// Shape check with the offending shapes in the message.
ffi::Error CheckShape(OpId op, const char* name, const Buffer_Type& b,
                      int64_t rows, int64_t cols);
// `order` is [n*n]; row r is a permutation of 0..n-1 with r first
// (own_first) or last.
ffi::Error CheckOrder(OpId op, I32Span order, int n, bool own_first);
ffi::Error CheckCommon(OpId op, int32_t timeout_ms, int32_t chunks);
// A 0/1 switch attribute `name`.
ffi::Error CheckSwitch(OpId op, const char* name, int32_t value);

// Rows [begin, end) of a row-major matrix.
struct Rows {
  int64_t begin, end;
  int64_t size() const { return end - begin; }
};

// Part `i` of `parts` near-equal parts of rows [first, first + total).
inline Rows SplitRows(int64_t first, int64_t total, int64_t parts, int64_t i) {
  return {first + total * i / parts, first + total * (i + 1) / parts};
}

// Row-major GEMM of `rows` rows: D = X W (+ C) with leading dims of the
// full matrices; the channel supplies the cuBLASLt workspace.
ffi::Error RowGemm(Channel& ch, ffi::DataType dtype, int64_t rows, int64_t n,
                   int64_t k, const void* x, const void* w, const void* c,
                   void* d);
// out = x w + sum over `peers` of their message `index`, read at byte
// `offset` of their receive slots. The first partial is cuBLASLt's C input
// (beta = 1, no extra pass); further ones (n > 2) are added after.
ffi::Error GemmPlusPartials(Channel& ch, ffi::DataType dtype, int64_t rows,
                            int64_t n, int64_t k, const void* x, const void* w,
                            void* out, const std::vector<int>& peers,
                            int index, size_t offset);
// d[i] += sum_j srcs[j][i] for i < elements, on the channel's XLA stream.
ffi::Error AddInto(Channel& ch, ffi::DataType dtype, void* d,
                   const std::vector<const void*>& srcs, size_t elements);
// Copies bytes [offset, offset + bytes) of `peer_rank`'s receive slot to the
// same bytes of `dst` on a copy engine, once its message `index` landed
// (Channel::Arrival, its wait from `after`).
ffi::Error CopyOutOnArrival(Channel& ch, int peer_rank, int index, char* dst, size_t offset,
                            size_t bytes, cudaEvent_t after = nullptr);
// d[i] = first[i] + sum_j srcs[j][i] (first may be d), the same way.
ffi::Error SumInto(Channel& ch, ffi::DataType dtype, void* d, const void* first,
                   const std::vector<const void*>& srcs, size_t elements);

}  // namespace jfo
