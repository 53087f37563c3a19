// The Channel (transport.h) of the peer transport: one call of one op on one
// device, moving data on copy engines and signalling with stream memory ops
// (cuStreamWriteValue32) into the receiver's flag, waiting with kernels of
// one warp at most with a timeout. Flow control and slot reuse: see peer.cu, which
// owns the devices' state.
#include <cuda.h>

#include <algorithm>
#include <string>
#include <utility>

#include "peer_kernels.cuh"
#include "peer_state.h"

namespace jfo {
namespace {

using internal::FillIfFailedKernel;
using internal::FillWordsKernel;
using internal::SleepKernel;
using internal::WaitFlagKernel;

using StreamValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t,
                                     unsigned int);

StreamValue32Fn g_write_value32 = nullptr;
StreamValue32Fn g_wait_value32 = nullptr;

}  // namespace

ffi::Error Stall(cudaStream_t stream, int ms) {
  SleepKernel<<<1, 1, 0, stream>>>(static_cast<uint64_t>(ms) * 1000000ull);
  JFO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

ffi::Error WriteFlag(cudaStream_t stream, uint32_t* flag, uint32_t value) {
  JFO_RETURN_IF_ERROR(LoadDriverEntryPoints());
  // The default flags order the write after the earlier work's data is visible.
  CUresult res = g_write_value32(reinterpret_cast<CUstream>(stream),
                                 reinterpret_cast<CUdeviceptr>(flag), value, 0);
  if (res != CUDA_SUCCESS) {
    return ffi::Error::Internal("jax_flashoverlap: cuStreamWriteValue32 failed "
                                "with CUresult " + std::to_string(res));
  }
  return ffi::Error::Success();
}

ffi::Error LoadDriverEntryPoints() {
  if (g_write_value32 && g_wait_value32) return ffi::Error::Success();
  for (auto [name, slot] : {std::pair{"cuStreamWriteValue32", &g_write_value32},
                            std::pair{"cuStreamWaitValue32", &g_wait_value32}}) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult query;
    JFO_CUDA_RETURN_IF_ERROR(cudaGetDriverEntryPointByVersion(
        name, &fn, 12000, cudaEnableDefault, &query));
    if (query != cudaDriverEntryPointSuccess || fn == nullptr) {
      return ffi::Error::Internal(std::string("jax_flashoverlap: the CUDA driver has no ") +
                                  name);
    }
    *slot = reinterpret_cast<StreamValue32Fn>(fn);
  }
  return ffi::Error::Success();
}

ffi::Error LoadChannelKernels() {
  cudaFuncAttributes attrs;
  JFO_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attrs, WaitFlagKernel));
  JFO_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attrs, FillIfFailedKernel<uint16_t>));
  JFO_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attrs, FillIfFailedKernel<uint32_t>));
  JFO_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attrs, SleepKernel));
  return ffi::Error::Success();
}

void LaunchFillWords(uint32_t* words, size_t count, uint32_t value,
                     cudaStream_t stream) {
  FillWordsKernel<<<256, 256, 0, stream>>>(words, count, value);
}

Channel::~Channel() {
  if (committed_ && !ended_) {
    MarkFailed(group_->ids,
               std::string("jax_flashoverlap ") + OpName(op_) + ": rank " +
                   std::to_string(group_->rank) + " (" + DeviceLabel(id()) +
                   ") stopped in the middle of a "
                   "call: " + (failure_.empty() ? "an error" : failure_));
    JoinSideStreams();
  }
}

// After an error return: the copies and waits already enqueued on the side
// streams read XLA's inputs and write its outputs, so XLA's stream (and the
// device's next call) must not run ahead of them. Best effort: the call is
// failing already.
void Channel::JoinSideStreams() {
  std::vector<cudaStream_t> side = {dev_->copy_stream};
  for (int r = 0; r < group_->n; ++r) {
    if (r == group_->rank) continue;
    side.push_back(dev_->send_streams[group_->ids[r]]);
    side.push_back(dev_->wait_streams[group_->ids[r]]);
  }
  for (cudaStream_t s : side) {
    cudaEvent_t done;
    bool joined = false;
    if (cudaEventCreateWithFlags(&done, cudaEventDisableTiming) == cudaSuccess) {
      joined = cudaEventRecord(done, s) == cudaSuccess &&
               cudaStreamWaitEvent(stream_, done, 0) == cudaSuccess;
      cudaEventDestroy(done);  // released once it completes
    }
    // Without the join the host waits instead (each wait is bounded).
    if (!joined) cudaStreamSynchronize(s);
  }
  cudaEventRecord(dev_->last_end, stream_);
  cudaGetLastError();  // the error being reported is the call's own
}

