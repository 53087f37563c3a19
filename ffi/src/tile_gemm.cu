// The tile GEMMs (tile_gemm.h) on CUTLASS 3: the cooperative warp-specialized
// Hopper kernel, tiles of 256 x 128 in clusters of 1 x 2.
// - Signalling: the TMA-store epilogue publishes each tile to its row
//   block's counter (tile_gemm/signalling_epilogue.cuh). On one H200 it costs
//   0-5% against the same kernel without counters (benchmarks/results/
//   cutlass_gemm_tma_signalling_1xh200.json).
// - Gathering: the tiles start at the own rows (tile_gemm/rotated_scheduler.cuh)
//   and the load warp waits for a tile's rows (tile_gemm/arrival_waits.cuh).
// Compiled for sm_90a only.
#include "tile_gemm.h"

#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "tile_gemm/arrival_waits.cuh"
#include "tile_gemm/rotated_scheduler.cuh"
#include "tile_gemm/signalling_epilogue.cuh"

namespace jfo {
namespace {

using namespace cute;

using Element = cutlass::bfloat16_t;
using Layout = cutlass::layout::RowMajor;
constexpr int kAlignment = 8;  // 16 bytes of bf16
using TileShape = Shape<Int<kTileGemmRows>, Int<kTileGemmCols>, _64>;
using ClusterShape = Shape<_1, _2, _1>;

using PlainEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, Layout,
    kAlignment, Element, Layout, kAlignment,
    cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
template <class Epilogue>
using MainloopFor = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, Layout, kAlignment,
    Element, Layout, kAlignment, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
using ProblemShape = Shape<int, int, int, int>;

using SignallingEpilogue = tile_gemm::TmaSignallingEpilogue<PlainEpilogue>;
using Kernel = cutlass::gemm::kernel::GemmUniversal<
    ProblemShape, MainloopFor<SignallingEpilogue>, SignallingEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

using GatherKernel = cutlass::gemm::kernel::GemmUniversal<
    ProblemShape,
    tile_gemm::ArrivalWaitingMainloop<MainloopFor<PlainEpilogue>, kTileGemmRows>,
    PlainEpilogue, tile_gemm::RotatedRows>;
using GatherGemmOp = cutlass::gemm::device::GemmUniversalAdapter<GatherKernel>;

ffi::Error Failed(const char* what, const TileGemmArgs& a) {
  return ffi::Error::Internal(
      std::string("jax_flashoverlap tile GEMM: ") + what + " for M x K x N = " +
      std::to_string(a.m) + " x " + std::to_string(a.k) + " x " + std::to_string(a.n));
}

// The arguments every tile GEMM shares; `epilogue` and `mainloop` wrap the
// plain CUTLASS ones of `K` as its collectives need.
template <class K, class EpilogueWrap, class MainloopWrap>
typename cutlass::gemm::device::GemmUniversalAdapter<K>::Arguments MakeArguments(
    int ordinal, const TileGemmArgs& a, EpilogueWrap epilogue, MainloopWrap mainloop) {
  const int m = static_cast<int>(a.m), n = static_cast<int>(a.n), k = static_cast<int>(a.k);
  auto sa = cutlass::make_cute_packed_stride(typename K::StrideA{}, {m, k, 1});
  auto sb = cutlass::make_cute_packed_stride(typename K::StrideB{}, {n, k, 1});
  auto sd = cutlass::make_cute_packed_stride(typename K::StrideD{}, {m, n, 1});
  auto* d = static_cast<Element*>(a.d);
  typename cutlass::gemm::device::GemmUniversalAdapter<K>::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      mainloop({static_cast<const Element*>(a.x), sa, static_cast<const Element*>(a.w), sb}),
      epilogue({{1.0f, 0.0f}, d, sd, d, sd}),
      cutlass::KernelHardwareInfo::make_kernel_hardware_info<K>(ordinal)};
  // Along N: the tiles of a row block run one after another, so row blocks
  // finish in order and the first can be sent while later ones compute
  // (CUTLASS's heuristic goes along M when N has more tiles, and then every
  // row block finishes near the end); the gathering GEMM likewise reaches
  // the peers' rows in the order they arrive.
  args.scheduler.raster_order =
      cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN;
  return args;
}

typename Gemm::Arguments SignallingArguments(int ordinal, const TileGemmArgs& a) {
  return MakeArguments<Kernel>(
      ordinal, a,
      [&](typename PlainEpilogue::Arguments base) {
        return typename Kernel::EpilogueArguments{base, a.counters};
      },
      [](typename Kernel::MainloopArguments base) { return base; });
}

typename GatherGemmOp::Arguments GatherArguments(int ordinal, const GatherGemmArgs& a) {
  auto args = MakeArguments<GatherKernel>(
      ordinal, a.gemm, [](typename PlainEpilogue::Arguments base) { return base; },
      [&](typename MainloopFor<PlainEpilogue>::Arguments base) {
        return typename GatherKernel::MainloopArguments{base, a.arrivals};
      });
  args.scheduler.first_tile_m = static_cast<int>(a.first_row / kTileGemmRows);
  return args;
}

// Checks, initializes and launches `Op` on `arguments`.
template <class Op>
ffi::Error Launch(const typename Op::Arguments& arguments, const TileGemmArgs& args,
                  void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (Op::get_workspace_size(arguments) > workspace_bytes) {
    return Failed("workspace too small", args);
  }
  Op gemm;
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) {
    return Failed("CUTLASS cannot implement the problem", args);
  }
  if (gemm.initialize(arguments, workspace, stream) != cutlass::Status::kSuccess) {
    return Failed("initialize failed", args);
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) return Failed("launch failed", args);
  JFO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace

ffi::Error CheckTileGemm(int ordinal, const TileGemmArgs& a) {
  int major = 0, minor = 0;
  JFO_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal));
  JFO_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal));
  if (major != 9 || minor != 0) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap tile GEMM: needs an sm_90 (Hopper) GPU; device " +
        std::to_string(ordinal) + " is sm_" + std::to_string(major) + std::to_string(minor));
  }
  // TMA moves rows of 16-byte multiples; M is free.
  if (a.n % kAlignment || a.k % kAlignment || a.m <= 0 || a.n <= 0 || a.k <= 0 ||
      a.m > INT32_MAX || a.n > INT32_MAX || a.k > INT32_MAX) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap tile GEMM: M must be positive, K and N positive multiples of 8, "
        "got " +
        std::to_string(a.m) + " x " + std::to_string(a.k) + " x " + std::to_string(a.n));
  }
  return ffi::Error::Success();
}

