// Peer transport: several GPUs driven by one process (jax.shard_map on local
// devices). Data moves on copy engines (cudaMemcpyAsync into a peer pointer),
// signals are stream memory ops (cuStreamWriteValue32) into the receiver's
// flag, waits are one-thread kernels with a timeout.
//
// Flow control. Every ordered pair (sender s, receiver d) has one flag word in
// d's workspace. Each message raises it to the next epoch; epochs only grow
// (a flag is never reset), so a waiter checks `flag >= epoch` and a late or
// repeated signal cannot satisfy a future wait early. Both sides count epochs
// on the host: the handlers run their host code every call (they are not
// command-buffer compatible), and every op sends the same number of messages
// in both directions of a pair.
//
// Slot reuse. The receive slot of a pair is double-buffered by call parity,
// and a call's sends are ordered after that call's start on the sender's XLA
// stream. The sender can write the slot of call k again only at call k+2;
// call k+2 starts after its call k+1 finished, which needed the receiver's
// call k+1 messages, which the receiver sends only after starting call k+1,
// i.e. after it finished reading (End joins all readers) the slot of call k.
//
// The symmetric all-reduce region inside the same workspace is laid out and
// handed out by peer_region.cu.
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "peer_kernels.cuh"
#include "peer_state.h"

namespace jfo {
namespace {


using internal::FillIfFailedKernel;
using internal::FillWordsKernel;
using internal::WaitFlagKernel;

using WriteValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t,
                                    unsigned int);

}  // namespace

namespace {

std::mutex g_mu;
std::condition_variable g_cv;
std::map<int, std::unique_ptr<DeviceState>> g_devices;
std::map<std::vector<int>, std::set<int>> g_registered;  // group -> members
WriteValue32Fn g_write_value32 = nullptr;

// The range jax_flashoverlap/settings.py accepts; anything else is an error,
// never a silent 64 MiB or a size that wraps around.
constexpr size_t kMinWorkspaceMb = 64, kMaxWorkspaceMb = size_t{1} << 20;

ffi::ErrorOr<size_t> WorkspaceBytesFromEnv() {
  const char* env = std::getenv("JAX_FLASHOVERLAP_WORKSPACE_MB");
  if (env == nullptr) return size_t{1024} << 20;
  const std::string raw(env);
  const size_t first = raw.find_first_not_of(' ');
  const size_t last = raw.find_last_not_of(' ');
  const bool digits = first != std::string::npos && last - first < 8 &&
                      raw.find_first_not_of("0123456789", first) > last;
  const size_t mb = digits ? std::stoull(raw.substr(first, last - first + 1)) : 0;
  if (mb < kMinWorkspaceMb || mb > kMaxWorkspaceMb) {
    return ffi::Error::InvalidArgument(
        "JAX_FLASHOVERLAP_WORKSPACE_MB='" + raw +
        "': expected an integer number of MiB from 64 to 1048576");
  }
  return mb << 20;
}

ffi::Error LoadDriverEntryPoints() {
  if (g_write_value32) return ffi::Error::Success();
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult query;
  JFO_CUDA_RETURN_IF_ERROR(cudaGetDriverEntryPointByVersion(
      "cuStreamWriteValue32", &fn, 12000, cudaEnableDefault, &query));
  if (query != cudaDriverEntryPointSuccess || fn == nullptr) {
    return ffi::Error::Internal(
        "jax_flashoverlap: the CUDA driver has no cuStreamWriteValue32");
  }
  g_write_value32 = reinterpret_cast<WriteValue32Fn>(fn);
  return ffi::Error::Success();
}

// Allocates everything a device needs once; called under g_mu.
ffi::ErrorOr<DeviceState*> GetOrCreateDevice(int ordinal) {
  auto it = g_devices.find(ordinal);
  if (it != g_devices.end()) return it->second.get();
  auto st = std::make_unique<DeviceState>();
  st->ordinal = ordinal;
  DeviceGuard guard(ordinal);
  JFO_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&st->num_devices));
  auto workspace_bytes = WorkspaceBytesFromEnv();
  if (workspace_bytes.has_error()) return workspace_bytes.error();
  const size_t bytes = *workspace_bytes;
  JFO_CUDA_RETURN_IF_ERROR(cudaMalloc(&st->workspace, bytes));
  char* control = st->workspace + kGemmWorkspaceBytes;
  st->flags = reinterpret_cast<uint32_t*>(control);
  st->fail_call = reinterpret_cast<uint32_t*>(control + kFailWordOffset);
  st->record_lock = reinterpret_cast<uint32_t*>(control + kRecordLockOffset);
  const size_t data = bytes - kGemmWorkspaceBytes - kControlBytes;
  // A quarter for the all-reduce region. Of the rest, a peer needs one staged
  // message per peer and receives two (parities): staging one third, receive
  // slots two thirds.
  const size_t ar_bytes = data / 4 / 256 * 256;
  char* ar = control + kControlBytes;
  JFO_RETURN_IF_ERROR(LayOutAllReduceRegion(st.get(), control, ar, ar_bytes));
  st->staging = ar + ar_bytes;
  st->staging_bytes = (data - ar_bytes) / 3 / 256 * 256;
  st->recv = st->staging + st->staging_bytes;
  st->slot_bytes = (data - ar_bytes - st->staging_bytes) /
                   (2 * SenderCount(st->num_devices)) / 256 * 256;
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
  st->sent_epoch.assign(st->num_devices, 0);
  st->recv_epoch.assign(st->num_devices, 0);
  st->pair_calls.assign(st->num_devices, 0);
  // Load our kernels now: with CUDA lazy loading, a first launch while a
  // wait kernel spins can block until that wait times out.
  cudaFuncAttributes attrs;
  JFO_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attrs, WaitFlagKernel));
  JFO_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attrs, FillIfFailedKernel<uint16_t>));
  JFO_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attrs, FillIfFailedKernel<uint32_t>));
  JFO_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(control, 0, kControlBytes, st->copy_stream));
  FillWordsKernel<<<256, 256, 0, st->copy_stream>>>(
      reinterpret_cast<uint32_t*>(st->lamport_slots),
      st->lamport_slots_bytes / sizeof(uint32_t), kLamportEmpty);
  JFO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  JFO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st->copy_stream));
  DeviceState* raw = st.get();
  g_devices[ordinal] = std::move(st);
  return raw;
}

