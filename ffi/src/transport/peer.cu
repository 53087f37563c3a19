// Peer transport: the GPUs of a node, driven by one process (jax.shard_map on
// local devices) or by several (node.cu maps the other processes'
// workspaces here). Data moves on copy engines (cudaMemcpyAsync into a peer pointer),
// signals are stream memory ops (cuStreamWriteValue32) into the receiver's
// flag, waits are kernels of one warp at most with a timeout (one thread polls).
//
// Flow control. Every ordered pair (sender s, receiver d) has one flag word in
// d's workspace; each message raises it to (the pair's call number, the
// message's index in the call) (ChannelFlag). Flags only grow (until a reset):
// a waiter checks `flag >= (call, index)`, so a late or repeated signal cannot
// satisfy a future wait early, and a flag two calls ahead means the ranks are
// out of step (the wait fails). Both sides count the pair's calls on the host:
// the handlers run their host code every call (not command-buffer compatible).
// Before its first flag of a call a sender writes the call's fingerprint
// (fingerprint.h), which the waiter compares with its own.
//
// Slot reuse. The receive slot of a pair is double-buffered by call parity,
// and a call's sends are ordered after that call's start on the sender's XLA
// stream. The sender can write the slot of call k again only at call k+2;
// call k+2 starts after its call k+1 finished, which needed the receiver's
// call k+1 messages, which the receiver sends only after starting call k+1,
// i.e. after it finished reading (End joins all readers) the slot of call k.
//
// The symmetric all-reduce region inside the same workspace is laid out and
// handed out by peer_region.cu; the Channel's calls are in channel.cu.
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "peer_state.h"
#include "../settings.h"

namespace jfo {
namespace {

std::mutex g_mu;
std::condition_variable g_cv;
std::map<int, std::unique_ptr<DeviceState>> g_devices;  // by transport id
std::map<std::vector<int>, std::set<int>> g_registered;  // group -> members
std::map<int, std::string> g_failed;  // transport id -> the first fault seen

struct InjectedFault {
  FaultKind kind = FaultKind::kNone;
  int id = -1;
  int calls = 0;  // calls on device `id` until it fires, this one included
  int stall_ms = 0;
};
InjectedFault g_fault;
// Whether g_fault holds a fault: every call asks, and almost always none is
// armed, so the answer needs no lock.
std::atomic<bool> g_fault_armed{false};

// Marks device `id` failed (under g_mu): the host refuses its groups' later
// calls, and the word all-reduces replayed from a CUDA graph read
// (PeerRegion::region_failed; 0 or 1, so one byte) makes those write NaN.
// Another process's device is only marked here: its own process learns of
// the fault from its own waits, which time out.
void FailLocked(int id, const std::string& why) {
  if (!g_failed.emplace(id, why).second) return;
  auto it = g_devices.find(id);
  if (it == g_devices.end() || it->second->remote ||
      it->second->region_failed == nullptr) {
    return;
  }
  DeviceGuard guard(it->second->cuda_ordinal);
  // Best effort (a device in an error state fails its calls anyway), and
  // its error must not reach the next call's cudaGetLastError.
  if (cudaMemsetAsync(it->second->region_failed, 1, 1, it->second->copy_stream) != cudaSuccess) {
    (void)cudaGetLastError();
  }
}

// Frees what a DeviceState of this process holds (any part may be missing).
void Release(DeviceState* st) {
  DeviceGuard guard(st->cuda_ordinal);
  for (cudaEvent_t e : st->events) {
    if (e) cudaEventDestroy(e);
  }
  if (st->last_end) cudaEventDestroy(st->last_end);
  for (auto* streams : {&st->send_streams, &st->wait_streams}) {
    for (cudaStream_t s : *streams) {
      if (s) cudaStreamDestroy(s);
    }
  }
  if (st->copy_stream) cudaStreamDestroy(st->copy_stream);
  if (st->record) cudaFreeHost(st->record);
  if (st->workspace) cudaFree(st->workspace);
  cudaGetLastError();  // the error being reported is the caller's
}

// Zeroes the control words (flags, counters, the region's failed word) and
// refills the Lamport slots, on the device's copy stream, and waits for it.
ffi::Error ClearControl(DeviceState* st) {
  char* control = st->workspace + kGemmWorkspaceBytes;
  JFO_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(control, 0, kControlBytes, st->copy_stream));
  LaunchFillWords(reinterpret_cast<uint32_t*>(st->lamport_slots),
                  st->lamport_slots_bytes / sizeof(uint32_t), kLamportEmpty,
                  st->copy_stream);
  JFO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  JFO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st->copy_stream));
  return ffi::Error::Success();
}

