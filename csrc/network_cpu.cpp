// CPU reference kernels of bf16_dueling_forward and mixed_backward, written with ATen ops, and
// of the trainer-step ops that stand in for them (_online_and_target_logits,
// _mixed_backward_from_head), all built from the shared pieces of network_cpu.h.
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "network_args.h"
#include "network_cpu.h"

namespace dqn_ops {
namespace cpu {

using at::Tensor;

namespace {

// relu(in W^T + b) per block of `layer` (a dense layer is one block), stored at the mirror's
// precision (what the next GEMM reads). Out-of-place products: the inputs may require grad (no
// out= then).
Tensor hidden_layer(const HiddenLayer& layer, const Tensor& input, const NetViews& p) {
  Tensor in = input.to(p.ct);
  Tensor z = at::empty({in.size(0), layer.out_width}, p.params.options());
  for (const HeadSlice& blk : layer.blocks)
    z.narrow(1, blk.out_col, blk.out_width)
        .copy_(at::addmm(p.bias(layer.b_off + blk.out_col, blk.out_width), in.narrow(1, blk.in_col, blk.in_width),
                         p.mirror_weight(blk.w_off, blk.out_width, blk.in_width).t()));
  return at::relu(z).to(p.params_bf16.scalar_type());
}

// IQN's embedding input c[r * N + i, k] = cos(pi * (k * tau[r, i])), k = 0..n-1, at the mirror's
// precision: the product k * tau in the fractions' dtype (the CUDA kernel's F32 argument of
// cospif), the cosine in double, rounded to the compute dtype and then to the mirror's.
Tensor iqn_cosines(const Tensor& fractions, int64_t n, const NetViews& p) {
  Tensor k = at::arange(n, fractions.options());
  Tensor angle = fractions.reshape({-1, 1}) * k;
  return at::cos(angle.to(at::kDouble) * M_PI).to(p.ct).to(p.params_bf16.scalar_type());
}

}  // namespace

std::vector<Tensor> hidden_layers(const Tensor& x, const NetViews& p, const NetLayout& L,
                                  const c10::optional<Tensor>& fractions) {
  std::vector<Tensor> acts{x};
  acts.reserve(L.num_activations());
  for (size_t i = 0; i < L.hidden.size(); ++i) {
    acts.push_back(hidden_layer(L.hidden[i], acts.back(), p));
    if (L.iqn() && acts.size() == L.cos_activation()) {  // after the trunk: c, phi, z on rows * N rows
      const int64_t N = fractions->size(1);
      Tensor c = iqn_cosines(*fractions, L.iqn_embedding, p);
      Tensor phi = hidden_layer(L.phi, c, p);
      // h_L * phi: a product of two mirror-precision values, rounded once (exact in F32 for BF16).
      Tensor z = (acts.back().to(p.ct).repeat_interleave(N, 0) * phi.to(p.ct)).to(p.params_bf16.scalar_type());
      acts.insert(acts.end(), {c, phi, z});
    }
  }
  return acts;
}

Tensor fractions_to_slots(const Tensor& q, int64_t N) {
  return q.view({-1, N, q.size(1)}).transpose(1, 2).contiguous();
}

Tensor slots_to_fractions(const Tensor& q) {
  return q.transpose(1, 2).reshape({-1, q.size(1), 1});
}

Tensor output_logits(const Tensor& last, const NetViews& p, const NetLayout& L) {
  Tensor in = last.to(p.ct);
  Tensor logits = at::empty({last.size(0), L.head_ld}, p.params.options());
  for (const HeadSlice& h : L.heads)  // out-of-place ops: the inputs may require grad (no out= then)
    logits.narrow(1, h.pad_col, h.pad_width)
        .copy_(at::mm(in.narrow(1, h.in_col, h.in_width), p.mirror_weight(h.w_off, h.pad_width, h.in_width).t()));
  return logits;
}

Tensor head_from_logits(const Tensor& logits, const Tensor& params, const NetLayout& L) {
  Tensor head = at::empty({logits.size(0), L.head_out}, logits.options());
  for (const HeadSlice& h : L.heads)
    head.narrow(1, h.out_col, h.out_width)
        .copy_(logits.narrow(1, h.pad_col, h.out_width) + params.narrow(0, L.b_out + h.out_col, h.out_width));
  return head;
}

Tensor dueling_aggregate(const Tensor& head, const NetLayout& L) {
  const int64_t B = head.size(0), NA = L.atoms;
  auto q = at::empty({B, L.q_rows(), NA}, head.options());
  for (int64_t e = 0; e < L.members; ++e)
    for (int64_t d = 0; d < L.num_branches(); ++d) {
      const int64_t n = L.branch_sizes[d], row = e * L.total_actions + L.action_offsets[d];
      auto a = head.narrow(1, L.branch_head(e, d).out_col, n * NA).view({B, n, NA});
      if (L.dueling) {
        auto v = head.narrow(1, L.value_head(e).out_col, NA).unsqueeze(1);
        q.narrow(1, row, n).copy_(v + a - a.mean(1, /*keepdim=*/true));
      } else {
        q.narrow(1, row, n).copy_(a);
      }
    }
  return q;
}

Tensor dueling_backward(const c10::optional<Tensor>& grad_q, const c10::optional<Tensor>& grad_head,
                        const NetLayout& L) {
  const Tensor& any = grad_q.has_value() ? *grad_q : *grad_head;
  const int64_t B = any.size(0), NA = L.atoms;
  Tensor d_head = grad_head.has_value() ? grad_head->clone() : at::zeros({B, L.head_out}, any.options());
  if (grad_q.has_value()) {
    for (int64_t e = 0; e < L.members; ++e) {
      // Member e's rows of dq: its value head takes the sum over its own actions only.
      const Tensor dq = grad_q->narrow(1, e * L.total_actions, L.total_actions);
      if (L.dueling) d_head.narrow(1, L.value_head(e).out_col, NA).add_(dq.sum(1));
      for (int64_t d = 0; d < L.num_branches(); ++d) {
        const int64_t n = L.branch_sizes[d], off = L.action_offsets[d];
        auto dqd = dq.narrow(1, off, n);
        auto da = d_head.narrow(1, L.branch_head(e, d).out_col, n * NA).view({B, n, NA});
        if (L.dueling)
          da.add_(dqd - dqd.mean(1, /*keepdim=*/true));
        else
          da.add_(dqd);
      }
    }
  }
  return d_head;
}

Tensor padded_head_grad(const Tensor& d_head, const NetLayout& L, at::ScalarType dtype) {
  Tensor padded = at::zeros({d_head.size(0), L.head_ld}, d_head.options().dtype(dtype));
  for (const HeadSlice& h : L.heads)
    padded.narrow(1, h.pad_col, h.out_width).copy_(d_head.narrow(1, h.out_col, h.out_width));
  return padded;
}

std::tuple<Tensor, Tensor> backward_from_head(const Tensor& d_head, at::TensorList activations, const NetViews& p,
                                              const NetLayout& L, BackwardPrecision precision,
                                              bool need_grad_states) {
  const bool emulate_bf16 = p.params_bf16.scalar_type() == at::kBFloat16;
  const auto options = p.params.options();
  const int64_t B = activations[0].size(0);

  // GEMM operands, as the CUDA kernels form them: in `bf16` mode dY is rounded to BF16 and
  // dX uses the BF16 mirror; in `tf32`/`fp32` dY stays F32 and dX uses the F32 master.
  auto gemm_operand = [&](const Tensor& dy) {
    return (emulate_bf16 && precision == BackwardPrecision::kBF16) ? dy.to(at::kBFloat16).to(p.ct) : dy;
  };
  auto dx_weight = [&](int64_t off, int64_t rows, int64_t cols) {
    return precision == BackwardPrecision::kBF16 ? p.mirror_weight(off, rows, cols) : p.master_weight(off, rows, cols);
  };
  auto relu_backward = [&](const Tensor& dh, const Tensor& h) { return at::where(h.gt(0), dh, at::zeros({}, dh.options())); };

  Tensor grad = at::zeros({L.numel}, options);  // padding between segments stays 0
  auto grad_weight = [&](int64_t off, int64_t rows, int64_t cols) { return grad.narrow(0, off, rows * cols).view({rows, cols}); };

  // One block-diagonal layer's dW (from dY [B, out] and its input x) and, when need_dx, dX:
  // each block's product added into its input columns. Blocks that read the same columns (the
  // output heads with no head layer all read the last trunk layer) sum there.
  auto blocks_backward = [&](const std::vector<HeadSlice>& blocks, const Tensor& dy, const Tensor& x,
                             int64_t in_width, bool need_dx) {
    Tensor xc = x.to(p.ct);
    Tensor dx = need_dx ? at::zeros({x.size(0), in_width}, options) : Tensor();
    for (const HeadSlice& blk : blocks) {
      Tensor dyj = dy.narrow(1, blk.out_col, blk.out_width);
      grad_weight(blk.w_off, blk.out_width, blk.in_width)
          .copy_(at::mm(dyj.t(), xc.narrow(1, blk.in_col, blk.in_width)));
      if (need_dx)
        dx.narrow(1, blk.in_col, blk.in_width).add_(at::mm(dyj, dx_weight(blk.w_off, blk.out_width, blk.in_width)));
    }
    return dx;
  };

  // Output heads, on the last hidden activation.
  const size_t M = L.hidden.size();
  Tensor d_out = blocks_backward(L.heads, gemm_operand(d_head), activations.back(), L.head_in_width, true);
  grad.narrow(0, L.b_out, L.head_out).copy_(d_head.sum(0));

  // Hidden layers, last to first. Bias gradients come from the unrounded dZ.
  for (size_t i = M; i-- > 0;) {
    if (L.iqn() && i + 1 == static_cast<size_t>(L.trunk_layers)) {
      // d_out is d(z) [B * N, T] (z = h_L * phi, no ReLU of its own): into d(h_L) [B, T], the
      // sum over each sample's fractions, and phi's dP = d(z) h_L masked by phi's ReLU.
      const Tensor& h = activations[L.hidden_activation(i)];
      const Tensor& phi = activations[L.phi_activation()];
      const int64_t N = phi.size(0) / B;
      Tensor dh = (d_out * phi.to(p.ct)).view({B, N, -1}).sum(1);
      Tensor dP = relu_backward(d_out * h.to(p.ct).repeat_interleave(N, 0), phi);
      grad.narrow(0, L.phi.b_off, L.phi.out_width).copy_(dP.sum(0));
      blocks_backward(L.phi.blocks, gemm_operand(dP), activations[L.cos_activation()], L.iqn_embedding, false);
      d_out = dh;
    }
    const HiddenLayer& layer = L.hidden[i];
    const size_t out = L.hidden_activation(i);
    Tensor dz = relu_backward(d_out, activations[out]);
    grad.narrow(0, layer.b_off, layer.out_width).copy_(dz.sum(0));
    d_out = blocks_backward(layer.blocks, gemm_operand(dz), activations[out - 1], layer.in_width,
                            i > 0 || need_grad_states);
  }
  return {grad, need_grad_states ? d_out : at::empty({0}, options)};
}

namespace {

std::tuple<Tensor, Tensor, std::vector<Tensor>> dueling_forward_cpu(const Tensor& states, const Tensor& params,
                                                                   const Tensor& params_bf16, c10::IntArrayRef layout,
                                                                   c10::string_view backward_precision,
                                                                   const c10::optional<Tensor>& fractions) {
  const NetLayout L = parse_layout(layout, kForwardOp);
  check_forward_args(states, params, params_bf16, L, std::string(backward_precision));
  const int64_t N = check_fractions(fractions, params, L, kForwardOp, {states.size(0), -1});
  const NetViews p(params, params_bf16);
  Tensor x = states.to(params_bf16.scalar_type(), /*non_blocking=*/false, /*copy=*/true);  // never an alias of states
  std::vector<Tensor> acts = hidden_layers(x, p, L, fractions);
  Tensor head = head_from_logits(output_logits(acts.back(), p, L), params, L);
  Tensor q = dueling_aggregate(head, L);
  if (L.iqn()) q = fractions_to_slots(q, N);
  return {q, head, std::move(acts)};
}

std::tuple<Tensor, Tensor> mixed_backward_cpu(const c10::optional<Tensor>& grad_q,
                                              const c10::optional<Tensor>& grad_head, at::TensorList activations,
                                              const Tensor& params, const Tensor& params_bf16,
                                              c10::IntArrayRef layout, c10::string_view precision_str,
                                              bool need_grad_states) {
  const NetLayout L = parse_layout(layout, kBackwardOp);
  const std::string precision_s(precision_str);
  check_backward_args(grad_q, grad_head, activations, params, params_bf16, L, precision_s);
  const BackwardPrecision precision = parse_precision(precision_s, kBackwardOp);
  // IQN: grad_q [B, R, N] -> one row per (sample, fraction), as the head logits lie.
  const c10::optional<Tensor> dq = L.iqn() && grad_q.has_value() ? c10::optional<Tensor>(slots_to_fractions(*grad_q))
                                                                   : grad_q;
  return backward_from_head(dueling_backward(dq, grad_head, L), activations, NetViews(params, params_bf16), L,
                            precision, need_grad_states);
}

// The online network on state_pairs and the target network on its last B rows (s'), as two
// bf16_dueling_forward calls on state_pairs and on s' compute them, stopped before the output
// bias. batch_networks only chooses the CUDA launch strategy.
std::tuple<Tensor, Tensor, std::vector<Tensor>> online_and_target_logits_cpu(
    const Tensor& state_pairs, const Tensor& params, const Tensor& params_bf16, const Tensor& target_params,
    const Tensor& target_params_bf16, c10::IntArrayRef layout, bool /*batch_networks*/) {
  const NetLayout L = parse_layout(layout, kLogitsOp);
  const int64_t B =
      check_online_and_target_args(state_pairs, params, params_bf16, target_params, target_params_bf16, L);
  const NetViews online(params, params_bf16), target(target_params, target_params_bf16);
  Tensor x = state_pairs.to(params_bf16.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  std::vector<Tensor> on = hidden_layers(x, online, L);
  Tensor target_logits = output_logits(hidden_layers(x.narrow(0, B, B), target, L).back(), target, L);
  Tensor logits = output_logits(on.back(), online, L);
  return {logits, target_logits, std::move(on)};
}

Tensor mixed_backward_from_head_cpu(const Tensor& grad_head, const Tensor& grad_head_bf16,
                                    at::TensorList activations, const Tensor& params, const Tensor& params_bf16,
                                    c10::IntArrayRef layout, c10::string_view precision_str) {
  const NetLayout L = parse_layout(layout, kBackwardFromHeadOp);
  const std::string precision_s(precision_str);
  check_backward_from_head_args(grad_head, grad_head_bf16, activations, params, params_bf16, L, precision_s);
  // grad_head_bf16 is grad_head rounded; the reference rounds grad_head where the CUDA GEMMs
  // would read the copy (backward_from_head's gemm_operand), as mixed_backward's does.
  return std::get<0>(backward_from_head(grad_head, activations, NetViews(params, params_bf16), L,
                                        parse_precision(precision_s, kBackwardFromHeadOp), false));
}

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(dqn_ops, CPU, m) {
  m.impl("bf16_dueling_forward", &cpu::dueling_forward_cpu);
  m.impl("mixed_backward", &cpu::mixed_backward_cpu);
  m.impl("_online_and_target_logits", &cpu::online_and_target_logits_cpu);
  m.impl("_mixed_backward_from_head", &cpu::mixed_backward_from_head_cpu);
}

}  // namespace dqn_ops
