// NVSHMEM bootstrap for one process per GPU: unique id from PE 0 (shared by
// the Python side through jax.distributed), NVSHMEMX_INIT_WITH_UNIQUEID, then
// ONE collective allocation of the all-reduce's symmetric buffers and signal
// words (nvshmem_malloc is collective, so it never runs per call).
//
// Two ways to start, chosen by JAX_FLASHOVERLAP_NVSHMEM_INIT:
//   hostlib (default): nvshmemx_hostlib_init_attr starts the host library
//     alone; then nvshmemx_cumodule_init fills this module's copy of the
//     device state (the module's kernels are linked with the static device
//     library, relocatable device code). The way nvshmem4py and JAX's Mosaic
//     GPU start NVSHMEM from a shared library.
//   inline: nvshmemx_init_attr, the header-inline start of NVSHMEM's
//     examples, which runs this module's device-library code inside the
//     start. Seen on 2xH200 (NVSHMEM 3.4.5): SIGSEGV inside it, before NVSHMEM's
//     team setup; kept to tell the two apart.
#include <cuda.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "nvshmem/state.h"
#include "transport/fingerprint.h"

namespace jfo {
namespace nv {
namespace {

std::mutex g_mutex;
NvState g_state;

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("jax_flashoverlap nvshmem: ") + what +
                             " failed: " + cudaGetErrorString(err));
  }
}

using FuncGetModuleFn = CUresult (*)(CUmodule*, CUfunction);

// The CUDA module of this extension's kernels (the driver API through the
// runtime's entry points: the extension links no libcuda).
CUmodule OwnModule() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult query;
  if (cudaGetDriverEntryPointByVersion("cuFuncGetModule", &fn, 11000, cudaEnableDefault,
                                       &query) != cudaSuccess ||
      query != cudaDriverEntryPointSuccess || fn == nullptr) {
    throw std::runtime_error("jax_flashoverlap nvshmem: the CUDA driver has no cuFuncGetModule");
  }
  cudaFunction_t func;
  Check(cudaGetFuncBySymbol(&func, AnyKernel()), "cudaGetFuncBySymbol");
  CUmodule module = nullptr;
  const CUresult res = reinterpret_cast<FuncGetModuleFn>(fn)(
      &module, reinterpret_cast<CUfunction>(func));
  if (res != CUDA_SUCCESS) {
    throw std::runtime_error("jax_flashoverlap nvshmem: cuFuncGetModule failed with CUresult " +
                             std::to_string(res));
  }
  return module;
}

// A crash inside NVSHMEM's start-up kills the process with no native
// stack (the GPU machine has no debugger): print the frames, then die of
// the signal as before. Async-signal-safe calls only.
void PrintFramesAndDie(int sig) {
  void* frames[64];
  const int depth = backtrace(frames, 64);
  static const char kHeader[] = "[jax_flashoverlap nvshmem] fatal signal; native frames:\n";
  (void)!write(STDERR_FILENO, kHeader, sizeof(kHeader) - 1);
  backtrace_symbols_fd(frames, depth, STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  raise(sig);
}

// With debug (JAX_FLASHOVERLAP_NVSHMEM_DEBUG=1, passed to Init), each
// start-up step is printed before it runs, and a crash prints its native
// frames: a start that crashes inside NVSHMEM then shows which step it was
// and where. Set under g_mutex by Init.
bool g_debug = false;

void Step(int rank, const char* what) {
  if (g_debug) std::fprintf(stderr, "[jax_flashoverlap nvshmem PE %d] %s\n", rank, what);
}

int CeilLog2(int n) {
  int k = 0;
  while ((1 << k) < n) ++k;
  return k;
}

// Shuts NVSHMEM down the way it was started.
void Stop(NvState& st) {
  if (st.module != nullptr) {
    nvshmemx_cumodule_finalize(st.module);
    st.module = nullptr;
    nvshmemx_hostlib_finalize();
  } else {
    nvshmem_finalize();
  }
}

}  // namespace

