// record_step on CUDA: one single-thread kernel writes the step's scalars into the ring row the
// device-side slot names, advances the slot and raises the sticky flag. It replaces the five
// torch kernels the same bookkeeping took (stack, index_copy, add, remainder, maximum). With a
// host_flag (pinned host memory) it also stores the new flag there, through the allocation's
// mapping into the device's address space: the host reads the flag a step or so later with a
// plain load, where a device-to-host copy would cost it an event, a stream switch and the copy's
// launch every step (dqn_ops/readback.py). The flag only rises until the host resets it, so a
// late or reordered view of it delays its notice of a non-finite step, never loses it.
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
                                   const float* __restrict__ non_finite, volatile float* host_flag) {
  pdl_enter();
  const int64_t row = ((slot[0] % rows) + rows) % rows;  // a foreign slot wraps, never writes out of bounds
  for (int i = 0; i < values.count; ++i) ring[row * values.count + i] = *values.ptr[i];
  slot[0] = (row + 1) % rows;
  const float f = max_propagating_nan(flag[0], non_finite[0]);
  flag[0] = f;
  if (host_flag != nullptr) *host_flag = f;
}

// The device's address of pinned host memory (the same as the host's under unified addressing,
// but asked, not assumed); an error for memory the device cannot reach.
float* device_view_of_pinned(const Tensor& host) {
  cudaPointerAttributes attr{};
  C10_CUDA_CHECK(cudaPointerGetAttributes(&attr, host.data_ptr()));
  DQN_CHECK(attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr, kRecordOp,
            ": host_flag: expected pinned host memory the device can address, got memory of CUDA type ",
            static_cast<int>(attr.type));
  return static_cast<float*>(attr.devicePointer);
}

void record_step_cuda(Tensor& ring, Tensor& slot, Tensor& flag, at::TensorList values, const Tensor& non_finite,
                      const c10::optional<Tensor>& host_flag) {
  check_record_args(ring, slot, flag, values, non_finite, host_flag);
  const c10::cuda::CUDAGuard guard(ring.device());
  RecordValues v{};
  v.count = static_cast<int>(values.size());
  for (int i = 0; i < v.count; ++i) v.ptr[i] = values[i].data_ptr<float>();
  float* host = host_flag.has_value() ? device_view_of_pinned(*host_flag) : nullptr;
  launch(record_step_kernel, 1, 1, 0, at::cuda::getCurrentCUDAStream(), ring.data_ptr<float>(), ring.size(0),
         slot.data_ptr<int64_t>(), flag.data_ptr<float>(), v, non_finite.data_ptr<float>(), host);
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) { m.impl("record_step", &cuda::record_step_cuda); }

}  // namespace dqn_ops
