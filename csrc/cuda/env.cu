// _futures_env_step and _futures_env_reset on CUDA: one thread per environment runs
// env::step_one / env::write_observation (env_math.h, the CPU kernel's arithmetic), so a step of
// FuturesTradingEnv is one kernel launch that reads and writes device tensors only: a CUDA graph
// replays it with the market, the ring's head, the episode clocks and the random stream all
// advancing on the device.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "env_args.h"
#include "pdl.cuh"

namespace dqn_ops {
namespace cuda {
namespace {

using at::Tensor;

constexpr int kEnvThreads = 128;

__global__ void futures_env_step_kernel(int64_t n, const int64_t* __restrict__ actions, float* __restrict__ state,
                                        int64_t* __restrict__ counters, float* __restrict__ ring,
                                        float* __restrict__ obs, float* __restrict__ info, const env::Params p) {
  pdl_enter();
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  const env::StepOut out{obs + e * env::kStateDim, obs + (n + e) * env::kStateDim, info + e, info + n + e,
                         info + 2 * n + e, info + 3 * n + e, info + 4 * n + e};
  env::step_one(e, actions + e * env::kNumBranches, state + e, state + n + e, state + 2 * n + e, counters + e,
                counters + n + e, ring + e * env::kHistory, p, out);
}

__global__ void futures_env_reset_kernel(int64_t n, float* __restrict__ state, int64_t* __restrict__ counters,
                                         const float* __restrict__ ring, float* __restrict__ obs, float scale,
                                         float left) {
  pdl_enter();
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  state[2 * n + e] = 0.0f;
  counters[n + e] = 0;
  env::write_observation(ring + e * env::kHistory, counters[e], scale, obs + (n + e) * env::kStateDim, 0.0f, left,
                         nullptr, 0.0f, 0.0f);
}

unsigned int blocks_for(int64_t n) { return static_cast<unsigned int>((n + kEnvThreads - 1) / kEnvThreads); }

void futures_env_step_cuda(const Tensor& actions, Tensor& state, Tensor& counters, Tensor& returns,
                           Tensor& observations, Tensor& info, int64_t seed, int64_t episode_length, double kappa,
                           double trend, double sigma, double sigma_fair, double switch_prob, double cost) {
  const env::Params p = check_env_step_args(actions, state, counters, returns, observations, info, seed,
                                            episode_length, kappa, trend, sigma, sigma_fair, switch_prob, cost);
  const c10::cuda::CUDAGuard guard(state.device());
  const int64_t n = state.size(1);
  launch(futures_env_step_kernel, blocks_for(n), kEnvThreads, 0, at::cuda::getCurrentCUDAStream(), n,
         actions.data_ptr<int64_t>(), state.data_ptr<float>(), counters.data_ptr<int64_t>(), returns.data_ptr<float>(),
         observations.data_ptr<float>(), info.data_ptr<float>(), p);
}

void futures_env_reset_cuda(Tensor& state, Tensor& counters, const Tensor& returns, Tensor& observations,
                            double sigma, int64_t episode_length) {
  const char* op = kEnvResetOp;
  const int64_t n = check_env_tensors(op, state, counters, returns, observations);
  check_episode_length(episode_length, op);
  const float scale = checked_scale(sigma, op);
  const c10::cuda::CUDAGuard guard(state.device());
  launch(futures_env_reset_kernel, blocks_for(n), kEnvThreads, 0, at::cuda::getCurrentCUDAStream(), n,
         state.data_ptr<float>(), counters.data_ptr<int64_t>(), returns.data_ptr<float>(),
         observations.data_ptr<float>(), scale, env::time_left(0, episode_length));
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) {
  m.impl("_futures_env_step", &cuda::futures_env_step_cuda);
  m.impl("_futures_env_reset", &cuda::futures_env_reset_cuda);
}

}  // namespace dqn_ops
