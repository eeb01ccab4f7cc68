// CPU reference kernels of bf16_dueling_forward and mixed_backward, written with ATen ops.
//
// They compute exactly what the CUDA kernels compute, in the same order of roundings:
// with a BF16 mirror, weights, states and hidden activations are rounded to BF16 and every
// product accumulates in F32 (the tensor cores' BF16 x BF16 -> F32); with a mirror of
// params' own dtype nothing is rounded, which gives the float64 path gradcheck runs on.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "network_args.h"

namespace dqn_ops {
namespace {

using at::Tensor;

struct Views {
  const Tensor& params;       // compute dtype: F32 or F64
  const Tensor& params_bf16;  // mirror: BF16 or params' dtype
  at::ScalarType ct;

  // A weight of the mirror (what the forward GEMMs read), in the compute dtype.
  Tensor mirror_weight(int64_t off, int64_t rows, int64_t cols) const {
    return params_bf16.narrow(0, off, rows * cols).view({rows, cols}).to(ct);
  }
  Tensor master_weight(int64_t off, int64_t rows, int64_t cols) const {
    return params.narrow(0, off, rows * cols).view({rows, cols});
  }
  Tensor bias(int64_t off, int64_t n) const { return params.narrow(0, off, n); }
};

// q_d[b, k, :] = v[b, :] + a_d[b, k, :] - mean_k a_d[b, k, :]  (BDQ local mean, per atom)
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

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> dueling_forward_cpu(
    const Tensor& states, const Tensor& params, const Tensor& params_bf16, c10::IntArrayRef layout,
    c10::string_view backward_precision) {
  const NetLayout L = parse_layout(layout, kForwardOp);
  check_forward_args(states, params, params_bf16, L, std::string(backward_precision));
  const auto lp = params_bf16.scalar_type();
  const Views p{params, params_bf16, params.scalar_type()};
  const int64_t B = states.size(0);

  // Hidden layer: relu(x W^T + b), stored at the mirror's precision (what the next GEMM reads).
  auto hidden = [&](const Tensor& x, int64_t w_off, int64_t b_off, int64_t out, int64_t in) {
    return at::relu(at::addmm(p.bias(b_off, out), x.to(p.ct), p.mirror_weight(w_off, out, in).t())).to(lp);
  };
  Tensor x = states.to(lp, /*non_blocking=*/false, /*copy=*/true);  // a new tensor, never an alias of states
  Tensor h1 = hidden(x, L.w_s1, L.b_s1, L.trunk1, L.state_dim);
  Tensor h2 = hidden(h1, L.w_s2, L.b_s2, L.trunk2, L.trunk1);
  Tensor hh = hidden(h2, L.w_h1, L.b_h1, L.head_hidden, L.trunk2);

  Tensor hhc = hh.to(p.ct);
  Tensor head = at::empty({B, L.head_out}, params.options());
  for (const HeadSlice& h : L.heads) {
    head.narrow(1, h.out_col, h.out_width)
        .copy_(at::addmm(p.bias(L.b_out + h.out_col, h.out_width), hhc.narrow(1, h.in_col, h.in_width),
                         p.mirror_weight(h.w_off, h.out_width, h.in_width).t()));
  }
  Tensor q = dueling_aggregate(head, L);
  return {q, head, x, h1, h2, hh};
}

std::tuple<Tensor, Tensor> mixed_backward_cpu(
    const c10::optional<Tensor>& grad_q, const c10::optional<Tensor>& grad_head, const Tensor& states_bf16,
    const Tensor& h1, const Tensor& h2, const Tensor& hh, const Tensor& params, const Tensor& params_bf16,
    c10::IntArrayRef layout, c10::string_view precision_str, bool need_grad_states) {
  const NetLayout L = parse_layout(layout, kBackwardOp);
  const std::string precision_s(precision_str);
  check_backward_args(grad_q, grad_head, states_bf16, h1, h2, hh, params, params_bf16, L, precision_s);
  const BackwardPrecision precision = parse_precision(precision_s, kBackwardOp);
  const Views p{params, params_bf16, params.scalar_type()};
  const bool emulate_bf16 = params_bf16.scalar_type() == at::kBFloat16;
  const int64_t B = states_bf16.size(0), NA = L.atoms;

  // GEMM operands, as the CUDA kernels form them: in `bf16` mode dY is rounded to BF16 and
  // dX uses the BF16 mirror; in `tf32`/`fp32` dY stays F32 and dX uses the F32 master.
  auto gemm_operand = [&](const Tensor& dy) {
    return (emulate_bf16 && precision == BackwardPrecision::kBF16) ? dy.to(at::kBFloat16).to(p.ct) : dy;
  };
  auto dx_weight = [&](int64_t off, int64_t rows, int64_t cols) {
    return precision == BackwardPrecision::kBF16 ? p.mirror_weight(off, rows, cols) : p.master_weight(off, rows, cols);
  };
  auto relu_backward = [&](const Tensor& dh, const Tensor& h) { return at::where(h.gt(0), dh, at::zeros({}, dh.options())); };

  // d(head logits) from d(q): dv = sum over every action; da_d = dq_d - mean_k dq_d.
  Tensor d_head = grad_head.has_value() ? grad_head->clone() : at::zeros({B, L.head_out}, params.options());
  if (grad_q.has_value()) {
    const Tensor& dq = *grad_q;
    d_head.narrow(1, 0, NA).add_(dq.sum(1));
    for (int64_t d = 0; d < L.num_branches(); ++d) {
      const int64_t n = L.branch_sizes[d], off = L.action_offsets[d];
      auto dqd = dq.narrow(1, off, n);
      d_head.narrow(1, NA * (1 + off), n * NA).view({B, n, NA}).add_(dqd - dqd.mean(1, /*keepdim=*/true));
    }
  }

  Tensor grad = at::zeros({L.numel}, params.options());  // padding between segments stays 0
  auto grad_weight = [&](int64_t off, int64_t rows, int64_t cols) { return grad.narrow(0, off, rows * cols).view({rows, cols}); };

  // Output heads (block-diagonal last layer).
  Tensor dy = gemm_operand(d_head);
  Tensor hhc = hh.to(p.ct);
  Tensor d_hh = at::empty({B, L.head_hidden}, params.options());
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
  if (!need_grad_states) d_states = at::empty({0}, params.options());
  return {grad, d_states};
}

}  // namespace

TORCH_LIBRARY_IMPL(dqn_ops, CPU, m) {
  m.impl("bf16_dueling_forward", &dueling_forward_cpu);
  m.impl("mixed_backward", &mixed_backward_cpu);
}

}  // namespace dqn_ops
