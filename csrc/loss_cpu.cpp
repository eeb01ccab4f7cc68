// CPU reference kernels of dqn_loss (one sample after the other; C51, QR and IQN in double precision,
// MSE / Huber in F32 as on CUDA, so that both devices overflow alike; an ensemble's members one
// after the other within a sample, each its own double-DQN learner, csrc/dqn_ops.cpp) and of
// _dqn_loss_on_logits (the output bias, the dueling aggregation (q = the branch logits without
// dueling), dqn_loss and the aggregation's backward: network_cpu.h's pieces around the same loss).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "layout.h"
#include "loss_args.h"
#include "network_cpu.h"
#include "quantile_math.h"

namespace dqn_ops {
namespace {

using at::Tensor;

// softmax of x[0..n) into p (max-shifted); returns log-sum-exp.
double softmax(const float* x, int64_t n, std::vector<double>& p) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, double(x[j]));
  double s = 0;
  for (int64_t j = 0; j < n; ++j) s += (p[j] = std::exp(double(x[j]) - m));
  for (int64_t j = 0; j < n; ++j) p[j] /= s;
  return m + std::log(s);
}

// A double into F32 as IEEE rounding does it: out of range gives +-inf (a plain cast is undefined
// there, and Tensor::fill_ refuses it with "cannot be converted to type float without overflow").
float to_f32(double v) {
  constexpr double kMax = std::numeric_limits<float>::max();
  if (std::isnan(v) || std::abs(v) <= kMax) return static_cast<float>(v);
  return v > 0 ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity();
}

// A float as the shortest text that reads back as the same value (9 significant digits at
// most): an error names the value itself (std::to_string's fixed 6 decimals shows -1e-9 as -0.000000).
std::string float_str(float v) {
  char buf[32];
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, double(v));
    if (std::strtof(buf, nullptr) == v || v != v) break;
  }
  return buf;
}

// The row of member e's action a of branch d (at offset off) of sample b in q [B, E * A, atoms]:
// [B, E * A] is [B * E, A], member e of sample b its row b * E + e.
inline int64_t q_row(const LossShape& S, int64_t b, int64_t e, int64_t off, int64_t a) {
  return (b * S.members + e) * S.total_actions + off + a;
}

// The bootstrap mask m_be of sample b's member e (1 without masks).
inline float mask_of(const float* masks, const LossShape& S, int64_t b, int64_t e) {
  return masks ? masks[b * S.members + e] : 1.f;
}

// MSE / Huber on the BDQ target, in F32 with the CUDA kernel's arithmetic (bdq_sample in
// csrc/cuda/loss/kernels.cuh): y = r + gamma (1 - done) mean_d Q_target_d(s', argmax Q_online_d(s')),
// per member from its own rows. A non-finite y (NaN/Inf reward or done, an Inf target, or y
// overflowing F32) poisons the sample: NaN loss and TD error, NaN gradient rows of every action
// of that member. A finite y whose squared error overflows gives an inf loss with a finite
// gradient, as on CUDA; either way the optimizer then sees a non-finite loss or gradient norm
// and skips the step. A mask scales its member's loss and gradient (0 * NaN is NaN: a poisoned
// sample stays poisoned), never the TD error or mean_q.
void bdq_loss_f32(const float* x, const float* xo, const float* xt, const int64_t* act, const float* r,
                  const float* dn, const float* w, const float* masks, const LossShape& S, float gamma, float* g,
                  float* td, Tensor& loss, Tensor& mean_q) {
  const int64_t B = S.batch, E = S.members, D = static_cast<int64_t>(S.branch_sizes.size());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float fd = static_cast<float>(E * D);  // the terms of a sample: E = 1 divides by D, as before members
  float loss_acc = 0.f, q_acc = 0.f;
  for (int64_t b = 0; b < B; ++b) {
    const float wb = w ? w[b] : 1.f;
    float sample_loss = 0.f, sample_td = 0.f, qsum = 0.f;  // sample_loss masked, the others not
    for (int64_t e = 0; e < E; ++e) {
      float target = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const int64_t off = S.action_offsets[d], n = S.branch_sizes[d];
        int64_t a_star = 0;
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t a = 0; a < n; ++a) {
          const float qv = xo[q_row(S, b, e, off, a)];
          if (qv > best || std::isnan(qv)) {
            best = qv;
            a_star = a;
            if (std::isnan(qv)) break;
          }
        }
        target += xt[q_row(S, b, e, off, a_star)];
      }
      const float y = r[b] + gamma * (1.f - dn[b]) * (target / static_cast<float>(D));
      const float me = mask_of(masks, S, b, e);
      const float scale = wb * me / (static_cast<float>(B) * fd);
      float member_loss = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const int64_t off = S.action_offsets[d], n = S.branch_sizes[d];
        const int64_t a = act[b * D + d];
        if (!std::isfinite(y)) {  // poisoned sample (NaN must reach the gradient: the optimizer skips)
          for (int64_t k = 0; k < n; ++k) g[q_row(S, b, e, off, k)] = nan;
          member_loss = sample_td = qsum = nan;
          continue;
        }
        const float qv = x[q_row(S, b, e, off, a)];
        const float delta = y - qv;
        float l, dl;  // loss and d(loss)/d(q)
        if (S.type == LossType::kMSE) {
          l = delta * delta;
          dl = -2.f * delta;
        } else {
          const float ad = std::abs(delta);
          l = ad <= 1.f ? 0.5f * delta * delta : ad - 0.5f;
          dl = std::isnan(delta) ? delta : -std::min(std::max(delta, -1.f), 1.f);  // NaN must reach the gradient
        }
        member_loss += l;
        sample_td += std::abs(delta);
        qsum += qv;
        g[q_row(S, b, e, off, a)] = dl * scale;
      }
      sample_loss += me * member_loss;
    }
    td[b] = sample_td / fd;
    loss_acc = std::fma(wb, sample_loss / fd, loss_acc);
    q_acc += qsum / fd;
  }
  loss.fill_(loss_acc / static_cast<float>(B));
  mean_q.fill_(q_acc / static_cast<float>(B));
}

