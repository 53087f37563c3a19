// A decode step through every block of Mamba-2, as one kernel (bf16, at
// most kMaxBatch rows, one GPU).
//
// XLA runs a Mamba-2 decode block as a dozen kernels: the norm, in_proj's
// GEMM, the convolution and its window's shift, the SSM state's update, the
// gated norm, out_proj's GEMM. On one H100 the 1.3B model's step took 2.2x
// the time its weights take to read. Here one persistent kernel (a CTA per
// SM, co-resident by a cooperative launch) runs each block as three stages:
//
//   A  RMSNorm, x @ W_in                       (16-column items)
//   B  per (batch row, head): the causal convolution of its x, B and C
//      channels, SiLU, the step size, the SSM state's update in place,
//      y = state . C + D x, and y * silu(z)
//   C  the gated RMSNorm, x += . @ W_out         (16-column items)
//
// Each stage polls the previous one's outputs (per-layer buffers, filled
// with an empty mark at the launch's start) and the weights stream through
// a ring of shared-memory slots by TMA bulk copies: the machinery of the
// Transformer decode kernel (transformer_decode/), whose header comments
// say how. The convolution's state is a ring of conv_width rows, position
// t's inputs in row t mod conv_width (models.mamba_decode_pallas): a step
// reads the other rows and writes its own, which no item reads.
//
// Every wait is bounded: a poll, count or copy that does not complete
// within timeout_ms prints which CTA and layer waited and traps, so the
// step ends in a CUDA error, never in wrong numbers.
#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "common.h"
#include "handlers.h"
#include "mamba_decode/kernel.cuh"
#include "transformer_decode/launch.cuh"

