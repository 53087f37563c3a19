// The decode kernel's host side apart from its handler
// (../transformer_decode.cu): operands as a rank sees them, the tensor
// ranks' persistent receive areas and streams, and the launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "../common.h"
#include "kernel.cuh"
#include "launch.cuh"
#include "params.cuh"

namespace jfo {
namespace transformer_decode {

// An operand as one rank sees it. With emulated ranks (ranks > 1) a stacked
// operand's first axis is the rank, and rank r's part is the r-th slice.
// (Fixed-size: a step's host time is time its GPU may wait for.)
struct Part {
  static constexpr int kMaxRank = 6;
  char* data = nullptr;
  int64_t dims[kMaxRank] = {};
  int rank = 0;  // of the array
  ffi::DataType type = ffi::DataType::INVALID;
  size_t bytes = 0;

  bool Is(ffi::DataType t, std::initializer_list<int64_t> want) const {
    if (type != t || rank != static_cast<int>(want.size())) return false;
    int i = 0;
    for (const int64_t w : want) {
      if (dims[i++] != w) return false;
    }
    return true;
  }
  bool SameShape(const Part& other) const {
    if (rank != other.rank) return false;
    for (int i = 0; i < rank; ++i) {
      if (dims[i] != other.dims[i]) return false;
    }
    return true;
  }
};

inline std::string PartDims(const Part& part) {
  std::string s = "[";
  for (int i = 0; i < part.rank; ++i) s += (i ? ", " : "") + std::to_string(part.dims[i]);
  return s + "]";
}

inline ffi::ErrorOr<Part> PartOf(const ffi::AnyBuffer& b, const char* name, int rank, int ranks) {
  const auto dims = b.dimensions();
  const int skip = ranks > 1 ? 1 : 0;
  if (dims.size() > static_cast<size_t>(Part::kMaxRank + skip) ||
      (skip && (dims.size() == 0 || dims[0] != ranks))) {
    return ffi::Error::InvalidArgument(
        std::string("jax_flashoverlap transformer_decode: ") + name + " is " + DimsToString(b) +
        (skip ? ", not stacked by rank (first axis " + std::to_string(ranks) + ")"
              : ", more axes than any operand has"));
  }
  Part part;
  part.type = b.element_type();
  part.bytes = b.size_bytes() / ranks;
  part.data = static_cast<char*>(b.untyped_data()) + rank * part.bytes;
  part.rank = static_cast<int>(dims.size()) - skip;
  for (int i = 0; i < part.rank; ++i) part.dims[i] = dims[i + skip];
  return part;
}

// w: [layers, items, k, columns].
inline WeightStage StageOf(const Part& w, int columns, int chunk_bytes) {
  return WeightStageOf(w.data, w.dims[1], w.dims[2], columns, chunk_bytes);
}

inline ffi::Error CheckWeight(const Part& w, const char* name, int64_t layers, int64_t items,
                       int64_t k, int64_t columns) {
  if (!w.Is(ffi::DataType::BF16, {layers, items, k, columns})) {
    return ffi::Error::InvalidArgument(
        std::string("jax_flashoverlap transformer_decode: ") + name + " must be bf16 [" +
        std::to_string(layers) + ", " + std::to_string(items) + ", " + std::to_string(k) +
        ", " + std::to_string(columns) + "] (prepared by models.transformer_decode_cuda), got " +
        PartDims(w));
  }
  return ffi::Error::Success();
}

// The tensor ranks of a step: this GPU's rank and every rank's CUDA device.
struct TensorGroup {
  int rank = 0, ranks = 1;
  int ordinals[kMaxTensorRanks] = {};
};

// Ranks on GPUs of their own: the group of `group_ordinals` (each group's n
// ordinals in rank order) that holds `device`, with peer access from it to
// every other member enabled (once per pair).
inline ffi::ErrorOr<TensorGroup> TensorGroupOf(I32Span group_ordinals, int n, int device) {
  static const std::string op = "jax_flashoverlap transformer_decode: ";
  if (n > kMaxTensorRanks || group_ordinals.size() % n) {
    return ffi::Error::InvalidArgument(
        op + "takes up to " + std::to_string(kMaxTensorRanks) + " tensor ranks of one process "
        "in groups of n; got n = " + std::to_string(n) + " and " +
        std::to_string(group_ordinals.size()) + " ordinals");
  }
  TensorGroup group;
  group.ranks = n;
  group.rank = -1;
  for (size_t start = 0; start < group_ordinals.size() && group.rank < 0; start += n) {
    for (int q = 0; q < n; ++q) {
      if (group_ordinals[start + q] == device) group.rank = q;
    }
    if (group.rank >= 0) {
      for (int q = 0; q < n; ++q) group.ordinals[q] = group_ordinals[start + q];
    }
  }
  if (group.rank < 0) {
    return ffi::Error::InvalidArgument(op + "CUDA device " + std::to_string(device) +
                                       " is in no tensor group of this process's devices");
  }
  // What would make one rank refuse while the others launch (and then
  // trap, waiting for it) is refused by every rank alike (and see
  // SmallestOf).
  for (int q = 0; q < n; ++q) {
    for (int r = 0; r < q; ++r) {
      if (group.ordinals[r] == group.ordinals[q]) {
        return ffi::Error::InvalidArgument(op + "CUDA device " +
                                           std::to_string(group.ordinals[q]) +
                                           " holds two ranks of one tensor group");
      }
    }
  }
  static std::mutex mu;
  static std::set<std::pair<int, int>> enabled;
  std::lock_guard<std::mutex> lock(mu);
  for (int q = 0; q < n; ++q) {
    const int peer = group.ordinals[q];
    if (q == group.rank || enabled.count({device, peer})) continue;
    int can = 0;
    JFO_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, device, peer));
    if (!can) {
      return ffi::Error::InvalidArgument(
          op + "CUDA device " + std::to_string(device) + " cannot store into device " +
          std::to_string(peer) + "'s memory (no peer access); use decode_blocks='layers'");
    }
    const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // enabled before, by another part of the process
    } else {
      JFO_CUDA_RETURN_IF_ERROR(err);
    }
    enabled.insert({device, peer});
  }
  return group;
}

