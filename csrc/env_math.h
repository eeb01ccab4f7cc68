// The step of the synthetic futures market (dqn_ops/rl/envs.py, FuturesTradingEnv) for one
// environment, shared by the CPU reference and the CUDA kernel so both run the same formula in
// the same order; tests/test_envs.py has the same step in float64 Python.
//
// Per environment the op keeps (all device tensors, nothing on the host):
//   gap      = f - x, the fair value's lead over the log price: the market's dynamics and the
//              features depend on x only through gap and the returns, and gap is stationary, so
//              a market that runs forever keeps its precision (x itself drifts without bound);
//   regime   in {-1, 0, +1}, position (contracts), both F32;
//   steps    the market's step counter: the Philox `call` of its draws and the ring's head;
//   clock    the steps taken in the current episode;
//   ring     the last kHistory returns, ring[steps % kHistory] the slot the next return takes.
// The observation's price-window features (x minus the mean of the last w log prices) come
// from the returns: x_t - x_{t-k} is the sum of the last k returns, so no price ring is kept.
#pragma once

#include <cmath>
#include <cstdint>

#include "philox.h"

namespace dqn_ops {
namespace env {

constexpr int kNumBranches = 3;      // direction, size, speed
constexpr int kActionsPerBranch = 3;
constexpr int kLookback = 84;        // returns in the observation
constexpr int kHistory = 84;         // ring length: max(kLookback, MA and momentum windows)
constexpr int kMaxWindow = 50;       // the longest MA / momentum window
constexpr int kVolWindow = 20;
constexpr int kNumMa = 4, kNumMom = 4;
constexpr int kStateDim = kLookback + kNumMa + kNumMom + 4;  // + position, vol, time left, zero
static_assert(kHistory >= kLookback && kHistory >= kMaxWindow && kHistory >= kVolWindow, "ring too short");

// Unrolled in device code: the loops' trip counts are constants, so the history stays in
// registers (constant indices), a thread issues its ring loads together instead of one latency
// at a time, and the window tests fold away.
#if defined(__CUDA_ARCH__)
#define DQN_ENV_UNROLL _Pragma("unroll")
#else
#define DQN_ENV_UNROLL
#endif

// Philox slots of one environment's market step (key = seed, call = steps, row = env): one
// 4-word block.
constexpr uint32_t kSlotSwitch = 0;  // uniform: the regime switches when below switch_prob
constexpr uint32_t kSlotRegime = 1;  // the new regime, below(bits, 3) - 1
constexpr uint32_t kSlotRadius = 2;  // Box-Muller: u1 = 1 - uniform, in (0, 1]
constexpr uint32_t kSlotAngle = 3;   // Box-Muller: u2 = uniform; eps = r cos(2 pi u2), eta = r sin(2 pi u2)

// The action tables (envs.py's DIRECTIONS, SIZES, SPEEDS); an index outside [0, 3) is rejected
// before these are read.
DQN_OPS_HD float direction(int64_t a) { return a == 0 ? -1.0f : (a == 1 ? 0.0f : 1.0f); }
DQN_OPS_HD float size(int64_t a) { return a == 0 ? 0.5f : (a == 1 ? 1.0f : 2.0f); }
DQN_OPS_HD float speed(int64_t a) { return a == 0 ? 1.0f : (a == 1 ? 0.5f : 0.25f); }
DQN_OPS_HD bool in_range(int64_t a) { return a >= 0 && a < kActionsPerBranch; }

// The windows of the MA-deviation and momentum features, by index (device code cannot index a
// host array).
DQN_OPS_HD int ma_window(int i) { return i == 0 ? 5 : (i == 1 ? 10 : (i == 2 ? 20 : 50)); }
DQN_OPS_HD int mom_window(int i) { return i == 0 ? 5 : (i == 1 ? 10 : (i == 2 ? 20 : 40)); }

struct Params {
  uint64_t seed;
  int64_t episode_length;
  float kappa, trend, sigma, sigma_fair, switch_prob, cost;
  float scale;  // 1 / sigma: features in units of the return noise
};

// The fraction of the episode left after `clock` steps, as the old host-side 1 - t / T (in double).
DQN_OPS_HD float time_left(int64_t clock, int64_t episode_length) {
  return static_cast<float>(1.0 - static_cast<double>(clock) / static_cast<double>(episode_length));
}

// Writes one environment's observation (kStateDim floats) for each non-null `out`, with that
// row's position and time left: the last kLookback returns, oldest first; x minus the mean of
// the last w log prices (w in 5, 10, 20, 50); the sum of the last w returns (w in 5, 10, 20,
// 40); position; the sample std of the last 20 returns; time left; 0. Returns and windows are
// scaled by `scale`. `steps` = the returns written so far (the newest is at (steps - 1) % kHistory).
DQN_OPS_HD void write_observation(const float* ring, int64_t steps, float scale, float* out_a, float position_a,
                                  float left_a, float* out_b, float position_b, float left_b) {
  // The history, oldest first, at constant indices: registers in device code, every load
  // issued before the first store.
  float h[kHistory];
  const int oldest = static_cast<int>(steps % kHistory);
  DQN_ENV_UNROLL
  for (int j = 0; j < kHistory; ++j) {
    const int at = oldest + j;
    h[j] = ring[at < kHistory ? at : at - kHistory];
  }
  DQN_ENV_UNROLL
  for (int j = 0; j < kLookback; ++j) {
    const float v = h[kHistory - kLookback + j] * scale;
    out_a[j] = v;
    if (out_b != nullptr) out_b[j] = v;
  }
  // Newest to oldest: after k returns, s = x_t - x_{t-k} and dev = sum_{m<k} (x_t - x_{t-m}).
  float s = 0.0f, dev = 0.0f, s_vol = 0.0f;
  int next_ma = 0, next_mom = 0;
  DQN_ENV_UNROLL
  for (int k = 1; k <= kMaxWindow; ++k) {
    dev += s;
    s += h[kHistory - k];
    if (next_ma < kNumMa && k == ma_window(next_ma)) {
      const float v = dev / static_cast<float>(k) * scale;
      out_a[kLookback + next_ma] = v;
      if (out_b != nullptr) out_b[kLookback + next_ma] = v;
      ++next_ma;
    }
    if (next_mom < kNumMom && k == mom_window(next_mom)) {
      const float v = s * scale;
      out_a[kLookback + kNumMa + next_mom] = v;
      if (out_b != nullptr) out_b[kLookback + kNumMa + next_mom] = v;
      ++next_mom;
    }
    if (k == kVolWindow) s_vol = s;
  }
  const float mean = s_vol / static_cast<float>(kVolWindow);
  float ss = 0.0f;
  DQN_ENV_UNROLL
  for (int k = 1; k <= kVolWindow; ++k) {
    const float d = h[kHistory - k] - mean;
    ss += d * d;
  }
  const float vol = sqrtf(ss / static_cast<float>(kVolWindow - 1)) * scale;
  constexpr int tail = kLookback + kNumMa + kNumMom;
  out_a[tail] = position_a;
  out_a[tail + 1] = vol;
  out_a[tail + 2] = left_a;
  out_a[tail + 3] = 0.0f;
  if (out_b != nullptr) {
    out_b[tail] = position_b;
    out_b[tail + 1] = vol;
    out_b[tail + 2] = left_b;
    out_b[tail + 3] = 0.0f;
  }
}

// Where one environment's step writes (row `env` of each output).
struct StepOut {
  float* next_obs;  // the observation the action led to (terminal at an episode end)
  float* obs;       // the observation to act on next (a new episode's first one after an end)
  float *reward, *terminated, *truncated, *pnl, *traded;
};

// One environment's step: trade towards the action's target position, move the market one step,
// book the PnL, advance the episode clock, and end the episode (position and clock to 0, the
// market running on) at episode_length. An action outside [0, 3) in any branch (possible on CUDA
// only: the CPU kernel rejects it first) trades nothing and makes pnl and reward NaN, which the
// training step's non-finite check reports.
DQN_OPS_HD void step_one(int64_t env, const int64_t* action, float* gap, float* regime, float* position, int64_t* steps,
                         int64_t* clock, float* ring, const Params& p, const StepOut& out) {
  const int64_t a_dir = action[0], a_size = action[1], a_speed = action[2];
  const bool valid = in_range(a_dir) && in_range(a_size) && in_range(a_speed);
  float pos = *position, traded = 0.0f;
  if (valid) {
    const float target = direction(a_dir) * size(a_size);
    const float next = pos + speed(a_speed) * (target - pos);
    traded = fabsf(next - pos);
    pos = next;
  }

  const int64_t call = *steps;
  const uint32_t row = static_cast<uint32_t>(env);
  float reg = *regime;
  if (philox::uniform(philox::draw(philox::Stream::kEnv, p.seed, call, row, kSlotSwitch)) < p.switch_prob) {
    const uint32_t bits = philox::draw(philox::Stream::kEnv, p.seed, call, row, kSlotRegime);
    reg = static_cast<float>(philox::below(bits, 3) - 1);
  }
  const float u1 = 1.0f - philox::uniform(philox::draw(philox::Stream::kEnv, p.seed, call, row, kSlotRadius));
  const float u2 = philox::uniform(philox::draw(philox::Stream::kEnv, p.seed, call, row, kSlotAngle));
  const float radius = sqrtf(-2.0f * logf(u1));
  const float angle = 6.28318530717958647692f * u2;
  const float eps = radius * cosf(angle), eta = radius * sinf(angle);
  const float g = *gap;
  const float r = p.kappa * g + p.trend * reg + p.sigma * eps;  // x' = x + r
  *gap = g - r + p.sigma_fair * eta;                             // f' = f + sigma_f eta
  *regime = reg;
  ring[call % kHistory] = r;
  const int64_t written = call + 1;
  *steps = written;

  const float pnl = valid ? pos * r - p.cost * traded : NAN;
  *out.pnl = pnl;
  *out.reward = 100.0f * pnl;
  *out.traded = traded;
  const int64_t c = *clock + 1;
  const bool done = c >= p.episode_length;
  *out.terminated = done ? 1.0f : 0.0f;
  *out.truncated = 0.0f;  // the time left is observed: the end is a termination
  write_observation(ring, written, p.scale, out.next_obs, pos, time_left(c, p.episode_length), out.obs,
                    done ? 0.0f : pos, done ? 1.0f : time_left(c, p.episode_length));
  *position = done ? 0.0f : pos;
  *clock = done ? 0 : c;
}

}  // namespace env
}  // namespace dqn_ops
