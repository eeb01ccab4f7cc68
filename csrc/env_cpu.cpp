// CPU kernels of _futures_env_step and _futures_env_reset: env::step_one / env::write_observation
// (env_math.h) for each environment, the arithmetic of the CUDA kernel.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "env_args.h"

namespace dqn_ops {
namespace {

using at::Tensor;

void futures_env_step_cpu(const Tensor& actions, Tensor& state, Tensor& counters, Tensor& returns,
                          Tensor& observations, Tensor& info, int64_t seed, int64_t episode_length, double kappa,
                          double trend, double sigma, double sigma_fair, double switch_prob, double cost) {
  const env::Params p = check_env_step_args(actions, state, counters, returns, observations, info, seed,
                                            episode_length, kappa, trend, sigma, sigma_fair, switch_prob, cost);
  check_actions_in_range(actions);
  const int64_t n = state.size(1);
  const int64_t* a = actions.data_ptr<int64_t>();
  float* s = state.data_ptr<float>();
  int64_t* c = counters.data_ptr<int64_t>();
  float* ring = returns.data_ptr<float>();
  float* obs = observations.data_ptr<float>();
  float* inf = info.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const env::StepOut out{obs + e * env::kStateDim, obs + (n + e) * env::kStateDim, inf + e, inf + n + e,
                             inf + 2 * n + e, inf + 3 * n + e, inf + 4 * n + e};
      env::step_one(e, a + e * env::kNumBranches, s + e, s + n + e, s + 2 * n + e, c + e, c + n + e,
                    ring + e * env::kHistory, p, out);
    }
  });
}

void futures_env_reset_cpu(Tensor& state, Tensor& counters, const Tensor& returns, Tensor& observations,
                           double sigma, int64_t episode_length) {
  const char* op = kEnvResetOp;
  const int64_t n = check_env_tensors(op, state, counters, returns, observations);
  check_episode_length(episode_length, op);
  const float scale = checked_scale(sigma, op);
  float* position = state.data_ptr<float>() + 2 * n;
  int64_t* c = counters.data_ptr<int64_t>();
  const float* ring = returns.data_ptr<float>();
  float* obs = observations.data_ptr<float>() + n * env::kStateDim;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      position[e] = 0.0f;
      c[n + e] = 0;
      env::write_observation(ring + e * env::kHistory, c[e], scale, obs + e * env::kStateDim, 0.0f,
                             env::time_left(0, episode_length), nullptr, 0.0f, 0.0f);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(dqn_ops, CPU, m) {
  m.impl("_futures_env_step", &futures_env_step_cpu);
  m.impl("_futures_env_reset", &futures_env_reset_cpu);
}

}  // namespace dqn_ops