std::string DebugWaitFlag(int ordinal, uint32_t flag, uint32_t expected,
                          int timeout_ms, uint32_t their_fingerprint,
                          uint32_t own_fingerprint) {
  DeviceGuard guard(ordinal);
  uint32_t* words = nullptr;  // [flag, fail_call, record_lock, fingerprint]
  TimeoutRecord* record = nullptr;
  std::string result;
  auto check = [&](cudaError_t err) {
    if (err != cudaSuccess && result.empty()) {
      result = std::string("CUDA error: ") + cudaGetErrorString(err);
    }
    return err == cudaSuccess;
  };
  if (check(cudaMalloc(&words, 4 * sizeof(uint32_t))) &&
      check(cudaHostAlloc(&record, sizeof(TimeoutRecord),
                          cudaHostAllocMapped | cudaHostAllocPortable))) {
    *record = TimeoutRecord{};
    const uint32_t init[4] = {flag, 0, 0, their_fingerprint};
    WaitReport report{static_cast<uint64_t>(timeout_ms) * 1000000ull, words + 1, 1, record,
                      words + 2, TimeoutRecord{}};
    if (own_fingerprint != 0) {
      report.fingerprint = words + 3;
      report.own_fingerprint = own_fingerprint;
    }
    if (check(cudaMemcpy(words, init, sizeof(init), cudaMemcpyHostToDevice))) {
      WaitFlagKernel<<<1, 1>>>(words, expected, report, nullptr, 0);
      if (check(cudaGetLastError()) && check(cudaDeviceSynchronize())) {
        result = !record->set                        ? "reached"
                 : record->cause == kOutOfStep       ? "out of step"
                 : record->cause == kCallMismatch    ? "another call"
                                                     : "timed out";
      }
    }
  }
  if (record) cudaFreeHost(record);
  if (words) cudaFree(words);
  return result;
}

ffi::Error Channel::Begin(OpId op, const GroupSpec& group, int timeout_ms,
                          cudaStream_t stream, uint32_t fingerprint) {
  JFO_RETURN_IF_ERROR(EnsureGroupReady(op, group, timeout_ms));
  dev_ = LookupDevice(group.ids[group.rank]);
  lock_ = std::unique_lock<std::mutex>(dev_->mu);
  JFO_RETURN_IF_ERROR(CheckGroupHealthy(op, group));
  group_ = &group;
  op_ = op;
  stream_ = stream;
  // From here on the peers may run this call: any error is a fault.
  committed_ = true;
  int stall_ms = 0;
  fault_ = TakeFault(id(), &stall_ms);
  if (fault_ == FaultKind::kSkip) {
    failure_ = "injected fault: this call was skipped";
    return ffi::Error::Internal(std::string("jax_flashoverlap ") + OpName(op) +
                                ": " + failure_);
  }
  if (fault_ == FaultKind::kStall) JFO_RETURN_IF_ERROR(Stall(stream_, stall_ms));
  // Calls of this device in host order, whichever stream each came on.
  JFO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, dev_->last_end, 0));
  timeout_ns_ = static_cast<uint64_t>(timeout_ms) * 1000000ull;
  // 0 is fail_call's value after a reset: a call with that id would find
  // itself failed, its waits returning before their messages.
  call_id_ = ++dev_->call_id;
  if (call_id_ == 0) call_id_ = ++dev_->call_id;
  events_used_ = 0;
  sent_.assign(group.n, 0);
  parity_.assign(group.n, 0);
  fingerprint_ = fingerprint;
  for (int r = 0; r < group.n; ++r) {
    parity_[r] = static_cast<int>(dev_->pair_calls[group.ids[r]] & 1);
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
  local_flags_ = 0;
  ffi::Error rehearsed = schedule();
  rehearsal_ = false;
  local_flags_ = 0;
  // A rehearsal can fail on one rank only (its GEMMs run cuBLASLt, which may
  // fail on one device) while the peers send: a fault, which the destructor
  // marks.
  if (rehearsed.failure()) {
    failure_ = rehearsed.message();
    return rehearsed;
  }
  // The budget is checked here, before anything is sent: an error halfway
  // through the real pass would leave the peers' counters out of step. End
  // takes one event per side stream: the copy stream and two per peer.
  const int needed = events_used_ + events_rehearsed_ + 1 + 2 * (group_->n - 1);
  if (needed > kEventsPerCall) {
    // Nothing has moved yet. The rehearsal's GEMMs are still queued on the
    // stream, so the device's next call waits for them.
    JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(dev_->last_end, stream_));
    return Refuse(ffi::Error::InvalidArgument(
        std::string("jax_flashoverlap ") + OpName(op_) + ": the schedule needs " +
        std::to_string(needed) + " events per call, more than " +
        std::to_string(kEventsPerCall) + "; use fewer chunks"));
  }
  ffi::Error done = schedule();
  // An injected error after the schedule: it sent nothing (a group of one).
  if (done.success() && fault_ == FaultKind::kError) done = InjectedError();
  if (done.failure()) failure_ = done.message();
  return done;
}

