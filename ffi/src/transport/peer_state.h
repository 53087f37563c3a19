// Per-device state of the peer transport, shared by its parts: peer.cu
// (workspace, rendezvous, the copy-engine Channel), peer_region.cu (the
// symmetric all-reduce region) and node.cu (devices of other processes).
// Not part of the transport interface.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "peer_region.h"
#include "transport.h"

namespace jfo {

// Control words at the start of the control area (zeroed at allocation).
// 128 KiB: the all-reduce counters from kArControlOffset take
// (4 * 128 * num_devices + 1) words, so this fits 45 devices.
constexpr size_t kControlBytes = 128u << 10;
// Channel flags use the bytes below kFingerprintOffset, the senders'
// fingerprints ([sender id][parity]) those from there to kFailWordOffset.
constexpr size_t kFingerprintOffset = 16u << 10;
constexpr size_t kFailWordOffset = 32u << 10;
constexpr size_t kRecordLockOffset = kFailWordOffset + 4;
constexpr size_t kWaitsFailedOffset = kFailWordOffset + 8;
constexpr size_t kArControlOffset = 36u << 10;  // all-reduce counters and flags

// Everything below is indexed by transport id (transport.h), and
// `num_devices` counts the ids: the CUDA devices of the process, or the
// devices of the node once it is configured. A device of another process is
// a `remote` view: its workspace mapped here and laid out as its owner lays
// it out, without streams, events or a timeout record.
struct DeviceState {
  int id = 0;
  int cuda_ordinal = 0;  // in this process; -1 for a remote view
  bool remote = false;
  int num_devices = 1;
  char* workspace = nullptr;
  size_t workspace_bytes = 0;
  uint32_t* flags = nullptr;      // flags[sender id], in device memory
  // fingerprints[2 * sender id + parity]: the CallFingerprint of the
  // sender's call of that parity, written before its first flag.
  uint32_t* fingerprints = nullptr;
  uint32_t* fail_call = nullptr;  // id of the last call whose wait timed out
  // Set by a failed Channel wait here, or by a peer's: every later wait on
  // this device fails at once (NaN), also in calls the host had queued
  // before it learned of the failure, until reset.
  uint32_t* waits_failed = nullptr;
  uint32_t* record_lock = nullptr;
  char* staging = nullptr;
  size_t staging_bytes = 0;
  char* recv = nullptr;
  size_t slot_bytes = 0;
  // All-reduce region (peer_region.cu).
  uint32_t* ar_seq = nullptr;    // [peer id][block]
  uint32_t* ar_flags = nullptr;  // [kind][sender id][block]
  char* ar_slots = nullptr;      // [sender index][parity], ar_slot_bytes each
  size_t ar_slot_bytes = 0;
  uint32_t* lamport_seq = nullptr;     // [peer id][kLamportBlocks]
  uint32_t* region_failed = nullptr;  // one word, see PeerRegion
  char* lamport_slots = nullptr;       // [sender index][parity], LamportParityBytes
  size_t lamport_slots_bytes = 0;      // all of them
  TimeoutRecord* record = nullptr;  // host-mapped pinned memory
  std::vector<cudaStream_t> send_streams, wait_streams;  // per peer id
  cudaStream_t copy_stream = nullptr;
  std::vector<cudaEvent_t> events;
  // Recorded at the end of every Channel call, waited on at the start of the
  // next: calls on one device run in host order even from different streams.
  cudaEvent_t last_end = nullptr;
  std::vector<uint64_t> pair_calls;  // calls of the pair, per peer id
  uint32_t call_id = 0;
  std::mutex mu;

  // Slots are indexed by the sender's id, so devices that belong to several
  // groups never share a slot between two senders.
  size_t SenderIndex(int sender) const {
    return static_cast<size_t>(sender < id ? sender : sender - 1);
  }
  char* Slot(int sender, int parity) const {
    return recv + (SenderIndex(sender) * 2 + parity) * slot_bytes;
  }
};

// The state of a device after EnsureGroupReady (or a remote view after
// ImportWorkspace), or nullptr.
DeviceState* LookupDevice(int id);
// This process's device `id`, allocated now if it is not yet.
ffi::ErrorOr<DeviceState*> AllocatedDevice(int id);
// Registers the view of another process's device; fails if `id` has state.
ffi::Error AdoptRemoteDevice(std::unique_ptr<DeviceState> view);
// Whether any device of this process has state (the node can no longer be
// configured: its layout counts the devices).
bool AnyDeviceState();
// The number of transport ids (the node's devices once it is configured,
// else the CUDA devices of the process).
ffi::ErrorOr<int> TransportDeviceCount();
// Sets the pointers of `st` into its workspace (`workspace`, `num_devices`
// and `workspace_bytes` set); allocates nothing.
ffi::Error LayOutWorkspace(DeviceState* st);
// Returns the formatted timeout record of `st` and clears it, or "".
std::string TakeRecord(DeviceState* st);
// `records` followed by where the README explains timeouts.
std::string WithTimeoutHint(const std::string& records);
// channel.cu: resolves cuStreamWriteValue32 (once; under the caller's lock),
// loads the Channel's kernels now (with CUDA lazy loading, a first launch
// while a wait kernel spins can block until that wait times out), and fills
// `count` words at `words` with `value` on `stream` (check cudaGetLastError).
ffi::Error LoadDriverEntryPoints();
ffi::Error LoadChannelKernels();
void LaunchFillWords(uint32_t* words, size_t count, uint32_t value, cudaStream_t stream);
// Lays the all-reduce region out in `bytes` at `base` (data) and in the
// control area `control` (counters, flags); allocates nothing.
ffi::Error LayOutAllReduceRegion(DeviceState* st, char* control, char* base,
                                 size_t bytes);

}  // namespace jfo
