// fused_adam_bf16 and ema_update on CUDA.
//
// Adam is two launches: (1) per-block partial sums of g^2 into a scratch buffer (a fixed grid
// for a given size, so the summation order and the norm are deterministic); (2) the update:
// every block reduces the same partials in the same order to the global norm, decides skip /
// clip on the device, and runs the element update with 16-byte loads, writing the F32 master,
// both moments and the BF16 mirror in one pass. Launch (1) also copies the step count into
// the scratch so that launch (2) reads the old count there while its block 0 writes the new
// one: no block reads a value another block of the same launch writes.
//
// The sum of squares accumulates in double (each thread, the blocks' partials, their fold), as
// the CPU kernel does: the norm of a finite gradient is finite whenever it fits in F32, where an
// F32 sum of squares overflows to inf once an element passes ~1.8e19 (or the sum passes 3.4e38)
// and would skip a step the clipping can take. A float's square is exact in double, so the only
// difference from the CPU's sequential sum is the order of the additions, below F32's resolution
// after the sqrt and the rounding to F32. The cost is negligible: launch (1) is bound by the reads
// of the gradient (one DFMA per 4-byte load; even a GPU with 1/64-rate FP64 has several times the
// DFMA throughput that its memory bandwidth needs), and launch (2) folds at most 1024 doubles per
// block.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include "elementwise.cuh"
#include "optim_args.h"
#include "optim_math.h"
#include "pdl.cuh"
#include "reductions.cuh"

namespace dqn_ops {
namespace cuda {
namespace {

using at::Tensor;
constexpr int kThreads = 256;
constexpr int kMaxNormBlocks = 1024;  // = partials; each update block folds them in 4 per thread

// scratch: kMaxNormBlocks partial sums of squares, then the step count (doubles).
__global__ void __launch_bounds__(kThreads) sq_norm_partials_kernel(const float* __restrict__ g, int64_t n,
                                                                    double* __restrict__ scratch,
                                                                    const float* __restrict__ step) {
  pdl_enter();
  __shared__ double smem[kThreads];
  double s = 0.0;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    const double x = g[i];
    s += x * x;
  }
  s = block_sum<kThreads>(s, smem);
  if (threadIdx.x == 0) {
    scratch[blockIdx.x] = s;
    if (blockIdx.x == 0) scratch[kMaxNormBlocks] = step[0];
  }
}

__global__ void __launch_bounds__(kThreads) adam_update_kernel(
    float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
    __nv_bfloat16* __restrict__ mirror, int64_t n, const double* __restrict__ scratch, int num_partials,
    float* __restrict__ step, const float* __restrict__ lr, float beta1, float beta2, float eps, float weight_decay,
    bool decoupled, float max_grad_norm, float* __restrict__ grad_norm, float* __restrict__ found_inf) {
  pdl_enter();
  __shared__ double smem[kThreads];
  double s = 0.0;
  for (int i = threadIdx.x; i < num_partials; i += kThreads) s += scratch[i];
  const float norm = static_cast<float>(sqrt(block_sum<kThreads>(s, smem)));
  const float step_lr = lr[0];
  const bool runs = adam_step_runs(norm, step_lr);  // the same decision in every block
  const float new_step = static_cast<float>(scratch[kMaxNormBlocks]) + 1.f;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    grad_norm[0] = norm;
    found_inf[0] = runs ? 0.f : 1.f;
    if (runs) step[0] = new_step;
  }
  if (!runs) return;  // skip: nothing else is written
  const AdamStep st = make_adam_step(step_lr, new_step, beta1, beta2, eps, weight_decay, decoupled,
                                     clip_coefficient(norm, max_grad_norm));
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t n4 = n / 4;  // every buffer is 16-byte aligned (checked)
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n4; i += stride) {
    float4 pp = reinterpret_cast<float4*>(p)[i];
    const float4 gg = reinterpret_cast<const float4*>(g)[i];
    float4 mm = reinterpret_cast<float4*>(m)[i];
    float4 vv = reinterpret_cast<float4*>(v)[i];
    adam_element(pp.x, gg.x, mm.x, vv.x, st);
    adam_element(pp.y, gg.y, mm.y, vv.y, st);
    adam_element(pp.z, gg.z, mm.z, vv.z, st);
    adam_element(pp.w, gg.w, mm.w, vv.w, st);
    reinterpret_cast<float4*>(p)[i] = pp;
    reinterpret_cast<float4*>(m)[i] = mm;
    reinterpret_cast<float4*>(v)[i] = vv;
    *reinterpret_cast<uint2*>(mirror + 4 * i) = pack_bf16x4(pp.x, pp.y, pp.z, pp.w);
  }
  for (int64_t i = 4 * n4 + blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n; i += stride) {
    adam_element(p[i], g[i], m[i], v[i], st);
    mirror[i] = __float2bfloat16_rn(p[i]);
  }
}

