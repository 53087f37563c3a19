// The gathering side of FlashOverlap's tile-wise signalling: a CUTLASS 3
// collective mainloop whose load warp, before it loads a tile's rows of A,
// waits until the rank those rows come from has sent them (its copy-engine
// flag, ChannelFlag). all_gather_matmul's GEMM then runs over the whole
// gathered A while the peers' blocks are still arriving, with no cut into
// one GEMM per block. Needs the CUTLASS headers (nvidia-cutlass 4.2.0.0)
// and sm_90a.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "../tile_gemm.h"
#include "../transport/signal.cuh"

namespace jfo::tile_gemm {

// The calling warp waits until rows [row_begin, row_end) have arrived
// (RowArrivals, tile_gemm.h). One lane polls (a spinning warp must not slow
// the GEMM's other warps); the warp barrier passes its acquire on to the lane
// that issues the TMA loads, and the proxy fence orders those loads (the
// async proxy) after it.
CUTLASS_DEVICE void WaitForRows(const RowArrivals& arrivals, int row_begin, int row_end) {
  if (threadIdx.x % 32 == 0 && arrivals.blocks > 0) {
    const int last = min((row_end - 1) / arrivals.block_rows, arrivals.blocks - 1);
    for (int b = row_begin / arrivals.block_rows; b <= last; ++b) {
      if (arrivals.flag[b] == nullptr) continue;
      WaitReport report = arrivals.report;
      report.info.peer_rank = arrivals.peer_rank[b];
      report.info.peer_ordinal = arrivals.peer_ordinal[b];
      signal::WaitChannelFlag(arrivals.flag[b], arrivals.expected[b], report);
    }
  }
  __syncwarp();
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// `Base` (a CUTLASS 3 Hopper TMA mainloop) whose loads of a tile first wait
// for the tile's rows of A (RowArrivals). Only the load warp waits: the MMA
// warps wait for the loaded stages as always.
template <class Base, int kTileRows>
class ArrivalWaitingMainloop : public Base {
 public:
  struct Arguments {
    typename Base::Arguments base;
    RowArrivals arrivals;
  };
  // Derived, not wrapped: the kernel passes it where the base's is expected.
  struct Params : Base::Params {
    RowArrivals arrivals;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& shape,
                                                  Arguments const& args, void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) =
        Base::to_underlying_arguments(shape, args.base, workspace);
    params.arrivals = args.arrivals;
    return params;
  }
  // The arrivals are checked, with a message, by CheckGatherGemm.
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    return Base::can_implement(shape, args.base);
  }

  template <class Pipeline, class PipelineState, class LoadInputs, class BlockCoord,
            class... Rest>
  CUTLASS_DEVICE void load(Params const& params, Pipeline pipeline, PipelineState state,
                           LoadInputs const& load_inputs, BlockCoord const& blk_coord,
                           Rest&&... rest) {
    const int row = static_cast<int>(cute::get<0>(blk_coord)) * kTileRows;
    WaitForRows(params.arrivals, row, row + kTileRows);
    Base::load(params, pipeline, state, load_inputs, blk_coord, static_cast<Rest&&>(rest)...);
  }
};

}  // namespace jfo::tile_gemm
