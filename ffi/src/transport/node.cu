// Devices of other processes of the node: the node's table of transport ids,
// the workspaces exported and imported through CUDA IPC, and which memory
// the peers of a group may reach.
//
// A workspace is one cudaMalloc allocation, so its legacy IPC handle
// (cudaIpcGetMemHandle: 64 bytes) names it whole, and the handle travels
// through jax.distributed's key-value store as it is. (cuMem's shareable
// handles are file descriptors, which need a Unix socket or pidfd_getfd
// between the processes.) The importer lays the mapped workspace out as its
// owner does (LayOutWorkspace), so the Channel and the all-reduce region
// address a peer of another process exactly as one of this process. Its
// flags, slots and counters are the owner's memory; only the owner zeroes
// them, at allocation and in ResetTransport.
#include <cuda.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "peer_state.h"
#include "../settings.h"

namespace jfo {
namespace {

std::mutex g_node_mu;
int g_node_size = 0;                // 0: not configured (one process)
std::map<int, int> g_id_of_cuda;    // CUDA ordinal of this process -> id
std::map<int, int> g_cuda_of_id;    // id of this process's device -> CUDA ordinal
std::vector<std::string> g_labels;  // by id

}  // namespace

ffi::Error ConfigureNode(int node_size, const std::vector<std::pair<int, int>>& local,
                         const std::vector<std::string>& labels) {
  if (node_size < 1 || local.empty() || static_cast<int>(labels.size()) != node_size) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap: configure_node needs node_size >= 1 (got " +
        std::to_string(node_size) + "), this process's devices, and a label for every "
        "device of the node");
  }
  std::map<int, int> id_of_cuda, cuda_of_id;
  for (auto [cuda_ordinal, id] : local) {
    if (id < 0 || id >= node_size || !id_of_cuda.emplace(cuda_ordinal, id).second ||
        !cuda_of_id.emplace(id, cuda_ordinal).second) {
      return ffi::Error::InvalidArgument(
          "jax_flashoverlap: configure_node: CUDA device " + std::to_string(cuda_ordinal) +
          " -> id " + std::to_string(id) + " is out of range or listed twice");
    }
  }
  // Asked first: the transport's lock is taken before this file's, never after.
  const bool allocated = AnyDeviceState();
  std::lock_guard<std::mutex> lock(g_node_mu);
  if (g_node_size == node_size && g_id_of_cuda == id_of_cuda) return ffi::Error::Success();
  // The layout of every workspace counts the devices: it cannot change.
  if (allocated) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
        "jax_flashoverlap: the node transport must be set up before the first CUDA op of "
        "the process (this process already ran one, or set it up differently)");
  }
  g_node_size = node_size;
  g_id_of_cuda = std::move(id_of_cuda);
  g_cuda_of_id = std::move(cuda_of_id);
  g_labels = labels;
  return ffi::Error::Success();
}

int TransportId(int cuda_ordinal) {
  std::lock_guard<std::mutex> lock(g_node_mu);
  if (g_node_size == 0) return cuda_ordinal;
  auto it = g_id_of_cuda.find(cuda_ordinal);
  return it == g_id_of_cuda.end() ? -1 : it->second;
}

int CudaOrdinalOf(int id) {
  std::lock_guard<std::mutex> lock(g_node_mu);
  if (g_node_size == 0) return id;
  auto it = g_cuda_of_id.find(id);
  return it == g_cuda_of_id.end() ? -1 : it->second;
}

std::string DeviceLabel(int id) {
  std::lock_guard<std::mutex> lock(g_node_mu);
  if (g_node_size == 0 || id < 0 || id >= g_node_size) {
    return "CUDA device " + std::to_string(id);
  }
  return "device " + std::to_string(id) + " of the node (" + g_labels[id] + ")";
}

ffi::ErrorOr<int> TransportDeviceCount() {
  {
    std::lock_guard<std::mutex> lock(g_node_mu);
    if (g_node_size > 0) return g_node_size;
  }
  int count = 0;
  JFO_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  return count;
}