NvState& State() { return g_state; }

std::string GetUniqueId() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0) {
    throw std::runtime_error(
        "jax_flashoverlap nvshmem: nvshmemx_get_uniqueid failed (NVSHMEM_DEBUG=INFO "
        "says why)");
  }
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

void Init(const std::string& uid, int rank, int nranks, size_t heap_bytes,
          int device, bool hostlib, bool debug) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (debug && !g_debug) {
    std::signal(SIGSEGV, PrintFramesAndDie);
    std::signal(SIGBUS, PrintFramesAndDie);
  }
  g_debug = debug;
  NvState& st = g_state;
  if (st.initialized) {
    if (st.rank == rank && st.npes == nranks) return;  // idempotent
    throw std::runtime_error(
        "jax_flashoverlap nvshmem: already initialised as PE " +
        std::to_string(st.rank) + " of " + std::to_string(st.npes) +
        "; finalize() first");
  }
  if (uid.size() != sizeof(nvshmemx_uniqueid_t)) {
    throw std::runtime_error(
        "jax_flashoverlap nvshmem: the unique id has " + std::to_string(uid.size()) +
        " bytes, expected " + std::to_string(sizeof(nvshmemx_uniqueid_t)) +
        " (from get_unique_id() of the same NVSHMEM version)");
  }
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    throw std::runtime_error("jax_flashoverlap nvshmem: rank " + std::to_string(rank) +
                             " is not in [0, " + std::to_string(nranks) + ")");
  }
  const int steps = CeilLog2(nranks);
  if (steps > kNvMaxSteps) {
    throw std::runtime_error("jax_flashoverlap nvshmem: too many PEs");
  }
  Step(rank, "cudaSetDevice");
  Check(cudaSetDevice(device), "cudaSetDevice");
  // NVSHMEM reads its heap size and NVSHMEM_DISABLE_NVLS from the
  // environment: nvshmem.initialize() exported both (settings.export) before
  // this call; nothing here writes the environment while JAX's threads run.

  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr) != 0) {
    throw std::runtime_error("jax_flashoverlap nvshmem: nvshmemx_set_attr_uniqueid_args failed");
  }
  Step(rank, hostlib ? "nvshmemx_hostlib_init_attr" : "nvshmemx_init_attr");
  const int started = hostlib ? nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr)
                              : nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  if (started != 0) {
    throw std::runtime_error(std::string("jax_flashoverlap nvshmem: ") +
                             (hostlib ? "nvshmemx_hostlib_init_attr" : "nvshmemx_init_attr") +
                             " failed (rerun with NVSHMEM_DEBUG=INFO)");
  }
  if (hostlib) {
    Step(rank, "nvshmemx_cumodule_init");
    CUmodule module = nullptr;
    try {
      module = OwnModule();
    } catch (...) {
      nvshmemx_hostlib_finalize();
      throw;
    }
    if (nvshmemx_cumodule_init(module) != 0) {
      nvshmemx_hostlib_finalize();
      throw std::runtime_error(
          "jax_flashoverlap nvshmem: nvshmemx_cumodule_init failed (rerun with "
          "NVSHMEM_DEBUG=INFO)");
    }
    st.module = module;  // from here on, Stop() undoes both
  }
  Step(rank, "nvshmem_my_pe");
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != nranks) {
    Stop(st);
    throw std::runtime_error(
        "jax_flashoverlap nvshmem: NVSHMEM made this process PE " +
        std::to_string(nvshmem_my_pe()) + " of " + std::to_string(nvshmem_n_pes()) +
        ", expected " + std::to_string(rank) + " of " + std::to_string(nranks));
  }

  // Half the heap for our buffers: NVSHMEM keeps its own bookkeeping there.
  const size_t sig_bytes = sizeof(uint64_t) * kNvMaxBlocks * kSigPerBlock;
  const int units = 2 + 2 * steps;
  const size_t per_stripe = 2ull * kNvMaxBlocks * units;
  size_t stripe = (heap_bytes / 2 - sig_bytes) / per_stripe / 256 * 256;
  if (heap_bytes / 2 <= sig_bytes || stripe < 4096) {
    Stop(st);
    throw std::runtime_error(
        "jax_flashoverlap nvshmem: heap_bytes=" + std::to_string(heap_bytes) +
        " is too small for the all-reduce buffers (" + std::to_string(nranks) +
        " PEs need at least " +
        std::to_string((4096 * per_stripe + sig_bytes) * 2 >> 20) + " MiB)");
  }
  // Collective: every PE asks for the same sizes, in the same order.
  Step(rank, "nvshmem_malloc");
  char* data = static_cast<char*>(nvshmem_malloc(stripe * per_stripe));
  uint64_t* signals = static_cast<uint64_t*>(nvshmem_calloc(1, sig_bytes));
  if (data == nullptr || signals == nullptr) {
    Stop(st);
    throw std::runtime_error(
        "jax_flashoverlap nvshmem: nvshmem_malloc of " +
        std::to_string(stripe * per_stripe >> 20) +
        " MiB failed; raise heap_mb (NVSHMEM_SYMMETRIC_SIZE) or free GPU "
        "memory (XLA_PYTHON_CLIENT_MEM_FRACTION)");
  }
  try {
    Step(rank, "device counters");
    Check(cudaMalloc(&st.seq, sizeof(uint64_t) * kNvMaxBlocks), "cudaMalloc(seq)");
    Check(cudaMemset(st.seq, 0, sizeof(uint64_t) * kNvMaxBlocks), "cudaMemset(seq)");
    Check(cudaMalloc(&st.record_lock, sizeof(uint32_t)), "cudaMalloc(lock)");
    Check(cudaMemset(st.record_lock, 0, sizeof(uint32_t)), "cudaMemset(lock)");
    static uint32_t* lifetime = nullptr;  // never freed: see NvState::lifetime
    static uint32_t generation = 0;
    if (lifetime == nullptr) {
      Check(cudaMalloc(&lifetime, 2 * sizeof(uint32_t)), "cudaMalloc(lifetime)");
      Check(cudaMemset(lifetime, 0, 2 * sizeof(uint32_t)), "cudaMemset(lifetime)");
    }
    st.lifetime = lifetime;
    st.generation = ++generation;
    Check(cudaMemcpy(lifetime, &st.generation, sizeof(uint32_t), cudaMemcpyHostToDevice),
          "cudaMemcpy(generation)");
    Check(cudaHostAlloc(reinterpret_cast<void**>(&st.record), sizeof(NvTimeoutRecord),
                        cudaHostAllocMapped),
          "cudaHostAlloc(record)");
    std::memset(const_cast<NvTimeoutRecord*>(st.record), 0, sizeof(NvTimeoutRecord));
    Check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&st.record_dev), st.record, 0),
          "cudaHostGetDevicePointer(record)");
    Step(rank, "loading kernels");
    Check(LoadKernels(), "loading the all-reduce kernels");
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  } catch (...) {  // a later initialize() must find NVSHMEM stopped
    cudaFree(st.seq);
    cudaFree(st.record_lock);
    cudaFreeHost(st.record);
    Stop(st);
    st = NvState{};
    throw;
  }
  // Every PE's counters and signals are zero before anyone's first call.
  Step(rank, "nvshmem_barrier_all");
  nvshmem_barrier_all();
  Step(rank, "started");

  st.rank = rank;
  st.npes = nranks;
  st.steps = steps;
  st.device = device;
  st.heap_bytes = heap_bytes;
  st.data = data;
  st.stripe_bytes = stripe;
  st.units_per_block = units;
  st.signals = signals;
  st.initialized = true;
}

