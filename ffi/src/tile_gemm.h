// The tile GEMMs of FlashOverlap's tile-wise signalling: one CUTLASS Hopper
// GEMM over the whole problem, with no cut into row-block GEMMs.
// - The signalling GEMM (reduce-scatter and all-reduce sides): its epilogue
//   counts each finished output tile in its row block's counter, so that
//   copies of finished rows can start while the GEMM goes on (a copy engine
//   held by cuStreamWaitValue32 on the counter).
// - The gathering GEMM (all-gather side): it starts at this rank's own rows
//   and loads a peer's rows only once their copy-engine flag says they have
//   arrived.
// Built only with CUTLASS (JFO_WITH_CUTLASS: the pinned nvidia-cutlass
// headers found at build time); runs on sm_90 GPUs.
#pragma once

#include <cstdint>
#include <string>

#include "common.h"
#include "transport/transport.h"

namespace jfo {

// Rows per counter (the tile's height) and columns per counted tile.
constexpr int kTileGemmRows = 256;
constexpr int kTileGemmCols = 128;

// Counters for m rows, and by how much each grows per GEMM of n columns.
inline int64_t TileGemmCounters(int64_t m) { return (m + kTileGemmRows - 1) / kTileGemmRows; }
inline uint32_t TileGemmTilesPerRowBlock(int64_t n) {
  return static_cast<uint32_t>((n + kTileGemmCols - 1) / kTileGemmCols);
}

// bf16 D[M, N] = X[M, K] @ W[K, N], row-major and contiguous, float32
// accumulation; counters[i] (TileGemmCounters(M) of them) grows by
// TileGemmTilesPerRowBlock(N) as rows [i * kTileGemmRows, ...) are written,
// each increment after its tile's stores are visible to the device. N and K
// must be multiples of 8 (16-byte rows for TMA). `workspace` holds
// CUTLASS's scratch (TileGemmWorkspaceBytes, may be 0).
struct TileGemmArgs {
  int64_t m, n, k;
  const void* x;
  const void* w;
  void* d;
  uint32_t* counters;
};
size_t TileGemmWorkspaceBytes(int ordinal, const TileGemmArgs& args);
// Whether device `ordinal` (sm_90) and the shape can run: call it before a
// schedule starts, so that a refusal comes before anything is sent.
ffi::Error CheckTileGemm(int ordinal, const TileGemmArgs& args);
// Launches the GEMM; `args` passed CheckTileGemm.
ffi::Error TileGemm(int ordinal, const TileGemmArgs& args, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream);
// Where the gathered rows of A come from: block b (rows [b * block_rows,
// ...), rank b's rows) may be read once flag[b] (a copy-engine flag,
// ChannelFlag) reaches expected[b]; a null flag: the block is in place before
// the GEMM starts. A wait that fails (timeout, peer out of step) is recorded
// through `report`, naming peer_rank[b] and peer_ordinal[b] (the rank the
// block comes from), and the GEMM goes on: the call's outputs become NaN and
// the host gets the error, as for the transport's own waits.
struct RowArrivals {
  static constexpr int kMaxBlocks = 8;
  int32_t block_rows = 0;
  int32_t blocks = 0;  // 0: nothing to wait for
  const uint32_t* flag[kMaxBlocks] = {};
  uint32_t expected[kMaxBlocks] = {};
  int32_t peer_rank[kMaxBlocks] = {};
  int32_t peer_ordinal[kMaxBlocks] = {};
  WaitReport report = {};
};

// The gathering GEMM: D = X @ W as TileGemm (counters unused), tiles in row
// order starting at the row block of `first_row` and wrapping, each reading
// its rows of X once `arrivals` says they are there.
struct GatherGemmArgs {
  TileGemmArgs gemm;
  int64_t first_row = 0;
  RowArrivals arrivals;
};
size_t GatherGemmWorkspaceBytes(int ordinal, const GatherGemmArgs& args);
ffi::Error CheckGatherGemm(int ordinal, const GatherGemmArgs& args);
// Launches the GEMM; `args` passed CheckGatherGemm.
ffi::Error GatherGemm(int ordinal, const GatherGemmArgs& args, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream);

// The refusal of a tile-signalled schedule in a build without CUTLASS:
// `op` the op's name, `setting` the cuda_policy setting that asked for it.
inline ffi::Error TileGemmNotBuilt(const std::string& op, const std::string& setting) {
  return ffi::Error::InvalidArgument(
      "jax_flashoverlap " + op + ": tile_signalled needs the extension built with CUTLASS "
      "(build_info()['cutlass'] is empty); set cuda_policy." + setting + " = 'row_blocks'");
}

// True once per device and kernel: for a schedule's rehearsal to launch the
// GEMM (and so load its kernel) before the device's first call that waits.
enum class TileKernel { kSignalling, kGathering };
bool FirstTileGemmOn(int ordinal, TileKernel kernel);

#ifdef JFO_WITH_CUTLASS
// The handler of `jfo_tile_gemm` (tests and benchmarks: the GEMM and its
// counters alone, from zeroed counters).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoTileGemm);
// The handler of `jfo_gather_tile_gemm_check` (tests: the gathering GEMM on
// one GPU, its rows arriving from a second stream, tile_gemm_check.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoGatherTileGemmCheck);
#endif

}  // namespace jfo