namespace jfo {
namespace {

using namespace mamba_decode;  // NOLINT: this file is the op built on them
using transformer_decode::AlignUp;
using transformer_decode::kAllOptions;
using transformer_decode::kControlBytes;
using transformer_decode::kMaxColumns;
using transformer_decode::kMinChunkBytes;
using transformer_decode::WeightStage;

const std::string kOp = "jax_flashoverlap mamba_decode: ";

ffi::Error Invalid(const std::string& what) { return ffi::Error::InvalidArgument(kOp + what); }

bool Is(const ffi::AnyBuffer& b, ffi::DataType type, std::initializer_list<int64_t> dims) {
  const auto have = b.dimensions();
  if (b.element_type() != type || have.size() != dims.size()) return false;
  size_t i = 0;
  for (const int64_t want : dims) {
    if (have[i++] != want) return false;
  }
  return true;
}

std::string Dims(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  for (const int64_t v : dims) s += (s.size() > 1 ? ", " : "") + std::to_string(v);
  return s + "]";
}

int64_t Padded(int64_t n) { return (n + kItemColumns - 1) / kItemColumns * kItemColumns; }

WeightStage StageOf(const ffi::AnyBuffer& w, int chunk_bytes) {
  const auto dims = w.dimensions();  // [layers, items, k, kItemColumns]
  return transformer_decode::WeightStageOf(w.untyped_data(), dims[1], dims[2], kItemColumns,
                                           chunk_bytes);
}

struct Launch {
  MambaParams m = {};
  size_t shared = 0;
  int grid = 0;
};

struct Attrs {
  int32_t heads, groups;
  float eps;
  int32_t timeout_ms, chunk_bytes, ring_slots, options, schedule, trace;
};

ffi::ErrorOr<Launch> Plan(cudaStream_t stream, int device, const Attrs& a,
                          const ffi::AnyBuffer& x, const ffi::AnyBuffer& pos,
                          const ffi::AnyBuffer& norm, const ffi::AnyBuffer& in_proj,
                          const ffi::AnyBuffer& out_proj, const ffi::AnyBuffer& conv_weight,
                          const ffi::AnyBuffer& conv_bias, const ffi::AnyBuffer& dt_bias,
                          const ffi::AnyBuffer& a_log, const ffi::AnyBuffer& d_skip,
                          const ffi::AnyBuffer& gate_norm, ffi::RemainingArgs& states_in,
                          ffi::AnyBuffer& x_out, ffi::AnyBuffer& workspace,
                          ffi::RemainingRets& states_out) {
  const auto xd = x.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || xd.size() != 2) {
    return Invalid("x must be bf16 [batch, d], got " + DimsToString(x));
  }
  const int64_t batch = xd[0], d = xd[1];
  const auto nd = norm.dimensions();
  if (norm.element_type() != ffi::DataType::F32 || nd.size() != 2 || nd[1] != d) {
    return Invalid("the norms' weights must be float32 [layers, d], got " + DimsToString(norm));
  }
  const int64_t layers = nd[0], heads = a.heads, groups = a.groups;
  if (batch < 1 || batch > kMaxBatch || layers < 1 || layers > kMaxLayers || heads < 1 ||
      groups < 1 || groups > kMaxGroups || heads % groups || d % kItemColumns ||
      pos.element_type() != ffi::DataType::S32 || pos.element_count() != 1 || a.timeout_ms < 1) {
    return Invalid("needs 1 <= batch <= " + std::to_string(kMaxBatch) + ", 1 <= layers <= " +
                   std::to_string(kMaxLayers) + ", heads a multiple of groups (at most " +
                   std::to_string(kMaxGroups) + "), d a multiple of " +
                   std::to_string(kItemColumns) + ", an int32 position and timeout_ms >= 1");
  }
  if (states_in.size() != static_cast<size_t>(2 * layers) || states_out.size() != states_in.size()) {
    return Invalid("expected a convolution and an SSM state per layer");
  }
  auto first_conv = states_in.get<ffi::AnyBuffer>(0);
  auto first_ssm = states_in.get<ffi::AnyBuffer>(1);
  if (first_conv.has_error()) return first_conv.error();
  if (first_ssm.has_error()) return first_ssm.error();
  const auto cd = first_conv->dimensions(), sd = first_ssm->dimensions();
  if (cd.size() != 3 || sd.size() != 5 || cd[1] != batch || sd[0] != batch || sd[1] != groups ||
      sd[2] != heads / groups) {
    return Invalid("the states must be conv [width, batch, channels] and ssm [batch, groups, "
                   "heads / groups, head_dim, state] per layer, got " +
                   DimsToString(*first_conv) + " and " + DimsToString(*first_ssm));
  }
  const int64_t width = cd[0], head_dim = sd[3], n = sd[4], inner = heads * head_dim;
  const int64_t channels = groups * ((heads / groups) * head_dim + 2 * n);
  if (cd[2] != channels || width < 2 || width > kMaxConvWidth) {
    return Invalid("the convolution's state must be [width <= " + std::to_string(kMaxConvWidth) +
                   ", batch, " + std::to_string(channels) + "], got " + DimsToString(*first_conv));
  }
  // Thread t of a mixer item: channel t / (n / S), S state entries.
  const int64_t per_thread = std::max<int64_t>(1, head_dim * n / kThreads);
  const int64_t sharers = n / per_thread;
  if (n % per_thread || per_thread > kMaxStatePerThread || (per_thread & (per_thread - 1)) ||
      sharers > 32 || (sharers & (sharers - 1)) || (head_dim * sharers) % 32 ||
      head_dim * sharers > kThreads || inner % groups || (inner / groups) % 8) {
    return Invalid("head_dim " + std::to_string(head_dim) + " and state " + std::to_string(n) +
                   " do not fit a mixer item (powers of two, head_dim * state at most " +
                   std::to_string(kThreads * kMaxStatePerThread) + ")");
  }
  const int64_t in_columns = 2 * Padded(inner) + 2 * Padded(groups * n) + Padded(heads);
  if (!Is(in_proj, ffi::DataType::BF16, {layers, in_columns / kItemColumns, d, kItemColumns})) {
    return Invalid("in_proj must be bf16 " +
                   Dims({layers, in_columns / kItemColumns, d, kItemColumns}) +
                   " (models.mamba_decode_cuda.prepare_weights), got " + DimsToString(in_proj));
  }
  if (!Is(out_proj, ffi::DataType::BF16, {layers, d / kItemColumns, inner, kItemColumns})) {
    return Invalid("out_proj must be bf16 " +
                   Dims({layers, d / kItemColumns, inner, kItemColumns}) + ", got " +
                   DimsToString(out_proj));
  }
  auto check = [](const ffi::AnyBuffer& b, const char* name,
                  std::initializer_list<int64_t> dims) -> ffi::Error {
    if (Is(b, ffi::DataType::F32, dims)) return ffi::Error::Success();
    return Invalid(std::string(name) + " must be float32 " + Dims(dims) + ", got " +
                   DimsToString(b));
  };
  JFO_RETURN_IF_ERROR(check(conv_weight, "conv_weight", {layers, width, channels}));
  JFO_RETURN_IF_ERROR(check(conv_bias, "conv_bias", {layers, channels}));
  JFO_RETURN_IF_ERROR(check(dt_bias, "dt_bias", {layers, heads}));
  JFO_RETURN_IF_ERROR(check(a_log, "a_log", {layers, heads}));
  JFO_RETURN_IF_ERROR(check(d_skip, "d_skip", {layers, heads}));
  JFO_RETURN_IF_ERROR(check(gate_norm, "gate_norm", {layers, inner}));
  if (a.chunk_bytes < kMinChunkBytes || a.chunk_bytes % kMinChunkBytes ||
      a.chunk_bytes > (1 << 20)) {
    return Invalid("chunk_bytes must be a multiple of " + std::to_string(kMinChunkBytes) +
                   " up to 1 MiB");
  }
  if (a.options & ~kAllOptions || !(a.options & transformer_decode::kPolledHandoffs)) {
    return Invalid("options must include polled handoffs (64) and no unknown bit, got " +
                   std::to_string(a.options));
  }
  if (a.schedule & ~kAllSchedule || a.trace < 0 || a.trace > 1) {
    return Invalid("schedule takes bits " + std::to_string(kAllSchedule) +
                   " and trace 0 or 1; got " + std::to_string(a.schedule) + " and " +
                   std::to_string(a.trace));
  }

