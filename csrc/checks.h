// Input checks shared by every op. Each message names the op and the argument, says what was
// expected and what came, e.g.
//   dqn_ops.bf16_dueling_forward: states: expected shape [*, 96], got [256, 95]
#pragma once

#include <initializer_list>
#include <sstream>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace dqn_ops {

inline std::string shape_str(c10::IntArrayRef s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

// -1 in `expected` matches any size.
inline void check_shape(const at::Tensor& t, const char* op, const char* name, std::initializer_list<int64_t> expected) {
  bool ok = t.dim() == static_cast<int64_t>(expected.size());
  std::ostringstream e;
  e << "[";
  int64_t i = 0;
  for (int64_t s : expected) {
    if (ok && s >= 0 && t.size(i) != s) ok = false;
    e << (i ? ", " : "") << (s >= 0 ? std::to_string(s) : std::string("*"));
    ++i;
  }
  e << "]";
  TORCH_CHECK(ok, op, ": ", name, ": expected shape ", e.str(), ", got ", shape_str(t.sizes()));
}

inline void check_dtype(const at::Tensor& t, const char* op, const char* name, at::ScalarType expected) {
  TORCH_CHECK(t.scalar_type() == expected, op, ": ", name, ": expected dtype ", expected, ", got ", t.scalar_type());
}

inline void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, ": expected a contiguous tensor, got strides ",
              shape_str(t.strides()), " for shape ", shape_str(t.sizes()));
}

inline void check_device(const at::Tensor& t, const char* op, const char* name, const at::Device& expected) {
  TORCH_CHECK(t.device() == expected, op, ": ", name, ": expected a tensor on ", expected, ", got one on ", t.device());
}

// Vectorised loads and cuBLAS fast paths need the base pointer aligned; a view at an odd
// storage offset is rejected rather than silently slowed or misread.
inline void check_aligned(const at::Tensor& t, const char* op, const char* name, int64_t bytes) {
  const auto addr = reinterpret_cast<uintptr_t>(t.data_ptr());
  TORCH_CHECK(addr % bytes == 0, op, ": ", name, ": expected its data pointer aligned to ", bytes,
              " bytes, got an address with offset ", addr % bytes, " (a view at an unaligned storage offset?)");
}

inline void check_no_overlap(const at::Tensor& a, const char* name_a, const at::Tensor& b, const char* name_b, const char* op) {
  if (a.numel() == 0 || b.numel() == 0) return;
  const auto a0 = reinterpret_cast<uintptr_t>(a.data_ptr()), a1 = a0 + a.nbytes();
  const auto b0 = reinterpret_cast<uintptr_t>(b.data_ptr()), b1 = b0 + b.nbytes();
  TORCH_CHECK(a1 <= b0 || b1 <= a0, op, ": ", name_a, " and ", name_b, " must not share memory");
}

}  // namespace dqn_ops
