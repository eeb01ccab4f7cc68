"""The same network in plain PyTorch (``nn.Linear`` layers, as the plain-PyTorch anchor step of docs/design.md
builds it): the baseline the benchmarks compare against and the reference the tests check the kernels with. Its
state-dict names are DuelingBranchQNet's, so weights move both ways (``dqn_ops.from_torch`` / ``dqn_ops.to_torch``)."""
from __future__ import annotations

import dataclasses
from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from ..graphed import CapturedStep, on_device
from ..layout import DQNConfig, ParamLayout, group_prefix
from ..network import DuelingBranchQNet
from ..readback import DeferredReadback
from ..spectral import SpectralNorm
from ..step import quantile_midpoints
from ..trainer import (STAT_FIELDS, NonFiniteSteps, TrainerConfig, check_checkpoint, check_device_available,
                       check_epsilon, check_trainer_args, ensemble_score, expected_q, greedy_from_logits,
                       group_loss_types, group_mask_seed, input_buffers, load_batch, resolve_loss_type)


class TorchQNet(nn.Module):
    """The network of any ``DQNConfig`` as plain ``nn.Linear`` layers, computing the formulas of
    ``dqn_ops/layout.py``: each head's layers separate (the kernels' one matrix W_h1 and
    block-diagonal deeper layers are these layers side by side).

    The layers are built from ``ParamLayout(c).tensors`` and carry its names, so the state
    dicts of this module and of ``DuelingBranchQNet`` match key for key: the trunk ``s1..sL``;
    the value head ``v1..v<H+1>`` (with dueling); branch d's head ``a<j>.<d>`` (``q<j>.<d>``
    without dueling), ``a<j>`` being a ModuleList over the branches; layer H + 1 of a head is
    its output layer (with H = 0 it reads the last trunk layer). An ensemble (E > 1) has the
    trunk and one submodule ``e<m>`` per member holding that member's heads under the same
    names (``e0.v1``, ``e1.a2.0``). An IQN network (``iqn_embedding`` = n > 0) has the layer
    ``phi`` (``nn.Linear(n, T_L)``) after the trunk and takes quantile fractions:
    ``forward(s, tau)`` (docs/iqn-design.md). Head groups (``DQNConfig.aux``;
    docs/combination-design.md): one submodule ``g<g>`` per aux group holding that group's
    layers under the same names (``g1.phi``, ``g1.v1``, ``g2.e3.a2.1``); the trunk runs once and
    ``forward`` returns every group's outputs.
    """

    def __init__(self, c: DQNConfig):
        super().__init__()
        self.config = c
        layout = ParamLayout(c)
        for name, (out_features, in_features) in layout.layers():
            # 'e1.a2.0': container 'e1' (a module), 'a2' (a ModuleList over the branches), index 0.
            *path, last = name.split(".")
            parent = self
            for i, part in enumerate(path):
                if part not in parent._modules:
                    parent.add_module(part, nn.ModuleList() if last.isdigit() and i == len(path) - 1 else nn.Module())
                parent = parent._modules[part]
            layer = nn.Linear(in_features, out_features)
            if isinstance(parent, nn.ModuleList):
                assert len(parent) == int(last)  # ParamLayout lists the branches in order: index = branch
                parent.append(layer)
            else:
                parent.add_module(last, layer)
        # Plain lists (not submodules: the layers are registered above under their names)
        # of the trunk's layers and, per head group, its phi (IQN) and each head's layers, in
        # head order.
        self._trunk = [self.get_submodule(f"s{i + 1}") for i in range(len(c.trunk_hidden))]
        self._groups = [(gc, self.get_submodule(group_prefix(g) + "phi") if gc.iqn else None,
                         [[self.get_submodule(layout.head_layer_name(head, j + 1)) for j in range(gc.head_depth + 1)]
                          for head in layout.head_names(g)])
                        for g, gc in enumerate(layout.group_configs)]

    def forward(self, s, tau=None, group_fractions=None):
        """Returns (q [B, E * sum n_d, NA]: dueling-aggregated, or the branches' logits without
        dueling, member after member; head [B, NA * E * (dueling + sum n_d)]: every output head's
        logits in head order: the value heads first, then member 0's branches, member 1's, ...).

        An IQN network takes ``tau`` [B, N], each sample's quantile fractions, and returns (q
        [B, E * sum n_d, N]: action a's value at fraction tau[b, i] in slot i; head [B * N,
        E * (dueling + sum n_d)]: the head logits of row (b, i) at b * N + i).

        A network with head groups (``DQNConfig.aux``) returns a list of G such (q, head) pairs,
        group 0's first, each of its own group's shapes: ``tau`` is group 0's fractions (an IQN
        group 0), ``group_fractions`` one entry per aux group, [B, N_g] for an IQN group and None
        for any other (None: no aux group is IQN's). The trunk runs once."""
        c = self.config
        if not c.aux and group_fractions is not None:
            raise ValueError("TorchQNet: group_fractions are the fractions of DQNConfig.aux's head groups; this "
                             "network has none")
        fractions = [tau] + (list(group_fractions) if group_fractions is not None else [None] * len(c.aux))
        if len(fractions) != c.num_groups:
            raise ValueError(f"TorchQNet: group_fractions must have one entry per aux head group ({len(c.aux)}), got "
                             f"{len(fractions) - 1}")
        h = s
        for layer in self._trunk:
            h = F.relu(layer(h))
        outputs = [self._group_forward(g, h, fractions[g]) for g in range(c.num_groups)]
        return outputs if c.aux else outputs[0]

    def _group_forward(self, g, h, tau):
        """Head group g on the trunk's output h [B, T_L] (at its fractions tau [B, N] if IQN's): (q, head)."""
        c, phi_layer, head_layers = self._groups[g]
        if (tau is None) if c.iqn else (tau is not None):
            if g == 0:
                raise ValueError(f"TorchQNet: an IQN network (iqn_embedding > 0) takes the fractions tau [B, N], any "
                                 f"other none; this one has iqn_embedding={c.iqn_embedding} and was "
                                 f"{'not ' if tau is None else ''}given tau")
            raise ValueError(f"TorchQNet: an IQN head group takes its fractions [B, N] (group_fractions[{g - 1}] for "
                             f"group {g}), any other None; group {g} has iqn_embedding={c.iqn_embedding} and was "
                             f"{'not ' if tau is None else ''}given fractions")
        N = 1
        if c.iqn:
            if tau.dim() != 2 or tau.shape[0] != h.shape[0]:
                what = "tau" if g == 0 else f"group {g}'s fractions (group_fractions[{g - 1}])"
                raise ValueError(f"TorchQNet: {what} must be [B, N] with B = {h.shape[0]} (the states' rows), got "
                                 f"{list(tau.shape)}")
            N = tau.shape[1]
            phi = F.relu(phi_layer(iqn_cosines(tau.to(h.dtype), c.iqn_embedding)))    # [B, N, T]
            h = (h[:, None, :] * phi).reshape(-1, h.shape[1])                          # z: [B * N, T], (b, i) rows
        heads = []
        for layers in head_layers:
            x = h
            for layer in layers[:-1]:
                x = F.relu(layer(x))
            heads.append(layers[-1](x))
        E, D, values = c.members, c.num_branches, c.members * int(c.dueling)
        qs = []
        for e in range(E):
            member = [a.view(-1, n, c.atoms) for a, n in zip(heads[values + e * D:values + (e + 1) * D], c.branches)]
            if c.dueling:
                v = heads[e].view(-1, 1, c.atoms)
                member = [v + a - a.mean(1, keepdim=True) for a in member]
            qs += member
        q = torch.cat(qs, 1)
        if c.iqn:  # [B * N, E * A, 1] rows (b, i) -> [B, E * A, N]: fraction i in atom slot i
            q = q.view(-1, N, q.shape[1]).transpose(1, 2)
        return q, torch.cat(heads, 1)