  Launch launch;
  MambaParams& m = launch.m;
  Params& p = m.core;
  p.layers = static_cast<int>(layers);
  p.batch = static_cast<int>(batch);
  p.d = static_cast<int>(d);
  p.chunk_bytes = a.chunk_bytes;
  p.options = a.options;
  p.eps = a.eps;
  p.timeout_ns = static_cast<uint64_t>(a.timeout_ms) * 1000000ull;
  p.exchange.ranks = 1;
  p.x_in = static_cast<const __nv_bfloat16*>(x.untyped_data());
  p.pos = static_cast<const int32_t*>(pos.untyped_data());
  p.attn_norm = static_cast<const float*>(norm.untyped_data());
  p.stages[0] = StageOf(in_proj, a.chunk_bytes);
  p.stages[1] = StageOf(out_proj, a.chunk_bytes);
  if (!Is(x_out, ffi::DataType::BF16, {batch, d})) {
    return Invalid("x_out must be bf16 [batch, d], got " + DimsToString(x_out));
  }
  p.x_out = static_cast<__nv_bfloat16*>(x_out.untyped_data());
  m.inner = static_cast<int>(inner);
  m.heads = static_cast<int>(heads);
  m.head_dim = static_cast<int>(head_dim);
  m.state = static_cast<int>(n);
  m.groups = static_cast<int>(groups);
  m.conv_width = static_cast<int>(width);
  m.state_per_thread = static_cast<int>(per_thread);
  m.x_at = 0;
  m.b_at = static_cast<int>(Padded(inner));
  m.c_at = m.b_at + static_cast<int>(Padded(groups * n));
  m.dt_at = m.c_at + static_cast<int>(Padded(groups * n));
  m.z_at = m.dt_at + static_cast<int>(Padded(heads));
  m.in_columns = static_cast<int>(in_columns);
  m.conv_weight = static_cast<const float*>(conv_weight.untyped_data());
  m.conv_bias = static_cast<const float*>(conv_bias.untyped_data());
  m.dt_bias = static_cast<const float*>(dt_bias.untyped_data());
  m.a_log = static_cast<const float*>(a_log.untyped_data());
  m.d_skip = static_cast<const float*>(d_skip.untyped_data());
  m.gate_norm = static_cast<const float*>(gate_norm.untyped_data());
  for (int64_t i = 0; i < 2 * layers; ++i) {
    auto in_buffer = states_in.get<ffi::AnyBuffer>(i);
    auto out_buffer = states_out.get<ffi::AnyBuffer>(i);
    if (in_buffer.has_error()) return in_buffer.error();
    if (out_buffer.has_error()) return out_buffer.error();
    const bool conv = i % 2 == 0;
    const auto& first = conv ? *first_conv : *first_ssm;
    const auto type = conv ? ffi::DataType::BF16 : ffi::DataType::F32;
    const auto fd = first.dimensions(), id = in_buffer->dimensions(),
               od = (*out_buffer)->dimensions();
    if (in_buffer->element_type() != type || (*out_buffer)->element_type() != type ||
        !std::equal(fd.begin(), fd.end(), id.begin(), id.end()) ||
        !std::equal(fd.begin(), fd.end(), od.begin(), od.end())) {
      return Invalid("state " + std::to_string(i) + " is " + DimsToString(*in_buffer) +
                     (conv ? ", expected bf16 " : ", expected float32 ") + DimsToString(first));
    }
    void* data = (*out_buffer)->untyped_data();
    if (data != in_buffer->untyped_data()) {
      // Not aliased (XLA could not donate it): start from the input's contents.
      JFO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(data, in_buffer->untyped_data(),
                                               in_buffer->size_bytes(),
                                               cudaMemcpyDeviceToDevice, stream));
    }
    if (conv) {
      m.states[i / 2].conv = static_cast<__nv_bfloat16*>(data);
    } else {
      m.states[i / 2].ssm = static_cast<float*>(data);
    }
  }