ffi::ErrorOr<std::pair<std::string, size_t>> ExportWorkspace(int id) {
  const int cuda_ordinal = CudaOrdinalOf(id);
  if (cuda_ordinal < 0) {
    return ffi::Error::InvalidArgument("jax_flashoverlap: export_workspace: " +
                                       DeviceLabel(id) + " is not this process's");
  }
  auto st = AllocatedDevice(id);
  if (st.has_error()) return st.error();
  DeviceGuard guard(cuda_ordinal);
  cudaIpcMemHandle_t handle;
  JFO_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, (*st)->workspace));
  return std::pair{std::string(handle.reserved, sizeof(handle.reserved)),
                   (*st)->workspace_bytes};
}

ffi::Error ImportWorkspace(int id, const std::string& handle, size_t bytes) {
  int local_cuda = -1, count = 0;
  {
    std::lock_guard<std::mutex> lock(g_node_mu);
    if (g_node_size == 0 || id < 0 || id >= g_node_size || g_cuda_of_id.count(id)) {
      return ffi::Error::InvalidArgument(
          "jax_flashoverlap: import_workspace: id " + std::to_string(id) +
          " is not another process's device of the configured node");
    }
    if (g_cuda_of_id.size() != 1) {
      // One context maps the handle; a second device of this process would
      // need peer access to a GPU it may not see.
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
          "jax_flashoverlap: groups across processes need one GPU per process; this "
          "process drives " + std::to_string(g_cuda_of_id.size()));
    }
    local_cuda = g_cuda_of_id.begin()->second;
    count = g_node_size;
  }
  cudaIpcMemHandle_t h;
  if (handle.size() != sizeof(h.reserved)) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap: import_workspace: a handle has " +
        std::to_string(sizeof(h.reserved)) + " bytes, got " + std::to_string(handle.size()));
  }
  const size_t own = GetSettings().workspace_mb << 20;
  if (bytes != own) {
    return ffi::Error::InvalidArgument(
        "jax_flashoverlap: " + DeviceLabel(id) + " has a workspace of " +
        std::to_string(bytes >> 20) + " MiB, this process " + std::to_string(own >> 20) +
        " MiB; set the same JAX_FLASHOVERLAP_WORKSPACE_MB in every process");
  }
  std::copy(handle.begin(), handle.end(), h.reserved);
  DeviceGuard guard(local_cuda);
  auto view = std::make_unique<DeviceState>();
  view->id = id;
  view->cuda_ordinal = -1;
  view->remote = true;
  view->num_devices = count;
  view->workspace_bytes = bytes;
  void* mapped = nullptr;
  JFO_CUDA_RETURN_IF_ERROR(
      cudaIpcOpenMemHandle(&mapped, h, cudaIpcMemLazyEnablePeerAccess));
  view->workspace = static_cast<char*>(mapped);
  ffi::Error laid_out = LayOutWorkspace(view.get());
  if (laid_out.success()) laid_out = AdoptRemoteDevice(std::move(view));
  if (laid_out.failure()) {
    cudaIpcCloseMemHandle(mapped);
    cudaGetLastError();
  }
  return laid_out;
}

bool PeerStoresAllowed(const void* ptr, const GroupSpec& group) {
  // Latched at the first call: every later call of this process takes the
  // same path (a setting changed mid-run does not switch protocols).
  static const bool disabled = !GetSettings().peer_stores;
  using GetAttributeFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
  static const GetAttributeFn get_attribute = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult query;
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", &fn, 12000,
                                         cudaEnableDefault,
                                         &query) != cudaSuccess ||
        query != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<GetAttributeFn>(fn);
  }();
  if (disabled || get_attribute == nullptr) return false;
  for (int id : group.ids) {
    if (CudaOrdinalOf(id) < 0) return false;
  }
  // XLA's allocators map their memory into every local GPU (virtual memory
  // with access set per device, or pools with peer access), but a user's
  // allocator need not: ask each peer's context, whose access the attribute
  // reports.
  for (int q = 0; q < group.n; ++q) {
    if (q == group.rank) continue;
    DeviceGuard on_peer(CudaOrdinalOf(group.ids[q]));
    unsigned int flags = 0;
    if (get_attribute(&flags, CU_POINTER_ATTRIBUTE_ACCESS_FLAGS,
                      reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS ||
        flags != CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE) {
      cudaGetLastError();
      return false;
    }
  }
  return true;
}

}  // namespace jfo
