// What one chunk of the decode kernel's GEMV costs an SM, and what the
// weight stream costs the kernel's other work.
//
// The ring: the kernel's (one CTA of 256 threads an SM, TMA bulk copies
// into 32 KiB slots, a CTA-wide sync a chunk, thread 0 refilling),
// streaming 2 GiB, each chunk's GEMV by the kernel's mma.sync loop
// (ffi/src/transformer_decode/stages.cuh, 64 columns, batch 1) or by
// Hopper's wgmma (m64n8k16, both operands read from shared memory, each
// warpgroup half of a chunk's k-steps). Rows by policy: the copies with no
// L2 policy (the first run's ring), evict-first made for each copy (the
// kernel's), evict-first made once a CTA. Rows by in_flight: thread 0
// tracking landed copies and keeping at most that many in flight (the
// slots still buffer 6 chunks; in_flight = slots tracks with no cap);
// 0 is the kernel's (no tracking); "relaxed" rows track with a relaxed
// test_wait in place of the acquiring one. "consume_only" rows re-read
// slots never refilled: what the instructions alone allow.
//
// The round trips, alone and beside each ring (one thread, or two, on
// another CUDA stream, next to the ring's CTAs): a chain of dependent
// ld.relaxed.gpu loads that hit L2 (as the kernel's polls), and a handoff
// ping-pong (a plain store one CTA makes, polled by another, and back, as
// the kernel's handoffs): whether the kernel's load-bound steps pay for its
// weight stream in latency, and in loads or in stores. Each row says the
// SMs it ran on.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Iffi/src \
//     -o /tmp/chunk_gemv_probe scripts/chunk_gemv_probe.cu
//   JFO_COMMIT=$(git rev-parse --short HEAD) /tmp/chunk_gemv_probe > chunk_gemv_probe.json
//
// Each ring row: 3 warm-up passes, then 15 passes timed one by one with
// CUDA events; the median pass. The weights are random bf16 integers in
// [-3, 3] and the operand is ones, so every column sum is exact and their
// total (batch row 0's outputs, summed over the grid) is checked against
// the host's sum of all weights: a systematic miss or re-read (a layout
// wrong, a slot read stale) fails it. "consume_only" rows are unchecked.
// A round trip's row: the median of its segments of 32 trips (those inside
// the ring's run). Exits 1 on a failed check.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "probe_support.cuh"
#include "transformer_decode/stages.cuh"
#include "transformer_decode/sync.cuh"

using jfo::transformer_decode::BulkLoad;
using jfo::transformer_decode::EvictFirstPolicy;
using jfo::transformer_decode::LoadWords;
using jfo::transformer_decode::MbarrierInit;
using jfo::transformer_decode::MbarrierTryWait;
using jfo::transformer_decode::MmaBf16;
using jfo::transformer_decode::SharedAddress;

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr unsigned kSlotBytes = 32768;
constexpr int kColumns = 64;                           // gate/up's item width
constexpr int kKSteps = kSlotBytes / (kColumns * 32);  // 16 k-steps, each 16 k x 64 columns
constexpr int kOperandBytes = kKSteps * 256;           // B: 16 k x 8 rows a k-step
constexpr int kWarmup = 3, kPasses = 15;

enum class Gemv { kMmaSync, kWgmma };

// A wgmma shared-memory descriptor, no swizzle: core matrices of 8 rows by
// 16 bytes, `lead` bytes apart along k and `stride` bytes apart along m/n.
__device__ __forceinline__ uint64_t Descriptor(const void* p, unsigned lead, unsigned stride) {
  return static_cast<uint64_t>((SharedAddress(p) & 0x3FFFF) >> 4) |
         static_cast<uint64_t>(lead >> 4) << 16 | static_cast<uint64_t>(stride >> 4) << 32;
}

// d += a b: a the 64 x 16 weights, b the 16 x 8 operand (k-major both).
__device__ __forceinline__ void Wgmma(float (&d)[4], uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, "
      "0, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(a), "l"(b));
#endif
}

__device__ __forceinline__ void WgmmaFence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void WgmmaCommitAndWait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#endif
}