// A poisoned sample b (a non-finite target): NaN in the taken action's rows of grad_q, in every
// branch of every member, so that the optimizer's non-finite check skips the step whatever the masks.
void poison_taken_rows(float* g, const LossShape& S, const int64_t* act, int64_t b) {
  const int64_t NA = S.atoms, D = static_cast<int64_t>(S.branch_sizes.size());
  for (int64_t e = 0; e < S.members; ++e)
    for (int64_t d = 0; d < D; ++d)
      std::fill_n(g + q_row(S, b, e, S.action_offsets[d], act[b * D + d]) * NA, NA,
                  std::numeric_limits<float>::quiet_NaN());
}

// QR-DQN (Dabney et al. 2017, eq. 10, kappa 1) and IQN (Dabney et al. 2018, eq. 3, kappa 1)
// in double precision, for one branch of one sample: theta (the taken action's N quantiles of
// q) against the target quantiles t[0..N'). Returns sum_i (1/N') sum_j |tau_i - 1{u_ij < 0}|
// huber(u_ij), u_ij = t_j - theta_i, tau_i = fractions[i] (IQN: the sample's own) or, without
// fractions, (2i + 1) / 2N (QR: N' = N); writes d(that)/d(theta_i) * scale into g[i].
double quantile_huber(const float* theta, const float* fractions, int64_t N, const std::vector<double>& t, int64_t N2,
                      double scale, float* g) {
  double loss = 0;
  for (int64_t i = 0; i < N; ++i) {
    const double tau = fractions ? double(fractions[i]) : quantile_fraction(i, N);
    double li = 0, gi = 0;
    for (int64_t j = 0; j < N2; ++j) {
      const double u = t[j] - double(theta[i]);
      const double w = u < 0 ? 1.0 - tau : tau;  // |tau - 1{u < 0}|
      const double au = std::abs(u);
      li += w * (au <= 1.0 ? 0.5 * u * u : au - 0.5);
      gi -= w * (std::isnan(u) ? u : std::min(1.0, std::max(-1.0, u)));  // a NaN theta must reach the gradient
    }
    loss += li / double(N2);
    g[i] = static_cast<float>(gi / double(N2) * scale);
  }
  return loss;
}

