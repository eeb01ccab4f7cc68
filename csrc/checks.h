// Input checks shared by every op. Each message names the op and the argument, says what was
// expected and what came, e.g.
//   dqn_ops.bf16_dueling_forward: states: expected shape [*, 96], got [256, 95]
//
// Messages are built by string concatenation, never with iostreams: TORCH_CHECK with several
// arguments formats them through a std::ostringstream instantiated inside this extension,
// and with the device machine's toolchain (a newer g++ than the libstdc++ torch loads) that
// crashed in std::codecvt on the first error raised. DQN_CHECK hands TORCH_CHECK a single
// std::string, which it passes through untouched.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

namespace dqn_ops {
namespace detail {
inline void append(std::string& out, const char* s) { out += s; }
inline void append(std::string& out, const std::string& s) { out += s; }
inline void append(std::string& out, std::string_view s) { out.append(s.data(), s.size()); }
inline void append(std::string& out, c10::ScalarType t) { out += c10::toString(t); }
inline void append(std::string& out, const c10::Device& d) { out += d.str(); }
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
inline void append(std::string& out, T v) { out += std::to_string(v); }
}  // namespace detail

template <typename... Args>
std::string cat(const Args&... args) {
  std::string out;
  (detail::append(out, args), ...);
  return out;
}

#define DQN_CHECK(cond, ...) TORCH_CHECK(cond, ::dqn_ops::cat(__VA_ARGS__))

inline std::string shape_str(c10::IntArrayRef s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += cat(i ? ", " : "", s[i]);
  return o + "]";
}

// -1 in `expected` matches any size.
inline void check_shape(const at::Tensor& t, const char* op, const char* name, std::initializer_list<int64_t> expected) {
  bool ok = t.dim() == static_cast<int64_t>(expected.size());
  std::string e = "[";
  int64_t i = 0;
  for (int64_t s : expected) {
    if (ok && s >= 0 && t.size(i) != s) ok = false;
    e += cat(i ? ", " : "", s >= 0 ? std::to_string(s) : std::string("*"));
    ++i;
  }
  e += "]";
  DQN_CHECK(ok, op, ": ", name, ": expected shape ", e, ", got ", shape_str(t.sizes()));
}

inline void check_dtype(const at::Tensor& t, const char* op, const char* name, at::ScalarType expected) {
  DQN_CHECK(t.scalar_type() == expected, op, ": ", name, ": expected dtype ", expected, ", got ", t.scalar_type());
}

// A mirror the optimizer-side ops write beside F32 params: BF16, or on the CPU F32 (the unrounded
// reference path: the network's forward then rounds nothing; DuelingBranchQNet's mirror_dtype).
inline void check_mirror_dtype(const at::Tensor& t, const char* op, const char* name) {
  DQN_CHECK(t.scalar_type() == at::kBFloat16 || (t.device().is_cpu() && t.scalar_type() == at::kFloat), op, ": ",
            name, ": expected dtype BFloat16 (or Float on the CPU), got ", t.scalar_type(), " on ", t.device());
}

inline void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  DQN_CHECK(t.is_contiguous(), op, ": ", name, ": expected a contiguous tensor, got strides ",
              shape_str(t.strides()), " for shape ", shape_str(t.sizes()));
}

inline void check_device(const at::Tensor& t, const char* op, const char* name, const at::Device& expected) {
  DQN_CHECK(t.device() == expected, op, ": ", name, ": expected a tensor on ", expected, ", got one on ", t.device());
}

// The four checks every dense input of a kernel needs, in the order their messages come.
inline void check_tensor(const at::Tensor& t, const char* op, const char* name, const at::Device& device,
                         at::ScalarType dtype, std::initializer_list<int64_t> shape) {
  check_device(t, op, name, device);
  check_dtype(t, op, name, dtype);
  check_shape(t, op, name, shape);
  check_contiguous(t, op, name);
}

// Vectorised loads and cuBLAS fast paths need the base pointer aligned; a view at an odd
// storage offset is rejected rather than silently slowed or misread.
inline void check_aligned(const at::Tensor& t, const char* op, const char* name, int64_t bytes) {
  const auto addr = reinterpret_cast<uintptr_t>(t.data_ptr());
  DQN_CHECK(addr % bytes == 0, op, ": ", name, ": expected its data pointer aligned to ", bytes,
              " bytes, got an address with offset ", addr % bytes, " (a view at an unaligned storage offset?)");
}

inline void check_no_overlap(const at::Tensor& a, const char* name_a, const at::Tensor& b, const char* name_b, const char* op) {
  if (a.numel() == 0 || b.numel() == 0) return;
  const auto a0 = reinterpret_cast<uintptr_t>(a.data_ptr()), a1 = a0 + a.nbytes();
  const auto b0 = reinterpret_cast<uintptr_t>(b.data_ptr()), b1 = b0 + b.nbytes();
  DQN_CHECK(a1 <= b0 || b1 <= a0, op, ": ", name_a, " and ", name_b, " must not share memory");
}

}  // namespace dqn_ops