// What every rank of the group lays its launch out by: the smallest SM
// count, shared memory and compute capability among its GPUs (`device`'s
// own at one rank), so that every rank runs the same grid and ring, each
// item of out and down comes in the same order on every rank (exchange.cuh),
// and a GPU that cannot run the kernel stops every rank alike.
inline DeviceInfo SmallestOf(const TensorGroup& group, int device) {
  DeviceInfo smallest = DeviceInfoOf(device);
  for (int q = 0; q < group.ranks && group.ranks > 1; ++q) {
    const DeviceInfo other = DeviceInfoOf(group.ordinals[q]);
    smallest.sms = std::min(smallest.sms, other.sms);
    smallest.major = std::min(smallest.major, other.major);
    smallest.max_shared = std::min(smallest.max_shared, other.max_shared);
  }
  return smallest;
}

// Emulated ranks: all on this GPU.
inline TensorGroup EmulatedGroup(int rank, int ranks, int device) {
  TensorGroup group;
  group.rank = rank;
  group.ranks = ranks;
  for (int q = 0; q < ranks; ++q) group.ordinals[q] = device;
  return group;
}

// The receive area of one tensor rank's partial sums (exchange.cuh), with
// its launch count after it, in that rank's GPU's memory. A peer stores
// into it before this rank's next launch, so it outlives the call: one per
// group (its ranks' devices), rank and shape, for the process's life, filled
// with kHandoffEmpty and the count 0 when made. Whichever rank's call comes
// first makes it and returns once it is filled, before any launch uses it;
// the fill is a copy (a copy engine, beside a kernel that holds every SM),
// and only that area's lock is held meanwhile.
struct ExchangeArea {
  __nv_bfloat16* recv = nullptr;
  size_t bytes = 0;         // recv's
  unsigned* launches = nullptr;  // after recv, then the failure word
  unsigned* failed = nullptr;
  ExchangeFailure* report = nullptr;  // host-mapped
};

// recv filled with kHandoffEmpty, the launch count and failure word zeroed,
// no failure reported: as made, and after a reset.
inline cudaError_t FillExchangeArea(const ExchangeArea& area) {
  std::vector<unsigned char> filled(area.bytes + 256, 0xFF);
  std::fill(filled.begin() + area.bytes, filled.end(), 0);
  cudaStream_t fill = nullptr;
  cudaError_t err = cudaStreamCreateWithFlags(&fill, cudaStreamNonBlocking);
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(area.recv, filled.data(), filled.size(), cudaMemcpyHostToDevice, fill);
  }
  if (err == cudaSuccess) err = cudaStreamSynchronize(fill);
  if (fill) cudaStreamDestroy(fill);
  if (err == cudaSuccess) *area.report = ExchangeFailure{};
  return err;
}

