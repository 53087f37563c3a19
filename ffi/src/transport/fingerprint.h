// A call's fingerprint: the op, its operands' dtypes and shapes, and the
// options that change what moves between the ranks. Counters alone pair the
// k-th call of one rank with the k-th call of its peer; ranks whose programs
// diverge (another shape, dtype or chunk count on one rank) would then sum
// each other's unrelated bytes. So every sender puts its call's fingerprint
// beside its data (Channel, the all-reduce kernels), and every receiver
// compares it with its own before it reads that data: a mismatch fails the
// call on each rank that sees it, with NaN outputs and a host error naming
// both calls, and marks the group failed.
//
// Header-only: the NVSHMEM module is built apart from the main extension
// and includes it too.
#pragma once

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>

#include "../common.h"

namespace jfo {

class CallFingerprint {
 public:
  explicit CallFingerprint(const char* op) : text_(op) {}

  // "x=bf16[512, 1024]"
  CallFingerprint& Buffer(const char* name, const Buffer_Type& b) {
    return Add(name, DtypeName(b.element_type()) + DimsToString(b));
  }
  CallFingerprint& Option(const char* name, int64_t value) {
    return Add(name, std::to_string(value));
  }
  CallFingerprint& Option(const char* name, I32Span values) {
    std::string s = "[";
    for (size_t i = 0; i < values.size(); ++i) {
      s += (i ? "," : "") + std::to_string(values[i]);
    }
    return Add(name, s + "]");
  }

  // A hash of the description (FNV-1a, folded to 32 bits). Never 0 (a
  // zeroed word means "nothing written") and no 16-bit half is 0x8000 (the
  // Lamport slots' empty pattern), so it can travel where data does.
  // Registers the description for DescribeFingerprint.
  uint32_t Seal() const {
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : text_) h = (h ^ c) * 0x100000001b3ull;
    uint32_t v = static_cast<uint32_t>(h ^ (h >> 32));
    if ((v & 0xffffu) == 0x8000u) v ^= 1u;
    if ((v >> 16) == 0x8000u) v ^= 1u << 16;
    if (v == 0) v = 1;
    if (v == 0xFFFFFFFFu) v = 0xFFFFFFFEu;  // kRefusedFingerprint (transport.h)
    Register(v, text_);
    return v;
  }

  const std::string& text() const { return text_; }

 private:
  CallFingerprint& Add(const char* name, const std::string& value) {
    text_ += std::string(" ") + name + "=" + value;
    return *this;
  }

  static std::string DtypeName(ffi::DataType t) {
    switch (t) {
      case ffi::DataType::BF16: return "bf16";
      case ffi::DataType::F16: return "f16";
      case ffi::DataType::F32: return "f32";
      case ffi::DataType::F64: return "f64";
      case ffi::DataType::S32: return "s32";
      default: return "dtype" + std::to_string(static_cast<int>(t));
    }
  }

  // Descriptions of the fingerprints this process made, for messages; a
  // bounded table (a program makes few distinct calls).
  static std::mutex& RegistryMutex() {
    static std::mutex mu;
    return mu;
  }
  static std::unordered_map<uint32_t, std::string>& Registry() {
    static std::unordered_map<uint32_t, std::string> table;
    return table;
  }
  static void Register(uint32_t value, const std::string& text) {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto& table = Registry();
    if (table.size() < 4096 && table.find(value) == table.end()) table.emplace(value, text);
  }

  friend std::string DescribeFingerprint(uint32_t value);
  std::string text_;
};

// "all_reduce x=bf16[4096] ... (fingerprint 0x1234abcd)", or, for a call
// this process never made (a peer process's), only the fingerprint.
inline std::string DescribeFingerprint(uint32_t value) {
  char hex[32];
  std::snprintf(hex, sizeof(hex), "fingerprint 0x%08x", value);
  std::lock_guard<std::mutex> lock(CallFingerprint::RegistryMutex());
  const auto& table = CallFingerprint::Registry();
  auto it = table.find(value);
  if (it == table.end()) return std::string("a call with ") + hex + " (not made in this process)";
  return it->second + " (" + hex + ")";
}

}  // namespace jfo
