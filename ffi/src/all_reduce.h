// The all-reduce's kernels and its handler share these: the kernels'
// arguments, their launch shapes and the table of compiled variants. The
// protocols are described where they live: all_reduce.cu (the op),
// all_reduce_flags.cu (one-shot and two-shot), all_reduce_lamport.cu.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops_common.h"
#include "transport/peer_region.h"

namespace jfo {
namespace all_reduce {

// Threads per block: the flag kernels' blocks each stream a chunk over
// NVLink, so more warps keep more stores in flight; the Lamport kernel's
// blocks poll.
constexpr int kFlagThreads = 1024;
constexpr int kLamportThreads = 512;
// kAllReduceMinBlockBytes (transport.h) per block before another block joins
// (up to kArMaxBlocks): few spinning CTAs for small messages. To be measured.
constexpr size_t kMinBlockBytes = kAllReduceMinBlockBytes;
// The Lamport kernel spreads a message over at least this many of its
// kLamportBlocks blocks (the measured split up to 256 KiB), more from
// kMinBlockBytes per block.
constexpr size_t kLamportMinActiveBlocks = 16;
enum Algorithm : int32_t { kOneShot = 0, kTwoShot = 1, kLamport = 2 };

// Two-shot mailboxes: how a rank tells each peer where to store its slice
// of the result. Before its reduce-scatter signal, lane q writes `gather_to`
// (this call's y, which the peers then store into directly, or
// kGatherIntoSlot) into the last bytes of this rank's stripe on peer q.
// After its wait, the peer's lane takes it with an atomic swap to
// kMailboxTaken. A rank whose call failed swaps kMailboxTaken into its own
// mailboxes: finding kMailboxTaken there, it knows that the peer took its y
// and may still be storing into it, so it waits (bounded) for that peer's
// all-gather signal before the kernel ends and XLA may reuse y; a peer that
// comes later finds kMailboxTaken and gives up without touching y.
constexpr unsigned long long kMailboxTaken = 0;
constexpr unsigned long long kGatherIntoSlot = 1;
constexpr size_t kMailboxBytes = 16;  // keeps the stripe's data 16-byte aligned

struct Args {
  const void* x;
  void* y;
  size_t elements;  // N
  size_t chunk;     // elements per block; a multiple of 16 bytes
  size_t slice;     // two-shot: elements per rank within a chunk, likewise
  int n, rank;
  // Two-shot: what this rank's mailboxes on its peers say (see Mailbox).
  unsigned long long gather_to;
  uint64_t timeout_ns;
  // CallFingerprint of this call: a peer's must match before its data is
  // read (after the mailbox in each stripe; in the Lamport block headers).
  uint32_t fingerprint;
  TimeoutRecord info;  // op, rank, ordinal, timeout_ms of a timeout report
  PeerRegion region;
};

__device__ __forceinline__ bool IsPeer(const Args& a, int q) {
  return q < a.n && q != a.rank;
}

using KernelFn = void (*)(Args);

// The compiled variant for a dtype, 16-byte aligned buffers (vector) or not,
// and one-shot / two-shot (FlagKernel) or Lamport (LamportKernel).
KernelFn FlagKernel(ffi::DataType dtype, bool vector, Algorithm algorithm);
KernelFn LamportKernel(ffi::DataType dtype, bool vector);

}  // namespace all_reduce
}  // namespace jfo
