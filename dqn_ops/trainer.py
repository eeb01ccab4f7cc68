"""``Trainer``: one DQN training step of a branching, distributional network (any ``DQNConfig``:
dueling or not, any trunk and head depth), on the device, without host syncs, replayed from one
CUDA graph after a short warm-up.

The step: one online forward on [s; s'] (activations of s saved; s' for the double-DQN action
choice), target forward on s', ``dqn_loss`` (C51, QR, IQN, or MSE/Huber for one atom) with its gradient,
``mixed_backward``, global grad-norm clip + Adam writing the BF16 mirror (``fused_adam_bf16``),
spectral norm of every weight matrix (``batched_spectral_norm``), Polyak update of the target
and its mirror (``ema_update``). Scalars (loss, grad norm, mean Q, skipped) are read back every
``readback_interval`` steps without a sync (``dqn_ops.readback``).

Forward, loss and backward are ``dqn_ops.step.InternalOpsStep`` on every device for a network
of one head group that is not IQN's: the dueling aggregation and its backward inside the loss,
the same results bit for bit as the public ops (``dqn_ops.step.PublicOpsStep``); on CUDA, for
C51 with few enough atoms or QR, and few enough branches over its members, the loss is one fused kernel
(``uses_fused_path``). An IQN network's step is ``PublicOpsStep`` (its forward takes the
fractions), a network with head groups' ``GroupsStep`` (each group's public-ops step).

An ensemble (``DQNConfig(ensemble=E)``): every member learns as its own double-DQN learner on
the shared trunk; with ``TrainerConfig.bootstrap_p`` < 1 the loss weights member e's term of
the transition at replay row i by the bootstrap mask ``ops.bootstrap_masks`` draws for (the key
``group_mask_seed(seed, group, rank)``, i, e) (the batch then carries the replay's ``indices``); exploring
(``act_explore``) scores each action by mean + ``act_ucb`` * std over the members, greedy acting
(``act``, evaluation) by the mean.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import ops, side_stream
from .graphed import CapturedStep, on_device
from .layout import DQNConfig, check_betas, check_bool, check_choice, check_float, check_int, check_seed
from .network import DuelingBranchQNet
from .optim import FusedAdamBF16
from .readback import DeferredReadback
from .spectral import SpectralNorm
from .step import (GroupsStep, InternalOpsStep, PublicOpsStep, default_batch_networks, fused_loss_supported,
                   quantile_midpoints)

BATCH_KEYS = ("states", "actions", "rewards", "next_states", "dones")
OPTIONAL_BATCH_KEYS = ("weights", "indices")  # indices: the replay rows, read for bootstrap masks
STAT_FIELDS = ("loss", "grad_norm", "mean_q", "skipped")
MIRRORS = {"bf16": torch.bfloat16, "f32": torch.float32}  # TrainerConfig.mirror -> the networks' mirror_dtype


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Hyper-parameters of the training step (defaults: those of the plain-PyTorch anchor step
    that docs/design.md compares against). Frozen, as ``DQNConfig``: every field is checked once,
    at construction, and a trainer reads its config when it is built (``dataclasses.replace``
    makes a changed copy; ``Trainer.set_lr`` changes the learning rate of a built trainer)."""

    batch_size: int = 256
    lr: float = 1e-4
    betas: Tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    max_grad_norm: Optional[float] = 10.0
    gamma: float = 0.99            # discount of the stored return (gamma ** n for n-step returns)
    v_min: float = -10.0
    v_max: float = 10.0
    tau: float = 0.005             # Polyak rate of the target network
    sigma_max: Optional[float] = 1.0  # spectral-norm clamp; None: no spectral norm
    n_power_iterations: int = 1
    # 'c51', 'qr', 'mse', 'huber', 'iqn'; None: 'iqn' for an IQN network, 'c51' with atoms > 1, else 'huber'
    loss_type: Optional[str] = None
    backward_precision: str = "bf16"
    # The networks' mirror (what the GEMMs read): 'bf16'; 'f32' (CPU only) keeps an F32 one,
    # so nothing is rounded anywhere: the same step in F32, as plain PyTorch computes it (the
    # reference that tells BF16's effects on training from the formulas'; dqn_ops.Trainer only).
    mirror: str = "bf16"
    use_cuda_graph: bool = True    # on CUDA: capture the step after warmup_steps eager steps
    warmup_steps: int = 3
    readback_interval: int = 100
    on_non_finite: str = "raise"   # 'raise': NonFiniteError; 'flag': count them in non_finite_steps
    # An ensemble's bootstrap (DQNConfig(ensemble=E)): member e learns from a transition with this
    # probability (ops.bootstrap_masks over the batch's replay indices); 1: every member from every
    # transition (no masks).
    bootstrap_p: float = 1.0
    act_ucb: float = 0.0           # acting scores mean + act_ucb * std over an ensemble's members
    # An IQN network's fractions per sample (docs/iqn-design.md): N = N' = K, the online network
    # at N fractions drawn per sample (tau), the target at N' others (tau'), the next action and
    # acting by the mean over the K midpoints (2k + 1) / 2K.
    iqn_fractions: int = 32
    # A network with head groups (DQNConfig.aux): each aux group's loss type, one entry per group
    # (None: its kind's first, HeadGroup.loss_types: 'q' groups MSE); (): every group's default.
    aux_loss_types: Tuple[Optional[str], ...] = ()

    def _set(self, field: str, value):
        object.__setattr__(self, field, value)  # the checked, normalised value of a frozen field

    def __post_init__(self):
        """Checks every field at construction (types and ranges); the error names the field, what
        was expected and what came. Numbers are stored as float / int, betas as a tuple."""
        n = "TrainerConfig"
        self._set("batch_size", check_int(n, "batch_size", self.batch_size, minimum=1))
        self._set("lr", check_float(n, "lr", self.lr, low=0.0, low_open=True))
        self._set("betas", check_betas(n, self.betas))
        self._set("adam_eps", check_float(n, "adam_eps", self.adam_eps, low=0.0))
        self._set("weight_decay", check_float(n, "weight_decay", self.weight_decay, low=0.0))
        check_bool(n, "decoupled_weight_decay", self.decoupled_weight_decay)
        if self.max_grad_norm is not None:  # inf: the norm is computed, nothing is clipped
            self._set("max_grad_norm", check_float(n, "max_grad_norm", self.max_grad_norm, low=0.0, low_open=True,
                                                   finite=False))
        self._set("gamma", check_float(n, "gamma", self.gamma, low=0.0, high=1.0))
        self._set("v_min", check_float(n, "v_min", self.v_min))
        self._set("v_max", check_float(n, "v_max", self.v_max))
        if not self.v_min < self.v_max:
            raise ValueError(f"{n}: v_min must be below v_max (the C51 support [v_min, v_max]), got "
                             f"v_min={self.v_min!r}, v_max={self.v_max!r}")
        self._set("tau", check_float(n, "tau", self.tau, low=0.0, high=1.0))
        if self.sigma_max is not None:
            if isinstance(self.sigma_max, (list, tuple)):  # one clamp per weight matrix (SpectralNorm)
                if not self.sigma_max:
                    raise ValueError(f"{n}: sigma_max must be a positive number, a sequence of them or None, got "
                                     f"{self.sigma_max!r}")
                self._set("sigma_max", tuple(check_float(n, f"sigma_max[{i}]", v, low=0.0, low_open=True)
                                             for i, v in enumerate(self.sigma_max)))
            else:
                self._set("sigma_max", check_float(n, "sigma_max", self.sigma_max, low=0.0, low_open=True))
        self._set("n_power_iterations", check_int(n, "n_power_iterations", self.n_power_iterations, minimum=1))
        check_choice(n, "loss_type", self.loss_type, ops.LOSS_TYPES, allow_none=True)
        check_choice(n, "backward_precision", self.backward_precision, ops.BACKWARD_PRECISIONS)
        check_choice(n, "mirror", self.mirror, MIRRORS)
        check_bool(n, "use_cuda_graph", self.use_cuda_graph)
        if not isinstance(self.warmup_steps, bool) and isinstance(self.warmup_steps, int) and self.warmup_steps < 1:
            raise ValueError(f"{n}: warmup_steps must be >= 1 (cuBLAS must be warm before a capture), "
                             f"got {self.warmup_steps}")
        self._set("warmup_steps", check_int(n, "warmup_steps", self.warmup_steps, minimum=1))
        self._set("readback_interval", check_int(n, "readback_interval", self.readback_interval, minimum=1))
        check_choice(n, "on_non_finite", self.on_non_finite, ("raise", "flag"))
        self._set("bootstrap_p", check_float(n, "bootstrap_p", self.bootstrap_p, low=0.0, high=1.0, low_open=True))
        self._set("act_ucb", check_float(n, "act_ucb", self.act_ucb))
        self._set("iqn_fractions", check_int(n, "iqn_fractions", self.iqn_fractions, minimum=1))
        if isinstance(self.aux_loss_types, (str, bytes)) or not hasattr(self.aux_loss_types, "__iter__"):
            raise TypeError(f"{n}: aux_loss_types must be a sequence of loss types (or None), one per aux head group, "
                            f"got {self.aux_loss_types!r}")
        self._set("aux_loss_types", tuple(self.aux_loss_types))
        for i, t in enumerate(self.aux_loss_types):
            check_choice(n, f"aux_loss_types[{i}]", t, ops.LOSS_TYPES, allow_none=True)

    @property
    def uses_masks(self) -> bool:
        """Whether the loss takes bootstrap masks (bootstrap_p < 1): the batches then need the
        replay's indices."""
        return self.bootstrap_p < 1.0