ffi::ErrorOr<DeviceState*> AllocateDevice(DeviceState* st);

// Allocates everything a device of this process needs once; called under
// g_mu. A failure frees what it allocated, and the next call tries again
// from nothing.
ffi::ErrorOr<DeviceState*> GetOrCreateDevice(int id) {
  auto it = g_devices.find(id);
  if (it != g_devices.end()) return it->second.get();
  const int cuda_ordinal = CudaOrdinalOf(id);
  if (cuda_ordinal < 0) {
    return ffi::Error::Internal(
        "jax_flashoverlap: " + DeviceLabel(id) + " is another process's, and its "
        "workspace was not imported; the node transport must be set up before the "
        "first op (jax_flashoverlap.node_transport.setup())");
  }
  auto st = std::make_unique<DeviceState>();
  st->id = id;
  st->cuda_ordinal = cuda_ordinal;
  auto made = AllocateDevice(st.get());
  if (made.has_error()) {
    Release(st.get());
    return made.error();
  }
  g_devices[id] = std::move(st);
  return *made;
}

ffi::ErrorOr<DeviceState*> AllocateDevice(DeviceState* st) {
  DeviceGuard guard(st->cuda_ordinal);
  auto count = TransportDeviceCount();
  if (count.has_error()) return count.error();
  st->num_devices = *count;
  // Validated by jax_flashoverlap/settings.py (64 MiB to 1 TiB) before it
  // reached the extension.
  st->workspace_bytes = GetSettings().workspace_mb << 20;
  JFO_CUDA_RETURN_IF_ERROR(cudaMalloc(&st->workspace, st->workspace_bytes));
  JFO_RETURN_IF_ERROR(LayOutWorkspace(st));
  JFO_CUDA_RETURN_IF_ERROR(cudaHostAlloc(
      &st->record, sizeof(TimeoutRecord),
      cudaHostAllocMapped | cudaHostAllocPortable));
  st->record->set = 0;
  JFO_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&st->copy_stream, cudaStreamNonBlocking));
  st->send_streams.resize(st->num_devices);
  st->wait_streams.resize(st->num_devices);
  for (int d = 0; d < st->num_devices; ++d) {
    JFO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(
        &st->send_streams[d], cudaStreamNonBlocking));
    JFO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(
        &st->wait_streams[d], cudaStreamNonBlocking));
  }
  st->events.resize(kEventsPerCall);
  for (auto& e : st->events) {
    JFO_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  JFO_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&st->last_end, cudaEventDisableTiming));
  st->pair_calls.assign(st->num_devices, 0);
  // Load our kernels now: with CUDA lazy loading, a first launch while a
  // wait kernel spins can block until that wait times out.
  JFO_RETURN_IF_ERROR(LoadChannelKernels());
  JFO_RETURN_IF_ERROR(ClearControl(st));
  return st;
}

