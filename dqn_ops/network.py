"""``DuelingBranchQNet``: the network as an ``nn.Module`` over one flat parameter buffer."""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import torch
from torch import Tensor, nn

from . import ops
from .layout import DQNConfig, ParamLayout


class DuelingBranchQNet(nn.Module):
    """Branching, distributional Q-network (dueling or not, any trunk and head depth:
    ``DQNConfig``) whose forward and backward run through ``dqn_ops.bf16_dueling_forward`` /
    ``dqn_ops.mixed_backward``.

    Storage: one flat F32 parameter (``flat_params``, the only registered Parameter, so any
    ``torch.optim`` optimizer and ``.to()`` work on it as on any module) and its BF16 mirror
    (``params_bf16``, a buffer the GEMMs read). The per-layer tensors are views of the flat
    buffer (``layer_views()``), and the state dict holds them under the names of a plain
    ``nn.Linear`` network (``s1.weight``, ``v2.bias``, ``a1.0.weight``, ``q1.0.bias`` ...:
    ``ParamLayout``), so state dicts load both ways.

    ``forward(states)`` returns the Q logits ``[B, E * sum(branches), atoms]`` (dueling-aggregated,
    or the branch heads' logits without dueling; E = ``config.members``, member e's rows after
    member e-1's); ``split_members`` cuts them per member, ``split_branches`` per branch.
    ``forward_full`` also returns the raw head logits and the saved activations.

    While ``sync_mirror`` is True the mirror is refreshed from ``flat_params`` by ``forward``
    whenever the master changed since the last refresh: autograd's version counter of
    ``flat_params`` (bumped by every in-place write, so by any ``torch.optim`` step) or its
    storage moved, or the mirror itself was written. A forward that finds both unchanged
    writes nothing, so a second forward before ``backward`` (the double-DQN choice on s',
    ``greedy_actions``, a ``no_grad`` evaluation) leaves the mirror that the first one saved for
    backward intact; an optimizer step between forward and backward is still caught by
    autograd's own check (the forward saves ``flat_params`` too). Writes that autograd cannot
    see (through ``flat_params.data``) need ``refresh_mirror()``. Inside a CUDA-graph capture or
    ``torch.compile`` the refresh is unconditional (it must be part of every replay). A caller
    that keeps the mirror in sync itself (``dqn_ops.FusedAdamBF16`` writes it in the Adam pass)
    sets ``sync_mirror`` False.

    ``params_bf16`` is one tensor object for the network's lifetime: ``.to()``, ``.double()``,
    ``.float()`` ... rewrite it in place (its ``.data``), so an optimizer or a caller that holds
    it (``FusedAdamBF16.for_network``) keeps writing the mirror that the forward reads.

    The mirror is BF16 beside F32 parameters. On the CPU, ``net.double()`` gives the float64
    reference path: the mirror becomes float64 too and nothing is rounded; ``net.float()``
    brings back the BF16 mirror. ``mirror_dtype=torch.float32`` (CPU only) keeps an F32 mirror
    beside F32 parameters: the same kernels with nothing rounded, so the network, and a
    ``Trainer`` of it, compute what plain PyTorch computes in F32 (the reference that tells the
    BF16 rounding's effects from the formulas').
    """

    def __init__(self, config: Optional[DQNConfig] = None, *, backward_precision: str = "tf32",
                 device=None, dtype=torch.float32, generator: Optional[torch.Generator] = None,
                 mirror_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config = config if config is not None else DQNConfig()
        self.layout = ParamLayout(self.config)
        # One ops layout per head group (DQNConfig.aux: each the trunk and that group's heads in the
        # one buffer); group 0's is the network's own without aux groups, and acting's.
        self._group_layouts = ([self.layout.encode(group=g) for g in range(self.config.num_groups)]
                               if self.config.aux else [self.layout.encode()])
        self._layout_ints = self._group_layouts[0]
        if backward_precision not in ops.BACKWARD_PRECISIONS:
            raise ValueError(f"DuelingBranchQNet: backward_precision must be one of {ops.BACKWARD_PRECISIONS}, "
                             f"got {backward_precision!r}")
        self.backward_precision = backward_precision
        if mirror_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"DuelingBranchQNet: mirror_dtype must be torch.bfloat16 or torch.float32 (CPU only), "
                             f"got {mirror_dtype!r}")
        self.mirror_dtype = mirror_dtype
        self.sync_mirror = True
        self.flat_params = nn.Parameter(torch.zeros(self.layout.numel, device=device, dtype=dtype))
        self.register_buffer("params_bf16", torch.zeros(self.layout.numel, device=device,
                                                        dtype=self._mirror_dtype_of(self.flat_params)),
                             persistent=False)
        self.reset_parameters(generator)
        self._register_state_dict_hook(_state_dict_per_layer)
        self._register_load_state_dict_pre_hook(_load_state_dict_per_layer, with_module=True)
        self.register_load_state_dict_post_hook(_refresh_mirror_after_load)  # a module-level function: picklable

    # -- parameters ---------------------------------------------------------------------
    def layer_views(self, source: Optional[Tensor] = None) -> Dict[str, Tensor]:
        """Per-layer views of ``source`` (default ``flat_params``), keyed like nn.Linear's (a
        weight whose stored width was rounded up is a strided view: ``ParamLayout.views``)."""
        return self.layout.views(self.flat_params if source is None else source)

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None):
        """nn.Linear's default initialisation, layer by layer: U(-1/sqrt(in), 1/sqrt(in))."""
        self.flat_params.zero_()
        for name, view in self.layer_views().items():
            fan_in = view.shape[1] if view.dim() == 2 else self._fan_in_of_bias(name)
            bound = 1.0 / math.sqrt(fan_in)
            sample = torch.rand(view.shape, generator=generator, dtype=torch.float64) * (2 * bound) - bound
            view.copy_(sample)
        self.refresh_mirror()

    def _fan_in_of_bias(self, name: str) -> int:
        return dict((n, s) for n, s, _ in self.layout.tensors)[name.replace(".bias", ".weight")][1]

    @torch.no_grad()
    def refresh_mirror(self):
        """Write the low-precision mirror from the master parameters."""
        self.params_bf16.copy_(self.flat_params.detach())
        self._mirror_key = self._master_key()

    def _master_key(self):
        """What says that the mirror may be stale: the master's and the mirror's version
        counters and storages (a refresh bumps the mirror's version: the key is taken after)."""
        p, m = self.flat_params, self.params_bf16
        return (p._version, p.data_ptr(), p.dtype, m._version, m.data_ptr(), m.dtype)

    def _sync_mirror(self):
        if torch.compiler.is_compiling():  # traced: the copy is part of every call of the compiled graph
            with torch.no_grad():
                self.params_bf16.copy_(self.flat_params.detach())
        elif ((self.params_bf16.is_cuda and torch.cuda.is_current_stream_capturing())  # part of every replay
              or getattr(self, "_mirror_key", None) != self._master_key()):
            self.refresh_mirror()

    def _mirror_dtype_of(self, params: Tensor) -> torch.dtype:
        """The mirror's dtype beside `params`: ``mirror_dtype`` beside F32 params (F32 only on
        the CPU), params' own dtype otherwise (the exact CPU reference path)."""
        if params.dtype != torch.float32:
            return params.dtype
        mirror_dtype = getattr(self, "mirror_dtype", torch.bfloat16)  # a module pickled before the option
        if mirror_dtype != torch.bfloat16 and params.device.type != "cpu":
            raise ValueError(f"DuelingBranchQNet: an F32 mirror (mirror_dtype=torch.float32) is the CPU's unrounded "
                             f"reference path; the {params.device.type} kernels read a BF16 mirror")
        return mirror_dtype

    def weight_matrices(self) -> Dict[str, Tensor]:
        """The weight matrices (10 for the reference config) as views of ``flat_params``."""
        return {n: v for n, v in self.layer_views().items() if n.endswith(".weight")}

    def _apply(self, fn, recurse=True):
        # .to()/.double()/.float() convert every floating tensor alike; the mirror instead
        # follows its rule (_mirror_dtype_of), checked on an empty tensor first so that a move
        # the mirror refuses changes nothing, and is rewritten from the converted params.
        # The mirror keeps its tensor object (its .data is replaced), so whoever holds it (an
        # optimizer from FusedAdamBF16.for_network) keeps writing the one the forward reads.
        self._mirror_dtype_of(fn(self.flat_params.detach()[:0]))
        mirror = self._buffers["params_bf16"]
        super()._apply(fn, recurse)
        mirror_dtype = self._mirror_dtype_of(self.flat_params)
        converted = self._buffers["params_bf16"]
        if converted.dtype != mirror_dtype or converted.device != self.flat_params.device:
            converted = torch.empty_like(self.flat_params, dtype=mirror_dtype, requires_grad=False)
        if converted is not mirror:
            mirror.data = converted
        self._buffers["params_bf16"] = mirror
        self.refresh_mirror()
        return self

    # -- forward ------------------------------------------------------------------------
    def forward_full(self, states: Tensor, fractions: Optional[Tensor] = None, group: int = 0) -> ops.ForwardOutput:
        """``ops.bf16_dueling_forward`` on this network; an IQN network takes its quantile
        fractions [B, N] (q_logits then [B, E * sum n_d, N]). With head groups
        (``DQNConfig.aux``): head group ``group`` on the trunk, the network
        ``config.group_config(group)`` is (its gradient reaches the trunk and that group's heads)."""
        layout = self._group_layout(group)
        if self.sync_mirror:
            self._sync_mirror()
        return ops.bf16_dueling_forward(states, self.flat_params, self.params_bf16, layout, self.backward_precision,
                                        fractions)

    def forward(self, states: Tensor, fractions: Optional[Tensor] = None, group: int = 0) -> Tensor:
        return self.forward_full(states, fractions, group).q_logits

    def forward_groups(self, states: Tensor, fractions: Optional[Sequence[Optional[Tensor]]] = None):
        """Every head group's ``forward_full``, group 0's first: ``fractions`` one entry per group
        ([B, N_g] for an IQN group, None for any other; None: no group is IQN's). Each group is
        one op call and runs the trunk itself; autograd adds the groups' trunk gradients."""
        G = self.config.num_groups
        fractions = [None] * G if fractions is None else list(fractions)
        if len(fractions) != G:
            raise ValueError(f"DuelingBranchQNet.forward_groups: fractions must have one entry per head group ({G}), "
                             f"got {len(fractions)}")
        return [self.forward_full(states, f, g) for g, f in enumerate(fractions)]

    def _group_layout(self, group: int):
        return self._group_layouts[self.config.check_group("DuelingBranchQNet", group)]

    @torch.no_grad()
    def act(self, states: Tensor, epsilon: Tensor, rng: Tensor, v_min: float = -10.0,
            v_max: float = 10.0, loss_type: str = "c51", ucb: float = 0.0,
            fractions: Optional[Tensor] = None) -> ops.ActOutput:
        """Epsilon-greedy actions [N, D] and the greedy actions' expected Q (``dqn_ops.ops.act``):
        ``epsilon`` a one-element float32 tensor and ``rng`` the int64 (seed, call) pair, both on
        the states' device (read and advanced there: no sync); v_min / v_max: the C51 support;
        loss_type: what the outputs are ('c51', 'qr' quantiles, 'mse' / 'huber', 'iqn'); ucb: an
        ensemble's score mean + ucb * std over the members; fractions: an IQN network's K
        fractions [K], shared by every row (``ops.act``)."""
        if self.sync_mirror:
            self._sync_mirror()
        return ops.act(states, self.flat_params.detach(), self.params_bf16, self._layout_ints, v_min, v_max,
                       epsilon, rng, loss_type, ucb, fractions)

    def split_members(self, q_logits: Tensor):
        """[B, E * sum n_d, NA] -> a tuple of E views [B, sum n_d, NA], one per ensemble member."""
        return torch.split(q_logits, self.config.total_actions, dim=1)

    def split_branches(self, q_logits: Tensor):
        """[B, sum n_d, NA] -> a tuple of [B, n_d, NA], one per branch (views). An ensemble's
        [B, E * sum n_d, NA] -> a tuple of E such tuples, one per member (member e's branch d
        at ``[e][d]``); one member's rows (``split_members``) split as a single network's."""
        c = self.config
        if c.members > 1 and q_logits.shape[1] == c.q_rows:
            return tuple(torch.split(m, list(c.branches), dim=1) for m in self.split_members(q_logits))
        return torch.split(q_logits, list(c.branches), dim=1)

    def extra_repr(self) -> str:
        c = self.config
        return (f"state_dim={c.state_dim}, trunk_hidden={c.trunk_hidden}, value_hidden={c.value_hidden}, "
                f"adv_hidden={c.adv_hidden}, atoms={c.atoms}, branches={c.branches}, dueling={c.dueling}, "
                + (f"ensemble={c.ensemble}, " if c.ensemble > 1 else "")
                + f"parameters={c.num_parameters}, backward_precision={self.backward_precision!r}")


