// The Python extension `_ffi`: handler capsules for jax.ffi plus build
// facts and error reporting. Builds without CUDA too (no handlers then), so
// the package imports on CPU-only machines.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "settings.h"

#ifdef JFO_WITH_CUDA
#include "handlers.h"
#endif
#ifdef JFO_WITH_CUTLASS
#include "tile_gemm.h"
#endif
#ifdef JFO_WITH_CUBLASLT
#include "gemm.h"
#include "transport/peer_state.h"
#include "transport/peer_region.h"
#include "transport/transport.h"
#endif

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// Fused ops set up peers and workspaces in the initialize stage, so they are
// registered as a dict of stage handlers (accepted by register_ffi_target).
template <typename T>
nb::dict Stages(T* initialize, T* execute) {
  nb::dict d;
  d["initialize"] = Capsule(initialize);
  d["execute"] = Capsule(execute);
  return d;
}

nb::dict Registrations() {
  nb::dict d;
#ifdef JFO_WITH_CUDA
  d["jfo_scale"] = Capsule(jfo::JfoScale);
  d["jfo_decode_matmul"] = Capsule(jfo::JfoDecodeMatmul);
  d["jfo_transformer_decode"] = Capsule(jfo::JfoTransformerDecode);
  d["jfo_mamba_decode"] = Capsule(jfo::JfoMambaDecode);
#endif
#ifdef JFO_WITH_CUBLASLT
  d["jfo_all_gather_matmul"] =
      Stages(jfo::JfoAllGatherMatmulInitialize, jfo::JfoAllGatherMatmul);
  d["jfo_matmul_reduce_scatter"] =
      Stages(jfo::JfoMatmulReduceScatterInitialize,
             jfo::JfoMatmulReduceScatter);
  d["jfo_matmul_all_reduce"] =
      Stages(jfo::JfoMatmulAllReduceInitialize, jfo::JfoMatmulAllReduce);
  d["jfo_all_reduce"] =
      Stages(jfo::JfoAllReduceInitialize, jfo::JfoAllReduce);
  d["jfo_all_reduce_copy_engine"] = Stages(
      jfo::JfoAllReduceCopyEngineInitialize, jfo::JfoAllReduceCopyEngine);
#endif
#ifdef JFO_WITH_CUTLASS
  d["jfo_tile_gemm"] = Capsule(jfo::JfoTileGemm);
  d["jfo_gather_tile_gemm_check"] = Capsule(jfo::JfoGatherTileGemmCheck);
#endif
  return d;
}

nb::dict BuildInfo() {
  nb::dict d;
  nb::list archs;
#ifdef JFO_WITH_CUDA
  d["cuda"] = true;
  d["cuda_version"] = JFO_CUDA_VERSION;
  std::string list = JFO_CUDA_ARCHITECTURES;  // comma-separated: "80-real,90-real,100"
  for (size_t pos = 0; pos <= list.size();) {
    size_t end = list.find(',', pos);
    if (end == std::string::npos) end = list.size();
    if (end > pos) archs.append(list.substr(pos, end - pos));
    pos = end + 1;
  }
#else
  d["cuda"] = false;
  d["cuda_version"] = "";
#endif
  d["architectures"] = archs;
#ifdef JFO_WITH_CUBLASLT
  d["cublaslt"] = true;
#else
  d["cublaslt"] = false;
#endif
#ifdef JFO_WITH_CUTLASS
  d["cutlass"] = JFO_CUTLASS_VERSION;
#else
  d["cutlass"] = "";
#endif
  return d;
}

// The transport's layout limits, which jax_flashoverlap.dispatch mirrors
// (tests/test_extension.py checks that they agree). Empty without the ops.
nb::dict Limits() {
  nb::dict d;
#ifdef JFO_WITH_CUBLASLT
  d["lamport_max_bytes"] = jfo::kLamportMaxBytes;
  d["lamport_parity_budget"] = jfo::kLamportParityBudget;
  d["all_reduce_min_block_bytes"] = jfo::kAllReduceMinBlockBytes;
  d["gemm_workspace_bytes"] = jfo::kGemmWorkspaceBytes;
  d["control_bytes"] = jfo::kControlBytes;
  d["events_per_call"] = jfo::kEventsPerCall;
#endif
  return d;
}

std::optional<std::string> PendingError() {
  std::string msg;
#ifdef JFO_WITH_CUBLASLT
  msg = jfo::TakePendingError();
#endif
#ifdef JFO_WITH_CUDA
  const std::string decode = jfo::TransformerDecodeFailures();
  msg += (msg.empty() || decode.empty() ? "" : "\n") + decode;
#endif
  if (!msg.empty()) return msg;
  return std::nullopt;
}

