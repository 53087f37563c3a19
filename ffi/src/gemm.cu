#include "gemm.h"

#include <cublasLt.h>
#include <dlfcn.h>

#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "settings.h"

namespace jfo {
namespace {

// The cuBLASLt entry points we use, resolved with dlsym.
struct LtApi {
  decltype(&cublasLtCreate) Create;
  decltype(&cublasLtMatmulDescCreate) MatmulDescCreate;
  decltype(&cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  decltype(&cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
  decltype(&cublasLtMatmulPreferenceCreate) PreferenceCreate;
  decltype(&cublasLtMatmulPreferenceDestroy) PreferenceDestroy;
  decltype(&cublasLtMatmulPreferenceSetAttribute) PreferenceSetAttribute;
  decltype(&cublasLtMatmulAlgoGetHeuristic) AlgoGetHeuristic;
  decltype(&cublasLtMatmul) Matmul;
  decltype(&cublasLtGetStatusString) GetStatusString;
};

// Everything cuBLASLt needs for one problem, built once and reused.
struct Plan {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, c, d;
  cublasLtMatmulAlgo_t algo;
};

// (ordinal, dtype, m, n, k, ldx, ldw, ldc, ldd, has_c, alignment)
using PlanKey = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, bool, int>;

std::mutex g_mu;
std::string g_path = "libcublasLt.so.13";
LtApi* g_api = nullptr;
std::map<int, cublasLtHandle_t> g_handles;
std::map<PlanKey, Plan> g_plans;

// Autotuning (on unless JAX_FLASHOVERLAP_GEMM_AUTOTUNE=0): the heuristic's
// first choices, each timed on the call's own operands when a problem is
// first seen. The fused ops run GEMMs of a fraction of the rows XLA's dot
// would see, whose best tile can differ from the heuristic's pick (on
// all_gather_matmul at 2048x8192x7168: 643 -> 625 us of GEMM kernels).
constexpr int kHeuristicCandidates = 8;
constexpr int kTimedRuns = 3;
struct TimingEvents {
  cudaEvent_t start = nullptr, stop = nullptr;
};
std::map<int, TimingEvents> g_timing_events;  // by ordinal

bool AutotuneRequested() { return GetSettings().gemm_autotune; }

// Called under g_mu.
ffi::ErrorOr<TimingEvents> TimingEventsFor(int ordinal) {
  auto it = g_timing_events.find(ordinal);
  if (it != g_timing_events.end()) return it->second;
  DeviceGuard guard(ordinal);
  TimingEvents ev;
  JFO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&ev.start));
  if (const cudaError_t err = cudaEventCreate(&ev.stop); err != cudaSuccess) {
    cudaEventDestroy(ev.start);
    JFO_CUDA_RETURN_IF_ERROR(err);
  }
  g_timing_events[ordinal] = ev;
  return ev;
}

ffi::Error LtError(const char* what, cublasStatus_t s) {
  return ffi::Error::Internal(std::string("jax_flashoverlap: ") + what +
                              " failed: " + g_api->GetStatusString(s));
}

#define JFO_LT_RETURN_IF_ERROR(expr)                                \
  do {                                                              \
    cublasStatus_t jfo_s_ = (expr);                                 \
    if (jfo_s_ != CUBLAS_STATUS_SUCCESS) return LtError(#expr, jfo_s_); \
  } while (0)

// Called under g_mu. jax's CUDA plugin has normally loaded cuBLASLt already,
// so RTLD_NOW finds the same copy.
ffi::Error LoadApi() {
  if (g_api) return ffi::Error::Success();
  void* lib = dlopen(g_path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    return ffi::Error::Internal(
        "jax_flashoverlap: cannot load cuBLASLt (" + g_path + "): " +
        dlerror() + "; install nvidia-cublas or call "
        "jax_flashoverlap._ffi.set_cublaslt_path(path)");
  }
  static LtApi api;
  void** slots[] = {
      reinterpret_cast<void**>(&api.Create),
      reinterpret_cast<void**>(&api.MatmulDescCreate),
      reinterpret_cast<void**>(&api.MatmulDescSetAttribute),
      reinterpret_cast<void**>(&api.MatrixLayoutCreate),
      reinterpret_cast<void**>(&api.PreferenceCreate),
      reinterpret_cast<void**>(&api.PreferenceDestroy),
      reinterpret_cast<void**>(&api.PreferenceSetAttribute),
      reinterpret_cast<void**>(&api.AlgoGetHeuristic),
      reinterpret_cast<void**>(&api.Matmul),
      reinterpret_cast<void**>(&api.GetStatusString)};
  const char* names[] = {
      "cublasLtCreate", "cublasLtMatmulDescCreate",
      "cublasLtMatmulDescSetAttribute", "cublasLtMatrixLayoutCreate",
      "cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceDestroy",
      "cublasLtMatmulPreferenceSetAttribute",
      "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul",
      "cublasLtGetStatusString"};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); ++i) {
    *slots[i] = dlsym(lib, names[i]);
    if (!*slots[i]) {
      return ffi::Error::Internal(std::string("jax_flashoverlap: ") + g_path +
                                  " has no symbol " + names[i]);
    }
  }
  g_api = &api;
  return ffi::Error::Success();
}

ffi::ErrorOr<cublasLtHandle_t> Handle(int ordinal) {
  JFO_RETURN_IF_ERROR(LoadApi());
  auto it = g_handles.find(ordinal);
  if (it != g_handles.end()) return it->second;
  cublasLtHandle_t h;
  JFO_LT_RETURN_IF_ERROR(g_api->Create(&h));
  g_handles[ordinal] = h;
  return h;
}

// Largest power of two (<= 256) dividing every pointer: the heuristic must
// not pick a kernel that assumes more alignment than row-block offsets have.
int Alignment(const GemmArgs& g) {
  uintptr_t bits = reinterpret_cast<uintptr_t>(g.x) |
                   reinterpret_cast<uintptr_t>(g.w) |
                   reinterpret_cast<uintptr_t>(g.d) |
                   reinterpret_cast<uintptr_t>(g.c) | 256;
  return static_cast<int>(bits & (~bits + 1));
}

cublasStatus_t Launch(cublasLtHandle_t handle, const Plan& plan,
                      const cublasLtMatmulAlgo_t& algo, const GemmArgs& g,
                      void* workspace, size_t workspace_bytes,
                      cudaStream_t stream) {
  const float alpha = 1.0f, beta = g.c ? 1.0f : 0.0f;
  return g_api->Matmul(handle, plan.desc, &alpha, g.w, plan.a, g.x, plan.b,
                       &beta, g.c ? g.c : g.d, plan.c, g.d, plan.d, &algo,
                       workspace, workspace_bytes, stream);
}

// Index of the fastest of `candidates`, timed on `stream` with the call's
// operands (it writes only the call's output, which the real launch then
// overwrites). The host waits for the stream here, once per new problem and
// never holding g_mu; the peer waits of this call are not enqueued yet.
ffi::ErrorOr<int> Fastest(cublasLtHandle_t handle, const Plan& plan,
                          const std::vector<cublasLtMatmulAlgo_t>& candidates,
                          const GemmArgs& g, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream,
                          TimingEvents ev) {
  int best = -1;
  float best_ms = std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < candidates.size(); ++i) {
    auto run = [&] {
      return Launch(handle, plan, candidates[i], g, workspace,
                    workspace_bytes, stream);
    };
    if (run() != CUBLAS_STATUS_SUCCESS) continue;  // warm-up; unusable algo
    JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev.start, stream));
    bool ok = true;
    for (int r = 0; r < kTimedRuns && ok; ++r) ok = run() == CUBLAS_STATUS_SUCCESS;
    JFO_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev.stop, stream));
    JFO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(ev.stop));
    float ms = 0;
    JFO_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, ev.start, ev.stop));
    if (ok && ms < best_ms) {
      best_ms = ms;
      best = static_cast<int>(i);
    }
  }
  if (best < 0) {
    return ffi::Error::Internal(
        "jax_flashoverlap: no cuBLASLt algorithm ran for M=" +
        std::to_string(g.m) + " N=" + std::to_string(g.n) +
        " K=" + std::to_string(g.k));
  }
  return best;
}

