// CPU kernel of record_step: one row of per-step scalars into the deferred-readback ring.
#include <torch/library.h>

#include "readback_args.h"

namespace dqn_ops {
namespace {

using at::Tensor;

void record_step_cpu(Tensor& ring, Tensor& slot, Tensor& flag, at::TensorList values, const Tensor& non_finite,
                     const c10::optional<Tensor>& host_flag) {
  check_record_args(ring, slot, flag, values, non_finite, host_flag);
  int64_t* s = slot.data_ptr<int64_t>();
  const int64_t rows = ring.size(0), cols = ring.size(1);
  // A slot outside the ring (written by someone else) wraps instead of writing out of bounds.
  const int64_t row = ((s[0] % rows) + rows) % rows;
  float* r = ring.data_ptr<float>() + row * cols;
  for (int64_t i = 0; i < cols; ++i) r[i] = *values[i].data_ptr<float>();
  s[0] = (row + 1) % rows;
  float* f = flag.data_ptr<float>();
  f[0] = max_propagating_nan(f[0], *non_finite.data_ptr<float>());
  if (host_flag.has_value()) host_flag->data_ptr<float>()[0] = f[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(dqn_ops, CPU, m) { m.impl("record_step", &record_step_cpu); }

}  // namespace dqn_ops