def iqn_cosines(tau, n):
    """IQN's embedding input (Dabney et al. 2018, eq. 4): c[..., k] = cos(pi k tau), k = 0..n-1,
    for fractions tau [...] -> [..., n] (k = 0 gives the constant 1, the paper's sum from 0)."""
    k = torch.arange(n, device=tau.device, dtype=tau.dtype)
    return torch.cos(torch.pi * k * tau[..., None])


# The name scripts/bench_network.py imports.
TorchDuelingBranchNet = TorchQNet


def check_actions_on_cpu(actions: Tensor, branches) -> None:
    """An action outside its branch's [0, n) raises on the CPU, as ``dqn_ops.dqn_loss``'s CPU
    kernel does; on CUDA, where only a host sync could find it, and in a ``torch.compile``d loss
    (a data-dependent branch there would break the graph), ``taken_rows`` poisons its sample."""
    if actions.device.type != "cpu" or torch.compiler.is_compiling():
        return
    sizes = torch.tensor(branches, device=actions.device)
    bad = ((actions < 0) | (actions >= sizes)).nonzero()
    if len(bad):
        b, d = (int(i) for i in bad[0])
        raise ValueError(f"torch_dqn_loss: actions: sample {b} takes action {int(actions[b, d])} in branch {d}, "
                         f"which has {branches[d]} actions")