ffi::Error Channel::InjectedError() {
  fault_ = FaultKind::kNone;
  return ffi::Error::Internal(std::string("jax_flashoverlap ") + OpName(op_) +
                              ": injected fault: an error in the middle of "
                              "the call");
}

ffi::Error Channel::CheckCapacity(size_t slot_bytes, size_t staging_bytes) {
  // Messages land in the peers' slots: the group's smallest decides, the
  // same on every rank.
  size_t slot = dev_->slot_bytes;
  for (int id : group_->ids) slot = std::min(slot, LookupDevice(id)->slot_bytes);
  if (slot_bytes <= slot && staging_bytes <= dev_->staging_bytes) {
    return ffi::Error::Success();
  }
  return Refuse(ffi::Error::InvalidArgument(
      std::string("jax_flashoverlap ") + OpName(op_) + ": needs " +
      std::to_string(slot_bytes >> 20) + " MiB per receive slot and " +
      std::to_string(staging_bytes >> 20) +
      " MiB of staging, the workspaces have " +
      std::to_string(slot >> 20) + " and " +
      std::to_string(dev_->staging_bytes >> 20) +
      " MiB; raise JAX_FLASHOVERLAP_WORKSPACE_MB (before the first call)"));
}

ffi::Error Channel::Refuse(ffi::Error why) {
  committed_ = false;
  failure_ = why.message();
  const int self = id();
  for (int r = 0; r < group_->n; ++r) {
    if (r == group_->rank) continue;
    const int peer = group_->ids[r];
    DeviceState* dst = LookupDevice(peer);
    cudaStream_t s = dev_->send_streams[peer];
    // On the pair's flag stream, after this call's start: after every flag
    // of the previous call. The flag passes every wait of the call.
    ffi::Error marked = ffi::Error::Success();
    if (cudaStreamWaitEvent(s, start_, 0) != cudaSuccess) {
      marked = ffi::Error::Internal("cudaStreamWaitEvent failed");
    }
    if (marked.success()) {
      marked = WriteFlag(s, dst->fingerprints + 2 * self + parity_[r], kRefusedFingerprint);
    }
    if (marked.success()) {
      marked = WriteFlag(s, dst->flags + self,
                         ChannelFlag(dev_->pair_calls[peer] + 1, kMaxMessagesPerCall));
    }
    if (marked.failure()) {  // the peers may wait for this call: a fault
      committed_ = true;
      return why;
    }
    dev_->pair_calls[peer] += 1;
  }
  cudaEventRecord(dev_->last_end, stream_);
  return why;
}

char* Channel::RecvSlot(int peer_rank) const {
  return dev_->Slot(group_->ids[peer_rank], parity_[peer_rank]);
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
  return SendWhen(peer_rank, offset, src, bytes, after, nullptr, 0);
}

ffi::ErrorOr<int> Channel::SendWhen(int peer_rank, size_t offset, const void* src,
                                    size_t bytes, cudaEvent_t after,
                                    const uint32_t* counter, uint32_t at_least) {
  if (rehearsal_) return 0;
  if (sent_[peer_rank] >= kMaxMessagesPerCall) {  // the event budget keeps it far off
    return ffi::Error::Internal(std::string("jax_flashoverlap ") + OpName(op_) +
                                ": more than " +
                                std::to_string(kMaxMessagesPerCall) +
                                " messages to one peer in a call");
  }
  const int peer = group_->ids[peer_rank];
  const int self = group_->ids[group_->rank];
  DeviceState* dst = LookupDevice(peer);
  cudaStream_t s = dev_->send_streams[peer];
  JFO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, after ? after : start_, 0));
  if (counter != nullptr) {
    CUresult waited = g_wait_value32(reinterpret_cast<CUstream>(s),
                                     reinterpret_cast<CUdeviceptr>(counter), at_least,
                                     CU_STREAM_WAIT_VALUE_GEQ);
    if (waited != CUDA_SUCCESS) {
      return ffi::Error::Internal("jax_flashoverlap: cuStreamWaitValue32 failed "
                                  "with CUresult " + std::to_string(waited));
    }
  }
  if (sent_[peer_rank] == 0) {
    // On the stream of the pair's flags, before the first: a peer that sees
    // a flag of this call sees the fingerprint too. It reads the word of
    // this parity only after such a flag.
    JFO_RETURN_IF_ERROR(
        WriteFlag(s, dst->fingerprints + 2 * self + parity_[peer_rank], fingerprint_));
  }
  if (bytes > 0) {
    char* remote = dst->Slot(self, parity_[peer_rank]) + offset;
    JFO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(remote, src, bytes,
                                             cudaMemcpyDeviceToDevice, s));
  }
  JFO_RETURN_IF_ERROR(WriteFlag(
      s, dst->flags + self, ChannelFlag(dev_->pair_calls[peer] + 1, sent_[peer_rank] + 1)));
  if (fault_ == FaultKind::kError) return InjectedError();
  return sent_[peer_rank]++;
}

