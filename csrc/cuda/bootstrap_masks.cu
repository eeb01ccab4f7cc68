// bootstrap_masks on CUDA: a thread per mask element, masks[b, e] = bootstrap_mask(seed,
// indices[b], e, p) (csrc/bootstrap_args.h, the formula the CPU kernel shares: the same bits).
// No state, no host read: capturable in a CUDA graph.
#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "bootstrap_args.h"
#include "pdl.cuh"

namespace dqn_ops {
namespace cuda {
namespace {

using at::Tensor;

constexpr int kThreads = 256;

__global__ void bootstrap_masks_kernel(const int64_t* __restrict__ indices, int64_t stride, int64_t members,
                                       int64_t total, uint64_t seed, double p, float* __restrict__ masks) {
  pdl_enter();
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += step) {
    const int64_t b = i / members, e = i - b * members;
    masks[i] = bootstrap_mask(seed, static_cast<uint64_t>(indices[b * stride]), static_cast<uint32_t>(e), p);
  }
}

Tensor bootstrap_masks_cuda(const Tensor& indices, int64_t seed, int64_t members, double p) {
  check_bootstrap_masks_args(indices, members, p);
  const c10::cuda::CUDAGuard guard(indices.device());
  const int64_t B = indices.size(0), total = B * members;
  Tensor masks = at::empty({B, members}, indices.options().dtype(at::kFloat));
  if (total == 0) return masks;
  // A thread per element up to a grid of 65535 blocks; beyond that the threads loop.
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535);
  launch(bootstrap_masks_kernel, static_cast<unsigned>(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream(),
         indices.data_ptr<int64_t>(), indices.stride(0), members, total, static_cast<uint64_t>(seed), p,
         masks.data_ptr<float>());
  return masks;
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) { m.impl("bootstrap_masks", &cuda::bootstrap_masks_cuda); }

}  // namespace dqn_ops
