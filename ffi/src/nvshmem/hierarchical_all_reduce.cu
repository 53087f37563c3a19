// NVRAR: hierarchical all-reduce over every NVSHMEM PE (one process per GPU),
// in ONE kernel, no host state per call (command-buffer compatible).
// Tested with 2 and 4 PEs sharing one GPU; not yet run across GPUs.
//
// PEs form nodes of `node_size` consecutive PEs (G); the node count N must be
// a power of two. PE = node * G + l. Like ../all_reduce.cu, element range
// [0, E) is cut into `blocks` chunks (a function of E, dtype and G only, so
// every PE runs the same grid), block b handles chunk b, and a chunk is cut
// into G slices; PE l of a node owns slice l.
//
//   1. intra-node reduce-scatter: store slice q of our chunk into local peer
//      q's RS receive unit (nvshmem_ptr: NVLink loads/stores), signal, wait;
//      sum slice l over local ranks 0..G-1 in fp32, round once.
//   2. inter-node recursive doubling on slice l: for k < log2 N, partner =
//      PE of node (node ^ 2^k) with the same l; put-with-signal
//      (nvshmemx_putmem_signal_nbi_block) our partial from the step-k send
//      unit into the partner's step-k receive unit, signal value = call
//      sequence number; bounded wait on our step-k signal; sum lower node's
//      partial + upper node's partial (the same operation on both sides, so
//      both get the same bits), round, into the step-(k+1) send unit, or, at
//      the last step, into y and into the local peers' AG receive units.
//   3. intra-node all-gather: signal, wait, copy the peers' slices into y.
//
// Every rank ends with identical bits: each slice is computed by the owner
// PEs with the same operations on the same values, then copied.
//
// Flow control: block b keeps a call counter seq[b] in device memory; a call
// raises it to s, uses units of parity s & 1 and sets signal words to s
// (waits compare >= s, so a word already at s + 1 also satisfies call s).
// Why nobody overwrites a unit (or a put's source) still in use: a unit of
// parity p is written at call s and next at call s + 2. An all-reduce is a
// barrier: our call s + 1 finishes only after waits that depend, directly or
// through intermediate PEs, on every PE having started its call s + 1, and a
// PE starts call s + 1 only after its call-s kernel (all its reads of
// parity-p units, and its waits for our call-s signals, which arrive after
// our put data) ended, in stream order. This holds whatever node_size each
// call uses. Every kernel also ends with nvshmem_quiet. It needs every PE to
// run the same all-reduces in the same order, one at a time per GPU (XLA's
// stream order does that).
//
// Calls are matched by more than counters: a signal word holds the call's
// fingerprint (CallFingerprint: size and dtype) over its sequence number, and
// a wait that finds its call's number with another fingerprint fails. A word
// one call ahead passes: that PE finished this call, so its own waits found
// this PE's fingerprint equal to its own.
//
// Every wait is bounded by %globaltimer; a timeout, a peer found two calls
// ahead, or one in another call, records which PE (pending_error()), fills
// the block's output chunk with NaN and returns. It also sets the process's
// failed word (NvState::failed): every later kernel writes NaN and sends
// nothing, so that no partner still in the failed call is satisfied by this
// PE's next one, also in CUDA graph replays.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <string>

#include "common.h"
#include "nvshmem/state.h"
#include "transport/reduce.cuh"
#include "transport/fingerprint.h"
#include "transport/signal.cuh"