class NonFiniteError(RuntimeError):
    """A training step produced a non-finite loss or gradient (the optimizer skipped it)."""


class NonFiniteSteps:
    """How a trainer reports its non-finite steps (``TrainerConfig.on_non_finite``), the same for
    ``Trainer`` and the plain-PyTorch ``TorchTrainer``. The trainer has ``stats`` (a
    DeferredReadback that sets apart the skipped rows), ``config``, ``non_finite_steps`` and
    ``_non_finite_message(step, row, count)``."""

    def _handle_non_finite(self):
        """The readback's flag rose after steps were enqueued: read their rows now and report them."""
        self.stats.readback()
        self.stats.reset_flag()
        self._check_rows()

    def _check_rows(self):
        """The rows the readback set apart: their step numbers appended to ``non_finite_steps``,
        and with ``on_non_finite='raise'`` a NonFiniteError naming the first."""
        bad = self.stats.take_bad_rows()
        if not bad:
            return
        new = [step for step, _ in bad]
        self.non_finite_steps.extend(new)
        if self.config.on_non_finite == "raise":
            raise NonFiniteError(self._non_finite_message(new[0], bad[0][1], len(new)))


class Trainer(NonFiniteSteps):
    """Owns the online and target networks, the optimizer, spectral norm and EMA, and runs the
    training step.

    Args:
        net_config: the network's sizes (``DQNConfig``; the reference config by default).
        config: ``TrainerConfig``.
        device: where everything lives. On CUDA with ``config.use_cuda_graph`` the step is
            captured into one CUDA graph after ``warmup_steps`` eager steps; elsewhere (CPU, or
            graphs off) the same step runs eagerly.
        seed: seeds the initial weights and the spectral-norm vectors; keys the exploration
            draws (``act_explore``) and an ensemble's bootstrap masks.

    Feed a batch either by ``step(batch)`` (a mapping with float32 states [B, SD], actions [B, D]
    int64, rewards [B], next_states [B, SD], dones [B], optionally weights [B], float32 like the
    network takes them: another dtype raises a TypeError (``load_batch``); copied into the
    static input buffers, device to device, no sync), or by writing into ``trainer.inputs``
    yourself and calling ``step()``. ``trainer.td_error`` [B] holds the last step's per-sample
    TD error (for prioritized replay), on the device.

    Ensembles (``DQNConfig(ensemble=E)``): the loss treats each member as its own double-DQN
    learner (``dqn_loss``). With ``TrainerConfig.bootstrap_p`` = p < 1 the batch must also carry
    ``indices`` int64 [B], the replay rows of its transitions (``ReplayBuffer.sample`` returns
    them; ``inputs['indices']`` then exists), and each step's loss takes the masks
    ``ops.bootstrap_masks(indices, group_mask_seed(seed, 0, rank), E, p)``, drawn on the device
    (the seed a loaded checkpoint's; rank the data-parallel one): member e learns from the
    transition at row i iff its mask is 1, the same mask every time that transition is sampled.
    p = 1 passes no masks (masks=None: with E = 1, the plain network's step bit for bit).
    ``act_explore`` scores each action by mean + ``act_ucb`` * std of the members' expected Q,
    ``act`` (evaluation) by their mean.

    Host-visible numbers: ``metrics()`` (what has been read back so far, no sync) and
    ``readback()`` (everything up to now: syncs; call it at epoch ends).

    Forward, loss and backward: ``gradient_step`` (a ``dqn_ops.step.InternalOpsStep``; an IQN
    network's a ``PublicOpsStep``, a network with head groups' a ``GroupsStep``), the same
    results bit for bit as the public ops. ``uses_fused_path`` (read-only) says whether its loss
    runs the fused loss kernel (CUDA, C51 with at most ``ops.FUSED_LOSS_MAX_ATOMS`` atoms or QR,
    at most ``ops.FUSED_LOSS_MAX_BRANCHES`` branches over the ensemble's members). ``batch_networks``: whether the forward
    runs the online and target networks' hidden layers as one batched GEMM each (fewer
    launches, more FLOPs, the same results); by default at batch sizes up to
    ``dqn_ops.step.BATCH_NETWORKS_MAX_BATCH``. Set it before the first step: a captured graph
    keeps the choice it was captured with.

    Data-parallel: when ``torch.distributed`` is initialised with more than one rank (or a
    ``process_group`` is given), each rank trains on its own ``batch_size`` samples, the flat
    gradient is averaged with one all-reduce (captured in the CUDA graph with NCCL; gloo on the
    CPU), and every rank then runs the same Adam, spectral norm and EMA, so the ranks stay
    identical with no other communication. The weights, spectral vectors and target are
    broadcast from rank 0 at construction. Metrics (loss, mean Q, TD errors) are each rank's own.

    Non-finite steps (NaN/Inf in states, rewards or dones; an out-of-range action on CUDA):
    the gradient is non-finite, so the optimizer skips the step on the device (parameters,
    moments and step count unchanged; the spectral clamp and the target EMA still apply). A
    loss that overflows with a finite gradient (MSE on a huge reward) is reported too; then
    the optimizer did apply the step, and ``NonFiniteError`` says so. A sticky device flag,
    which each step's readback kernel also stores into pinned host memory, makes the host
    notice a step or two after the GPU ran it (the host may be further ahead: the launch
    queue); it then reads back at once and raises ``NonFiniteError`` naming the step
    (``on_non_finite='raise'``) or appends it to ``non_finite_steps`` (``'flag'``).
    """

    def __init__(self, net_config: Optional[DQNConfig] = None, config: Optional[TrainerConfig] = None,
                 device: Union[str, torch.device] = "cuda", seed: int = 0, process_group=None):
        self.net_config, self.config, self.device = check_trainer_args("Trainer", net_config, config, device, seed)
        c, cfg = self.net_config, self.config
        self.loss_type = resolve_loss_type(cfg.loss_type, c.atoms, "Trainer", c.iqn)
        self.mask_seed = seed  # the bootstrap masks' key: a checkpoint's replaces it (load_state_dict)
        if cfg.mirror != "bf16" and self.device.type != "cpu":
            raise ValueError(f"Trainer: TrainerConfig.mirror={cfg.mirror!r} is the CPU's unrounded reference path; "
                             f"the {self.device.type} kernels read a BF16 mirror")
        check_device_available("Trainer", self.device)
        gen = torch.Generator().manual_seed(seed)
        net_kw = dict(backward_precision=cfg.backward_precision, mirror_dtype=MIRRORS[cfg.mirror])
        self.online = DuelingBranchQNet(c, generator=gen, **net_kw).to(self.device)
        self.target = DuelingBranchQNet(c, **net_kw).to(self.device)
        self.target.load_state_dict(self.online.state_dict())
        self.target.sync_mirror = False
        self.target.requires_grad_(False)
        self.lr = torch.full((1,), float(cfg.lr), device=self.device)  # read on the device: set_lr() between replays
        self.optimizer = FusedAdamBF16.for_network(
            self.online, lr=self.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
            decoupled_weight_decay=cfg.decoupled_weight_decay, max_grad_norm=cfg.max_grad_norm)
        self.spectral = (SpectralNorm(self.online, cfg.sigma_max, cfg.n_power_iterations, generator=gen).to(self.device)
                         if cfg.sigma_max is not None else None)

        B = cfg.batch_size
        dev = self.device
        self._state_pairs, self.inputs = input_buffers(c, cfg, dev)
        self._ones = torch.ones(B, device=dev)  # the weights of a batch without them
        self.td_error = torch.zeros(B, device=dev)
        step_kw = dict(v_min=cfg.v_min, v_max=cfg.v_max, gamma=cfg.gamma, precision=cfg.backward_precision)
        # IQN's forward takes fractions, which the internal ops do not: its step is the public ops',
        # as is every group's of a network with head groups.
        self.group_loss_types = group_loss_types(c, self.loss_type, cfg.aux_loss_types)
        if c.aux:
            self.gradient_step = GroupsStep(self.online, self.target, loss_types=self.group_loss_types, **step_kw)
        elif c.iqn:
            self.gradient_step = PublicOpsStep(self.online, self.target, loss_type=self.loss_type, **step_kw)
        else:
            self.gradient_step = InternalOpsStep(self.online, self.target, loss_type=self.loss_type,
                                                 batch_networks=default_batch_networks(B), **step_kw)
        self.stats = DeferredReadback(STAT_FIELDS, cfg.readback_interval, dev, bad_field="skipped")
        if self.spectral is not None:
            self.stats.watch("sigma", self.spectral.sigma)
        self.steps = 0  # steps enqueued
        self.non_finite_steps: List[int] = []
        self.process_group, self.world_size = _data_parallel_group(process_group)
        if self.world_size > 1:
            self._broadcast_state()
        self._runner = CapturedStep(self._step_body, self.device, cfg.use_cuda_graph,
                                    cfg.warmup_steps, owner_holds_step=True)
        # Acting (dqn_ops.ops.act): act() runs it with epsilon 0 (its counter advances unread);
        # act_explore() draws from explore_rng = (seed, call), which each call advances on the device.
        self._act_epsilon0 = torch.zeros(1, device=dev)
        self._act_greedy_rng = torch.zeros(2, dtype=torch.long, device=dev)
        self.explore_rng = ops.philox_rng(seed, dev)
        # IQN: the step draws tau and tau' from fraction_rng = (seed, step) on the device
        # (ops.iqn_fractions, advanced by one per step); acting reads the K midpoints.
        self.fraction_rng = ops.philox_rng(seed, dev)
        self._act_fractions = quantile_midpoints(cfg.iqn_fractions, self._act_epsilon0) if c.iqn else None
        self.rank = torch.distributed.get_rank(self.process_group) if self.world_size > 1 else 0
        self._fraction_row_offset = self.rank * B  # each rank's samples draw fractions of their own
        # Counts load_state_dict calls: a loop that captured device_step in its own graph
        # (dqn_ops.rl.loop) captures again when it changes (the optimizer's tensors are new).
        self.state_generation = 0

    # -- the step ---------------------------------------------------------------------
    @property
    def graphed(self) -> bool:
        return self._runner.graphed

    @property
    def uses_fused_path(self) -> bool:
        """Whether the step's loss runs the fused loss kernel (else the composition of
        the public kernels that the internal loss op runs elsewhere: the same results)."""
        return fused_loss_supported(self.net_config, self.loss_type, self.device)

    @property
    def batch_networks(self) -> bool:
        """Whether the forward batches the online and target networks' hidden layers (never for
        IQN, whose networks run at different fractions)."""
        return getattr(self.gradient_step, "batch_networks", False)

    @batch_networks.setter
    def batch_networks(self, value: bool):
        if self.net_config.iqn or self.net_config.aux:
            raise ValueError("Trainer.batch_networks: " + (
                "a network of head groups runs each group's public-ops step, the two networks apart"
                if self.net_config.aux else "an IQN network's step runs the two networks apart"))
        self.gradient_step.batch_networks = bool(value)

    def set_lr(self, lr: float):
        """New learning rate from the next step on (a device write: no sync, graph-safe). The live
        rate is the device tensor ``self.lr``; ``self.config.lr`` stays the one the trainer was
        built (or a checkpoint loaded) with."""
        self.lr.fill_(check_float("Trainer.set_lr", "lr", lr, low=0.0))  # 0 (a schedule's end): no update

    def _on_device(self):
        """The trainer's device made current (CUDA): its current stream (the caller's, a side
        stream included) is where the step, the graph's replay and the readback's copies and
        events go, whichever device was current."""
        return on_device(self.device)

    def step(self, batch: Optional[Mapping[str, Tensor]] = None):
        """One training step. With `batch`, copies it into ``inputs`` first."""
        with self._on_device():  # once for the whole step: the host's path is part of a small step's time
            if batch is not None:
                load_batch(self.inputs, batch, self._ones, exact_dtypes=True)
            self._runner.run_with_device_current()
            self._after_steps_with_device_current(1)

    # -- for a loop that captures the step in its own CUDA graph (dqn_ops.rl.loop) --------
    def device_step(self):
        """The step's device work on ``inputs`` (forward, loss, backward, optimizer, spectral
        norm, EMA, td_error, the readback row) with no host bookkeeping and no graph of its
        own: for a caller that runs it inside its own CUDA graph, with the trainer's device
        current. Around enqueueing n of them (a replay), call ``before_steps(n)`` and
        ``after_steps(n)``; n must fit the readback ring (``readback_interval``)."""
        self._step_body()

    def before_steps(self, count: int):
        """Before `count` device steps are enqueued at once: the readback copies what they
        would overwrite."""
        with self._on_device():
            self.stats.make_room(count)

    def after_steps(self, count: int):
        """After `count` steps were enqueued: the step count and the readback's bookkeeping
        (a non-finite step seen by then raises or is flagged, as ``step`` does)."""
        with self._on_device():
            self._after_steps_with_device_current(count)

    def _after_steps_with_device_current(self, count: int):
        self.steps += count
        if self.stats.after_step(count):
            self._handle_non_finite()

    @torch.no_grad()
    def _step_body(self):
        cfg, p, x, c = self.config, self.online.flat_params, self.inputs, self.net_config
        draw = lambda: ops.iqn_fractions(self.fraction_rng, cfg.batch_size, cfg.iqn_fractions,  # noqa: E731
                                         cfg.iqn_fractions, self._fraction_row_offset)
        if c.aux:  # per group: an IQN group's own draws (each call advances the stream), an ensemble's masks
            groups = self.online.layout.group_configs
            fractions = [draw() if gc.iqn else None for gc in groups]
            masks = ([self.bootstrap_masks(x["indices"], g) if gc.members > 1 else None for g, gc in enumerate(groups)]
                     if cfg.uses_masks else None)
        else:
            fractions = draw() if c.iqn else None
            masks = self.bootstrap_masks(x["indices"]) if cfg.uses_masks else None
        out = self.gradient_step(self._state_pairs, x["actions"], x["rewards"], x["dones"], x["weights"], masks,
                                 fractions)
        grad = out.grad
        if self.world_size > 1:  # data-parallel: the mean gradient over every rank's batch
            torch.distributed.all_reduce(grad, group=self.process_group)
            grad.mul_(1.0 / self.world_size)
        p.grad = grad
        self.optimizer.step()  # clip + Adam + BF16 mirror; skipped on the device when non-finite
        # The TD errors and the readback row beside spectral norm and the EMA (dqn_ops.side_stream):
        # they read the step's outputs and the optimizer's, which those two do not write.
        tail = side_stream.Branch(self.device, side_stream.LANE_STEP)
        try:
            with tail:
                self.td_error.copy_(out.td_error)
                found_inf = self.optimizer.found_inf
                self.stats.record([out.loss, self.optimizer.grad_norm, out.mean_q, found_inf], found_inf)
            if self.spectral is not None:
                self.spectral()
            ops.ema_update(self.target.flat_params, self.target.params_bf16, p, cfg.tau)
        finally:
            tail.join()

    def bootstrap_masks(self, indices: Tensor, group: int = 0) -> Tensor:
        """The bootstrap masks [B, E] this trainer's loss takes for transitions at the replay rows
        ``indices`` (``ops.bootstrap_masks`` keyed by the trainer's seed, or the loaded checkpoint's,
        with p = ``TrainerConfig.bootstrap_p``; all ones for p = 1). ``group``: head group g's
        ([B, E_g]). The key: ``group_mask_seed`` of the seed, the group and the data-parallel rank."""
        return ops.bootstrap_masks(indices, group_mask_seed(self.mask_seed, group, self.rank),
                                   self.net_config.group_config(group).members, self.config.bootstrap_p)

    @torch.no_grad()
    def _broadcast_state(self):
        src = torch.distributed.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        tensors = [self.online.flat_params.data, self.target.flat_params.data]
        if self.spectral is not None:
            tensors += [self.spectral.u, self.spectral.v]
        for t in tensors:
            torch.distributed.broadcast(t, src, group=self.process_group)
        self.online.refresh_mirror()
        self.target.refresh_mirror()

    # -- host-visible numbers -----------------------------------------------------------
    def readback(self) -> Dict[str, float]:
        """Reads every step's scalars up to now (synchronises) and returns metrics()."""
        with self._on_device():
            self.stats.readback()
        self._check_rows()
        return self.metrics()

    def metrics(self, last: Optional[int] = None) -> Dict[str, float]:
        """Aggregates of the steps read back so far (no sync): over the last `last` of them, or
        all since the start (running aggregates; ``last`` up to ``self.stats.window``, the recent
        rows kept; the means and max over the finite values, ``DeferredReadback.summary``). Keys:
        steps (the last step read + 1, a loaded checkpoint's included), loss (mean), loss_last,
        grad_norm_mean, grad_norm_max, mean_q,
        skipped, and sigma_max_seen (largest spectral-norm estimate of the last readback)."""
        out = self.stats.summary(last)
        if "sigma" in self.stats.extra:
            out["sigma_max_seen"] = max(self.stats.extra["sigma"])
        return out

    def _non_finite_message(self, step: int, r: Dict[str, float], count: int) -> str:
        """What the non-finite step `step` changed, exactly (``_step_body``'s order: the
        optimizer, then spectral norm, then the target EMA and the TD errors); `r`: its read-back row."""
        head = (f"dqn_ops.Trainer: step {step} was non-finite (loss={r['loss']}, grad_norm={r['grad_norm']}, "
                f"mean_q={r['mean_q']}). ")
        if r["skipped"] > 0:
            what = ("The optimizer skipped it (non-finite gradient): the parameters, the Adam moments and the step "
                    "count are unchanged. The rest of that step still ran: ")
        else:
            what = ("The gradient was finite, so the optimizer applied it (the parameters, the Adam moments and the "
                    "step count changed); then: ")
        ran = []
        if self.spectral is not None:
            ran.append("the spectral-norm clamp (weights rescaled to sigma <= sigma_max, its power-iteration vectors "
                       "updated)")
        ran.append(f"the target network's EMA toward the online weights (tau={self.config.tau})")
        ran.append("trainer.td_error (NaN for the poisoned samples)")
        return (head + what + ", ".join(ran) + ". "
                f"{count} such step(s) so far; look for NaN/Inf or huge values in states or rewards, or out-of-range "
                f"actions. TrainerConfig(on_non_finite='flag') counts them in trainer.non_finite_steps instead.")

    # -- acting -----------------------------------------------------------------------
    @torch.no_grad()
    def act(self, states: Tensor) -> Tensor:
        """Greedy actions [B, D] of the online network (expected Q over the support for C51, the
        quantiles' mean for QR; an ensemble's mean over the members, without ``act_ucb``'s bonus,
        which is exploration's: ``act_explore``; the first of equal maxima), from
        ``dqn_ops.ops.act`` with epsilon 0: no host sync, graph-capturable. [0, D] for an empty
        batch."""
        with self._on_device():
            return self.online.act(states, self._act_epsilon0, self._act_greedy_rng, self.config.v_min,
                                   self.config.v_max, self.loss_type, fractions=self._act_fractions).actions

    @torch.no_grad()
    def act_explore(self, states: Tensor, epsilon: Tensor) -> Tuple[Tensor, Tensor]:
        """Epsilon-greedy actions [B, D] and the greedy actions' expected Q [B, D] (before
        exploration, for logging), from ``dqn_ops.ops.act``. ``epsilon``: a one-element float32
        tensor on the trainer's device, read there (a schedule ``fill_``s it: no sync, and a
        captured graph replays with its current value). The random numbers come from
        ``explore_rng`` = (the trainer's seed, a call counter), which each call with states
        advances on the device: two trainers of one seed draw the same sequence of actions. An
        ensemble's greedy action maximises mean + ``act_ucb`` * std over the members (greedy Q:
        its mean)."""
        check_epsilon("Trainer.act_explore", epsilon)
        with self._on_device():
            return tuple(self.online.act(states, epsilon, self.explore_rng, self.config.v_min, self.config.v_max,
                                         self.loss_type, self.config.act_ucb, self._act_fractions))

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The checkpoint (``torch.save`` it; ``load_state_dict`` restores it). As
        ``nn.Module.state_dict``, the networks' and the optimizer's entries are the trainer's own
        tensors, which the next steps overwrite: ``copy.deepcopy`` it for a snapshot in memory."""
        return dict(trainer="Trainer", online=self.online.state_dict(), target=self.target.state_dict(),
                    optimizer=self.optimizer.state_dict(),
                    spectral=self.spectral.state_dict() if self.spectral is not None else None,
                    lr=self.lr.clone(), explore_rng=self.explore_rng.clone(), mask_seed=self.mask_seed,
                    fraction_rng=self.fraction_rng.clone(),
                    steps=self.steps,
                    net_config=dataclasses.asdict(self.net_config),
                    config=dataclasses.asdict(self.config))

    def load_state_dict(self, state: dict):
        """Restores a checkpoint (the step count too: the next step, and the step numbers in
        ``non_finite_steps`` / ``NonFiniteError``, continue from it); the next steps warm up and
        re-capture the graph. The optimizer's hyper-parameters (lr, betas, eps, weight decay)
        become the checkpoint's, as ``torch.optim``'s ``load_state_dict`` restores them, and
        ``self.config`` says so; ``set_lr`` after loading sets another learning rate."""
        check_checkpoint(state, "Trainer", self.net_config, self.loss_type)
        self._check_checkpoint_lengths(state)
        self.online.load_state_dict(state["online"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:  # keep reading the lr from our device tensor
            group["lr"] = self.lr
        self.lr.copy_(state["lr"])
        group = self.optimizer.param_groups[0]
        self.config = dataclasses.replace(self.config, lr=float(self.lr.item()), betas=tuple(group["betas"]),
                                          adam_eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                                          decoupled_weight_decay=bool(group["decoupled_weight_decay"]))
        if "explore_rng" in state:  # act_explore continues the checkpoint's random stream
            self.explore_rng.copy_(state["explore_rng"])
        if "fraction_rng" in state:  # and an IQN step its fractions' stream
            self.fraction_rng.copy_(state["fraction_rng"])
        # the replay rows keep the masks they had: the checkpoint's key (the graph is captured
        # anew below, with it)
        self.mask_seed = int(state.get("mask_seed", self.mask_seed))
        if self.spectral is not None and state["spectral"] is not None:
            self.spectral.load_state_dict(state["spectral"])
        self.steps = int(state["steps"])
        self.stats.set_next_step(self.steps)  # the rows recorded from now on are numbered from there
        self._runner.reset()  # the optimizer's state tensors are new: capture again after warm-up
        self.state_generation += 1

    def _check_checkpoint_lengths(self, state: dict):
        """Refuses, before anything loads, a checkpoint whose flat Adam moments (the buffer's
        length) or spectral-norm v (the matrices' row strides) have another length than this
        trainer's: written before the buffer stored the aligned network."""
        mismatches = []
        stored = self.online.layout.numel
        for moments in state["optimizer"].get("state", {}).values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in moments and moments[key].numel() != stored:
                    mismatches.append(f"its Adam {key} has {moments[key].numel()} elements, this network's flat "
                                      f"buffer {stored}")
        spectral = state.get("spectral")
        if self.spectral is not None and spectral is not None and spectral["v"].numel() != self.spectral.v.numel():
            mismatches.append(f"its spectral norm's v has {spectral['v'].numel()} elements, this trainer's "
                              f"{self.spectral.v.numel()}")
        if mismatches:
            raise ValueError(
                f"Trainer.load_state_dict: the checkpoint does not fit: {'; '.join(mismatches)}. It was written before "
                f"the buffer stored every hidden width rounded up to a multiple of 8 (DQNConfig.aligned, "
                f"docs/networks.md): its networks load (DuelingBranchQNet.load_state_dict of state['online'], "
                f"state['target']), its optimizer and spectral-norm state do not")


def check_checkpoint(state: dict, trainer: str, net_config: DQNConfig, loss_type: str):
    """That a checkpoint (a trainer's ``state_dict``) fits `trainer`'s ``load_state_dict`` with
    this network and loss type: written by the same kind of trainer (their optimizers' states
    differ; a checkpoint without the key is a Trainer's), the same network, the same loss."""
    owner = f"{trainer}.load_state_dict"
    saved_by = state.get("trainer", "Trainer")
    if saved_by != trainer:
        raise ValueError(f"{owner}: the checkpoint is a {saved_by}'s (its optimizer's state is of another kind); "
                         f"load it into a {saved_by}")
    # (checked before the network as a whole: a clearer error for the one change that keeps
    # every other size)
    members = int(state["net_config"].get("ensemble", 1))
    if members != net_config.members:
        raise ValueError(f"{owner}: the checkpoint's network is an ensemble of {members} member(s), this trainer's "
                         f"of {net_config.members} (DQNConfig.ensemble): each member has its own heads, so the "
                         f"parameters do not fit")
    if DQNConfig.from_dict(state["net_config"]) != net_config:
        raise ValueError(f"{owner}: the checkpoint's network {state['net_config']} is not this trainer's "
                         f"{dataclasses.asdict(net_config)}")
    # C51 and QR heads have the same shape: the loss type tells their outputs apart
    saved = resolve_loss_type(state.get("config", {}).get("loss_type"), net_config.atoms, owner, net_config.iqn)
    if saved != loss_type:
        raise ValueError(f"{owner}: the checkpoint was trained with loss_type {saved!r}, this trainer's is "
                         f"{loss_type!r} (the outputs mean different things)")


def check_trainer_args(owner: str, net_config, config, device, seed) -> Tuple[DQNConfig, "TrainerConfig", torch.device]:
    """A trainer's (net_config, config, device) with their defaults, after the checks both
    trainers make: the two configs' types (a TrainerConfig given as the first argument is the
    common slip) and a seed that seeds torch.Generator (check_device_available comes after the
    configs' own checks)."""
    if net_config is not None and not isinstance(net_config, DQNConfig):
        raise TypeError(f"{owner}: net_config must be a dqn_ops.DQNConfig (or None: the reference network), got "
                        f"{type(net_config).__name__}" + (" (the TrainerConfig goes second: config=...)"
                                                          if isinstance(net_config, TrainerConfig) else ""))
    if config is not None and not isinstance(config, TrainerConfig):
        raise TypeError(f"{owner}: config must be a dqn_ops.TrainerConfig (or None: the defaults), got "
                        f"{type(config).__name__}")
    check_seed(owner, seed)
    return net_config or DQNConfig(), config or TrainerConfig(), torch.device(device)


def check_device_available(owner: str, device: torch.device):
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{owner}: device {str(device)!r}, but this torch has no CUDA device "
                           f"(torch.cuda.is_available() is False): pass device='cpu'")


