// `jfo_gather_tile_gemm_check`: the gathering tile GEMM (tile_gemm.h) on one
// GPU, its rows arriving as a peer's would. A staging copy of x starts as NaN
// except this rank's own block; after `delay_us`, a second stream brings the
// other blocks in, in the order the GEMM reaches them, each followed by its
// flag (the copy-engine flag of Channel::Send). The GEMM must read every
// block only after its flag, so y equals x @ w only if every wait held. A
// block that never arrives, or a flag two calls ahead, must end in the
// transport's error naming that block's rank. The second stream uses no SMs,
// as a peer's sends do not (the waiting GEMM may hold them all): a host
// function's sleep, copies from pinned host memory, flags written by the
// stream. For tests: it allocates and synchronizes on every call.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include "tile_gemm.h"
#include "transport/transport.h"

namespace jfo {
namespace {

// What a call allocates, released on every way out.
struct CheckResources {
  void* staging = nullptr;
  void* source = nullptr;  // pinned host copy of x
  uint32_t* words = nullptr;  // [flags..., fail_call, record_lock]
  void* workspace = nullptr;
  TimeoutRecord* record = nullptr;
  cudaStream_t side = nullptr;
  cudaEvent_t ready = nullptr;
  ~CheckResources() {
    if (side) cudaStreamSynchronize(side);
    if (ready) cudaEventDestroy(ready);
    if (side) cudaStreamDestroy(side);
    cudaFree(staging);
    cudaFree(words);
    cudaFree(workspace);
    if (record) cudaFreeHost(record);
    if (source) cudaFreeHost(source);
  }
};

ffi::Error GatherTileGemmCheckImpl(cudaStream_t stream, int ordinal, Buffer_Type x,
                                   Buffer_Type w, Result_Type y, int64_t block_rows,
                                   int64_t own_block, int64_t delay_us,
                                   int64_t missing_block, int64_t calls_ahead,
                                   int64_t timeout_ms) {
  for (auto t : {x.element_type(), w.element_type(), y->element_type()}) {
    if (t != ffi::DataType::BF16) {
      return ffi::Error::InvalidArgument(
          "jax_flashoverlap gather tile GEMM check: bf16 operands only");
    }
  }
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || block_rows <= 0) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap gather tile GEMM check: need x [M, K], w [K, N] and "
        "block_rows > 0, got x " + DimsToString(x) + ", w " + DimsToString(w));
  }
  const int64_t m = xd[0], k = xd[1];
  const int blocks = static_cast<int>((m + block_rows - 1) / block_rows);
  if (own_block < 0 || own_block >= blocks) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap gather tile GEMM check: own_block must be in [0, " +
        std::to_string(blocks) + "), got " + std::to_string(own_block));
  }
  GatherGemmArgs args;
  args.gemm = {m, wd[1], k, nullptr, w.untyped_data(), y->untyped_data(), nullptr};
  args.first_row = own_block * block_rows;
  RowArrivals& arrivals = args.arrivals;
  arrivals.block_rows = static_cast<int32_t>(block_rows);
  arrivals.blocks = blocks;
  JFO_RETURN_IF_ERROR(CheckGatherGemm(ordinal, args));

  CheckResources res;
  const size_t row_bytes = static_cast<size_t>(k) * 2;
  JFO_CUDA_RETURN_IF_ERROR(cudaMalloc(&res.staging, m * row_bytes));
  JFO_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&res.source, m * row_bytes, cudaHostAllocDefault));
  JFO_CUDA_RETURN_IF_ERROR(cudaMalloc(&res.words, (blocks + 2) * sizeof(uint32_t)));
  JFO_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&res.record, sizeof(TimeoutRecord),
                                         cudaHostAllocMapped | cudaHostAllocPortable));
  *res.record = TimeoutRecord{};
  args.gemm.x = res.staging;
  const size_t workspace_bytes = GatherGemmWorkspaceBytes(ordinal, args);
  if (workspace_bytes) JFO_CUDA_RETURN_IF_ERROR(cudaMalloc(&res.workspace, workspace_bytes));

  // bf16 0xFFFF is NaN: a row read before its copy poisons its outputs.
  JFO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(res.staging, 0xFF, m * row_bytes, stream));
  JFO_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(res.words, 0, (blocks + 2) * sizeof(uint32_t), stream));
  auto rows_of = [&](int b) { return std::min<int64_t>(block_rows, m - b * block_rows); };
  auto at = [&](void* base, int b) {
    return static_cast<char*>(base) + b * block_rows * row_bytes;
  };
  JFO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(at(res.staging, own_block),
                                           at(x.untyped_data(), own_block),
                                           rows_of(own_block) * row_bytes,
                                           cudaMemcpyDeviceToDevice, stream));
  JFO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(res.source, x.untyped_data(), m * row_bytes,
                                           cudaMemcpyDeviceToHost, stream));

  const uint32_t expected = ChannelFlag(1, 1);
  TimeoutRecord info{};
  info.op = static_cast<int32_t>(OpId::kAllGatherMatmul);
  info.rank = static_cast<int32_t>(own_block);
  info.ordinal = ordinal;
  info.timeout_ms = static_cast<int32_t>(timeout_ms);
  arrivals.report = {static_cast<uint64_t>(timeout_ms) * 1000000ull, res.words + blocks, 1,
                     res.record, res.words + blocks + 1, info};
  for (int b = 0; b < blocks; ++b) {
    arrivals.flag[b] = b == own_block ? nullptr : res.words + b;
    arrivals.expected[b] = expected;
    arrivals.peer_rank[b] = b;
    arrivals.peer_ordinal[b] = ordinal;
  }

  // The "peers": after the setup and the delay, the other blocks in the
  // GEMM's order (from the own block on, wrapping), each then its flag; no
  // SMs (see the top).
  JFO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&res.side, cudaStreamNonBlocking));
  JFO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&res.ready, cudaEventDisableTiming));
  JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(res.ready, stream));
  JFO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(res.side, res.ready, 0));
  static_assert(sizeof(void*) >= sizeof(int64_t));
  JFO_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(
      res.side,
      [](void* us) {
        std::this_thread::sleep_for(std::chrono::microseconds(reinterpret_cast<intptr_t>(us)));
      },
      reinterpret_cast<void*>(static_cast<intptr_t>(delay_us))));
  for (int i = 1; i < blocks; ++i) {
    const int b = static_cast<int>((own_block + i) % blocks);
    if (b == missing_block) continue;
    JFO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(at(res.staging, b), at(res.source, b),
                                             rows_of(b) * row_bytes, cudaMemcpyHostToDevice,
                                             res.side));
    JFO_RETURN_IF_ERROR(
        WriteFlag(res.side, res.words + b, ChannelFlag(1 + calls_ahead, 1)));
  }

  JFO_RETURN_IF_ERROR(GatherGemm(ordinal, args, res.workspace, workspace_bytes, stream));
  JFO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  JFO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(res.side));
  if (res.record->set) return ffi::Error::Internal(FormatTimeout(*res.record));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoGatherTileGemmCheck, GatherTileGemmCheckImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()     // XLA's stream for this device
        .Ctx<ffi::DeviceOrdinal>()  // local CUDA ordinal
        .Arg<Buffer_Type>()         // x [M, K] bf16: the rows every block brings
        .Arg<Buffer_Type>()         // w [K, N] bf16
        .Ret<Buffer_Type>()         // y [M, N] bf16
        .Attr<int64_t>("block_rows")
        .Attr<int64_t>("own_block")       // in place before the GEMM starts
        .Attr<int64_t>("delay_us")        // before the first block arrives
        .Attr<int64_t>("missing_block")   // never arrives; -1: none
        .Attr<int64_t>("calls_ahead")     // flags written this many calls ahead
        .Attr<int64_t>("timeout_ms"));

}  // namespace jfo
