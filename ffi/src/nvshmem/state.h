// The NVSHMEM side of jax_flashoverlap (module `_nvshmem_ffi`), one process
// per GPU: the process-wide state set up by bootstrap.cu (init) and used by
// the hierarchical all-reduce handler. Plain C++ here, so that module.cc
// (compiled by the host compiler) can include it.
//
// Symmetric layout, fixed at init (nvshmem_malloc is collective and must not
// run per call). The data region is cut into units of `stripe_bytes`:
//
//   unit(kind, parity, block) = base + ((parity * kNvMaxBlocks + block)
//                                       * units_per_block + kind) * stripe
//   kinds: 0 RS receive, 1 AG receive, 2 + k step-k receive,
//          2 + steps + k step-k send        (k < steps = ceil(log2(npes)))
//
// Block b of a kernel touches only its own units and signal words (as in
// ../all_reduce_flags.cu), so the double-buffering argument is per block. Signal
// words (uint64, symmetric) per block: [RS from local rank j] (kNvMaxNode),
// [AG from local rank j] (kNvMaxNode), [step k] (kNvMaxSteps).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jfo {
namespace nv {

constexpr int kNvMaxBlocks = 32;
constexpr int kNvMaxNode = 8;    // GPUs per node (one NVLink domain)
constexpr int kNvMaxSteps = 16;  // log2 of the node count
constexpr int kSigRs = 0;
constexpr int kSigAg = kNvMaxNode;
constexpr int kSigStep = 2 * kNvMaxNode;
constexpr int kSigPerBlock = 2 * kNvMaxNode + kNvMaxSteps;

// What a wait that timed out leaves for the host (host-mapped, written under
// `record_lock` by the first block that times out).
// `expected` and `seen` are signal words: the call's fingerprint
// (CallFingerprint) in the high 32 bits, its sequence number in the low.
struct NvTimeoutRecord {
  volatile int32_t set;
  int32_t phase;  // 1: reduce-scatter, 2: inter-node step, 3: all-gather
  int32_t step, pe, peer_pe, block, timeout_ms;
  uint64_t expected, seen;
};

struct NvState {
  bool initialized = false;
  int rank = 0, npes = 1, steps = 0, device = 0;
  size_t heap_bytes = 0;
  char* data = nullptr;         // symmetric data region
  size_t stripe_bytes = 0;      // bytes of one unit
  int units_per_block = 0;
  uint64_t* signals = nullptr;  // symmetric, kNvMaxBlocks * kSigPerBlock
  uint64_t* seq = nullptr;      // device, kNvMaxBlocks call counters
  NvTimeoutRecord* record = nullptr;  // host-mapped
  NvTimeoutRecord* record_dev = nullptr;  // its device address
  uint32_t* record_lock = nullptr;    // device word
  // Device words that live as long as the process (a CUDA graph may replay a
  // kernel after finalize): [0] the generation of the running NVSHMEM
  // (0 after finalize; a kernel of another generation writes NaN and
  // touches no buffer of NVSHMEM's, which may be freed); [1] failed, set by
  // every wait that fails: each later kernel of the process writes NaN and
  // sends nothing, also when replayed from a graph (where no host check
  // runs), so that no peer waiting for this PE's call is satisfied by its
  // next one.
  uint32_t* lifetime = nullptr;
  uint32_t generation = 0;
  CUmodule module = nullptr;  // set when started through the host library
};

// The process's state (initialized == false before init / after finalize).
NvState& State();

// Bootstrap (bootstrap.cu). Errors are thrown as std::runtime_error.
std::string GetUniqueId();
// hostlib: start through NVSHMEM's host library (JAX_FLASHOVERLAP_NVSHMEM_INIT
// "hostlib") rather than inline; debug: print each step
// (JAX_FLASHOVERLAP_NVSHMEM_DEBUG). Both parsed by jax_flashoverlap/settings.py.
void Init(const std::string& uid, int rank, int nranks, size_t heap_bytes,
          int device, bool hostlib, bool debug);
void Finalize();
// Returns (and clears) a recorded wait timeout, or nullopt; the first one
// is kept (Failure).
std::optional<std::string> TakePendingError();
// The first timeout seen, or "": every later all-reduce of the process fails
// with it (the PEs' call counters may no longer agree), until it restarts.
std::string Failure();
// Records `why` as the process's failure unless one is recorded already.
void SetFailure(const std::string& why);
// Loads the all-reduce kernels eagerly (hierarchical_all_reduce.cu).
cudaError_t LoadKernels();
// One of this module's kernels: finds the CUDA module whose copy of the
// NVSHMEM device state must be initialised (bootstrap.cu).
const void* AnyKernel();
// Largest all-reduce message (bytes per rank) for this node size.
size_t MaxMessageBytes(int node_size);

}  // namespace nv

XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoNvshmemAllReduce);

}  // namespace jfo
