"""``FusedAdamBF16`` and ``ema_update_``: the optimizer step and the target-network update,
each one pass over memory that also writes the BF16 mirror the next forward reads."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from .layout import check_betas, check_float
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
            ``param.to(torch.bfloat16)`` (on the CPU an F32 one, kept equal to the parameter:
            the unrounded reference path, ``DuelingBranchQNet(mirror_dtype=torch.float32)``);
            a parameter without one gets its own BF16 mirror, in
            ``self.mirror(param)``. ``FusedAdamBF16.for_network(net)`` wires a
            DuelingBranchQNet's mirror and turns off its per-forward mirror refresh.
        max_grad_norm: clip to this global gradient norm (as ``clip_grad_norm_`` over all the
            optimizer's parameters), on the device.

    ``lr`` may be a float (copied to a device tensor at each ``step``) or a one-element F32
    tensor on the parameters' device (read on the device: change it with ``copy_`` between
    replays of a captured graph). After each step, ``self.grad_norm`` holds the gradient norm
    before clipping and ``self.found_inf`` 1.0 if it was not finite — then the step was
    skipped on the device (parameters, moments and step count unchanged). Reading them syncs;
    the step itself never does.

    Over several parameters the norm, the clipping and the skip are global, as
    ``clip_grad_norm_`` + ``torch.optim.Adam``: one norm over every gradient (per-tensor norms
    combined on the device), every gradient scaled by the one clip coefficient (NaN when the
    norm is not finite, so every tensor's update skips), then one ``fused_adam_bf16`` pass per
    tensor on the scaled copy (one gradient-sized temporary per tensor). One tensor (as
    ``for_network``) runs the fused op alone: no temporary, no extra pass.
    """

    def __init__(self, params: Iterable, lr=1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 decoupled_weight_decay: bool = False, max_grad_norm: Optional[float] = None,
                 mirrors: Optional[Sequence[Tensor]] = None):
        if not (isinstance(lr, Tensor) or lr >= 0):
            raise ValueError(f"FusedAdamBF16: lr must be >= 0, got {lr}")
        n = "FusedAdamBF16"
        betas = check_betas(n, betas)
        eps = check_float(n, "eps", eps, low=0.0)
        weight_decay = check_float(n, "weight_decay", weight_decay, low=0.0)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, capturable=True)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"FusedAdamBF16: max_grad_norm must be None or > 0, got {max_grad_norm}")
        flat = [p for g in self.param_groups for p in g["params"]]
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
            elif (not (mirror.dtype == torch.bfloat16 or (mirror.dtype == torch.float32 and p.device.type == "cpu"))
                  or mirror.shape != p.shape or mirror.device != p.device):
                raise ValueError(f"FusedAdamBF16: mirror {i} must be a bfloat16 tensor (or float32 on the CPU) of shape "
                                 f"{tuple(p.shape)} on {p.device}, got {mirror.dtype} {tuple(mirror.shape)} on "
                                 f"{mirror.device}")
            self._mirrors[p] = mirror
        device = flat[0].device
        if any(p.device != device for p in flat):
            raise ValueError(f"FusedAdamBF16: all parameters must be on one device (one global gradient norm and "
                             f"skip decision), got {sorted({str(p.device) for p in flat})}")
        self.grad_norm = torch.zeros(1, device=device)
        self.found_inf = torch.zeros(1, device=device)
        # each tensor's own norm / flag of a step over several tensors (the global ones go above)
        self._scratch = (torch.zeros(1, device=device), torch.zeros(1, device=device))
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
        work = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not work:
            return loss
        if len(work) == 1:  # the op's own norm is the global one
            group, p = work[0]
            self._adam(group, p, p.grad, self.max_grad_norm, self.grad_norm, self.found_inf)
            return loss
        # Several tensors: one global norm, one clip coefficient, one skip decision, all on the
        # device (no sync; capturable). A non-finite norm makes the coefficient NaN: every
        # scaled gradient is then non-finite, and every tensor's update skips.
        grads = [p.grad for _, p in work]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).to(torch.float32))
        finite = torch.isfinite(norm)
        coef = torch.ones_like(norm)
        if self.max_grad_norm is not None:  # clip_grad_norm_'s coefficient
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        coef = torch.where(finite, coef, torch.full_like(coef, float("nan")))
        scaled = torch._foreach_mul(grads, coef)
        for (group, p), g in zip(work, scaled):
            self._adam(group, p, g, None, *self._scratch)
        self.grad_norm.copy_(norm.reshape(1))
        self.found_inf.copy_((~finite).to(self.found_inf.dtype).reshape(1))
        return loss

    def _adam(self, group, p, grad, max_grad_norm, grad_norm, found_inf):
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros(1, dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        fused_adam_bf16(p.view(-1), grad.reshape(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                        self._mirrors[p].view(-1), state["step"].view(-1), self._lr_tensor(group, p.device),
                        beta1, beta2, group["eps"], group["weight_decay"], group["decoupled_weight_decay"],
                        max_grad_norm, grad_norm, found_inf)
        # The op wrote p in place where autograd cannot see it: bump its version as a torch
        # in-place op would, so that a DuelingBranchQNet whose mirror this optimizer does not
        # write (no for_network) refreshes it at its next forward, and autograd still refuses a
        # backward through a forward taken before this step.
        torch.autograd.graph.increment_version(p)