// Whether the copy into `bar`'s slot landed, without waiting. Acquire (the
// default) orders this thread's later reads after the copy's writes; thread
// 0's tracking reads nothing of the slot, so relaxed is enough for it.
__device__ __forceinline__ bool MbarrierTestWait(uint64_t* bar, unsigned parity, bool relaxed) {
  unsigned done = 0;
  if (relaxed) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.relaxed.cta.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(SharedAddress(bar)), "r"(parity)
        : "memory");
  } else {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(SharedAddress(bar)), "r"(parity)
        : "memory");
  }
  return done != 0;
}

// The copies' L2 policy: none, evict-first made for every copy (as the
// kernel's IssueNext), or evict-first made once a CTA.
enum Policy { kNoPolicy = 0, kEvictFirstEachCopy = 1, kEvictFirstOnce = 2 };

// in_flight: the most copies thread 0 keeps in flight, tracking which
// landed (0: no tracking, as many as there are free slots, as the kernel):
// the slots still buffer `slots` chunks, but fewer bytes wait in the memory
// system's queues at any time. in_flight = slots tracks without a cap.
// relaxed: the tracking's test_wait without acquire (what the tracking
// costs thread 0 with and without the fence).
template <Gemv G, bool kRefill>
__global__ void __launch_bounds__(kThreads, 1)
    RingGemv(const unsigned char* src, size_t chunks, int slots, float* total,
             unsigned long long* stats, int in_flight = 0,
             int policy = kEvictFirstEachCopy, bool relaxed = false) {
  extern __shared__ __align__(1024) unsigned char shared[];
  auto* operand = reinterpret_cast<__nv_bfloat16*>(shared + size_t(slots) * kSlotBytes);
  auto* bars = reinterpret_cast<uint64_t*>(reinterpret_cast<unsigned char*>(operand) +
                                           kOperandBytes);
  const long long t0 = clock64();
  if (threadIdx.x == 0 && blockIdx.x == 0) stats[3] = jfo::GlobalTimerNs();
  long long waited = 0;
  size_t begin, end;
  Share(chunks, &begin, &end);
  const size_t mine = end - begin;
  // Ones: batch row 0's output of a column is its sum. The mma.sync loop
  // reads row 0 only ([k] bf16); wgmma reads core matrices [k-step][k half][8 rows][8].
  for (int i = threadIdx.x; i < kOperandBytes / 2; i += kThreads) operand[i] = 1.f;
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) MbarrierInit(bars + s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the operand, for wgmma
  __syncthreads();
  const uint64_t policy_once = policy == kEvictFirstOnce ? EvictFirstPolicy() : 0;
  auto issue = [&](size_t c) {
    BulkLoad(shared + (c % slots) * kSlotBytes, src + (begin + c) * kSlotBytes, kSlotBytes,
             bars + c % slots, policy == kEvictFirstEachCopy ? EvictFirstPolicy() : policy_once);
  };
  size_t issued = 0, landed = 0;  // thread 0's
  const size_t cap = in_flight > 0 ? in_flight : slots;
  // Thread 0, having consumed `consumed` chunks: the landed ones counted
  // (with a cap only: without, a free slot is all a copy needs, as in the
  // kernel), then copies issued while a slot is free and fewer than `cap` fly.
  auto top_up = [&](size_t consumed) {
    landed = max(landed, consumed);
    while (in_flight > 0 && landed < issued &&
           MbarrierTestWait(bars + landed % slots, (landed / slots) & 1, relaxed)) {
      ++landed;
    }
    while (issued < mine && issued < consumed + slots && issued - landed < cap) issue(issued++);
  };
  if (threadIdx.x == 0) top_up(0);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = warp / 4;
  float acc[4][4] = {};  // mma.sync: 4 column tiles; wgmma: acc[0]
  for (size_t c = 0; c < mine; ++c) {
    const int slot = c % slots;
    const long long w0 = clock64();
    if (kRefill || c < size_t(slots)) {
      const uint64_t since = jfo::GlobalTimerNs();
      while (!MbarrierTryWait(bars + slot, (c / slots) & 1)) {
        if (kRefill && threadIdx.x == 0) top_up(c);
        if (jfo::GlobalTimerNs() - since > 1000000000ull) __trap();  // a copy lost: fail, not hang
      }
    }
    __syncwarp();  // the lanes leave the wait apart; the MMAs below are .aligned
    waited += clock64() - w0;
    const unsigned char* w = shared + size_t(slot) * kSlotBytes;
    if constexpr (G == Gemv::kMmaSync) {
      const uint4* tiles = reinterpret_cast<const uint4*>(w);
      const int g = lane / 4, t = lane % 4;
      for (int kt = warp; kt < kKSteps; kt += kWarps) {
        unsigned b0 = 0, b1 = 0;
        if (g == 0) {
          b0 = *reinterpret_cast<const unsigned*>(operand + kt * 16 + 2 * t);
          b1 = *reinterpret_cast<const unsigned*>(operand + kt * 16 + 2 * t + 8);
        }
#pragma unroll
        for (int ct = 0; ct < 4; ++ct) MmaBf16(acc[ct], tiles[(kt * 4 + ct) * 32 + lane], b0, b1);
      }
    } else {
      // A k-step's A (64 columns as m, 16 k): 8 groups of 8 columns, 256
      // bytes apart, each two core matrices along k, 128 bytes apart. B:
      // two core matrices along k.
      WgmmaFence();
#pragma unroll
      for (int i = 0; i < kKSteps / 2; ++i) {
        const int s = group * (kKSteps / 2) + i;
        Wgmma(acc[0], Descriptor(w + s * 2048, 128, 256),
              Descriptor(reinterpret_cast<unsigned char*>(operand) + s * 256, 128, 256));
      }
      WgmmaCommitAndWait();
    }
    __syncthreads();
    if (kRefill && threadIdx.x == 0) top_up(c + 1);
  }
  // Batch row 0: mma.sync's lanes with t == 0 hold it in c[0] and c[2];
  // wgmma's (lane % 4 == 0) in d[0] and d[2].
  float sum = 0.f;
  if (lane % 4 == 0) {
    if constexpr (G == Gemv::kMmaSync) {
      for (int ct = 0; ct < 4; ++ct) sum += acc[ct][0] + acc[ct][2];
    } else {
      sum = acc[0][0] + acc[0][2];
    }
  }
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(~0u, sum, o);
  if (lane == 0) atomicAdd(total, sum);
  if (threadIdx.x == 0) {
    atomicAdd(stats + 0, static_cast<unsigned long long>(clock64() - t0));
    atomicAdd(stats + 1, static_cast<unsigned long long>(waited));
    atomicAdd(stats + 2, static_cast<unsigned long long>(mine));
    atomicMax(stats + 4, static_cast<unsigned long long>(jfo::GlobalTimerNs()));
  }
}