inline ffi::ErrorOr<ExchangeArea> MakeExchangeArea(int device, size_t bytes) {
  DeviceGuard on(device);
  ExchangeArea area;
  area.bytes = bytes;
  void* memory = nullptr;
  void* report = nullptr;
  cudaError_t err = cudaMalloc(&memory, bytes + 256);
  if (err == cudaSuccess) {
    err = cudaHostAlloc(&report, sizeof(ExchangeFailure), cudaHostAllocMapped | cudaHostAllocPortable);
  }
  if (err == cudaSuccess) {
    area.recv = static_cast<__nv_bfloat16*>(memory);
    area.launches = reinterpret_cast<unsigned*>(static_cast<char*>(memory) + bytes);
    area.failed = area.launches + 1;
    area.report = static_cast<ExchangeFailure*>(report);
    err = FillExchangeArea(area);
  }
  if (err != cudaSuccess) {
    if (memory) cudaFree(memory);
    if (report) cudaFreeHost(report);
    return ffi::Error::Internal(std::string("jax_flashoverlap transformer_decode: making a "
                                            "tensor rank's receive area on CUDA device ") +
                                std::to_string(device) + " failed: " + cudaGetErrorString(err));
  }
  return area;
}

// Every receive area of the process: one per group (its ranks' devices),
// rank and shape.
using Ordinals = std::array<int, kMaxTensorRanks>;
struct ExchangeAreas {
  using Key = std::tuple<Ordinals, int, int, int64_t, int64_t, int64_t>;
  struct Entry {
    std::mutex mu;
    ExchangeArea area;
  };
  std::mutex mu;
  std::map<Key, std::shared_ptr<Entry>> entries;
};

inline ExchangeAreas& AllExchangeAreas() {
  static ExchangeAreas* areas = new ExchangeAreas;  // never destroyed: used at exit
  return *areas;
}

inline Ordinals OrdinalsOf(const TensorGroup& group) {
  Ordinals ordinals{};
  std::copy(group.ordinals, group.ordinals + group.ranks, ordinals.begin());
  return ordinals;
}

inline ffi::ErrorOr<ExchangeArea> ExchangeAreaOf(const TensorGroup& group, int rank,
                                                 int64_t layers, int64_t batch, int64_t d) {
  ExchangeAreas& areas = AllExchangeAreas();
  std::shared_ptr<ExchangeAreas::Entry> entry;
  {
    std::lock_guard<std::mutex> lock(areas.mu);
    auto& slot = areas.entries[{OrdinalsOf(group), group.ranks, rank, layers, batch, d}];
    if (!slot) slot = std::make_shared<ExchangeAreas::Entry>();
    entry = slot;
  }
  std::lock_guard<std::mutex> lock(entry->mu);
  if (!entry->area.recv) {
    JFO_ASSIGN_OR_RETURN(entry->area, MakeExchangeArea(group.ordinals[rank],
                                                       ExchangeBytes(layers, batch, d,
                                                                     group.ranks)));
  }
  return entry->area;
}

// The reported timeouts of the groups whose devices are `ordinals` (every
// group when null), one line each, or "".
inline std::string ExchangeFailures(const Ordinals* ordinals) {
  ExchangeAreas& areas = AllExchangeAreas();
  std::lock_guard<std::mutex> lock(areas.mu);
  std::string lines;
  for (const auto& [key, entry] : areas.entries) {
    std::lock_guard<std::mutex> area_lock(entry->mu);
    const ExchangeFailure* r = entry->area.report;
    if (!r || !r->set || (ordinals && std::get<0>(key) != *ordinals)) continue;
    const int device = std::get<0>(key)[r->rank];
    lines += (lines.empty() ? "" : "\n") + std::string("jax_flashoverlap transformer_decode: "
             "tensor rank ") + std::to_string(r->rank) + " (CUDA device " +
             std::to_string(device) + ") timed out in layer " + std::to_string(r->layer) +
             " waiting for tensor rank " + std::to_string(r->peer) + "'s partial sums (CUDA "
             "device " + std::to_string(r->peer_device) + "); that step's outputs are NaN, and "
             "every step of the group fails until jax_flashoverlap.reset()";
  }
  return lines;
}

