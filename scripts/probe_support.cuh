// What the standalone weight-stream probes share: their random data, each
// CTA's share of it, their timing, the device query and the results' date.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "cuda_check.cuh"

// `bytes` of random bf16 integers in [-3, 3] at `device`; returns their sum.
// Every partial sum of them is exact in float, so sums can be checked exactly.
inline int64_t FillRandomBf16Integers(void* device, size_t bytes) {
  std::vector<uint16_t> host(bytes / 2);
  const uint16_t bits[7] = {0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040};
  uint64_t s = 0x9E3779B97F4A7C15ull;
  int64_t sum = 0;
  for (auto& h : host) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    const int value = static_cast<int>((s >> 32) % 7);
    h = bits[value];
    sum += value - 3;
  }
  CHECK_CUDA(cudaMemcpy(device, host.data(), bytes, cudaMemcpyHostToDevice));
  return sum;
}

// The CTA's contiguous share [*begin, *end) of `n` items (words or chunks).
__device__ inline void Share(size_t n, size_t* begin, size_t* end) {
  const size_t per = (n + gridDim.x - 1) / gridDim.x;
  *begin = min(n, blockIdx.x * per);
  *end = min(n, *begin + per);
}

// `warmup` launches, then `passes` timed one by one with CUDA events: the
// median pass, in µs.
inline double MedianUs(const std::function<void()>& launch, int warmup, int passes) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) launch();
  CHECK_CUDA(cudaGetLastError());
  std::vector<float> ms;
  for (int i = 0; i < passes; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    launch();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] * 1e3;
}

// Device 0: its SM count, the shared memory a CTA may opt in to, its properties.
struct Device {
  int sms = 0, max_shared = 0;
  cudaDeviceProp prop{};
};

inline Device QueryDevice() {
  Device d;
  CHECK_CUDA(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK_CUDA(cudaDeviceGetAttribute(&d.max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  CHECK_CUDA(cudaGetDeviceProperties(&d.prop, 0));
  return d;
}

// Now, UTC, as the results' meta has it (2026-12-05T04:41:08Z).
inline std::string UtcNow() {
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return date;
}
