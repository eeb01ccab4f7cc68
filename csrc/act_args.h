// Argument validation of act, shared by the CPU and CUDA kernels, and the arithmetic both
// backends share: the C51 support and the epsilon-greedy draw (csrc/philox.h's stream layout).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "checks.h"
#include "layout.h"
#include "loss_args.h"
#include "network_args.h"
#include "philox.h"

namespace dqn_ops {

constexpr const char* kActOp = "dqn_ops.act";

// philox::draw's row is a 32-bit word: more rows would repeat another row's numbers.
constexpr int64_t kActMaxRows = int64_t(1) << 32;

// states [N, SD] (N >= 0) with params / params_bf16 as bf16_dueling_forward takes them (its
// checks, in its order, but for the batch size: N = 0 is an empty call here);
// epsilon: one F32 element, rng: int64 [2] = (seed, call counter), both on the states' device;
// loss_type: how the outputs become Q-values (dqn_loss's names: 'c51' the expected value over
// the support, 'qr' the mean of the quantiles, 'mse' / 'huber' one atom, the Q-value itself);
// v_min < v_max, both finite, for C51 with atoms > 1 (anything else ignores them); ucb finite,
// either sign (csrc/dqn_ops.cpp: Inf times a std of 0 would be NaN); an IQN network acts with
// loss_type 'iqn' on fractions [K] shared by every row (check_fractions), any other takes none.
// Returns the parsed loss type and the slots each action's expected Q averages or weighs: the
// atoms, or IQN's K fractions.
struct ActKind {
  LossType type;
  int64_t slots;
};
inline ActKind check_act_args(const at::Tensor& states, const at::Tensor& params, const at::Tensor& params_bf16,
                              const NetLayout& L, double v_min, double v_max, const at::Tensor& epsilon,
                              const at::Tensor& rng, const std::string& loss_type, double ucb,
                              const c10::optional<at::Tensor>& fractions) {
  const char* op = kActOp;
  const LossType type = parse_loss_type(loss_type, op, /*takes_iqn=*/true);
  DQN_CHECK((type == LossType::kIQN) == L.iqn(), op, ": loss_type '", loss_type, "': ",
            L.iqn() ? "an IQN network (iqn_embedding > 0) acts with loss_type 'iqn'"
                    : "'iqn' needs an IQN network (iqn_embedding > 0)");
  DQN_CHECK(std::isfinite(ucb), op, ": ucb: expected a finite value (either sign), got ", std::to_string(ucb));
  check_params(params, params_bf16, L, op);
  check_tensor(states, op, "states", params.device(), params.scalar_type(), {-1, L.state_dim});
  DQN_CHECK(states.size(0) < kActMaxRows, op, ": states: at most ", kActMaxRows - 1, " rows (philox's row is 32 bits), got ",
            states.size(0));
  check_device(epsilon, op, "epsilon", states.device());
  check_dtype(epsilon, op, "epsilon", at::kFloat);
  DQN_CHECK(epsilon.numel() == 1, op, ": epsilon: expected one element, got shape ", shape_str(epsilon.sizes()));
  check_tensor(rng, op, "rng", states.device(), at::kLong, {2});
  // rng is written after every input is read, but an epsilon inside it would change with it.
  check_no_overlap(rng, "rng", epsilon, "epsilon", op);
  if (type != LossType::kC51) check_loss_fits_atoms(op, type, L.atoms, loss_type);  // C51 also reads 1 atom
  if (type == LossType::kC51 && L.atoms > 1) {
    DQN_CHECK(std::isfinite(v_min) && std::isfinite(v_max) && v_min < v_max, op,
              ": v_min must be below v_max, both finite (the C51 support of ", L.atoms, " atoms), got v_min=",
              std::to_string(v_min), ", v_max=", std::to_string(v_max));
  }
  const int64_t K = check_fractions(fractions, params, L, op, {-1});
  return {type, L.iqn() ? K : L.atoms};
}

// The distance between two atoms of the C51 support z_i = v_min + i * dz (0 for one atom).
inline double support_step(double v_min, double v_max, int64_t atoms) {
  return atoms > 1 ? (v_max - v_min) / double(atoms - 1) : 0.0;
}

// Epsilon-greedy on the stream layout of csrc/philox.h: row n explores iff
// uniform(draw(seed, call, n, 0)) < epsilon (so epsilon <= 0 never explores, >= 1 always, NaN
// never: every comparison with NaN is false); exploring, branch d takes
// below(draw(seed, call, n, 1 + d), n_d).
DQN_OPS_HD bool act_explores(uint64_t seed, uint64_t call, uint32_t row, float epsilon) {
  return philox::uniform(philox::draw(philox::Stream::kAct, seed, call, row, 0)) < epsilon;
}
DQN_OPS_HD int64_t act_random_action(uint64_t seed, uint64_t call, uint32_t row, int64_t branch, int64_t actions) {
  return philox::below(philox::draw(philox::Stream::kAct, seed, call, row, static_cast<uint32_t>(1 + branch)),
                       actions);
}

// Row `row`'s epsilon-greedy actions in place: actions[0..D) hold its greedy actions; when the
// row explores, branch d's becomes act_random_action(..., d, sizes[d]). act's CPU kernel and
// epsilon_greedy's kernels (both backends) apply it; act's CUDA epilogue calls the same two
// functions (act_explores, then act_random_action per branch).
template <typename Sizes>
DQN_OPS_HD void explore_row(uint64_t seed, uint64_t call, uint32_t row, float epsilon, const Sizes& sizes, int64_t D,
                            int64_t* actions) {
  if (!act_explores(seed, call, row, epsilon)) return;
  for (int64_t d = 0; d < D; ++d) actions[d] = act_random_action(seed, call, row, d, sizes[d]);
}

constexpr const char* kEpsilonGreedyOp = "dqn_ops.epsilon_greedy";
// The CUDA kernels' branch table holds 256 branches (csrc/cuda/branch_table.cuh); both backends
// take the same inputs. philox::below reaches at most 2^24 distinct actions (a 24-bit uniform).
constexpr int64_t kEpsilonGreedyMaxBranches = 256;
constexpr int64_t kEpsilonGreedyMaxActions = int64_t(1) << 24;

// epsilon_greedy: greedy int64 [N, D] (any backend's greedy actions; passed through unread
// where a row does not explore), branches: the D >= 1 branch sizes (each >= 1), epsilon and rng
// as act takes them, all on greedy's device.
inline void check_epsilon_greedy_args(const at::Tensor& greedy, c10::IntArrayRef branches, const at::Tensor& epsilon,
                                      const at::Tensor& rng) {
  const char* op = kEpsilonGreedyOp;
  DQN_CHECK(!branches.empty() && static_cast<int64_t>(branches.size()) <= kEpsilonGreedyMaxBranches, op,
            ": branches: expected 1 to ", kEpsilonGreedyMaxBranches, " branch sizes, got ", branches.size());
  for (size_t d = 0; d < branches.size(); ++d)
    DQN_CHECK(branches[d] >= 1 && branches[d] <= kEpsilonGreedyMaxActions, op,
              ": branches: expected every branch size in [1, ", kEpsilonGreedyMaxActions, "], got ", branches[d],
              " at branch ", d);
  const int64_t D = static_cast<int64_t>(branches.size());
  check_tensor(greedy, op, "greedy", greedy.device(), at::kLong, {-1, D});
  DQN_CHECK(greedy.size(0) < kActMaxRows, op, ": greedy: at most ", kActMaxRows - 1,
            " rows (philox's row is 32 bits), got ", greedy.size(0));
  check_device(epsilon, op, "epsilon", greedy.device());
  check_dtype(epsilon, op, "epsilon", at::kFloat);
  DQN_CHECK(epsilon.numel() == 1, op, ": epsilon: expected one element, got shape ", shape_str(epsilon.sizes()));
  check_tensor(rng, op, "rng", greedy.device(), at::kLong, {2});
  check_no_overlap(rng, "rng", epsilon, "epsilon", op);
}

}  // namespace dqn_ops
