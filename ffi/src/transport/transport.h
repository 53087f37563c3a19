// The interface the ops use to move bytes between the ranks of a group.
// Ops say *what* goes where (a row block to a peer's receive slot, "wait for
// peer p's i-th message"); the transport decides *how*: copy engines and
// stream memory ops into the peers' workspaces (peer.cu), which are CUDA peer
// memory for GPUs of this process and CUDA IPC mappings for GPUs of other
// processes of the node (node.cu). The ops never know which.
// Single-kernel ops (all_reduce) instead get a PeerRegion (peer_region.h):
// pointers into the peers' memory that their kernel loads and stores
// directly, with the signal and wait primitives of signal.cuh.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "../common.h"

namespace jfo {

enum class OpId : int32_t {
  kAllGatherMatmul = 1,
  kMatmulReduceScatter = 2,
  kMatmulAllReduce = 3,
  kAllReduce = 4,
  kAllReduceLamport = 5,  // in timeout records only: the flagless kernel
  // In timeout records only: a two-shot peer had given up on the call.
  kAllReduceAbandoned = 6,
  kAllReduceCopyEngine = 7,  // the copy engines' two-shot (all_reduce_copy_engine.cu)
};
const char* OpName(OpId op);

// Devices are named by transport ids. In a job of one process they are the
// CUDA ordinals. When the ranks of a group live in several processes of a
// node (one process per GPU, or several sharing one GPU), ConfigureNode gives
// every device of the node an id 0..node_size-1, the same in every process,
// and the `group_ordinals` attributes hold these ids.
//
// The group (from the flat `group_ordinals` attribute) containing this device.
struct GroupSpec {
  std::vector<int> ids;  // transport ids, indexed by rank
  int rank = 0;          // position of this device inside `ids`
  int n = 1;
  int cuda_ordinal = 0;  // this device's CUDA ordinal in this process
};
ffi::ErrorOr<GroupSpec> FindGroup(OpId op, I32Span group_ordinals, int32_t n,
                                  int cuda_ordinal);

// Several processes of a node (node.cu). Once per process, before its first
// op: `local` maps each CUDA ordinal this process drives to its id, and
// `labels` names every id of the node for messages ("process 2, CUDA device
// 0"). Then each process exports its devices' workspaces (allocating them)
// and imports every other process's; the exchange itself is the caller's
// (jax_flashoverlap/node_transport.py, through jax.distributed's store).
ffi::Error ConfigureNode(int node_size, const std::vector<std::pair<int, int>>& local,
                         const std::vector<std::string>& labels);
// The CUDA IPC handle of device `id`'s workspace (allocated now if it is not
// yet) and its size in bytes.
ffi::ErrorOr<std::pair<std::string, size_t>> ExportWorkspace(int id);
// Maps device `id`'s workspace from another process of the node; `bytes`
// must equal this process's workspace size (the layouts must agree).
ffi::Error ImportWorkspace(int id, const std::string& handle, size_t bytes);
// The transport id of CUDA device `cuda_ordinal` of this process.
int TransportId(int cuda_ordinal);
// The CUDA ordinal in this process of transport id `id`, or -1 when the
// device is another process's.
int CudaOrdinalOf(int id);
// How messages name device `id`: "CUDA device 3" in a one-process job, the
// configured label across processes.
std::string DeviceLabel(int id);

// Initialize-stage setup: allocates this device's persistent workspace,
// enables peer access and waits (bounded) until every member of the group has
// done the same. Idempotent and cheap after the first call.
ffi::Error EnsureGroupReady(OpId op, const GroupSpec& group, int timeout_ms);

// Returns (and clears) the recorded wait timeouts of every device, one per
// line, or "". The devices of each record (the waiter and the peer it waited
// for) are marked failed: see CheckGroupHealthy.
std::string TakePendingError();

// Sticky failure. After a timeout, or an error once a call may have moved
// anything, the devices involved are marked failed, and every later call on a
// group with a failed device fails at once, before it sends anything, on
// every member, until ResetTransport: a rank whose counters fell out of step
// never runs again and so never reads a peer's stale data.
ffi::Error CheckGroupHealthy(OpId op, const GroupSpec& group);
void MarkFailed(const std::vector<int>& ids, const std::string& why);

// Waits until every device of the transport is idle, then returns it to its
// state after allocation (flags, counters, Lamport slots zeroed or refilled,
// no failures, no injected fault). Returns "" or why it could not.
std::string ResetTransport();

// The fault-injection hook for tests (off unless InjectFault is called): the
// `calls`-th next call on device `id` raises an error after its
// first send ("error"), raises at its start and sends nothing ("skip", what a
// rank that drops out does), or starts `stall_ms` late ("stall"). Devices
// are named by transport id.
enum class FaultKind : int { kNone = 0, kError = 1, kSkip = 2, kStall = 3 };
void InjectFault(FaultKind kind, int id, int calls, int stall_ms);
// The fault due now on device `id` (counting this call), or kNone.
FaultKind TakeFault(int id, int* stall_ms);
// For single-kernel ops, before their launch on `stream`: the fault due now
// on this device. "error" and "skip" both mark the group failed and return
// the error before the launch; "stall" enqueues the delay (captured into a
// CUDA graph with the op).
ffi::Error ApplyFault(OpId op, const GroupSpec& group, cudaStream_t stream);
// The injected "stall": `stream` idles `ms` before the work enqueued after.
ffi::Error Stall(cudaStream_t stream, int ms);
// Test hook: runs the Channel's wait kernel on CUDA device `ordinal` against
// a flag holding `flag` (and, unless `own_fingerprint` is 0, a fingerprint
// word holding `their_fingerprint`) and returns "reached", "timed out",
// "out of step" or "another call".
std::string DebugWaitFlag(int ordinal, uint32_t flag, uint32_t expected,
                          int timeout_ms, uint32_t their_fingerprint,
                          uint32_t own_fingerprint);

// The CUDA driver's module loading mode in this process: "lazy", "eager",
// or "unknown" (no driver, or CUDA not initialised yet).
std::string ModuleLoadingMode();

// Whether every other member of `group` may load and store `ptr` (this
// device's memory) directly, as its CUDA context reports. False for all
// pointers while JAX_FLASHOVERLAP_PEER_STORES=0 (a switch for debugging),
// and when a member is in another process (only workspaces are mapped there).
bool PeerStoresAllowed(const void* ptr, const GroupSpec& group);

// Why a wait failed. kOutOfStep: it saw its peer at least two calls ahead,
// which no schedule allows (a peer leads by at most one call).
// kCallMismatch: the peer's message came from another call (its
// CallFingerprint differs); `expected` and `seen` then hold the two
// fingerprints. kPeerFailed: a wait of another device of the group failed
// first (peer_ordinal names it) and marked this one (WaitReport).
enum WaitFailure : int32_t {
  kTimedOut = 0,
  kOutOfStep = 1,
  kCallMismatch = 2,
  kPeerFailed = 3
};

// What a wait that failed leaves for the host (host-mapped memory, written
// by the device under PeerRegion::record_lock, read by TakePendingError).
// Devices are named by transport id.
struct TimeoutRecord {
  volatile int32_t set;
  int32_t op, rank, ordinal, peer_rank, peer_ordinal, timeout_ms;
  uint32_t expected, seen;
  int32_t cause;  // WaitFailure
};

// The host's message for a failed wait: the op, this rank and the peer it
// waited for, and whether it timed out, found the peer out of step, or found
// it in another call (naming both).
std::string FormatTimeout(const TimeoutRecord& record);

// Where a failed wait of a call reports (signal::WaitChannelFlag): `fail_call`
// holds the call's id once any of its waits failed (the others then stop at
// once, and its outputs become NaN); `record` (under `record_lock`) tells the
// host which wait, with `info` naming the op, this rank and the peer.
// `fingerprint` (null: no check) is the word where the peer's call left its
// CallFingerprint, compared with `own_fingerprint` once the flag is there.
// `waits_failed` (null: none) is this device's sticky failure word and
// `peer_waits_failed` the peer's: a failed wait sets both (to its device's
// transport id + 1, unless set already), and a wait that finds its own set
// fails at once, reporting the device that set it.
struct WaitReport {
  uint64_t timeout_ns;
  uint32_t* fail_call;
  uint32_t call_id;
  TimeoutRecord* record;
  uint32_t* record_lock;
  TimeoutRecord info;
  const uint32_t* fingerprint = nullptr;
  uint32_t own_fingerprint = 0;
  uint32_t* waits_failed = nullptr;
  uint32_t* peer_waits_failed = nullptr;
};

// What a sender writes in place of its fingerprint when it refuses a call
// that its peers may run (Channel::Refuse): their waits fail at once.
// CallFingerprint::Seal never makes it.
constexpr uint32_t kRefusedFingerprint = 0xFFFFFFFFu;

// A copy-engine flag (Channel): the pair's call number, wrapping, in the high
// bits and the message's index in the call, from 1, in the low ones. A later
// message of the pair always holds a larger value (in wrapping order).
constexpr int kFlagMessageBits = 12;
constexpr int kMaxMessagesPerCall = (1 << kFlagMessageBits) - 1;
inline uint32_t ChannelFlag(uint64_t pair_call, int message) {
  return static_cast<uint32_t>(pair_call << kFlagMessageBits) |
         static_cast<uint32_t>(message);
}

// `stream` writes `value` into `flag` once its earlier work's writes are
// visible (cuStreamWriteValue32, as Channel::Send's flags).
ffi::Error WriteFlag(cudaStream_t stream, uint32_t* flag, uint32_t value);

// The workspace starts with the GEMMs' cuBLASLt workspace; every call may
// record up to kEventsPerCall CUDA events (peer.cu).
constexpr size_t kGemmWorkspaceBytes = 32u << 20;
constexpr int kEventsPerCall = 1024;

struct DeviceState;

// A range of device memory.
struct DeviceBytes {
  void* data = nullptr;
  size_t size = 0;
};

// One call of one op on one device. Usage: Begin, then Send/Arrival/
// CopyLocal/Mark in schedule order, then End. Every member of the group must
// issue the same number of messages to every peer in a call.
class Channel {
 public:
  Channel() = default;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;
  // A call that ends between its real pass's start and a successful End
  // (an error return) marks its group failed: its counters and its peers'
  // may no longer agree.
  ~Channel();
  // Fails at once when a device of the group failed earlier
  // (CheckGroupHealthy); orders the call after this device's previous one,
  // and records the call start on `stream` (every copy into an output or a
  // peer is ordered after it). `fingerprint` (CallFingerprint::Seal) goes
  // to each peer before the call's first flag there, and every wait of the
  // call compares the peer's with it before the data is read.
  ffi::Error Begin(OpId op, const GroupSpec& group, int timeout_ms,
                   cudaStream_t stream, uint32_t fingerprint);
  // Runs the op's `schedule` (the calls below) twice. The first pass is a
  // rehearsal: nothing moves, only GEMMs with a new cuBLASLt plan run (into
  // the call's own outputs/staging, overwritten later). CUDA lazy loading
  // loads a kernel at its first launch and that can block until the device
  // is idle; if that happened after this call's first wait, two GPUs each
  // blocked in a launch, waiting for the other's unsent data, would stall
  // until the timeout. The rehearsal moves every first launch before the
  // call's waits, whose peers' sends are then already enqueued.
  ffi::Error Run(const std::function<ffi::Error()>& schedule);
  bool rehearsal() const { return rehearsal_; }
  // Fails, naming the fix, when one message exceeds the receive slot of any
  // rank of the group or the local scratch exceeds this device's
  // (JAX_FLASHOVERLAP_WORKSPACE_MB), through Refuse.
  ffi::Error CheckCapacity(size_t slot_bytes, size_t staging_bytes);
  // Returns `why` for a call refused after Begin but before anything moved
  // (a shape or build the schedule cannot take). The call still counts, and
  // each peer gets a flag of it with kRefusedFingerprint: where every rank
  // refused alike nobody waits and the group stays sound; a peer that ran
  // the call fails at its first wait, instead of this rank falling a call
  // behind it and later reading that call's messages as its own.
  ffi::Error Refuse(ffi::Error why);