ffi::Error EnablePeerAccess(int ordinal, const std::vector<int>& peers) {
  DeviceGuard guard(ordinal);
  for (int p : peers) {
    if (p == ordinal) continue;
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

std::string FormatTimeout(const TimeoutRecord& r) {
  const OpId op = static_cast<OpId>(r.op);
  if (op == OpId::kAllReduceAbandoned) {
    return std::string("jax_flashoverlap ") + OpName(op) + ": rank " +
           std::to_string(r.rank) + " (CUDA device " +
           std::to_string(r.ordinal) + ") found that rank " +
           std::to_string(r.peer_rank) + " (CUDA device " +
           std::to_string(r.peer_ordinal) + ") had given up on epoch " +
           std::to_string(r.expected) + " after its " +
           std::to_string(r.timeout_ms) + " ms timeout";
  }
  const std::string what =
      op == OpId::kAllReduceLamport
          ? "its data of call " + std::to_string(r.expected) +
                " of the pair (Lamport calls on this device now return NaN "
                "until the process restarts)"
          : "epoch " + std::to_string(r.expected) + " (flag holds " +
                std::to_string(r.seen) + ")";
  return std::string("jax_flashoverlap ") + OpName(op) + ": rank " +
         std::to_string(r.rank) + " (CUDA device " + std::to_string(r.ordinal) +
         ") timed out after " + std::to_string(r.timeout_ms) +
         " ms waiting for rank " + std::to_string(r.peer_rank) +
         " (CUDA device " + std::to_string(r.peer_ordinal) + "), " + what;
}

}  // namespace

DeviceState* LookupDevice(int ordinal) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_devices.find(ordinal);
  return it == g_devices.end() ? nullptr : it->second.get();
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
  }
  return "?";
}