ffi::ErrorOr<cudaEvent_t> Channel::Arrival(int peer_rank, int index, cudaEvent_t after,
                                           DeviceBytes read_from) {
  if (rehearsal_) {
    ++events_rehearsed_;  // the real pass takes one
    return start_;
  }
  const int peer = group_->ids[peer_rank];
  cudaStream_t s = waits_on_xla_stream_ ? stream_ : dev_->wait_streams[peer];
  if (!waits_on_xla_stream_) {
    // A wait starts its clock with the call, not while the stream runs ahead.
    JFO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, after ? after : start_, 0));
  }
  const FlagWait wait = ArrivalFlag(peer_rank, index);
  WaitFlagKernel<<<1, read_from.size ? 32 : 1, 0, s>>>(
      wait.flag, wait.expected, wait.report, static_cast<unsigned char*>(read_from.data),
      read_from.size);
  JFO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  auto ev = NextEvent();
  if (ev.has_error()) return ev;
  JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(*ev, s));
  return ev;
}

Channel::FlagWait Channel::ArrivalFlag(int peer_rank, int index) const {
  const int peer = group_->ids[peer_rank];
  TimeoutRecord info{};
  info.op = static_cast<int32_t>(op_);
  info.rank = group_->rank;
  info.ordinal = group_->ids[group_->rank];
  info.peer_rank = peer_rank;
  info.peer_ordinal = peer;
  info.timeout_ms = static_cast<int32_t>(timeout_ns_ / 1000000ull);
  // The own id's pair count stays 0 (End counts peers only), so the
  // own flag's values are (1, copy) in every call, after its zeroing.
  WaitReport report{timeout_ns_, dev_->fail_call, call_id_, dev_->record, dev_->record_lock,
                    info};
  report.waits_failed = dev_->waits_failed;
  if (peer_rank != group_->rank) {
    report.fingerprint = dev_->fingerprints + 2 * peer + parity_[peer_rank];
    report.own_fingerprint = fingerprint_;
    report.peer_waits_failed = LookupDevice(peer)->waits_failed;
  }
  return {dev_->flags + peer, ChannelFlag(dev_->pair_calls[peer] + 1, index + 1), report};
}

ffi::ErrorOr<Channel::FlagWait> Channel::CopyLocalFlagged(void* dst, const void* src,
                                                          size_t bytes) {
  const FlagWait wait = ArrivalFlag(group_->rank, local_flags_);
  const bool first = local_flags_++ == 0;
  if (rehearsal_) {
    if (first) ++events_rehearsed_;  // the real pass's zeroing takes one
    return wait;
  }
  uint32_t* flag = dev_->flags + id();
  cudaStream_t s = dev_->copy_stream;
  if (first) {
    // A value left by an earlier call could pass this call's waits.
    JFO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flag, 0, sizeof(uint32_t), stream_));
    auto zeroed = Mark();
    if (zeroed.has_error()) return zeroed.error();
    JFO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, *zeroed, 0));
  }
  JFO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
  JFO_RETURN_IF_ERROR(WriteFlag(s, flag, wait.expected));
  return wait;
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
    const int peer = group_->ids[r];
    side.push_back(dev_->send_streams[peer]);
    side.push_back(dev_->wait_streams[peer]);
    dev_->pair_calls[peer] += 1;
  }
  for (cudaStream_t s : side) {
    auto ev = NextEvent();
    if (ev.has_error()) return ev.error();
    JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(*ev, s));
    JFO_RETURN_IF_ERROR(WaitOn(*ev));
  }
  if (group_->n == 1 || outputs.empty()) return Ended();
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
  return Ended();
}

ffi::Error Channel::Ended() {
  JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(dev_->last_end, stream_));
  ended_ = true;
  return ffi::Error::Success();
}

}  // namespace jfo
