"""The training step's forward -> loss -> backward, written once.

``InternalOpsStep`` is what ``Trainer`` runs, on every device, for a network of one head group
that is not IQN's (those run ``PublicOpsStep`` and ``GroupsStep``):
``_online_and_target_logits`` (the online network on [s; s'] and the target network on s', up
to the output layer's logits) -> ``_dqn_loss_on_logits`` (the dueling aggregation, the loss and
d(loss)/d(head logits) in one pass) -> ``_mixed_backward_from_head``. On CUDA, for C51 with at
most ``FUSED_LOSS_MAX_ATOMS`` atoms or QR, with at most ``FUSED_LOSS_MAX_BRANCHES`` branches
(``fused_loss_supported``), the loss is one fused kernel: the logits cross memory once instead
of three times, four kernels fewer; elsewhere the op composes the public kernels.

``PublicOpsStep`` is the same step on the public ops, ``bf16_dueling_forward`` ->
``dqn_loss`` -> ``mixed_backward``: the reference the tests compare the trainer's path with
(the same bits) and whose ops the benchmarks time one by one. It is also the trainer's step for
IQN networks (docs/iqn-design.md), whose forward takes quantile fractions: the online network
runs on [s; s'] at [tau; the K = N midpoints], the target on s' at tau', the loss reads tau.

Both take the online and target ``DuelingBranchQNet`` (read at each call, so a checkpoint
load is seen) and the loss's settings, and run the stages ``forward(state_pairs)``,
``loss(forward_out, actions, rewards, dones, weights, masks)`` and ``backward(forward_out,
loss_out)`` one by one or together (calling the object returns a ``StepOutput``); ``masks``:
an ensemble's bootstrap masks [B, E] (``dqn_ops.ops.bootstrap_masks``) or None, as the loss
takes them; ``fractions``: an IQN network's (tau [B, N], tau' [B, N']) (``dqn_ops.ops.iqn_fractions``),
None for any other. No host sync, no allocation outside torch's caching allocator: the
sequence captures in a CUDA graph.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import ops, side_stream
from .layout import DQNConfig

# Up to this batch size the online and target networks' hidden layers run together, a dense
# layer as one launch of the dense layer kernel (or one batched GEMM and one pass): fewer
# launches, at the price of the target's pass on s (about 16% more FLOPs for the reference
# config); at larger batches the FLOPs cost more than the launches save
# (scripts/bench_batch_networks.py measures both).
BATCH_NETWORKS_MAX_BATCH = 4096


def fused_loss_supported(config: DQNConfig, loss_type: str, device: torch.device) -> bool:
    """Whether ``_dqn_loss_on_logits`` runs its fused kernel (output bias, the dueling aggregation
    when the network has one, the loss and its gradient in one launch) for this network, loss
    and device (else it composes the public kernels, with the same results). The fused kernel is
    C51's (up to ``FUSED_LOSS_MAX_ATOMS`` atoms) and QR's (any quantile count the CUDA loss
    takes), for up to ``FUSED_LOSS_MAX_BRANCHES`` branches over an ensemble's members, with
    bootstrap masks or not; a network with head groups runs each group's public ops."""
    atoms_fit = (2 <= config.atoms <= ops.FUSED_LOSS_MAX_ATOMS if loss_type == "c51"
                 else loss_type == "qr" and config.atoms <= ops.LOSS_CUDA_MAX_ATOMS)
    return (torch.device(device).type == "cuda" and atoms_fit and not config.aux
            and config.members * config.num_branches <= ops.FUSED_LOSS_MAX_BRANCHES)


def quantile_midpoints(n: int, like: Tensor) -> Tensor:
    """The fixed fractions (2k + 1) / 2n, k < n, [n] in `like`'s dtype and device: QR-DQN's
    quantiles, and the fractions IQN acts and picks the next action at (docs/iqn-design.md)."""
    return (torch.arange(n, device=like.device, dtype=like.dtype) * 2 + 1) / (2 * n)


def default_batch_networks(batch_size: int) -> bool:
    """Whether the trainer's forward batches the online and target networks' hidden layers."""
    return batch_size <= BATCH_NETWORKS_MAX_BATCH


class StepOutput(NamedTuple):
    loss: Tensor                # []
    grad: Tensor                # the flat F32 gradient, in the online network's layout
    td_error: Tensor            # [B]
    mean_q: Tensor              # []
    saved: Tuple[Tensor, ...]   # the activation list of s (states, every hidden layer): what the backward read
    forward_out: tuple          # the forward stage's output
    loss_out: tuple             # the loss stage's output


