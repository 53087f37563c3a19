// The Python extension `_nvshmem_ffi` (opt-in: CMake option
// JFO_ENABLE_NVSHMEM): NVSHMEM bootstrap for one process per GPU and the
// hierarchical (NVRAR) all-reduce handler. Separate from `_ffi`, so that the
// validated extension never depends on NVSHMEM. Used through
// jax_flashoverlap/nvshmem.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>

#include "nvshmem/state.h"

namespace nb = nanobind;

namespace {

nb::bytes GetUniqueId() {
  std::string id = jfo::nv::GetUniqueId();
  return nb::bytes(id.data(), id.size());
}

void Init(nb::bytes uid, int rank, int nranks, size_t heap_bytes, int device, bool hostlib,
          bool debug) {
  std::string id(static_cast<const char*>(uid.data()), uid.size());
  nb::gil_scoped_release release;  // collective: waits for the other processes
  jfo::nv::Init(id, rank, nranks, heap_bytes, device, hostlib, debug);
}

void Finalize() {
  nb::gil_scoped_release release;
  jfo::nv::Finalize();
}

nb::dict Info() {
  const jfo::nv::NvState& st = jfo::nv::State();
  nb::dict d;
  d["initialized"] = st.initialized;
  d["rank"] = st.rank;
  d["npes"] = st.npes;
  d["heap_bytes"] = st.heap_bytes;
  d["stripe_bytes"] = st.stripe_bytes;
  return d;
}

}  // namespace

NB_MODULE(_nvshmem_ffi, m) {
  m.doc() = "jax_flashoverlap NVSHMEM transport and hierarchical all-reduce (experimental)";
  m.def("get_unique_id", &GetUniqueId,
        "nvshmemx_get_uniqueid() as bytes (call on one process, share with all).");
  m.def("init", &Init, nb::arg("uid"), nb::arg("rank"), nb::arg("nranks"),
        nb::arg("heap_bytes"), nb::arg("device") = 0, nb::arg("hostlib") = true,
        nb::arg("debug") = false,
        "Collective: NVSHMEM init with the unique id (NVSHMEM_SYMMETRIC_SIZE = "
        "heap_bytes, NVLS off) and one allocation of the all-reduce buffers; "
        "hostlib: start through NVSHMEM's host library (else inline); debug: "
        "print each start-up step.");
  m.def("finalize", &Finalize, "Collective: frees the buffers, nvshmem_finalize().");
  m.def("info", &Info, "Dict: initialized, rank, npes, heap_bytes, stripe_bytes.");
  m.def("max_message_bytes", &jfo::nv::MaxMessageBytes, nb::arg("node_size"),
        "Largest all-reduce (bytes per PE) the buffers hold for this node size.");
  m.def("pending_error", &jfo::nv::TakePendingError,
        "Returns and clears a recorded wait timeout, or None.");
  m.def("registrations", []() {
    nb::dict d;
    d["jfo_nvshmem_all_reduce"] =
        nb::capsule(reinterpret_cast<void*>(jfo::JfoNvshmemAllReduce));
    return d;
  }, "Target name -> PyCapsule for jax.ffi.register_ffi_target(platform='CUDA').");
}
