// Argument validation of record_step, shared by the CPU and CUDA kernels.
#pragma once

#include <utility>

#include <ATen/ATen.h>

#include "checks.h"

namespace dqn_ops {

constexpr const char* kRecordOp = "dqn_ops.record_step";
constexpr int kMaxRecordValues = 8;

// ring [interval, F] F32, slot [1] int64 (the next row), flag [1] F32 (sticky), values: F
// one-element F32 tensors, non_finite: one element F32, all on one device; host_flag [1] F32 on
// the CPU, pinned when the others are on CUDA (the kernel writes it through its mapping into the
// device's address space, so the host reads the flag with no copy and no CUDA call).
inline void check_record_args(const at::Tensor& ring, const at::Tensor& slot, const at::Tensor& flag,
                              at::TensorList values, const at::Tensor& non_finite,
                              const c10::optional<at::Tensor>& host_flag) {
  const char* op = kRecordOp;
  const at::Device dev = ring.device();
  check_tensor(ring, op, "ring", dev, at::kFloat, {-1, -1});
  DQN_CHECK(ring.size(0) >= 1, op, ": ring: expected at least one row, got shape ", shape_str(ring.sizes()));
  check_tensor(slot, op, "slot", dev, at::kLong, {1});
  check_tensor(flag, op, "flag", dev, at::kFloat, {1});
  DQN_CHECK(static_cast<int64_t>(values.size()) == ring.size(1), op, ": values: expected ", ring.size(1),
            " tensors (one per ring column), got ", values.size());
  DQN_CHECK(values.size() <= static_cast<size_t>(kMaxRecordValues), op, ": at most ", kMaxRecordValues,
            " values, got ", values.size());
  for (const at::Tensor& v : values) {
    check_device(v, op, "values[i]", dev);
    check_dtype(v, op, "values[i]", at::kFloat);
    DQN_CHECK(v.numel() == 1, op, ": values[i]: expected one element, got shape ", shape_str(v.sizes()));
  }
  check_device(non_finite, op, "non_finite", dev);
  check_dtype(non_finite, op, "non_finite", at::kFloat);
  DQN_CHECK(non_finite.numel() == 1, op, ": non_finite: expected one element, got shape ",
            shape_str(non_finite.sizes()));
  check_no_overlap(ring, "ring", slot, "slot", op);
  check_no_overlap(ring, "ring", flag, "flag", op);
  check_no_overlap(slot, "slot", flag, "flag", op);
  // the kernel writes the ring row before it reads the later values and non_finite
  const std::pair<const char*, const at::Tensor*> written[] = {{"ring", &ring}, {"slot", &slot}, {"flag", &flag}};
  for (const auto& [name, w] : written) {
    for (const at::Tensor& v : values) check_no_overlap(*w, name, v, "values[i]", op);
    check_no_overlap(*w, name, non_finite, "non_finite", op);
  }
  if (host_flag.has_value()) {
    check_tensor(*host_flag, op, "host_flag", at::Device(at::kCPU), at::kFloat, {1});
    DQN_CHECK(dev.is_cpu() || host_flag->is_pinned(), op, ": host_flag: expected pinned memory (the ", dev,
              " kernel writes it), got pageable memory: make it with torch.zeros(1, pin_memory=True)");
    if (dev.is_cpu()) {
      check_no_overlap(*host_flag, "host_flag", flag, "flag", op);
      check_no_overlap(*host_flag, "host_flag", ring, "ring", op);
      check_no_overlap(*host_flag, "host_flag", slot, "slot", op);
    }
  }
}

// torch.maximum's rule: NaN if either is NaN.
template <typename T>
C10_HOST_DEVICE inline T max_propagating_nan(T a, T b) {
  return (a != a || b != b) ? (a != a ? a : b) : (a > b ? a : b);
}

}  // namespace dqn_ops
