// Argument validation of bf16_dueling_forward and mixed_backward, shared by the CPU and
// CUDA kernels so both reject the same inputs with the same messages.
#pragma once

#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "checks.h"
#include "layout.h"

namespace dqn_ops {

constexpr const char* kForwardOp = "dqn_ops.bf16_dueling_forward";
constexpr const char* kBackwardOp = "dqn_ops.mixed_backward";
constexpr const char* kLogitsOp = "dqn_ops._online_and_target_logits";
constexpr const char* kBackwardFromHeadOp = "dqn_ops._mixed_backward_from_head";

// Operand types of the backward GEMMs (docs/design.md: cuBLAS takes no F32 x BF16 mix).
enum class BackwardPrecision {
  kBF16,  // dY cast to BF16 where produced; BF16 x BF16 -> F32
  kTF32,  // F32 dY x F32 master weights / upcast activations on TF32 tensor cores
  kFP32,  // F32 x F32, full-precision FMA (for checks)
};

inline BackwardPrecision parse_precision(const std::string& s, const char* op) {
  if (s == "bf16") return BackwardPrecision::kBF16;
  if (s == "tf32") return BackwardPrecision::kTF32;
  if (s == "fp32") return BackwardPrecision::kFP32;
  DQN_CHECK(false, op, ": precision: expected one of 'tf32', 'bf16', 'fp32', got '", s, "'");
}

// params / params_bf16: the flat master buffer and its low-precision mirror.
// On CUDA they must be F32 / BF16. On the CPU (the reference path) params may be F32 or F64
// and the mirror BF16 (rounding emulated exactly as on the GPU) or params' own dtype (no
// rounding at all: the float64 path gradcheck uses).
// `name` and `mirror_name` name the two tensors in the messages (a second network's: "target_params").
inline void check_params(const at::Tensor& params, const at::Tensor& params_bf16, const NetLayout& L, const char* op,
                         const char* name = "params", const char* mirror_name = "params_bf16") {
  check_shape(params, op, name, {L.numel});
  check_shape(params_bf16, op, mirror_name, {L.numel});
  check_contiguous(params, op, name);
  check_contiguous(params_bf16, op, mirror_name);
  check_device(params_bf16, op, mirror_name, params.device());
  if (params.is_cuda()) {
    check_dtype(params, op, name, at::kFloat);
    check_dtype(params_bf16, op, mirror_name, at::kBFloat16);
    check_aligned(params, op, name, 32);
    check_aligned(params_bf16, op, mirror_name, 16);
  } else {
    DQN_CHECK(params.device().is_cpu(), op, ": ", name, ": expected a CPU or CUDA tensor, got one on ", params.device());
    DQN_CHECK(params.scalar_type() == at::kFloat || params.scalar_type() == at::kDouble, op,
                ": ", name, ": expected dtype Float (or Double on the CPU), got ", params.scalar_type());
    DQN_CHECK(params_bf16.scalar_type() == at::kBFloat16 || params_bf16.scalar_type() == params.scalar_type(), op,
                ": ", mirror_name, ": expected dtype BFloat16 (or ", name, "' dtype ", params.scalar_type(),
                " on the CPU), got ", params_bf16.scalar_type());
    DQN_CHECK(params_bf16.scalar_type() != at::kBFloat16 || params.scalar_type() == at::kFloat, op,
                ": ", name, ": a BFloat16 mirror needs Float params, got ", params.scalar_type());
  }
}

// An IQN network's quantile fractions: given iff the layout has the phi layer (L.iqn()), in
// params' dtype on its device, `shape` ({rows, -1} per sample, {-1} shared by every row) with
// at least one fraction. Returns N, the fractions per row (1 without IQN).
inline int64_t check_fractions(const c10::optional<at::Tensor>& fractions, const at::Tensor& params,
                               const NetLayout& L, const char* op, std::initializer_list<int64_t> shape) {
  if (!L.iqn()) {
    DQN_CHECK(!fractions.has_value(), op, ": fractions: only an IQN network (iqn_embedding > 0) takes them; ",
              "this layout has none");
    return 1;
  }
  DQN_CHECK(fractions.has_value(), op, ": fractions: an IQN network (iqn_embedding ", L.iqn_embedding,
            ") needs the quantile fractions tau, got None");
  check_tensor(*fractions, op, "fractions", params.device(), params.scalar_type(), shape);
  const int64_t N = fractions->size(fractions->dim() - 1);
  DQN_CHECK(N >= 1, op, ": fractions: expected at least 1 fraction per row, got 0");
  return N;
}

inline void check_forward_args(const at::Tensor& states, const at::Tensor& params, const at::Tensor& params_bf16,
                               const NetLayout& L, const std::string& backward_precision,
                               const char* op = kForwardOp, const char* states_name = "states") {
  parse_precision(backward_precision, op);
  check_params(params, params_bf16, L, op);
  check_device(states, op, states_name, params.device());
  check_dtype(states, op, states_name, params.scalar_type());
  check_shape(states, op, states_name, {-1, L.state_dim});
  DQN_CHECK(states.size(0) >= 1, op, ": ", states_name, ": expected a batch of at least 1 row, got 0");
  check_contiguous(states, op, states_name);
}

// The saved activations' batch: B samples, N fractions per sample (IQN; 1 otherwise).
struct SavedBatch {
  int64_t B, N;
};

// The saved activations must be the ones bf16_dueling_forward returned for this layout: the
// states at the mirror's precision, then every hidden layer's output ([B, width] each; with IQN
// the cosines, phi, z and the head layers on B * N rows: NetLayout::num_activations; names in
// messages: activations[i]).
inline SavedBatch check_saved_activations(at::TensorList activations, const at::Tensor& params_bf16,
                                          const NetLayout& L, const char* op) {
  const size_t expected = L.num_activations();
  DQN_CHECK(activations.size() == expected, op, ": activations: expected ", expected, " tensors (the states and each ",
            L.iqn() ? "hidden layer, with the IQN cosines, phi and z" : "hidden layer",
            ", as the forward returned them), got ", activations.size());
  DQN_CHECK(activations[0].dim() == 2 && activations[0].size(0) >= 1, op,
            ": activations[0]: expected the states [B >= 1, ", L.state_dim, "], got shape ", shape_str(activations[0].sizes()));
  const int64_t B = activations[0].size(0);
  int64_t N = 1;
  if (L.iqn()) {
    const at::Tensor& c = activations[L.cos_activation()];
    DQN_CHECK(c.dim() == 2 && c.size(0) >= B && c.size(0) % B == 0, op, ": activations[", L.cos_activation(),
              "]: expected the IQN cosines [B * N, ", L.iqn_embedding, "] with B = ", B, ", got shape ",
              shape_str(c.sizes()));
    N = c.size(0) / B;
  }
  for (size_t i = 0; i < expected; ++i) {
    const std::string name = "activations[" + std::to_string(i) + "]";
    check_shape(activations[i], op, name.c_str(), {L.per_fraction(i) ? B * N : B, L.activation_width(i)});
    check_dtype(activations[i], op, name.c_str(), params_bf16.scalar_type());
    check_device(activations[i], op, name.c_str(), params_bf16.device());
    check_contiguous(activations[i], op, name.c_str());
  }
  return {B, N};
}

inline SavedBatch check_backward_args(const c10::optional<at::Tensor>& grad_q,
                                      const c10::optional<at::Tensor>& grad_head, at::TensorList activations,
                                      const at::Tensor& params, const at::Tensor& params_bf16, const NetLayout& L,
                                      const std::string& precision) {
  const char* op = kBackwardOp;
  parse_precision(precision, op);
  check_params(params, params_bf16, L, op);
  const SavedBatch batch = check_saved_activations(activations, params_bf16, L, op);
  const int64_t B = batch.B, N = batch.N;
  DQN_CHECK(grad_q.has_value() || grad_head.has_value(), op, ": grad_q and grad_head are both None; give at least one");
  if (grad_q.has_value()) {
    // IQN: q's last dimension holds the N fractions' values (one atom each).
    check_shape(*grad_q, op, "grad_q", {B, L.q_rows(), L.iqn() ? N : L.atoms});
    check_dtype(*grad_q, op, "grad_q", params.scalar_type());
    check_device(*grad_q, op, "grad_q", params.device());
    check_contiguous(*grad_q, op, "grad_q");
  }
  if (grad_head.has_value()) {
    check_shape(*grad_head, op, "grad_head", {B * N, L.head_out});
    check_dtype(*grad_head, op, "grad_head", params.scalar_type());
    check_device(*grad_head, op, "grad_head", params.device());
    check_contiguous(*grad_head, op, "grad_head");
  }
  return batch;
}

// _online_and_target_logits: state_pairs [2B, SD] = [s; s'] as bf16_dueling_forward's states,
// and two networks' params (the target's in the same dtypes as the online network's).
// Returns B.
inline int64_t check_online_and_target_args(const at::Tensor& state_pairs, const at::Tensor& params,
                                            const at::Tensor& params_bf16, const at::Tensor& target_params,
                                            const at::Tensor& target_params_bf16, const NetLayout& L) {
  const char* op = kLogitsOp;
  check_forward_args(state_pairs, params, params_bf16, L, "bf16", op, "state_pairs");
  // The trainer runs IQN on the public ops (its fractions differ between the networks and sets).
  DQN_CHECK(!L.iqn(), op, ": IQN networks run the composed step (bf16_dueling_forward with fractions), not this op");
  check_device(target_params, op, "target_params", params.device());
  check_dtype(target_params, op, "target_params", params.scalar_type());
  check_params(target_params, target_params_bf16, L, op, "target_params", "target_params_bf16");
  check_dtype(target_params_bf16, op, "target_params_bf16", params_bf16.scalar_type());
  const int64_t rows = state_pairs.size(0);
  DQN_CHECK(rows % 2 == 0, op, ": state_pairs: expected [s; s'], an even number of rows, got ", rows);
  return rows / 2;
}

// _mixed_backward_from_head: grad_head [B, head_out] in params' dtype and its copy in the
// padded layout [B, head_ld], BF16 as _dqn_loss_on_logits makes it (or, on the CPU, the mirror's
// dtype), with the saved activations. Returns B.
inline int64_t check_backward_from_head_args(const at::Tensor& grad_head, const at::Tensor& grad_head_bf16,
                                             at::TensorList activations, const at::Tensor& params,
                                             const at::Tensor& params_bf16, const NetLayout& L,
                                             const std::string& precision) {
  const char* op = kBackwardFromHeadOp;
  parse_precision(precision, op);
  check_params(params, params_bf16, L, op);
  DQN_CHECK(!L.iqn(), op, ": IQN networks run the composed step (mixed_backward), not this op");
  const int64_t B = check_saved_activations(activations, params_bf16, L, op).B;
  check_tensor(grad_head, op, "grad_head", params.device(), params.scalar_type(), {B, L.head_out});
  DQN_CHECK(grad_head_bf16.scalar_type() == at::kBFloat16 ||
                (params.is_cpu() && grad_head_bf16.scalar_type() == params_bf16.scalar_type()),
            op, ": grad_head_bf16: expected dtype BFloat16", params.is_cpu() ? " (or params_bf16's)" : "", ", got ",
            grad_head_bf16.scalar_type());
  check_tensor(grad_head_bf16, op, "grad_head_bf16", params.device(), grad_head_bf16.scalar_type(), {B, L.head_ld});
  if (params.is_cuda()) check_aligned(grad_head_bf16, op, "grad_head_bf16", 16);
  return B;
}

}  // namespace dqn_ops