// One thread: kSegments segments of kLoadsPerSegment dependent loads through
// `next` (each the index of the next word, lines apart: L2 hits after the
// first pass), each segment's start (ns) and length (ns) into `segments`.
constexpr int kSegments = 64, kLoadsPerSegment = 32;

__device__ __forceinline__ unsigned SmId() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// sink[0]: the chain's end (kept live); sink[1]: the SM it ran on.
__global__ void L2Chase(const unsigned* next, unsigned long long* segments, unsigned* sink) {
  unsigned at[1] = {0};  // the kernel's polls' load (handoff.cuh)
  for (int i = 0; i < kLoadsPerSegment; ++i) LoadWords(next + at[0], at);  // into L2
  for (int s = 0; s < kSegments; ++s) {
    const unsigned long long start = jfo::GlobalTimerNs();
    for (int i = 0; i < kLoadsPerSegment; ++i) LoadWords(next + at[0], at);
    segments[2 * s] = start;
    segments[2 * s + 1] = jfo::GlobalTimerNs() - start;
  }
  sink[0] = at[0];
  sink[1] = SmId();
}

// Two CTAs of one thread hand a count back and forth through global memory
// as the decode kernel hands values over: a plain store, the other CTA
// polling it with relaxed loads. CTA 0 records kSegments segments of
// kLoadsPerSegment round trips (start ns, length ns); sms[b]: CTA b's SM.
// A wait past 100 ms marks the segment 0 long and ends both (the other
// CTA not running).
__global__ void HandoffPingPong(unsigned* words, unsigned long long* segments, unsigned* sms) {
  sms[blockIdx.x] = SmId();
  unsigned* mine = words + blockIdx.x * 64;  // 256 bytes apart: lines of their own
  const unsigned* theirs = words + (1 - blockIdx.x) * 64;
  auto wait_for = [&](unsigned value) {
    const unsigned long long start = jfo::GlobalTimerNs();
    unsigned seen[1];
    do {
      LoadWords(theirs, seen);
      if (jfo::GlobalTimerNs() - start > 100000000ull) return false;
    } while (seen[0] != value);
    return true;
  };
  auto hand = [&](unsigned value) {
    asm volatile("st.global.u32 [%0], %1;" ::"l"(mine), "r"(value) : "memory");
  };
  unsigned value = 0;
  for (int s = 0; s < kSegments; ++s) {
    const unsigned long long start = jfo::GlobalTimerNs();
    bool ok = true;
    for (int i = 0; i < kLoadsPerSegment && ok; ++i) {
      ++value;
      if (blockIdx.x == 0) {
        hand(value);
        ok = wait_for(value);
      } else {
        ok = wait_for(value);
        hand(value);
      }
    }
    if (blockIdx.x == 0) {
      segments[2 * s] = start;
      segments[2 * s + 1] = ok ? jfo::GlobalTimerNs() - start : 0;
    }
    if (!ok) return;
  }
}

