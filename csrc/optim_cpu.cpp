// CPU reference kernels of fused_adam_bf16 and ema_update: plain loops over optim_math.h.
#include <cmath>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "mirror_cpu.h"
#include "optim_args.h"
#include "optim_math.h"

namespace dqn_ops {
namespace {

using at::Tensor;

void fused_adam_bf16_cpu(Tensor& params, const Tensor& grads, Tensor& exp_avg, Tensor& exp_avg_sq, Tensor& params_bf16,
                         Tensor& step, const Tensor& lr, double beta1, double beta2, double eps, double weight_decay,
                         bool decoupled_weight_decay, c10::optional<double> max_grad_norm, Tensor& grad_norm,
                         Tensor& found_inf) {
  check_adam_args(params, grads, exp_avg, exp_avg_sq, params_bf16, step, lr, beta1, beta2, eps, weight_decay,
                  max_grad_norm, grad_norm, found_inf);
  const int64_t n = params.numel();
  float* p = params.data_ptr<float>();
  const float* g = grads.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();

  // The sum of squares in double, as the CUDA kernels (csrc/cuda/optim.cu says why).
  double sq = 0;
  for (int64_t i = 0; i < n; ++i) sq += double(g[i]) * double(g[i]);
  const float norm = static_cast<float>(std::sqrt(sq));
  grad_norm.data_ptr<float>()[0] = norm;
  const float step_lr = lr.data_ptr<float>()[0];
  const bool runs = adam_step_runs(norm, step_lr);
  found_inf.data_ptr<float>()[0] = runs ? 0.f : 1.f;
  if (!runs) return;  // skip the step: params, moments, mirror and step count unchanged

  const float t = step.data_ptr<float>()[0] + 1.f;
  step.data_ptr<float>()[0] = t;
  const AdamStep s = make_adam_step(step_lr, t, float(beta1), float(beta2), float(eps),
                                    float(weight_decay), decoupled_weight_decay,
                                    clip_coefficient(norm, float(max_grad_norm.value_or(0))));
  write_mirror(params_bf16, [&](auto* mirror) {
    for (int64_t i = 0; i < n; ++i) {
      adam_element(p[i], g[i], m[i], v[i], s);
      mirror[i] = p[i];
    }
  });
}

void ema_update_cpu(Tensor& target, Tensor& target_bf16, const Tensor& online, double tau) {
  check_ema_args(target, target_bf16, online, tau);
  float* t = target.data_ptr<float>();
  const float* o = online.data_ptr<float>();
  const float w = static_cast<float>(tau);
  write_mirror(target_bf16, [&](auto* mirror) {
    for (int64_t i = 0; i < target.numel(); ++i) {
      t[i] = lerp_like_torch(t[i], o[i], w);
      mirror[i] = t[i];
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(dqn_ops, CPU, m) {
  m.impl("fused_adam_bf16", &fused_adam_bf16_cpu);
  m.impl("ema_update", &ema_update_cpu);
}

}  // namespace dqn_ops
