// _spectral_norm_ema's checks and its composition of two public ops, shared by the CPU kernel
// and the CUDA kernel's fallback (csrc/cuda/spectral_norm.cu fuses the two where it can).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/ArrayRef.h>

#include "optim_args.h"
#include "spectral_args.h"

namespace dqn_ops {

constexpr const char* kSpectralEmaOp = "dqn_ops._spectral_norm_ema";

// Both ops' own checks, and no memory shared between what the EMA writes (target, its mirror)
// and what the spectral norm writes or reads besides params: fused, the two run at once.
inline std::vector<SpectralMatrix> check_spectral_ema_args(
    const at::Tensor& params, const at::Tensor& params_bf16, const at::Tensor& u, const at::Tensor& v,
    const at::Tensor& sigma, c10::IntArrayRef matrices, c10::ArrayRef<double> sigma_max, int64_t n_power_iterations,
    double eps, const at::Tensor& target, const at::Tensor& target_bf16, double tau) {
  auto mats = check_spectral_args(params, params_bf16, u, v, sigma, matrices, sigma_max, n_power_iterations, eps);
  check_ema_args(target, target_bf16, params, tau);
  const std::pair<const at::Tensor*, const char*> written[] = {{&target, "target"}, {&target_bf16, "target_bf16"}};
  const std::pair<const at::Tensor*, const char*> spectral[] = {
      {&params_bf16, "params_bf16"}, {&u, "u"}, {&v, "v"}, {&sigma, "sigma"}};
  for (const auto& w : written)
    for (const auto& s : spectral) check_no_overlap(*w.first, w.second, *s.first, s.second, kSpectralEmaOp);
  return mats;
}

// batched_spectral_norm, then ema_update on the clamped params: the op's meaning, by the
// dispatcher (each op's kernel for the tensors' device).
inline void spectral_norm_then_ema(at::Tensor& params, at::Tensor& params_bf16, at::Tensor& u, at::Tensor& v,
                                   at::Tensor& sigma, c10::IntArrayRef matrices, c10::ArrayRef<double> sigma_max,
                                   int64_t n_power_iterations, double eps, at::Tensor& target,
                                   at::Tensor& target_bf16, double tau) {
  static const auto spectral =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dqn_ops::batched_spectral_norm", "")
          .typed<void(at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, c10::IntArrayRef,
                      c10::ArrayRef<double>, int64_t, double, bool)>();
  static const auto ema = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("dqn_ops::ema_update", "")
                              .typed<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>();
  spectral.call(params, params_bf16, u, v, sigma, matrices, sigma_max, n_power_iterations, eps, false);
  ema.call(target, target_bf16, params, tau);
}

}  // namespace dqn_ops