size_t TileGemmWorkspaceBytes(int ordinal, const TileGemmArgs& args) {
  return Gemm::get_workspace_size(SignallingArguments(ordinal, args));
}

ffi::Error TileGemm(int ordinal, const TileGemmArgs& args, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream) {
  return Launch<Gemm>(SignallingArguments(ordinal, args), args, workspace, workspace_bytes,
                      stream);
}

ffi::Error CheckGatherGemm(int ordinal, const GatherGemmArgs& args) {
  JFO_RETURN_IF_ERROR(CheckTileGemm(ordinal, args.gemm));
  const RowArrivals& a = args.arrivals;
  if (args.first_row < 0 || args.first_row >= args.gemm.m || a.blocks < 0 ||
      a.blocks > RowArrivals::kMaxBlocks ||
      (a.blocks > 0 && (a.block_rows <= 0 ||
                        static_cast<int64_t>(a.block_rows) * a.blocks < args.gemm.m))) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap tile GEMM: the gathered rows need at most " +
        std::to_string(RowArrivals::kMaxBlocks) + " blocks (0: none to wait for) covering all " +
        std::to_string(args.gemm.m) + " rows and a first row inside them, got " +
        std::to_string(a.blocks) + " blocks of " + std::to_string(a.block_rows) +
        " rows, first row " + std::to_string(args.first_row));
  }
  return ffi::Error::Success();
}

size_t GatherGemmWorkspaceBytes(int ordinal, const GatherGemmArgs& args) {
  return GatherGemmOp::get_workspace_size(GatherArguments(ordinal, args));
}

ffi::Error GatherGemm(int ordinal, const GatherGemmArgs& args, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  return Launch<GatherGemmOp>(GatherArguments(ordinal, args), args.gemm, workspace,
                              workspace_bytes, stream);
}

bool FirstTileGemmOn(int ordinal, TileKernel kernel) {
  static std::mutex mutex;
  static std::set<std::pair<int, TileKernel>> launched;
  std::lock_guard<std::mutex> lock(mutex);
  return launched.insert({ordinal, kernel}).second;
}

namespace {

ffi::Error TileGemmImpl(cudaStream_t stream, int ordinal, Buffer_Type x, Buffer_Type w,
                        Result_Type y, Result_Type counters) {
  for (auto t : {x.element_type(), w.element_type(), y->element_type()}) {
    if (t != ffi::DataType::BF16) {
      return ffi::Error::InvalidArgument("jax_flashoverlap tile GEMM: bf16 operands only");
    }
  }
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || yd.size() != 2 ||
      yd[0] != xd[0] || yd[1] != wd[1] ||
      counters->element_count() != static_cast<size_t>(TileGemmCounters(xd[0]))) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap tile GEMM: need x [M, K], w [K, N], y [M, N] and " +
        std::to_string(TileGemmCounters(xd.size() ? xd[0] : 0)) + " counters, got x " +
        DimsToString(x) + ", w " + DimsToString(w) + ", y " + DimsToString(*y));
  }
  TileGemmArgs args{xd[0], wd[1], xd[1], x.untyped_data(), w.untyped_data(),
                    y->untyped_data(), static_cast<uint32_t*>(counters->untyped_data())};
  JFO_RETURN_IF_ERROR(CheckTileGemm(ordinal, args));
  const size_t bytes = TileGemmWorkspaceBytes(ordinal, args);
  void* workspace = nullptr;
  if (bytes) JFO_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&workspace, bytes, stream));
  JFO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      args.counters, 0, counters->element_count() * sizeof(uint32_t), stream));
  ffi::Error result = TileGemm(ordinal, args, workspace, bytes, stream);
  if (workspace) JFO_CUDA_RETURN_IF_ERROR(cudaFreeAsync(workspace, stream));
  return result;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoTileGemm, TileGemmImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()     // XLA's stream for this device
        .Ctx<ffi::DeviceOrdinal>()  // local CUDA ordinal
        .Arg<Buffer_Type>()         // x [M, K] bf16
        .Arg<Buffer_Type>()         // w [K, N] bf16
        .Ret<Buffer_Type>()         // y [M, N] bf16
        .Ret<Buffer_Type>());       // counters [ceil(M / 256)] uint32

}  // namespace jfo
