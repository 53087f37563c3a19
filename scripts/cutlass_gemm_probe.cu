// Can a GEMM of our own match cuBLASLt at the fused ops' shapes? FlashOverlap
// needs one GEMM over the whole problem that signals each finished row chunk
// (benchmarks/NOTES.md, "Next measurements" 1); CUTLASS's Hopper kernels are
// where such a GEMM would start. This times plain CUTLASS 3 warp-specialized
// bf16 GEMMs (row-major A [M, K], B [K, N], D [M, N], fp32 accumulation, as
// the extension's GEMMs) in a few tile configurations, after checking 256
// random outputs of each against a float64 dot on the host.
//
// CUTLASS is header-only and not on the GPU machine (no registry there), so
// build here and carry the binary:
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr \
//     -I<cutlass>/include -I<cutlass>/tools/util/include \
//     -o build/cutlass_gemm_probe scripts/cutlass_gemm_probe.cu
//   build/cutlass_gemm_probe > cutlass_gemm_probe.json   # on the GPU
// Compare with cuBLAS at the same shapes in the same call, e.g. torch.matmul
// (scripts/gemm_lanes_probe.py times it as "whole").
//
// Timing: CUDA events around 20 back-to-back launches, median of 7 such
// batches after one warm-up batch; fresh random data, one set per shape.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cuda_check.cuh"

#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;


namespace {

using Element = cutlass::bfloat16_t;
using Layout = cutlass::layout::RowMajor;
constexpr int kAlignment = 8;  // 16 bytes of bf16

template <class TileShape, class ClusterShape, class Schedule, class EpilogueSchedule>
struct Config {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, Layout,
      kAlignment, Element, Layout, kAlignment, EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, Layout, kAlignment,
      Element, Layout, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop,
                                                      Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using Cooperative256x128 =
    Config<Shape<_256, _128, _64>, Shape<_1, _2, _1>,
           cutlass::gemm::KernelTmaWarpSpecializedCooperative,
           cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Cooperative128x256 =
    Config<Shape<_128, _256, _64>, Shape<_2, _1, _1>,
           cutlass::gemm::KernelTmaWarpSpecializedCooperative,
           cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Pingpong128x128 =
    Config<Shape<_128, _128, _64>, Shape<_1, _2, _1>,
           cutlass::gemm::KernelTmaWarpSpecializedPingpong,
           cutlass::epilogue::TmaWarpSpecialized>;

struct Problem {
  int m, n, k;
  const Element* a;
  const Element* b;
  Element* d;
};

// Median microseconds per launch, or a negative value if the configuration
// cannot run the problem or gets wrong results.
template <class C>
double Time(const Problem& p, const std::vector<float>& ha, const std::vector<float>& hb,
            std::mt19937& rng, cudaStream_t stream, const char** why) {
  using Gemm = typename C::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideC = typename Gemm::GemmKernel::StrideC;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  auto sa = cutlass::make_cute_packed_stride(StrideA{}, {p.m, p.k, 1});
  auto sb = cutlass::make_cute_packed_stride(StrideB{}, {p.n, p.k, 1});
  auto sc = cutlass::make_cute_packed_stride(StrideC{}, {p.m, p.n, 1});
  auto sd = cutlass::make_cute_packed_stride(StrideD{}, {p.m, p.n, 1});
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  auto hw = cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename Gemm::GemmKernel>(
      device);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {p.m, p.n, p.k, 1},
                                {p.a, sa, p.b, sb},
                                {{1.0f, 0.0f}, p.d, sc, p.d, sd},
                                hw};
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    *why = "can_implement failed";
    return -1;
  }
  void* workspace = nullptr;
  const size_t workspace_bytes = Gemm::get_workspace_size(args);
  if (workspace_bytes) CHECK_CUDA(cudaMalloc(&workspace, workspace_bytes));
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) {
    *why = "initialize failed";
    return -1;
  }
  // Poisoned output, one run, then 256 random entries against float64.
  CHECK_CUDA(cudaMemsetAsync(p.d, 0xff, size_t(p.m) * p.n * sizeof(Element), stream));
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    *why = "run failed";
    return -1;
  }
  std::vector<Element> hd(size_t(p.m) * p.n);
  CHECK_CUDA(cudaMemcpyAsync(hd.data(), p.d, hd.size() * sizeof(Element),
                             cudaMemcpyDeviceToHost, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::uniform_int_distribution<int> row(0, p.m - 1), col(0, p.n - 1);
  for (int s = 0; s < 256; ++s) {
    const int i = row(rng), j = col(rng);
    double want = 0;
    for (int l = 0; l < p.k; ++l) want += double(ha[size_t(i) * p.k + l]) * hb[size_t(l) * p.n + j];
    const double got = float(hd[size_t(i) * p.n + j]);
    // bf16 output: 2^-8 relative, plus the fp32 sum's rounding over k terms.
    if (!(std::fabs(got - want) <= 1e-2 * std::fabs(want) + 1e-3 * std::sqrt(double(p.k)))) {
      *why = "wrong result";
      std::fprintf(stderr, "D[%d, %d] = %g, float64 says %g\n", i, j, got, want);
      return -1;
    }
  }
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> batches;
  constexpr int kLaunches = 20, kBatches = 7;
  for (int batch = 0; batch <= kBatches; ++batch) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    for (int r = 0; r < kLaunches; ++r) gemm.run(stream);
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (batch > 0) batches.push_back(1e3 * ms / kLaunches);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  if (workspace) CHECK_CUDA(cudaFree(workspace));
  std::sort(batches.begin(), batches.end());
  return batches[batches.size() / 2];
}

std::vector<float> Random(size_t count, std::mt19937& rng, Element* device) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<Element> host(count);
  std::vector<float> rounded(count);
  for (size_t i = 0; i < count; ++i) {
    host[i] = Element(normal(rng));
    rounded[i] = float(host[i]);
  }
  CHECK_CUDA(cudaMemcpy(device, host.data(), count * sizeof(Element), cudaMemcpyHostToDevice));
  return rounded;
}

}  // namespace