ffi::ErrorOr<GroupSpec> FindGroup(OpId op, I32Span group_ordinals, int32_t n,
                                  int ordinal) {
  const std::string where = std::string("jax_flashoverlap ") + OpName(op);
  if (n < 1 || group_ordinals.size() % n != 0 || group_ordinals.size() == 0) {
    return ffi::Error::InvalidArgument(
        where + ": group_ordinals has " +
        std::to_string(group_ordinals.size()) +
        " entries, expected a positive multiple of n = " + std::to_string(n));
  }
  for (size_t g = 0; g < group_ordinals.size(); g += n) {
    for (int r = 0; r < n; ++r) {
      if (group_ordinals[g + r] != ordinal) continue;
      GroupSpec spec;
      spec.ordinals.assign(group_ordinals.begin() + g,
                           group_ordinals.begin() + g + n);
      spec.rank = r;
      spec.n = n;
      std::set<int> unique(spec.ordinals.begin(), spec.ordinals.end());
      if (static_cast<int>(unique.size()) != n) {
        return ffi::Error::InvalidArgument(
            where + ": a group lists a CUDA ordinal twice");
      }
      return spec;
    }
  }
  return ffi::Error::InvalidArgument(
      where + ": CUDA device " + std::to_string(ordinal) +
      " is in no group of group_ordinals");
}

ffi::Error EnsureGroupReady(OpId op, const GroupSpec& group, int timeout_ms) {
  const int self = group.ordinals[group.rank];
  std::unique_lock<std::mutex> lock(g_mu);
  auto& members = g_registered[group.ordinals];
  if (static_cast<int>(members.size()) == group.n) return ffi::Error::Success();
  JFO_RETURN_IF_ERROR(LoadDriverEntryPoints());
  auto st = GetOrCreateDevice(self);
  if (st.has_error()) return st.error();
  JFO_RETURN_IF_ERROR(EnablePeerAccess(self, group.ordinals));
  members.insert(self);
  g_cv.notify_all();
  // No device may use a peer pointer before every member has allocated.
  const bool ok = g_cv.wait_for(
      lock, std::chrono::milliseconds(timeout_ms),
      [&] { return static_cast<int>(members.size()) == group.n; });
  if (ok) return ffi::Error::Success();
  std::string missing;
  for (int o : group.ordinals) {
    if (members.count(o)) continue;
    missing += (missing.empty() ? "" : ", ") + std::to_string(o);
  }
  return ffi::Error::Internal(
      std::string("jax_flashoverlap ") + OpName(op) + ": CUDA device " +
      std::to_string(self) + " waited " + std::to_string(timeout_ms) +
      " ms for CUDA devices {" + missing +
      "} of its group to initialize; every device of the group must run "
      "the op");
}

std::string WithTimeoutHint(const std::string& records) {
  return records + "\n(README, Troubleshooting: 'timed out waiting for rank')";
}

// Every device's record, one per line: when two ranks wait for each other,
// both sides say what they waited for.
std::string TakePendingError() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::string all;
  for (auto& [ordinal, st] : g_devices) {
    std::string msg = TakeRecord(st.get());
    if (!msg.empty()) all += (all.empty() ? "" : "\n") + msg;
  }
  return all.empty() ? all : WithTimeoutHint(all);
}

bool PeerStoresAllowed(const void* ptr, const GroupSpec& group) {
  static const bool disabled = [] {
    const char* env = std::getenv("JAX_FLASHOVERLAP_PEER_STORES");
    return env != nullptr && std::string(env) == "0";
  }();
  using GetAttributeFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
  static const GetAttributeFn get_attribute = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult query;
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", &fn, 12000,
                                         cudaEnableDefault,
                                         &query) != cudaSuccess ||
        query != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<GetAttributeFn>(fn);
  }();
  if (disabled || get_attribute == nullptr) return false;
  // XLA's allocators map their memory into every local GPU (virtual memory
  // with access set per device, or pools with peer access), but a user's
  // allocator need not: ask each peer's context, whose access the attribute
  // reports.
  for (int q = 0; q < group.n; ++q) {
    if (q == group.rank) continue;
    DeviceGuard on_peer(group.ordinals[q]);
    unsigned int flags = 0;
    if (get_attribute(&flags, CU_POINTER_ATTRIBUTE_ACCESS_FLAGS,
                      reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS ||
        flags != CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE) {
      cudaGetLastError();
      return false;
    }
  }
  return true;
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

ffi::Error Channel::Begin(OpId op, const GroupSpec& group, int timeout_ms,
                          cudaStream_t stream) {
  JFO_RETURN_IF_ERROR(EnsureGroupReady(op, group, timeout_ms));
  dev_ = LookupDevice(group.ordinals[group.rank]);
  lock_ = std::unique_lock<std::mutex>(dev_->mu);
  std::string pending = TakeRecord(dev_);
  if (!pending.empty()) return ffi::Error::Internal(WithTimeoutHint(pending));
  group_ = &group;
  op_ = op;
  stream_ = stream;
  timeout_ns_ = static_cast<uint64_t>(timeout_ms) * 1000000ull;
  call_id_ = ++dev_->call_id;
  events_used_ = 0;
  sent_.assign(group.n, 0);
  parity_.assign(group.n, 0);
  for (int r = 0; r < group.n; ++r) {
    parity_[r] = static_cast<int>(dev_->pair_calls[group.ordinals[r]] & 1);
  }
  auto start = NextEvent();
  if (start.has_error()) return start.error();
  start_ = *start;
  JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(start_, stream_));
  return ffi::Error::Success();
}

