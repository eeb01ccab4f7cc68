// record_step on CUDA: one single-thread kernel writes the step's scalars into the ring row the
// device-side slot names, advances the slot and raises the sticky flag. It replaces the five
// torch kernels the same bookkeeping took (stack, index_copy, add, remainder, maximum).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "pdl.cuh"
#include "readback_args.h"

namespace dqn_ops {
namespace cuda {
namespace {

using at::Tensor;

struct RecordValues {
  const float* ptr[kMaxRecordValues];
  int count;
};

__global__ void record_step_kernel(float* __restrict__ ring, int64_t rows, int64_t* __restrict__ slot,
                                   float* __restrict__ flag, const RecordValues values,
                                   const float* __restrict__ non_finite) {
  pdl_enter();
  const int64_t row = ((slot[0] % rows) + rows) % rows;  // a foreign slot wraps, never writes out of bounds
  for (int i = 0; i < values.count; ++i) ring[row * values.count + i] = *values.ptr[i];
  slot[0] = (row + 1) % rows;
  flag[0] = max_propagating_nan(flag[0], non_finite[0]);
}

void record_step_cuda(Tensor& ring, Tensor& slot, Tensor& flag, at::TensorList values, const Tensor& non_finite) {
  check_record_args(ring, slot, flag, values, non_finite);
  const c10::cuda::CUDAGuard guard(ring.device());
  RecordValues v{};
  v.count = static_cast<int>(values.size());
  for (int i = 0; i < v.count; ++i) v.ptr[i] = values[i].data_ptr<float>();
  launch(record_step_kernel, 1, 1, 0, at::cuda::getCurrentCUDAStream(), ring.data_ptr<float>(), ring.size(0),
         slot.data_ptr<int64_t>(), flag.data_ptr<float>(), v, non_finite.data_ptr<float>());
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) { m.impl("record_step", &cuda::record_step_cuda); }

}  // namespace dqn_ops