__global__ void __launch_bounds__(kThreads) ema_kernel(float* __restrict__ t, __nv_bfloat16* __restrict__ mirror,
                                                       const float* __restrict__ o, int64_t n, float tau) {
  pdl_enter();
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t n4 = n / 4;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n4; i += stride) {
    float4 tt = reinterpret_cast<float4*>(t)[i];
    const float4 oo = reinterpret_cast<const float4*>(o)[i];
    tt.x = lerp_like_torch(tt.x, oo.x, tau);
    tt.y = lerp_like_torch(tt.y, oo.y, tau);
    tt.z = lerp_like_torch(tt.z, oo.z, tau);
    tt.w = lerp_like_torch(tt.w, oo.w, tau);
    reinterpret_cast<float4*>(t)[i] = tt;
    *reinterpret_cast<uint2*>(mirror + 4 * i) = pack_bf16x4(tt.x, tt.y, tt.z, tt.w);
  }
  for (int64_t i = 4 * n4 + blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n; i += stride) {
    t[i] = lerp_like_torch(t[i], o[i], tau);
    mirror[i] = __float2bfloat16_rn(t[i]);
  }
}

// Enough blocks to fill the device several times over, no more (the loops grid-stride).
unsigned update_blocks(int64_t n) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = (n / 4 + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t(sms) * 8)));
}

void fused_adam_bf16_cuda(Tensor& params, const Tensor& grads, Tensor& exp_avg, Tensor& exp_avg_sq,
                          Tensor& params_bf16, Tensor& step, const Tensor& lr, double beta1, double beta2, double eps,
                          double weight_decay, bool decoupled_weight_decay, c10::optional<double> max_grad_norm,
                          Tensor& grad_norm, Tensor& found_inf) {
  check_adam_args(params, grads, exp_avg, exp_avg_sq, params_bf16, step, lr, beta1, beta2, eps, weight_decay,
                  max_grad_norm, grad_norm, found_inf);
  // Kernels must run on the tensors' device, whichever device is current.
  const c10::cuda::CUDAGuard guard(params.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t n = params.numel();
  const int partials = static_cast<int>(std::min<int64_t>(kMaxNormBlocks, (n + kThreads - 1) / kThreads));
  Tensor scratch = at::empty({kMaxNormBlocks + 1}, params.options().dtype(at::kDouble));
  launch(sq_norm_partials_kernel, partials, kThreads, 0, stream, grads.data_ptr<float>(), n,
         scratch.data_ptr<double>(), step.data_ptr<float>());
  launch(adam_update_kernel, update_blocks(n), kThreads, 0, stream, params.data_ptr<float>(), grads.data_ptr<float>(),
         exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), static_cast<__nv_bfloat16*>(params_bf16.data_ptr()),
         n, scratch.data_ptr<double>(), partials, step.data_ptr<float>(), lr.data_ptr<float>(), float(beta1),
         float(beta2), float(eps), float(weight_decay), decoupled_weight_decay, float(max_grad_norm.value_or(0)),
         grad_norm.data_ptr<float>(), found_inf.data_ptr<float>());
}

void ema_update_cuda(Tensor& target, Tensor& target_bf16, const Tensor& online, double tau) {
  check_ema_args(target, target_bf16, online, tau);
  const c10::cuda::CUDAGuard guard(target.device());
  const int64_t n = target.numel();
  launch(ema_kernel, update_blocks(n), kThreads, 0, at::cuda::getCurrentCUDAStream(), target.data_ptr<float>(),
         static_cast<__nv_bfloat16*>(target_bf16.data_ptr()), online.data_ptr<float>(), n, float(tau));
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) {
  m.impl("fused_adam_bf16", &cuda::fused_adam_bf16_cuda);
  m.impl("ema_update", &cuda::ema_update_cuda);
}

}  // namespace dqn_ops