def taken_rows(x: Tensor, actions: Tensor) -> Tensor:
    """x[b, actions[b]] for each sample b (x: one branch's [B, n, ...]). An action outside [0, n)
    (on CUDA: ``check_actions_on_cpu`` refuses it on the CPU) reads row 0 plus NaN: the sample's
    loss and its gradient become NaN, as with dqn_ops's CUDA kernels, and the step's readback row
    says so (an index out of range would be a device-side assert, fatal to the process's CUDA
    context)."""
    n = x.shape[1]
    valid = (actions >= 0) & (actions < n)
    rows = torch.arange(x.shape[0], device=x.device)
    picked = x[rows, torch.where(valid, actions, torch.zeros_like(actions))]
    # added, not filled: the NaN must reach the gradient of q (a fill would stop it there)
    poison = torch.where(valid, 0.0, float("nan")).to(x.dtype)
    return picked + poison.view(-1, *[1] * (picked.dim() - 1))


def torch_dqn_loss(q, q_next_online, q_next_target, actions, rewards, dones, branches, v_min, v_max, gamma,
                   loss_type="c51", weights=None, masks=None, fractions=None):
    """The loss of ``dqn_ops.dqn_loss`` in plain PyTorch ops (the anchor's C51 loop; QR-DQN's
    quantile Huber loss; BDQ's MSE/Huber for one atom; IQN's). Returns (loss, td_error [B],
    mean_q), differentiable w.r.t. q. An ensemble (q [B, E * sum(branches), NA]) runs as B * E
    samples, member e of sample b at row b * E + e of q viewed as [B * E, sum(branches), NA]
    (each member its own learner); masks [B, E] (None: 1) weight the members' losses.

    'iqn' (docs/iqn-design.md): QR-DQN's loss at each sample's own fractions: q [B, E * A, N]
    the online values at ``fractions`` [B, N] (tau_bi in slot i), q_next_online [B, E * A, K]
    (its mean over the K slots picks the next action), q_next_target [B, E * A, N'] (the target
    values at N' other fractions); N, K, N' may differ. 'qr' is the case tau_bi = (2i + 1) / 2N."""
    B, width, NA = q.shape
    E = width // sum(branches)
    if (loss_type == "iqn") != (fractions is not None):
        raise ValueError(f"torch_dqn_loss: loss_type 'iqn' takes the fractions of q [B, N], any other none; "
                         f"got loss_type {loss_type!r} and fractions {'None' if fractions is None else 'given'}")
    if fractions is not None and tuple(fractions.shape) != (B, NA):
        raise ValueError(f"torch_dqn_loss: fractions must be [B, N] = {[B, NA]} (q's samples and slots), got "
                         f"{list(fractions.shape)}")
    check_actions_on_cpu(actions, branches)
    w = torch.ones(B, device=q.device, dtype=q.dtype) if weights is None else weights
    mask = torch.ones(B, E, device=q.device, dtype=q.dtype) if masks is None else masks
    if E > 1:  # each (sample, member) as a sample of its own, the per-sample inputs repeated
        q, q_next_online, q_next_target = (t.reshape(B * E, width // E, t.shape[-1])
                                           for t in (q, q_next_online, q_next_target))
        actions, rewards, dones = (t.repeat_interleave(E, 0) for t in (actions, rewards, dones))
        if fractions is not None:  # the members share the trunk, phi and so the fractions
            fractions = fractions.repeat_interleave(E, 0)
    rows = torch.arange(q.shape[0], device=q.device)
    per_branch, q_taken, off = [], [], 0
    if loss_type == "c51":
        support = torch.linspace(v_min, v_max, NA, device=q.device, dtype=q.dtype)
        dz = (v_max - v_min) / (NA - 1)
        with torch.no_grad():
            # A non-finite reward or done poisons its sample, as dqn_ops's kernels do (clamping
            # would hide an Inf; a NaN position would index out of range): its target row is NaN,
            # read from a position of 0.
            finite = torch.isfinite(rewards) & torch.isfinite(dones)
            tz = (rewards[:, None] + gamma * (1 - dones[:, None]) * support).clamp(v_min, v_max)
            bj = torch.where(finite[:, None], (tz - v_min) / dz, 0.0).clamp(0, NA - 1)
            poison = torch.where(finite, 0.0, float("nan")).to(q.dtype)[:, None]
            lo, hi = bj.floor().long(), bj.ceil().long()
            lo = torch.where((hi > 0) & (lo == hi), lo - 1, lo)
            hi = torch.where((lo < NA - 1) & (lo == hi), hi + 1, hi)
        for i, n in enumerate(branches):
            with torch.no_grad():
                a_star = (q_next_online[:, off:off + n].softmax(-1) * support).sum(-1).argmax(1)
                p_next = q_next_target[:, off:off + n].softmax(-1)[rows, a_star]
                m = torch.zeros(q.shape[0], NA, device=q.device, dtype=q.dtype)
                m.scatter_add_(1, lo, p_next * (hi.to(q.dtype) - bj))
                m.scatter_add_(1, hi, p_next * (bj - lo.to(q.dtype)))
                m += poison
            logits = taken_rows(q[:, off:off + n], actions[:, i])
            per_branch.append(-(m * logits.log_softmax(-1)).sum(-1))
            q_taken.append((logits.detach().softmax(-1) * support).sum(-1))
            off += n
        per_sample = torch.stack(per_branch, 1).mean(1)
        td = per_sample.detach()
    elif loss_type in ("qr", "iqn"):
        # [B, N] (iqn: each sample's own) or [1, N] (qr: the fixed midpoints) fractions of q's slots
        tau = fractions.to(q.dtype) if loss_type == "iqn" else quantile_midpoints(NA, q)[None]
        for i, n in enumerate(branches):
            with torch.no_grad():
                a_star = q_next_online[:, off:off + n].mean(-1).argmax(1)
                target = rewards[:, None] + gamma * (1 - dones[:, None]) * q_next_target[:, off:off + n][rows, a_star]
            theta = taken_rows(q[:, off:off + n], actions[:, i])    # [B, N]
            u = target[:, None, :] - theta[:, :, None]              # [B, N (i), N' (j)]
            huber = F.huber_loss(u, torch.zeros_like(u), reduction="none", delta=1.0)
            per_branch.append(((tau[:, :, None] - (u.detach() < 0).to(q.dtype)).abs() * huber).mean(2).sum(1))
            q_taken.append(theta.detach().mean(-1))
            off += n
        per_sample = torch.stack(per_branch, 1).mean(1)
        td = per_sample.detach()
    else:
        targets = []
        with torch.no_grad():
            for n in branches:
                qo, qt = q_next_online[:, off:off + n, 0], q_next_target[:, off:off + n, 0]
                targets.append(qt[rows, qo.argmax(1)])
                off += n
            y = rewards + gamma * (1 - dones) * torch.stack(targets, 1).mean(1)
        off = 0
        for i, n in enumerate(branches):
            q_taken.append(taken_rows(q[:, off:off + n, 0], actions[:, i]))
            off += n
        qa = torch.stack(q_taken, 1)
        if loss_type == "mse":
            per = (y[:, None] - qa) ** 2
        else:
            per = F.huber_loss(qa, y[:, None].expand_as(qa), reduction="none", delta=1.0)
        per_sample = per.mean(1)
        td = (y[:, None] - qa.detach()).abs().mean(1)
        q_taken = [qa.detach()[:, i] for i in range(len(branches))]
    # per_sample, td: [B * E] (b-major): the mean over members, masked for the loss only
    per_sample, td = per_sample.view(B, E), td.view(B, E).mean(1)
    return (w * (mask * per_sample).sum(1) / E).mean(), td, torch.stack(q_taken, 1).mean()


def torch_groups_loss(config: DQNConfig, qs, qs_next_online, qs_next_target, actions, rewards, dones, v_min, v_max,
                      gamma, loss_types, weights=None, masks=None, fractions=None):
    """The loss of a network with head groups (docs/combination-design.md): sum_g w_g L_g, L_g
    ``torch_dqn_loss`` of group g's outputs with its own loss type, w_g ``config.loss_weights``
    (group 0's 1), on one batch (actions, rewards, dones, weights). Per group, one entry each:
    qs / qs_next_online / qs_next_target (its q at s, and its outputs at s' as torch_dqn_loss
    takes them), ``loss_types`` (each among ``HeadGroup.loss_types`` of an aux group's kind),
    ``masks`` (an ensemble group's bootstrap masks [B, E_g], or None; None: none anywhere),
    ``fractions`` (an IQN group's fractions of q [B, N_g], else None; None: no IQN group).
    Returns (loss, td_error [B], mean_q): the TD error and mean Q are group 0's."""
    G = config.num_groups
    masks = [None] * G if masks is None else list(masks)
    fractions = [None] * G if fractions is None else list(fractions)
    for what, given in (("qs", qs), ("qs_next_online", qs_next_online), ("qs_next_target", qs_next_target),
                        ("loss_types", loss_types), ("masks", masks), ("fractions", fractions)):
        if len(given) != G:
            raise ValueError(f"torch_groups_loss: {what} must have one entry per head group ({G}), got {len(given)}")
    for g, group in enumerate(config.aux, 1):
        group.check_loss_type("torch_groups_loss", f"loss_types[{g}]", loss_types[g], g)
    total = td = mean_q = None
    for g, w in enumerate(config.loss_weights):
        loss, td_g, mean_q_g = torch_dqn_loss(qs[g], qs_next_online[g], qs_next_target[g], actions, rewards, dones,
                                              config.branches, v_min, v_max, gamma, loss_types[g], weights, masks[g],
                                              fractions[g])
        total = w * loss if total is None else total + w * loss
        if g == 0:
            td, mean_q = td_g, mean_q_g
    return total, td, mean_q


class TorchTrainer(NonFiniteSteps):
    """The training step of ``dqn_ops.Trainer`` in plain PyTorch, F32 (TF32 off): the F32 path
    of the convergence-parity check and the baseline of the benchmarks. Same constructor,
    ``step``, ``act``, ``readback`` and ``metrics``; ``amp=True`` runs the forwards under
    autocast BF16. On CUDA with ``use_cuda_graph`` the step is captured after warm-up like
    the dqn_ops one (``torch.optim.Adam(capturable=True)``). Ensembles as ``Trainer``: the same
    bootstrap masks (``ops.bootstrap_masks`` of the batch's ``indices``, keyed by the seed) and
    the same acting scores (exploring: mean + ``act_ucb`` * std over the members; ``act``: the mean).
    Non-finite steps as ``Trainer``'s: a non-finite gradient skips the update (on CUDA on the
    device, the fused Adam's ``found_inf``), a non-finite reward or done or an out-of-range action
    (on CUDA; the CPU refuses it) poisons its sample, and ``TrainerConfig.on_non_finite`` says
    whether such a step raises ``NonFiniteError`` or is counted in ``non_finite_steps``.

    ``exploration`` says where ``act_explore``'s random numbers come from: ``"philox"`` (the
    default) draws them with ``ops.epsilon_greedy`` from ``explore_rng`` = (the seed's Philox key,
    a call counter), exactly as ``dqn_ops.Trainer(seed=seed).act_explore`` draws its own, so the
    two trainers of one seed explore alike wherever their greedy actions agree (a comparison of
    the two then pairs their runs: common random numbers); ``"torch"`` draws them with
    ``torch.rand`` (torch's generator; no dqn_ops op in acting). ``fractions`` says the same of
    an IQN step's quantile fractions: ``"philox"`` draws tau and tau' with ``ops.iqn_fractions``
    from ``fraction_rng``, as ``dqn_ops.Trainer(seed=seed)`` draws them (one draw per IQN head
    group per step, in group order), ``"torch"`` with ``torch.rand``."""

    def __init__(self, net_config=None, config=None, device="cuda", seed: int = 0, amp: bool = False,
                 exploration: str = "philox", fractions: str = "philox"):
        self.net_config, self.config, self.device = check_trainer_args("TorchTrainer", net_config, config, device,
                                                                       seed)
        c, cfg = self.net_config, self.config
        if cfg.mirror != "bf16":
            raise ValueError(f"TorchTrainer: TrainerConfig.mirror is dqn_ops.Trainer's (plain PyTorch keeps no mirror: "
                             f"F32, or BF16 autocast with amp=True), got {cfg.mirror!r}")
        for name, value in (("exploration", exploration), ("fractions", fractions)):
            if value not in ("philox", "torch"):
                raise ValueError(f"TorchTrainer: {name}: expected 'philox' (dqn_ops.Trainer's draws) or 'torch' "
                                 f"(torch.rand), got {value!r}")
        check_device_available("TorchTrainer", self.device)
        self.amp = amp
        self.seed = seed
        self.exploration = exploration
        self.fractions = fractions
        self.loss_type = resolve_loss_type(cfg.loss_type, c.atoms, "TorchTrainer", c.iqn)
        self.group_loss_types = group_loss_types(c, self.loss_type, cfg.aux_loss_types, "TorchTrainer")
        self._groups = [c.group_config(g) for g in range(c.num_groups)]
        # The same initial weights and spectral-norm vectors as dqn_ops.Trainer(seed=seed): the
        # two paths start from one point, so a comparison sees only their numerics.
        gen = torch.Generator().manual_seed(seed)
        init = DuelingBranchQNet(c, generator=gen)
        init_sn = SpectralNorm(init, 1.0, generator=gen)
        self.online = TorchQNet(c).to(self.device)
        self.online.load_state_dict(init.state_dict())
        self.target = TorchQNet(c).to(self.device)
        self.target.load_state_dict(self.online.state_dict())
        self.target.requires_grad_(False)
        self.optimizer = self._adam(cfg.decoupled_weight_decay)
        params = dict(self.online.named_parameters())
        self.weights = [params[name] for name in init_sn.names]
        rows = [w.shape[0] for w in self.weights]
        self.us = [u.clone().to(self.device) for u in torch.split(init_sn.u, rows)]
        B = cfg.batch_size
        dev = self.device
        _, self.inputs = input_buffers(c, cfg, dev)
        self._ones = torch.ones(B, device=dev)  # the weights of a batch without them
        self.td_error = torch.zeros(B, device=dev)
        # act_explore's constant, made before any capture (a host-to-device copy cannot be captured)
        self._branch_sizes = torch.tensor(c.branches, device=dev)
        self._branch_offsets = torch.tensor([sum(c.branches[:d]) for d in range(c.num_branches)], device=dev)
        # The draws with 'philox': dqn_ops.Trainer's explore_rng and fraction_rng for this seed.
        self.explore_rng = ops.philox_rng(seed, dev)
        self.fraction_rng = ops.philox_rng(seed, dev)
        # IQN: the K = N midpoints every row acts and picks the next action at (as Trainer's)
        self._midpoints = quantile_midpoints(cfg.iqn_fractions, torch.empty(0, device=dev))[None]
        self.stats = DeferredReadback(STAT_FIELDS, cfg.readback_interval, dev, bad_field="skipped")
        self.steps = 0
        self.non_finite_steps: List[int] = []  # as Trainer's (TrainerConfig.on_non_finite='flag')
        self._runner = CapturedStep(self._step_body, self.device, cfg.use_cuda_graph,
                                    cfg.warmup_steps, owner_holds_step=True)

    def step(self, batch=None):
        if batch is not None:
            load_batch(self.inputs, batch, self._ones, exact_dtypes=True, owner="TorchTrainer.step")
        self._runner()
        self.after_steps(1)

    # -- what dqn_ops.rl.loop.TrainingLoop drives (as dqn_ops.Trainer has it) ---------------
    def device_step(self):
        self._step_body()

    def before_steps(self, count: int):
        self.stats.make_room(count)

    def after_steps(self, count: int):
        self.steps += count
        if self.stats.after_step(count):  # a non-finite step seen: reported now, as Trainer does
            self._handle_non_finite()

    def _non_finite_message(self, step: int, r: dict, count: int) -> str:
        what = ("The optimizer skipped it (non-finite gradient): the parameters, the Adam moments and the step "
                "count are unchanged; the spectral-norm clamp and the target network's EMA still ran."
                if r["skipped"] > 0 else "The gradient was finite, so the optimizer applied it.")
        return (f"TorchTrainer: step {step} was non-finite (loss={r['loss']}, grad_norm={r['grad_norm']}, "
                f"mean_q={r['mean_q']}). {what} {count} such step(s) so far. TrainerConfig(on_non_finite='flag') "
                f"counts them in trainer.non_finite_steps instead.")

    def _on_device(self):
        return on_device(self.device)

    @torch.no_grad()
    def act_explore(self, states, epsilon):
        """Epsilon-greedy: the greedy action of each branch, or with probability `epsilon` (a
        one-element device tensor) a uniform random action for every branch; the random numbers
        ``dqn_ops.Trainer``'s (``exploration='philox'``: ``ops.epsilon_greedy`` on ``explore_rng``)
        or torch's generator's (``'torch'``); both graph-safe on CUDA. Returns (actions, greedy
        expected Q). An ensemble's greedy action maximises mean + ``act_ucb`` * std over the
        members, its greedy Q the mean."""
        check_epsilon("TorchTrainer.act_explore", epsilon)
        c = self.net_config
        q = expected_q(self._forward_q(self.online, states, self._at_midpoints(states))[0].float(), self.config.v_min,
                       self.config.v_max, self.loss_type)
        score, mean = ensemble_score(q, c.members, self.config.act_ucb)
        greedy = torch.stack([b.argmax(1) for b in torch.split(score, list(c.branches), dim=1)], 1)
        greedy_q = mean.gather(1, greedy + self._branch_offsets)
        if self.exploration == "philox":
            return ops.epsilon_greedy(greedy, c.branches, epsilon, self.explore_rng), greedy_q
        n = self._branch_sizes
        random = torch.minimum((torch.rand(states.shape[0], c.num_branches, device=q.device) * n).long(), n - 1)
        explore = torch.rand(states.shape[0], 1, device=q.device) < epsilon
        return torch.where(explore, random, greedy), greedy_q

    def _at_midpoints(self, states):
        """Each head group's fractions at the midpoints for `states`' rows: [B, K] for an IQN group,
        None for any other."""
        return [self._midpoints.expand(states.shape[0], -1) if gc.iqn else None for gc in self._groups]

    def _draw_fractions(self):
        """Each head group's (tau, tau') for the batch, [B, N] each for an IQN group (None for any
        other): ``ops.iqn_fractions`` on ``fraction_rng`` (fractions='philox', Trainer's draws)
        or torch.rand."""
        B, N = self.config.batch_size, self.config.iqn_fractions
        if self.fractions == "philox":
            draws = [ops.iqn_fractions(self.fraction_rng, B, N, N) if gc.iqn else None for gc in self._groups]
            return [None if d is None else d.tau for d in draws], [None if d is None else d.tau_target for d in draws]
        return ([torch.rand(B, N, device=self.device) if gc.iqn else None for gc in self._groups],
                [torch.rand(B, N, device=self.device) if gc.iqn else None for gc in self._groups])

    def _forward_q(self, net, states, fractions):
        """Each head group's q on `states` at its `fractions` (one entry per group), group 0's first."""
        if not self.net_config.aux:
            return [net(states, *(() if fractions[0] is None else (fractions[0],)))[0]]
        return [q for q, _ in net(states, fractions[0], fractions[1:])]

    def _loss_part(self):
        """Forwards (online on s and s', target on s') and the loss (with an ensemble's bootstrap
        masks when bootstrap_p < 1: ``dqn_ops.Trainer``'s, the same op on the same key). IQN: s
        at tau, s' at the midpoints (the next action), the target at tau', both drawn here
        (``_draw_fractions``)."""
        cfg, x, c = self.config, self.inputs, self.net_config
        masks = ([ops.bootstrap_masks(x["indices"], group_mask_seed(self.seed, g), gc.members, cfg.bootstrap_p)
                  if gc.members > 1 or not c.aux else None for g, gc in enumerate(self._groups)]
                 if cfg.uses_masks else [None] * c.num_groups)
        tau, tau_target = self._draw_fractions()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            with torch.no_grad():
                qo = [q.float() for q in self._forward_q(self.online, x["next_states"],
                                                          self._at_midpoints(x["next_states"]))]
                qt = [q.float() for q in self._forward_q(self.target, x["next_states"], tau_target)]
            qs = [q.float() for q in self._forward_q(self.online, x["states"], tau)]
        if c.aux:
            return torch_groups_loss(c, qs, qo, qt, x["actions"], x["rewards"], x["dones"], cfg.v_min, cfg.v_max,
                                     cfg.gamma, self.group_loss_types, x["weights"], masks, tau)
        return torch_dqn_loss(qs[0], qo[0], qt[0], x["actions"], x["rewards"], x["dones"], c.branches, cfg.v_min,
                              cfg.v_max, cfg.gamma, self.loss_type, x["weights"], masks[0], tau[0])

    @torch.no_grad()
    def _post_part(self):
        """After the optimizer: the anchor's spectral norm (power iteration, clamp) and the EMA."""
        cfg = self.config
        if cfg.sigma_max is not None:
            for w, u in zip(self.weights, self.us):
                for _ in range(cfg.n_power_iterations):
                    v = F.normalize(w.t() @ u, dim=0)
                    u.copy_(F.normalize(w @ v, dim=0))
                sigma = u @ w @ v
                w.mul_(torch.clamp(cfg.sigma_max / sigma, max=1.0))
        torch._foreach_lerp_(list(self.target.parameters()), list(self.online.parameters()), cfg.tau)

    def compile_parts(self):
        """torch.compile the forward + loss and the post-step updates (the strongest PyTorch
        recipe of the anchor step when the whole step is then graphed)."""
        self._loss_part = torch.compile(self._loss_part)
        self._post_part = torch.compile(self._post_part)

    def _step_body(self):
        cfg = self.config
        loss, td, mean_q = self._loss_part()
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        params = list(self.online.parameters())
        grad_norm = (torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm, foreach=True)
                     if cfg.max_grad_norm is not None else torch.linalg.vector_norm(
                         torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))
        bad = (~torch.isfinite(grad_norm)).float().detach()
        # A non-finite gradient skips the update, as Trainer's optimizer does: on CUDA on the device
        # (the fused Adam's found_inf, GradScaler's mechanism: the moments and the step count
        # stay too), on the CPU by the host (no graph there to keep free of syncs).
        if self.device.type == "cuda":
            self.optimizer.found_inf = bad
            self.optimizer.step()
        elif not bad.item():
            self.optimizer.step()
        self._post_part()
        with torch.no_grad():
            self.td_error.copy_(td)
            self.stats.record([loss.detach(), grad_norm, mean_q, bad], bad)

    def readback(self):
        """Reads every step's scalars up to now (synchronises) and returns metrics(); a non-finite
        step raises NonFiniteError or is counted, as ``TrainerConfig.on_non_finite`` says."""
        self.stats.readback()
        self._check_rows()
        return self.metrics()

    def metrics(self, last=None):
        return self.stats.summary(last)

    @torch.no_grad()
    def act(self, states):
        return greedy_from_logits(self._forward_q(self.online, states, self._at_midpoints(states))[0],
                                  self.net_config.branches,
                                  self.config.v_min, self.config.v_max, self.loss_type)

    # -- checkpoints (as dqn_ops.Trainer's; a TorchTrainer loads only its own) ------------------
    def _adam(self, decoupled_weight_decay: bool) -> torch.optim.Optimizer:
        """The online network's optimizer with this trainer's settings: AdamW for decoupled weight
        decay (torch's Adam takes ``decoupled_weight_decay`` only in recent versions), else Adam."""
        cfg, cuda = self.config, self.device.type == "cuda"
        adam = torch.optim.AdamW if decoupled_weight_decay else torch.optim.Adam
        return adam(self.online.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                    weight_decay=cfg.weight_decay, capturable=cuda, fused=cuda)

    def state_dict(self) -> dict:
        """The checkpoint (``torch.save`` it; ``load_state_dict`` restores it): the networks, the
        optimizer, the spectral-norm vectors, the random streams, the masks' key and the step
        count. As ``nn.Module.state_dict``, the entries are the trainer's own tensors, which the
        next steps overwrite: ``copy.deepcopy`` it for a snapshot in memory."""
        return dict(trainer="TorchTrainer", online=self.online.state_dict(), target=self.target.state_dict(),
                    optimizer=self.optimizer.state_dict(), spectral_u=[u.clone() for u in self.us],
                    explore_rng=self.explore_rng.clone(), fraction_rng=self.fraction_rng.clone(),
                    mask_seed=self.seed, steps=self.steps,
                    net_config=dataclasses.asdict(self.net_config), config=dataclasses.asdict(self.config))

    def load_state_dict(self, state: dict):
        """Restores a checkpoint of a TorchTrainer of this network and loss type (the step count
        too); the next steps warm up and re-capture the graph. The optimizer's hyper-parameters
        become the checkpoint's, as ``torch.optim``'s ``load_state_dict`` restores them, and
        ``self.config`` says so."""
        check_checkpoint(state, "TorchTrainer", self.net_config, self.loss_type)
        if len(state["spectral_u"]) != len(self.us):
            raise ValueError(f"TorchTrainer.load_state_dict: the checkpoint has {len(state['spectral_u'])} "
                             f"spectral-norm vectors, this trainer {len(self.us)}")
        self.online.load_state_dict(state["online"])
        self.target.load_state_dict(state["target"])
        decoupled = bool(state["config"]["decoupled_weight_decay"])
        if decoupled != isinstance(self.optimizer, torch.optim.AdamW):  # the other kind of weight decay
            self.optimizer = self._adam(decoupled)
        self.optimizer.load_state_dict(state["optimizer"])
        group = self.optimizer.param_groups[0]
        self.config = dataclasses.replace(self.config, lr=float(group["lr"]), betas=tuple(group["betas"]),
                                          adam_eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                                          decoupled_weight_decay=decoupled)
        with torch.no_grad():
            for u, saved in zip(self.us, state["spectral_u"]):
                u.copy_(saved)
            self.explore_rng.copy_(state["explore_rng"])
            self.fraction_rng.copy_(state["fraction_rng"])
        self.seed = int(state["mask_seed"])  # the replay rows keep the masks they had
        self.steps = int(state["steps"])
        self.stats.set_next_step(self.steps)
        self._runner.reset()  # the optimizer's state tensors are new: capture again after warm-up
