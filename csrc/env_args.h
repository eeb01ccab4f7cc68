// Argument validation of _futures_env_step and _futures_env_reset, shared by the CPU and CUDA
// kernels (the step itself: env_math.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <ATen/ATen.h>

#include "checks.h"
#include "env_math.h"

namespace dqn_ops {

constexpr const char* kEnvStepOp = "dqn_ops._futures_env_step";
constexpr const char* kEnvResetOp = "dqn_ops._futures_env_reset";
constexpr int kEnvStateRows = 3;  // gap, regime, position
constexpr int kEnvCounterRows = 2;  // steps, clock
constexpr int kEnvInfoRows = 5;  // reward, terminated, truncated, pnl, traded

// The environment's tensors, on state's device, contiguous, none sharing memory with another:
// state [3, N] F32, counters [2, N] int64, returns [N, kHistory] F32, observations
// [2, N, kStateDim] F32. Returns N.
inline int64_t check_env_tensors(const char* op, const at::Tensor& state, const at::Tensor& counters,
                                 const at::Tensor& returns, const at::Tensor& observations) {
  const at::Device dev = state.device();
  check_tensor(state, op, "state", dev, at::kFloat, {kEnvStateRows, -1});
  const int64_t n = state.size(1);
  DQN_CHECK(n >= 1, op, ": state: expected at least one environment, got shape ", shape_str(state.sizes()));
  DQN_CHECK(n <= std::numeric_limits<int32_t>::max(), op, ": at most 2^31 - 1 environments, got ", n);
  check_tensor(counters, op, "counters", dev, at::kLong, {kEnvCounterRows, n});
  check_tensor(returns, op, "returns", dev, at::kFloat, {n, env::kHistory});
  check_tensor(observations, op, "observations", dev, at::kFloat, {2, n, env::kStateDim});
  check_no_overlap(state, "state", counters, "counters", op);
  check_no_overlap(state, "state", returns, "returns", op);
  check_no_overlap(state, "state", observations, "observations", op);
  check_no_overlap(counters, "counters", returns, "returns", op);
  check_no_overlap(counters, "counters", observations, "observations", op);
  check_no_overlap(returns, "returns", observations, "observations", op);
  return n;
}

inline float checked_finite(double v, const char* op, const char* name) {
  DQN_CHECK(std::isfinite(v), op, ": ", name, ": expected a finite number, got ", std::to_string(v));
  return static_cast<float>(v);
}

inline void check_episode_length(int64_t episode_length, const char* op) {
  DQN_CHECK(episode_length >= 1, op, ": episode_length: expected >= 1, got ", episode_length);
}

// sigma > 0: the features are in units of sigma.
inline float checked_scale(double sigma, const char* op) {
  checked_finite(sigma, op, "sigma");
  DQN_CHECK(sigma > 0.0, op, ": sigma: expected > 0, got ", std::to_string(sigma));
  return static_cast<float>(1.0 / sigma);
}

// actions [N, 3] int64 besides the environment's tensors; info [5, N] F32; the model's numbers
// finite, sigma > 0, episode_length >= 1. Returns the kernel's parameters.
inline env::Params check_env_step_args(const at::Tensor& actions, const at::Tensor& state, const at::Tensor& counters,
                                       const at::Tensor& returns, const at::Tensor& observations,
                                       const at::Tensor& info, int64_t seed, int64_t episode_length, double kappa,
                                       double trend, double sigma, double sigma_fair, double switch_prob,
                                       double cost) {
  const char* op = kEnvStepOp;
  const int64_t n = check_env_tensors(op, state, counters, returns, observations);
  check_tensor(actions, op, "actions", state.device(), at::kLong, {n, env::kNumBranches});
  check_tensor(info, op, "info", state.device(), at::kFloat, {kEnvInfoRows, n});
  check_no_overlap(info, "info", state, "state", op);
  check_no_overlap(info, "info", counters, "counters", op);
  check_no_overlap(info, "info", returns, "returns", op);
  check_no_overlap(info, "info", observations, "observations", op);
  // the actions are read while the outputs are written: no byte of them may be one of theirs
  check_no_overlap(actions, "actions", counters, "counters", op);
  check_no_overlap(actions, "actions", state, "state", op);
  check_no_overlap(actions, "actions", returns, "returns", op);
  check_no_overlap(actions, "actions", observations, "observations", op);
  check_no_overlap(actions, "actions", info, "info", op);
  check_episode_length(episode_length, op);
  env::Params p{};
  p.seed = static_cast<uint64_t>(seed);
  p.episode_length = episode_length;
  p.kappa = checked_finite(kappa, op, "kappa");
  p.trend = checked_finite(trend, op, "trend");
  p.sigma_fair = checked_finite(sigma_fair, op, "sigma_fair");
  p.switch_prob = checked_finite(switch_prob, op, "switch_prob");
  p.cost = checked_finite(cost, op, "cost");
  p.scale = checked_scale(sigma, op);
  p.sigma = static_cast<float>(sigma);
  return p;
}

// The CPU kernel reads the actions anyway, so it rejects an index outside [0, 3) naming the
// branch (the CUDA kernel cannot without a host sync: see env::step_one).
inline void check_actions_in_range(const at::Tensor& actions) {
  const int64_t* a = actions.data_ptr<int64_t>();
  const int64_t n = actions.size(0);
  for (int d = 0; d < env::kNumBranches; ++d) {
    int64_t lo = a[d], hi = a[d];
    for (int64_t i = 1; i < n; ++i) {
      const int64_t v = a[i * env::kNumBranches + d];
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
    DQN_CHECK(lo >= 0 && hi < env::kActionsPerBranch, kEnvStepOp, ": actions[:, ", d, "]: expected values in [0, ",
              env::kActionsPerBranch, "), got values in [", lo, ", ", hi, "]");
  }
}

}  // namespace dqn_ops
