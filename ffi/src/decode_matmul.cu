// y = x @ w for decoding's few rows (x [m, k] with m <= 8, w [k, n], bf16).
//
// At one token per step the weight GEMMs read every weight once and do
// almost no arithmetic, so their time is the weight's bytes over HBM
// bandwidth. XLA's GEMMs of one or a few rows reach about 3 TB/s on an H200
// (4.8 peak) and add a kernel that sums their split-K parts. Here each
// thread streams 16-byte rows of a 64-column tile of w, the CTAs of a
// cluster split k between them and sum their parts through distributed
// shared memory: one kernel, no workspace, nothing to zero between calls.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>

#include "handlers.h"

namespace jfo {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kColumnsPerThread = 8;  // 16 bytes of bf16
constexpr int kMaxRows = 8;
constexpr int kMaxClusterSplits = 8;  // the portable cluster size
constexpr int kStageRows = 1024;      // rows of x staged in shared memory at a time

// Shared memory of one CTA: a stage of x as float [rows][m], then the warps'
// sums [warps][m][tile], then the CTA's part [m][tile] its cluster reads.
constexpr size_t SharedBytes(int m, int tile) {
  return sizeof(float) * (static_cast<size_t>(kStageRows) * m +
                          static_cast<size_t>(kWarps + 1) * m * tile);
}

__device__ __forceinline__ void AddProducts(float (&acc)[kColumnsPerThread], uint4 packed,
                                            float scale) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < kColumnsPerThread / 2; ++i) {
    const float2 w = __bfloat1622float2(pairs[i]);
    acc[2 * i] = fmaf(scale, w.x, acc[2 * i]);
    acc[2 * i + 1] = fmaf(scale, w.y, acc[2 * i + 1]);
  }
}