namespace jfo {
namespace nv {
namespace {

constexpr int kThreads = 512;
constexpr size_t kMinBlockBytes = 16u << 10;  // to be measured
constexpr int kRsRecv = 0;
constexpr int kAgRecv = 1;

struct Args {
  const void* x;
  void* y;
  size_t elements;  // E
  size_t chunk;     // elements per block; a multiple of 16 bytes
  size_t slice;     // elements per local rank within a chunk, likewise
  int G, l, node, steps;  // steps: log2 N used by this call
  int steps_alloc;        // log2 npes: units were laid out for this many
  int pe, timeout_ms;
  uint64_t timeout_ns;
  char* data;                       // our symmetric data region
  char* peer_data[kNvMaxNode];      // local peer q's region (ours for q == l)
  uint64_t* sig;                    // our signal words
  uint64_t* peer_sig[kNvMaxNode];   // local peer q's signal words
  uint64_t* seq;                    // kNvMaxBlocks call counters (device)
  size_t stripe;
  int units;
  NvTimeoutRecord* record;
  uint32_t* record_lock;
  // NvState::lifetime: [0] the running generation, [1] the failed word.
  const uint32_t* lifetime;
  uint32_t* failed;
  uint32_t generation;   // this call's
  uint32_t fingerprint;  // CallFingerprint of this call
};

// The value of the signal words of call s.
__device__ __forceinline__ uint64_t SignalWord(const Args& a, uint64_t s) {
  return (static_cast<uint64_t>(a.fingerprint) << 32) | static_cast<uint32_t>(s);
}

// The clock, the 64-bit signal accesses and the fixed-order sums are the
// single-process all-reduce's (../transport/signal.cuh, reduce.cuh).
using reduce::ReduceRange;
using signal::GlobalTimerNs;
using signal::LoadAcquire;
using signal::Reached;
using signal::StoreRelease;

__device__ void RecordTimeout(const Args& a, int phase, int step, int peer_pe,
                              uint64_t expected, uint64_t seen) {
  atomicExch(a.failed, 1u);
  if (atomicCAS(a.record_lock, 0u, 1u) != 0u) return;
  NvTimeoutRecord* r = a.record;
  if (!r->set) {
    r->phase = phase;
    r->step = step;
    r->pe = a.pe;
    r->peer_pe = peer_pe;
    r->block = blockIdx.x;
    r->timeout_ms = a.timeout_ms;
    r->expected = expected;
    r->seen = seen;
    __threadfence_system();
    r->set = 1;
  }
  __threadfence();
  atomicExch(a.record_lock, 0u);
}

// Waits until the word `flag` shows call s (SignalWord) or a later one, or
// the deadline; returns the word seen, or 0 on a failure. A word at call
// s + 2 or beyond fails at once: no healthy run lets a peer lead by two calls
// (see Flow control above), so that peer has given up on calls it timed out
// in and wrote call s + 2's data into the unit this call would read. Call s
// with another fingerprint fails too: the peer runs another all-reduce.
__device__ uint64_t BoundedWait(const Args& a, const uint64_t* flag, uint64_t s,
                                uint64_t deadline, int phase, int step, int peer_pe) {
  const uint32_t call = static_cast<uint32_t>(s);
  for (;;) {
    const uint64_t seen = LoadAcquire(flag);
    const uint32_t seen_call = static_cast<uint32_t>(seen);
    const bool ahead = Reached(seen_call, call + 2);
    const bool other_call = seen_call == call && (seen >> 32) != a.fingerprint;
    if (ahead || other_call) {
      RecordTimeout(a, phase, step, peer_pe, SignalWord(a, s), seen);
      return 0;
    }
    if (Reached(seen_call, call)) return seen;
    if (GlobalTimerNs() > deadline) {
      RecordTimeout(a, phase, step, peer_pe, SignalWord(a, s), seen);
      return 0;
    }
  }
}

// Whole block, after its stores of this phase: lane q (a local peer) raises
// our signal word `base + l` on q to s.
__device__ void SignalLocal(const Args& a, int base, uint64_t s) {
  __syncthreads();
  const int q = threadIdx.x;
  if (q >= a.G || q == a.l) return;
  __threadfence_system();
  StoreRelease(a.peer_sig[q] + blockIdx.x * kSigPerBlock + base + a.l, SignalWord(a, s));
}

// Lane q waits for local peer q's word `base + q` here to reach s; the
// barrier hands the data to the block. Sets *failed on a timeout.
__device__ void WaitLocal(const Args& a, int base, uint64_t s, uint64_t deadline,
                          int phase, int* failed) {
  const int q = threadIdx.x;
  if (q < a.G && q != a.l) {
    const uint64_t* flag = a.sig + blockIdx.x * kSigPerBlock + base + q;
    if (BoundedWait(a, flag, s, deadline, phase, 0, a.node * a.G + q) == 0) *failed = 1;
  }
  __syncthreads();
}

template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads) HierarchicalAllReduceKernel(Args a) {
  __shared__ uint64_t s_seq;
  __shared__ int failed;
  const int b = blockIdx.x;
  const uint64_t deadline = GlobalTimerNs() + a.timeout_ns;
  if (threadIdx.x == 0) {
    // After finalize (a graph replay) NVSHMEM's buffers and the counters
    // may be freed: the generation check comes before anything else is read.
    const bool live = *reinterpret_cast<const volatile uint32_t*>(a.lifetime) == a.generation;
    failed = !live || *reinterpret_cast<volatile uint32_t*>(a.failed) != 0;
    if (live) {
      s_seq = a.seq[b] + 1;
      a.seq[b] = s_seq;
    }
  }
  __syncthreads();
  const uint64_t s = s_seq;
  const int parity = static_cast<int>(s & 1);

  const size_t lo = b * a.chunk;
  const size_t count = min(a.elements, lo + a.chunk) - lo;
  const T* x = static_cast<const T*>(a.x) + lo;
  T* y = static_cast<T*>(a.y) + lo;
  const T nan = static_cast<T>(__int_as_float(0x7fc00000));
  if (failed) {  // an earlier call failed: send nothing
    for (size_t i = threadIdx.x; i < count; i += blockDim.x) y[i] = nan;
    return;
  }
  auto begin = [&](int q) { return min(q * a.slice, count); };
  const size_t own = begin(a.l);
  const size_t own_n = begin(a.l + 1) - own;
  const size_t unit_base =
      ((static_cast<size_t>(parity) * kNvMaxBlocks + b) * a.units) * a.stripe;
  auto unit = [&](char* region, int kind) {
    return reinterpret_cast<T*>(region + unit_base + kind * a.stripe);
  };
  auto step_recv = [&](int k) { return unit(a.data, 2 + k); };
  auto step_send = [&](int k) { return unit(a.data, 2 + a.steps_alloc + k); };

  const T* srcs[kNvMaxNode];
  T* dsts[kNvMaxNode];
  // Where the fully reduced own slice goes: y and the local peers' AG units.
  auto final_dsts = [&]() {
    int nd = 0;
    dsts[nd++] = y + own;
    for (int q = 0; q < a.G; ++q) {
      if (q != a.l) dsts[nd++] = unit(a.peer_data[q], kAgRecv) + a.l * a.slice;
    }
    return nd;
  };

  // 1. Intra-node reduce-scatter.
  if (a.G > 1) {
    for (int q = 0; q < a.G; ++q) {
      if (q == a.l) continue;
      const T* src = x + begin(q);
      T* dst = unit(a.peer_data[q], kRsRecv) + a.l * a.slice;
      ReduceRange<T, kVector>(&src, 1, &dst, 1, begin(q + 1) - begin(q));
    }
    SignalLocal(a, kSigRs, s);
    WaitLocal(a, kSigRs, s, deadline, 1, &failed);
  }
  if (!failed) {
    for (int j = 0; j < a.G; ++j) {
      srcs[j] = j == a.l ? x + own : unit(a.data, kRsRecv) + j * a.slice;
    }
    int nd = 1;
    if (a.steps > 0) {
      dsts[0] = step_send(0);
    } else {
      nd = final_dsts();
    }
    ReduceRange<T, kVector>(srcs, a.G, dsts, nd, own_n);
  }

  // 2. Inter-node recursive doubling on the own slice.
  for (int k = 0; k < a.steps; ++k) {
    __syncthreads();  // the send unit is written; `failed` is settled
    if (failed) break;
    const int partner = ((a.node ^ (1 << k)) * a.G) + a.l;
    uint64_t* sig = a.sig + b * kSigPerBlock + kSigStep + k;
    // The partner has the same l and chunk, hence the same own_n.
    if (own_n > 0) {
      nvshmemx_putmem_signal_nbi_block(step_recv(k), step_send(k), own_n * sizeof(T), sig,
                                       SignalWord(a, s), NVSHMEM_SIGNAL_SET, partner);
    } else if (threadIdx.x == 0) {
      nvshmemx_signal_op(sig, SignalWord(a, s), NVSHMEM_SIGNAL_SET, partner);
    }
    if (threadIdx.x == 0) {
      if (const uint64_t seen = BoundedWait(a, sig, s, deadline, 2, k, partner)) {
        // Already satisfied: returns at once, after the transport's memory
        // update that makes the put's data visible (nvshmem's own wait has no
        // timeout, so it only ever runs once the signal is there). The word
        // stays `seen` until this PE's next call lets the partner go on.
        nvshmem_signal_wait_until(sig, NVSHMEM_CMP_EQ, seen);
      } else {
        failed = 1;
      }
    }
    __syncthreads();
    if (failed) break;
    const bool upper = (a.node >> k) & 1;
    srcs[0] = upper ? step_recv(k) : step_send(k);
    srcs[1] = upper ? step_send(k) : step_recv(k);
    int nd = 1;
    if (k + 1 < a.steps) {
      dsts[0] = step_send(k + 1);
    } else {
      nd = final_dsts();
    }
    ReduceRange<T, kVector>(srcs, 2, dsts, nd, own_n);
  }

  // 3. Intra-node all-gather.
  __syncthreads();
  if (a.G > 1 && !failed) {
    SignalLocal(a, kSigAg, s);
    WaitLocal(a, kSigAg, s, deadline, 3, &failed);
    if (!failed) {
      for (int q = 0; q < a.G; ++q) {
        if (q == a.l) continue;
        const T* src = unit(a.data, kAgRecv) + q * a.slice;
        T* dst = y + begin(q);
        ReduceRange<T, kVector>(&src, 1, &dst, 1, begin(q + 1) - begin(q));
      }
    }
  }
  if (failed) {  // a peer is missing: make the wrong result visible
    for (size_t i = threadIdx.x; i < count; i += blockDim.x) y[i] = nan;
  }
  __syncthreads();
  if (threadIdx.x == 0) nvshmem_quiet();
}

using KernelFn = void (*)(Args);

template <typename T>
constexpr KernelFn kKernels[2] = {HierarchicalAllReduceKernel<T, false>,
                                  HierarchicalAllReduceKernel<T, true>};

KernelFn PickKernel(ffi::DataType dtype, bool vector) {
  switch (dtype) {
    case ffi::DataType::BF16: return kKernels<__nv_bfloat16>[vector];
    case ffi::DataType::F16: return kKernels<__half>[vector];
    default: return kKernels<float>[vector];
  }
}

size_t RoundUp(size_t v, size_t m) { return (v + m - 1) / m * m; }

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_flashoverlap nvshmem all_reduce: " + msg);
}

ffi::Error AllReduceImpl(cudaStream_t stream, Buffer_Type x, Result_Type y,
                         int32_t node_size, int32_t timeout_ms) {
  const NvState& st = State();
  if (!st.initialized) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_flashoverlap nvshmem all_reduce: NVSHMEM is not initialised in "
                      "this process; call jax_flashoverlap.nvshmem.initialize() first");
  }
  if (auto pending = TakePendingError()) {
    return ffi::Error::Internal(*pending);
  }
  if (const std::string failure = Failure(); !failure.empty()) {
    return ffi::Error::Internal(
        "jax_flashoverlap nvshmem all_reduce: an earlier call of this process "
        "timed out, so every call fails until the processes restart (the "
        "PEs' call counters may no longer agree). The first fault: " +
        failure);
  }
  const auto dtype = x.element_type();
  if (!IsSupportedFloat(dtype) || y->element_type() != dtype) {
    return Invalid("x and y must both be bfloat16, float16 or float32");
  }
  const size_t elements = x.element_count();
  if (y->element_count() != elements) {
    return Invalid("x " + DimsToString(x) + " and y " + DimsToString(*y) + " differ in size");
  }
  if (timeout_ms <= 0) return Invalid("timeout_ms must be positive");
  const int G = node_size;
  if (G < 1 || G > kNvMaxNode || st.npes % G != 0) {
    return Invalid("node_size=" + std::to_string(G) + " must be in [1, " +
                   std::to_string(kNvMaxNode) + "] and divide the number of PEs (" +
                   std::to_string(st.npes) + ")");
  }
  const int nodes = st.npes / G;
  if ((nodes & (nodes - 1)) != 0) {
    return Invalid("the node count " + std::to_string(nodes) + " (" +
                   std::to_string(st.npes) + " PEs / node_size " + std::to_string(G) +
                   ") must be a power of two (recursive doubling)");
  }
  if (elements == 0) return ffi::Error::Success();

  Args a{};
  a.G = G;
  a.l = st.rank % G;
  a.node = st.rank / G;
  a.steps = 0;
  while ((1 << a.steps) < nodes) ++a.steps;
  a.steps_alloc = st.steps;
  a.pe = st.rank;
  for (int q = 0; q < G; ++q) {
    const int pe = a.node * G + q;
    a.peer_data[q] = static_cast<char*>(nvshmem_ptr(st.data, pe));
    a.peer_sig[q] = static_cast<uint64_t*>(nvshmem_ptr(st.signals, pe));
    if (a.peer_data[q] == nullptr || a.peer_sig[q] == nullptr) {
      return Invalid("PE " + std::to_string(pe) + " is in this PE's node (node_size=" +
                     std::to_string(G) + ") but its memory cannot be mapped here "
                     "(nvshmem_ptr returned null: no NVLink/P2P path); use a node_size "
                     "that matches the GPUs per host");
    }
  }

  const size_t es = DataTypeBytes(dtype);
  const size_t pack = 16 / es;
  const size_t want = (elements * es + kMinBlockBytes - 1) / kMinBlockBytes;
  const size_t blocks0 = std::min<size_t>(std::max<size_t>(want, 1), kNvMaxBlocks);
  a.chunk = RoundUp((elements + blocks0 - 1) / blocks0, pack);
  const unsigned blocks = static_cast<unsigned>((elements + a.chunk - 1) / a.chunk);
  a.slice = RoundUp((a.chunk + G - 1) / G, pack);
  if (G * a.slice * es > st.stripe_bytes) {
    return Invalid(std::to_string(elements * es) + " bytes per PE exceed the buffers " +
                   "(at most about " + std::to_string(MaxMessageBytes(G)) + " bytes with node_size=" +
                   std::to_string(G) + "); pass a larger heap_mb to "
                   "jax_flashoverlap.nvshmem.initialize()");
  }
  a.x = x.untyped_data();
  a.y = y->untyped_data();
  a.elements = elements;
  a.timeout_ms = timeout_ms;
  a.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000ull;
  a.data = st.data;
  a.sig = st.signals;
  a.seq = st.seq;
  a.stripe = st.stripe_bytes;
  a.units = st.units_per_block;
  a.record = st.record_dev;
  a.record_lock = st.record_lock;
  a.lifetime = st.lifetime;
  a.failed = st.lifetime + 1;
  a.generation = st.generation;
  a.fingerprint = CallFingerprint("nvshmem all_reduce")
                      .Option("dtype", static_cast<int>(dtype))
                      .Option("elements", static_cast<int64_t>(elements))
                      .Option("node_size", G)
                      .Seal();
  const bool vector = reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(a.y) % 16 == 0;
  PickKernel(dtype, vector)<<<blocks, kThreads, 0, stream>>>(a);
  if (const cudaError_t launched = cudaGetLastError(); launched != cudaSuccess) {
    // The peers' kernels run and wait for this one: its counters fell behind.
    const std::string why = std::string("jax_flashoverlap nvshmem all_reduce: the launch "
                                        "failed: ") + cudaGetErrorString(launched);
    SetFailure(why);
    return ffi::Error::Internal(why);
  }
  return ffi::Error::Success();
}

}  // namespace

// Loads every variant now (see ../all_reduce.cu: a lazily loaded kernel can
// block its launch until a spinning peer kernel gives up).
cudaError_t LoadKernels() {
  cudaFuncAttributes attrs;
  for (auto dtype : {ffi::DataType::BF16, ffi::DataType::F16, ffi::DataType::F32}) {
    for (bool vector : {false, true}) {
      cudaError_t err = cudaFuncGetAttributes(&attrs, PickKernel(dtype, vector));
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

const void* AnyKernel() {
  return reinterpret_cast<const void*>(PickKernel(ffi::DataType::F32, false));
}

}  // namespace nv

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoNvshmemAllReduce, nv::AllReduceImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()          // XLA's stream for this (only) device
        .Arg<Buffer_Type>()              // x: any shape, read as flat
        .Ret<Buffer_Type>()              // y: x's shape, the sum over all PEs
        .Attr<int32_t>("node_size")      // consecutive PEs per node
        .Attr<int32_t>("timeout_ms"),    // bound of every wait
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jfo
