// iqn_fractions on CUDA: a thread per fraction, tau and tau_target in one launch, from
// iqn_fraction (csrc/iqn_fractions_args.h, the formula the CPU kernel shares: the same bits),
// then the one-thread launch that advances rng's call (call_counter.cuh). Seed and call are read
// on the device: no host sync, capturable in a CUDA graph, each replay draws the next call's.
#include <algorithm>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "call_counter.cuh"
#include "iqn_fractions_args.h"
#include "pdl.cuh"

namespace dqn_ops {
namespace cuda {
namespace {

using at::Tensor;

constexpr int kThreads = 256;

// Elements [0, batch * n) are tau (row-major), the next batch * n_target tau_target.
__global__ void iqn_fractions_kernel(const int64_t* __restrict__ rng, int64_t batch, int64_t n, int64_t n_target,
                                     int64_t row_offset, float* __restrict__ tau, float* __restrict__ tau_target) {
  pdl_enter();
  const uint64_t seed = static_cast<uint64_t>(rng[0]), call = static_cast<uint64_t>(rng[1]);
  const int64_t online = batch * n, total = online + batch * n_target;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += step) {
    if (e < online) {
      const int64_t b = e / n, i = e - b * n;
      tau[e] = iqn_fraction(seed, call, static_cast<uint32_t>(row_offset + b), static_cast<uint32_t>(i));
    } else {
      const int64_t k = e - online, b = k / n_target, j = k - b * n_target;
      tau_target[k] = iqn_fraction(seed, call, static_cast<uint32_t>(row_offset + b),
                                   kIqnTargetSlot + static_cast<uint32_t>(j));
    }
  }
}

std::tuple<Tensor, Tensor> iqn_fractions_cuda(Tensor& rng, int64_t batch, int64_t n, int64_t n_target,
                                              int64_t row_offset) {
  check_iqn_fractions_args(rng, batch, n, n_target, row_offset);
  const c10::cuda::CUDAGuard guard(rng.device());
  Tensor tau = at::empty({batch, n}, rng.options().dtype(at::kFloat));
  Tensor tau_target = at::empty({batch, n_target}, rng.options().dtype(at::kFloat));
  const int64_t total = batch * (n + n_target);  // >= 2: batch, n, n_target >= 1
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // A thread per element up to a grid of 65535 blocks; beyond that the threads loop.
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535);
  launch(iqn_fractions_kernel, static_cast<unsigned>(blocks), kThreads, 0, stream, rng.data_ptr<int64_t>(), batch, n,
         n_target, row_offset, tau.data_ptr<float>(), tau_target.data_ptr<float>());
  advance_call(rng.data_ptr<int64_t>(), stream);
  return {tau, tau_target};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) { m.impl("iqn_fractions", &cuda::iqn_fractions_cuda); }

}  // namespace dqn_ops