// Grid (column tiles, splits of k); the splits of a tile form one cluster
// (on sm_90 and later; with one split, no cluster). M rows, UNROLL 16-byte
// loads in flight per thread, TILE columns per CTA: each row's TILE * 2
// contiguous bytes are read by TILE / 8 threads.
template <int M, int UNROLL, int TILE>
__global__ void __launch_bounds__(kThreads)
    DecodeMatmulKernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                       __nv_bfloat16* __restrict__ y, int k, int n, int k_per_cta) {
  constexpr int kTileColumns = TILE;
  constexpr int kThreadsPerRow = TILE / kColumnsPerThread;
  constexpr int kRowLanes = kThreads / kThreadsPerRow;  // rows in flight per pass
  extern __shared__ float shared[];
  [[maybe_unused]] const int splits = gridDim.y;
  const int split = blockIdx.y;
  const int k0 = split * k_per_cta;
  const int rows = max(0, min(k, k0 + k_per_cta) - k0);
  float* xs = shared;                                      // [stage rows][M]
  float* warp_sums = xs + kStageRows * M;                  // [warps][M][tile]
  float* part = warp_sums + kWarps * M * kTileColumns;     // [M][tile]

  const int column_thread = threadIdx.x % kThreadsPerRow;
  const int row_lane = threadIdx.x / kThreadsPerRow;
  const int column = blockIdx.x * kTileColumns + column_thread * kColumnsPerThread;
  const bool in_range = column < n;  // n is a multiple of 8: a thread's columns all or none
  const __nv_bfloat16* w_tile = w + static_cast<size_t>(k0) * n + column;

  // With programmatic dependent launch, the CTAs are resident before the
  // kernel ahead of this one ends; every read waits for it here.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  constexpr int kPass = kRowLanes * UNROLL;  // rows one pass of loads covers
  // Streaming loads: each weight is read once a step; L1 and L2 keep the rest.
  auto load_pass = [&](const __nv_bfloat16* w_stage, int stage_rows, int base,
                       uint4 (&loaded)[UNROLL]) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int r = base + u * kRowLanes;
      loaded[u] = (in_range && r < stage_rows)
                      ? __ldcs(reinterpret_cast<const uint4*>(w_stage + static_cast<size_t>(r) * n))
                      : make_uint4(0, 0, 0, 0);
    }
  };

  float acc[M][kColumnsPerThread] = {};
  for (int stage = 0; stage < rows; stage += kStageRows) {
    const int stage_rows = min(kStageRows, rows - stage);
    const __nv_bfloat16* w_stage = w_tile + static_cast<size_t>(stage) * n;
    uint4 loaded[UNROLL];
    load_pass(w_stage, stage_rows, row_lane, loaded);  // in flight while x is staged
    __syncthreads();  // the previous stage's reads of xs are done
    for (int i = threadIdx.x; i < stage_rows * M; i += kThreads) {
      const int row = i / stage_rows, r = i % stage_rows;  // coalesced along k
      xs[r * M + row] = __bfloat162float(x[static_cast<size_t>(row) * k + k0 + stage + r]);
    }
    __syncthreads();
    for (int base = row_lane; base < stage_rows; base += kPass) {
      uint4 next[UNROLL];  // the next pass's loads in flight during this one's arithmetic
      load_pass(w_stage, stage_rows, base + kPass, next);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int r = base + u * kRowLanes;
        if (r < stage_rows) {
#pragma unroll
          for (int row = 0; row < M; ++row) AddProducts(acc[row], loaded[u], xs[r * M + row]);
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) loaded[u] = next[u];
    }
  }

  // Sum the warp's row lanes (lanes kThreadsPerRow apart hold the same columns).
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int row = 0; row < M; ++row) {
#pragma unroll
    for (int j = 0; j < kColumnsPerThread; ++j) {
      float v = acc[row][j];
#pragma unroll
      for (int offset = kThreadsPerRow; offset < 32; offset *= 2) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
      }
      if (lane < kThreadsPerRow) {
        warp_sums[(warp * M + row) * kTileColumns + lane * kColumnsPerThread + j] = v;
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < M * kTileColumns; i += kThreads) {
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) sum += warp_sums[v * M * kTileColumns + i];
    part[i] = sum;
  }

  // Each CTA of the cluster writes a share of the tile, summed over the splits.
  int first = 0, count = M * kTileColumns;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cg::cluster_group cluster = cg::this_cluster();
  if (splits > 1) {
    cluster.sync();  // every CTA's part is written
    const int share = (count + splits - 1) / splits;
    first = split * share;
    count = max(0, min(count, first + share) - first);
  } else {
    __syncthreads();
  }
#else
  __syncthreads();
#endif
  for (int i = threadIdx.x; i < count; i += kThreads) {
    const int index = first + i;
    float sum = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (splits > 1) {
      for (int s = 0; s < splits; ++s) sum += cluster.map_shared_rank(part, s)[index];
    } else {
      sum = part[index];
    }
#else
    sum = part[index];
#endif
    const int row = index / kTileColumns;
    const int col = blockIdx.x * kTileColumns + index % kTileColumns;
    if (col < n) y[static_cast<size_t>(row) * n + col] = __float2bfloat16(sum);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (splits > 1) cluster.sync();  // the others' reads of this CTA's part are done
#endif
}

// The SMs of a device, or -1 before Hopper: there are no clusters, one split.
int SmCount(int device) {
  const DeviceInfo info = DeviceInfoOf(device);
  return info.major >= 9 ? std::max(info.sms, 1) : -1;
}

// Splits of k per column tile: enough CTAs for two per SM, a power of two
// up to a portable cluster, each with at least 32 rows of k.
int SplitsFor(int device, int k, int n, int tile) {
  const int sms = SmCount(device);
  if (sms < 0) return 1;
  const int tiles = (n + tile - 1) / tile;
  int splits = 1;
  while (splits < kMaxClusterSplits && tiles * splits < 2 * sms && k / (2 * splits) >= 32) {
    splits *= 2;
  }
  return splits;
}

