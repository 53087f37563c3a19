// Failures on the host side: the message for a wait that failed on the
// device (TimeoutRecord), and the injected faults of single-kernel ops.
#include "fingerprint.h"
#include "peer_state.h"

namespace jfo {

std::string FormatTimeout(const TimeoutRecord& r) {
  const OpId op = static_cast<OpId>(r.op);
  const std::string self = std::string("jax_flashoverlap ") + OpName(op) + ": rank " +
                           std::to_string(r.rank) + " (" + DeviceLabel(r.ordinal) + ")";
  const std::string peer =
      "rank " + std::to_string(r.peer_rank) + " (" + DeviceLabel(r.peer_ordinal) + ")";
  if (op == OpId::kAllReduceAbandoned) {
    return self + " found that " + peer + " had given up on epoch " +
           std::to_string(r.expected) + " after its " + std::to_string(r.timeout_ms) +
           " ms timeout";
  }
  if (r.cause == kPeerFailed) {
    return self + " stopped a call: a wait of " + DeviceLabel(r.peer_ordinal) +
           " in this group failed first (its own error says why), so no message here is "
           "trusted until jax_flashoverlap.reset()";
  }
  if (r.cause == kCallMismatch && r.seen == kRefusedFingerprint) {
    return self + " ran a call that " + peer + " refused (its own error says why); the "
           "group failed";
  }
  if (r.cause == kCallMismatch) {
    return self + " and " + peer + " ran different calls: this rank ran " +
           DescribeFingerprint(r.expected) + ", the peer ran " + DescribeFingerprint(r.seen) +
           ". Every rank of a group must make the same calls, in the same order, with "
           "the same shapes, dtypes and options";
  }
  if (r.cause == kOutOfStep) {
    return self + " found " + peer + " at least two calls ahead (flag " +
           std::to_string(r.seen) + ", expected " + std::to_string(r.expected) +
           "): the ranks are out of step (a call ran on some ranks only)";
  }
  const std::string what =
      op == OpId::kAllReduceLamport
          ? "its data of call " + std::to_string(r.expected) +
                " of the pair (Lamport calls on this device return NaN until "
                "jax_flashoverlap.reset())"
          : "flag value " + std::to_string(r.expected) + " (flag holds " +
                std::to_string(r.seen) + ")";
  return self + " timed out after " + std::to_string(r.timeout_ms) + " ms waiting for " +
         peer + ", " + what;
}

ffi::Error ApplyFault(OpId op, const GroupSpec& group, cudaStream_t stream) {
  int stall_ms = 0;
  const FaultKind kind = TakeFault(group.ids[group.rank], &stall_ms);
  if (kind == FaultKind::kStall) return Stall(stream, stall_ms);
  if (kind != FaultKind::kNone) {
    const std::string why = std::string("jax_flashoverlap ") + OpName(op) +
                            ": injected fault: rank " +
                            std::to_string(group.rank) + " did not run a call";
    MarkFailed(group.ids, why);
    return ffi::Error::Internal(why);
  }
  return ffi::Error::Success();
}

}  // namespace jfo
