// CPU reference kernels of bf16_dueling_forward and mixed_backward, written with ATen ops, and
// of the trainer-step ops that stand in for them (_online_and_target_logits,
// _mixed_backward_from_head), all built from the shared pieces of network_cpu.h.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "network_args.h"
#include "network_cpu.h"

namespace dqn_ops {
namespace cpu {

using at::Tensor;

HiddenActs hidden_layers(const Tensor& x, const NetViews& p, const NetLayout& L) {
  const auto lp = p.params_bf16.scalar_type();
  // relu(x W^T + b), stored at the mirror's precision (what the next GEMM reads).
  auto hidden = [&](const Tensor& in, int64_t w_off, int64_t b_off, int64_t out, int64_t in_width) {
    return at::relu(at::addmm(p.bias(b_off, out), in.to(p.ct), p.mirror_weight(w_off, out, in_width).t())).to(lp);
  };
  Tensor h1 = hidden(x, L.w_s1, L.b_s1, L.trunk1, L.state_dim);
  Tensor h2 = hidden(h1, L.w_s2, L.b_s2, L.trunk2, L.trunk1);
  Tensor hh = hidden(h2, L.w_h1, L.b_h1, L.head_hidden, L.trunk2);
  return {h1, h2, hh};
}

Tensor output_logits(const Tensor& hh, const NetViews& p, const NetLayout& L) {
  Tensor hhc = hh.to(p.ct);
  Tensor logits = at::empty({hh.size(0), L.head_ld}, p.params.options());
  for (const HeadSlice& h : L.heads)  // out-of-place ops: the inputs may require grad (no out= then)
    logits.narrow(1, h.pad_col, h.pad_width)
        .copy_(at::mm(hhc.narrow(1, h.in_col, h.in_width), p.mirror_weight(h.w_off, h.pad_width, h.in_width).t()));
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
  auto q = at::empty({B, L.total_actions, NA}, head.options());
  auto v = head.narrow(1, 0, NA).unsqueeze(1);
  for (int64_t d = 0; d < L.num_branches(); ++d) {
    const int64_t n = L.branch_sizes[d], off = L.action_offsets[d];
    auto a = head.narrow(1, NA * (1 + off), n * NA).view({B, n, NA});
    q.narrow(1, off, n).copy_(v + a - a.mean(1, /*keepdim=*/true));
  }
  return q;
}

Tensor dueling_backward(const c10::optional<Tensor>& grad_q, const c10::optional<Tensor>& grad_head,
                        const NetLayout& L) {
  const Tensor& any = grad_q.has_value() ? *grad_q : *grad_head;
  const int64_t B = any.size(0), NA = L.atoms;
  Tensor d_head = grad_head.has_value() ? grad_head->clone() : at::zeros({B, L.head_out}, any.options());
  if (grad_q.has_value()) {
    const Tensor& dq = *grad_q;
    d_head.narrow(1, 0, NA).add_(dq.sum(1));
    for (int64_t d = 0; d < L.num_branches(); ++d) {
      const int64_t n = L.branch_sizes[d], off = L.action_offsets[d];
      auto dqd = dq.narrow(1, off, n);
      d_head.narrow(1, NA * (1 + off), n * NA).view({B, n, NA}).add_(dqd - dqd.mean(1, /*keepdim=*/true));
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

std::tuple<Tensor, Tensor> backward_from_head(const Tensor& d_head, const Tensor& states_bf16, const Tensor& h1,
                                              const Tensor& h2, const Tensor& hh, const NetViews& p,
                                              const NetLayout& L, BackwardPrecision precision,
                                              bool need_grad_states) {
  const bool emulate_bf16 = p.params_bf16.scalar_type() == at::kBFloat16;
  const auto options = p.params.options();
  const int64_t B = states_bf16.size(0);

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

  // Output heads (block-diagonal last layer).
  Tensor dy = gemm_operand(d_head);
  Tensor hhc = hh.to(p.ct);
  Tensor d_hh = at::empty({B, L.head_hidden}, options);
  for (const HeadSlice& h : L.heads) {
    Tensor dyj = dy.narrow(1, h.out_col, h.out_width);
    grad_weight(h.w_off, h.out_width, h.in_width).copy_(at::mm(dyj.t(), hhc.narrow(1, h.in_col, h.in_width)));
    d_hh.narrow(1, h.in_col, h.in_width).copy_(at::mm(dyj, dx_weight(h.w_off, h.out_width, h.in_width)));
  }
  grad.narrow(0, L.b_out, L.head_out).copy_(d_head.sum(0));

  // Hidden layers, last to first. Bias gradients come from the unrounded dZ.
  auto hidden_backward = [&](const Tensor& d_out, const Tensor& h_out, const Tensor& x_in, int64_t w_off, int64_t b_off,
                             int64_t out, int64_t in, bool need_dx) {
    Tensor dz = relu_backward(d_out, h_out);
    grad.narrow(0, b_off, out).copy_(dz.sum(0));
    Tensor dzr = gemm_operand(dz);
    grad_weight(w_off, out, in).copy_(at::mm(dzr.t(), x_in.to(p.ct)));
    return need_dx ? at::mm(dzr, dx_weight(w_off, out, in)) : Tensor();
  };
  Tensor d_h2 = hidden_backward(d_hh, hh, h2, L.w_h1, L.b_h1, L.head_hidden, L.trunk2, true);
  Tensor d_h1 = hidden_backward(d_h2, h2, h1, L.w_s2, L.b_s2, L.trunk2, L.trunk1, true);
  Tensor d_states = hidden_backward(d_h1, h1, states_bf16, L.w_s1, L.b_s1, L.trunk1, L.state_dim, need_grad_states);
  if (!need_grad_states) d_states = at::empty({0}, options);
  return {grad, d_states};
}

namespace {

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> dueling_forward_cpu(
    const Tensor& states, const Tensor& params, const Tensor& params_bf16, c10::IntArrayRef layout,
    c10::string_view backward_precision) {
  const NetLayout L = parse_layout(layout, kForwardOp);
  check_forward_args(states, params, params_bf16, L, std::string(backward_precision));
  const NetViews p(params, params_bf16);
  Tensor x = states.to(params_bf16.scalar_type(), /*non_blocking=*/false, /*copy=*/true);  // never an alias of states
  const HiddenActs a = hidden_layers(x, p, L);
  Tensor head = head_from_logits(output_logits(a.hh, p, L), params, L);
  Tensor q = dueling_aggregate(head, L);
  return {q, head, x, a.h1, a.h2, a.hh};
}

std::tuple<Tensor, Tensor> mixed_backward_cpu(
    const c10::optional<Tensor>& grad_q, const c10::optional<Tensor>& grad_head, const Tensor& states_bf16,
    const Tensor& h1, const Tensor& h2, const Tensor& hh, const Tensor& params, const Tensor& params_bf16,
    c10::IntArrayRef layout, c10::string_view precision_str, bool need_grad_states) {
  const NetLayout L = parse_layout(layout, kBackwardOp);
  const std::string precision_s(precision_str);
  check_backward_args(grad_q, grad_head, states_bf16, h1, h2, hh, params, params_bf16, L, precision_s);
  const BackwardPrecision precision = parse_precision(precision_s, kBackwardOp);
  return backward_from_head(dueling_backward(grad_q, grad_head, L), states_bf16, h1, h2, hh,
                            NetViews(params, params_bf16), L, precision, need_grad_states);
}

// The online network on state_pairs and the target network on its last B rows (s'), as two
// bf16_dueling_forward calls on state_pairs and on s' compute them, stopped before the output
// bias. batch_networks only chooses the CUDA launch strategy.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> online_and_target_logits_cpu(
    const Tensor& state_pairs, const Tensor& params, const Tensor& params_bf16, const Tensor& target_params,
    const Tensor& target_params_bf16, c10::IntArrayRef layout, bool /*batch_networks*/) {
  const NetLayout L = parse_layout(layout, kLogitsOp);
  const int64_t B =
      check_online_and_target_args(state_pairs, params, params_bf16, target_params, target_params_bf16, L);
  const NetViews online(params, params_bf16), target(target_params, target_params_bf16);
  Tensor x = state_pairs.to(params_bf16.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  const HiddenActs on = hidden_layers(x, online, L);
  const HiddenActs tgt = hidden_layers(x.narrow(0, B, B), target, L);
  return {output_logits(on.hh, online, L), output_logits(tgt.hh, target, L), x, on.h1, on.h2, on.hh};
}

Tensor mixed_backward_from_head_cpu(const Tensor& grad_head, const Tensor& grad_head_bf16, const Tensor& states_bf16,
                                    const Tensor& h1, const Tensor& h2, const Tensor& hh, const Tensor& params,
                                    const Tensor& params_bf16, c10::IntArrayRef layout,
                                    c10::string_view precision_str) {
  const NetLayout L = parse_layout(layout, kBackwardFromHeadOp);
  const std::string precision_s(precision_str);
  check_backward_from_head_args(grad_head, grad_head_bf16, states_bf16, h1, h2, hh, params, params_bf16, L,
                                precision_s);
  // grad_head_bf16 is grad_head rounded; the reference rounds grad_head where the CUDA GEMMs
  // would read the copy (backward_from_head's gemm_operand), as mixed_backward's does.
  return std::get<0>(backward_from_head(grad_head, states_bf16, h1, h2, hh, NetViews(params, params_bf16), L,
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
