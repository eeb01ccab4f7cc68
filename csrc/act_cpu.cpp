// CPU reference kernel of act: bf16_dueling_forward's network pieces (network_cpu.h, so the
// Q logits are its q_logits bit for bit), the expected Q of every action in double precision
// (as the CPU loss's double-DQN choice computes it; QR: the quantiles' mean), an ensemble's
// score of each action (mean + ucb * std over the members), the per-branch argmax (the first of
// equal maxima; a NaN wins, as torch.argmax), and epsilon-greedy on csrc/philox.h's stream layout;
// epsilon_greedy's CPU kernel (that exploration alone, over greedy actions given).
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "act_args.h"
#include "network_cpu.h"
#include "quantile_math.h"

namespace dqn_ops {
namespace cpu {
namespace {

using at::Tensor;

// Expected Q of one action's atoms x[0..atoms) (stride 1), in double: C51 sum_i softmax(x)_i
// z_i, max-shifted; QR the mean of the quantiles, summed in order; the Q value itself for one atom.
template <typename scalar_t>
double expected_q(const scalar_t* x, int64_t atoms, LossType type, double v_min, double dz) {
  if (atoms == 1) return double(x[0]);
  if (type == LossType::kQR || type == LossType::kIQN) return quantile_mean(x, atoms);
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < atoms; ++j) m = std::max(m, double(x[j]));
  double s = 0, sz = 0;
  for (int64_t j = 0; j < atoms; ++j) {
    const double e = std::exp(double(x[j]) - m);
    s += e;
    sz += e * (v_min + double(j) * dz);
  }
  return sz / s;
}

// act's score of one action (csrc/dqn_ops.cpp): x = member 0's atoms of the action, member e's
// `stride` elements after member e - 1's; qs: room for the members' expected Q (each computed
// once). Writes mean_e Q_e to *mean and returns mean_e Q_e + ucb * std_e Q_e (population std,
// two passes in double). One member: its Q itself, whatever ucb (no sum: act's bits without
// members, -0 included); ucb = 0: the mean (no std, which a non-finite Q would make NaN).
template <typename scalar_t>
double ensemble_score(const scalar_t* x, int64_t stride, int64_t atoms, LossType type, double v_min, double dz,
                      double ucb, std::vector<double>& qs, double* mean) {
  const int64_t members = static_cast<int64_t>(qs.size());
  for (int64_t e = 0; e < members; ++e) qs[e] = expected_q(x + e * stride, atoms, type, v_min, dz);
  double sum = qs[0];
  for (int64_t e = 1; e < members; ++e) sum += qs[e];
  *mean = members == 1 ? sum : sum / double(members);
  if (members == 1 || ucb == 0) return *mean;
  double sq = 0;
  for (int64_t e = 0; e < members; ++e) {
    const double dev = qs[e] - *mean;
    sq += dev * dev;
  }
  return *mean + ucb * std::sqrt(sq / double(members));
}

// q [N, E * total_actions, slots] (contiguous; member e's branch d at rows e * total_actions +
// off_d, E = L.members; slots: the atoms, or IQN's fractions) -> greedy actions and their mean
// expected Q over the members [N, D].
template <typename scalar_t>
void greedy(const Tensor& q, const NetLayout& L, LossType type, double v_min, double dz, double ucb, int64_t* act,
            scalar_t* greedy_q) {
  const int64_t N = q.size(0), A = L.total_actions, NA = q.size(2), D = L.num_branches(), E = L.members;
  const scalar_t* x = q.data_ptr<scalar_t>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<double> qs(E);
    for (int64_t b = begin; b < end; ++b)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t off = L.action_offsets[d], n = L.branch_sizes[d];
        int64_t arg = 0;
        double best = -std::numeric_limits<double>::infinity(), best_mean = best;
        for (int64_t a = 0; a < n; ++a) {
          double mean;
          const double score =
              ensemble_score(x + (b * E * A + off + a) * NA, A * NA, NA, type, v_min, dz, ucb, qs, &mean);
          if (score > best || std::isnan(score)) {  // first of equal maxima; the first NaN wins
            best = score;
            best_mean = mean;
            arg = a;
            if (std::isnan(score)) break;
          }
        }
        act[b * D + d] = arg;
        greedy_q[b * D + d] = static_cast<scalar_t>(best_mean);  // F32: rounds (overflow gives inf)
      }
  });
}