std::string ModuleLoadingMode() {
#ifdef JFO_WITH_CUBLASLT
  return jfo::ModuleLoadingMode();
#else
  return "unknown";
#endif
}

nb::dict DebugCounters() {
  nb::dict d;
#ifdef JFO_WITH_CUBLASLT
  d["all_reduce_host_calls"] = jfo::AllReduceHostCalls();
  d["all_reduce_direct_gathers"] = jfo::AllReduceDirectGathers();
#endif
  return d;
}

void Configure(size_t workspace_mb, bool peer_stores, bool gemm_autotune) {
  // settings.py's range, checked again: a workspace below it has no room for
  // the control words that sit after the GEMM workspace.
  if (workspace_mb < 64 || workspace_mb > (size_t{1} << 20)) {
    throw nb::value_error("configure: workspace_mb must be from 64 to 1048576 (MiB)");
  }
  jfo::SetSettings({workspace_mb, peer_stores, gemm_autotune});
}

nb::dict Settings() {
  const jfo::RuntimeSettings current = jfo::GetSettings();
  nb::dict d;
  d["workspace_mb"] = current.workspace_mb;
  d["peer_stores"] = current.peer_stores;
  d["gemm_autotune"] = current.gemm_autotune;
  return d;
}

void Reset() {
  std::string why;
  {
    // It waits for every GPU (up to a wait's timeout): XLA's threads may
    // need the GIL meanwhile.
    nb::gil_scoped_release release;
#ifdef JFO_WITH_CUBLASLT
    why = jfo::ResetTransport();
#endif
#ifdef JFO_WITH_CUDA
    if (why.empty()) why = jfo::ResetTransformerDecode();
#endif
  }
  if (!why.empty()) throw std::runtime_error("jax_flashoverlap.reset: " + why);
}

void InjectFault(const std::string& kind, int ordinal, int call, int stall_ms) {
#ifdef JFO_WITH_CUBLASLT
  using jfo::FaultKind;
  const FaultKind parsed = kind == "error"   ? FaultKind::kError
                           : kind == "skip"  ? FaultKind::kSkip
                           : kind == "stall" ? FaultKind::kStall
                           : kind == "none"  ? FaultKind::kNone
                                             : static_cast<FaultKind>(-1);
  if (static_cast<int>(parsed) < 0 || ordinal < 0 || call < 1 || stall_ms < 0) {
    throw nb::value_error(
        "inject_fault: kind must be error, skip, stall or none, ordinal >= 0, "
        "call >= 1 and stall_ms >= 0");
  }
  jfo::InjectFault(parsed, ordinal, call, stall_ms);
#else
  (void)kind, (void)ordinal, (void)call, (void)stall_ms;
  throw std::runtime_error("inject_fault: this build has no CUDA ops");
#endif
}

std::string DebugWaitFlag(int ordinal, uint32_t flag, uint32_t expected,
                          int timeout_ms, uint32_t their_fingerprint,
                          uint32_t own_fingerprint) {
#ifdef JFO_WITH_CUBLASLT
  return jfo::DebugWaitFlag(ordinal, flag, expected, timeout_ms, their_fingerprint,
                            own_fingerprint);
#else
  (void)ordinal, (void)flag, (void)expected, (void)timeout_ms;
  (void)their_fingerprint, (void)own_fingerprint;
  throw std::runtime_error("debug_wait_flag: this build has no CUDA ops");
#endif
}

#ifdef JFO_WITH_CUBLASLT
// An error of the node transport as the Python exception it names.
void ThrowIfFailed(const xla::ffi::Error& error) {
  if (error.success()) return;
  const std::string message(error.message());
  if (error.errc() == xla::ffi::ErrorCode::kInvalidArgument) throw nb::value_error(message.c_str());
  throw std::runtime_error(message);
}
#endif

void ConfigureNode(int node_size, const std::vector<std::pair<int, int>>& local,
                   const std::vector<std::string>& labels) {
#ifdef JFO_WITH_CUBLASLT
  ThrowIfFailed(jfo::ConfigureNode(node_size, local, labels));
#else
  (void)node_size, (void)local, (void)labels;
  throw std::runtime_error("configure_node: this build has no CUDA ops");
#endif
}

std::pair<nb::bytes, size_t> ExportWorkspace(int id) {
#ifdef JFO_WITH_CUBLASLT
  auto exported = jfo::ExportWorkspace(id);
  if (exported.has_error()) ThrowIfFailed(exported.error());
  return {nb::bytes(exported->first.data(), exported->first.size()), exported->second};
#else
  (void)id;
  throw std::runtime_error("export_workspace: this build has no CUDA ops");
#endif
}

