"""``FusedAdamBF16`` and ``ema_update_``: the optimizer step and the target-network update,
each one pass over memory that also writes the BF16 mirror the next forward reads."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from .ops import ema_update, fused_adam_bf16


def ema_update_(target, online, tau: float) -> None:
    """Polyak update of a target DuelingBranchQNet from an online one (flat buffers + mirror)."""
    if target.config != online.config:
        raise ValueError(f"ema_update_: target and online networks differ: {target.config} vs {online.config}")
    ema_update(target.flat_params.data, target.params_bf16, online.flat_params.data, tau)


class FusedAdamBF16(torch.optim.Optimizer):
    """Adam (AdamW with ``decoupled_weight_decay=True``) over flat F32 master parameters that
    writes each parameter's BF16 mirror in the same pass.

    Args:
        params: parameters or param groups (each parameter a contiguous F32 tensor).
        mirrors: one BF16 tensor per parameter (in order) to keep equal to
            ``param.to(torch.bfloat16)``; a parameter without one gets its own, in
            ``self.mirror(param)``. ``FusedAdamBF16.for_network(net)`` wires a
            DuelingBranchQNet's mirror and turns off its per-forward mirror refresh.
        max_grad_norm: clip to this global gradient norm (as ``clip_grad_norm_``), on the
            device. Needs all parameters in one tensor (DuelingBranchQNet has one).

    ``lr`` may be a float (copied to a device tensor at each ``step``) or a one-element F32
    tensor on the parameters' device (read on the device: change it with ``copy_`` between
    replays of a captured graph). After each step, ``self.grad_norm`` holds the gradient norm
    before clipping and ``self.found_inf`` 1.0 if it was not finite — then the step was
    skipped on the device (parameters, moments and step count unchanged). Reading them syncs;
    the step itself never does.
    """

    def __init__(self, params: Iterable, lr=1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 decoupled_weight_decay: bool = False, max_grad_norm: Optional[float] = None,
                 mirrors: Optional[Sequence[Tensor]] = None):
        if not (isinstance(lr, Tensor) or lr >= 0):
            raise ValueError(f"FusedAdamBF16: lr must be >= 0, got {lr}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, capturable=True)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        flat = [p for g in self.param_groups for p in g["params"]]
        if max_grad_norm is not None and len(flat) != 1:
            raise ValueError(f"FusedAdamBF16: max_grad_norm needs all parameters in one tensor, got {len(flat)}")
        if mirrors is not None and len(mirrors) != len(flat):
            raise ValueError(f"FusedAdamBF16: got {len(mirrors)} mirrors for {len(flat)} parameters")
        self._mirrors = {}
        for i, p in enumerate(flat):
            if p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError(f"FusedAdamBF16: parameter {i} must be a contiguous float32 tensor, "
                                 f"got {p.dtype} with strides {p.stride()}")
            mirror = mirrors[i] if mirrors is not None else None
            if mirror is None:
                mirror = p.detach().to(torch.bfloat16)
            elif mirror.dtype != torch.bfloat16 or mirror.shape != p.shape or mirror.device != p.device:
                raise ValueError(f"FusedAdamBF16: mirror {i} must be a bfloat16 tensor of shape {tuple(p.shape)} on "
                                 f"{p.device}, got {mirror.dtype} {tuple(mirror.shape)} on {mirror.device}")
            self._mirrors[p] = mirror
        device = flat[0].device
        self.grad_norm = torch.zeros(1, device=device)
        self.found_inf = torch.zeros(1, device=device)
        self._lr_tensors = {}

    @classmethod
    def for_network(cls, net, **kwargs) -> "FusedAdamBF16":
        """An optimizer over a DuelingBranchQNet that keeps ``net.params_bf16`` up to date."""
        net.sync_mirror = False
        net.refresh_mirror()
        return cls([net.flat_params], mirrors=[net.params_bf16], **kwargs)

    def mirror(self, param: Tensor) -> Tensor:
        return self._mirrors[param]

    def _lr_tensor(self, group, device) -> Tensor:
        lr = group["lr"]
        if isinstance(lr, Tensor):
            return lr
        key = id(group)
        if key not in self._lr_tensors:
            self._lr_tensors[key] = torch.empty(1, device=device)
        t = self._lr_tensors[key]
        t.fill_(float(lr))
        return t

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(1, dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                fused_adam_bf16(p.view(-1), p.grad.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                                self._mirrors[p].view(-1), state["step"].view(-1), self._lr_tensor(group, p.device),
                                beta1, beta2, group["eps"], group["weight_decay"], group["decoupled_weight_decay"],
                                self.max_grad_norm, self.grad_norm, self.found_inf)
        return loss
