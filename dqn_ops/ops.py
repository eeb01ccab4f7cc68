"""Typed wrappers of the ``torch.ops.dqn_ops`` ops, with their fake kernels and autograd.

Each wrapper calls ``torch.ops.dqn_ops.<op>.default``; the schemas are in csrc/dqn_ops.cpp,
the CPU kernels in csrc/, the CUDA kernels in csrc/cuda/.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .layout import decode_config

BACKWARD_PRECISIONS = ("tf32", "bf16", "fp32")


class ForwardOutput(NamedTuple):
    q_logits: Tensor     # [B, sum n_d, NA]   dueling-aggregated, per branch action
    head_logits: Tensor  # [B, NA * (1 + sum n_d)]  raw value logits, then each branch's advantages
    states_bf16: Tensor  # [B, SD]   saved for the backward, at the mirror's precision
    h1: Tensor           # [B, SH1]
    h2: Tensor           # [B, SH2]
    hh: Tensor           # [B, VH + D*AH]


def bf16_dueling_forward(states: Tensor, params: Tensor, params_bf16: Tensor, layout: Sequence[int],
                         backward_precision: str = "tf32") -> ForwardOutput:
    """Forward pass of the dueling branching network on BF16 tensor cores.

    Args:
        states: [B, SD] float32 (float64 allowed on the CPU reference path).
        params: the flat F32 master parameters (biases are read from here).
        params_bf16: the flat BF16 mirror of ``params`` (the GEMMs read the weights from here).
            On the CPU it may also have ``params``' dtype: then nothing is rounded.
        layout: ``ParamLayout(config).encode()``.
        backward_precision: the precision autograd's backward will use ('tf32', 'bf16', 'fp32').
    """
    return ForwardOutput(*torch.ops.dqn_ops.bf16_dueling_forward.default(
        states, params, params_bf16, list(layout), backward_precision))


def mixed_backward(grad_q: Optional[Tensor], grad_head: Optional[Tensor], saved: ForwardOutput | Sequence[Tensor],
                   params: Tensor, params_bf16: Tensor, layout: Sequence[int], precision: str = "tf32",
                   need_grad_states: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Backward pass: the flat gradient (every dW and db) and, if asked, d(states).

    Args:
        grad_q: d(loss)/d(q_logits) [B, sum n_d, NA], or None.
        grad_head: d(loss)/d(head_logits) [B, head_out], or None (not both None).
        saved: the forward's output (or its last four tensors: states_bf16, h1, h2, hh).
        precision: 'tf32' (F32 operands on TF32 tensor cores), 'bf16' (BF16 operands),
            'fp32' (full-precision F32). See DESIGN.md fact 1.
    Returns:
        (grad_params in params' layout, grad_states [B, SD] or None)
    """
    states_bf16, h1, h2, hh = tuple(saved)[-4:]
    grad_params, grad_states = torch.ops.dqn_ops.mixed_backward.default(
        grad_q, grad_head, states_bf16, h1, h2, hh, params, params_bf16, list(layout), precision, need_grad_states)
    return grad_params, (grad_states if need_grad_states else None)


# ---------------------------------------------------------------------------------------
# Fake kernels: shapes and dtypes only, for torch.compile and FakeTensor tracing.

def _check_fake(cond, msg):
    torch._check(cond, lambda: msg)


@torch.library.register_fake("dqn_ops::bf16_dueling_forward")
def _(states, params, params_bf16, layout, backward_precision="tf32"):
    op = "dqn_ops.bf16_dueling_forward"
    c = decode_config(layout)
    _check_fake(backward_precision in BACKWARD_PRECISIONS,
                f"{op}: backward_precision: expected one of {BACKWARD_PRECISIONS}, got {backward_precision!r}")
    _check_fake(states.dim() == 2 and states.shape[1] == c.state_dim,
                f"{op}: states: expected shape [*, {c.state_dim}], got {list(states.shape)}")
    _check_fake(params.dim() == 1 and params.shape[0] == layout[-1],
                f"{op}: params: expected shape [{layout[-1]}], got {list(params.shape)}")
    _check_fake(params_bf16.shape == params.shape,
                f"{op}: params_bf16: expected shape {list(params.shape)}, got {list(params_bf16.shape)}")
    B = states.shape[0]
    lp = params_bf16.dtype
    return (params.new_empty(B, c.total_actions, c.atoms), params.new_empty(B, c.head_out),
            states.new_empty(B, c.state_dim, dtype=lp), states.new_empty(B, c.trunk_hidden[0], dtype=lp),
            states.new_empty(B, c.trunk_hidden[1], dtype=lp), states.new_empty(B, c.head_hidden, dtype=lp))


@torch.library.register_fake("dqn_ops::mixed_backward")
def _(grad_q, grad_head, states_bf16, h1, h2, hh, params, params_bf16, layout, precision="tf32",
      need_grad_states=False):
    op = "dqn_ops.mixed_backward"
    c = decode_config(layout)
    _check_fake(precision in BACKWARD_PRECISIONS,
                f"{op}: precision: expected one of {BACKWARD_PRECISIONS}, got {precision!r}")
    _check_fake(grad_q is not None or grad_head is not None, f"{op}: grad_q and grad_head are both None; give at least one")
    B = states_bf16.shape[0]
    grad_states = params.new_empty(B, c.state_dim) if need_grad_states else params.new_empty(0)
    return params.new_empty(params.shape), grad_states


# ---------------------------------------------------------------------------------------
# Autograd: bf16_dueling_forward's backward is mixed_backward. The saved activations it
# returns are marked non-differentiable.

def _forward_setup_context(ctx, inputs, output):
    states, params, params_bf16, layout, backward_precision = inputs
    _, _, states_bf16, h1, h2, hh = output
    ctx.save_for_backward(states_bf16, h1, h2, hh, params, params_bf16)
    ctx.mark_non_differentiable(states_bf16, h1, h2, hh)
    ctx.layout = list(layout)
    ctx.precision = backward_precision


def _forward_backward(ctx, grad_q, grad_head, *_saved_grads):
    states_bf16, h1, h2, hh, params, params_bf16 = ctx.saved_tensors
    need_states = ctx.needs_input_grad[0]
    if grad_q is None and grad_head is None:
        return None, None, None, None, None
    grad_params, grad_states = torch.ops.dqn_ops.mixed_backward.default(
        grad_q.contiguous() if grad_q is not None else None,
        grad_head.contiguous() if grad_head is not None else None,
        states_bf16, h1, h2, hh, params, params_bf16, ctx.layout, ctx.precision, need_states)
    return (grad_states if need_states else None), (grad_params if ctx.needs_input_grad[1] else None), None, None, None


torch.library.register_autograd("dqn_ops::bf16_dueling_forward", _forward_backward,
                                setup_context=_forward_setup_context)
