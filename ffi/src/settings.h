// The extension's run-time settings. jax_flashoverlap/settings.py parses and
// validates them (JAX_FLASHOVERLAP_WORKSPACE_MB, _PEER_STORES,
// _GEMM_AUTOTUNE) and hands them over through the module function
// `configure` whenever it lowers a CUDA op, so the extension never reads the
// environment itself and there is one parser, in Python.
#pragma once

#include <cstddef>
#include <mutex>

namespace jfo {

struct RuntimeSettings {
  size_t workspace_mb = 1024;  // each GPU's workspace, at its first op
  bool peer_stores = true;     // kernels may store into peers' memory
  bool gemm_autotune = true;   // time cuBLASLt's candidates per new problem
};

namespace settings_detail {
inline std::mutex& Mutex() {
  static std::mutex mu;
  return mu;
}
inline RuntimeSettings& Current() {
  static RuntimeSettings settings;
  return settings;
}
}  // namespace settings_detail

inline RuntimeSettings GetSettings() {
  std::lock_guard<std::mutex> lock(settings_detail::Mutex());
  return settings_detail::Current();
}

inline void SetSettings(const RuntimeSettings& settings) {
  std::lock_guard<std::mutex> lock(settings_detail::Mutex());
  settings_detail::Current() = settings;
}

}  // namespace jfo
