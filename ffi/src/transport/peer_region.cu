// The symmetric all-reduce region of the peer transport (see PeerRegion in
// transport.h): where it sits in each device's workspace, and the pointers a
// device's kernel needs to reach its peers' copies directly over NVLink.
//
// Layout, per device, all indexed by transport id (transport.h):
//   control area (zeroed with the rest of the control words):
//     seq  [num_devices][kArMaxBlocks]            calls of pair (this, peer)
//     flags[kArFlagKinds][num_devices][kArMaxBlocks]   written by the sender
//     lamport_seq[num_devices][kLamportBlocks]      calls of the Lamport kernel
//     region_failed                                 one word, see PeerRegion
//   data: Lamport slots [num_devices - 1 senders][2 parities] of
//     LamportParityBytes(num_devices), data then block headers (kept at
//     kLamportEmpty, filled at allocation), then
//     [num_devices - 1 senders][2 parities] slots of ar_slot_bytes, each
//     cut into kArMaxBlocks stripes of ar_slot_bytes / kArMaxBlocks.
// Everything is device memory that lives as long as the process, so a
// kernel captured into a CUDA graph keeps valid pointers across replays.
#include <algorithm>

#include "peer_state.h"

namespace jfo {

ffi::Error LayOutAllReduceRegion(DeviceState* st, char* control, char* base,
                                 size_t bytes) {
  const size_t words = static_cast<size_t>(st->num_devices) * kArMaxBlocks;
  const size_t lamport_words =
      static_cast<size_t>(st->num_devices) * kLamportBlocks;
  if (((1 + kArFlagKinds) * words + lamport_words + 1) * sizeof(uint32_t) >
      kControlBytes - kArControlOffset) {
    return ffi::Error::Internal(
        "jax_flashoverlap: " + std::to_string(st->num_devices) +
        " CUDA devices are more than the all-reduce control area holds");
  }
  st->ar_seq = reinterpret_cast<uint32_t*>(control + kArControlOffset);
  st->ar_flags = st->ar_seq + words;
  st->lamport_seq = st->ar_flags + kArFlagKinds * words;
  st->region_failed = st->lamport_seq + lamport_words;
  const size_t senders = SenderCount(st->num_devices);
  const size_t lamport_bytes = senders * 2 * LamportParityBytes(st->num_devices);
  if (lamport_bytes >= bytes) {
    return ffi::Error::Internal(
        "jax_flashoverlap: the all-reduce region (" + std::to_string(bytes >> 20) +
        " MiB) is too small; raise JAX_FLASHOVERLAP_WORKSPACE_MB");
  }
  st->lamport_slots = base;
  st->lamport_slots_bytes = lamport_bytes;
  st->ar_slots = base + lamport_bytes;
  // Stripes of whole 256-byte lines, so every block's data stays aligned.
  const size_t line = kArMaxBlocks * 256;
  st->ar_slot_bytes = (bytes - lamport_bytes) / (2 * senders) / line * line;
  return ffi::Error::Success();
}

ffi::ErrorOr<PeerRegion> AllReduceRegion(OpId op, const GroupSpec& group,
                                         int timeout_ms) {
  const std::string where = std::string("jax_flashoverlap ") + OpName(op);
  if (group.n > kArMaxRanks) {
    return ffi::Error::InvalidArgument(
        where + ": groups of at most " + std::to_string(kArMaxRanks) +
        " GPUs are supported, got " + std::to_string(group.n));
  }
  JFO_RETURN_IF_ERROR(EnsureGroupReady(op, group, timeout_ms));
  const int self = group.ids[group.rank];
  DeviceState* me = LookupDevice(self);
  JFO_RETURN_IF_ERROR(CheckGroupHealthy(op, group));

  PeerRegion r{};
  const size_t lamport_slot = LamportParityBytes(me->num_devices);
  const size_t kind_stride =
      static_cast<size_t>(me->num_devices) * kArMaxBlocks;
  for (int q = 0; q < group.n; ++q) {
    const int other = group.ids[q];
    r.ids[q] = other;
    if (q == group.rank) continue;
    DeviceState* peer = LookupDevice(other);
    // Sender and receiver compute slot addresses in different devices'
    // layouts; they agree only if the layouts are the same size.
    if (peer->ar_slot_bytes != me->ar_slot_bytes ||
        peer->num_devices != me->num_devices) {
      return ffi::Error::Internal(
          where + ": " + DeviceLabel(self) + " and " + DeviceLabel(other) +
          " have different workspace layouts");
    }
    r.send[q] =
        peer->ar_slots + peer->SenderIndex(self) * 2 * me->ar_slot_bytes;
    r.recv[q] = me->ar_slots + me->SenderIndex(other) * 2 * me->ar_slot_bytes;
    r.send_flag[q] = peer->ar_flags + static_cast<size_t>(self) * kArMaxBlocks;
    r.recv_flag[q] = me->ar_flags + static_cast<size_t>(other) * kArMaxBlocks;
    r.seq[q] = me->ar_seq + static_cast<size_t>(other) * kArMaxBlocks;
    r.lamport_send[q] =
        peer->lamport_slots + peer->SenderIndex(self) * 2 * lamport_slot;
    r.lamport_recv[q] =
        me->lamport_slots + me->SenderIndex(other) * 2 * lamport_slot;
    r.lamport_seq[q] =
        me->lamport_seq + static_cast<size_t>(other) * kLamportBlocks;
    r.region_failed_peer[q] = peer->region_failed;
  }
  r.lamport_parity_bytes = lamport_slot;
  r.lamport_data_bytes = LamportSlotBytes(me->num_devices);
  r.region_failed = me->region_failed;
  r.parity_bytes = me->ar_slot_bytes;
  r.stripe_bytes = me->ar_slot_bytes / kArMaxBlocks;
  r.flag_kind_stride = kind_stride;
  r.record = me->record;
  r.record_lock = me->record_lock;
  return r;
}

}  // namespace jfo
