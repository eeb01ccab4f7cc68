// CPU kernel of bootstrap_masks: masks[b, e] = bootstrap_mask(seed, indices[b], e, p)
// (csrc/bootstrap_args.h, the formula the CUDA kernel shares).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bootstrap_args.h"

namespace dqn_ops {
namespace {

using at::Tensor;

Tensor bootstrap_masks_cpu(const Tensor& indices, int64_t seed, int64_t members, double p) {
  check_bootstrap_masks_args(indices, members, p);
  const int64_t B = indices.size(0);
  Tensor masks = at::empty({B, members}, indices.options().dtype(at::kFloat));
  const int64_t* idx = indices.data_ptr<int64_t>();
  const int64_t stride = indices.stride(0);
  float* out = masks.data_ptr<float>();
  const uint64_t key = static_cast<uint64_t>(seed);
  at::parallel_for(0, B, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint64_t index = static_cast<uint64_t>(idx[b * stride]);
      for (int64_t e = 0; e < members; ++e)
        out[b * members + e] = bootstrap_mask(key, index, static_cast<uint32_t>(e), p);
    }
  });
  return masks;
}

}  // namespace

TORCH_LIBRARY_IMPL(dqn_ops, CPU, m) { m.impl("bootstrap_masks", &bootstrap_masks_cpu); }

}  // namespace dqn_ops
