"""The dense layer kernel's switch: which layers the CUDA ops compute with dqn_ops's own BF16
tensor-core GEMM (``csrc/cuda/dense_layer.h``) with the work after the GEMM in its epilogue, and
which with cuBLAS GEMMs and a pass after them. Three uses: a dense hidden layer (a trunk layer,
the heads' merged first layer, IQN's phi: the F32 bias, ReLU and the rounding to BF16); the
output layer (every head of one network, or of both in the trainer's step, in one launch); and
in the backward a layer's input gradient (the ReLU mask of the layer before and the gradient's
BF16 copy). Both ways compute the same formula; the F32 sums' order, so at times a last bit,
differs.

Modes: ``"auto"`` (the default: where the kernel was measured faster, ``bench/NOTES.md``: hidden
layers of at least 128 outputs; the output layer and the input gradients at small batches),
``"on"`` (everywhere it can run: K a multiple of 8, N even, 16-byte aligned operands, an sm_80
or newer GPU) and ``"off"``. The environment variable
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
