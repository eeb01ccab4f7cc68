"""``dqn_loss``: the C51 (or, with one atom, MSE / Huber) double-DQN loss of a branching
network, with its gradient computed in the same pass."""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

LOSS_TYPES = ("c51", "mse", "huber")


class LossOutput(NamedTuple):
    loss: Tensor      # []  mean over samples of the (importance-weighted) per-sample loss
    grad_q: Tensor    # [B, sum n_d, atoms]  d(loss)/d(q)
    td_error: Tensor  # [B]  per-sample priority: C51 cross-entropy, or mean_d |y - Q_d| (unweighted)
    mean_q: Tensor    # []  mean expected Q of the taken actions (for logging)


def dqn_loss(q: Tensor, q_next_online: Tensor, q_next_target: Tensor, actions: Tensor, rewards: Tensor,
             dones: Tensor, branches: Sequence[int], *, v_min: float = -10.0, v_max: float = 10.0,
             gamma: float = 0.99, weights: Optional[Tensor] = None, loss_type: str = "c51") -> LossOutput:
    """The double-DQN loss of a dueling branching network, all on the device, no host sync.

    Args:
        q: dueling-aggregated logits of the online network on s, [B, sum(branches), atoms] F32.
        q_next_online: the online network on s' (chooses the next action per branch).
        q_next_target: the target network on s' (evaluates it).
        actions: [B, num_branches] int64, the action taken in each branch.
        rewards, dones: [B] F32 (dones: 1.0 for a terminal transition).
        branches: the action count of each branch.
        v_min, v_max: the C51 support (atoms evenly spaced).
        gamma: the discount of the stored return (gamma ** n for n-step returns).
        weights: [B] importance weights (prioritized replay), or None.
        loss_type: 'c51' (atoms > 1), 'mse' or 'huber' (atoms == 1, BDQ's mean-over-branches target).

    ``loss`` is differentiable w.r.t. ``q`` (its backward is ``grad_q``, already computed), so
    ``loss.backward()`` works in an autograd graph as with any PyTorch loss.

    Non-finite data: a NaN/Inf reward or done (which clamping onto the support would otherwise
    hide) makes that sample's loss, td_error and gradient NaN, so ``FusedAdamBF16`` skips the
    step and the trainer reports it. On CUDA an out-of-range action cannot be reported without
    a host sync, so it is treated the same way; on the CPU it raises.
    """
    return LossOutput(*torch.ops.dqn_ops.dqn_loss.default(q, q_next_online, q_next_target, actions, rewards, dones,
                                                          weights, list(branches), v_min, v_max, gamma, loss_type))


@torch.library.register_fake("dqn_ops::dqn_loss")
def _(q, q_next_online, q_next_target, actions, rewards, dones, weights, branches, v_min, v_max, gamma,
      loss_type="c51"):
    op = "dqn_ops.dqn_loss"
    torch._check(loss_type in LOSS_TYPES, lambda: f"{op}: loss_type: expected one of {LOSS_TYPES}, got {loss_type!r}")
    torch._check(q.dim() == 3 and q.shape[1] == sum(branches),
                 lambda: f"{op}: q: expected shape [B, {sum(branches)}, atoms], got {list(q.shape)}")
    for name, t in (("q_next_online", q_next_online), ("q_next_target", q_next_target)):
        torch._check(t.shape == q.shape, lambda: f"{op}: {name}: expected shape {list(q.shape)}, got {list(t.shape)}")
    torch._check(actions.shape == (q.shape[0], len(branches)),
                 lambda: f"{op}: actions: expected shape [{q.shape[0]}, {len(branches)}], got {list(actions.shape)}")
    return q.new_empty(()), torch.empty_like(q), q.new_empty(q.shape[0]), q.new_empty(())


def _setup_context(ctx, inputs, output):
    loss, grad_q, td_error, mean_q = output
    ctx.save_for_backward(grad_q)
    ctx.mark_non_differentiable(grad_q, td_error, mean_q)


def _backward(ctx, grad_loss, _grad_grad_q, _grad_td, _grad_mean_q):
    (grad_q,) = ctx.saved_tensors
    return grad_q * grad_loss, None, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("dqn_ops::dqn_loss", _backward, setup_context=_setup_context)
