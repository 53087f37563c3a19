// How fast one H200 streams a decode step's weights (2 GiB read once) into
// its SMs, by the ways the one-kernel decode step (ffi/src/transformer_decode)
// could read them: plain 16-byte loads into registers, and TMA bulk copies
// into a ring of shared-memory slots (a ring a CTA refilled after a CTA-wide
// sync, as the kernel has it; a ring a CTA refilled by a producer warp; a
// ring a warp), with and without a GEMV's arithmetic on what lands, and the
// consumers alone; and the ring with chunks asked into L2 ahead of its slots
// ("_line_l2": a prefetch.global.L2 a thread and 128 bytes; "_bulk_l2": one
// cp.async.bulk.prefetch.L2), and over a share that L2 holds, read 64 times
// ("l2_resident": what L2 gives a ring). It says what caps the kernel's
// weight stream: the memory, the ring, or the work done on each chunk.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/hbm_stream_probe scripts/hbm_stream_probe.cu
//   JFO_COMMIT=$(git rev-parse --short HEAD) /tmp/hbm_stream_probe > hbm_stream_probe.json
//
// Each variant: 3 warm-up passes, then 15 passes timed one by one with CUDA
// events; the median pass. TB/s = bytes read / median time. The data are
// random bf16 integers in [-3, 3], so every check is exact: the xor of all
// 16-byte words against the plain loads', the sums against the host's.
// Ring rows also give thread 0's share of the time spent waiting for a
// chunk (the rest it spends on the chunks) and the SM clock it ran at.
// "consume_only" rows re-read slots that are never refilled, "l2_resident"
// rows words read many times: unchecked.
// Exits 1 if a check fails.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "../ffi/src/transformer_decode/sync.cuh"
#include "probe_support.cuh"

constexpr int kThreads = 256;
constexpr int kWarmup = 3, kPasses = 15;

// The decode kernel's own mbarrier and bulk-copy helpers: the rings below
// issue and wait exactly as it does.
using jfo::GlobalTimerNs;
using jfo::transformer_decode::BulkLoad;
using jfo::transformer_decode::MbarrierInit;
using jfo::transformer_decode::MbarrierTryWait;
using jfo::transformer_decode::SharedAddress;

__device__ __forceinline__ uint4 Xor(uint4 a, uint4 b) {
  return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
}

__device__ void StoreXor(uint4 acc, uint4* out) {
  for (int o = 16; o > 0; o /= 2) {
    acc.x ^= __shfl_xor_sync(~0u, acc.x, o);
    acc.y ^= __shfl_xor_sync(~0u, acc.y, o);
    acc.z ^= __shfl_xor_sync(~0u, acc.z, o);
    acc.w ^= __shfl_xor_sync(~0u, acc.w, o);
  }
  if (threadIdx.x % 32 == 0) out[blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32] = acc;
}

// Plain loads, U independent 16-byte loads a thread in flight.
template <int U>
__global__ void __launch_bounds__(kThreads) PlainLoads(const uint4* src, size_t words, uint4* out) {
  size_t begin, end;
  Share(words, &begin, &end);
  uint4 acc = make_uint4(0, 0, 0, 0);
  size_t i = begin + threadIdx.x;
  for (; i + (U - 1) * kThreads < end; i += U * kThreads) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldcs(src + i + u * kThreads);
#pragma unroll
    for (int u = 0; u < U; ++u) acc = Xor(acc, v[u]);
  }
  for (; i < end; i += kThreads) acc = Xor(acc, __ldcs(src + i));
  StoreXor(acc, out);
}

// What the CTA does with each chunk that lands: xor its words, sum its bf16
// values, or a GEMV of 64 columns (8 words a row) against an operand of ones
// in shared memory, as the decode kernel's gate/up stage does at batch 1.
enum class Work { kXor, kSum, kGemv };

template <Work W>
struct Consumer {
  uint4 x = make_uint4(0, 0, 0, 0);
  float acc[8] = {};

