// How the CPU kernels write a mirror (fused_adam_bf16, ema_update, batched_spectral_norm): BF16,
// rounded to nearest even as __float2bfloat16_rn, or on the unrounded reference path F32, the
// value itself (checks.h, check_mirror_dtype).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

namespace dqn_ops {

// write(m) with m the mirror's element pointer, at::BFloat16* or float*: assigning a float to
// either element type is the mirror's rule.
template <class Write>
void write_mirror(const at::Tensor& mirror, Write&& write) {
  if (mirror.scalar_type() == at::kBFloat16) write(mirror.data_ptr<at::BFloat16>());
  else write(mirror.data_ptr<float>());
}

}  // namespace dqn_ops
