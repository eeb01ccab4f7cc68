// CPU reference kernel of batched_spectral_norm: the power iteration of the CUDA kernel, one
// matrix after the other, with float64 accumulation.
#include <atomic>
#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "mirror_cpu.h"
#include "spectral_args.h"
#include "switches.h"

namespace dqn_ops {

namespace {
constexpr SwitchName kStrategyNames[] = {{"auto", static_cast<int>(SpectralStrategy::kAuto)},
                                         {"cooperative", static_cast<int>(SpectralStrategy::kCooperative)}};

// The setting, initialised from the environment at its first use (switches.h).
std::atomic<int>& spectral_strategy_setting() {
  static std::atomic<int> setting{
      env_switch("DQN_OPS_SPECTRAL_STRATEGY", kStrategyNames, static_cast<int>(SpectralStrategy::kAuto))};
  return setting;
}
}  // namespace

bool parse_spectral_strategy(std::string_view name, SpectralStrategy* out) {
  int value = 0;
  if (!switch_value(kStrategyNames, name, &value)) return false;
  *out = static_cast<SpectralStrategy>(value);
  return true;
}

const char* spectral_strategy_name(SpectralStrategy strategy) {
  return switch_name(kStrategyNames, static_cast<int>(strategy));
}

std::string spectral_strategy_choices() { return switch_choices(kStrategyNames); }

SpectralStrategy spectral_strategy() {
  return static_cast<SpectralStrategy>(spectral_strategy_setting().load(std::memory_order_relaxed));
}

SpectralStrategy set_spectral_strategy(SpectralStrategy strategy) {
  return static_cast<SpectralStrategy>(
      spectral_strategy_setting().exchange(static_cast<int>(strategy), std::memory_order_relaxed));
}

namespace {

using at::Tensor;

void batched_spectral_norm_cpu(Tensor& params, Tensor& params_bf16, Tensor& u, Tensor& v, Tensor& sigma,
                               c10::IntArrayRef matrices, c10::ArrayRef<double> sigma_max,
                               int64_t n_power_iterations, double eps, bool /*one_launch_per_matrix*/) {
  const auto mats = check_spectral_args(params, params_bf16, u, v, sigma, matrices, sigma_max, n_power_iterations, eps);
  float* p = params.data_ptr<float>();
  float* uu = u.data_ptr<float>();
  float* vv = v.data_ptr<float>();
  float* sig = sigma.data_ptr<float>();
  for (size_t m = 0; m < mats.size(); ++m) {
    const SpectralMatrix& d = mats[m];
    float* W = p + d.w_off;
    float* um = uu + d.u_off;
    float* vm = vv + d.v_off;
    std::vector<double> acc(std::max(d.rows, d.cols));
    double s = 0;
    for (int64_t it = 0; it < n_power_iterations; ++it) {
      // v = normalize(W^T u)
      std::fill(acc.begin(), acc.begin() + d.cols, 0.0);
      for (int64_t r = 0; r < d.rows; ++r)
        for (int64_t c = 0; c < d.cols; ++c) acc[c] += double(W[r * d.cols + c]) * um[r];
      double nv = 0;
      for (int64_t c = 0; c < d.cols; ++c) nv += acc[c] * acc[c];
      nv = std::max(std::sqrt(nv), eps);
      for (int64_t c = 0; c < d.cols; ++c) vm[c] = static_cast<float>(acc[c] / nv);
      // u = normalize(W v); sigma = u^T W v = |W v|
      double nu = 0;
      for (int64_t r = 0; r < d.rows; ++r) {
        double dot = 0;
        for (int64_t c = 0; c < d.cols; ++c) dot += double(W[r * d.cols + c]) * vm[c];
        acc[r] = dot;
        nu += dot * dot;
      }
      s = std::sqrt(nu);
      nu = std::max(s, eps);
      for (int64_t r = 0; r < d.rows; ++r) um[r] = static_cast<float>(acc[r] / nu);
    }
    const float sf = static_cast<float>(s);
    sig[m] = sf;
    if (sf > d.sigma_max) {  // false for NaN: a non-finite estimate leaves W alone, and sigma reports it
      const float scale = d.sigma_max / sf;
      write_mirror(params_bf16, [&](auto* mirror) {
        for (int64_t i = 0; i < d.rows * d.cols; ++i) {
          W[i] *= scale;
          mirror[d.w_off + i] = W[i];
        }
      });
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(dqn_ops, CPU, m) { m.impl("batched_spectral_norm", &batched_spectral_norm_cpu); }

}  // namespace dqn_ops
