// fused_adam_bf16's device side and its norm partials' launch, shared by the op's own update
// kernel (optim.cu) and the trainer's optimizer tail, where Adam runs inside the spectral norm's
// cluster kernel (spectral_norm.cu). Both compute every element with adam_element from the same
// global norm, so the two give the same bits.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "optim_math.h"
#include "reductions.cuh"

namespace dqn_ops {
namespace cuda {

// The norm partials' launch has at most this many blocks; the update folds them.
constexpr int kMaxNormBlocks = 1024;

// One Adam step's buffers and settings on the device. `norm` is the partials' scratch:
// num_partials sums of squares, then (at kMaxNormBlocks) the step count before this step, so that
// the block that writes the new count reads no value another block reads.
struct AdamArgs {
  float* p;
  const float* g;
  float* m;
  float* v;
  __nv_bfloat16* mirror;
  int64_t n;
  const double* norm;
  int num_partials;
  float* step;
  const float* lr;
  float beta1, beta2, eps, weight_decay, max_grad_norm;  // max_grad_norm <= 0: no clipping
  bool decoupled;
  float* grad_norm;
  float* found_inf;
};

// Checks fused_adam_bf16's arguments and launches the norm partials on the current stream;
// returns the update's arguments. *scratch keeps the partials alive (the caching allocator's
// stream order: it must stay referenced until the update is launched). Defined in optim.cu.
AdamArgs launch_adam_norm(at::Tensor& params, const at::Tensor& grads, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                          at::Tensor& params_bf16, at::Tensor& step, const at::Tensor& lr, double beta1, double beta2,
                          double eps, double weight_decay, bool decoupled_weight_decay,
                          c10::optional<double> max_grad_norm, at::Tensor& grad_norm, at::Tensor& found_inf,
                          at::Tensor* scratch);

#if defined(__CUDACC__)
// Every block: the global norm from the partials (the same order in every block, so the same
// value), whether the step runs, and its constants in *st. The block for which `writes` holds
// (one in the launch) stores the norm, the flag and the new step count.
template <int kThreads>
__device__ bool adam_begin(const AdamArgs& a, double* smem, AdamStep* st, bool writes) {
  double s = 0.0;
  for (int i = threadIdx.x; i < a.num_partials; i += kThreads) s += a.norm[i];
  const float norm = static_cast<float>(sqrt(block_sum<kThreads>(s, smem)));
  const float lr = a.lr[0];
  const bool runs = adam_step_runs(norm, lr);
  const float new_step = static_cast<float>(a.norm[kMaxNormBlocks]) + 1.f;
  if (writes && threadIdx.x == 0) {
    a.grad_norm[0] = norm;
    a.found_inf[0] = runs ? 0.f : 1.f;
    if (runs) a.step[0] = new_step;
  }
  *st = make_adam_step(lr, new_step, a.beta1, a.beta2, a.eps, a.weight_decay, a.decoupled,
                       clip_coefficient(norm, a.max_grad_norm));
  return runs;
}

__device__ __forceinline__ void store_bf16x4(__nv_bfloat16* dst, float4 p) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(p.x, p.y), hi = __floats2bfloat162_rn(p.z, p.w);
  uint2 u;
  u.x = *reinterpret_cast<uint32_t*>(&lo);
  u.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(dst) = u;
}

// Adam on 4 elements from index 4 i, already loaded; w as adam_range's.
__device__ __forceinline__ void adam_x4(const AdamArgs& a, const AdamStep& st, int64_t i, float4 pp, float4 gg,
                                        float4 mm, float4 vv, int64_t e0, float* w) {
  adam_element(pp.x, gg.x, mm.x, vv.x, st);
  adam_element(pp.y, gg.y, mm.y, vv.y, st);
  adam_element(pp.z, gg.z, mm.z, vv.z, st);
  adam_element(pp.w, gg.w, mm.w, vv.w, st);
  reinterpret_cast<float4*>(a.p)[i] = pp;
  reinterpret_cast<float4*>(a.m)[i] = mm;
  reinterpret_cast<float4*>(a.v)[i] = vv;
  store_bf16x4(a.mirror + 4 * i, pp);
  if (w != nullptr) {
    float* dst = w + (4 * i - e0);
    dst[0] = pp.x;
    dst[1] = pp.y;
    dst[2] = pp.z;
    dst[3] = pp.w;
  }
}

// The update of elements [e0, e1) by threads `t` of `threads` (t < threads): 16-byte loads and
// stores where 4 elements start at a multiple of 4 (every buffer is 16-byte aligned, checked),
// single elements at the ends. Where w is not null, w[e - e0] receives each updated parameter.
// A thread's groups of 4 go kUnroll at a time, every load before the first store: the compiler
// may not move a load above a store to a buffer it cannot prove distinct, and a block that
// loops over many groups (the cluster kernel: a few hundred threads for a matrix's rows) would
// otherwise wait one memory latency per group. A grid that covers the buffer (fused_adam_bf16's)
// takes kUnroll = 1: its threads have a group or two each, and fewer registers keep more blocks
// resident.
template <int kUnroll>
__device__ __forceinline__ void adam_range(const AdamArgs& a, const AdamStep& st, int64_t e0, int64_t e1, int64_t t,
                                           int64_t threads, float* w) {
  const int64_t a0 = e1 < ((e0 + 3) & ~int64_t(3)) ? e1 : ((e0 + 3) & ~int64_t(3));
  const int64_t a1 = a0 > (e1 & ~int64_t(3)) ? a0 : (e1 & ~int64_t(3));
  int64_t i = a0 / 4 + t;
  for (; i + (kUnroll - 1) * threads < a1 / 4; i += kUnroll * threads) {
    float4 pp[kUnroll], gg[kUnroll], mm[kUnroll], vv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      pp[u] = reinterpret_cast<const float4*>(a.p)[i + u * threads];
      gg[u] = reinterpret_cast<const float4*>(a.g)[i + u * threads];
      mm[u] = reinterpret_cast<const float4*>(a.m)[i + u * threads];
      vv[u] = reinterpret_cast<const float4*>(a.v)[i + u * threads];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) adam_x4(a, st, i + u * threads, pp[u], gg[u], mm[u], vv[u], e0, w);
  }
  for (; i < a1 / 4; i += threads)
    adam_x4(a, st, i, reinterpret_cast<const float4*>(a.p)[i], reinterpret_cast<const float4*>(a.g)[i],
            reinterpret_cast<const float4*>(a.m)[i], reinterpret_cast<const float4*>(a.v)[i], e0, w);
  // The ends: [e0, a0) and [a1, e1), fewer than 4 elements each.
  for (int64_t j = t; j < (a0 - e0) + (e1 - a1); j += threads) {
    const int64_t k = j < a0 - e0 ? e0 + j : a1 + (j - (a0 - e0));
    adam_element(a.p[k], a.g[k], a.m[k], a.v[k], st);
    a.mirror[k] = __float2bfloat16_rn(a.p[k]);
    if (w != nullptr) w[k - e0] = a.p[k];
  }
}
#endif

}  // namespace cuda
}  // namespace dqn_ops