  const size_t handoff_bytes =
      AlignUp(static_cast<size_t>(layers) * batch * (in_columns + inner + d) * 2, 256);
  const size_t trace_bytes = a.trace ? static_cast<size_t>(layers) *
                                           transformer_decode::kMaxTraceCtas *
                                           transformer_decode::kTraceEvents * 8
                                     : 0;
  const size_t need = kControlBytes + handoff_bytes + trace_bytes;
  if (workspace.size_bytes() < need) {
    return Invalid("the workspace holds " + std::to_string(workspace.size_bytes()) + " bytes, " +
                   std::to_string(need) + " needed");
  }
  auto* base = static_cast<unsigned char*>(workspace.untyped_data());
  p.barrier = reinterpret_cast<unsigned*>(base);
  p.cleared = p.barrier + 16;
  p.handoffs = reinterpret_cast<__nv_bfloat16*>(base + kControlBytes);
  p.handoff_bytes = handoff_bytes;
  p.trace = trace_bytes ? reinterpret_cast<unsigned long long*>(base + kControlBytes +
                                                                handoff_bytes)
                        : nullptr;
  m.schedule = a.schedule;

  const DeviceInfo info = DeviceInfoOf(device);
  if (info.major < 9) return Invalid("needs a Hopper or later GPU (TMA bulk copies)");
  // Shared memory: the ring with what the rest leaves.
  const size_t operand =
      AlignUp(static_cast<size_t>(std::max(d, inner) + kOperandPad) * batch * 2, 128);
  const size_t reduce = static_cast<size_t>(kWarps) * batch * kMaxColumns * 4;
  const size_t result = static_cast<size_t>(batch) * kMaxColumns * 4;
  const size_t scalars =
      AlignUp(std::max<size_t>((kWarps + 1) * kMaxBatch + 4, (kWarps + 1) * batch * groups) * 4,
              16);
  const size_t mixer = AlignUp(static_cast<size_t>(head_dim + 2 * n + 2) * 4, 16);
  const size_t fixed = operand + reduce + result + scalars + mixer;
  const size_t budget = static_cast<size_t>(info.max_shared);
  const int fit = static_cast<int>(std::min<size_t>(
      16, budget > fixed ? (budget - fixed) / (a.chunk_bytes + 8) : 0));
  if (fit < 2) return Invalid("these shapes leave no shared memory for the weights' ring");
  if (a.ring_slots < 0 || a.ring_slots == 1 || a.ring_slots > fit) {
    return Invalid("ring_slots must be 0 (as many as fit) or 2 to " + std::to_string(fit) +
                   " at these shapes, got " + std::to_string(a.ring_slots));
  }
  p.ring_slots = a.ring_slots ? a.ring_slots : fit;
  size_t at = static_cast<size_t>(p.ring_slots) * a.chunk_bytes;
  p.operand_offset = static_cast<int>(at);
  at += operand;
  p.reduce_offset = static_cast<int>(at);
  at += reduce;
  p.result_offset = static_cast<int>(at);
  at += result;
  p.scalar_offset = static_cast<int>(at);
  at += scalars;
  m.mixer_offset = static_cast<int>(at);
  at += mixer;
  p.mbar_offset = static_cast<int>(at);
  at += static_cast<size_t>(p.ring_slots) * 8;
  launch.shared = at;
  launch.grid = info.sms;
  if (p.trace && launch.grid > transformer_decode::kMaxTraceCtas) {
    return Invalid("a trace holds " + std::to_string(transformer_decode::kMaxTraceCtas) +
                   " CTAs; this GPU runs " + std::to_string(launch.grid));
  }
  if (a.schedule & kBalancedItems) {
    // out_proj's and the mixer's items start past the CTAs that take one
    // more in_proj item than the rest.
    p.stages[1].first_cta = p.stages[0].items % launch.grid;
  }
  JFO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(base, 0, kControlBytes, stream));
  if (p.trace) JFO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.trace, 0, trace_bytes, stream));

  return launch;
}

