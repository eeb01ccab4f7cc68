"""The dense layer kernel's switch: which dense hidden layers (a trunk layer, the heads' merged
first layer, IQN's phi) the CUDA forward computes with dqn_ops's own BF16 tensor-core GEMM whose
epilogue adds the F32 bias, applies ReLU and rounds to BF16 (``csrc/cuda/dense_layer.h``), and
which as a cuBLAS GEMM with an F32 output and a bias + ReLU pass. Both compute the same formula;
the F32 sums' order, so at times the last bit of an activation, differs.

Modes: ``"auto"`` (the default: layers of at least 128 outputs, where the kernel was measured
faster, ``bench/NOTES.md``), ``"on"`` (every layer it can run: K a multiple of 8, N even, 16-byte
aligned operands, an sm_80 or newer GPU) and ``"off"``. The environment variable
``DQN_OPS_DENSE_KERNEL=auto|1|0`` sets the process's mode at its first use (a bad value raises
there); a CUDA graph keeps the kernels it was captured with. The CPU kernels ignore it.
"""
from . import _C

MODES = ("auto", "on", "off")


def mode() -> str:
    """The process-wide mode: ``"auto"``, ``"on"`` or ``"off"``."""
    return _C._dense_layer_mode()


def set_mode(new: str) -> str:
    """Sets the process-wide mode (``"auto"``, ``"on"`` or ``"off"``); returns the previous one."""
    if new not in MODES:
        raise ValueError(f"dense_kernel.set_mode: expected one of {MODES}, got {new!r}")
    return _C._set_dense_layer_mode(new)