template <int M, int TILE>
ffi::Error Launch(cudaStream_t stream, const __nv_bfloat16* x, const __nv_bfloat16* w,
                  __nv_bfloat16* y, int k, int n, int splits) {
  constexpr int kUnroll = M <= 2 ? 8 : 4;
  auto kernel = DecodeMatmulKernel<M, kUnroll, TILE>;
  const int k_per_cta = (k + splits - 1) / splits;
  constexpr size_t shared = SharedBytes(M, TILE);
  if constexpr (shared > 48 * 1024) {
    JFO_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((n + TILE - 1) / TILE, splits, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  config.attrs = attrs;
  if (splits > 1) {  // splits > 1 only on sm_90 and later (SplitsFor)
    attrs[0].id = cudaLaunchAttributeClusterDimension;
    attrs[0].val.clusterDim.x = 1;
    attrs[0].val.clusterDim.y = splits;
    attrs[0].val.clusterDim.z = 1;
    // Launched before the kernel ahead ends (it waits in griddepcontrol.wait):
    // the launch and the CTAs' start overlap that kernel's tail.
    attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[1].val.programmaticStreamSerializationAllowed = 1;
    config.numAttrs = 2;
  }
  JFO_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, kernel, x, w, y, k, n, k_per_cta));
  return ffi::Error::Success();
}

template <int TILE>
ffi::Error LaunchRows(cudaStream_t stream, int64_t m, const __nv_bfloat16* x,
                      const __nv_bfloat16* w, __nv_bfloat16* y, int k, int n, int device) {
  const int splits = SplitsFor(device, k, n, TILE);
  switch (m) {
    case 1: return Launch<1, TILE>(stream, x, w, y, k, n, splits);
    case 2: return Launch<2, TILE>(stream, x, w, y, k, n, splits);
    case 3: return Launch<3, TILE>(stream, x, w, y, k, n, splits);
    case 4: return Launch<4, TILE>(stream, x, w, y, k, n, splits);
    case 5: return Launch<5, TILE>(stream, x, w, y, k, n, splits);
    case 6: return Launch<6, TILE>(stream, x, w, y, k, n, splits);
    case 7: return Launch<7, TILE>(stream, x, w, y, k, n, splits);
    default: return Launch<8, TILE>(stream, x, w, y, k, n, splits);
  }
}

ffi::Error DecodeMatmulImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Result<ffi::AnyBuffer> y, int32_t tile_columns) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 ||
      y->element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("jax_flashoverlap decode_matmul: x, w and y must be bf16");
  }
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[0] ||
      yd[0] != xd[0] || yd[1] != wd[1]) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap decode_matmul: expected x [m, k], w [k, n] and y [m, n]");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  if (m < 1 || m > kMaxRows || n % kColumnsPerThread || k < 1 || k > (1 << 20) ||
      n > (int64_t{1} << 30)) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap decode_matmul: needs 1 <= m <= 8 rows, 1 <= k <= 2^20 and n a "
        "multiple of 8; got m=" + std::to_string(m) + ", k=" + std::to_string(k) +
        ", n=" + std::to_string(n));
  }
  int device = 0;
  JFO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const auto* xp = static_cast<const __nv_bfloat16*>(x.untyped_data());
  const auto* wp = static_cast<const __nv_bfloat16*>(w.untyped_data());
  auto* yp = static_cast<__nv_bfloat16*>(y->untyped_data());
  const int ki = static_cast<int>(k), ni = static_cast<int>(n);
  switch (tile_columns) {
    case 64: return LaunchRows<64>(stream, m, xp, wp, yp, ki, ni, device);
    case 128: return LaunchRows<128>(stream, m, xp, wp, yp, ki, ni, device);
    case 256: return LaunchRows<256>(stream, m, xp, wp, yp, ki, ni, device);
    default:
      return ffi::Error::InvalidArgument("jax_flashoverlap decode_matmul: tile_columns must be "
                                         "64, 128 or 256, got " + std::to_string(tile_columns));
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoDecodeMatmul, DecodeMatmulImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()   // XLA's stream
        .Arg<ffi::AnyBuffer>()    // x [m, k]
        .Arg<ffi::AnyBuffer>()    // w [k, n]
        .Ret<ffi::AnyBuffer>()    // y [m, n]
        .Attr<int32_t>("tile_columns"),  // columns per CTA: 64, 128 or 256
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jfo