def _refresh_mirror_after_load(module, incompatible_keys):
    module.refresh_mirror()


def _state_dict_per_layer(module: DuelingBranchQNet, state_dict, prefix, local_metadata):
    flat = state_dict.pop(prefix + "flat_params")
    for name, view in module.layer_views(flat).items():
        state_dict[prefix + name] = view
    return state_dict


def _load_state_dict_per_layer(module: DuelingBranchQNet, state_dict, prefix, local_metadata, strict,
                               missing_keys, unexpected_keys, error_msgs):
    """Per-layer keys -> the flat buffer. Keys that are given are loaded (over a copy of the
    current parameters), the per-layer names that are not are reported missing (so
    ``strict=False`` loads a partial state dict, ``strict=True`` names what is missing)."""
    if prefix + "flat_params" in state_dict:
        return  # a flat state dict: the default loader
    flat = module.flat_params.detach().clone()
    views = module.layer_views(flat)
    for name, _, _ in module.layout.tensors:
        key = prefix + name
        if key not in state_dict:
            missing_keys.append(key)
            continue
        value = state_dict.pop(key)
        if not isinstance(value, torch.Tensor) or value.shape != views[name].shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {shape}, "
                              f"the shape in the current model is {tuple(views[name].shape)}.")
            continue
        views[name].copy_(value)
    state_dict[prefix + "flat_params"] = flat