// Peer access from CUDA device `ordinal` to the other devices of `ids` that
// this process drives (another process's workspace is mapped with access).
ffi::Error EnablePeerAccess(int ordinal, const std::vector<int>& ids) {
  DeviceGuard guard(ordinal);
  for (int id : ids) {
    const int p = CudaOrdinalOf(id);
    if (p < 0 || p == ordinal) continue;
    int can = 0;
    JFO_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, ordinal, p));
    if (!can) {
      return ffi::Error::Internal(
          "jax_flashoverlap: CUDA device " + std::to_string(ordinal) +
          " cannot access device " + std::to_string(p) +
          " (no peer access); use the pure-JAX implementation");
    }
    cudaError_t err = cudaDeviceEnablePeerAccess(p, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // XLA or NCCL enabled it first: fine
    } else {
      JFO_CUDA_RETURN_IF_ERROR(err);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error LayOutWorkspace(DeviceState* st) {
  char* control = st->workspace + kGemmWorkspaceBytes;
  st->flags = reinterpret_cast<uint32_t*>(control);
  st->fingerprints = reinterpret_cast<uint32_t*>(control + kFingerprintOffset);
  st->fail_call = reinterpret_cast<uint32_t*>(control + kFailWordOffset);
  st->record_lock = reinterpret_cast<uint32_t*>(control + kRecordLockOffset);
  st->waits_failed = reinterpret_cast<uint32_t*>(control + kWaitsFailedOffset);
  const size_t data = st->workspace_bytes - kGemmWorkspaceBytes - kControlBytes;
  // A quarter for the all-reduce region. Of the rest, a peer needs one staged
  // message per peer and receives two (parities): staging one third, receive
  // slots two thirds.
  const size_t ar_bytes = data / 4 / 256 * 256;
  char* ar = control + kControlBytes;
  JFO_RETURN_IF_ERROR(LayOutAllReduceRegion(st, control, ar, ar_bytes));
  st->staging = ar + ar_bytes;
  st->staging_bytes = (data - ar_bytes) / 3 / 256 * 256;
  st->recv = st->staging + st->staging_bytes;
  st->slot_bytes = (data - ar_bytes - st->staging_bytes) /
                   (2 * SenderCount(st->num_devices)) / 256 * 256;
  return ffi::Error::Success();
}

DeviceState* LookupDevice(int id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_devices.find(id);
  return it == g_devices.end() ? nullptr : it->second.get();
}

ffi::ErrorOr<DeviceState*> AllocatedDevice(int id) {
  std::lock_guard<std::mutex> lock(g_mu);
  JFO_RETURN_IF_ERROR(LoadDriverEntryPoints());
  return GetOrCreateDevice(id);
}

ffi::Error AdoptRemoteDevice(std::unique_ptr<DeviceState> view) {
  std::lock_guard<std::mutex> lock(g_mu);
  const int id = view->id;
  if (!g_devices.emplace(id, std::move(view)).second) {
    return ffi::Error::Internal("jax_flashoverlap: " + DeviceLabel(id) +
                                " already has a workspace in this process");
  }
  return ffi::Error::Success();
}

bool AnyDeviceState() {
  std::lock_guard<std::mutex> lock(g_mu);
  return !g_devices.empty();
}

// Formats before clearing `set`: a device writes the fields only while `set`
// is 0 (signal::RecordTimeout), so they cannot change under the formatting.
std::string TakeRecord(DeviceState* st) {
  if (!__atomic_load_n(&st->record->set, __ATOMIC_ACQUIRE)) return "";
  std::string msg = FormatTimeout(*st->record);
  __atomic_store_n(&st->record->set, 0, __ATOMIC_RELEASE);
  return msg;
}

const char* OpName(OpId op) {
  switch (op) {
    case OpId::kAllGatherMatmul: return "all_gather_matmul";
    case OpId::kMatmulReduceScatter: return "matmul_reduce_scatter";
    case OpId::kMatmulAllReduce: return "matmul_all_reduce";
    case OpId::kAllReduce: return "all_reduce";
    case OpId::kAllReduceLamport: return "all_reduce (lamport)";
    case OpId::kAllReduceAbandoned: return "all_reduce";
    case OpId::kAllReduceCopyEngine: return "all_reduce (copy engines)";
  }
  return "?";
}

ffi::ErrorOr<GroupSpec> FindGroup(OpId op, I32Span group_ordinals, int32_t n,
                                  int cuda_ordinal) {
  const int self = TransportId(cuda_ordinal);
  const std::string where = std::string("jax_flashoverlap ") + OpName(op);
  if (n < 1 || group_ordinals.size() % n != 0 || group_ordinals.size() == 0) {
    return ffi::Error::InvalidArgument(
        where + ": group_ordinals has " +
        std::to_string(group_ordinals.size()) +
        " entries, expected a positive multiple of n = " + std::to_string(n));
  }
  for (size_t g = 0; g < group_ordinals.size(); g += n) {
    for (int r = 0; r < n; ++r) {
      if (group_ordinals[g + r] != self) continue;
      GroupSpec spec;
      spec.ids.assign(group_ordinals.begin() + g, group_ordinals.begin() + g + n);
      spec.rank = r;
      spec.n = n;
      spec.cuda_ordinal = cuda_ordinal;
      std::set<int> unique(spec.ids.begin(), spec.ids.end());
      if (static_cast<int>(unique.size()) != n) {
        return ffi::Error::InvalidArgument(where + ": a group lists a device twice");
      }
      return spec;
    }
  }
  if (self < 0) {
    return ffi::Error::InvalidArgument(
        where + ": CUDA device " + std::to_string(cuda_ordinal) +
        " of this process is not a device of the configured node");
  }
  return ffi::Error::InvalidArgument(where + ": " + DeviceLabel(self) +
                                     " is in no group of group_ordinals");
}

ffi::Error EnsureGroupReady(OpId op, const GroupSpec& group, int timeout_ms) {
  const int self = group.ids[group.rank];
  std::unique_lock<std::mutex> lock(g_mu);
  auto& members = g_registered[group.ids];
  if (static_cast<int>(members.size()) == group.n) return ffi::Error::Success();
  JFO_RETURN_IF_ERROR(LoadDriverEntryPoints());
  auto st = GetOrCreateDevice(self);
  if (st.has_error()) return st.error();
  JFO_RETURN_IF_ERROR(EnablePeerAccess(group.cuda_ordinal, group.ids));
  members.insert(self);
  // Another process's device was allocated before its workspace was
  // exported, and imported here before any op (node.cu): it is ready.
  for (int id : group.ids) {
    auto it = g_devices.find(id);
    if (it != g_devices.end() && it->second->remote) members.insert(id);
  }
  g_cv.notify_all();
  // No device may use a peer pointer before every member has allocated.
  const bool ok = g_cv.wait_for(
      lock, std::chrono::milliseconds(timeout_ms),
      [&] { return static_cast<int>(members.size()) == group.n; });
  if (ok) return ffi::Error::Success();
  // This device counts as a member from here on, so a late peer will run the
  // call and wait for it: the group has failed.
  const std::string why = DeviceLabel(self) + " gave up waiting for its group to initialize";
  for (int id : group.ids) FailLocked(id, why);
  std::string missing;
  for (int id : group.ids) {
    if (members.count(id)) continue;
    missing += (missing.empty() ? "" : ", ") + DeviceLabel(id);
  }
  return ffi::Error::Internal(
      std::string("jax_flashoverlap ") + OpName(op) + ": " + DeviceLabel(self) + " waited " +
      std::to_string(timeout_ms) + " ms for {" + missing +
      "} of its group to initialize; every device of the group must run the op");
}

std::string WithTimeoutHint(const std::string& records) {
  return records + "\n(README, Troubleshooting: 'timed out waiting for rank')";
}

namespace {

// Every device's record, one per line (two ranks waiting for each other both
// say what they waited for), or ""; marks each record's devices failed. Under g_mu.
std::string TakeRecords() {
  std::string all;
  for (auto& [id, st] : g_devices) {
    if (st->remote || !__atomic_load_n(&st->record->set, __ATOMIC_ACQUIRE)) continue;
    const int peer = st->record->peer_ordinal;  // fixed while `set` is 1
    std::string msg = TakeRecord(st.get());
    if (msg.empty()) continue;
    all += (all.empty() ? "" : "\n") + msg;
    FailLocked(id, msg);
    FailLocked(peer, msg);
  }
  return all.empty() ? all : WithTimeoutHint(all);
}

// "{CUDA device a, CUDA device b}" of `ids` that failed, and the first
// fault of the first of them; "" if none did. Called under g_mu.
std::string FailedAmong(const std::vector<int>& ids, std::string* why) {
  std::string failed;
  for (int id : ids) {
    auto it = g_failed.find(id);
    if (it == g_failed.end()) continue;
    failed += (failed.empty() ? "" : ", ") + DeviceLabel(id);
    if (why->empty()) *why = it->second;
  }
  return failed.empty() ? failed : "{" + failed + "}";
}

}  // namespace

std::string TakePendingError() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::string records = TakeRecords();
  if (!records.empty() || g_failed.empty()) return records;
  std::vector<int> all;
  for (const auto& [id, why] : g_failed) all.push_back(id);
  std::string why;
  const std::string failed = FailedAmong(all, &why);
  return "jax_flashoverlap: " + failed + " failed earlier, so every call on "
         "their groups fails until jax_flashoverlap.reset(). The first fault: " +
         why;
}