  __device__ __forceinline__ void Add(const uint4& w, const __nv_bfloat16* operand, size_t row) {
    if constexpr (W == Work::kXor) {
      x = Xor(x, w);
    } else {
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&w);
      const float o = W == Work::kGemv ? __bfloat162float(operand[row]) : 1.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(pairs[i]);
        acc[2 * i] = fmaf(o, f.x, acc[2 * i]);
        acc[2 * i + 1] = fmaf(o, f.y, acc[2 * i + 1]);
      }
    }
  }

  __device__ void Finish(uint4* out, float* sum) {
    if constexpr (W == Work::kXor) {
      StoreXor(x, out);
    } else {
      float total = 0.f;
      for (int j = 0; j < 8; ++j) total += acc[j];
      // One atomic a warp: a thread each would queue ~10^5 on one address.
      for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(~0u, total, o);
      if (threadIdx.x % 32 == 0) atomicAdd(sum, total);
    }
  }
};

// A ring of shared-memory slots a CTA, filled by TMA bulk copies.
// kProducerWarp false: as the decode kernel, thread 0 refills a slot once
// the CTA has synced after using it. true: a last, extra warp only issues
// copies, each slot refilled once every consumer warp has arrived on its
// "empty" mbarrier; the consumer warps never sync with each other.
// With `prefetch` (kLineL2: every thread one 128-byte prefetch.global.L2;
// kBulkL2: thread 0 one cp.async.bulk.prefetch.L2) each chunk `ahead`
// chunks past the ring's newest is asked into L2 as the ring refills a
// slot: more bytes in flight than the slots hold. `repeat` > 1 reads the
// CTA's share that many times (a share that fits L2: what L2 gives an SM).
enum Prefetch { kNoPrefetch, kLineL2, kBulkL2 };

template <Work W, bool kProducerWarp, bool kCopies = true>
__global__ void __launch_bounds__(1024)
    RingStream(const uint4* src, size_t words, uint4* out, int slots, unsigned slot_bytes,
               float* sum, unsigned long long* stats, int prefetch = kNoPrefetch, int ahead = 0,
               int repeat = 1) {
  extern __shared__ __align__(128) unsigned char shared[];
  const long long t0 = clock64();
  const uint64_t ns0 = GlobalTimerNs();
  long long waited = 0;
  uint64_t* full = reinterpret_cast<uint64_t*>(shared + size_t(slots) * slot_bytes);
  uint64_t* empty = full + slots;
  auto* operand = reinterpret_cast<__nv_bfloat16*>(empty + slots);
  const int consumers = kProducerWarp ? blockDim.x - 32 : blockDim.x;
  const int consumer_warps = consumers / 32;
  const bool producer = kProducerWarp ? threadIdx.x == consumers : threadIdx.x == 0;
  size_t begin, end;
  Share(words, &begin, &end);
  const size_t slot_words = slot_bytes / 16;
  const size_t share_chunks = (end - begin + slot_words - 1) / slot_words;
  const size_t chunks = share_chunks * repeat;
  auto first_word = [&](size_t c) { return begin + (c % share_chunks) * slot_words; };
  auto ask_l2 = [&](size_t c) {
    if (prefetch == kNoPrefetch || c >= chunks) return;
    const size_t w0 = first_word(c);
    const unsigned bytes = static_cast<unsigned>(min(slot_words, end - w0) * 16);
    if (prefetch == kBulkL2) {
      if (threadIdx.x == 0) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src + w0), "r"(bytes)
                     : "memory");
      }
    } else {
      for (unsigned at = threadIdx.x * 128; at < bytes; at += blockDim.x * 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(src + w0) + at));
      }
    }
  };
  for (unsigned r = threadIdx.x; r < slot_words / 8; r += blockDim.x) {
    operand[r] = __float2bfloat16(1.f);
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) MbarrierInit(full + s, 1), MbarrierInit(empty + s, consumer_warps);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](size_t c) {
    const size_t w0 = first_word(c);
    const unsigned bytes = static_cast<unsigned>(min(slot_words, end - w0) * 16);
    BulkLoad(shared + (c % slots) * slot_bytes, src + w0, bytes, full + c % slots, 0);
  };
  if (kProducerWarp && threadIdx.x >= consumers) {
    if (!producer) return;
    for (size_t c = 0; c < chunks; ++c) {
      if (c >= size_t(slots)) {
        while (!MbarrierTryWait(empty + c % slots, (c / slots - 1) & 1)) {
        }
      }
      issue(c);
    }
    return;
  }
  if (kCopies && !kProducerWarp && producer) {
    for (size_t c = 0; c < min(chunks, size_t(slots)); ++c) issue(c);
  }
  for (int a = 0; a < ahead; ++a) ask_l2(slots + a);
  Consumer<W> work;
  for (size_t c = 0; c < chunks; ++c) {
    const int slot = c % slots;
    const long long w0 = clock64();
    while (kCopies && !MbarrierTryWait(full + slot, (c / slots) & 1)) {
    }
    waited += clock64() - w0;
    const uint4* w = reinterpret_cast<const uint4*>(shared + size_t(slot) * slot_bytes);
    const size_t n = min(slot_words, end - first_word(c));
    for (size_t v = threadIdx.x; v < n; v += consumers) work.Add(w[v], operand, v / 8);
    if (kProducerWarp) {
      __syncwarp();
      if (threadIdx.x % 32 == 0) {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SharedAddress(empty + slot))
                     : "memory");
      }
    } else {
      __syncthreads();
      if (kCopies && producer && c + slots < chunks) issue(c + slots);
      if (kCopies) ask_l2(c + slots + ahead);
    }
  }
  work.Finish(out, sum);
  if (threadIdx.x == 0) {
    atomicAdd(stats + 0, static_cast<unsigned long long>(clock64() - t0));
    atomicAdd(stats + 1, static_cast<unsigned long long>(waited));
    atomicAdd(stats + 2, static_cast<unsigned long long>(GlobalTimerNs() - ns0));
  }
}