// Row-major D = X W is column-major D^T = W^T X^T: A = W (N x K, ld = ldw),
// B = X (K x M, ld = ldx), no transposes. With `tune` (timing events), the
// algorithm is the fastest of the heuristic's first candidates, else its
// first.
ffi::ErrorOr<Plan> MakePlan(cublasLtHandle_t handle, const GemmArgs& g,
                             int align, const TimingEvents* tune,
                             void* workspace, size_t workspace_bytes,
                             cudaStream_t stream) {
  const cudaDataType_t t = ToCudaDataType(g.dtype);
  const cudaDataType_t scale_t = CUDA_R_32F;
  Plan p;
  JFO_LT_RETURN_IF_ERROR(
      g_api->MatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, scale_t));
  JFO_LT_RETURN_IF_ERROR(g_api->MatrixLayoutCreate(&p.a, t, g.n, g.k, g.ldw));
  JFO_LT_RETURN_IF_ERROR(g_api->MatrixLayoutCreate(&p.b, t, g.k, g.m, g.ldx));
  JFO_LT_RETURN_IF_ERROR(g_api->MatrixLayoutCreate(
      &p.c, t, g.n, g.m, g.c ? g.ldc : g.ldd));
  JFO_LT_RETURN_IF_ERROR(g_api->MatrixLayoutCreate(&p.d, t, g.n, g.m, g.ldd));
  cublasLtMatmulPreference_t pref;
  JFO_LT_RETURN_IF_ERROR(g_api->PreferenceCreate(&pref));
  // Needed only for the heuristic query below.
  std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                  decltype(g_api->PreferenceDestroy)>
      owned_pref(pref, g_api->PreferenceDestroy);
  uint64_t ws = 32u << 20;
  uint32_t a32 = static_cast<uint32_t>(align);
  JFO_LT_RETURN_IF_ERROR(g_api->PreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    JFO_LT_RETURN_IF_ERROR(
        g_api->PreferenceSetAttribute(pref, attr, &a32, sizeof(a32)));
  }
  cublasLtMatmulHeuristicResult_t results[kHeuristicCandidates];
  int found = 0;
  JFO_LT_RETURN_IF_ERROR(g_api->AlgoGetHeuristic(
      handle, p.desc, p.a, p.b, p.c, p.d, pref, tune ? kHeuristicCandidates : 1,
      results, &found));
  if (found == 0) {
    return ffi::Error::Internal(
        "jax_flashoverlap: cuBLASLt has no algorithm for M=" +
        std::to_string(g.m) + " N=" + std::to_string(g.n) +
        " K=" + std::to_string(g.k));
  }
  p.algo = results[0].algo;
  if (tune && found > 1) {
    std::vector<cublasLtMatmulAlgo_t> candidates;
    for (int i = 0; i < found; ++i) candidates.push_back(results[i].algo);
    auto best = Fastest(handle, p, candidates, g, workspace, workspace_bytes,
                        stream, *tune);
    if (best.has_error()) return best.error();
    p.algo = candidates[*best];
  }
  return p;
}

}  // namespace

