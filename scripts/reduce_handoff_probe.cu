// How long one H200 takes to hand a sum of 128 CTAs' contributions to other
// CTAs, by the ways the one-kernel decode step (ffi/src/transformer_decode)
// could do it, against the handoff it has: each CTA storing its own slice,
// the others polling every value (an all-gather, no reduction).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/reduce_handoff_probe scripts/reduce_handoff_probe.cu
//   /tmp/reduce_handoff_probe > reduce_handoff_probe.json
//
// 128 producer CTAs and 4 consumer CTAs (256 threads each, one a SM, a
// cooperative launch), all starting at one %globaltimer instant. Variants:
//   stores      each producer stores its N / 128 floats; consumers poll all N
//               until none is the sentinel (what the kernel does today);
//   red_f32     each producer adds to all N floats (red.add.f32), then counts
//               itself with a release add; consumers acquire the count, then read;
//   red_v4      the same with 16-byte vector adds (red.add.v4.f32);
//   red_u64     each producer adds (value << 8) + 1 to N 64-bit words (a
//               fixed-point sum and a count in one word: no count, no fence);
//               consumers poll each word until its count is 128.
// Per variant, 21 launches: the median over launches of the last producer's
// "issued" and the last consumer's "done", in ns from the start instant.
// Every consumer checks every value exactly (the contributions are small
// integers); the probe exits 1 on a mismatch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../ffi/src/device_clock.cuh"
#include "cuda_check.cuh"

using jfo::GlobalTimerNs;

constexpr int kThreads = 256, kProducers = 128, kConsumers = 4, kLaunches = 21;
constexpr int kStartDelayNs = 20000;

enum Variant { kStores, kRedF32, kRedV4, kRedU64, kVariants };
const char* const kNames[kVariants] = {"stores", "red_f32", "red_v4", "red_u64"};

struct Args {
  int n;
  float* floats;           // [n], the sentinel (all ones) or zeros before a launch
  unsigned long long* words;  // [n], zeros before a launch
  unsigned* count;
  unsigned long long* start;   // the instant every CTA starts at
  unsigned long long* issued;  // [kProducers]
  unsigned long long* done;    // [kConsumers]
  int* bad;
};

__device__ __forceinline__ float LoadRelaxedF32(const float* p) {
  float v;
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long LoadRelaxedU64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Producer j's contribution to every output: j + 1 (exact in float32 sums).
__device__ __forceinline__ float Contribution(int j) { return static_cast<float>(j + 1); }

template <Variant V>
__global__ void __launch_bounds__(kThreads, 1) Handoff(Args a) {
  __shared__ unsigned long long start;
  const int cta = blockIdx.x;
  if (threadIdx.x == 0) {
    if (cta == 0) atomicExch(a.start, GlobalTimerNs() + kStartDelayNs);
    unsigned long long s;
    while ((s = *reinterpret_cast<volatile unsigned long long*>(a.start)) == 0) {
    }
    start = s;
  }
  __syncthreads();
  while (GlobalTimerNs() < start) {
  }
  const int n = a.n;
  if (cta < kProducers) {
    const float value = Contribution(cta);
    if (V == kStores) {
      const int per = n / kProducers;
      for (int i = threadIdx.x; i < per; i += kThreads) a.floats[cta * per + i] = value;
    } else if (V == kRedF32) {
      for (int i = threadIdx.x; i < n; i += kThreads) {
        asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;" ::"l"(a.floats + i), "f"(value)
                     : "memory");
      }
    } else if (V == kRedV4) {
      for (int i = threadIdx.x * 4; i < n; i += kThreads * 4) {
        asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %1, %1, %1};"
                     ::"l"(a.floats + i), "f"(value) : "memory");
      }
    } else {
      const unsigned long long packed = (static_cast<unsigned long long>(cta + 1) << 8) + 1;
      for (int i = threadIdx.x; i < n; i += kThreads) {
        asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(a.words + i), "l"(packed)
                     : "memory");
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (V == kRedF32 || V == kRedV4) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(a.count) : "memory");
      }
      a.issued[cta] = GlobalTimerNs() - start;
    }
    return;
  }
  // Consumers: every value, checked.
  const float total = kProducers * (kProducers + 1) / 2.f;
  bool bad = false;
  if (V == kStores) {
    const int per = n / kProducers;
    for (int i = threadIdx.x; i < n; i += kThreads) {
      float v;
      while (__float_as_uint(v = LoadRelaxedF32(a.floats + i)) == 0xFFFFFFFFu) {
      }
      bad |= v != Contribution(i / per);
    }
  } else if (V == kRedF32 || V == kRedV4) {
    if (threadIdx.x == 0) {
      unsigned c;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(a.count) : "memory");
      } while (c < kProducers);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += kThreads) bad |= LoadRelaxedF32(a.floats + i) != total;
  } else {
    for (int i = threadIdx.x; i < n; i += kThreads) {
      unsigned long long w;
      while (((w = LoadRelaxedU64(a.words + i)) & 0xFF) != kProducers) {
      }
      bad |= (w >> 8) != static_cast<unsigned long long>(total);
    }
  }
  if (bad) atomicAdd(a.bad, 1);
  __syncthreads();
  if (threadIdx.x == 0) a.done[cta - kProducers] = GlobalTimerNs() - start;
}