ffi::Error Channel::Run(const std::function<ffi::Error()>& schedule) {
  rehearsal_ = true;
  events_rehearsed_ = 0;
  ffi::Error rehearsed = schedule();
  rehearsal_ = false;
  if (rehearsed.failure()) return rehearsed;
  // The budget is checked here, before anything is sent: an error halfway
  // through the real pass would leave the peers' counters out of step. End
  // takes one event per side stream: the copy stream and two per peer.
  const int needed = events_used_ + events_rehearsed_ + 1 + 2 * (group_->n - 1);
  if (needed > kEventsPerCall) {
    return ffi::Error::InvalidArgument(
        std::string("jax_flashoverlap ") + OpName(op_) + ": the schedule needs " +
        std::to_string(needed) + " events per call, more than " +
        std::to_string(kEventsPerCall) + "; use fewer chunks");
  }
  return schedule();
}

ffi::Error Channel::CheckCapacity(size_t slot_bytes,
                                  size_t staging_bytes) const {
  if (slot_bytes <= dev_->slot_bytes && staging_bytes <= dev_->staging_bytes) {
    return ffi::Error::Success();
  }
  return ffi::Error::InvalidArgument(
      std::string("jax_flashoverlap ") + OpName(op_) + ": needs " +
      std::to_string(slot_bytes >> 20) + " MiB per receive slot and " +
      std::to_string(staging_bytes >> 20) +
      " MiB of staging, the workspace has " +
      std::to_string(dev_->slot_bytes >> 20) + " and " +
      std::to_string(dev_->staging_bytes >> 20) +
      " MiB; raise JAX_FLASHOVERLAP_WORKSPACE_MB (before the first call)");
}

char* Channel::RecvSlot(int peer_rank) const {
  return dev_->Slot(group_->ordinals[peer_rank], parity_[peer_rank]);
}

char* Channel::Staging() const { return dev_->staging; }

void* Channel::GemmWorkspace(size_t* bytes) const {
  *bytes = kGemmWorkspaceBytes;
  return dev_->workspace;
}

ffi::ErrorOr<cudaEvent_t> Channel::NextEvent() {
  if (events_used_ == kEventsPerCall) {
    return ffi::Error::InvalidArgument(
        std::string("jax_flashoverlap ") + OpName(op_) +
        ": schedule needs more than " + std::to_string(kEventsPerCall) +
        " events per call; use fewer chunks");
  }
  return dev_->events[events_used_++];
}

ffi::ErrorOr<cudaEvent_t> Channel::Mark() {
  if (rehearsal_) {
    ++events_rehearsed_;  // the real pass takes one
    return start_;
  }
  auto ev = NextEvent();
  if (ev.has_error()) return ev;
  JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(*ev, stream_));
  return ev;
}

ffi::Error Channel::WaitOn(cudaEvent_t event) {
  if (rehearsal_) return ffi::Error::Success();
  JFO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, event, 0));
  return ffi::Error::Success();
}