void SetCublasLtPath(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_path = path;
}

ffi::Error GemmInit(int ordinal) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto h = Handle(ordinal);
  return h.has_error() ? h.error() : ffi::Error::Success();
}

ffi::Error Gemm(int ordinal, const GemmArgs& g, void* workspace,
                size_t workspace_bytes, cudaStream_t stream,
                bool only_if_new) {
  if (g.m == 0 || g.n == 0) return ffi::Error::Success();
  if (g.k <= 0) {
    // cuBLASLt has no layout for an empty K; the wrappers refuse empty
    // operands before they reach a kernel.
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap: a GEMM needs K >= 1, got M=" + std::to_string(g.m) +
        " N=" + std::to_string(g.n) + " K=" + std::to_string(g.k));
  }
  const int align = Alignment(g);
  const PlanKey key{ordinal, static_cast<int>(g.dtype), g.m, g.n, g.k, g.ldx,
                    g.ldw, g.c ? g.ldc : 0, g.ldd, g.c != nullptr, align};
  cublasLtHandle_t handle;
  Plan plan;
  bool known = false;
  TimingEvents events;
  const TimingEvents* tune = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto h = Handle(ordinal);
    if (h.has_error()) return h.error();
    handle = *h;
    auto it = g_plans.find(key);
    known = it != g_plans.end();
    if (known) {
      plan = it->second;
    } else if (AutotuneRequested()) {
      auto ev = TimingEventsFor(ordinal);
      if (ev.has_error()) return ev.error();
      events = *ev;
      tune = &events;
    }
  }
  if (!known) {
    // Outside g_mu: tuning waits for this device's stream, and another
    // device's thread must not block on the lock meanwhile. That wait ends
    // because every device has its own launch thread (PjRt's), so the peer
    // sends that earlier waits on this stream need are enqueued regardless.
    // The key holds the ordinal and a device runs one call at a time, so no
    // other thread makes this plan.
    only_if_new = false;
    auto made = MakePlan(handle, g, align, tune, workspace, workspace_bytes,
                         stream);
    if (made.has_error()) return made.error();
    plan = *made;
    std::lock_guard<std::mutex> lock(g_mu);
    g_plans.emplace(key, plan);
  }
  if (only_if_new) return ffi::Error::Success();
  JFO_LT_RETURN_IF_ERROR(
      Launch(handle, plan, plan.algo, g, workspace, workspace_bytes, stream));
  return ffi::Error::Success();
}

}  // namespace jfo
