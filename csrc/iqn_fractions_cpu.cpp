// CPU kernel of iqn_fractions: tau[b, i] = iqn_fraction(seed, call, row_offset + b, i),
// tau_target[b, j] = iqn_fraction(seed, call, row_offset + b, kIqnTargetSlot + j)
// (csrc/iqn_fractions_args.h, the formula the CUDA kernel shares), then call + 1.
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "iqn_fractions_args.h"

namespace dqn_ops {
namespace {

using at::Tensor;

std::tuple<Tensor, Tensor> iqn_fractions_cpu(Tensor& rng, int64_t batch, int64_t n, int64_t n_target,
                                             int64_t row_offset) {
  check_iqn_fractions_args(rng, batch, n, n_target, row_offset);
  Tensor tau = at::empty({batch, n}, rng.options().dtype(at::kFloat));
  Tensor tau_target = at::empty({batch, n_target}, rng.options().dtype(at::kFloat));
  int64_t* r = rng.data_ptr<int64_t>();
  const uint64_t seed = static_cast<uint64_t>(r[0]), call = static_cast<uint64_t>(r[1]);
  float* t = tau.data_ptr<float>();
  float* tt = tau_target.data_ptr<float>();
  at::parallel_for(0, batch, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint32_t row = static_cast<uint32_t>(row_offset + b);  // below 2^32: checked
      for (int64_t i = 0; i < n; ++i) t[b * n + i] = iqn_fraction(seed, call, row, static_cast<uint32_t>(i));
      for (int64_t j = 0; j < n_target; ++j)
        tt[b * n_target + j] = iqn_fraction(seed, call, row, kIqnTargetSlot + static_cast<uint32_t>(j));
    }
  });
  r[1] = static_cast<int64_t>(call + 1);  // wraps as the unsigned counter it is
  return {tau, tau_target};
}

}  // namespace

TORCH_LIBRARY_IMPL(dqn_ops, CPU, m) { m.impl("iqn_fractions", &iqn_fractions_cpu); }

}  // namespace dqn_ops
