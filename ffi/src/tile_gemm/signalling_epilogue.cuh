// CUTLASS 3 collective epilogues that count finished output tiles: after a
// tile's stores are visible in global memory, its epilogue adds 1 to the
// counter of the tile's row block. A row block of N columns is written once
// its counter grew by ceil(N / tile N); a copy engine held by
// cuStreamWaitValue32 on the counter can then send those rows while the GEMM
// goes on (FlashOverlap's tile-wise signalling). Shared by the extension's
// tile GEMM (tile_gemm.cu) and scripts/cutlass_gemm_probe.cu, which checks
// and times them on one GPU. Needs the CUTLASS headers (nvidia-cutlass
// 4.2.0.0) and sm_90a.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/cutlass.h"

namespace jfo::tile_gemm {

// What the signalling epilogues add to a CUTLASS collective epilogue: the
// counters (one per row block of tiles) in its arguments, and `Publish`,
// which makes a tile's stores visible before it adds 1 to its row block's
// counter. A row block of n columns is written when its counter has grown by
// ceil(n / tile n). `kTma`: the base has TMA descriptors to prefetch.
// After each tile's store, `Derived::AfterTile(inside, row block, thread)`
// decides when to publish it.
template <class Derived, class Base, bool kTma>
class CountingEpilogue : public Base {
 public:
  struct Arguments {
    typename Base::Arguments base;
    uint32_t* counters = nullptr;
  };
  // Derived, not wrapped: the kernel reads the base's fields directly.
  struct Params : Base::Params {
    uint32_t* counters;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args,
                                        void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) =
        Base::to_underlying_arguments(shape, args.base, workspace);
    params.counters = args.counters;
    return params;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const& shape, Arguments const& args) {
    return Base::get_workspace_size(shape, args.base);
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const& shape, Arguments const& args,
                                              void* workspace, cudaStream_t stream,
                                              cutlass::CudaHostAdapter* adapter = nullptr) {
    return Base::initialize_workspace(shape, args.base, workspace, stream, adapter);
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    return args.counters != nullptr && Base::can_implement(shape, args.base);
  }
  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    if constexpr (kTma) Base::prefetch_tma_descriptors(params);
  }

  template <class Storage>
  CUTLASS_HOST_DEVICE CountingEpilogue(Params const& params, Storage& storage)
      : Base(params, storage), counters_(params.counters) {}

  template <class ProblemShape, class TileShape, class TileCoord, class Acc, class TiledMma,
            class Storage>
  CUTLASS_DEVICE auto store(typename Base::LoadPipeline load_pipeline,
                            typename Base::LoadPipelineState load_state,
                            typename Base::StorePipeline store_pipeline,
                            typename Base::StorePipelineState store_state,
                            ProblemShape problem_shape, TileShape tile_shape,
                            TileCoord tile_coord, Acc accumulators, TiledMma tiled_mma,
                            int thread_idx, Storage& storage, int subtile_index = -1) {
    auto states = Base::store(load_pipeline, load_state, store_pipeline, store_state,
                              problem_shape, tile_shape, tile_coord, accumulators, tiled_mma,
                              thread_idx, storage, subtile_index);
    // Tiles wholly outside the problem (the scheduler pads the column tiles
    // to a multiple of the cluster) store nothing and count nothing.
    const bool inside =
        cute::get<0>(tile_coord) * cute::size<0>(tile_shape) < cute::get<0>(problem_shape) &&
        cute::get<1>(tile_coord) * cute::size<1>(tile_shape) < cute::get<1>(problem_shape);
    static_cast<Derived*>(this)->AfterTile(inside, int(cute::get<0>(tile_coord)), thread_idx);
    return states;
  }

 protected:
  // The caller's stores, and those of the threads it has synchronized with
  // (the fence is cumulative), before the count that publishes them.
  CUTLASS_DEVICE void Publish(int row_block) const {
    __threadfence();
    atomicAdd(counters_ + row_block, 1u);
  }

 private:
  uint32_t* counters_;
};

// TMA stores: the first warp issues them as one bulk group per epilogue
// subtile, asynchronously. Waiting for a tile's own groups would hold its
// threads' next tile until the stores land, so a tile is published once the
// next tile's stores are issued (then only that tile's kSubtiles groups may
// still be pending), and the last tile in store_tail. Completion (not the
// `.read` of CUTLASS's own waits, which frees only the shared memory) makes
// the stores visible to the waiting thread; the proxy fence orders them, as
// the TMA unit's writes, before its generic release.
template <class Base>
class TmaSignallingEpilogue
    : public CountingEpilogue<TmaSignallingEpilogue<Base>, Base, true> {
  using Counting = CountingEpilogue<TmaSignallingEpilogue, Base, true>;
  friend Counting;
  static constexpr int kSubtiles =
      (cute::size<0>(typename Base::CtaTileMNK{}) / cute::size<0>(typename Base::EpilogueTile{})) *
      (cute::size<1>(typename Base::CtaTileMNK{}) / cute::size<1>(typename Base::EpilogueTile{}));

 public:
  using Counting::Counting;

  CUTLASS_DEVICE auto store_tail(typename Base::LoadPipeline load_pipeline,
                                 typename Base::LoadPipelineState load_state,
                                 typename Base::StorePipeline store_pipeline,
                                 typename Base::StorePipelineState store_state) {
    auto states = Base::store_tail(load_pipeline, load_state, store_pipeline, store_state);
    if (pending_ >= 0) {  // only the first warp's threads hold a tile
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      PublishPending();
      pending_ = -1;
    }
    return states;
  }

 private:
  CUTLASS_DEVICE void AfterTile(bool inside, int row_block, int thread_idx) {
    if (thread_idx / 32 != 0) return;  // not the warp that issued the stores
    if (pending_ >= 0) {
      asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kSubtiles) : "memory");
      PublishPending();
    }
    pending_ = inside ? row_block : -1;
  }

  CUTLASS_DEVICE void PublishPending() const {
    __syncwarp();  // every lane's groups are complete
    if (threadIdx.x % 32 == 0) {
      asm volatile("fence.proxy.async.global;" ::: "memory");
      Counting::Publish(pending_);
    }
  }

  int pending_ = -1;  // the row block of the tile whose stores may be in flight
};

}  // namespace jfo::tile_gemm