template <int B, int S>
ffi::Error LaunchAs(cudaStream_t stream, int device, const Launch& launch) {
  return transformer_decode::LaunchPersistent(kOp.c_str(), MambaDecodeKernel<B, S>, launch.m,
                                              stream, device, launch.grid, kThreads,
                                              launch.shared, /*cooperative=*/true);
}

template <int B>
ffi::Error LaunchBatch(cudaStream_t stream, int device, const Launch& launch) {
  switch (launch.m.state_per_thread) {
    case 1: return LaunchAs<B, 1>(stream, device, launch);
    case 2: return LaunchAs<B, 2>(stream, device, launch);
    case 4: return LaunchAs<B, 4>(stream, device, launch);
    case 8: return LaunchAs<B, 8>(stream, device, launch);
    case 16: return LaunchAs<B, 16>(stream, device, launch);
    case 32: return LaunchAs<B, 32>(stream, device, launch);
    default: return LaunchAs<B, 64>(stream, device, launch);
  }
}

ffi::Error MambaDecodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer pos,
                           ffi::AnyBuffer norm, ffi::AnyBuffer in_proj, ffi::AnyBuffer out_proj,
                           ffi::AnyBuffer conv_weight, ffi::AnyBuffer conv_bias,
                           ffi::AnyBuffer dt_bias, ffi::AnyBuffer a_log, ffi::AnyBuffer d_skip,
                           ffi::AnyBuffer gate_norm, ffi::RemainingArgs states_in,
                           ffi::Result<ffi::AnyBuffer> x_out,
                           ffi::Result<ffi::AnyBuffer> workspace, ffi::RemainingRets states_out,
                           int32_t heads, int32_t groups, float eps, int32_t timeout_ms,
                           int32_t chunk_bytes, int32_t ring_slots, int32_t options,
                           int32_t schedule, int32_t trace) {
  const Attrs attrs{heads,      groups,  eps,      timeout_ms, chunk_bytes,
                    ring_slots, options, schedule, trace};
  int device = 0;
  JFO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  JFO_ASSIGN_OR_RETURN(const Launch launch,
                       Plan(stream, device, attrs, x, pos, norm, in_proj, out_proj, conv_weight,
                            conv_bias, dt_bias, a_log, d_skip, gate_norm, states_in, *x_out,
                            *workspace, states_out));
  switch (launch.m.core.batch) {
    case 1: return LaunchBatch<1>(stream, device, launch);
    case 2: return LaunchBatch<2>(stream, device, launch);
    case 3: return LaunchBatch<3>(stream, device, launch);
    default: return LaunchBatch<4>(stream, device, launch);
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfoMambaDecode, MambaDecodeImpl,
    ffi::Ffi::Bind()
        .Ctx<FFI_Stream_Type>()
        .Arg<ffi::AnyBuffer>()  // x [batch, d] bf16: the blocks' input
        .Arg<ffi::AnyBuffer>()  // pos: int32 scalar, this token's position
        .Arg<ffi::AnyBuffer>()  // the blocks' norms' weights [layers, d] float32
        .Arg<ffi::AnyBuffer>()  // in_proj [layers, in_columns / 16, d, 16] bf16
        .Arg<ffi::AnyBuffer>()  // out_proj [layers, d / 16, inner, 16] bf16
        .Arg<ffi::AnyBuffer>()  // conv_weight [layers, width, channels] float32
        .Arg<ffi::AnyBuffer>()  // conv_bias [layers, channels] float32
        .Arg<ffi::AnyBuffer>()  // dt_bias [layers, heads] float32
        .Arg<ffi::AnyBuffer>()  // a_log [layers, heads] float32
        .Arg<ffi::AnyBuffer>()  // d_skip [layers, heads] float32
        .Arg<ffi::AnyBuffer>()  // the gated norms' weights [layers, inner] float32
        .RemainingArgs()        // conv [width, batch, channels] bf16, ssm [batch, g, heads/g, p, n] f32, per layer
        .Ret<ffi::AnyBuffer>()  // x [batch, d] bf16: the blocks' output
        .Ret<ffi::AnyBuffer>()  // workspace (u8)
        .RemainingRets()        // the states, aliased to the inputs
        .Attr<int32_t>("heads")
        .Attr<int32_t>("groups")
        .Attr<float>("eps")
        .Attr<int32_t>("timeout_ms")
        .Attr<int32_t>("chunk_bytes")
        .Attr<int32_t>("ring_slots")
        .Attr<int32_t>("options")
        .Attr<int32_t>("schedule")  // kAllSchedule's bits (mamba_decode/kernel.cuh)
        .Attr<int32_t>("trace"));   // 1: each CTA's clocks after the handoffs

}  // namespace jfo