void Finalize() {
  std::lock_guard<std::mutex> lock(g_mutex);
  NvState& st = g_state;
  if (!st.initialized) return;
  cudaSetDevice(st.device);
  cudaDeviceSynchronize();
  const uint32_t ended = 0;  // later replays of this generation's kernels do nothing
  cudaMemcpy(st.lifetime, &ended, sizeof(ended), cudaMemcpyHostToDevice);
  nvshmem_barrier_all();  // no peer still writes into our buffers
  nvshmem_free(st.data);
  nvshmem_free(st.signals);
  cudaFree(st.seq);
  cudaFree(st.record_lock);
  cudaFreeHost(st.record);
  Stop(st);
  st = NvState{};
}

std::mutex g_failure_mu;  // the handler's threads and Python's
std::string g_failure;

std::string Failure() {
  std::lock_guard<std::mutex> lock(g_failure_mu);
  return g_failure;
}

void SetFailure(const std::string& why) {
  std::lock_guard<std::mutex> lock(g_failure_mu);
  if (g_failure.empty()) g_failure = why;
}

std::optional<std::string> TakePendingError() {
  std::lock_guard<std::mutex> lock(g_failure_mu);
  NvState& st = g_state;
  if (st.record == nullptr ||
      !__atomic_load_n(&st.record->set, __ATOMIC_ACQUIRE)) {
    return std::nullopt;
  }
  const NvTimeoutRecord r = *const_cast<const NvTimeoutRecord*>(st.record);
  __atomic_store_n(&st.record->set, 0, __ATOMIC_RELEASE);
  static const char* kPhase[] = {"?", "intra-node reduce-scatter", "inter-node step",
                                 "intra-node all-gather"};
  std::string phase = kPhase[(r.phase >= 1 && r.phase <= 3) ? r.phase : 0];
  if (r.phase == 2) phase += " " + std::to_string(r.step);
  // Signal words: the fingerprint over the call number (BoundedWait). A
  // word two or more calls past the expected one: that PE gave up on calls
  // of its own and ran ahead; the expected call with another fingerprint:
  // that PE ran another all-reduce (size or dtype).
  const uint32_t call = static_cast<uint32_t>(r.expected), seen = static_cast<uint32_t>(r.seen);
  const uint32_t ours = static_cast<uint32_t>(r.expected >> 32);
  const uint32_t theirs = static_cast<uint32_t>(r.seen >> 32);
  const bool ahead = static_cast<int32_t>(seen - call) >= 2;
  const bool other_call = seen == call && theirs != ours;
  const std::string peer = "PE " + std::to_string(r.peer_pe);
  std::string msg = "jax_flashoverlap nvshmem all_reduce: PE " + std::to_string(r.pe) +
         (other_call ? " and " + peer + " ran different calls: this PE ran " +
                           DescribeFingerprint(ours) + ", the peer ran " +
                           DescribeFingerprint(theirs)
          : ahead ? " found " + peer + " two or more calls ahead, out of step"
                  : " waited " + std::to_string(r.timeout_ms) + " ms for " + peer) +
         " (" + phase + ", block " + std::to_string(r.block) + ", call " +
         std::to_string(call) + ", last seen " + std::to_string(seen) +
         "); the output was filled with NaN. Is process " + std::to_string(r.peer_pe) +
         " alive and running the same all-reduces, in the same order, on the same sizes "
         "and dtypes?";
  if (g_failure.empty()) g_failure = msg;
  return msg;
}

size_t MaxMessageBytes(int node_size) {
  const NvState& st = g_state;
  if (!st.initialized) return 0;
  const size_t slack = 16 * (static_cast<size_t>(node_size) + 1);
  return st.stripe_bytes > slack ? kNvMaxBlocks * (st.stripe_bytes - slack) : 0;
}

}  // namespace nv
}  // namespace jfo
