// The per-element arithmetic of fused_adam_bf16 and ema_update, shared by the CPU reference
// and the CUDA kernels so both compute the same formula in the same order (torch.optim.Adam's).
#pragma once

#include <cfloat>
#include <cmath>

#if defined(__CUDACC__)
#define DQN_HD __host__ __device__ __forceinline__
#else
#define DQN_HD inline
#endif

namespace dqn_ops {

// Device code rounds each multiply and add on its own or in an explicit FMA (the _rn
// intrinsics, which ptxas never contracts): a plain a * b + c becomes an FMA in one kernel and
// not in another, as the code around it differs, so the rounding of each step is the one written
// here in whichever kernel inlines these formulas (fused_adam_bf16's and ema_update's). Host
// code runs the same sequence with separate roundings (setup.py builds it with -ffp-contract=off).
DQN_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

DQN_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

DQN_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// a * b + c: one rounding on the device, two on the host.
DQN_HD float fma_dev(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return a * b + c;
#endif
}

// torch.lerp's formula (the one torch.optim.Adam's exp_avg.lerp_ and torch._foreach_lerp_ use).
DQN_HD float lerp_like_torch(float start, float end, float weight) {
  const float diff = sub_rn(end, start);
  return weight < 0.5f ? fma_dev(weight, diff, start) : fma_dev(-diff, sub_rn(1.f, weight), end);
}

// Whether a step runs: the gradient norm is finite and lr is a finite, non-negative number.
// Otherwise the step is skipped (found_inf = 1; params, moments, mirror and step unchanged).
// lr is a device tensor (a captured graph replays with a changing lr), so a bad lr cannot be
// rejected on the host without a sync; skipping it like a non-finite gradient keeps a NaN or
// negative schedule value from corrupting the weights, and the flag reports it. One home for
// the rule, so the CPU and CUDA kernels skip the same steps. Comparisons instead of isfinite:
// false for NaN on both sides, the same in host and device code.
DQN_HD bool adam_step_runs(float grad_norm, float lr) {
  return grad_norm <= FLT_MAX && lr >= 0.f && lr <= FLT_MAX;  // grad_norm is a square root: >= 0 or NaN
}

struct AdamStep {
  float lr, beta1, beta2, eps, weight_decay;
  bool decoupled;   // AdamW: params *= 1 - lr * weight_decay, instead of grad += weight_decay * params
  float coef;       // gradient clipping coefficient (1 when not clipping)
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
};

// max_grad_norm <= 0 means no clipping; then coef is 1. As torch.nn.utils.clip_grad_norm_.
DQN_HD float clip_coefficient(float norm, float max_grad_norm) {
  if (!(max_grad_norm > 0.f)) return 1.f;
  const float c = max_grad_norm / (norm + 1e-6f);
  return c < 1.f ? c : 1.f;
}

DQN_HD AdamStep make_adam_step(float lr, float step, float beta1, float beta2, float eps, float weight_decay,
                               bool decoupled, float coef) {
  AdamStep s{lr, beta1, beta2, eps, weight_decay, decoupled, coef, 0.f, 0.f};
  s.step_size = lr / (1.f - powf(beta1, step));
  s.bc2_sqrt = sqrtf(1.f - powf(beta2, step));
  return s;
}

// One element of torch.optim.Adam(W) (F32, not amsgrad, not maximize) on a clipped gradient.
DQN_HD void adam_element(float& p, float g, float& m, float& v, const AdamStep& s) {
  g = mul_rn(g, s.coef);
  if (s.weight_decay != 0.f) {
    if (s.decoupled) p = mul_rn(p, sub_rn(1.f, mul_rn(s.lr, s.weight_decay)));
    else g = fma_dev(s.weight_decay, p, g);
  }
  m = lerp_like_torch(m, g, 1.f - s.beta1);
  v = fma_dev(v, s.beta2, mul_rn(mul_rn(1.f - s.beta2, g), g));
  p = sub_rn(p, mul_rn(s.step_size, m / add_rn(sqrtf(v) / s.bc2_sqrt, s.eps)));
}

}  // namespace dqn_ops