def check_epsilon(owner: str, epsilon):
    if not isinstance(epsilon, Tensor):
        raise TypeError(f"{owner}: epsilon must be a one-element float32 tensor on the trainer's device (read "
                        f"there: a schedule fill_()s it without a sync, a captured graph replays its current "
                        f"value), got {type(epsilon).__name__}: e.g. torch.full((1,), {epsilon!r}, device=...)")


def input_buffers(c: DQNConfig, cfg: TrainerConfig, device) -> Tuple[Tensor, Mapping[str, Tensor]]:
    """A trainer's input buffers for one batch (``static_inputs``), zeroed (the weights 1), and
    the [2B, state_dim] buffer whose two halves are its ``states`` and ``next_states``: the
    online network runs on both in one forward pass (one launch sequence instead of two)."""
    B, D = cfg.batch_size, c.num_branches
    state_pairs = torch.zeros(2 * B, c.state_dim, device=device)
    buffers = dict(states=state_pairs[:B], actions=torch.zeros(B, D, dtype=torch.long, device=device),
                   rewards=torch.zeros(B, device=device), next_states=state_pairs[B:],
                   dones=torch.zeros(B, device=device), weights=torch.ones(B, device=device))
    if cfg.uses_masks:  # the replay rows the bootstrap masks are drawn for
        buffers["indices"] = torch.zeros(B, dtype=torch.long, device=device)
    return state_pairs, static_inputs(buffers)


