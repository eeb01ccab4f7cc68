// Argument validation and descriptor decoding of batched_spectral_norm, shared by the CPU and
// CUDA kernels so both reject the same inputs with the same messages.
//
// The matrices come as the op's `int[] matrices` argument: (offset, rows, cols) for each
// weight matrix, a row-major [rows, cols] block of the flat F32 params starting at offset.
// dqn_ops.SpectralNorm builds that list once, when it is built for a network. Each matrix's
// persistent left vector u (rows elements) and right vector v (cols elements) lie one after
// the other in the flat `u` and `v` buffers, in the order of the list.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include "checks.h"

namespace dqn_ops {

constexpr const char* kSpectralOp = "dqn_ops.batched_spectral_norm";

// Which strategy the CUDA kernel takes (csrc/cuda/spectral_norm.cu). kAuto, the default: the
// cluster strategy for every matrix it can take on this device and binary, the cooperative one
// for the rest. kCooperative: the cooperative strategy for every matrix, the fallback every
// device with BF16 tensor cores (sm_80+) runs; for tests and for comparing the two. Set by
//   - the environment variable DQN_OPS_SPECTRAL_STRATEGY=auto|cooperative, read once, at the
//     first call of spectral_strategy() (switches.h: any other value raises there);
//   - dqn_ops._C._set_spectral_strategy("auto" | "cooperative"), which returns the previous name
//     (the test hook: no environment, no rebuild).
// A process-wide setting read with one atomic load per call: the default path pays nothing
// else. A CUDA graph keeps the launches of the strategy in force when it was captured. The CPU
// kernel has one strategy and ignores it. Defined in spectral_cpu.cpp (built with or without CUDA).
enum class SpectralStrategy : int { kAuto = 0, kCooperative = 1 };
SpectralStrategy spectral_strategy();
// Returns the previous strategy.
SpectralStrategy set_spectral_strategy(SpectralStrategy strategy);
// "auto" / "cooperative" <-> the enum; parse returns false for any other name; the names as a
// message lists them.
bool parse_spectral_strategy(std::string_view name, SpectralStrategy* out);
const char* spectral_strategy_name(SpectralStrategy strategy);
std::string spectral_strategy_choices();

struct SpectralMatrix {
  int64_t w_off;  // first element of W in params
  int64_t rows, cols;
  int64_t u_off, v_off;  // first element of u / v in their flat buffers
  float sigma_max;
};

// Decodes and validates the descriptor list against the buffers. Returns one entry per matrix.
inline std::vector<SpectralMatrix> check_spectral_args(const at::Tensor& params, const at::Tensor& params_bf16,
                                                       const at::Tensor& u, const at::Tensor& v,
                                                       const at::Tensor& sigma, c10::IntArrayRef matrices,
                                                       c10::ArrayRef<double> sigma_max, int64_t n_power_iterations,
                                                       double eps) {
  const char* op = kSpectralOp;
  DQN_CHECK(params.dim() == 1, op, ": params: expected a flat 1-D tensor, got shape ", shape_str(params.sizes()));
  const at::Device dev = params.device();
  DQN_CHECK(dev.is_cpu() || dev.is_cuda(), op, ": params: expected a CPU or CUDA tensor, got one on ", dev);
  const std::pair<const at::Tensor*, const char*> all[] = {
      {&params, "params"}, {&params_bf16, "params_bf16"}, {&u, "u"}, {&v, "v"}, {&sigma, "sigma"}};
  for (const auto& t : all) {
    check_device(*t.first, op, t.second, dev);
    check_contiguous(*t.first, op, t.second);
    DQN_CHECK(t.first->dim() == 1, op, ": ", t.second, ": expected a flat 1-D tensor, got shape ",
              shape_str(t.first->sizes()));
  }
  check_dtype(params, op, "params", at::kFloat);
  check_mirror_dtype(params_bf16, op, "params_bf16");
  check_dtype(u, op, "u", at::kFloat);
  check_dtype(v, op, "v", at::kFloat);
  check_dtype(sigma, op, "sigma", at::kFloat);
  check_shape(params_bf16, op, "params_bf16", {params.numel()});
  for (size_t i = 0; i < 5; ++i)
    for (size_t j = i + 1; j < 5; ++j) check_no_overlap(*all[i].first, all[i].second, *all[j].first, all[j].second, op);

  DQN_CHECK(matrices.size() % 3 == 0 && !matrices.empty(), op,
            ": matrices: expected (offset, rows, cols) for each matrix, a non-empty list whose length is a "
            "multiple of 3, got ", matrices.size(), " entries");
  const int64_t M = static_cast<int64_t>(matrices.size() / 3);
  DQN_CHECK(static_cast<int64_t>(sigma_max.size()) == M, op, ": sigma_max: expected one value per matrix (", M,
            "), got ", sigma_max.size());
  DQN_CHECK(n_power_iterations >= 1, op, ": n_power_iterations: expected >= 1, got ", n_power_iterations);
  DQN_CHECK(eps > 0, op, ": eps: expected a positive value, got ", std::to_string(eps));

  std::vector<SpectralMatrix> out;
  int64_t u_len = 0, v_len = 0;
  for (int64_t m = 0; m < M; ++m) {
    SpectralMatrix d;
    d.w_off = matrices[3 * m];
    d.rows = matrices[3 * m + 1];
    d.cols = matrices[3 * m + 2];
    DQN_CHECK(d.rows >= 1 && d.cols >= 1, op, ": matrices: matrix ", m, " has shape [", d.rows, ", ", d.cols,
              "]; a zero-size matrix has no spectral norm");
    DQN_CHECK(d.w_off >= 0 && d.w_off + d.rows * d.cols <= params.numel(), op, ": matrices: matrix ", m,
              " occupies [", d.w_off, ", ", d.w_off + d.rows * d.cols, ") of params, which has ", params.numel(),
              " elements");
    DQN_CHECK(sigma_max[m] > 0, op, ": sigma_max: expected positive values, got ", std::to_string(sigma_max[m]),
              " for matrix ", m);
    d.sigma_max = static_cast<float>(sigma_max[m]);
    d.u_off = u_len;
    d.v_off = v_len;
    u_len += d.rows;
    v_len += d.cols;
    out.push_back(d);
  }
  // Two matrices sharing elements would be rescaled twice, in an order that depends on the launch.
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const auto& d : out) spans.emplace_back(d.w_off, d.w_off + d.rows * d.cols);
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    DQN_CHECK(spans[i - 1].second <= spans[i].first, op, ": matrices: the matrices at offsets ", spans[i - 1].first,
              " and ", spans[i].first, " overlap");
  check_shape(u, op, "u (the left vectors of every matrix, one after the other)", {u_len});
  check_shape(v, op, "v (the right vectors of every matrix, one after the other)", {v_len});
  check_shape(sigma, op, "sigma", {M});
  return out;
}

}  // namespace dqn_ops