// Every receive area as made, once its device is idle; "" or why not.
inline std::string ResetExchangeAreas() {
  ExchangeAreas& areas = AllExchangeAreas();
  std::lock_guard<std::mutex> lock(areas.mu);
  for (const auto& [key, entry] : areas.entries) {
    std::lock_guard<std::mutex> area_lock(entry->mu);
    if (!entry->area.recv) continue;
    const int device = std::get<0>(key)[std::get<2>(key)];
    DeviceGuard on(device);
    cudaError_t err = cudaDeviceSynchronize();
    if (err == cudaSuccess) err = FillExchangeArea(entry->area);
    if (err != cudaSuccess) {
      return "clearing the decode kernel's receive area on CUDA device " +
             std::to_string(device) + ": " + cudaGetErrorString(err);
    }
  }
  return "";
}

// The streams that run emulated ranks 1.. beside XLA's stream, and the
// events that order them after its work and it after theirs: per device,
// made once.
struct RankStreams {
  cudaEvent_t start = nullptr;
  cudaStream_t streams[kMaxTensorRanks] = {};
  cudaEvent_t done[kMaxTensorRanks] = {};
};

inline ffi::ErrorOr<RankStreams> RankStreamsOf(int device) {
  static std::mutex mu;
  static std::map<int, RankStreams> all;
  std::lock_guard<std::mutex> lock(mu);
  auto found = all.find(device);
  if (found != all.end()) return found->second;
  RankStreams s;  // kept only once whole; what was made is released otherwise
  auto release = [&s] {
    if (s.start) cudaEventDestroy(s.start);
    for (int r = 1; r < kMaxTensorRanks; ++r) {
      if (s.streams[r]) cudaStreamDestroy(s.streams[r]);
      if (s.done[r]) cudaEventDestroy(s.done[r]);
    }
  };
  cudaError_t err = cudaEventCreateWithFlags(&s.start, cudaEventDisableTiming);
  for (int r = 1; r < kMaxTensorRanks && err == cudaSuccess; ++r) {
    err = cudaStreamCreateWithFlags(&s.streams[r], cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&s.done[r], cudaEventDisableTiming);
  }
  if (err != cudaSuccess) {
    release();
    JFO_CUDA_RETURN_IF_ERROR(err);
  }
  all[device] = s;
  return s;
}

// One emulated step at a time on a device: its ranks share the streams,
// the events, the receive areas and their launch counts.
inline std::mutex& EmulationLock(int device) {
  static std::mutex locks[64];
  return locks[device % 64];
}

// A launch's kernel for the batch and head dim. Emulated ranks run side by
// side, each on its share of the SMs, which a cooperative launch does not
// promise beside another: they launch without it.
template <int B, int HD>
ffi::Error LaunchAs(cudaStream_t stream, int device, const Params& p, int grid, size_t shared,
                    bool cooperative) {
  return LaunchPersistent("jax_flashoverlap transformer_decode: ",
                          TransformerDecodeKernel<B, HD>, p, stream, device, grid, kThreads,
                          shared, cooperative);
}

inline ffi::Error Launch(cudaStream_t stream, int device, const Params& p, int grid, size_t shared,
                  bool cooperative) {
#define JFO_LAUNCH_BATCH(B)                                                                 \
  case B:                                                                                   \
    return p.head_dim == 64 ? LaunchAs<B, 64>(stream, device, p, grid, shared, cooperative) \
                            : LaunchAs<B, 128>(stream, device, p, grid, shared, cooperative);
  switch (p.batch) {
    JFO_LAUNCH_BATCH(1)
    JFO_LAUNCH_BATCH(2)
    JFO_LAUNCH_BATCH(3)
    default:
      return p.head_dim == 64 ? LaunchAs<4, 64>(stream, device, p, grid, shared, cooperative)
                              : LaunchAs<4, 128>(stream, device, p, grid, shared, cooperative);
  }
#undef JFO_LAUNCH_BATCH
}

}  // namespace transformer_decode
}  // namespace jfo