void MarkFailed(const std::vector<int>& ids, const std::string& why) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (int id : ids) FailLocked(id, why);
}

ffi::Error CheckGroupHealthy(OpId op, const GroupSpec& group) {
  std::lock_guard<std::mutex> lock(g_mu);
  const std::string records = TakeRecords();
  std::string why;
  const std::string failed = FailedAmong(group.ids, &why);
  if (failed.empty()) return ffi::Error::Success();
  return ffi::Error::Internal(
      std::string("jax_flashoverlap ") + OpName(op) + ": " + failed +
      " of this group failed earlier, so every call on it fails until "
      "jax_flashoverlap.reset(). The first fault: " + why +
      (records.empty() ? "" : "\nRecorded now: " + records));
}

std::string ResetTransport() {
  std::vector<DeviceState*> devices;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    // Another process's device is reset by its own process
    // (jax_flashoverlap.reset() runs in every process between two barriers).
    for (auto& [id, st] : g_devices) {
      if (!st->remote) devices.push_back(st.get());
    }
  }
  // No call in flight on any device (the same order as every caller: a
  // Channel takes its device's lock before g_mu).
  std::vector<std::unique_lock<std::mutex>> held;
  for (DeviceState* st : devices) held.emplace_back(st->mu);
  // Every wait of the transport gives up within its timeout, so this ends.
  for (DeviceState* st : devices) {
    DeviceGuard guard(st->cuda_ordinal);
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      return DeviceLabel(st->id) + " reports an error (" + cudaGetErrorString(err) +
             "); the process must restart";
    }
  }
  // Under g_mu: a failure marked meanwhile (FailLocked) lands before the
  // clearing or after g_failed's, never only on the device.
  std::lock_guard<std::mutex> lock(g_mu);
  for (DeviceState* st : devices) {
    DeviceGuard guard(st->cuda_ordinal);
    ffi::Error cleared = ClearControl(st);
    if (cleared.failure()) {
      return "clearing " + DeviceLabel(st->id) + ": " + std::string(cleared.message());
    }
    std::fill(st->pair_calls.begin(), st->pair_calls.end(), 0u);
    __atomic_store_n(&st->record->set, 0, __ATOMIC_RELEASE);
  }
  g_failed.clear();
  g_fault = InjectedFault{};
  g_fault_armed.store(false);
  return "";
}