class _Params(NamedTuple):
    online: Tensor
    online_bf16: Tensor
    target: Tensor
    target_bf16: Tensor
    layout: Sequence[int]


class _Step:
    """The sequence both paths share; subclasses give its three stages."""

    def __init__(self, online, target, *, loss_type: str = "c51", v_min: float = -10.0, v_max: float = 10.0,
                 gamma: float = 0.99, precision: str = "bf16"):
        if loss_type not in ops.LOSS_TYPES:
            raise ValueError(f"{type(self).__name__}: loss_type must be one of {ops.LOSS_TYPES}, got {loss_type!r}")
        if precision not in ops.BACKWARD_PRECISIONS:
            raise ValueError(f"{type(self).__name__}: precision must be one of {ops.BACKWARD_PRECISIONS}, "
                             f"got {precision!r}")
        if online.config != target.config:
            raise ValueError(f"{type(self).__name__}: online and target networks differ: "
                             f"{online.config} vs {target.config}")
        self.online, self.target = online, target
        self.loss_type, self.v_min, self.v_max, self.gamma = loss_type, float(v_min), float(v_max), float(gamma)
        self.precision = precision

    def __call__(self, state_pairs: Tensor, actions: Tensor, rewards: Tensor, dones: Tensor,
                 weights: Optional[Tensor] = None, masks: Optional[Tensor] = None,
                 fractions: Optional[Tuple[Tensor, Tensor]] = None) -> StepOutput:
        """One forward -> loss -> backward. ``state_pairs``: [2B, SD], s then s'; actions [B, D]
        int64; rewards, dones, weights (or None) [B]; masks (or None) [B, E]; fractions: an IQN
        network's (tau [B, N], tau' [B, N']), else None."""
        self._check_fractions(fractions)
        fwd = self.forward(state_pairs, fractions)
        out = self.loss(fwd, actions, rewards, dones, weights, masks, fractions)
        grad = self.backward(fwd, out)
        return StepOutput(out.loss, grad, out.td_error, out.mean_q, self.saved(fwd), fwd, out)

    def _check_fractions(self, fractions):
        c = self._network_config()
        if (fractions is None) if c.iqn else (fractions is not None):
            raise ValueError(f"{type(self).__name__}: an IQN network's step takes fractions (tau, tau'), any "
                             f"other's none; this network has iqn_embedding={c.iqn_embedding}")

    def _network_config(self) -> DQNConfig:
        """The one-group network the stages run (the online network's)."""
        return self.online.config

    def _layout(self) -> Sequence[int]:
        return self.online._layout_ints

    def _params(self) -> _Params:
        # detached: the stages form the gradient themselves, so they run alike in any grad mode
        # (the internal ops have no autograd formula)
        net, tgt = self.online, self.target
        return _Params(net.flat_params.detach(), net.params_bf16, tgt.flat_params.detach(), tgt.params_bf16,
                       self._layout())

    def saved(self, fwd) -> Tuple[Tensor, ...]:
        """The activations of s (the first half of each tensor's rows: of the samples, or of the
        (sample, fraction) rows of an IQN network) that the backward reads; leading rows of
        contiguous tensors, so contiguous and aligned."""
        return tuple(t[:t.shape[0] // 2] for t in self._activations(fwd))

    def _activations(self, fwd) -> Sequence[Tensor]:
        raise NotImplementedError

    def forward(self, state_pairs: Tensor, fractions=None):
        raise NotImplementedError

    def loss(self, fwd, actions: Tensor, rewards: Tensor, dones: Tensor, weights: Optional[Tensor],
             masks: Optional[Tensor] = None, fractions=None):
        raise NotImplementedError

    def backward(self, fwd, loss_out) -> Tensor:
        raise NotImplementedError


class InternalOpsStep(_Step):
    """The trainer's step: ``_online_and_target_logits`` -> ``_dqn_loss_on_logits`` ->
    ``_mixed_backward_from_head``. ``batch_networks``: the forward runs both networks' hidden
    layers together, a dense layer in one launch (the same results; ``default_batch_networks(B)``
    is the trainer's choice). Stage outputs: ``ops.Logits``, ``ops.LossOnLogits``, the flat
    gradient."""

    def __init__(self, online, target, *, batch_networks: bool = False, **kwargs):
        super().__init__(online, target, **kwargs)
        if online.config.iqn:
            raise ValueError("InternalOpsStep: IQN networks run the public ops' step (PublicOpsStep)")
        if online.config.aux:
            raise ValueError("InternalOpsStep: networks with head groups run GroupsStep")
        self.batch_networks = bool(batch_networks)
        # The loss kernel's block counters, this step's own, by device (ops.new_loss_counter): made
        # here, not in a capture (where every replay would zero it again); kept, since a graph
        # captured on one device keeps using that device's after the networks move.
        self._loss_counters = {}
        self._loss_counter(online.flat_params.device)

    def forward(self, state_pairs: Tensor, fractions=None) -> ops.Logits:
        p = self._params()
        return ops._online_and_target_logits(state_pairs, p.online, p.online_bf16, p.target, p.target_bf16, p.layout,
                                             self.batch_networks)

    def _activations(self, fwd: ops.Logits):
        return fwd.activations

    def loss(self, fwd: ops.Logits, actions, rewards, dones, weights=None, masks=None,
             fractions=None) -> ops.LossOnLogits:
        p, B = self._params(), actions.shape[0]
        return ops._dqn_loss_on_logits(fwd.logits[:B], fwd.logits[B:], fwd.logits_next_target, p.online, p.target,
                                       actions, rewards, dones, weights, p.layout, self.v_min, self.v_max, self.gamma,
                                       self.loss_type, masks, self._loss_counter(actions.device))

    def _loss_counter(self, device: torch.device) -> Optional[Tensor]:
        """This step's counter on `device`; None (the launch zeroes one of its own) for a device
        first met inside a CUDA-graph capture."""
        counter = self._loss_counters.get(device)
        if counter is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            counter = self._loss_counters[device] = ops.new_loss_counter(device)
        return counter

    def backward(self, fwd: ops.Logits, loss_out: ops.LossOnLogits) -> Tensor:
        p = self._params()
        return ops._mixed_backward_from_head(loss_out.grad_head, loss_out.grad_head_bf16, self.saved(fwd), p.online,
                                             p.online_bf16, p.layout, self.precision)


class PublicForward(NamedTuple):
    online: ops.ForwardOutput  # the online network on [s; s']
    q_next_target: Tensor      # the target network's Q logits on s'


class PublicOpsStep(_Step):
    """The same step on the public ops: ``bf16_dueling_forward`` (online on [s; s'], target on
    s') -> ``dqn_loss`` -> ``mixed_backward``. Stage outputs: ``PublicForward``,
    ``ops.LossOutput``, the flat gradient. ``group``: with head groups (``DQNConfig.aux``), the
    step of group g's one-group network (``config.group_config(g)``, its layout view): its
    gradient is zero on the other groups' parameters (``GroupsStep`` adds the groups')."""

    def __init__(self, online, target, *, group: int = 0, **kwargs):
        super().__init__(online, target, **kwargs)
        self.group = online.config.check_group("PublicOpsStep", group)
        self._midpoint_rows: Optional[Tensor] = None

    def _midpoints_for(self, tau: Tensor) -> Tensor:
        """The midpoints as a [B, N] tensor like tau, kept from the last call of the same shape:
        formed anew, they are four elementwise launches on the step's chain (and in its graph,
        where the warm-up calls have formed them before the capture)."""
        m = self._midpoint_rows
        if m is None or m.shape != tau.shape or m.device != tau.device or m.dtype != tau.dtype:
            m = quantile_midpoints(tau.shape[1], tau).expand_as(tau).contiguous()
            self._midpoint_rows = m
        return m

    def _network_config(self) -> DQNConfig:
        return self.online.layout.group_configs[self.group]

    def _layout(self) -> Sequence[int]:
        return self.online._group_layouts[self.group]

    def forward(self, state_pairs: Tensor, fractions=None) -> PublicForward:
        p, B = self._params(), state_pairs.shape[0] // 2
        online_fractions = target_fractions = None
        if fractions is not None:  # IQN: s at tau, s' at the midpoints (the next action's), the target at tau'
            tau, target_fractions = fractions
            online_fractions = torch.cat([tau, self._midpoints_for(tau)])
        # The target's pass beside the online one's (dqn_ops.side_stream): neither reads the other.
        branch = side_stream.Branch(state_pairs.device, side_stream.LANE_STEP)
        try:
            with branch:
                q_next_target = ops.bf16_dueling_forward(state_pairs[B:], p.target, p.target_bf16, p.layout,
                                                         self.precision, target_fractions).q_logits
            online = ops.bf16_dueling_forward(state_pairs, p.online, p.online_bf16, p.layout, self.precision,
                                              online_fractions)
        finally:
            branch.join()
        return PublicForward(online, q_next_target)

    def _activations(self, fwd: PublicForward):
        return fwd.online.activations

    def loss(self, fwd: PublicForward, actions, rewards, dones, weights=None, masks=None,
             fractions=None) -> ops.LossOutput:
        B = actions.shape[0]
        q = fwd.online.q_logits
        return ops.dqn_loss(q[:B], q[B:], fwd.q_next_target, actions, rewards, dones, self.online.config.branches,
                            v_min=self.v_min, v_max=self.v_max, gamma=self.gamma, weights=weights,
                            loss_type=self.loss_type, masks=masks,
                            fractions=None if fractions is None else fractions[0])

    def backward(self, fwd: PublicForward, loss_out: ops.LossOutput) -> Tensor:
        p = self._params()
        return ops.mixed_backward(loss_out.grad_q, None, self.saved(fwd), p.online, p.online_bf16, p.layout,
                                  self.precision)[0]


class GroupsStep:
    """The step of a network with head groups (``DQNConfig.aux``; docs/combination-design.md):
    per group g, the public ops' step of its one-group network (``PublicOpsStep(group=g)``) with
    its own loss type, then the loss sum_g w_g L_g and the gradient sum_g w_g grad_g, added on
    the device (w_g: ``config.loss_weights``). Each group's forward runs the trunk itself; the
    trunk's gradient is the sum of the groups' (each group's is zero on the other groups' heads).
    The TD error and mean Q are group 0's (the replay priorities and acting are its).

    ``loss_types``: one per group, group 0's any the network's outputs take and an aux group's
    among its kind's (``HeadGroup.loss_types``). Calling it takes the batch as the other steps
    do, with per-group ``masks`` (an ensemble group's [B, E_g] or None; None: none anywhere) and
    ``fractions`` (an IQN group's (tau [B, N], tau' [B, N']) or None; None: no IQN group)."""

    def __init__(self, online, target, *, loss_types: Sequence[str], **kwargs):
        c = online.config
        loss_types = tuple(loss_types)
        if len(loss_types) != c.num_groups:
            raise ValueError(f"GroupsStep: loss_types must have one entry per head group ({c.num_groups}), got "
                             f"{len(loss_types)}")
        for g, group in enumerate(c.aux, 1):
            group.check_loss_type("GroupsStep", f"loss_types[{g}]", loss_types[g], g)
        self.online, self.target, self.loss_types = online, target, loss_types
        self.weights = c.loss_weights
        self.groups = [PublicOpsStep(online, target, group=g, loss_type=t, **kwargs) for g, t in enumerate(loss_types)]

    def __call__(self, state_pairs: Tensor, actions: Tensor, rewards: Tensor, dones: Tensor,
                 weights: Optional[Tensor] = None, masks: Optional[Sequence[Optional[Tensor]]] = None,
                 fractions: Optional[Sequence[Optional[Tuple[Tensor, Tensor]]]] = None) -> StepOutput:
        G = len(self.groups)
        masks = [None] * G if masks is None else list(masks)
        fractions = [None] * G if fractions is None else list(fractions)
        for what, given in (("masks", masks), ("fractions", fractions)):
            if len(given) != G:
                raise ValueError(f"GroupsStep: {what} must have one entry per head group ({G}), got {len(given)}")
        # Group g >= 1 beside group 0 on a side stream of its own (dqn_ops.side_stream): the groups'
        # steps read the same inputs and write their own outputs.
        branches = []
        outs = [None] * G
        try:
            for g in range(1, G):
                branches.append(side_stream.Branch(state_pairs.device, side_stream.group_lane(g)))
                with branches[-1]:
                    outs[g] = self.groups[g](state_pairs, actions, rewards, dones, weights, masks[g], fractions[g])
            outs[0] = self.groups[0](state_pairs, actions, rewards, dones, weights, masks[0], fractions[0])
        finally:
            for branch in branches:
                branch.join()
        loss, grad = outs[0].loss, outs[0].grad
        for w, out in zip(self.weights[1:], outs[1:]):
            loss = loss + w * out.loss
            grad = grad.add(out.grad, alpha=w)
        first = outs[0]
        return StepOutput(loss, grad, first.td_error, first.mean_q, first.saved, tuple(o.forward_out for o in outs),
                          tuple(o.loss_out for o in outs))
