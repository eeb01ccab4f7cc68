"""``DuelingBranchQNet``: the network as an ``nn.Module`` over one flat parameter buffer."""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch
from torch import Tensor, nn

from . import ops
from .layout import DQNConfig, ParamLayout


class DuelingBranchQNet(nn.Module):
    """Dueling, branching, distributional Q-network whose forward and backward run through
    ``dqn_ops.bf16_dueling_forward`` / ``dqn_ops.mixed_backward``.

    Storage: one flat F32 parameter (``flat_params``, the only registered Parameter, so any
    ``torch.optim`` optimizer and ``.to()`` work on it as on any module) and its BF16 mirror
    (``params_bf16``, a buffer the GEMMs read). The per-layer tensors are views of the flat
    buffer (``layer_views()``), and the state dict holds them under the names of a plain
    ``nn.Linear`` network (``s1.weight``, ``v2.bias``, ``a1.0.weight`` ...), so state dicts
    load both ways.

    ``forward(states)`` returns the dueling-aggregated logits ``[B, sum(branches), atoms]``;
    ``split_branches`` cuts them per branch. ``forward_full`` also returns the raw head logits
    and the saved activations.

    The mirror is refreshed from ``flat_params`` at every ``forward`` while ``sync_mirror`` is
    True (one cast over the buffer; correct under any optimizer). A caller that keeps it in
    sync itself (``dqn_ops.FusedAdamBF16`` writes it in the Adam pass) sets it False.

    The mirror is BF16 beside F32 parameters. On the CPU, ``net.double()`` gives the float64
    reference path: the mirror becomes float64 too and nothing is rounded; ``net.float()``
    brings back the BF16 mirror.
    """

    def __init__(self, config: Optional[DQNConfig] = None, *, backward_precision: str = "tf32",
                 device=None, dtype=torch.float32, generator: Optional[torch.Generator] = None):
        super().__init__()
        self.config = config if config is not None else DQNConfig()
        self.layout = ParamLayout(self.config)
        self._layout_ints = self.layout.encode()
        if backward_precision not in ops.BACKWARD_PRECISIONS:
            raise ValueError(f"DuelingBranchQNet: backward_precision must be one of {ops.BACKWARD_PRECISIONS}, "
                             f"got {backward_precision!r}")
        self.backward_precision = backward_precision
        self.sync_mirror = True
        self.flat_params = nn.Parameter(torch.zeros(self.layout.numel, device=device, dtype=dtype))
        self.register_buffer("params_bf16", torch.zeros(self.layout.numel, device=device, dtype=torch.bfloat16),
                             persistent=False)
        self.reset_parameters(generator)
        self._register_state_dict_hook(_state_dict_per_layer)
        self._register_load_state_dict_pre_hook(_load_state_dict_per_layer, with_module=True)
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.refresh_mirror())

    # -- parameters ---------------------------------------------------------------------
    def layer_views(self, source: Optional[Tensor] = None) -> Dict[str, Tensor]:
        """Per-layer views of ``source`` (default ``flat_params``), keyed like nn.Linear's."""
        flat = self.flat_params if source is None else source
        return {name: flat[off:off + _numel(shape)].view(shape) for name, shape, off in self.layout.tensors}

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
        self.params_bf16.copy_(self.flat_params)

    def weight_matrices(self) -> Dict[str, Tensor]:
        """The weight matrices (10 for the reference config) as views of ``flat_params``."""
        return {n: v for n, v in self.layer_views().items() if n.endswith(".weight")}

    def _apply(self, fn, recurse=True):
        # .to()/.double()/.float() convert every floating tensor alike; the mirror instead
        # follows its rule: BF16 beside F32 params, params' own dtype otherwise (the exact
        # CPU reference path), and is rewritten from the converted params.
        super()._apply(fn, recurse)
        mirror_dtype = torch.bfloat16 if self.flat_params.dtype == torch.float32 else self.flat_params.dtype
        if self.params_bf16.dtype != mirror_dtype or self.params_bf16.device != self.flat_params.device:
            self.params_bf16 = torch.empty_like(self.flat_params, dtype=mirror_dtype)
        self.refresh_mirror()
        return self

    # -- forward ------------------------------------------------------------------------
    def forward_full(self, states: Tensor) -> ops.ForwardOutput:
        if self.sync_mirror:
            self.params_bf16.copy_(self.flat_params.detach())
        return ops.bf16_dueling_forward(states, self.flat_params, self.params_bf16, self._layout_ints,
                                        self.backward_precision)

    def forward(self, states: Tensor) -> Tensor:
        return self.forward_full(states).q_logits

    def split_branches(self, q_logits: Tensor):
        """[B, sum n_d, NA] -> a tuple of [B, n_d, NA], one per branch (views)."""
        return torch.split(q_logits, list(self.config.branches), dim=1)

    def extra_repr(self) -> str:
        c = self.config
        return (f"state_dim={c.state_dim}, trunk_hidden={c.trunk_hidden}, value_hidden={c.value_hidden}, "
                f"adv_hidden={c.adv_hidden}, atoms={c.atoms}, branches={c.branches}, "
                f"parameters={c.num_parameters}, backward_precision={self.backward_precision!r}")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _state_dict_per_layer(module: DuelingBranchQNet, state_dict, prefix, local_metadata):
    flat = state_dict.pop(prefix + "flat_params")
    for name, view in module.layer_views(flat).items():
        state_dict[prefix + name] = view
    return state_dict


def _load_state_dict_per_layer(module: DuelingBranchQNet, state_dict, prefix, local_metadata, strict,
                               missing_keys, unexpected_keys, error_msgs):
    names = [prefix + n for n, _, _ in module.layout.tensors]
    if prefix + "flat_params" in state_dict or not all(n in state_dict for n in names):
        return  # a flat state dict, or keys missing: the default loader reports what is wrong
    flat = torch.zeros_like(module.flat_params)
    views = module.layer_views(flat)
    for name, _, _ in module.layout.tensors:
        value = state_dict.pop(prefix + name)
        if value.shape != views[name].shape:
            error_msgs.append(f"size mismatch for {prefix + name}: copying a param with shape {tuple(value.shape)}, "
                              f"the shape in the current model is {tuple(views[name].shape)}.")
            continue
        views[name].copy_(value)
    state_dict[prefix + "flat_params"] = flat
