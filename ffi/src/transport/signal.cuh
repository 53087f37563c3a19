// Device side of the peer transport's signals: the clock, acquire/release
// accesses to flag words at system scope, and the timeout report. Used by the
// transport's own wait kernel (peer_kernels.cuh), by kernels that work on a
// PeerRegion (all_reduce_flags.cu, all_reduce_lamport.cu) and by the tile
// GEMM that waits for gathered rows (tile_gemm/arrival_waits.cuh).
#pragma once

#include <cstdint>

#include "../device_clock.cuh"
#include "peer_region.h"
#include "transport.h"

namespace jfo {
namespace signal {

using ::jfo::GlobalTimerNs;

// System scope: the flag may live in a peer GPU's memory and be written by
// that GPU (or written by us into a peer's memory).
__device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];"
               : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreRelease(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;"
               :: "l"(p), "r"(v) : "memory");
}

// Epochs only grow and wrap: compare by signed distance.
__device__ __forceinline__ bool Reached(uint32_t seen, uint32_t expected) {
  return static_cast<int32_t>(seen - expected) >= 0;
}

// 64-bit flags (NVSHMEM signal words hold a call's sequence number).
__device__ __forceinline__ uint64_t LoadAcquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];"
               : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreRelease(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;"
               :: "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ bool Reached(uint64_t seen, uint64_t expected) {
  return static_cast<int64_t>(seen - expected) >= 0;
}

// Fills the record for the host unless it still holds an unread one (the
// first timeout is the informative one). `lock` keeps two threads (blocks of
// one kernel, or two wait kernels) from interleaving their fields; a thread
// that finds it taken leaves the report to its holder.
__device__ __forceinline__ void RecordTimeout(TimeoutRecord* record,
                                              uint32_t* lock,
                                              const TimeoutRecord& info,
                                              int peer_rank, int peer_ordinal,
                                              uint32_t expected,
                                              uint32_t seen) {
  if (atomicCAS(lock, 0u, 1u) != 0u) return;
  if (!record->set) {
    record->op = info.op;
    record->rank = info.rank;
    record->ordinal = info.ordinal;
    record->peer_rank = peer_rank;
    record->peer_ordinal = peer_ordinal;
    record->timeout_ms = info.timeout_ms;
    record->expected = expected;
    record->seen = seen;
    record->cause = info.cause;
    __threadfence_system();  // the fields before `set`
    record->set = 1;
  }
  __threadfence();
  atomicExch(lock, 0u);
}

// One thread waits for a copy-engine flag (ChannelFlag) to reach `expected`.
// It gives up after the timeout, at once when the flag shows the peer two
// calls ahead (the ranks are out of step) or the peer's fingerprint differs
// from this call's, or when another wait of the call has failed; the call's
// first failure is recorded for the host. Returns whether the message is
// there and belongs to this call.
__device__ __forceinline__ bool WaitChannelFlag(const uint32_t* flag,
                                                uint32_t expected,
                                                WaitReport report) {
  // The device (id + 1) whose failed wait marked this one, or 0.
  auto failed_by = [&]() -> uint32_t {
    return report.waits_failed == nullptr
               ? 0u
               : *reinterpret_cast<volatile uint32_t*>(report.waits_failed);
  };
  // An earlier failure here or on a peer: no message is trusted.
  auto fail_as_marked = [&](uint32_t by) {
    if (atomicExch(report.fail_call, report.call_id) == report.call_id) return false;
    report.info.cause = kPeerFailed;
    RecordTimeout(report.record, report.record_lock, report.info, -1,
                  static_cast<int>(by) - 1, 0, 0);
    return false;
  };
  const uint64_t start = GlobalTimerNs();
  uint32_t seen;
  if (const uint32_t by = failed_by()) return fail_as_marked(by);
  for (;;) {
    seen = LoadAcquire(flag);
    if (Reached(seen, expected)) {
      // The pair's call numbers, in wrapping order.
      const uint32_t calls_ahead =
          ((seen >> kFlagMessageBits) - (expected >> kFlagMessageBits)) &
          ((1u << (32 - kFlagMessageBits)) - 1);
      if (calls_ahead >= 2) {
        report.info.cause = kOutOfStep;
        break;
      }
      if (report.fingerprint == nullptr) return true;
      // Written before the flag (Channel::SendWhen), so the acquire above sees it.
      const uint32_t theirs = LoadAcquire(report.fingerprint);
      if (theirs == report.own_fingerprint) return true;
      report.info.cause = kCallMismatch;
      expected = report.own_fingerprint;
      seen = theirs;
      break;
    }
    if (*reinterpret_cast<volatile uint32_t*>(report.fail_call) == report.call_id) return false;
    if (const uint32_t by = failed_by()) return fail_as_marked(by);
    if (GlobalTimerNs() - start > report.timeout_ns) break;
  }
  if (report.waits_failed != nullptr) {
    const uint32_t self = static_cast<uint32_t>(report.info.ordinal) + 1;
    atomicCAS_system(report.waits_failed, 0u, self);
    if (report.peer_waits_failed != nullptr) atomicCAS_system(report.peer_waits_failed, 0u, self);
  }
  if (atomicExch(report.fail_call, report.call_id) == report.call_id) return false;
  RecordTimeout(report.record, report.record_lock, report.info, report.info.peer_rank,
                report.info.peer_ordinal, expected, seen);
  return false;
}

// After a timeout of an all-reduce wait: the region of this device and of
// every peer of the group has failed (PeerRegion::region_failed).
__device__ __forceinline__ void FailRegion(const PeerRegion& region, int n,
                                           int rank) {
  StoreRelease(region.region_failed, 1u);
  for (int p = 0; p < n; ++p) {
    if (p != rank) StoreRelease(region.region_failed_peer[p], 1u);
  }
}

__device__ __forceinline__ bool RegionFailed(const PeerRegion& region) {
  return *reinterpret_cast<volatile uint32_t*>(region.region_failed) != 0;
}

}  // namespace signal
}  // namespace jfo
