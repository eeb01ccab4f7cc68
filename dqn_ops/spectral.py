"""Spectral norm of every weight matrix of a network in one kernel launch.

``SpectralNorm(net, sigma_max=1.0)`` builds the descriptor list of the network's weight
matrices once (offset, rows, cols in the flat parameter buffer) and owns each matrix's
persistent power-iteration vectors u and v; calling it runs ``batched_spectral_norm``: power
iteration on all matrices, sigma estimates into ``self.sigma`` (a device tensor, read without a
sync only when you ask), and W <- W * min(1, sigma_max / sigma) in place, BF16 mirror included.

``spectral_norm_(net, ...)`` is the one-line form: it keeps a ``SpectralNorm`` on the network
(created on first use) and calls it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .ops import batched_spectral_norm


class SpectralNorm(nn.Module):
    """Spectral-norm clamp of a ``DuelingBranchQNet``'s weight matrices, in one launch.

    Args:
        net: the network (its ``flat_params`` and ``params_bf16`` are updated in place).
        sigma_max: the largest singular value a matrix may keep; a float for all, or one per
            matrix in the order of ``net.weight_matrices()``.
        n_power_iterations: power iterations per call.
        eps: floor of the norms when normalising u and v.
        generator: seeds the initial u and v (random unit vectors, as ``torch.nn.utils.spectral_norm``).

    Buffers: ``u`` and ``v`` (persistent, in the state dict: a checkpoint resumes the power
    iteration where it was) and ``sigma`` (the latest estimates, [num_matrices]). ``.to()``
    moves them; they must be on the network's device when called.
    """

    def __init__(self, net, sigma_max: Union[float, Sequence[float]] = 1.0, n_power_iterations: int = 1,
                 eps: float = 1e-12, generator: Optional[torch.Generator] = None):
        super().__init__()
        mats = net.layout.weight_matrices()
        self.names: List[str] = [name for name, _, _ in mats]
        # Each matrix as the kernels read it, [rows, row stride]: a weight whose stored width was
        # rounded up (DQNConfig.aligned) has zero columns past its own, which change neither sigma
        # nor u; v is zero there (the power iteration keeps it so).
        lds = [net.layout.row_strides[name] for name, _, _ in mats]
        self.matrices: List[int] = [x for (_, (rows, _), off), ld in zip(mats, lds) for x in (off, rows, ld)]
        self.configure(sigma_max, n_power_iterations, eps)
        self._net = [net]  # a plain reference: not a submodule, so not in this module's state dict
        device = net.flat_params.device
        u = torch.randn(sum(r for _, (r, _), _ in mats), generator=generator, dtype=torch.float32)
        v = torch.randn(sum(lds), generator=generator, dtype=torch.float32)
        start = 0
        for (_, (_, cols), _), ld in zip(mats, lds):
            v[start + cols:start + ld] = 0
            start += ld
        self.register_buffer("u", _normalize_segments(u, [r for _, (r, _), _ in mats]).to(device))
        self.register_buffer("v", _normalize_segments(v, lds).to(device))
        self.register_buffer("sigma", torch.zeros(len(mats), device=device), persistent=False)

    def configure(self, sigma_max: Union[float, Sequence[float]], n_power_iterations: int, eps: float):
        """Sets the clamp, the iteration count and eps (validated); u and v are kept."""
        m = len(self.names)
        if isinstance(sigma_max, (int, float)):
            sigma_max = [float(sigma_max)] * m
        if len(sigma_max) != m or any(not s > 0 for s in sigma_max):
            raise ValueError(f"SpectralNorm: sigma_max must be a positive float or {m} positive floats, got {sigma_max}")
        if int(n_power_iterations) < 1:
            raise ValueError(f"SpectralNorm: n_power_iterations must be >= 1, got {n_power_iterations}")
        self.sigma_max = [float(s) for s in sigma_max]
        self.n_power_iterations = int(n_power_iterations)
        self.eps = float(eps)

    @property
    def net(self):
        return self._net[0]

    @torch.no_grad()
    def forward(self, one_launch_per_matrix: bool = False) -> Tensor:
        """Runs the power iteration and the clamp; returns ``self.sigma`` (no host sync)."""
        net = self.net
        if net.flat_params.dtype != torch.float32 or net.params_bf16.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"SpectralNorm: the network must hold float32 parameters with a bfloat16 mirror (or a "
                            f"float32 one on the CPU), "
                            f"got {net.flat_params.dtype} / {net.params_bf16.dtype}")
        batched_spectral_norm(net.flat_params.data, net.params_bf16, self.u, self.v, self.sigma, self.matrices,
                              self.sigma_max, self.n_power_iterations, self.eps, one_launch_per_matrix)
        return self.sigma

    def sigmas(self) -> dict:
        """The latest sigma estimates by matrix name (reads back: syncs)."""
        return dict(zip(self.names, self.sigma.tolist()))

    def extra_repr(self) -> str:
        return (f"matrices={len(self.names)}, sigma_max={self.sigma_max if len(set(self.sigma_max)) > 1 else self.sigma_max[0]}, "
                f"n_power_iterations={self.n_power_iterations}")


def _normalize_segments(x: Tensor, lengths: Sequence[int]) -> Tensor:
    return torch.cat([torch.nn.functional.normalize(seg, dim=0) for seg in torch.split(x, list(lengths))])


def spectral_norm_(net, sigma_max: Union[float, Sequence[float]] = 1.0, n_power_iterations: int = 1,
                   eps: float = 1e-12) -> Tensor:
    """Clamps the spectral norm of every weight matrix of ``net`` to ``sigma_max``, in place.

    The power-iteration state lives on the network as a plain attribute (``net._spectral_norm``,
    a ``SpectralNorm`` created on the first call and reconfigured, vectors kept, when the
    arguments change; not part of the network's state dict). Returns the sigma estimates as a
    device tensor (no host sync). A trainer that checkpoints should own a ``SpectralNorm``.
    """
    sn = net.__dict__.get("_spectral_norm")
    if sn is None:
        sn = SpectralNorm(net, sigma_max, n_power_iterations, eps)
        object.__setattr__(net, "_spectral_norm", sn)  # bypasses nn.Module: no submodule, no state-dict keys
    else:
        sn.configure(sigma_max, n_power_iterations, eps)  # keeps the converged vectors
    if sn.u.device != net.flat_params.device:
        sn.to(net.flat_params.device)
    return sn()