  int rank() const { return group_->rank; }
  int n() const { return group_->n; }
  int ordinal() const { return group_->cuda_ordinal; }  // for this device's own work
  int id() const { return group_->ids[group_->rank]; }  // for the transport
  cudaStream_t stream() const { return stream_; }
  char* RecvSlot(int peer_rank) const;  // where peer_rank's bytes land here
  char* Staging() const;                // local scratch for outgoing data
  void* GemmWorkspace(size_t* bytes) const;

  // Copies `bytes` from local `src` to byte `offset` of this rank's receive
  // slot on `peer_rank` once `after` completed (nullptr: the call start),
  // then raises the peer's flag. Returns the message index (0, 1, ... per
  // peer and call) that the peer passes to Arrival.
  ffi::ErrorOr<int> Send(int peer_rank, size_t offset, const void* src,
                         size_t bytes, cudaEvent_t after);
  // As Send, and the copy also waits until the 32-bit `counter` (this
  // device's memory, raised by work already enqueued on the XLA stream, such
  // as the tile GEMM's epilogue) is at least `at_least`. That work is this
  // GPU's own and always finishes, so this wait needs no bound; enqueue it
  // after that work, or it may hold the work behind it in a shared queue.
  ffi::ErrorOr<int> SendWhen(int peer_rank, size_t offset, const void* src,
                             size_t bytes, cudaEvent_t after,
                             const uint32_t* counter, uint32_t at_least);
  // An event that completes when message `index` from `peer_rank` landed.
  // Its wait kernel runs on a side stream from the call start (or from
  // `after`, an event of this call, so that it does not spin beside the
  // work before that), or, after set_waits_on_xla_stream(true), on the XLA
  // stream after the work enqueued there so far: then it holds no SM while
  // earlier GEMMs run (a spinning CTA takes an SM slot a GEMM CTA could
  // use), but what follows it on the XLA stream waits for the message. Only
  // for schedules whose XLA-stream work after a wait needs that message
  // anyway. `read_from`: the receive slot's bytes that the call computes
  // from once the event completes; if the call failed before the message
  // came, they are NaN by then (a slot still holds the message of two calls
  // ago), so that nothing computed from them, and sent on, is a plausible
  // wrong number. Pass them wherever the result leaves this device.
  ffi::ErrorOr<cudaEvent_t> Arrival(int peer_rank, int index, cudaEvent_t after = nullptr,
                                    DeviceBytes read_from = {});
  void set_waits_on_xla_stream(bool on) { waits_on_xla_stream_ = on; }
  // For a kernel that waits for messages itself (signal::WaitChannelFlag;
  // the gathering tile GEMM): the flag that message `index` from `peer_rank`
  // raises, the value it then holds, and where a failed wait reports.
  struct FlagWait {
    const uint32_t* flag;
    uint32_t expected;
    WaitReport report;
  };
  FlagWait ArrivalFlag(int peer_rank, int index) const;
  // CopyLocal from the call start, then a raise of this device's own flag
  // (the word of its own id, which no peer writes; zeroed on the XLA
  // stream at the call's first such copy): a kernel can wait for the copy
  // with the returned FlagWait instead of the XLA stream waiting for it.
  ffi::ErrorOr<FlagWait> CopyLocalFlagged(void* dst, const void* src, size_t bytes);
  // Device-local copy on a copy engine, ordered after `after` (nullptr: the
  // call start); joined into the XLA stream by End.
  ffi::Error CopyLocal(void* dst, const void* src, size_t bytes,
                       cudaEvent_t after);
  // Records an event on the XLA stream (e.g. "this GEMM is done").
  ffi::ErrorOr<cudaEvent_t> Mark();
  // Makes the XLA stream wait for `event`.
  ffi::Error WaitOn(cudaEvent_t event);
  // Joins the side streams into the XLA stream, advances the epochs, and
  // overwrites `outputs` with NaN if a wait of this call timed out.
  struct Output {
    void* data;
    size_t elements;
    ffi::DataType dtype;
  };
  ffi::Error End(const std::vector<Output>& outputs);

 private:
  ffi::ErrorOr<cudaEvent_t> NextEvent();
  ffi::Error InjectedError();  // clears the injected fault, returns its error
  ffi::Error Ended();          // the call's last step
  void JoinSideStreams();      // after an error return

  DeviceState* dev_ = nullptr;
  const GroupSpec* group_ = nullptr;
  OpId op_{};
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr;
  uint64_t timeout_ns_ = 0;
  int events_used_ = 0;
  int events_rehearsed_ = 0;  // events the real pass of the schedule will take
  uint32_t call_id_ = 0;
  uint32_t fingerprint_ = 0;
  bool rehearsal_ = false;
  bool committed_ = false;  // past the checks: peers may see this call
  bool ended_ = false;
  FaultKind fault_ = FaultKind::kNone;
  std::string failure_;  // the error that stopped the call, for MarkFailed
  bool waits_on_xla_stream_ = false;
  int local_flags_ = 0;      // CopyLocalFlagged calls in this pass
  std::vector<int> sent_;    // messages sent to each rank in this call
  std::vector<int> parity_;  // receive-slot parity per rank in this call
  std::unique_lock<std::mutex> lock_;  // one call at a time per device
};

}  // namespace jfo