int main() {
  // M x K x N of one device's GEMM: the fused ops' whole problems at the
  // issue's shapes (all_gather_matmul at m_shard x K x n_shard computes
  // [2 m_shard, K] @ [K, n_shard]) and Mamba-2's in_proj backward.
  const int shapes[][3] = {{2048, 4096, 4096},  {4096, 8192, 7168},  {4096, 8192, 14336},
                           {8192, 8192, 4096},  {8192, 8192, 7168},  {2048, 8192, 7168},
                           {8192, 5152, 2048}};
  std::mt19937 rng(2026);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("{\"rows\": [\n");
  bool first = true;
  for (const auto& s : shapes) {
    Problem p{s[0], s[2], s[1], nullptr, nullptr, nullptr};
    Element *a, *b, *d;
    CHECK_CUDA(cudaMalloc(&a, size_t(p.m) * p.k * sizeof(Element)));
    CHECK_CUDA(cudaMalloc(&b, size_t(p.k) * p.n * sizeof(Element)));
    CHECK_CUDA(cudaMalloc(&d, size_t(p.m) * p.n * sizeof(Element)));
    const auto ha = Random(size_t(p.m) * p.k, rng, a);
    const auto hb = Random(size_t(p.k) * p.n, rng, b);
    p.a = a;
    p.b = b;
    p.d = d;
    struct Entry {
      const char* name;
      double (*time)(const Problem&, const std::vector<float>&, const std::vector<float>&,
                     std::mt19937&, cudaStream_t, const char**);
    };
    const Entry configs[] = {
        {"cooperative_256x128_cluster1x2", Time<Cooperative256x128>},
        {"cooperative_128x256_cluster2x1", Time<Cooperative128x256>},
        {"pingpong_128x128_cluster1x2", Time<Pingpong128x128>},
    };
    for (const auto& c : configs) {
      const char* why = "";
      const double us = c.time(p, ha, hb, rng, stream, &why);
      const double tflops = us > 0 ? 2.0 * p.m * p.n * p.k / us / 1e6 : 0;
      std::printf("%s  {\"m\": %d, \"k\": %d, \"n\": %d, \"config\": \"%s\", \"us\": %.2f, "
                  "\"tflops\": %.1f, \"error\": \"%s\"}",
                  first ? "" : ",\n", p.m, p.k, p.n, c.name, us, tflops, why);
      std::fflush(stdout);
      first = false;
    }
    CHECK_CUDA(cudaFree(a));
    CHECK_CUDA(cudaFree(b));
    CHECK_CUDA(cudaFree(d));
  }
  std::printf("\n]}\n");
  return 0;
}
