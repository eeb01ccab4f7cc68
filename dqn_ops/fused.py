"""The trainer's fused CUDA path: the three steps forward -> ``dqn_loss`` -> ``mixed_backward``
with the dueling aggregation and its backward moved into the loss.

``bf16_dueling_forward`` writes the dueling-aggregated q, ``dqn_loss`` reads it and writes
d(q), ``mixed_backward`` turns d(q) into d(head logits): three trips of the logits through
memory, two kernels (~47 µs of the 275 µs step at B = 4096 on the H200, bench/NOTES.md) that
do only that. Here the forward stops at the output layer's raw logits
(``_online_and_target_logits``: the online network on [s; s'] and the target network on s'),
the loss aggregates them as it reads them and writes d(head logits) directly
(``_dqn_loss_on_logits``), and the backward starts from there (``_mixed_backward_from_head``).
Every result is the same bits as the public ops' (tests/test_fused_step.py).

CUDA only, C51 with at most 64 atoms and at most 8 branches (``supported``); the trainer runs
the public ops otherwise. Internal: the schemas may change; the public ops are the API.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .layout import DQNConfig, decode_config

MAX_ATOMS = 64     # csrc/cuda/loss.cu: kDuelingMaxAtoms
MAX_BRANCHES = 8   # a warp per branch, 8 warps a block
# Up to this batch size the online and target networks' hidden layers run as one batched GEMM
# each (7 launches fewer a step; the target also runs on s: ~16% more FLOPs, reference config):
# bench/NOTES.md, "Step v7", has the count and the measurements it comes from.
BATCH_NETWORKS_MAX_BATCH = 4096


def supported(config: DQNConfig, loss_type: str, device: torch.device) -> bool:
    """Whether the fused path runs this network and loss on this device."""
    return (device.type == "cuda" and loss_type == "c51" and 2 <= config.atoms <= MAX_ATOMS
            and config.num_branches <= MAX_BRANCHES)


def batch_networks(batch_size: int) -> bool:
    """Whether the trainer's forward batches the online and target networks' hidden layers."""
    return batch_size <= BATCH_NETWORKS_MAX_BATCH


class Logits(NamedTuple):
    """The output layer's GEMM results (padded layout, no bias) of the online network on
    [s; s'] and of the target network on s', and the online network's activations on [s; s']
    that mixed_backward reads (as bf16_dueling_forward returns them)."""
    logits: Tensor              # [2B, head_ld] F32
    logits_next_target: Tensor  # [B, head_ld] F32
    states_bf16: Tensor         # [2B, state_dim] BF16
    h1: Tensor
    h2: Tensor
    hh: Tensor


class LossOnLogits(NamedTuple):
    loss: Tensor            # [] F32
    grad_head: Tensor       # [B, head_out] F32: d(loss)/d(head logits), compact
    grad_head_bf16: Tensor  # [B, head_ld] BF16: the same, padded layout, padding 0
    td_error: Tensor        # [B]
    mean_q: Tensor          # []


def online_and_target_logits(state_pairs: Tensor, params: Tensor, params_bf16: Tensor, target_params: Tensor,
                              target_params_bf16: Tensor, layout: Sequence[int], batch_networks: bool) -> Logits:
    return Logits(*torch.ops.dqn_ops._online_and_target_logits.default(
        state_pairs, params, params_bf16, target_params, target_params_bf16, list(layout), batch_networks))


def dqn_loss_on_logits(logits: Tensor, logits_next_online: Tensor, logits_next_target: Tensor, params: Tensor,
                       target_params: Tensor, actions: Tensor, rewards: Tensor, dones: Tensor,
                       weights: Optional[Tensor], layout: Sequence[int], v_min: float, v_max: float,
                       gamma: float) -> LossOnLogits:
    return LossOnLogits(*torch.ops.dqn_ops._dqn_loss_on_logits.default(
        logits, logits_next_online, logits_next_target, params, target_params, actions, rewards, dones, weights,
        list(layout), v_min, v_max, gamma))


def mixed_backward_from_head(grad_head: Tensor, grad_head_bf16: Tensor, saved: Sequence[Tensor], params: Tensor,
                             params_bf16: Tensor, layout: Sequence[int], precision: str = "bf16") -> Tensor:
    states_bf16, h1, h2, hh = tuple(saved)[-4:]
    return torch.ops.dqn_ops._mixed_backward_from_head.default(grad_head, grad_head_bf16, states_bf16, h1, h2, hh,
                                                               params, params_bf16, list(layout), precision)


# ---------------------------------------------------------------------------------------
# Fake kernels: shapes and dtypes only, for torch.compile and FakeTensor tracing.

@torch.library.register_fake("dqn_ops::_online_and_target_logits")
def _(state_pairs, params, params_bf16, target_params, target_params_bf16, layout, batch_networks):
    c = decode_config(layout)
    op = "dqn_ops._online_and_target_logits"
    torch._check(state_pairs.dim() == 2 and state_pairs.shape[1] == c.state_dim,
                 lambda: f"{op}: state_pairs: expected shape [*, {c.state_dim}], got {list(state_pairs.shape)}")
    rows, lp = state_pairs.shape[0], params_bf16.dtype
    torch._check(rows % 2 == 0, lambda: f"{op}: state_pairs: expected [s; s'], an even number of rows, got {rows}")
    widths = (c.state_dim, c.trunk_hidden[0], c.trunk_hidden[1], c.head_hidden)
    return (params.new_empty(rows, c.head_ld), params.new_empty(rows // 2, c.head_ld),
            *(state_pairs.new_empty(rows, w, dtype=lp) for w in widths))


@torch.library.register_fake("dqn_ops::_dqn_loss_on_logits")
def _(logits, logits_next_online, logits_next_target, params, target_params, actions, rewards, dones, weights,
      layout, v_min, v_max, gamma):
    c = decode_config(layout)
    op = "dqn_ops._dqn_loss_on_logits"
    torch._check(logits.dim() == 2 and logits.shape[1] == c.head_ld,
                 lambda: f"{op}: logits: expected shape [*, {c.head_ld}], got {list(logits.shape)}")
    B = logits.shape[0]
    return (logits.new_empty(()), logits.new_empty(B, c.head_out), logits.new_empty(B, c.head_ld, dtype=torch.bfloat16),
            logits.new_empty(B), logits.new_empty(()))


@torch.library.register_fake("dqn_ops::_mixed_backward_from_head")
def _(grad_head, grad_head_bf16, states_bf16, h1, h2, hh, params, params_bf16, layout, precision="bf16"):
    return params.new_empty(params.shape)