def static_inputs(buffers: Dict[str, Tensor]) -> Mapping[str, Tensor]:
    """A trainer's input buffers as a read-only mapping: the step reads these tensors (their
    addresses are in its CUDA graph), so a batch is written into them (``step(batch)``,
    ``load_batch`` or ``inputs[k].copy_(...)``); a new tensor bound to a key would be ignored."""
    return types.MappingProxyType(buffers)


def load_batch(inputs: Mapping[str, Tensor], batch: Mapping[str, Tensor], ones: Optional[Tensor] = None,
               exact_dtypes: bool = False, owner: str = "Trainer.step"):
    """Copies a batch (states, actions, rewards, next_states, dones, optional weights) into a
    trainer's static input buffers, device to device, checking names, shapes, dtypes and devices.
    Without weights, the weights buffer becomes 1 (copied from `ones` when given, else filled).
    ``indices`` (the replay rows) is copied when ``inputs`` has that buffer (a trainer drawing
    bootstrap masks), which then needs it: a batch without it is a KeyError; otherwise ignored.

    The dtype rule: with ``exact_dtypes`` (what ``Trainer.step`` passes) every tensor must have
    its buffer's dtype (float32; actions int64), the rule of the network and the ops, which
    reject float64 states on the F32 path: a float64 batch raises a TypeError instead of being
    rounded silently. Without it (this low-level copy's default), a floating tensor of another
    dtype (e.g. float64) is converted; integer actions must still be int64.

    The copies of matching dtype and contiguous layout go in one launch (``dqn_ops._load_batch``);
    the others (a converted dtype, a strided view) through ``Tensor.copy_``. ``owner`` names the
    caller in the errors."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise KeyError(f"{owner}: batch is missing {missing}; it needs {list(BATCH_KEYS)} (+ optional 'weights')")
    unknown = [k for k in batch if k not in BATCH_KEYS + OPTIONAL_BATCH_KEYS]
    if unknown:  # a misspelt 'weights' would otherwise train without them, silently
        raise KeyError(f"{owner}: batch has unknown keys {unknown}; it takes {list(BATCH_KEYS)} and the optional "
                       f"{list(OPTIONAL_BATCH_KEYS)}")
    for k, v in batch.items():
        if not isinstance(v, Tensor):
            raise TypeError(f"{owner}: batch[{k!r}] must be a torch.Tensor, got {type(v).__name__} (convert "
                            f"it first, e.g. torch.as_tensor(x, device=...))")
    if "indices" in inputs and "indices" not in batch:
        raise KeyError(f"{owner}: batch is missing 'indices': the bootstrap masks (TrainerConfig.bootstrap_p < 1) "
                       "are drawn per transition from its replay row, so the batch needs the replay's indices, int64 "
                       "[B] (ReplayBuffer.sample returns them)")
    pairs = []
    for k in BATCH_KEYS + OPTIONAL_BATCH_KEYS:
        if k not in batch or k not in inputs:
            continue
        src, dst = batch[k], inputs[k]
        if src.shape != dst.shape:
            raise ValueError(f"{owner}: batch[{k!r}]: expected shape {list(dst.shape)}, got {list(src.shape)}")
        if src.dtype != dst.dtype and (exact_dtypes or not (src.is_floating_point() and dst.is_floating_point())):
            hint = (f": convert it first (.to({dst.dtype})); the network and the ops take {dst.dtype} here, "
                    f"the trainer does not round a batch silently" if src.is_floating_point() and
                    dst.is_floating_point() else "")
            raise TypeError(f"{owner}: batch[{k!r}]: expected dtype {dst.dtype}, got {src.dtype}{hint}")
        if src.device != dst.device:
            raise ValueError(f"{owner}: batch[{k!r}] is on {src.device}, the trainer on {dst.device}: move "
                             f"the batch first (a copy from pageable host memory would sync with the device)")
        pairs.append((dst, src))
    if "weights" not in batch:
        if ones is None:
            inputs["weights"].fill_(1.0)
        else:
            pairs.append((inputs["weights"], ones))
    # A buffer given as its own source (a batch that is `inputs`) needs no copy.
    pairs = [(d, s) for d, s in pairs if not (d.data_ptr() == s.data_ptr() and d.stride() == s.stride())]
    direct, converted = [], []
    for d, s in pairs:
        one_launch = (d.dtype == s.dtype and d.is_contiguous() and s.is_contiguous()
                      and not any(_overlap(d, s2) for _, s2 in pairs))
        (direct if one_launch else converted).append((d, s))
    if direct:
        ops._load_batch([d for d, _ in direct], [s for _, s in direct])
    for d, s in converted:
        d.copy_(s, non_blocking=True)


def _overlap(a: Tensor, b: Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.numel() > 0 and b.numel() > 0 and a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def _data_parallel_group(process_group):
    """(group, world size): the given group, or the default one when torch.distributed is
    initialised; (None, 1) otherwise."""
    dist = torch.distributed
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return None, 1
    return process_group, dist.get_world_size(process_group)


def group_loss_types(config: DQNConfig, loss_type: str, aux_loss_types: Sequence[Optional[str]] = (),
                     owner: str = "Trainer") -> Tuple[str, ...]:
    """Each head group's loss type (both trainers'): group 0's the resolved ``loss_type``, an aux
    group's ``TrainerConfig.aux_loss_types``' entry (one per aux group, or none at all), None or
    absent its kind's first (``HeadGroup.loss_types``: a 'q' group trains with MSE). A loss its
    kind does not take is a ValueError naming `owner`."""
    aux = config.aux
    if aux_loss_types and len(aux_loss_types) != len(aux):
        raise ValueError(f"{owner}: TrainerConfig.aux_loss_types must have one entry per aux head group ({len(aux)}) "
                         f"or none, got {len(aux_loss_types)}")
    types = [loss_type]
    for g, group in enumerate(aux, 1):
        chosen = aux_loss_types[g - 1] if aux_loss_types else None
        if chosen is not None:
            group.check_loss_type(owner, f"TrainerConfig.aux_loss_types[{g - 1}]", chosen, g)
        types.append(chosen or group.loss_types[0])
    return tuple(types)


def group_mask_seed(seed: int, group: int, rank: int = 0) -> int:
    """The bootstrap masks' key of head group ``group`` (both trainers') on data-parallel rank
    ``rank``: the seed plus g * 2^32 plus rank * 2^48, so the ensemble groups' members draw apart,
    and so do the ranks, whose replays hold different transitions at the same rows."""
    return seed + (group << 32) + (rank << 48)


def resolve_loss_type(loss_type: Optional[str], atoms: int, owner: str, iqn: bool = False) -> str:
    """TrainerConfig.loss_type for a network of `atoms` atoms, IQN's or not: None picks 'iqn' (an
    IQN network), 'c51' (atoms > 1) or 'huber'; a loss that does not fit the network's outputs
    is a ValueError naming `owner`."""
    resolved = loss_type or ("iqn" if iqn else "c51" if atoms > 1 else "huber")
    if iqn != (resolved == "iqn"):
        raise ValueError(f"{owner}: loss_type {resolved!r} " + (
            "needs an IQN network (DQNConfig.iqn_embedding > 0)" if not iqn else
            "does not fit an IQN network (DQNConfig.iqn_embedding > 0), whose loss is 'iqn'"))
    needs = {"c51": "atoms > 1", "mse": "atoms == 1", "huber": "atoms == 1", "qr": "atoms >= 1",
             "iqn": "atoms == 1"}[resolved]
    fits = {"c51": atoms > 1, "mse": atoms == 1, "huber": atoms == 1, "qr": atoms >= 1, "iqn": atoms == 1}[resolved]
    if not fits:
        raise ValueError(f"{owner}: loss_type {resolved!r} needs {needs}, got a network of {atoms} atom(s)")
    return resolved


@torch.no_grad()
def greedy_actions(net: DuelingBranchQNet, states: Tensor, v_min: float = -10.0, v_max: float = 10.0,
                   loss_type: str = "c51", ucb: float = 0.0, fractions: Optional[Tensor] = None) -> Tensor:
    """argmax per branch of the expected Q (C51: softmax over atoms times the support; QR: the
    quantiles' mean; IQN: the mean at the K ``fractions`` [K]; an ensemble's mean + ucb * std
    over the members; the first of equal maxima), by ``dqn_ops.ops.act`` with epsilon 0; an
    empty batch [0, state_dim] gives an empty [0, D] int64 tensor."""
    epsilon = torch.zeros(1, device=states.device)
    rng = torch.zeros(2, dtype=torch.long, device=states.device)  # no draw is used at epsilon 0
    return net.act(states, epsilon, rng, v_min, v_max, loss_type, ucb, fractions).actions


def expected_q(q: Tensor, v_min: float, v_max: float, loss_type: str = "c51") -> Tensor:
    """[..., atoms] outputs -> [...] expected Q, as ``act`` reads them: QR the quantiles' mean
    (IQN: of its values at the fractions), C51 softmax times the support [v_min, v_max], one atom
    the value itself (torch ops)."""
    atoms = q.shape[-1]
    if loss_type in ("qr", "iqn"):
        return q.mean(-1)
    if atoms > 1:
        support = torch.linspace(v_min, v_max, atoms, device=q.device, dtype=q.dtype)
        return (q.softmax(-1) * support).sum(-1)
    return q[..., 0]


def ensemble_score(q: Tensor, members: int, ucb: float = 0.0) -> Tuple[Tensor, Tensor]:
    """[B, E * A] expected Q of E members (member e's actions from column e * A) -> (score, mean),
    each [B, A]: ``act``'s score of an action, mean_e Q_e + ucb * std_e Q_e (population std), in
    torch ops; one member or ucb = 0: the mean itself."""
    x = q.reshape(q.shape[0], members, q.shape[1] // members)
    mean = x.mean(1)
    if members == 1 or ucb == 0:
        return mean, mean
    return mean + ucb * x.std(1, correction=0), mean


def greedy_from_logits(q: Tensor, branches: Sequence[int], v_min: float, v_max: float,
                       loss_type: str = "c51", ucb: float = 0.0) -> Tensor:
    """[B, sum n_d, atoms] Q logits -> [B, D] greedy actions (first of equal maxima); the
    expected Q as ``greedy_actions`` forms it, in torch ops. An ensemble's [B, E * sum n_d,
    atoms] (E inferred from the width): the argmax of ``ensemble_score`` with ``ucb``."""
    if q.shape[0] == 0:
        return torch.empty(0, len(branches), dtype=torch.long, device=q.device)
    score, _ = ensemble_score(expected_q(q, v_min, v_max, loss_type), q.shape[1] // sum(branches), ucb)
    return torch.stack([b.argmax(1) for b in torch.split(score, list(branches), dim=1)], 1)
