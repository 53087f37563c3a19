// A CUTLASS 3 tile scheduler that starts at a chosen row of tiles: the
// persistent Hopper scheduler's order with every tile's row index rotated by
// `first_tile_m` (wrapping). all_gather_matmul's GEMM starts with this rank's
// own rows, which need no transfer, and reaches the peers' rows in the order
// they arrive (tile_gemm/arrival_waits.cuh). The rotation is the scheduler's,
// so the loads, the MMAs and the epilogue all see the same tile.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace jfo::tile_gemm {

// The tag a GemmUniversal takes for RotatedScheduler.
struct RotatedRows {};

class RotatedScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    int first_tile_m = 0;
  };
  struct Params : Base::Params {
    int32_t first_tile_m = 0;
    int32_t tiles_m = 1;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL shape, TileShape tile,
                                        ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params params;
    static_cast<Base::Params&>(params) =
        Base::to_underlying_arguments(shape, tile, cluster, hw_info, args, workspace,
                                      epilogue_subtile, ktile_start_alignment_count);
    const int rows = static_cast<int>(cute::get<0>(shape));
    const int tile_rows = static_cast<int>(cute::size<0>(tile));
    params.tiles_m = (rows + tile_rows - 1) / tile_rows;
    params.first_tile_m = args.first_tile_m % params.tiles_m;
    return params;
  }
  static bool can_implement(Arguments const& args) {
    return args.first_tile_m >= 0 && Base::can_implement(args);
  }

  CUTLASS_DEVICE explicit RotatedScheduler(Params const& params)
      : Base(params), first_tile_m_(params.first_tile_m), tiles_m_(params.tiles_m) {}

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape cluster) {
    return Rotated(Base::initial_work_tile_info(cluster));
  }
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work) {
    auto [next, advanced] = Base::fetch_next_work(work);
    return cute::make_tuple(Rotated(next), advanced);
  }
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work, Pipeline&, PipelineState) {
    return fetch_next_work(work);
  }

 private:
  CUTLASS_DEVICE WorkTileInfo Rotated(WorkTileInfo work) const {
    if (work.is_valid()) {
      work.M_idx += first_tile_m_;
      if (work.M_idx >= tiles_m_) work.M_idx -= tiles_m_;
    }
    return work;
  }

  int32_t first_tile_m_;
  int32_t tiles_m_;
};

}  // namespace jfo::tile_gemm

namespace cutlass::gemm::kernel::detail {

template <class ArchTag, class TileShape, class ClusterShape, uint32_t kStages>
struct TileSchedulerSelector<jfo::tile_gemm::RotatedRows, ArchTag, TileShape, ClusterShape,
                             kStages> {
  using Scheduler = jfo::tile_gemm::RotatedScheduler;
};

}  // namespace cutlass::gemm::kernel::detail