void InjectFault(FaultKind kind, int id, int calls, int stall_ms) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_fault = InjectedFault{kind, id, calls, stall_ms};
  g_fault_armed.store(kind != FaultKind::kNone);
}

FaultKind TakeFault(int id, int* stall_ms) {
  if (!g_fault_armed.load()) return FaultKind::kNone;
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_fault.kind == FaultKind::kNone || g_fault.id != id ||
      --g_fault.calls > 0) {
    return FaultKind::kNone;
  }
  const FaultKind kind = g_fault.kind;
  *stall_ms = g_fault.stall_ms;
  g_fault = InjectedFault{};
  g_fault_armed.store(false);
  return kind;
}

std::string ModuleLoadingMode() {
  using GetLoadingModeFn = CUresult (*)(CUmoduleLoadingMode*);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult query;
  if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 11070,
                                       cudaEnableDefault,
                                       &query) != cudaSuccess ||
      query != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();  // no driver here: not an error of a later call
    return "unknown";
  }
  CUmoduleLoadingMode mode;
  if (reinterpret_cast<GetLoadingModeFn>(fn)(&mode) != CUDA_SUCCESS) {
    return "unknown";  // e.g. CUDA not initialised in this process
  }
  return mode == CU_MODULE_LAZY_LOADING ? "lazy" : "eager";
}

}  // namespace jfo
