"""dqn_ops: the training step of a dueling, branching, distributional (C51) DQN on BF16
tensor cores, as PyTorch custom ops (``torch.ops.dqn_ops.*``) with thin Python wrappers.

``dqn_ops.ops`` holds every op's wrapper, fake kernel and autograd; the network, optimizer,
spectral norm and trainer build on it, and ``dqn_ops.step`` writes the training step's
forward -> loss -> backward once. The environment, replay buffer and plain-PyTorch baseline
live in ``dqn_ops.rl``, which this package does not import.
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers the ops with the dispatcher)
from . import ops, step
from .convert import from_torch, to_torch
from .layout import DQNConfig, HeadGroup, ParamLayout
from .network import DuelingBranchQNet
from .ops import (ActOutput, LossOutput, act, batched_spectral_norm, bf16_dueling_forward, bootstrap_masks, dqn_loss,
                  ema_update, epsilon_greedy, fused_adam_bf16, iqn_fractions, mixed_backward, record_step)
from .optim import FusedAdamBF16, ema_update_
from .spectral import SpectralNorm, spectral_norm_
from .trainer import NonFiniteError, Trainer, TrainerConfig, greedy_actions


def build_info() -> dict:
    """How this build was made: ``cuda`` (whether the loaded library has CUDA kernels),
    ``reason`` (the toolkit, or why CPU-only) and ``cuda_arch_list`` (the TORCH_CUDA_ARCH_LIST
    compiled for: the GPU architectures with machine code, "+PTX" where PTX was embedded too),
    as setup.py recorded them when it planned the build."""
    cuda = cuda_kernels_built()
    try:
        from ._build_info import BUILD_INFO
    except ImportError:  # built by other means than setup.py
        return dict(cuda=cuda, reason="unknown (no dqn_ops/_build_info.py)", cuda_arch_list=None)
    info = dict(BUILD_INFO)
    if info["cuda"] != cuda:  # setup.py ran again with other settings, or its build failed
        return dict(cuda=cuda, reason=f"unknown: setup.py's last plan ({info['reason']}) is not the library loaded",
                    cuda_arch_list=None)
    return info


def cuda_kernels_built() -> bool:
    """True when this build of the extension has its CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("dqn_ops::bf16_dueling_forward", "CUDA")


__all__ = ["DQNConfig", "HeadGroup", "ParamLayout", "DuelingBranchQNet", "bf16_dueling_forward", "mixed_backward",
           "ops", "step", "cuda_kernels_built", "build_info",
           "FusedAdamBF16", "fused_adam_bf16", "ema_update", "ema_update_",
           "SpectralNorm", "batched_spectral_norm", "spectral_norm_", "dqn_loss", "LossOutput", "bootstrap_masks",
           "iqn_fractions", "act", "ActOutput", "epsilon_greedy", "from_torch", "to_torch", "Trainer", "TrainerConfig",
           "NonFiniteError", "greedy_actions", "record_step"]
__version__ = "0.1.0"
