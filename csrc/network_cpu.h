// The CPU reference's network pieces, shared by the kernels of the public ops
// (bf16_dueling_forward, mixed_backward, dqn_loss) and of the trainer-step ops
// (_online_and_target_logits, _dqn_loss_on_logits, _mixed_backward_from_head), so that a
// composition of the latter is the former's bits by construction. Defined in network_cpu.cpp.
//
// They compute what the CUDA kernels compute, in the same order of roundings: with a BF16
// mirror, weights, states and hidden activations are rounded to BF16 and every product
// accumulates in F32 (the tensor cores' BF16 x BF16 -> F32); with a mirror of params' own
// dtype nothing is rounded, which gives the float64 path gradcheck runs on.
#pragma once

#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include "layout.h"
#include "network_args.h"

namespace dqn_ops {
namespace cpu {

// One network's flat buffers as the reference reads them.
struct NetViews {
  const at::Tensor& params;       // compute dtype: F32 or F64
  const at::Tensor& params_bf16;  // mirror: BF16 or params' dtype
  at::ScalarType ct;

  NetViews(const at::Tensor& p, const at::Tensor& mirror) : params(p), params_bf16(mirror), ct(p.scalar_type()) {}
  // A weight of the mirror (what the forward GEMMs read), in the compute dtype.
  at::Tensor mirror_weight(int64_t off, int64_t rows, int64_t cols) const {
    return params_bf16.narrow(0, off, rows * cols).view({rows, cols}).to(ct);
  }
  at::Tensor master_weight(int64_t off, int64_t rows, int64_t cols) const {
    return params.narrow(0, off, rows * cols).view({rows, cols});
  }
  at::Tensor bias(int64_t off, int64_t n) const { return params.narrow(0, off, n); }
};

// The activation list of the network on x (states already at the mirror's precision,
// [rows, SD]): {x, h_1, ..., h_M}, every hidden layer of L.hidden in forward order (the trunk's,
// then the heads'), each [rows, width] at the mirror's precision. What the ops return as
// `activations` and the backward reads. An IQN network takes fractions [rows, N] (params'
// dtype) and adds, after the trunk, the cosines c [rows * N, n], phi and z = h_L * phi
// [rows * N, T_L] (NetLayout::num_activations): the head layers then run on the rows * N rows.
std::vector<at::Tensor> hidden_layers(const at::Tensor& x, const NetViews& p, const NetLayout& L,
                                      const c10::optional<at::Tensor>& fractions = c10::nullopt);

// IQN's q layout: q [rows * N, R, 1] (one row per (sample, fraction)) <-> [rows, R, N] (slot i:
// fraction i), the layout bf16_dueling_forward returns and dqn_loss reads.
at::Tensor fractions_to_slots(const at::Tensor& q, int64_t N);
at::Tensor slots_to_fractions(const at::Tensor& q);

// The output layer's products on the last hidden activation, no bias, in the padded layout
// [rows, head_ld] of params' dtype (csrc/layout.h): head j's pad_width columns from its weight
// rows, padding rows included, as the CUDA GEMMs run them. With no head layer every head
// reads all of the last trunk layer.
at::Tensor output_logits(const at::Tensor& last, const NetViews& p, const NetLayout& L);

// head logits [rows, head_out] (compact) = padded logits + the output bias b_out of `params`.
at::Tensor head_from_logits(const at::Tensor& logits, const at::Tensor& params, const NetLayout& L);

// q [rows, E * total_actions, NA] from the head logits, member e's branch d at rows
// e * total_actions + off_d. With dueling (BDQ local mean per member, per atom):
// q_{e,d}[b, k, :] = v_e[b, :] + a_{e,d}[b, k, :] - mean_k a_{e,d}[b, k, :]; without: q_{e,d} = a_{e,d}.
at::Tensor dueling_aggregate(const at::Tensor& head, const NetLayout& L);

// d(head logits) [B, head_out] = grad_head + the aggregation's backward of grad_q (with
// dueling: dv_e = sum over member e's actions of dq_e, da_{e,d} = dq_{e,d} - mean_k dq_{e,d};
// without: da_{e,d} = dq_{e,d});
// either may be absent, not both.
at::Tensor dueling_backward(const c10::optional<at::Tensor>& grad_q, const c10::optional<at::Tensor>& grad_head,
                            const NetLayout& L);

// A compact head gradient [B, head_out] in the padded layout [B, head_ld] of `dtype`, padding 0.
at::Tensor padded_head_grad(const at::Tensor& d_head, const NetLayout& L, at::ScalarType dtype);

// mixed_backward from d(head logits) on, reading the activation list {x, h_1, ..., h_M} (with
// IQN's c, phi, z after the trunk): the flat gradient and, when need_grad_states, d(states)
// (else an empty tensor).
std::tuple<at::Tensor, at::Tensor> backward_from_head(const at::Tensor& d_head, at::TensorList activations,
                                                      const NetViews& p, const NetLayout& L,
                                                      BackwardPrecision precision, bool need_grad_states);

}  // namespace cpu
}  // namespace dqn_ops