template <Variant V>
void Launch(const Args& a) {
  void* params[] = {const_cast<Args*>(&a)};
  CHECK_CUDA(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(Handoff<V>),
                                         kProducers + kConsumers, kThreads, params));
}

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 4096;
  Args a = {};
  a.n = n;
  CHECK_CUDA(cudaMalloc(&a.floats, n * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&a.words, n * sizeof(unsigned long long)));
  CHECK_CUDA(cudaMalloc(&a.count, sizeof(unsigned)));
  CHECK_CUDA(cudaMalloc(&a.start, sizeof(unsigned long long)));
  CHECK_CUDA(cudaMalloc(&a.issued, kProducers * sizeof(unsigned long long)));
  CHECK_CUDA(cudaMalloc(&a.done, kConsumers * sizeof(unsigned long long)));
  CHECK_CUDA(cudaMalloc(&a.bad, sizeof(int)));
  CHECK_CUDA(cudaMemset(a.bad, 0, sizeof(int)));
  std::printf("{\"n\": %d, \"producers\": %d, \"consumers\": %d, \"launches\": %d, \"rows\": [\n",
              n, kProducers, kConsumers, kLaunches);
  for (int v = 0; v < kVariants; ++v) {
    std::vector<double> issued, done;
    for (int l = 0; l < kLaunches; ++l) {
      CHECK_CUDA(cudaMemset(a.floats, v == kStores ? 0xFF : 0, n * sizeof(float)));
      CHECK_CUDA(cudaMemset(a.words, 0, n * sizeof(unsigned long long)));
      CHECK_CUDA(cudaMemset(a.count, 0, sizeof(unsigned)));
      CHECK_CUDA(cudaMemset(a.start, 0, sizeof(unsigned long long)));
      switch (v) {
        case kStores: Launch<kStores>(a); break;
        case kRedF32: Launch<kRedF32>(a); break;
        case kRedV4: Launch<kRedV4>(a); break;
        default: Launch<kRedU64>(a); break;
      }
      CHECK_CUDA(cudaDeviceSynchronize());
      std::vector<unsigned long long> is(kProducers), dn(kConsumers);
      CHECK_CUDA(cudaMemcpy(is.data(), a.issued, sizeof(unsigned long long) * kProducers,
                            cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(dn.data(), a.done, sizeof(unsigned long long) * kConsumers,
                            cudaMemcpyDeviceToHost));
      issued.push_back(static_cast<double>(*std::max_element(is.begin(), is.end())));
      done.push_back(static_cast<double>(*std::max_element(dn.begin(), dn.end())));
    }
    std::sort(issued.begin(), issued.end());
    std::sort(done.begin(), done.end());
    std::printf("  {\"variant\": \"%s\", \"last_issued_ns\": %.0f, \"last_done_ns\": %.0f, "
                "\"last_done_ns_min\": %.0f, \"last_done_ns_max\": %.0f}%s\n",
                kNames[v], issued[kLaunches / 2], done[kLaunches / 2], done.front(),
                done.back(), v + 1 < kVariants ? "," : "");
  }
  int bad = 0;
  CHECK_CUDA(cudaMemcpy(&bad, a.bad, sizeof(int), cudaMemcpyDeviceToHost));
  std::printf("], \"mismatched_consumers\": %d}\n", bad);
  return bad ? 1 : 0;
}
