// The symmetric all-reduce region: what a single-kernel op (all_reduce)
// gets instead of a Channel (transport.h), pointers into the peers' memory
// that its kernel loads and stores directly. Laid out in peer_region.cu.
#pragma once

#include <cstddef>
#include <cstdint>

#include "transport.h"

namespace jfo {

// Symmetric all-reduce region: per device, for every ordered pair (sender s,
// receiver d), two parities of a data slot in d's memory, cut into
// kArMaxBlocks stripes (block b of a kernel only ever touches stripe b, so a
// block's double-buffering argument never involves another block), and per
// block one flag word per kind in d's memory plus one call counter per pair
// in each of s's and d's memory. Everything is indexed by transport id, so a
// device in several groups never shares state between two peers. Sized by
// JAX_FLASHOVERLAP_WORKSPACE_MB (a quarter of the workspace); see
// peer_region.cu.
constexpr int kArMaxRanks = 8;
constexpr int kArMaxBlocks = 128;
enum ArFlagKind : int { kArData = 0, kArGathered = 1, kArFlagKinds = 2 };
// The flagless one-shot ("Lamport") all-reduce: its own slots (two parities
// of LamportSlotBytes per sender), held at kLamportEmpty in every 32-bit word
// (0x8000 in every 16-bit half: -0.0 in bf16/fp16, a negative denormal in
// fp32) except while a message is in flight, and its own call counters for a
// grid of kLamportBlocks blocks. See all_reduce_lamport.cu.
constexpr int kLamportBlocks = 128;
constexpr size_t kLamportMaxBytes = 2u << 20;       // per sender, one peer
// 3 MiB: both parities of every sender's slots (6 MiB) stay below the
// all-reduce region of the smallest workspace (about 8 MiB, peer.cu).
constexpr size_t kLamportParityBudget = 3u << 20;   // one parity, all senders
constexpr uint32_t kLamportEmpty = 0x80008000u;
// After the data of each slot parity: one 16-byte header per block, where
// the sender's block puts its CallFingerprint (kept at kLamportEmpty too).
constexpr size_t kLamportHeaderBytes = kLamportBlocks * 16;
// Bytes per all-reduce block before another block joins (all_reduce.cu).
constexpr size_t kAllReduceMinBlockBytes = 16u << 10;

// Senders with slots in a device's memory: every other device of the
// process, and one slot when it is alone, so every layout has the same parts.
constexpr int SenderCount(int num_devices) {
  return num_devices > 1 ? num_devices - 1 : 1;
}

// Largest Lamport message (bytes per rank) on a device of a process with
// `num_devices` CUDA devices: kLamportMaxBytes shrunk so that one parity of
// every sender's slot fits kLamportParityBudget (2 MiB with one peer, 1024
// KiB with three, 384 KiB with seven), in whole 64 KiB.
// dispatch.lamport_max_bytes mirrors it.
constexpr size_t LamportSlotBytes(int num_devices) {
  const size_t senders = SenderCount(num_devices);
  const size_t fit = kLamportParityBudget / senders / (64u << 10) * (64u << 10);
  return fit < kLamportMaxBytes ? fit : kLamportMaxBytes;
}
// One parity of a sender's Lamport slot: its data, then its headers.
constexpr size_t LamportParityBytes(int num_devices) {
  return LamportSlotBytes(num_devices) + kLamportHeaderBytes;
}

// One device's view of the region for one group, indexed by group rank
// (entries of the own rank are null). Plain data: passed to kernels by value.
struct PeerRegion {
  char* send[kArMaxRanks];             // in rank q's memory: this rank's slot
  const char* recv[kArMaxRanks];       // here: rank q's slot
  uint32_t* send_flag[kArMaxRanks];    // in rank q's memory: flags from us
  const uint32_t* recv_flag[kArMaxRanks];  // here: flags from rank q
  uint32_t* seq[kArMaxRanks];          // here: calls of the pair (us, q)
  int ids[kArMaxRanks];                // transport id of each rank
  size_t parity_bytes;      // parity 1 of a slot starts this far after parity 0
  size_t stripe_bytes;      // bytes of one block's stripe in one slot parity
  size_t flag_kind_stride;  // words from kind k's flags to kind k + 1's
  TimeoutRecord* record;    // this device's timeout record (host-mapped)
  uint32_t* record_lock;    // device word: one writer of the record at a time
  // Lamport slots: ours on rank q / rank q's here; call counters of the pair
  // (us, q), one per block of the fixed grid.
  char* lamport_send[kArMaxRanks];
  const char* lamport_recv[kArMaxRanks];
  uint32_t* lamport_seq[kArMaxRanks];
  size_t lamport_parity_bytes;  // LamportParityBytes
  size_t lamport_data_bytes;    // LamportSlotBytes: the headers start here
  // Sticky "this region failed" words: this device's, and each peer's (in
  // its memory). Any all-reduce wait that times out sets its own and its
  // peers' (a late message may still land in a slot after that, and the
  // pair's counters no longer agree); every all-reduce kernel on a device
  // whose word is set writes NaN and sends nothing, until reset. The host
  // code cannot stop a call replayed from a CUDA graph: this word does.
  uint32_t* region_failed;
  uint32_t* region_failed_peer[kArMaxRanks];
};
// The region of `group` for this device. Waits (bounded) for the group like
// EnsureGroupReady, and fails when a device of the group failed earlier
// (CheckGroupHealthy). Host only; allocates nothing, so it may run while a
// CUDA graph is captured.
ffi::ErrorOr<PeerRegion> AllReduceRegion(OpId op, const GroupSpec& group,
                                         int timeout_ms);

}  // namespace jfo