std::tuple<Tensor, Tensor> act_cpu(const Tensor& states, const Tensor& params, const Tensor& params_bf16,
                                   c10::IntArrayRef layout, double v_min, double v_max, const Tensor& epsilon,
                                   Tensor& rng, c10::string_view loss_type, double ucb,
                                   const c10::optional<Tensor>& fractions) {
  const NetLayout L = parse_layout(layout, kActOp);
  const auto [type, slots] = check_act_args(states, params, params_bf16, L, v_min, v_max, epsilon, rng,
                                            std::string(loss_type), ucb, fractions);
  const int64_t N = states.size(0), D = L.num_branches();
  Tensor actions = at::empty({N, D}, states.options().dtype(at::kLong));
  Tensor greedy_q = at::empty({N, D}, params.options());
  if (N == 0) return {actions, greedy_q};  // no draws: rng unchanged

  // bf16_dueling_forward's CPU kernel, stopped at q_logits.
  const NetViews p(params, params_bf16);
  const Tensor x = states.to(params_bf16.scalar_type());
  // IQN: every row at the same K fractions.
  const c10::optional<Tensor> row_fractions =
      L.iqn() ? c10::optional<Tensor>(fractions->expand({N, slots}).contiguous()) : c10::nullopt;
  const Tensor last = hidden_layers(x, p, L, row_fractions).back();
  Tensor q = dueling_aggregate(head_from_logits(output_logits(last, p, L), params, L), L);
  q = L.iqn() ? fractions_to_slots(q, slots) : q.contiguous();
  TORCH_INTERNAL_ASSERT(q.size(1) == L.q_rows(), "act: q_logits of ", q.size(1), " rows, expected ", L.members,
                        " members of ", L.total_actions, " actions");

  int64_t* act = actions.data_ptr<int64_t>();
  const double dz = support_step(v_min, v_max, L.atoms);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dqn_ops.act", [&] {
    greedy<scalar_t>(q, L, type, v_min, dz, ucb, act, greedy_q.data_ptr<scalar_t>());
  });

  int64_t* r = rng.data_ptr<int64_t>();
  const uint64_t seed = static_cast<uint64_t>(r[0]), call = static_cast<uint64_t>(r[1]);
  const float eps = *epsilon.data_ptr<float>();
  for (int64_t b = 0; b < N; ++b)
    explore_row(seed, call, static_cast<uint32_t>(b), eps, L.branch_sizes, D, act + b * D);
  r[1] = static_cast<int64_t>(call + 1);  // wraps as the unsigned counter it is
  return {actions, greedy_q};
}

// epsilon_greedy: a copy of the greedy actions, each row explored as act explores it.
Tensor epsilon_greedy_cpu(const Tensor& greedy, c10::IntArrayRef branches, const Tensor& epsilon, Tensor& rng) {
  check_epsilon_greedy_args(greedy, branches, epsilon, rng);
  Tensor actions = greedy.clone();
  const int64_t N = greedy.size(0), D = static_cast<int64_t>(branches.size());
  if (N == 0) return actions;  // no draws: rng unchanged
  int64_t* r = rng.data_ptr<int64_t>();
  const uint64_t seed = static_cast<uint64_t>(r[0]), call = static_cast<uint64_t>(r[1]);
  const float eps = *epsilon.data_ptr<float>();
  int64_t* act = actions.data_ptr<int64_t>();
  for (int64_t b = 0; b < N; ++b) explore_row(seed, call, static_cast<uint32_t>(b), eps, branches, D, act + b * D);
  r[1] = static_cast<int64_t>(call + 1);
  return actions;
}

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(dqn_ops, CPU, m) {
  m.impl("act", &cpu::act_cpu);
  m.impl("epsilon_greedy", &cpu::epsilon_greedy_cpu);
}

}  // namespace dqn_ops
