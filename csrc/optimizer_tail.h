// _adam_spectral_norm_ema's checks and its composition of three public ops, shared by the CPU
// kernel and the CUDA kernel's fallback (csrc/cuda/spectral_norm.cu fuses them where it can).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include "optim_args.h"
#include "spectral_args.h"

namespace dqn_ops {

constexpr const char* kOptimizerTailOp = "dqn_ops._adam_spectral_norm_ema";

// The three ops' own checks, and no memory shared between the buffers only one of them uses:
// fused, Adam's moments and scalars, the spectral norm's vectors and the EMA's target are read and
// written at once. (params and its mirror are the ones they share.)
inline std::vector<SpectralMatrix> check_optimizer_tail_args(
    const at::Tensor& params, const at::Tensor& grads, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
    const at::Tensor& params_bf16, const at::Tensor& step, const at::Tensor& lr, double beta1, double beta2,
    double adam_eps, double weight_decay, const c10::optional<double>& max_grad_norm, const at::Tensor& grad_norm,
    const at::Tensor& found_inf, const at::Tensor& u, const at::Tensor& v, const at::Tensor& sigma,
    c10::IntArrayRef matrices, c10::ArrayRef<double> sigma_max, int64_t n_power_iterations, double spectral_eps,
    const at::Tensor& target, const at::Tensor& target_bf16, double tau) {
  check_adam_args(params, grads, exp_avg, exp_avg_sq, params_bf16, step, lr, beta1, beta2, adam_eps, weight_decay,
                  max_grad_norm, grad_norm, found_inf);
  auto mats = check_spectral_args(params, params_bf16, u, v, sigma, matrices, sigma_max, n_power_iterations,
                                  spectral_eps);
  check_ema_args(target, target_bf16, params, tau);
  using Named = std::pair<const at::Tensor*, const char*>;
  // Adam's (grads .. found_inf), the spectral norm's (u, v, sigma), the EMA's (target, its mirror).
  const Named adam[] = {{&grads, "grads"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}, {&step, "step"},
                        {&lr, "lr"}, {&grad_norm, "grad_norm"}, {&found_inf, "found_inf"}};
  const Named spectral[] = {{&u, "u"}, {&v, "v"}, {&sigma, "sigma"}};
  const Named ema[] = {{&target, "target"}, {&target_bf16, "target_bf16"}};
  for (const Named& a : adam) {
    for (const Named& s : spectral) check_no_overlap(*a.first, a.second, *s.first, s.second, kOptimizerTailOp);
    for (const Named& e : ema) check_no_overlap(*a.first, a.second, *e.first, e.second, kOptimizerTailOp);
  }
  for (const Named& e : ema) {
    for (const Named& s : spectral) check_no_overlap(*e.first, e.second, *s.first, s.second, kOptimizerTailOp);
    check_no_overlap(*e.first, e.second, params_bf16, "params_bf16", kOptimizerTailOp);
  }
  return mats;
}

// fused_adam_bf16, batched_spectral_norm, then ema_update toward the clamped params: the op's
// meaning, by the dispatcher (each op's kernel for the tensors' device).
inline void adam_then_spectral_norm_then_ema(
    at::Tensor& params, const at::Tensor& grads, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, at::Tensor& params_bf16,
    at::Tensor& step, const at::Tensor& lr, double beta1, double beta2, double adam_eps, double weight_decay,
    bool decoupled_weight_decay, c10::optional<double> max_grad_norm, at::Tensor& grad_norm, at::Tensor& found_inf,
    at::Tensor& u, at::Tensor& v, at::Tensor& sigma, c10::IntArrayRef matrices, c10::ArrayRef<double> sigma_max,
    int64_t n_power_iterations, double spectral_eps, at::Tensor& target, at::Tensor& target_bf16, double tau) {
  static const auto adam =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dqn_ops::fused_adam_bf16", "")
          .typed<void(at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&,
                      const at::Tensor&, double, double, double, double, bool, c10::optional<double>, at::Tensor&,
                      at::Tensor&)>();
  static const auto spectral =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dqn_ops::batched_spectral_norm", "")
          .typed<void(at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, c10::IntArrayRef,
                      c10::ArrayRef<double>, int64_t, double, bool)>();
  static const auto ema = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("dqn_ops::ema_update", "")
                              .typed<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>();
  adam.call(params, grads, exp_avg, exp_avg_sq, params_bf16, step, lr, beta1, beta2, adam_eps, weight_decay,
            decoupled_weight_decay, max_grad_norm, grad_norm, found_inf);
  spectral.call(params, params_bf16, u, v, sigma, matrices, sigma_max, n_power_iterations, spectral_eps, false);
  ema.call(target, target_bf16, params, tau);
}

}  // namespace dqn_ops
