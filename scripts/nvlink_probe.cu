// The NVLink ceilings between GPU 0 and GPU 1 of this machine, for the
// all-reduce's bandwidth target (README "All-reduce"): how fast bytes move
// between two GPUs by copy engine, by SM stores into the peer (push), by SM
// loads from the peer (pull), and in the pattern of a single-phase two-shot
// all-reduce of two ranks (each GPU reads half of the peer's buffer, adds its
// own half, writes the sum to itself and to the peer), with a local copy for
// scale. Both GPUs move data at once unless the row says "one way".
//
//   nvcc -O3 -arch=sm_90 -o /tmp/nvlink_probe scripts/nvlink_probe.cu
//   /tmp/nvlink_probe > nvlink_probe.json
//
// Host-timed batches of `kReps` transfers (both GPUs synchronised before and
// after), median of `kBatches` batches; the first batch warms up and is
// dropped. GB/s counts the bytes that cross the link each way per transfer
// (none for local_copy: there it is the bytes copied).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "cuda_check.cuh"


constexpr int kReps = 20;
constexpr int kBatches = 8;

__global__ void CopyKernel(uint4* dst, const uint4* src, size_t packs) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < packs;
       i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = __ldcg(src + i);
  }
}

// y_local[i] = y_peer[i] = x_local[i] + x_peer[i] over this GPU's half.
__global__ void TwoShotPattern(uint4* y_local, uint4* y_peer,
                               const uint4* x_local, const uint4* x_peer,
                               size_t packs) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < packs;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint4 a = __ldcg(x_local + i), b = __ldcg(x_peer + i);
    uint4 s;
    const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
    __nv_bfloat162* ps = reinterpret_cast<__nv_bfloat162*>(&s);
    for (int k = 0; k < 4; ++k) ps[k] = __hadd2(pa[k], pb[k]);
    y_local[i] = s;
    y_peer[i] = s;
  }
}

struct Gpu {
  char* src;
  char* dst;
  cudaStream_t stream;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Microseconds per transfer: `issue(g)` enqueues one transfer of GPU g.
double Time(Gpu* gpus, int ngpus, const std::function<void(int)>& issue) {
  std::vector<double> per;
  for (int batch = 0; batch <= kBatches; ++batch) {
    for (int g = 0; g < 2; ++g) {
      CHECK_CUDA(cudaSetDevice(g));
      CHECK_CUDA(cudaDeviceSynchronize());
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < kReps; ++r) {
      for (int g = 0; g < ngpus; ++g) {
        CHECK_CUDA(cudaSetDevice(g));
        issue(g);
      }
    }
    for (int g = 0; g < 2; ++g) {
      CHECK_CUDA(cudaSetDevice(g));
      CHECK_CUDA(cudaStreamSynchronize(gpus[g].stream));
    }
    const auto t1 = std::chrono::steady_clock::now();
    if (batch > 0) {
      per.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() /
                    kReps);
    }
  }
  CHECK_CUDA(cudaGetLastError());
  return Median(per);
}

int main() {
  int count = 0;
  CHECK_CUDA(cudaGetDeviceCount(&count));
  if (count < 2) {
    std::fprintf(stderr, "nvlink_probe: needs 2 GPUs, found %d\n", count);
    return 1;
  }
  const size_t kMax = 256u << 20;
  Gpu gpus[2];
  int sms = 0;
  for (int g = 0; g < 2; ++g) {
    CHECK_CUDA(cudaSetDevice(g));
    CHECK_CUDA(cudaDeviceEnablePeerAccess(1 - g, 0));
    CHECK_CUDA(cudaMalloc(&gpus[g].src, kMax));
    CHECK_CUDA(cudaMalloc(&gpus[g].dst, kMax));
    CHECK_CUDA(cudaMemset(gpus[g].src, 1, kMax));
    CHECK_CUDA(cudaStreamCreateWithFlags(&gpus[g].stream, cudaStreamNonBlocking));
    CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, g));
  }
  std::printf("{\"sms\": %d, \"reps\": %d, \"batches\": %d, \"rows\": [\n", sms,
              kReps, kBatches);
  bool first = true;
  auto row = [&](const std::string& name, size_t bytes, int blocks,
                 int threads, double us) {
    std::printf("%s  {\"name\": \"%s\", \"bytes\": %zu, \"blocks\": %d, "
                "\"threads\": %d, \"us\": %.2f, \"gb_per_s\": %.1f}",
                first ? "" : ",\n", name.c_str(), bytes, blocks, threads, us,
                bytes / us / 1e3);
    std::fflush(stdout);
    first = false;
  };
  const int grids[][2] = {{sms, 1024}, {2 * sms, 512}, {4 * sms, 256}};
  for (size_t bytes : {size_t(8) << 20, size_t(32) << 20, size_t(128) << 20}) {
    const size_t packs = bytes / 16;
    for (int ngpus : {1, 2}) {
      row(ngpus == 1 ? "copy_engine_one_way" : "copy_engine", bytes, 0, 0,
          Time(gpus, ngpus, [&](int g) {
            CHECK_CUDA(cudaMemcpyPeerAsync(gpus[1 - g].dst, 1 - g, gpus[g].src, g,
                                      bytes, gpus[g].stream));
          }));
    }
    for (const auto& grid : grids) {
      const int blocks = grid[0], threads = grid[1];
      row("local_copy", bytes, blocks, threads, Time(gpus, 2, [&](int g) {
            CopyKernel<<<blocks, threads, 0, gpus[g].stream>>>(
                reinterpret_cast<uint4*>(gpus[g].dst),
                reinterpret_cast<const uint4*>(gpus[g].src), packs);
          }));
      for (int ngpus : {1, 2}) {
        row(ngpus == 1 ? "sm_push_one_way" : "sm_push", bytes, blocks, threads,
            Time(gpus, ngpus, [&](int g) {
              CopyKernel<<<blocks, threads, 0, gpus[g].stream>>>(
                  reinterpret_cast<uint4*>(gpus[1 - g].dst),
                  reinterpret_cast<const uint4*>(gpus[g].src), packs);
            }));
      }
      row("sm_pull", bytes, blocks, threads, Time(gpus, 2, [&](int g) {
            CopyKernel<<<blocks, threads, 0, gpus[g].stream>>>(
                reinterpret_cast<uint4*>(gpus[g].dst),
                reinterpret_cast<const uint4*>(gpus[1 - g].src), packs);
          }));
      // An all-reduce of `bytes` per rank: each GPU sums its half, so it
      // stores bytes / 2 into the peer and the peer loads bytes / 2 from it:
      // `bytes` over the link each way, as in a two-shot.
      row("two_shot_pattern", bytes, blocks, threads,
          Time(gpus, 2, [&](int g) {
            const size_t half = g * (bytes / 2);
            TwoShotPattern<<<blocks, threads, 0, gpus[g].stream>>>(
                reinterpret_cast<uint4*>(gpus[g].dst + half),
                reinterpret_cast<uint4*>(gpus[1 - g].dst + half),
                reinterpret_cast<const uint4*>(gpus[g].src + half),
                reinterpret_cast<const uint4*>(gpus[1 - g].src + half),
                packs / 2);
          }));
    }
  }
  std::printf("\n]}\n");
  return 0;
}