ffi::ErrorOr<int> Channel::Send(int peer_rank, size_t offset, const void* src,
                                size_t bytes, cudaEvent_t after) {
  if (rehearsal_) return 0;
  const int peer = group_->ordinals[peer_rank];
  const int self = group_->ordinals[group_->rank];
  DeviceState* dst = LookupDevice(peer);
  cudaStream_t s = dev_->send_streams[peer];
  JFO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, after ? after : start_, 0));
  if (bytes > 0) {
    char* remote = dst->Slot(self, parity_[peer_rank]) + offset;
    JFO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(remote, src, bytes,
                                             cudaMemcpyDeviceToDevice, s));
  }
  // The default flags order the write after the copy's data is visible.
  const uint32_t epoch = ++dev_->sent_epoch[peer];
  CUresult res = g_write_value32(
      reinterpret_cast<CUstream>(s),
      reinterpret_cast<CUdeviceptr>(dst->flags + self), epoch, 0);
  if (res != CUDA_SUCCESS) {
    return ffi::Error::Internal("jax_flashoverlap: cuStreamWriteValue32 failed "
                                "with CUresult " + std::to_string(res));
  }
  return sent_[peer_rank]++;
}

ffi::ErrorOr<cudaEvent_t> Channel::Arrival(int peer_rank, int index) {
  if (rehearsal_) {
    ++events_rehearsed_;  // the real pass takes one
    return start_;
  }
  const int peer = group_->ordinals[peer_rank];
  cudaStream_t s = waits_on_xla_stream_ ? stream_ : dev_->wait_streams[peer];
  if (!waits_on_xla_stream_) {
    // A wait starts its clock with the call, not while the stream runs ahead.
    JFO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, start_, 0));
  }
  TimeoutRecord info{};
  info.op = static_cast<int32_t>(op_);
  info.rank = group_->rank;
  info.ordinal = group_->ordinals[group_->rank];
  info.peer_rank = peer_rank;
  info.peer_ordinal = peer;
  info.timeout_ms = static_cast<int32_t>(timeout_ns_ / 1000000ull);
  const uint32_t expected = dev_->recv_epoch[peer] + index + 1;
  WaitFlagKernel<<<1, 1, 0, s>>>(dev_->flags + peer, expected, timeout_ns_,
                                 dev_->fail_call, call_id_, dev_->record,
                                 dev_->record_lock, info);
  JFO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  auto ev = NextEvent();
  if (ev.has_error()) return ev;
  JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(*ev, s));
  return ev;
}

ffi::Error Channel::CopyLocal(void* dst, const void* src, size_t bytes,
                              cudaEvent_t after) {
  if (rehearsal_) return ffi::Error::Success();
  cudaStream_t s = dev_->copy_stream;
  JFO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, after ? after : start_, 0));
  JFO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
  return ffi::Error::Success();
}

ffi::Error Channel::End(const std::vector<Output>& outputs) {
  std::vector<cudaStream_t> side = {dev_->copy_stream};
  for (int r = 0; r < group_->n; ++r) {
    if (r == group_->rank) continue;
    const int peer = group_->ordinals[r];
    side.push_back(dev_->send_streams[peer]);
    side.push_back(dev_->wait_streams[peer]);
    // Symmetric schedules: the peer sent us as many messages as we sent it.
    dev_->recv_epoch[peer] += sent_[r];
    dev_->pair_calls[peer] += 1;
  }
  for (cudaStream_t s : side) {
    auto ev = NextEvent();
    if (ev.has_error()) return ev.error();
    JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(*ev, s));
    JFO_RETURN_IF_ERROR(WaitOn(*ev));
  }
  if (group_->n == 1 || outputs.empty()) return ffi::Error::Success();
  // Wrong results must be visible: NaN everywhere after a timed-out wait.
  const Output& a = outputs[0];
  const Output b =
      outputs.size() > 1 ? outputs[1] : Output{nullptr, 0, a.dtype};
  const size_t bytes = DataTypeBytes(a.dtype);
  if (bytes == 4) {
    FillIfFailedKernel<uint32_t><<<264, 256, 0, stream_>>>(
        static_cast<uint32_t*>(a.data), a.elements,
        static_cast<uint32_t*>(b.data), b.elements, 0x7FC00000u,
        dev_->fail_call, call_id_);
  } else {
    const uint16_t nan = a.dtype == ffi::DataType::BF16 ? 0x7FC0 : 0x7E00;
    FillIfFailedKernel<uint16_t><<<264, 256, 0, stream_>>>(
        static_cast<uint16_t*>(a.data), a.elements,
        static_cast<uint16_t*>(b.data), b.elements, nan, dev_->fail_call,
        call_id_);
  }
  JFO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace jfo
