// Argument validation of fused_adam_bf16 and ema_update, shared by the CPU and CUDA kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "checks.h"

namespace dqn_ops {

constexpr const char* kAdamOp = "dqn_ops.fused_adam_bf16";
constexpr const char* kEmaOp = "dqn_ops.ema_update";

// A flat buffer of n elements of `dtype` on `device`, contiguous, 16-byte aligned on CUDA (float4 access).
inline void check_flat(const at::Tensor& t, const char* op, const char* name, int64_t n, const at::Device& device,
                       at::ScalarType dtype) {
  check_tensor(t, op, name, device, dtype, {n});
  if (t.is_cuda()) check_aligned(t, op, name, 16);
}

inline void check_scalar_tensor(const at::Tensor& t, const char* op, const char* name, const at::Device& device) {
  check_device(t, op, name, device);
  check_dtype(t, op, name, at::kFloat);
  DQN_CHECK(t.numel() == 1, op, ": ", name, ": expected a one-element tensor, got shape ", shape_str(t.sizes()));
  check_contiguous(t, op, name);
}

inline void check_adam_args(const at::Tensor& params, const at::Tensor& grads, const at::Tensor& exp_avg,
                            const at::Tensor& exp_avg_sq, const at::Tensor& params_bf16, const at::Tensor& step,
                            const at::Tensor& lr, double beta1, double beta2, double eps, double weight_decay,
                            const c10::optional<double>& max_grad_norm, const at::Tensor& grad_norm,
                            const at::Tensor& found_inf) {
  const char* op = kAdamOp;
  DQN_CHECK(params.dim() == 1, op, ": params: expected a flat 1-D tensor, got shape ", shape_str(params.sizes()));
  const int64_t n = params.numel();
  DQN_CHECK(n >= 1, op, ": params: expected at least 1 element, got 0");
  const at::Device dev = params.device();
  DQN_CHECK(dev.is_cpu() || dev.is_cuda(), op, ": params: expected a CPU or CUDA tensor, got one on ", dev);
  check_flat(params, op, "params", n, dev, at::kFloat);
  check_flat(grads, op, "grads", n, dev, at::kFloat);
  check_flat(exp_avg, op, "exp_avg", n, dev, at::kFloat);
  check_flat(exp_avg_sq, op, "exp_avg_sq", n, dev, at::kFloat);
  check_mirror_dtype(params_bf16, op, "params_bf16");
  check_flat(params_bf16, op, "params_bf16", n, dev, params_bf16.scalar_type());
  check_scalar_tensor(step, op, "step", dev);
  check_scalar_tensor(lr, op, "lr", dev);
  check_scalar_tensor(grad_norm, op, "grad_norm", dev);
  check_scalar_tensor(found_inf, op, "found_inf", dev);
  // No two arguments may share memory: the kernels write params, the moments, the mirror,
  // step, grad_norm and found_inf while reading the others (the CUDA update reads step and the
  // norm partials in every block while block 0 writes step), so any overlap, of two buffers,
  // of a scalar with a buffer or of two scalars, makes the result depend on the order of writes.
  const std::pair<const at::Tensor*, const char*> args[] = {
      {&params, "params"},   {&grads, "grads"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"},
      {&params_bf16, "params_bf16"}, {&step, "step"}, {&lr, "lr"}, {&grad_norm, "grad_norm"},
      {&found_inf, "found_inf"}};
  constexpr size_t kArgs = sizeof(args) / sizeof(args[0]);
  for (size_t i = 0; i < kArgs; ++i)
    for (size_t j = i + 1; j < kArgs; ++j)
      check_no_overlap(*args[i].first, args[i].second, *args[j].first, args[j].second, op);
  DQN_CHECK(beta1 >= 0 && beta1 < 1, op, ": beta1: expected a value in [0, 1), got ", std::to_string(beta1));
  DQN_CHECK(beta2 >= 0 && beta2 < 1, op, ": beta2: expected a value in [0, 1), got ", std::to_string(beta2));
  DQN_CHECK(eps > 0, op, ": eps: expected a positive value, got ", std::to_string(eps));
  DQN_CHECK(weight_decay >= 0, op, ": weight_decay: expected a non-negative value, got ", std::to_string(weight_decay));
  DQN_CHECK(!max_grad_norm.has_value() || *max_grad_norm > 0, op, ": max_grad_norm: expected None or a positive value, got ",
            std::to_string(max_grad_norm.value_or(0)));
}

inline void check_ema_args(const at::Tensor& target, const at::Tensor& target_bf16, const at::Tensor& online, double tau) {
  const char* op = kEmaOp;
  DQN_CHECK(target.dim() == 1, op, ": target: expected a flat 1-D tensor, got shape ", shape_str(target.sizes()));
  const int64_t n = target.numel();
  const at::Device dev = target.device();
  DQN_CHECK(dev.is_cpu() || dev.is_cuda(), op, ": target: expected a CPU or CUDA tensor, got one on ", dev);
  check_flat(target, op, "target", n, dev, at::kFloat);
  check_mirror_dtype(target_bf16, op, "target_bf16");
  check_flat(target_bf16, op, "target_bf16", n, dev, target_bf16.scalar_type());
  check_flat(online, op, "online", n, dev, at::kFloat);
  // target and target_bf16 are written while online is read: no two of the three may overlap.
  check_no_overlap(target, "target", online, "online", op);
  check_no_overlap(target, "target", target_bf16, "target_bf16", op);
  check_no_overlap(target_bf16, "target_bf16", online, "online", op);
  DQN_CHECK(tau >= 0 && tau <= 1, op, ": tau: expected a value in [0, 1], got ", std::to_string(tau));
}

}  // namespace dqn_ops
