// Argument validation of dqn_loss, shared by the CPU and CUDA kernels.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include "checks.h"
#include "layout.h"

namespace dqn_ops {

constexpr const char* kLossOp = "dqn_ops.dqn_loss";
constexpr const char* kLossOnLogitsOp = "dqn_ops._dqn_loss_on_logits";

enum class LossType {
  kC51,    // distributional: projection of r + gamma z onto the support, cross-entropy (atoms > 1)
  kQR,     // distributional: quantile regression (QR-DQN), quantile Huber loss, kappa 1 (atoms >= 1 quantiles)
  kMSE,    // (y - Q)^2 on the BDQ target (atoms == 1)
  kHuber,  // Huber, delta 1, on the BDQ target (atoms == 1)
  kIQN,    // distributional: implicit quantile networks, QR's loss with each sample's own fractions
           // (docs/iqn-design.md): q's N slots at fractions [B, N], N, K, N' slots in the three inputs
};

struct LossShape {
  // atoms: q's slots per row (C51's atoms, QR's quantiles, IQN's N); next_atoms (K) and
  // target_atoms (N'): q_next_online's and q_next_target's, equal to atoms but for IQN.
  int64_t batch, total_actions, atoms, next_atoms, target_atoms;
  // E >= 1 ensemble members (csrc/dqn_ops.cpp): q is [B, E * total_actions, atoms], member e's
  // branch d at rows e * total_actions + action_offsets[d] of a sample.
  int64_t members;
  std::vector<int64_t> branch_sizes, action_offsets;
  LossType type;
};

// takes_iqn: whether the op takes 'iqn' (dqn_loss does; an op that does not lists the others,
// so that 'iqn' is refused as any name it does not know, and never runs another type's arithmetic).
inline LossType parse_loss_type(const std::string& s, const char* op = kLossOp, bool takes_iqn = false) {
  if (s == "c51") return LossType::kC51;
  if (s == "qr") return LossType::kQR;
  if (s == "mse") return LossType::kMSE;
  if (s == "huber") return LossType::kHuber;
  if (takes_iqn && s == "iqn") return LossType::kIQN;
  DQN_CHECK(false, op, ": loss_type: expected one of 'c51', 'qr', 'mse', 'huber'", takes_iqn ? ", 'iqn'" : "",
            ", got '", s, "'");
}

// Whether the network's outputs fit the loss type: C51 needs >= 2 atoms, MSE / Huber plain
// Q-values (1 atom), QR and IQN any count of quantiles (the losses' and act's check).
inline void check_loss_fits_atoms(const char* op, LossType type, int64_t atoms, const std::string& loss_type) {
  if (type == LossType::kC51)
    DQN_CHECK(atoms >= 2, op, ": loss_type 'c51' needs at least 2 atoms, got ", atoms,
              " (use 'mse' or 'huber' for plain Q-values)");
  if (type == LossType::kMSE || type == LossType::kHuber)
    DQN_CHECK(atoms == 1, op, ": loss_type '", loss_type, "' takes plain Q-values (1 atom), got ", atoms,
              " atoms (use 'c51' or 'qr')");
}

// The checks of the loss type against the atom count, and of the support and the discount:
// dqn_loss's and _dqn_loss_on_logits's (takes_iqn: as parse_loss_type). Returns the parsed type.
inline LossType check_loss_constants(const char* op, int64_t atoms, double v_min, double v_max, double gamma,
                                     const std::string& loss_type, bool takes_iqn = false) {
  const LossType type = parse_loss_type(loss_type, op, takes_iqn);
  check_loss_fits_atoms(op, type, atoms, loss_type);
  if (type == LossType::kC51)
    DQN_CHECK(v_min < v_max, op, ": v_min must be below v_max, got v_min=", std::to_string(v_min), ", v_max=",
              std::to_string(v_max));
  DQN_CHECK(gamma >= 0 && gamma <= 1, op, ": gamma: expected a value in [0, 1], got ", std::to_string(gamma));
  return type;
}

// The per-sample inputs of both losses: actions [B, D] int64, rewards and dones [B] F32, weights [B] F32 or None,
// masks [B, E] F32 or None.
inline void check_sample_args(const char* op, const at::Tensor& actions, const at::Tensor& rewards,
                              const at::Tensor& dones, const c10::optional<at::Tensor>& weights,
                              const c10::optional<at::Tensor>& masks, int64_t batch, int64_t branches,
                              int64_t members, const at::Device& dev) {
  check_tensor(actions, op, "actions", dev, at::kLong, {batch, branches});
  const std::pair<const at::Tensor*, const char*> per_sample[] = {{&rewards, "rewards"}, {&dones, "dones"}};
  for (const auto& t : per_sample) check_tensor(*t.first, op, t.second, dev, at::kFloat, {batch});
  if (weights.has_value()) check_tensor(*weights, op, "weights", dev, at::kFloat, {batch});
  if (masks.has_value()) check_tensor(*masks, op, "masks", dev, at::kFloat, {batch, members});
}

// dqn_loss. The three inputs [B, E * A, *]: the same slot count N everywhere, but for 'iqn'
// (q [B, E * A, N], q_next_online [B, E * A, K], q_next_target [B, E * A, N'], each at least 1,
// and fractions [B, N] F32, q's fractions; any other loss type takes no fractions). That the
// fractions lie in [0, 1] depends on their values: the CPU kernel checks it (raising), the CUDA
// kernel poisons the sample (no host sync).
inline LossShape check_loss_args(const at::Tensor& q, const at::Tensor& q_next_online, const at::Tensor& q_next_target,
                                 const at::Tensor& actions, const at::Tensor& rewards, const at::Tensor& dones,
                                 const c10::optional<at::Tensor>& weights, c10::IntArrayRef branches, double v_min,
                                 double v_max, double gamma, const std::string& loss_type,
                                 const c10::optional<at::Tensor>& masks, const c10::optional<at::Tensor>& fractions) {
  const char* op = kLossOp;
  LossShape s;
  s.type = parse_loss_type(loss_type, op, /*takes_iqn=*/true);
  const bool iqn = s.type == LossType::kIQN;
  DQN_CHECK(!branches.empty(), op, ": branches: expected at least one branch, got none");
  s.total_actions = 0;
  for (size_t d = 0; d < branches.size(); ++d) {
    DQN_CHECK(branches[d] >= 1, op, ": branches: branch ", d, " must have >= 1 action, got ", branches[d]);
    s.action_offsets.push_back(s.total_actions);
    s.branch_sizes.push_back(branches[d]);
    s.total_actions += branches[d];
  }
  DQN_CHECK(q.dim() == 3, op, ": q: expected shape [B, ", s.total_actions, ", atoms], got ", shape_str(q.sizes()));
  s.batch = q.size(0);
  s.atoms = q.size(2);
  // The members are q's rows per sample over the actions of one head set: a width that is no
  // positive multiple of sum(branches) is a wrong q (or wrong branches), not a smaller ensemble.
  const int64_t width = q.size(1);
  DQN_CHECK(width >= s.total_actions && width % s.total_actions == 0, op, ": q: expected shape [", s.batch, ", ",
            s.total_actions, ", ", s.atoms, "], got ", shape_str(q.sizes()), " (an ensemble of E members: [", s.batch,
            ", E * ", s.total_actions, ", ", s.atoms, "])");
  s.members = width / s.total_actions;
  const at::Device dev = q.device();
  DQN_CHECK(dev.is_cpu() || dev.is_cuda(), op, ": q: expected a CPU or CUDA tensor, got one on ", dev);
  const int64_t D = static_cast<int64_t>(branches.size());
  const std::pair<const at::Tensor*, const char*> logits[] = {
      {&q, "q"}, {&q_next_online, "q_next_online"}, {&q_next_target, "q_next_target"}};
  // IQN's three inputs are values at different fractions: their slot counts are their own.
  for (const auto& t : logits)
    check_tensor(*t.first, op, t.second, dev, at::kFloat, {s.batch, width, iqn ? -1 : s.atoms});
  s.next_atoms = q_next_online.size(2);
  s.target_atoms = q_next_target.size(2);
  if (iqn) {
    const std::pair<const at::Tensor*, const char*> slots[] = {
        {&q, "q: expected at least 1 fraction per sample (N)"},
        {&q_next_online, "q_next_online: expected at least 1 fraction per sample (K)"},
        {&q_next_target, "q_next_target: expected at least 1 fraction per sample (N')"}};
    for (const auto& t : slots)
      DQN_CHECK(t.first->size(2) >= 1, op, ": ", t.second, ", got shape ", shape_str(t.first->sizes()));
  }
  check_sample_args(op, actions, rewards, dones, weights, masks, s.batch, D, s.members, dev);
  if (iqn) {
    DQN_CHECK(fractions.has_value(), op, ": fractions: loss_type 'iqn' needs q's fractions [", s.batch, ", ", s.atoms,
              "], got None");
    check_tensor(*fractions, op, "fractions", dev, at::kFloat, {s.batch, s.atoms});
  } else {
    DQN_CHECK(!fractions.has_value(), op, ": fractions: only loss_type 'iqn' takes fractions, got a tensor with "
              "loss_type '", loss_type, "'");
  }
  DQN_CHECK(s.batch >= 1, op, ": q: expected a batch of at least 1 sample, got 0");
  check_loss_constants(op, s.atoms, v_min, v_max, gamma, loss_type, /*takes_iqn=*/true);
  return s;
}

// The sizes the CUDA loss kernels take (both ops; q_rows: q's rows per sample, E * A): the
// atoms (C51) or quantiles (QR; IQN's N and N') a warp stages in shared memory or loops over
// (the general C51 version's rows, QR's and IQN's target quantiles, a lane's quantiles of q),
// and the int indices (the (member, branch) entries: BranchTable). The atom limit is exported
// to Python as dqn_ops.ops.LOSS_CUDA_MAX_ATOMS.
constexpr int64_t kLossCudaMaxAtoms = 256;

inline void check_loss_cuda_limits(const char* op, int64_t batch, int64_t q_rows, int64_t atoms) {
  DQN_CHECK(atoms <= kLossCudaMaxAtoms, op, ": the CUDA kernel takes at most ", kLossCudaMaxAtoms,
            " atoms (C51) or quantiles (QR), got ", atoms, " (the CPU kernel takes any)");
  DQN_CHECK(batch <= INT_MAX / 2 && batch * q_rows * atoms <= (int64_t(1) << 40), op, ": batch too large (",
            batch, " samples)");
  DQN_CHECK(q_rows * atoms <= INT_MAX, op, ": a sample's rows of q (", q_rows, " actions x ", atoms,
            " atoms) are more than the CUDA kernel's int indices reach (the CPU kernel takes any)");
}

// dqn_loss's: the above, and for IQN its N and N' within the same limit (K only enters the
// next action's mean, a loop over each row: any count an int holds).
inline void check_loss_cuda_limits(const char* op, const LossShape& s) {
  const int64_t q_rows = s.members * s.total_actions;
  if (s.type != LossType::kIQN) return check_loss_cuda_limits(op, s.batch, q_rows, s.atoms);
  struct Slots {
    int64_t count;
    const char *name, *letter;
  };
  const Slots limited[] = {{s.atoms, "q", "N"}, {s.target_atoms, "q_next_target", "N'"}};
  for (const Slots& n : limited)
    DQN_CHECK(n.count <= kLossCudaMaxAtoms, op, ": ", n.name, ": the CUDA kernel takes at most ", kLossCudaMaxAtoms,
              " fractions per sample (IQN's ", n.letter, "), got ", n.count, " (the CPU kernel takes any)");
  DQN_CHECK(s.next_atoms <= INT_MAX, op, ": q_next_online: the CUDA kernel takes at most ", INT_MAX,
            " fractions per sample (IQN's K), got ", s.next_atoms);
  const int64_t most = std::max({s.atoms, s.next_atoms, s.target_atoms});
  DQN_CHECK(s.batch <= INT_MAX / 2 && s.batch * q_rows * most <= (int64_t(1) << 40), op, ": batch too large (",
            s.batch, " samples)");
  DQN_CHECK(q_rows * most <= INT_MAX, op, ": a sample's rows of q (", q_rows, " actions x ", most,
            " fractions) are more than the CUDA kernel's int indices reach (the CPU kernel takes any)");
}

// _dqn_loss_on_logits: the three passes' output-layer GEMM results in the padded layout
// ([B, head_ld] F32, no bias), each network's F32 params (their b_out is the output bias), the
// samples (masks [B, E], E = the layout's members) as for dqn_loss. Returns the loss type; B is logits.size(0).
inline LossType check_loss_on_logits_args(const at::Tensor& logits, const at::Tensor& logits_next_online,
                                          const at::Tensor& logits_next_target, const at::Tensor& params,
                                          const at::Tensor& target_params, const at::Tensor& actions,
                                          const at::Tensor& rewards, const at::Tensor& dones,
                                          const c10::optional<at::Tensor>& weights,
                                          const c10::optional<at::Tensor>& masks,
                                          const c10::optional<at::Tensor>& counter, const NetLayout& L, double v_min,
                                          double v_max, double gamma, const std::string& loss_type) {
  const char* op = kLossOnLogitsOp;
  DQN_CHECK(!L.iqn(), op, ": takes no IQN network (its head rows are per (sample, fraction); an IQN network's step "
            "runs the public ops, dqn_ops.step.PublicOpsStep)");
  const LossType type = check_loss_constants(op, L.atoms, v_min, v_max, gamma, loss_type);
  const at::Device dev = logits.device();
  DQN_CHECK(dev.is_cpu() || dev.is_cuda(), op, ": logits: expected a CPU or CUDA tensor, got one on ", dev);
  check_tensor(logits, op, "logits", dev, at::kFloat, {-1, L.head_ld});
  const int64_t B = logits.size(0);
  DQN_CHECK(B >= 1, op, ": logits: expected a batch of at least 1 row, got 0");
  check_tensor(logits_next_online, op, "logits_next_online", dev, at::kFloat, {B, L.head_ld});
  check_tensor(logits_next_target, op, "logits_next_target", dev, at::kFloat, {B, L.head_ld});
  check_tensor(params, op, "params", dev, at::kFloat, {L.numel});
  check_tensor(target_params, op, "target_params", dev, at::kFloat, {L.numel});
  check_sample_args(op, actions, rewards, dones, weights, masks, B, L.num_branches(), L.members, dev);
  if (counter.has_value()) check_tensor(*counter, op, "counter", dev, at::kInt, {1});
  return type;
}

}  // namespace dqn_ops
