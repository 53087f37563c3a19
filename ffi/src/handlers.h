// The XLA FFI handler symbols the Python module registers.
#pragma once

#include <string>

#include "common.h"

namespace jfo {

XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoScale);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoDecodeMatmul);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoTransformerDecode);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoMambaDecode);
// The decode kernel's tensor groups: the timeouts their ranks reported, one
// line each, or "" (until ResetTransformerDecode); and their receive areas
// as made, once each device is idle: "" or why not.
std::string TransformerDecodeFailures();
std::string ResetTransformerDecode();

#ifdef JFO_WITH_CUBLASLT
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoAllGatherMatmulInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoAllGatherMatmul);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoMatmulReduceScatterInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoMatmulReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoMatmulAllReduceInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoMatmulAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoAllReduceInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoAllReduceCopyEngineInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfoAllReduceCopyEngine);
// Host-side calls of the all-reduce execute handler so far: a test sees a
// call captured into a CUDA graph replay without its host code running.
uint64_t AllReduceHostCalls();
// Host-side two-shot calls whose peers store the result straight into this
// device's y (the rest gather through the receive slots).
uint64_t AllReduceDirectGathers();
#endif

}  // namespace jfo