void ImportWorkspace(int id, nb::bytes handle, size_t bytes) {
#ifdef JFO_WITH_CUBLASLT
  ThrowIfFailed(jfo::ImportWorkspace(id, std::string(handle.c_str(), handle.size()), bytes));
#else
  (void)id, (void)handle, (void)bytes;
  throw std::runtime_error("import_workspace: this build has no CUDA ops");
#endif
}

void SetCublasLtPath(const std::string& path) {
#ifdef JFO_WITH_CUBLASLT
  jfo::SetCublasLtPath(path);
#else
  (void)path;
#endif
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "jax_flashoverlap CUDA kernels exposed through the XLA FFI";
  m.def("registrations", &Registrations,
        "Target name -> PyCapsule (or dict of stage capsules) for "
        "jax.ffi.register_ffi_target(..., platform='CUDA').");
  m.def("build_info", &BuildInfo,
        "Dict: cuda (bool), cuda_version (str), architectures (list of str), "
        "cublaslt (bool), cutlass (str: the version the tile GEMM was built "
        "with, empty without it).");
  m.def("limits", &Limits, "The transport's layout limits (empty without the CUDA ops).");
  m.def("pending_error", &PendingError,
        "Returns and clears the recorded wait timeouts of every device (one "
        "per line); else, while GPUs of the transport have failed, a line "
        "naming them and the first fault; then the decode kernel's tensor "
        "groups' timeouts, until reset(); else None.");
  m.def("module_loading_mode", &ModuleLoadingMode,
        "The CUDA driver's module loading mode: 'lazy', 'eager' or 'unknown' "
        "(no driver, or CUDA not initialised).");
  m.def("debug_counters", &DebugCounters,
        "Dict of counters for tests: all_reduce_host_calls (how often the "
        "all-reduce handler's host code ran; CUDA graph replays skip it), "
        "all_reduce_direct_gathers (of those, two-shot calls whose peers "
        "store into y directly).");
  m.def("configure", &Configure, nb::kw_only(), nb::arg("workspace_mb"),
        nb::arg("peer_stores"), nb::arg("gemm_autotune"),
        "Sets the run-time settings, as jax_flashoverlap/settings.py parsed "
        "them (validated there; a workspace out of its range raises here too).");
  m.def("settings", &Settings,
        "Dict: the run-time settings the ops use (workspace_mb, peer_stores, "
        "gemm_autotune).");
  m.def("reset", &Reset,
        "Waits until every GPU of the transport is idle and returns the "
        "transport to its state before the first call (no failed group, no "
        "injected fault), and the decode kernel's tensor groups to theirs.");
  m.def("inject_fault", &InjectFault, nb::arg("kind"), nb::arg("ordinal"),
        nb::arg("call"), nb::arg("stall_ms"),
        "Test hook: the call-th next call on CUDA device `ordinal` fails "
        "('error': after its first send; 'skip': at its start) or starts "
        "stall_ms late ('stall'); 'none' clears it.");
  m.def("debug_wait_flag", &DebugWaitFlag, nb::arg("ordinal"), nb::arg("flag"),
        nb::arg("expected"), nb::arg("timeout_ms"), nb::arg("their_fingerprint") = 0,
        nb::arg("own_fingerprint") = 0,
        "Test hook: the copy-engine wait kernel against a flag holding `flag` "
        "(and, when own_fingerprint is not 0, a peer call's fingerprint): "
        "'reached', 'timed out', 'out of step' or 'another call'.");
  m.def("configure_node", &ConfigureNode, nb::arg("node_size"), nb::arg("local"),
        nb::arg("labels"),
        "Gives the devices of a node shared by several processes their transport ids "
        "(0..node_size-1, the same in every process): `local` lists (CUDA ordinal, id) "
        "of this process's devices, `labels` names every id for messages. Before the "
        "process's first CUDA op.");
  m.def("export_workspace", &ExportWorkspace, nb::arg("id"),
        "(CUDA IPC handle bytes, workspace bytes) of this process's device `id`, whose "
        "workspace is allocated now if it is not yet.");
  m.def("import_workspace", &ImportWorkspace, nb::arg("id"), nb::arg("handle"),
        nb::arg("bytes"),
        "Maps device `id`'s workspace from another process of the node (its "
        "export_workspace result).");
  m.def("set_cublaslt_path", &SetCublasLtPath, nb::arg("path"),
        "dlopen cuBLASLt from this path if it is not loaded yet.");
}