// QR-DQN and IQN on the whole batch: per member and branch the next action by the mean of the
// member's online quantiles (K of them; the first of equal maxima; a NaN wins), the N' target
// quantiles r + gamma (1 - done) theta_target of the member, quantile_huber on the taken
// action's N (fr: IQN's fractions [B, N], the members sharing a sample's; nullptr: QR's
// midpoints); per sample the mean over members and branches (masked for the loss, not for the
// TD error). A non-finite target quantile poisons the sample as a non-finite C51 reward does.
void qr_loss(const float* x, const float* xo, const float* xt, const float* fr, const int64_t* act, const float* r,
             const float* dn, const float* w, const float* masks, const LossShape& S, double gamma, float* g,
             float* td, Tensor& loss, Tensor& mean_q) {
  const int64_t B = S.batch, E = S.members, N = S.atoms, K = S.next_atoms, N2 = S.target_atoms;
  const int64_t D = static_cast<int64_t>(S.branch_sizes.size());
  const double terms = double(E * D);  // a sample's (member, branch) terms
  // Samples in parallel (N^2 pairs each), their sums in sample order afterwards: the same bits
  // as one sample after the other.
  std::vector<double> weighted_loss(B), sample_mean_q(B);
  at::parallel_for(0, B, 4, [&](int64_t begin, int64_t end) {
    std::vector<double> t(N2);
    for (int64_t b = begin; b < end; ++b) {
      // The target quantiles in F32, with the CUDA kernel's arithmetic (one fused multiply-add), so
      // that both devices overflow alike and see the same targets; the rest in double.
      const float discount = static_cast<float>(gamma) * (1.f - dn[b]);
      const double wb = w ? w[b] : 1.0;
      double sample_loss = 0, masked_loss = 0, sample_q = 0;
      bool poisoned = false;
      for (int64_t e = 0; e < E && !poisoned; ++e) {
        const double me = mask_of(masks, S, b, e);
        for (int64_t d = 0; d < D && !poisoned; ++d) {
          const int64_t off = S.action_offsets[d], n = S.branch_sizes[d];
          int64_t a_star = 0;
          double best = -std::numeric_limits<double>::infinity();
          for (int64_t a = 0; a < n; ++a) {
            const double qv = quantile_mean(xo + q_row(S, b, e, off, a) * K, K);
            if (qv > best || std::isnan(qv)) {
              best = qv;
              a_star = a;
              if (std::isnan(qv)) break;
            }
          }
          const float* xs = xt + q_row(S, b, e, off, a_star) * N2;
          for (int64_t j = 0; j < N2; ++j) {
            t[j] = std::fma(discount, xs[j], r[b]);
            poisoned = poisoned || !std::isfinite(t[j]);
          }
          if (poisoned) break;
          const int64_t row = q_row(S, b, e, off, act[b * D + d]);
          const float* tau = fr ? fr + b * N : nullptr;  // the members share the sample's fractions
          const double l = quantile_huber(x + row * N, tau, N, t, N2, wb * me / double(B * E * D), g + row * N) / terms;
          sample_loss += l;
          masked_loss += me * l;
          sample_q += quantile_mean(x + row * N, N) / terms;
        }
      }
      if (poisoned) {  // NaN must reach the gradient: the optimizer skips the step
        poison_taken_rows(g, S, act, b);
        sample_loss = masked_loss = sample_q = std::numeric_limits<double>::quiet_NaN();
      }
      td[b] = to_f32(sample_loss);
      weighted_loss[b] = wb * masked_loss;
      sample_mean_q[b] = sample_q;
    }
  });
  double loss_sum = 0, q_sum = 0;
  for (int64_t b = 0; b < B; ++b) {
    loss_sum += weighted_loss[b];
    q_sum += sample_mean_q[b];
  }
  loss.fill_(to_f32(loss_sum / B));
  mean_q.fill_(to_f32(q_sum / B));
}