// Plain loads into registers, U a thread in flight, and the GEMV of Work
// on them (64 columns: the operand row is the word's index / 8).
template <Work W, int U>
__global__ void __launch_bounds__(512)
    PlainStream(const uint4* src, size_t words, uint4* out, float* sum) {
  __shared__ __nv_bfloat16 operand[4096];
  for (int r = threadIdx.x; r < 4096; r += blockDim.x) operand[r] = __float2bfloat16(1.f);
  __syncthreads();
  size_t begin, end;
  Share(words, &begin, &end);
  Consumer<W> work;
  size_t i = begin + threadIdx.x;
  const size_t step = blockDim.x;
  for (; i + (U - 1) * step < end; i += U * step) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldcs(src + i + u * step);
#pragma unroll
    for (int u = 0; u < U; ++u) work.Add(v[u], operand, ((i + u * step) / 8) % 4096);
  }
  for (; i < end; i += step) work.Add(__ldcs(src + i), operand, (i / 8) % 4096);
  work.Finish(out, sum);
}

// One ring a warp: lane 0 issues the warp's copies, the warp waits on its
// own mbarriers and syncs only itself. The CTA's share is split by warp.
__global__ void __launch_bounds__(kThreads, 1)
    WarpRing(const uint4* src, size_t words, uint4* out, int slots, unsigned slot_bytes) {
  extern __shared__ __align__(128) unsigned char shared[];
  constexpr int kWarps = kThreads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned char* mine = shared + size_t(warp) * slots * slot_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(shared + size_t(kWarps) * slots * slot_bytes) +
                   warp * slots;
  size_t cta_begin, cta_end;
  Share(words, &cta_begin, &cta_end);
  const size_t per = (cta_end - cta_begin + kWarps - 1) / kWarps;
  const size_t begin = min(cta_end, cta_begin + warp * per), end = min(cta_end, begin + per);
  const size_t slot_words = slot_bytes / 16;
  const size_t chunks = (end - begin + slot_words - 1) / slot_words;
  if (lane == 0) {
    for (int s = 0; s < slots; ++s) MbarrierInit(bars + s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  auto issue = [&](size_t c) {
    if (lane != 0 || c >= chunks) return;
    const size_t w0 = begin + c * slot_words;
    const unsigned bytes = static_cast<unsigned>(min(slot_words, end - w0) * 16);
    BulkLoad(mine + (c % slots) * slot_bytes, src + w0, bytes, bars + c % slots, 0);
  };
  for (int s = 0; s < slots; ++s) issue(s);
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (size_t c = 0; c < chunks; ++c) {
    const int slot = c % slots;
    while (!MbarrierTryWait(bars + slot, (c / slots) & 1)) {
    }
    const uint4* w = reinterpret_cast<const uint4*>(mine + size_t(slot) * slot_bytes);
    const size_t n = min(slot_words, end - (begin + c * slot_words));
    for (size_t v = lane; v < n; v += 32) acc = Xor(acc, w[v]);
    __syncwarp();
    issue(c + slots);
  }
  StoreXor(acc, out);
}

struct Row {
  std::string name;
  int ctas, threads, slots;
  unsigned slot_bytes;
  double median_us, tbps;
  bool ok;                                 // the check passed (or nothing was checked)
  double wait_share = -1, clock_mhz = -1;  // ring variants: thread 0's
  bool checked = true;
};

int main() {
  const Device device = QueryDevice();
  const int sms = device.sms, max_shared = device.max_shared;
  const cudaDeviceProp& prop = device.prop;
  const size_t bytes = size_t(2) << 30;  // about the 1B model's weights
  const size_t words = bytes / 16;
  uint4* src = nullptr;
  uint4* out = nullptr;
  float* sum = nullptr;
  unsigned long long* stats = nullptr;
  CHECK_CUDA(cudaMalloc(&stats, 3 * sizeof(unsigned long long)));
  CHECK_CUDA(cudaMalloc(&src, bytes));
  CHECK_CUDA(cudaMalloc(&out, size_t(1) << 20));
  CHECK_CUDA(cudaMalloc(&sum, sizeof(float)));
  // Random bf16 integers in [-3, 3]: every partial sum is exact in float, so
  // the sums are checked exactly, and the xors see any word missed or read twice.
  const int64_t expected_sum = FillRandomBf16Integers(src, bytes);
  auto time = [&](const std::function<void()>& launch) {
    return MedianUs(launch, kWarmup, kPasses);
  };
  auto xor_of = [&](int ctas, int warps) {
    std::vector<uint4> host(size_t(ctas) * warps);
    CHECK_CUDA(cudaMemcpy(host.data(), out, host.size() * 16, cudaMemcpyDeviceToHost));
    uint4 acc{0, 0, 0, 0};
    for (auto& v : host) acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
    return acc;
  };
  auto same = [](uint4 x, uint4 y) { return x.x == y.x && x.y == y.y && x.z == y.z && x.w == y.w; };

  std::vector<Row> rows;
  uint4 reference{};
  auto plain = [&](auto kernel, const char* name, int ctas) {
    const double us = time([&] { kernel<<<ctas, kThreads>>>(src, words, out); });
    const uint4 got = xor_of(ctas, kThreads / 32);
    if (rows.empty()) reference = got;
    rows.push_back({name, ctas, kThreads, 0, 0, us, bytes / us / 1e6, same(got, reference)});
  };
  plain(PlainLoads<8>, "plain_loads_u8", sms * 8);
  plain(PlainLoads<8>, "plain_loads_u8", sms);
  plain(PlainLoads<8>, "plain_loads_u8", sms * 2);

  // ring(work, producer warp, CTAs an SM, consumer threads, slot bytes): as
  // many slots as a CTA's share of shared memory holds.
  auto ring = [&](auto kernel, const char* name, Work work, bool producer_warp, int per_sm,
                  int consumers, unsigned slot_bytes, int prefetch = kNoPrefetch, int ahead = 0,
                  int repeat = 1) {
    const size_t share = (static_cast<size_t>(max_shared) + 1024) / per_sm - 1024 - 2048;
    const size_t operand_bytes = slot_bytes / 64 + 16;  // a bf16 a row of 64 columns
    const int slots =
        static_cast<int>(std::min<size_t>((share - operand_bytes) / (slot_bytes + 16), 32));
    const size_t smem = size_t(slots) * (slot_bytes + 16) + operand_bytes;
    const int threads = consumers + (producer_warp ? 32 : 0), ctas = sms * per_sm;
    CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
    CHECK_CUDA(cudaMemset(out, 0, size_t(1) << 20));  // the producer warp writes none
    const double us = time([&] {
      CHECK_CUDA(cudaMemsetAsync(sum, 0, sizeof(float)));
      CHECK_CUDA(cudaMemsetAsync(stats, 0, 3 * sizeof(unsigned long long)));
      kernel<<<ctas, threads, smem>>>(src, words / repeat, out, slots, slot_bytes, sum, stats,
                                      prefetch, ahead, repeat);
    });
    unsigned long long st[3];
    CHECK_CUDA(cudaMemcpy(st, stats, sizeof(st), cudaMemcpyDeviceToHost));
    bool ok = true;
    const bool checked = std::string(name).rfind("consume_only", 0) != 0 && repeat == 1;
    if (!checked) {
    } else if (work == Work::kXor) {
      ok = same(xor_of(ctas, threads / 32), reference);
    } else {
      float got = 0.f;
      CHECK_CUDA(cudaMemcpy(&got, sum, 4, cudaMemcpyDeviceToHost));
      ok = static_cast<double>(got) == static_cast<double>(expected_sum);
    }
    rows.push_back({name, ctas, threads, slots, slot_bytes, us, bytes / us / 1e6, ok,
                    double(st[1]) / double(st[0]), double(st[0]) / double(st[2]) * 1e3, checked});
  };
  auto plain_work = [&](auto kernel, const char* name, int per_sm, int threads) {
    const int ctas = sms * per_sm;
    const double us = time([&] {
      CHECK_CUDA(cudaMemsetAsync(sum, 0, sizeof(float)));
      kernel<<<ctas, threads>>>(src, words, out, sum);
    });
    float got = 0.f;
    CHECK_CUDA(cudaMemcpy(&got, sum, 4, cudaMemcpyDeviceToHost));
    rows.push_back({name, ctas, threads, 0, 0, us, bytes / us / 1e6,
                    static_cast<double>(got) == static_cast<double>(expected_sum)});
  };
  plain_work(PlainStream<Work::kGemv, 8>, "plain_gemv_u8", 1, 256);
  plain_work(PlainStream<Work::kGemv, 8>, "plain_gemv_u8", 1, 512);
  plain_work(PlainStream<Work::kGemv, 8>, "plain_gemv_u8", 2, 512);
  plain_work(PlainStream<Work::kGemv, 8>, "plain_gemv_u8", 4, 256);
  auto cta_xor = RingStream<Work::kXor, false>;
  auto cta_gemv = RingStream<Work::kGemv, false>;
  auto producer_gemv = RingStream<Work::kGemv, true>;
  auto consume_xor = RingStream<Work::kXor, false, false>;
  auto consume_gemv = RingStream<Work::kGemv, false, false>;
  ring(cta_xor, "cta_ring_xor", Work::kXor, false, 1, 256, 16384);
  ring(cta_xor, "cta_ring_xor", Work::kXor, false, 1, 256, 32768);
  ring(cta_gemv, "cta_ring_gemv", Work::kGemv, false, 1, 256, 16384);
  ring(cta_gemv, "cta_ring_gemv", Work::kGemv, false, 1, 256, 32768);
  ring(cta_gemv, "cta_ring_gemv", Work::kGemv, false, 2, 256, 16384);
  ring(producer_gemv, "producer_warp_gemv", Work::kGemv, true, 1, 256, 32768);
  ring(producer_gemv, "producer_warp_gemv", Work::kGemv, true, 2, 256, 16384);
  // The consumers alone: the same slots read again, never refilled (their
  // sums are not checked).
  ring(consume_xor, "consume_only_xor", Work::kXor, false, 1, 256, 16384);
  ring(consume_gemv, "consume_only_gemv", Work::kGemv, false, 1, 256, 16384);
  ring(consume_gemv, "consume_only_gemv", Work::kGemv, false, 1, 256, 32768);
  // More bytes in flight than the slots: chunks asked into L2 ahead of the ring.
  for (int ahead : {2, 4, 8}) {
    ring(cta_xor, "cta_ring_xor_line_l2", Work::kXor, false, 1, 256, 32768, kLineL2, ahead);
  }
  ring(cta_xor, "cta_ring_xor_bulk_l2", Work::kXor, false, 1, 256, 32768, kBulkL2, 4);
  ring(cta_gemv, "cta_ring_gemv_line_l2", Work::kGemv, false, 1, 256, 32768, kLineL2, 4);
  ring(cta_xor, "cta_ring_xor_line_l2", Work::kXor, false, 1, 256, 16384, kLineL2, 8);
  // What L2 gives a ring: 32 MiB read 64 times (unchecked).
  ring(cta_xor, "l2_resident_ring_xor", Work::kXor, false, 1, 256, 32768, kNoPrefetch, 0, 64);

  const size_t budget = static_cast<size_t>(max_shared) - 1024;
  for (unsigned slot_bytes : {8192u, 16384u}) {
    const int slots = static_cast<int>(std::min<size_t>(budget / (8 * slot_bytes), 8));
    const size_t smem = size_t(8) * slots * slot_bytes + 8 * slots * 8;
    CHECK_CUDA(cudaFuncSetAttribute(WarpRing, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
    const double us =
        time([&] { WarpRing<<<sms, kThreads, smem>>>(src, words, out, slots, slot_bytes); });
    rows.push_back({"warp_ring_xor", sms, kThreads, slots, slot_bytes, us, bytes / us / 1e6,
                    same(xor_of(sms, kThreads / 32), reference)});
  }

  const char* commit = std::getenv("JFO_COMMIT");
  const std::string date = UtcNow();
  std::printf("{\"meta\": {\"device_kind\": \"%s\", \"sms\": %d, \"bytes\": %zu, "
              "\"warmup\": %d, \"passes\": %d, \"commit\": \"%s\", \"date\": \"%s\", "
              "\"protocol\": \"scripts/hbm_stream_probe.cu (header comment)\"},\n\"rows\": [\n",
              prop.name, sms, bytes, kWarmup, kPasses, commit ? commit : "unknown",
              date.c_str());
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf("  {\"variant\": \"%s\", \"ctas\": %d, \"threads\": %d, \"slots\": %d, "
                "\"slot_bytes\": %u, \"median_us\": %.1f, \"tb_per_s\": %.3f, \"checked\": %s, \"ok\": %s, "
                "\"wait_share\": %.3f, \"clock_mhz\": %.0f}%s\n",
                r.name.c_str(), r.ctas, r.threads, r.slots, r.slot_bytes, r.median_us, r.tbps,
                r.checked ? "true" : "false", r.ok ? "true" : "false", r.wait_share, r.clock_mhz,
                i + 1 < rows.size() ? "," : "");
  }
  std::printf("]}\n");
  for (const Row& r : rows) {
    std::fprintf(stderr, "%-18s ctas %4d thr %4d slots %2d x %6u %7.1f us %.3f TB/s wait %.2f "
                 "clk %4.0f %s\n", r.name.c_str(), r.ctas, r.threads, r.slots, r.slot_bytes,
                 r.median_us, r.tbps, r.wait_share, r.clock_mhz,
                 !r.checked ? "unchecked" : r.ok ? "" : "MISMATCH");
  }
  for (const Row& r : rows) {
    if (!r.ok) return 1;
  }
  return 0;
}