const char* PolicyName(int policy) {
  return policy == kNoPolicy ? "none" : policy == kEvictFirstEachCopy ? "evict_first_each_copy"
                                                                      : "evict_first_once";
}

struct Row {
  std::string name;
  int slots, in_flight, policy;
  bool relaxed;
  double median_us, tbps, wait_share, cycles_per_chunk;
  bool checked, ok;
};

// A round trip's row: in_flight -1 alone, else beside the ring with that
// in_flight and policy.
struct Chase {
  int in_flight, policy;
  bool handoff, relaxed;
  int segments;
  double ns;
  unsigned sm[2];  // the chase's SM, or the ping-pong's two
};

int main() {
  const Device device = QueryDevice();
  const int sms = device.sms, max_shared = device.max_shared;
  const cudaDeviceProp& prop = device.prop;
  const size_t bytes = size_t(2) << 30, chunks = bytes / kSlotBytes;
  const int slots = static_cast<int>((max_shared - kOperandBytes - 1024) / (kSlotBytes + 8));
  const size_t smem = size_t(slots) * kSlotBytes + kOperandBytes + 8 * slots;
  unsigned char* src = nullptr;
  float* total = nullptr;
  unsigned long long* stats = nullptr;
  CHECK_CUDA(cudaMalloc(&src, bytes));
  CHECK_CUDA(cudaMalloc(&total, sizeof(float)));
  CHECK_CUDA(cudaMalloc(&stats, 5 * sizeof(unsigned long long)));
  const int64_t expected = FillRandomBf16Integers(src, bytes);
  std::vector<Row> rows;
  auto run = [&](auto kernel, const char* name, bool checked, int in_flight, int policy,
                 bool relaxed = false) {
    CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
    auto launch = [&] {
      CHECK_CUDA(cudaMemsetAsync(total, 0, sizeof(float)));
      CHECK_CUDA(cudaMemsetAsync(stats, 0, 5 * sizeof(unsigned long long)));
      kernel<<<sms, kThreads, smem>>>(src, chunks, slots, total, stats, in_flight, policy,
                                      relaxed);
    };
    const double us = MedianUs(launch, kWarmup, kPasses);
    unsigned long long st[5];
    float got = 0.f;
    CHECK_CUDA(cudaMemcpy(st, stats, sizeof(st), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(&got, total, sizeof(float), cudaMemcpyDeviceToHost));
    const bool ok = !checked || static_cast<double>(got) == static_cast<double>(expected);
    rows.push_back({name, slots, in_flight, policy, relaxed, us, bytes / us / 1e6,
                    double(st[1]) / double(st[0]), double(st[0] - st[1]) / double(st[2]),
                    checked, ok});
  };
  // The first run's ring (no policy, no tracking), the kernel's (evict-first
  // made each copy), the policy made once; tracking alone (in_flight =
  // slots: no cap binds), then caps; each with and without the policy.
  for (int policy : {kNoPolicy, kEvictFirstEachCopy, kEvictFirstOnce}) {
    run(RingGemv<Gemv::kMmaSync, true>, "ring_mma_sync", true, 0, policy);
  }
  run(RingGemv<Gemv::kWgmma, true>, "ring_wgmma", true, 0, kNoPolicy);
  for (int policy : {kNoPolicy, kEvictFirstEachCopy}) {
    for (int in_flight : {slots, 2, 3, 4}) {
      run(RingGemv<Gemv::kMmaSync, true>, "ring_mma_sync", true, in_flight, policy);
    }
  }
  for (int in_flight : {slots, 2, 3}) {
    run(RingGemv<Gemv::kMmaSync, true>, "ring_mma_sync", true, in_flight, kEvictFirstEachCopy,
        /*relaxed=*/true);
  }
  run(RingGemv<Gemv::kMmaSync, false>, "consume_only_mma_sync", false, 0, kNoPolicy);
  run(RingGemv<Gemv::kWgmma, false>, "consume_only_wgmma", false, 0, kNoPolicy);

  // The round trips: an L2 chain over 32 words 4 KiB apart (L2-resident
  // after its first pass), and the ping-pong; alone, then each started just
  // after the ring's kernel on another stream, counting only the segments
  // inside the ring's run.
  unsigned* next = nullptr;
  unsigned* sink = nullptr;
  unsigned* words = nullptr;
  unsigned long long* segments = nullptr;
  CHECK_CUDA(cudaMalloc(&next, 32 * 4096));
  CHECK_CUDA(cudaMalloc(&sink, 2 * sizeof(unsigned)));
  CHECK_CUDA(cudaMalloc(&words, 2 * 64 * sizeof(unsigned)));
  CHECK_CUDA(cudaMalloc(&segments, 2 * kSegments * sizeof(unsigned long long)));
  {
    std::vector<unsigned> host(32 * 1024, 0);
    for (int i = 0; i < 32; ++i) host[i * 1024] = ((i + 1) % 32) * 1024;
    CHECK_CUDA(cudaMemcpy(next, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  }
  cudaStream_t side;
  CHECK_CUDA(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  auto round_trip = [&](Chase* c) {
    const bool under_stream = c->in_flight >= 0;
    CHECK_CUDA(cudaMemset(stats, 0, 5 * sizeof(unsigned long long)));
    CHECK_CUDA(cudaMemset(sink, 0xFF, 2 * sizeof(unsigned)));
    if (under_stream) {
      RingGemv<Gemv::kMmaSync, true>
          <<<sms, kThreads, smem>>>(src, chunks, slots, total, stats, c->in_flight, c->policy,
                                    c->relaxed);
      CHECK_CUDA(cudaGetLastError());
    }
    if (c->handoff) {
      CHECK_CUDA(cudaMemsetAsync(words, 0, 2 * 64 * sizeof(unsigned), side));
      HandoffPingPong<<<2, 1, 0, side>>>(words, segments, sink);
    } else {
      L2Chase<<<1, 1, 0, side>>>(next, segments, sink);
    }
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<unsigned long long> seg(2 * kSegments);
    unsigned long long st[5];
    unsigned ids[2];
    CHECK_CUDA(cudaMemcpy(seg.data(), segments, seg.size() * 8, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(st, stats, sizeof(st), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(ids, sink, sizeof(ids), cudaMemcpyDeviceToHost));
    c->sm[0] = c->handoff ? ids[0] : ids[1];  // the chase's sink[0] is its chain's end
    c->sm[1] = ids[1];
    std::vector<double> per_trip;
    for (int s = 0; s < kSegments; ++s) {
      const bool inside = seg[2 * s] >= st[3] && seg[2 * s] + seg[2 * s + 1] <= st[4];
      if (seg[2 * s + 1] == 0) break;  // the ping-pong's partner never answered
      if (!under_stream || inside) per_trip.push_back(double(seg[2 * s + 1]) / kLoadsPerSegment);
    }
    c->segments = static_cast<int>(per_trip.size());
    std::sort(per_trip.begin(), per_trip.end());
    c->ns = per_trip.empty() ? -1.0 : per_trip[per_trip.size() / 2];
  };
  std::vector<Chase> chases;
  for (bool handoff : {false, true}) {
    chases.push_back({-1, kNoPolicy, handoff, false});
    for (int policy : {kEvictFirstEachCopy, kNoPolicy}) {
      for (int in_flight : {0, 2, 3}) chases.push_back({in_flight, policy, handoff, false});
    }
    for (int in_flight : {2, 3}) chases.push_back({in_flight, kEvictFirstEachCopy, handoff, true});
  }
  for (Chase& c : chases) round_trip(&c);

  const char* commit = std::getenv("JFO_COMMIT");
  const std::string date = UtcNow();
  std::printf("{\"meta\": {\"device_kind\": \"%s\", \"sms\": %d, \"bytes\": %zu, "
              "\"slot_bytes\": %u, \"warmup\": %d, \"passes\": %d, \"commit\": \"%s\", "
              "\"date\": \"%s\", \"protocol\": \"scripts/chunk_gemv_probe.cu (header comment)\"},"
              "\n\"rows\": [\n",
              prop.name, sms, bytes, kSlotBytes, kWarmup, kPasses, commit ? commit : "unknown",
              date.c_str());
  for (const Row& r : rows) {
    std::printf("  {\"variant\": \"%s\", \"slots\": %d, \"in_flight\": %d, \"policy\": \"%s\", "
                "\"relaxed_tracking\": %s, "
                "\"median_us\": %.1f, \"tb_per_s\": %.3f, \"wait_share\": %.3f, "
                "\"cycles_a_chunk_not_waiting\": %.0f, \"checked\": %s, \"ok\": %s},\n",
                r.name.c_str(), r.slots, r.in_flight, PolicyName(r.policy),
                r.relaxed ? "true" : "false", r.median_us, r.tbps,
                r.wait_share, r.cycles_per_chunk, r.checked ? "true" : "false",
                r.ok ? "true" : "false");
  }
  for (size_t i = 0; i < chases.size(); ++i) {
    const Chase& c = chases[i];
    std::printf("  {\"variant\": \"%s\", \"in_flight\": %d, \"policy\": \"%s\", "
                "\"relaxed_tracking\": %s, "
                "\"median_ns\": %.0f, \"segments\": %d, \"trips_a_segment\": %d, "
                "\"sm\": [%u, %u]}%s\n",
                c.handoff ? "handoff_round_trip" : "l2_round_trip", c.in_flight,
                c.in_flight < 0 ? "alone" : PolicyName(c.policy), c.relaxed ? "true" : "false",
                c.ns, c.segments,
                kLoadsPerSegment, c.sm[0], c.sm[1], i + 1 < chases.size() ? "," : "");
  }
  std::printf("]}\n");
  for (const Row& r : rows) {
    std::fprintf(stderr, "%-22s in flight %d%s policy %-21s %7.1f us %.3f TB/s wait %.2f %5.0f "
                 "cycles/chunk %s\n", r.name.c_str(), r.in_flight, r.relaxed ? " relaxed" : "",
                 PolicyName(r.policy),
                 r.median_us, r.tbps, r.wait_share, r.cycles_per_chunk,
                 !r.checked ? "unchecked" : r.ok ? "" : "MISMATCH");
  }
  for (const Chase& c : chases) {
    std::fprintf(stderr, "%-7s round trip, %s in flight %d%s, policy %s: %.0f ns (%d segments, "
                 "SM %u/%u)\n", c.handoff ? "handoff" : "L2 load",
                 c.in_flight < 0 ? "alone," : "beside the ring,", c.in_flight,
                 c.relaxed ? " relaxed" : "",
                 PolicyName(c.policy), c.ns, c.segments, c.sm[0], c.sm[1]);
  }
  for (const Row& r : rows) {
    if (!r.ok) return 1;
  }
  return 0;
}