// The loss on validated inputs (S from check_loss_args or loss_shape; fractions: IQN's, else
// None); `op` names the op in the out-of-range-action and out-of-range-fraction errors.
std::tuple<Tensor, Tensor, Tensor, Tensor> dqn_loss_reference(const Tensor& q, const Tensor& q_next_online,
                                                              const Tensor& q_next_target, const Tensor& actions,
                                                              const Tensor& rewards, const Tensor& dones,
                                                              const c10::optional<Tensor>& weights,
                                                              const c10::optional<Tensor>& masks,
                                                              const c10::optional<Tensor>& fractions,
                                                              const LossShape& S, double v_min, double v_max,
                                                              double gamma, const char* op) {
  const int64_t B = S.batch, E = S.members, NA = S.atoms, D = static_cast<int64_t>(S.branch_sizes.size());
  Tensor loss = at::empty({}, q.options());
  Tensor grad_q = at::zeros_like(q);
  Tensor td_error = at::empty({B}, q.options());
  Tensor mean_q = at::empty({}, q.options());
  const float* x = q.data_ptr<float>();
  const float* xo = q_next_online.data_ptr<float>();
  const float* xt = q_next_target.data_ptr<float>();
  const int64_t* act = actions.data_ptr<int64_t>();
  const float* r = rewards.data_ptr<float>();
  const float* dn = dones.data_ptr<float>();
  const float* w = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  const float* mk = masks.has_value() ? masks->data_ptr<float>() : nullptr;
  const float* fr = fractions.has_value() ? fractions->data_ptr<float>() : nullptr;
  float* g = grad_q.data_ptr<float>();
  float* td = td_error.data_ptr<float>();

  for (int64_t b = 0; b < B; ++b)
    for (int64_t d = 0; d < D; ++d)
      DQN_CHECK(act[b * D + d] >= 0 && act[b * D + d] < S.branch_sizes[d], op, ": actions: sample ", b,
                " takes action ", act[b * D + d], " in branch ", d, ", which has ", S.branch_sizes[d], " actions");
  // IQN's fractions are probabilities (a NaN fails the test too); the CUDA kernel, which cannot
  // raise without a host sync, poisons the sample instead.
  if (fr)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < NA; ++i)
        DQN_CHECK(fr[b * NA + i] >= 0.f && fr[b * NA + i] <= 1.f, op, ": fractions: sample ", b, " slot ", i, " is ",
                  float_str(fr[b * NA + i]), ", expected a value in [0, 1]");

  if (S.type == LossType::kQR || S.type == LossType::kIQN) {
    qr_loss(x, xo, xt, fr, act, r, dn, w, mk, S, gamma, g, td, loss, mean_q);
    return {loss, grad_q, td_error, mean_q};
  }
  if (S.type != LossType::kC51) {
    bdq_loss_f32(x, xo, xt, act, r, dn, w, mk, S, static_cast<float>(gamma), g, td, loss, mean_q);
    return {loss, grad_q, td_error, mean_q};
  }
  // C51, in double precision; per member and branch, the sample's loss the mean over them
  // (masked for the loss, not for the TD error).
  const double dz = (v_max - v_min) / double(NA - 1);
  const double terms = double(E * D);  // a sample's (member, branch) terms
  std::vector<double> p(NA), pt(NA), m(NA);
  double loss_sum = 0, q_sum = 0;
  for (int64_t b = 0; b < B; ++b) {
    const double discount = gamma * (1.0 - dn[b]);
    const double wb = w ? w[b] : 1.0;
    double sample_loss = 0, masked_loss = 0;
    if (!std::isfinite(r[b]) || !std::isfinite(dn[b])) {
      // Clamping onto the support would hide a NaN or Inf reward: poison the sample instead, its
      // gradient too, so that the optimizer skips the step (DQN_CHECK-free, as on CUDA).
      const float nan = std::numeric_limits<float>::quiet_NaN();
      poison_taken_rows(g, S, act, b);
      td[b] = nan;
      loss_sum += nan;
      q_sum += nan;
      continue;
    }
    for (int64_t e = 0; e < E; ++e) {
      const double me = mask_of(mk, S, b, e);
      for (int64_t d = 0; d < D; ++d) {
        const int64_t off = S.action_offsets[d], n = S.branch_sizes[d];
        // double-DQN: the member's online network picks the next action (first of equal maxima)
        int64_t a_star = 0;
        double best = -std::numeric_limits<double>::infinity();
        for (int64_t a = 0; a < n; ++a) {
          softmax(xo + q_row(S, b, e, off, a) * NA, NA, p);
          double qv = 0;
          for (int64_t j = 0; j < NA; ++j) qv += p[j] * (v_min + j * dz);
          if (qv > best || std::isnan(qv)) {
            best = qv;
            a_star = a;
            if (std::isnan(qv)) break;
          }
        }
        softmax(xt + q_row(S, b, e, off, a_star) * NA, NA, pt);
        // projection of r + discount * z onto the support
        std::fill(m.begin(), m.end(), 0.0);
        for (int64_t i = 0; i < NA; ++i) {
          const double tz = std::min(v_max, std::max(v_min, r[b] + discount * (v_min + i * dz)));
          const double bi = std::min(double(NA - 1), std::max(0.0, (tz - v_min) / dz));
          int64_t l = static_cast<int64_t>(std::floor(bi)), u = static_cast<int64_t>(std::ceil(bi));
          if (l == u) {  // the atom lands exactly on a support point: give it all its mass
            if (u > 0) --l; else ++u;
          }
          m[l] += pt[i] * (u - bi);
          m[u] += pt[i] * (bi - l);
        }
        const int64_t row = q_row(S, b, e, off, act[b * D + d]);
        const float* xc = x + row * NA;
        const double lse = softmax(xc, NA, p);
        const double scale = wb * me;
        double ce = 0, qv = 0;
        for (int64_t j = 0; j < NA; ++j) {
          ce -= m[j] * (xc[j] - lse);
          qv += p[j] * (v_min + j * dz);
          g[row * NA + j] = static_cast<float>((p[j] - m[j]) * scale / double(B * E * D));
        }
        sample_loss += ce / terms;
        masked_loss += me * (ce / terms);
        q_sum += qv / terms;
      }
    }
    td[b] = to_f32(sample_loss);
    loss_sum += wb * masked_loss;
  }
  loss.fill_(to_f32(loss_sum / B));
  mean_q.fill_(to_f32(q_sum / B));
  return {loss, grad_q, td_error, mean_q};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> dqn_loss_cpu(const Tensor& q, const Tensor& q_next_online,
                                                        const Tensor& q_next_target, const Tensor& actions,
                                                        const Tensor& rewards, const Tensor& dones,
                                                        const c10::optional<Tensor>& weights, c10::IntArrayRef branches,
                                                        double v_min, double v_max, double gamma,
                                                        c10::string_view loss_type,
                                                        const c10::optional<Tensor>& masks,
                                                        const c10::optional<Tensor>& fractions) {
  const LossShape S = check_loss_args(q, q_next_online, q_next_target, actions, rewards, dones, weights, branches,
                                      v_min, v_max, gamma, std::string(loss_type), masks, fractions);
  return dqn_loss_reference(q, q_next_online, q_next_target, actions, rewards, dones, weights, masks, fractions, S,
                            v_min, v_max, gamma, kLossOp);
}

// _dqn_loss_on_logits: q of each pass as bf16_dueling_forward forms it from these logits, the
// dqn_loss reference, and d(loss)/d(head logits) as mixed_backward forms it from grad_q.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> dqn_loss_on_logits_cpu(
    const Tensor& logits, const Tensor& logits_next_online, const Tensor& logits_next_target, const Tensor& params,
    const Tensor& target_params, const Tensor& actions, const Tensor& rewards, const Tensor& dones,
    const c10::optional<Tensor>& weights, c10::IntArrayRef layout, double v_min, double v_max, double gamma,
    c10::string_view loss_type, const c10::optional<Tensor>& masks, const c10::optional<Tensor>& counter) {
  const char* op = kLossOnLogitsOp;
  const NetLayout L = parse_layout(layout, op);
  LossShape S;
  S.type = check_loss_on_logits_args(logits, logits_next_online, logits_next_target, params, target_params, actions,
                                     rewards, dones, weights, masks, counter, L, v_min, v_max, gamma,
                                     std::string(loss_type));
  S.batch = logits.size(0);
  S.members = L.members;
  S.total_actions = L.total_actions;
  S.atoms = S.next_atoms = S.target_atoms = L.atoms;
  S.branch_sizes = L.branch_sizes;
  S.action_offsets = L.action_offsets;
  auto q_of = [&](const Tensor& pass_logits, const Tensor& net_params) {
    return cpu::dueling_aggregate(cpu::head_from_logits(pass_logits, net_params, L), L);
  };
  const auto [loss, grad_q, td_error, mean_q] =
      dqn_loss_reference(q_of(logits, params), q_of(logits_next_online, params), q_of(logits_next_target, target_params),
                         actions, rewards, dones, weights, masks, c10::nullopt, S, v_min, v_max, gamma, op);
  Tensor grad_head = cpu::dueling_backward(grad_q, c10::nullopt, L);
  Tensor grad_head_bf16 = cpu::padded_head_grad(grad_head, L, at::kBFloat16);
  return {loss, grad_head, grad_head_bf16, td_error, mean_q};
}

}  // namespace

TORCH_LIBRARY_IMPL(dqn_ops, CPU, m) {
  m.impl("dqn_loss", &dqn_loss_cpu);
  m.impl("_dqn_loss_on_logits", &dqn_loss_on_logits_cpu);
}

}  // namespace dqn_ops
