"""Every ``torch.ops.dqn_ops`` op, in the order of its schema in csrc/dqn_ops.cpp: the typed
Python wrapper, the fake kernel (shapes and dtypes, for torch.compile and FakeTensor tracing)
and, where the op is differentiable, its autograd formula. The twin of the schema file: an op
is added in both (the checklist is at the top of csrc/dqn_ops.cpp). Modules, trainer, tests and
benchmarks call the ops through these wrappers.

Each wrapper calls ``torch.ops.dqn_ops.<op>.default`` through ``_call`` (which turns the
dispatcher's error for a device without a kernel into ``MissingKernelError``); the CPU kernels
are in csrc/, the CUDA kernels in csrc/cuda/. The ops whose names start with ``_`` are internal (the trainer's): their
schemas may change; the public ops are the API. Fake kernels check what the shapes depend on
and say, prefixed with the op's name, what was expected and what came; the kernels' own checks
(csrc/*_args.h) cover the rest.
"""
from __future__ import annotations

import math
import re
from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from . import _C
from .layout import decode_config

BACKWARD_PRECISIONS = ("tf32", "bf16", "fp32")
# 'iqn' (implicit quantile networks, docs/iqn-design.md) is dqn_loss's: the other ops that take a
# loss type refuse it as a name they do not know (csrc/loss_args.h parse_loss_type, _check_loss_type).
LOSS_TYPES = ("c51", "qr", "mse", "huber", "iqn")
# The configurations _dqn_loss_on_logits runs as one fused kernel on CUDA (the dueling
# aggregation inside the C51 or QR loss: C51 up to FUSED_LOSS_MAX_ATOMS atoms, QR with any
# quantile count the CUDA loss takes, either with at most FUSED_LOSS_MAX_BRANCHES branches over
# an ensemble's members, bootstrap masks or not);
# it composes the public kernels' arithmetic otherwise.
# Read from the extension, which sizes the kernel by them.
FUSED_LOSS_MAX_ATOMS: int = _C.FUSED_LOSS_MAX_ATOMS
LOSS_CUDA_MAX_ATOMS: int = _C.LOSS_CUDA_MAX_ATOMS  # atoms (C51) or quantiles (QR; IQN's N and N') the CUDA loss takes
FUSED_LOSS_MAX_BRANCHES: int = _C.FUSED_LOSS_MAX_BRANCHES
IQN_MAX_FRACTIONS: int = _C.IQN_MAX_FRACTIONS  # iqn_fractions' n and n_target: each set's slots lie below 2^17
EPSILON_GREEDY_MAX_BRANCHES: int = _C.EPSILON_GREEDY_MAX_BRANCHES  # the CUDA kernels' branch table
EPSILON_GREEDY_MAX_ACTIONS: int = _C.EPSILON_GREEDY_MAX_ACTIONS  # a branch's size: a 24-bit uniform's reach


def philox_seed(seed: int) -> int:
    """A seed as the int64 that holds its low 64 bits: how an rng tensor (int64 [2] = seed,
    call) carries csrc/philox.h's 64-bit key (act, the replay's sampling)."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def philox_rng(seed: int, device) -> Tensor:
    """A fresh rng tensor for the ops that draw from one (act, epsilon_greedy, iqn_fractions, the
    replay's sampling): int64 [2] = (philox_seed(seed), call 0) on ``device``. Two rngs made from
    one seed draw the same numbers call for call (how ``TorchTrainer`` explores as ``Trainer``)."""
    return torch.tensor([philox_seed(seed), 0], dtype=torch.long, device=device)


def _check(cond, msg: str):
    torch._check(cond, lambda: msg)


class MissingKernelError(NotImplementedError):
    """An op called on tensors of a device (dispatch key) this build of dqn_ops has no kernel
    for. The dispatcher's own error (its list of every registered backend) is ``__cause__``."""


_BACKEND = re.compile(r"Could not run 'dqn_ops::(\w+)' with arguments from the '(\w+)' backend")


def _raise_missing_kernel(op: str, err: NotImplementedError) -> None:
    """Raises the dqn_ops error (``from`` it) for the dispatcher's "Could not run
    'dqn_ops::<op>' with arguments from the '<X>' backend"; returns on any other
    NotImplementedError (the wrapper then re-raises that one). Only runs when a call failed:
    the fast path pays for a try block, nothing else."""
    m = _BACKEND.search(str(err))
    if m is None:
        return
    op, backend = m.group(1), m.group(2)  # the op that failed (a wrapper's op, or one it ran)
    if backend == "CUDA":
        what = ("has no CUDA kernel: this build of dqn_ops has no CUDA kernels (built without a CUDA "
                "toolkit, or with DQN_OPS_CPU_ONLY=1; dqn_ops.cuda_kernels_built() is False). Rebuild with a "
                "CUDA toolkit whose nvcc matches torch's CUDA version (see the README, 'Install'), or pass "
                "CPU tensors")
    elif backend.startswith("Sparse") or backend.startswith("Mkldnn") or backend.startswith("Quantized"):
        what = (f"has no kernel for {backend} tensors: its ops take dense (strided) tensors on the CPU or a "
                "CUDA device; convert them first (e.g. .to_dense())")
    else:
        what = (f"has no kernel for the {backend!r} backend (device {backend.lower()!r}): dqn_ops has CPU and "
                "CUDA kernels only; move the tensors to the CPU or a CUDA device")
    raise MissingKernelError(f"dqn_ops.{op} {what}.") from err


def _call(op: str, *args):
    """``torch.ops.dqn_ops.<op>.default(*args)``, its result returned; a call on tensors of a
    device this build has no kernel for raises ``MissingKernelError`` (``_raise_missing_kernel``)."""
    try:
        return getattr(torch.ops.dqn_ops, op).default(*args)
    except NotImplementedError as e:
        _raise_missing_kernel(op, e)
        raise


def _check_loss_type(op: str, loss_type: str, takes_iqn: bool = False) -> None:
    """loss_type one of LOSS_TYPES ('iqn' only where the op takes it), as the kernels' parse_loss_type."""
    names = LOSS_TYPES if takes_iqn else tuple(t for t in LOSS_TYPES if t != "iqn")
    _check(loss_type in names, f"{op}: loss_type: expected one of {names}, got {loss_type!r}")


def _check_masks(op: str, masks: Optional[Tensor], B: int, E: int) -> None:
    """Bootstrap masks [B, E] F32, or None (the loss fakes; the kernels: csrc/loss_args.h)."""
    if masks is None:
        return
    _check(masks.shape == (B, E) and masks.dtype == torch.float32,
           f"{op}: masks: expected float32 [{B}, {E}], got {masks.dtype} {list(masks.shape)}")


def _check_network_inputs(op: str, c, states: Tensor, params: Tensor, params_bf16: Tensor, layout) -> None:
    """What the shapes of a forward pass depend on (the fakes of bf16_dueling_forward and act)."""
    _check(states.dim() == 2 and states.shape[1] == c.state_dim,
           f"{op}: states: expected shape [*, {c.state_dim}], got {list(states.shape)}")
    _check(params.dim() == 1 and params.shape[0] == layout[-1],
           f"{op}: params: expected shape [{layout[-1]}], got {list(params.shape)}")
    _check(params_bf16.shape == params.shape,
           f"{op}: params_bf16: expected shape {list(params.shape)}, got {list(params_bf16.shape)}")


def _check_activation_count(op: str, c, activations) -> None:
    """The saved activations must be the forward's list: the states and each hidden layer."""
    n = 1 + len(c.hidden_widths) + (3 if c.iqn else 0)
    what = "hidden layer, with the IQN cosines, phi and z" if c.iqn else "hidden layer"
    _check(len(activations) == n, f"{op}: activations: expected {n} tensors (the states and each {what}, as "
                                  f"the forward returned them), got {len(activations)}")


# ---------------------------------------------------------------------------------------
# bf16_dueling_forward

class ForwardOutput(NamedTuple):
    # [B, E * sum n_d, NA]  dueling-aggregated (without dueling: the branch logits); member e's
    # rows after member e-1's (E = 1 but for an ensemble). IQN: [B, E * sum n_d, N], slot i the
    # value at fraction i.
    q_logits: Tensor
    # [B, NA * E * (dueling + sum n_d)]  raw logits in head order: the value heads (dueling),
    # then member 0's branches, member 1's, ... IQN: [B * N, ...], row b * N + i.
    head_logits: Tensor
    # Saved for the backward, at the mirror's precision: the states [B, SD], then every hidden
    # layer [B, w] for w in config.hidden_widths of the layout's network, the stored one
    # (DQNConfig.aligned: the widths rounded up to multiples of 8; the trunk's, then the heads' side by side);
    # IQN: after the trunk the cosines [B * N, n], phi and z [B * N, T_L], and the head layers on
    # B * N rows.
    activations: List[Tensor]


def bf16_dueling_forward(states: Tensor, params: Tensor, params_bf16: Tensor, layout: Sequence[int],
                         backward_precision: str = "tf32", fractions: Optional[Tensor] = None) -> ForwardOutput:
    """Forward pass of the branching network (dueling or not, any shape: dqn_ops.DQNConfig) on BF16
    tensor cores.

    Args:
        states: [B, SD] float32 (float64 allowed on the CPU reference path).
        params: the flat F32 master parameters (biases are read from here).
        params_bf16: the flat BF16 mirror of ``params`` (the GEMMs read the weights from here).
            On the CPU it may also have ``params``' dtype: then nothing is rounded.
        layout: ``ParamLayout(config).encode()``.
        backward_precision: the precision autograd's backward will use ('tf32', 'bf16', 'fp32').
        fractions: an IQN network's quantile fractions [B, N] in params' dtype (required iff the
            config has ``iqn_embedding`` > 0; docs/iqn-design.md); not differentiated.
    """
    args = (states, params, params_bf16, list(layout), backward_precision)
    return ForwardOutput(*_call("bf16_dueling_forward", *args, *(() if fractions is None else (fractions,))))


@torch.library.register_fake("dqn_ops::bf16_dueling_forward")
def _(states, params, params_bf16, layout, backward_precision="tf32", fractions=None):
    op = "dqn_ops.bf16_dueling_forward"
    c = decode_config(layout)
    _check(backward_precision in BACKWARD_PRECISIONS,
           f"{op}: backward_precision: expected one of {BACKWARD_PRECISIONS}, got {backward_precision!r}")
    _check_network_inputs(op, c, states, params, params_bf16, layout)
    B = states.shape[0]
    N = _check_fractions(op, c, fractions, params, (B, None))
    return (params.new_empty(B, c.q_rows, N if c.iqn else c.atoms), params.new_empty(B * N, c.head_out),
            _fake_activations(c, states, B, params_bf16.dtype, N))


def _check_fractions(op: str, c, fractions: Optional[Tensor], params: Tensor, shape) -> int:
    """csrc/network_args.h check_fractions: given iff the config is IQN's, in params' dtype,
    `shape` (None: any size). Returns N, the fractions per row (1 without IQN)."""
    if not c.iqn:
        _check(fractions is None, f"{op}: fractions: only an IQN network (iqn_embedding > 0) takes them; this "
                                  f"layout has none")
        return 1
    _check(fractions is not None, f"{op}: fractions: an IQN network (iqn_embedding {c.iqn_embedding}) needs the "
                                  f"quantile fractions tau, got None")
    ok = fractions.dim() == len(shape) and all(e is None or e == n for e, n in zip(shape, fractions.shape))
    _check(ok and fractions.dtype == params.dtype, f"{op}: fractions: expected {params.dtype} "
           f"[{', '.join('*' if e is None else str(e) for e in shape)}], got {fractions.dtype} {list(fractions.shape)}")
    _check(fractions.shape[-1] >= 1, f"{op}: fractions: expected at least 1 fraction per row, got 0")
    return fractions.shape[-1]


def _fake_activations(c, like: Tensor, rows: int, dtype, fractions: int = 1) -> List[Tensor]:
    """The activation list of `rows` rows: the states and every hidden layer, in `dtype`; an IQN
    network's cosines, phi and z after the trunk, and the head layers, on rows * fractions rows."""
    L = len(c.trunk_hidden)
    widths = [c.state_dim, *c.hidden_widths]
    if c.iqn:
        widths[L + 1:L + 1] = [c.iqn_embedding, c.trunk_hidden[-1], c.trunk_hidden[-1]]
    return [like.new_empty(rows * (fractions if c.iqn and k > L else 1), w, dtype=dtype) for k, w in enumerate(widths)]


# Its backward is mixed_backward; the saved activations it returns are non-differentiable.
def _forward_setup_context(ctx, inputs, output):
    states, params, params_bf16, layout = inputs[:4]
    backward_precision = inputs[4] if len(inputs) > 4 else "tf32"
    activations = output[2]
    ctx.save_for_backward(*activations, params, params_bf16)
    ctx.mark_non_differentiable(*activations)
    ctx.layout = list(layout)
    ctx.precision = backward_precision


def _forward_backward(ctx, grad_q, grad_head, _grad_activations):
    *activations, params, params_bf16 = ctx.saved_tensors
    need_states = ctx.needs_input_grad[0]
    # One gradient per input the call passed: the dispatcher drops a trailing argument equal to
    # its default (backward_precision), and some torch versions' autograd wrapper for an op with
    # a Tensor[] output takes exactly that many back (others also take one per schema argument).
    passed = len(ctx.needs_input_grad)
    if grad_q is None and grad_head is None:
        return (None,) * passed
    grad_params, grad_states = _call("mixed_backward", grad_q.contiguous() if grad_q is not None else None,
                                     grad_head.contiguous() if grad_head is not None else None, activations, params,
                                     params_bf16, ctx.layout, ctx.precision, need_states)
    grads = (grad_states if need_states else None), (grad_params if ctx.needs_input_grad[1] else None)
    return grads + (None,) * (passed - 2)


torch.library.register_autograd("dqn_ops::bf16_dueling_forward", _forward_backward,
                                setup_context=_forward_setup_context)


# ---------------------------------------------------------------------------------------
# mixed_backward

def mixed_backward(grad_q: Optional[Tensor], grad_head: Optional[Tensor], saved: ForwardOutput | Sequence[Tensor],
                   params: Tensor, params_bf16: Tensor, layout: Sequence[int], precision: str = "tf32",
                   need_grad_states: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Backward pass: the flat gradient (every dW and db) and, if asked, d(states).

    Args:
        grad_q: d(loss)/d(q_logits) [B, E * sum n_d, NA], or None.
        grad_head: d(loss)/d(head_logits) [B, head_out], or None (not both None).
        saved: the forward's output, or its activation list (the states at the mirror's
            precision, then every hidden layer, as the forward returned them).
        precision: 'tf32' (F32 operands on TF32 tensor cores), 'bf16' (BF16 operands),
            'fp32' (full-precision F32). cuBLAS multiplies no F32 operand by a BF16 one
            (docs/design.md), hence the choice.
    Returns:
        (grad_params in params' layout, grad_states [B, SD] or None)
    """
    grad_params, grad_states = _call("mixed_backward", grad_q, grad_head, _activations_of(saved), params, params_bf16,
                                     list(layout), precision, need_grad_states)
    return grad_params, (grad_states if need_grad_states else None)


def _activations_of(saved) -> List[Tensor]:
    """The activation list of a forward's output (ForwardOutput, Logits, or the raw op's tuple,
    whose last entry is the list), or the list itself."""
    if hasattr(saved, "activations"):
        return list(saved.activations)
    saved = list(saved)
    return list(saved[-1]) if saved and isinstance(saved[-1], (list, tuple)) else saved


@torch.library.register_fake("dqn_ops::mixed_backward")
def _(grad_q, grad_head, activations, params, params_bf16, layout, precision="tf32", need_grad_states=False):
    op = "dqn_ops.mixed_backward"
    c = decode_config(layout)
    _check(precision in BACKWARD_PRECISIONS,
           f"{op}: precision: expected one of {BACKWARD_PRECISIONS}, got {precision!r}")
    _check(grad_q is not None or grad_head is not None, f"{op}: grad_q and grad_head are both None; give at least one")
    _check_activation_count(op, c, activations)
    B = activations[0].shape[0]
    grad_states = params.new_empty(B, c.state_dim) if need_grad_states else params.new_empty(0)
    return params.new_empty(params.shape), grad_states


# ---------------------------------------------------------------------------------------
# fused_adam_bf16

def fused_adam_bf16(params: Tensor, grads: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, params_bf16: Tensor,
                    step: Tensor, lr: Tensor, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                    weight_decay: float = 0.0, decoupled_weight_decay: bool = False,
                    max_grad_norm: Optional[float] = None, grad_norm: Optional[Tensor] = None,
                    found_inf: Optional[Tensor] = None) -> None:
    """One Adam/AdamW step in place over flat F32 buffers, writing ``params_bf16`` too (BF16, or on
    the CPU F32: the unrounded path).

    ``step`` and ``lr`` are one-element F32 tensors on the params' device (a captured graph
    replays with their current values). ``grad_norm`` and ``found_inf`` (one-element F32,
    allocated when None) receive the global gradient norm before clipping and 1.0 when it was
    not finite, in which case nothing else is written (the step is skipped on the device).
    """
    grad_norm = params.new_empty(1) if grad_norm is None else grad_norm
    found_inf = params.new_empty(1) if found_inf is None else found_inf
    _call("fused_adam_bf16", params, grads, exp_avg, exp_avg_sq, params_bf16, step, lr, beta1, beta2, eps, weight_decay,
          decoupled_weight_decay, max_grad_norm, grad_norm, found_inf)


@torch.library.register_fake("dqn_ops::fused_adam_bf16")
def _(params, grads, exp_avg, exp_avg_sq, params_bf16, step, lr, beta1, beta2, eps, weight_decay,
      decoupled_weight_decay, max_grad_norm, grad_norm, found_inf):
    for name, t in (("grads", grads), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("params_bf16", params_bf16)):
        _check(t.shape == params.shape,
               f"dqn_ops.fused_adam_bf16: {name}: expected shape {list(params.shape)}, got {list(t.shape)}")
    return None


# ---------------------------------------------------------------------------------------
# ema_update

def ema_update(target: Tensor, target_bf16: Tensor, online: Tensor, tau: float) -> None:
    """target = lerp(target, online, tau) in place, writing target_bf16 (BF16, or F32 on the CPU) in
    the same pass."""
    _call("ema_update", target, target_bf16, online, tau)


@torch.library.register_fake("dqn_ops::ema_update")
def _(target, target_bf16, online, tau):
    _check(online.shape == target.shape,
           f"dqn_ops.ema_update: online: expected shape {list(target.shape)}, got {list(online.shape)}")
    return None


# ---------------------------------------------------------------------------------------
# record_step

def record_step(ring: Tensor, slot: Tensor, flag: Tensor, values: Sequence[Tensor], non_finite: Tensor,
                host_flag: Optional[Tensor] = None) -> None:
    """ring[slot] = values (one-element F32 tensors, one per ring column), slot = (slot + 1) %
    rows, flag = max(flag, non_finite); all on the device (dqn_ops/readback.py). ``host_flag``
    (one F32 element on the CPU, pinned when the others are on CUDA) receives the new flag too,
    stored by the kernel itself: the host reads it without a copy. Keep it alive until the
    kernel has run, and while a CUDA graph that captured the call is replayed (the pinned-memory
    cache would hand a freed block to the next pinned tensor while the kernel still writes it)."""
    _call("record_step", ring, slot, flag, list(values), non_finite, host_flag)


@torch.library.register_fake("dqn_ops::record_step")
def _(ring, slot, flag, values, non_finite, host_flag=None):
    _check(len(values) == ring.shape[1],
           f"dqn_ops.record_step: values: expected {ring.shape[1]} tensors, got {len(values)}")
    return None


# ---------------------------------------------------------------------------------------
# _load_batch (internal: the trainer's load_batch)

def _load_batch(dst: Sequence[Tensor], src: Sequence[Tensor]) -> None:
    """dst[i] <- src[i] for up to 8 pairs of one dtype and size each, in one launch on CUDA."""
    _call("_load_batch", list(dst), list(src))


@torch.library.register_fake("dqn_ops::_load_batch")
def _(dst, src):
    _check(len(dst) == len(src),
           f"dqn_ops._load_batch: expected as many sources as destinations, got {len(src)} and {len(dst)}")
    return None


# ---------------------------------------------------------------------------------------
# batched_spectral_norm

def batched_spectral_norm(params: Tensor, params_bf16: Tensor, u: Tensor, v: Tensor, sigma: Tensor,
                          matrices: Sequence[int], sigma_max: Sequence[float], n_power_iterations: int = 1,
                          eps: float = 1e-12, one_launch_per_matrix: bool = False) -> None:
    """Power iteration and sigma clamp on several matrices of a flat F32 buffer, in place.

    Args:
        params: flat F32 buffer holding the matrices (rescaled in place).
        params_bf16: its BF16 mirror (or F32 on the CPU); the rescaled matrices' elements are rewritten.
        u, v: flat F32 buffers of every matrix's left (rows) and right (cols) vector, one
            matrix after the other in the order of ``matrices``; updated in place.
        sigma: F32 [num_matrices], receives each matrix's sigma estimate (before the clamp).
        matrices: (offset, rows, cols) of each row-major matrix in ``params``, flattened.
        sigma_max: the clamp of each matrix.
        n_power_iterations: power iterations per call (>= 1).
        eps: floor of the norms when normalising u and v (as ``F.normalize``).
        one_launch_per_matrix: run the same kernel once per matrix (for comparisons).
    """
    _call("batched_spectral_norm", params, params_bf16, u, v, sigma, list(matrices), [float(s) for s in sigma_max],
          n_power_iterations, eps, one_launch_per_matrix)


@torch.library.register_fake("dqn_ops::batched_spectral_norm")
def _(params, params_bf16, u, v, sigma, matrices, sigma_max, n_power_iterations=1, eps=1e-12,
      one_launch_per_matrix=False):
    op = "dqn_ops.batched_spectral_norm"
    _check(len(matrices) % 3 == 0 and len(matrices) > 0,
           f"{op}: matrices: expected (offset, rows, cols) per matrix, got {len(matrices)} entries")
    m = len(matrices) // 3
    _check(len(sigma_max) == m, f"{op}: sigma_max: expected {m} values, got {len(sigma_max)}")
    rows = sum(matrices[1::3])
    cols = sum(matrices[2::3])
    _check(u.shape == (rows,), f"{op}: u: expected shape [{rows}], got {list(u.shape)}")
    _check(v.shape == (cols,), f"{op}: v: expected shape [{cols}], got {list(v.shape)}")
    _check(sigma.shape == (m,), f"{op}: sigma: expected shape [{m}], got {list(sigma.shape)}")
    _check(params_bf16.shape == params.shape,
           f"{op}: params_bf16: expected shape {list(params.shape)}, got {list(params_bf16.shape)}")
    return None


# ---------------------------------------------------------------------------------------
# dqn_loss

class LossOutput(NamedTuple):
    loss: Tensor      # []  mean over samples of the (importance-weighted, masked) per-sample loss
    grad_q: Tensor    # [B, E * sum n_d, atoms]  d(loss)/d(q)
    td_error: Tensor  # [B]  per-sample priority (unweighted, unmasked): C51 cross-entropy, QR / IQN quantile Huber
    #                        loss, or mean_d |y - Q_d|; the mean over members
    mean_q: Tensor    # []  mean expected Q of the taken actions (for logging)


def dqn_loss(q: Tensor, q_next_online: Tensor, q_next_target: Tensor, actions: Tensor, rewards: Tensor,
             dones: Tensor, branches: Sequence[int], *, v_min: float = -10.0, v_max: float = 10.0,
             gamma: float = 0.99, weights: Optional[Tensor] = None, loss_type: str = "c51",
             masks: Optional[Tensor] = None, fractions: Optional[Tensor] = None) -> LossOutput:
    """The double-DQN loss of a branching network, all on the device, no host sync.

    Args:
        q: the q logits of the online network on s (dueling-aggregated, or the branch heads'
            logits without dueling), [B, sum(branches), atoms] F32; for an ensemble of E
            members [B, E * sum(branches), atoms] (member e's rows from e * sum(branches)), E
            inferred from the width. Each member is its own double-DQN learner (its next action
            and target from its own rows); the loss averages over members and branches.
        q_next_online: the online network on s' (chooses the next action per branch).
        q_next_target: the target network on s' (evaluates it).
        actions: [B, num_branches] int64, the action taken in each branch.
        rewards, dones: [B] F32 (dones: 1.0 for a terminal transition).
        branches: the action count of each branch.
        v_min, v_max: the C51 support (atoms evenly spaced); 'qr' and 'iqn' do not use them.
        gamma: the discount of the stored return (gamma ** n for n-step returns).
        weights: [B] importance weights (prioritized replay), or None.
        loss_type: 'c51' (atoms > 1); 'qr' (QR-DQN: atoms = N quantiles at the fractions
            (2i + 1) / 2N, quantile Huber loss with kappa 1, the next action by the mean of the
            online quantiles); 'mse' or 'huber' (atoms == 1, BDQ's mean-over-branches target,
            per member); 'iqn' (implicit quantile networks, docs/iqn-design.md: QR's loss with
            each sample's own fractions, below).
        masks: [B, E] F32 bootstrap masks (member e learns from sample b with weight
            masks[b, e]: scales its loss and gradient, not td_error or mean_q), or None (all 1).
        fractions: 'iqn' only (required there, refused for the other types): [B, N] F32, q's
            fractions (slot i of sample b holds the values at tau = fractions[b, i], shared by
            the members), each in [0, 1]. With 'iqn' the three inputs have their own slot
            counts: q [B, E * A, N], q_next_online [B, E * A, K] (the next action by its mean
            over the K slots), q_next_target [B, E * A, N'] (the target quantiles); the loss
            per (sample, member, branch) is sum_i (1/N') sum_j |tau_i - 1{T_j < theta_i}|
            huber(T_j - theta_i). 'qr' is the case of the midpoints (2i + 1) / 2N with
            N = K = N'. The CUDA kernel takes N, N' <= LOSS_CUDA_MAX_ATOMS.

    ``loss`` is differentiable w.r.t. ``q`` (its backward is ``grad_q``, already computed), so
    ``loss.backward()`` works in an autograd graph as with any PyTorch loss.

    Non-finite data: a NaN/Inf reward or done (which clamping onto the support would otherwise
    hide; 'qr' / 'iqn': any non-finite target quantile) makes that sample's loss, td_error and gradient
    NaN (every member's, whatever the masks), so ``FusedAdamBF16`` skips the step and the trainer
    reports it. On CUDA an out-of-range action, or an IQN fraction outside [0, 1] (or NaN),
    cannot be reported without a host sync, so it is treated the same way; on the CPU it raises
    (naming the sample and the branch, or the slot).
    """
    return LossOutput(*_call("dqn_loss", q, q_next_online, q_next_target, actions, rewards, dones, weights,
                             list(branches), v_min, v_max, gamma, loss_type, masks, fractions))


@torch.library.register_fake("dqn_ops::dqn_loss")
def _(q, q_next_online, q_next_target, actions, rewards, dones, weights, branches, v_min, v_max, gamma,
      loss_type="c51", masks=None, fractions=None):
    op = "dqn_ops.dqn_loss"
    _check_loss_type(op, loss_type, takes_iqn=True)
    _check(len(branches) >= 1, f"{op}: branches: expected at least one branch, got none")
    for d, n in enumerate(branches):
        _check(n >= 1, f"{op}: branches: branch {d} must have >= 1 action, got {n}")
    A = sum(branches)
    _check(q.dim() == 3 and q.shape[1] >= A and q.shape[1] % A == 0,
           f"{op}: q: expected shape [B, {A}, atoms], got {list(q.shape)} (an ensemble of E members: "
           f"[B, E * {A}, atoms])")
    B, width, N = q.shape
    iqn = loss_type == "iqn"
    for name, t in (("q_next_online", q_next_online), ("q_next_target", q_next_target)):
        if iqn:  # values at other fractions: their own slot counts (K, N')
            _check(t.dim() == 3 and t.shape[:2] == q.shape[:2],
                   f"{op}: {name}: expected shape [{B}, {width}, *], got {list(t.shape)}")
        else:
            _check(t.shape == q.shape, f"{op}: {name}: expected shape {list(q.shape)}, got {list(t.shape)}")
    _check(actions.shape == (B, len(branches)),
           f"{op}: actions: expected shape [{B}, {len(branches)}], got {list(actions.shape)}")
    _check_masks(op, masks, B, width // A)
    if iqn:
        _check(fractions is not None, f"{op}: fractions: loss_type 'iqn' needs q's fractions [{B}, {N}], got None")
        _check(fractions.shape == (B, N) and fractions.dtype == torch.float32,
               f"{op}: fractions: expected float32 [{B}, {N}], got {fractions.dtype} {list(fractions.shape)}")
    else:
        _check(fractions is None,
               f"{op}: fractions: only loss_type 'iqn' takes fractions, got a tensor with loss_type '{loss_type}'")
    return q.new_empty(()), torch.empty_like(q), q.new_empty(q.shape[0]), q.new_empty(())


# d(loss)/d(q) is grad_q, computed in the forward pass.
def _loss_setup_context(ctx, inputs, output):
    loss, grad_q, td_error, mean_q = output
    ctx.save_for_backward(grad_q)
    ctx.mark_non_differentiable(grad_q, td_error, mean_q)


def _loss_backward(ctx, grad_loss, _grad_grad_q, _grad_td, _grad_mean_q):
    (grad_q,) = ctx.saved_tensors
    return grad_q * grad_loss, None, None, None, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("dqn_ops::dqn_loss", _loss_backward, setup_context=_loss_setup_context)


# ---------------------------------------------------------------------------------------
# The trainer's internal ops: bf16_dueling_forward -> dqn_loss -> mixed_backward with the
# dueling aggregation and its backward moved into the loss, so the logits make one trip
# through memory instead of three. Every result is the public ops' composition, bit for bit
# (tests/test_fused_step.py); dqn_ops/step.py runs them in sequence.

class Logits(NamedTuple):
    """The output layer's GEMM results (padded layout, no bias) of the online network on
    [s; s'] and of the target network on s', and the online network's activations on [s; s']
    that mixed_backward reads (as bf16_dueling_forward returns them)."""
    logits: Tensor              # [2B, head_ld] F32
    logits_next_target: Tensor  # [B, head_ld] F32
    activations: List[Tensor]   # [2B, state_dim], then [2B, w] per hidden layer; BF16


def _online_and_target_logits(state_pairs: Tensor, params: Tensor, params_bf16: Tensor, target_params: Tensor,
                              target_params_bf16: Tensor, layout: Sequence[int], batch_networks: bool) -> Logits:
    """bf16_dueling_forward stopped before the aggregation: the online network on
    ``state_pairs`` = [s; s'] and the target network on s'. ``batch_networks``: both networks'
    hidden layers as one batched GEMM each (fewer launches, the target also runs on s); the same
    results either way."""
    return Logits(*_call("_online_and_target_logits", state_pairs, params, params_bf16, target_params,
                         target_params_bf16, list(layout), batch_networks))


@torch.library.register_fake("dqn_ops::_online_and_target_logits")
def _(state_pairs, params, params_bf16, target_params, target_params_bf16, layout, batch_networks):
    c = decode_config(layout)
    op = "dqn_ops._online_and_target_logits"
    _check(state_pairs.dim() == 2 and state_pairs.shape[1] == c.state_dim,
           f"{op}: state_pairs: expected shape [*, {c.state_dim}], got {list(state_pairs.shape)}")
    rows = state_pairs.shape[0]
    _check(rows % 2 == 0, f"{op}: state_pairs: expected [s; s'], an even number of rows, got {rows}")
    return (params.new_empty(rows, c.head_ld), params.new_empty(rows // 2, c.head_ld),
            _fake_activations(c, state_pairs, rows, params_bf16.dtype))


class LossOnLogits(NamedTuple):
    loss: Tensor            # [] F32
    grad_head: Tensor       # [B, head_out] F32: d(loss)/d(head logits), compact
    grad_head_bf16: Tensor  # [B, head_ld] BF16: the same, padded layout, padding 0
    td_error: Tensor        # [B]
    mean_q: Tensor          # []


def _dqn_loss_on_logits(logits: Tensor, logits_next_online: Tensor, logits_next_target: Tensor, params: Tensor,
                        target_params: Tensor, actions: Tensor, rewards: Tensor, dones: Tensor,
                        weights: Optional[Tensor], layout: Sequence[int], v_min: float, v_max: float,
                        gamma: float, loss_type: str = "c51", masks: Optional[Tensor] = None,
                        counter: Optional[Tensor] = None) -> LossOnLogits:
    """dqn_loss on the output layer's logits (biases read from each network's params),
    returning d(loss)/d(head logits) as mixed_backward's dueling step would form it. One fused
    kernel on CUDA for C51 with at most FUSED_LOSS_MAX_ATOMS atoms or QR, with at most
    FUSED_LOSS_MAX_BRANCHES branches over an ensemble's members, masks or not; the public
    kernels' arithmetic otherwise. ``masks``:
    [B, E] bootstrap masks (E = the layout's ensemble members) or None, as for ``dqn_loss``.
    ``counter``: an int32 [1] tensor at 0 on the logits' device, the CUDA kernel's block counter,
    which the kernel leaves at 0 again: the launch then needs no memset of its own (one graph node
    fewer). Calls that can run at the same time must not share one (``new_loss_counter``)."""
    return LossOnLogits(*_call("_dqn_loss_on_logits", logits, logits_next_online, logits_next_target, params,
                               target_params, actions, rewards, dones, weights, list(layout), v_min, v_max, gamma,
                               loss_type, masks, counter))


def new_loss_counter(device) -> Tensor:
    """A zeroed block counter for ``_dqn_loss_on_logits`` on `device`."""
    return torch.zeros(1, dtype=torch.int32, device=device)


@torch.library.register_fake("dqn_ops::_dqn_loss_on_logits")
def _(logits, logits_next_online, logits_next_target, params, target_params, actions, rewards, dones, weights,
      layout, v_min, v_max, gamma, loss_type="c51", masks=None, counter=None):
    c = decode_config(layout)
    op = "dqn_ops._dqn_loss_on_logits"
    _check_loss_type(op, loss_type)
    _check(logits.dim() == 2 and logits.shape[1] == c.head_ld,
           f"{op}: logits: expected shape [*, {c.head_ld}], got {list(logits.shape)}")
    B = logits.shape[0]
    _check_masks(op, masks, B, c.members)
    if counter is not None:
        _check(counter.device == logits.device,
               f"{op}: counter: expected a tensor on {logits.device}, got one on {counter.device}")
        _check(counter.dtype == torch.int32, f"{op}: counter: expected dtype Int, got {counter.dtype}")
        _check(tuple(counter.shape) == (1,), f"{op}: counter: expected shape [1], got {list(counter.shape)}")
    return (logits.new_empty(()), logits.new_empty(B, c.head_out), logits.new_empty(B, c.head_ld, dtype=torch.bfloat16),
            logits.new_empty(B), logits.new_empty(()))


def _mixed_backward_from_head(grad_head: Tensor, grad_head_bf16: Tensor, saved: Sequence[Tensor], params: Tensor,
                              params_bf16: Tensor, layout: Sequence[int], precision: str = "bf16") -> Tensor:
    """mixed_backward from _dqn_loss_on_logits' head gradient; ``saved``: the activation list of s
    (the states at the mirror's precision, then every hidden layer). Returns the flat gradient."""
    return _call("_mixed_backward_from_head", grad_head, grad_head_bf16, _activations_of(saved), params, params_bf16,
                 list(layout), precision)


@torch.library.register_fake("dqn_ops::_mixed_backward_from_head")
def _(grad_head, grad_head_bf16, activations, params, params_bf16, layout, precision="bf16"):
    op = "dqn_ops._mixed_backward_from_head"
    _check(precision in BACKWARD_PRECISIONS,
           f"{op}: precision: expected one of {BACKWARD_PRECISIONS}, got {precision!r}")
    _check_activation_count(op, decode_config(layout), activations)
    return params.new_empty(params.shape)


# ---------------------------------------------------------------------------------------
# act

class ActOutput(NamedTuple):
    actions: Tensor   # [N, D] int64: epsilon-greedy actions
    greedy_q: Tensor  # [N, D] the greedy action's expected Q per branch (an ensemble's mean), before exploration


def act(states: Tensor, params: Tensor, params_bf16: Tensor, layout: Sequence[int], v_min: float, v_max: float,
        epsilon: Tensor, rng: Tensor, loss_type: str = "c51", ucb: float = 0.0,
        fractions: Optional[Tensor] = None) -> ActOutput:
    """Epsilon-greedy actions of the online network, on the device, without a host sync.

    The network runs as ``bf16_dueling_forward`` runs it (same arguments, same GEMMs: the
    same Q logits); per branch the greedy action maximises the expected Q (C51: sum_i
    softmax(q)_i z_i, z_i = v_min + i (v_max - v_min) / (atoms - 1); QR: the mean of the
    quantiles; one atom: q), the first of
    equal maxima (a NaN wins, as ``torch.argmax``). Row n explores iff
    ``uniform(draw(seed, call, n, 0)) < epsilon`` (epsilon <= 0: never, >= 1: always, NaN:
    never), then branch d takes ``below(draw(seed, call, n, 1 + d), n_d)`` (csrc/philox.h).

    Args:
        states: [N, SD] float32 (float64 on the CPU's float64 path), N >= 0.
        params, params_bf16, layout: as ``bf16_dueling_forward`` takes them.
        v_min, v_max: the C51 support (finite, v_min < v_max; ignored for one atom and by 'qr').
        epsilon: one float32 element on the states' device, read there (``fill_`` it between
            graph replays).
        rng: int64 [2] = (seed, call counter) on the states' device; each call with N > 0 draws
            from ``call`` and advances it by one, on the device (N = 0 leaves it).
        loss_type: the loss the network is trained with, which says what its outputs are:
            'c51' (or one atom), 'qr' (quantiles), 'mse' / 'huber' (one atom), as ``dqn_loss``.
        ucb: an ensemble's (E members, the layout's) exploration bonus: each action scores
            mean_e Q_e + ucb * std_e Q_e (population std), the greedy action the first argmax
            of the score, greedy_q its mean_e Q_e. Any finite value (< 0: a lower confidence
            bound); one member (std 0) or ucb = 0: the argmax of the mean. The CUDA kernel
            scores in F32 (|ucb| up to F32's largest finite value).
        fractions: an IQN network's (loss_type 'iqn') K quantile fractions [K], in params' dtype,
            shared by every row: an action's expected Q is the mean of its K values (the
            trainer passes the midpoints (2k + 1) / 2K; docs/iqn-design.md). None otherwise.
    """
    extra = () if fractions is None else (fractions,)
    return ActOutput(*_call("act", states, params, params_bf16, list(layout), float(v_min), float(v_max), epsilon, rng,
                            loss_type, float(ucb), *extra))


@torch.library.register_fake("dqn_ops::act")
def _(states, params, params_bf16, layout, v_min, v_max, epsilon, rng, loss_type="c51", ucb=0.0, fractions=None):
    op = "dqn_ops.act"
    _check_loss_type(op, loss_type, takes_iqn=True)
    _check(math.isfinite(ucb), f"{op}: ucb: expected a finite value (either sign), got {ucb}")
    c = decode_config(layout)
    _check((loss_type == "iqn") == c.iqn, f"{op}: loss_type '{loss_type}': " + (
        "an IQN network (iqn_embedding > 0) acts with loss_type 'iqn'" if c.iqn
        else "'iqn' needs an IQN network (iqn_embedding > 0)"))
    _check_network_inputs(op, c, states, params, params_bf16, layout)
    _check_fractions(op, c, fractions, params, (None,))
    _check(loss_type not in ("mse", "huber") or c.atoms == 1,
           f"{op}: loss_type '{loss_type}' takes plain Q-values (1 atom), got {c.atoms} atoms (use 'c51' or 'qr')")
    _check(epsilon.numel() == 1, f"{op}: epsilon: expected one element, got shape {list(epsilon.shape)}")
    _check(rng.shape == (2,) and rng.dtype == torch.int64,
           f"{op}: rng: expected int64 [2] (seed, call), got {rng.dtype} {list(rng.shape)}")
    N, D = states.shape[0], c.num_branches
    return states.new_empty(N, D, dtype=torch.int64), params.new_empty(N, D)


# ---------------------------------------------------------------------------------------
# epsilon_greedy

def epsilon_greedy(greedy: Tensor, branches: Sequence[int], epsilon: Tensor, rng: Tensor) -> Tensor:
    """``act``'s exploration alone, over greedy actions chosen by any code: [N, D] int64 on
    ``greedy``'s device, a copy of ``greedy`` where row n explores iff
    ``uniform(draw(seed, call, n, 0)) < epsilon``, and then branch d takes
    ``below(draw(seed, call, n, 1 + d), n_d)`` (csrc/philox.h, stream kAct): the same draws as
    ``act`` with the same ``rng``, so a network outside dqn_ops (``TorchTrainer``'s) explores as
    ``Trainer`` does for the same seed. No host sync; graph-capturable.

    Args:
        greedy: int64 [N, D] (N >= 0), contiguous; passed through unread where a row does not explore.
        branches: the D >= 1 branch sizes n_d >= 1.
        epsilon: one float32 element on greedy's device, read there (<= 0: never explore,
            >= 1: always, NaN: never).
        rng: int64 [2] = (seed, call counter) on greedy's device; each call with N > 0 draws
            from ``call`` and advances it by one, on the device (N = 0 leaves it).
    """
    return _call("epsilon_greedy", greedy, [int(n) for n in branches], epsilon, rng)


@torch.library.register_fake("dqn_ops::epsilon_greedy")
def _(greedy, branches, epsilon, rng):
    # csrc/act_args.h's check_epsilon_greedy_args, in its order and words
    op = "dqn_ops.epsilon_greedy"
    max_branches, max_actions = EPSILON_GREEDY_MAX_BRANCHES, EPSILON_GREEDY_MAX_ACTIONS
    _check(1 <= len(branches) <= max_branches,
           f"{op}: branches: expected 1 to {max_branches} branch sizes, got {len(branches)}")
    for d, n in enumerate(branches):
        _check(1 <= n <= max_actions, f"{op}: branches: expected every branch size in [1, {max_actions}], got {n} "
                                      f"at branch {d}")
    _check(greedy.dtype == torch.int64, f"{op}: greedy: expected dtype Long, got {greedy.dtype}")
    _check(greedy.dim() == 2 and greedy.shape[1] == len(branches),
           f"{op}: greedy: expected shape [*, {len(branches)}], got {list(greedy.shape)}")
    _check(greedy.is_contiguous(), f"{op}: greedy: expected a contiguous tensor")
    _check(epsilon.device == greedy.device, f"{op}: epsilon: expected a tensor on {greedy.device}, got one on "
                                            f"{epsilon.device}")
    _check(epsilon.dtype == torch.float32, f"{op}: epsilon: expected dtype Float, got {epsilon.dtype}")
    _check(epsilon.numel() == 1, f"{op}: epsilon: expected one element, got shape {list(epsilon.shape)}")
    _check(rng.device == greedy.device, f"{op}: rng: expected a tensor on {greedy.device}, got one on {rng.device}")
    _check(rng.dtype == torch.int64, f"{op}: rng: expected dtype Long, got {rng.dtype}")
    _check(rng.shape == (2,), f"{op}: rng: expected shape [2], got {list(rng.shape)}")
    return torch.empty_like(greedy)


# ---------------------------------------------------------------------------------------
# bootstrap_masks

def bootstrap_masks(indices: Tensor, seed: int, members: int, p: float) -> Tensor:
    """Bootstrapped DQN's masks (Osband et al. 2016) for a batch of replay rows: [B, members]
    float32 on ``indices``' device, ``masks[b, e]`` = 1.0 iff ``uniform(draw(seed, call=indices[b],
    row=e, slot 0)) < p`` (csrc/philox.h, stream kBootstrap; the formula: csrc/bootstrap_args.h),
    else 0.0. The masks ``dqn_loss`` / ``Trainer`` take: member e learns from a transition with
    probability p.

    A pure function of (seed, replay index, member): a transition keeps its masks for as long as
    it keeps its row, with nothing stored, and the op has no RNG state (graph-capturable, the same
    bits on the CPU and CUDA).

    Args:
        indices: int64 [B] (B >= 0), the batch's replay rows (``ReplayBuffer.sample``'s
            ``indices``); any values (their 64 bits are the counter), any strides.
        seed: any integer; its low 64 bits are the Philox key (``philox_seed``).
        members: the ensemble's size E >= 1.
        p: the probability of a 1, 0 < p <= 1 (1: all ones).
    """
    return _call("bootstrap_masks", indices, philox_seed(seed), int(members), float(p))


@torch.library.register_fake("dqn_ops::bootstrap_masks")
def _(indices, seed, members, p):
    op = "dqn_ops.bootstrap_masks"
    _check(indices.dtype == torch.int64, f"{op}: indices: expected dtype Long, got {indices.dtype}")
    _check(indices.dim() == 1, f"{op}: indices: expected a 1-D tensor [B] (the replay rows of the batch), got shape "
                               f"{list(indices.shape)}")
    _check(1 <= members <= 2 ** 32, f"{op}: members: expected 1 <= members <= {2 ** 32} (philox's row is 32 bits), "
                                    f"got {members}")
    _check(0 < p <= 1, f"{op}: p: expected 0 < p <= 1 (the probability that a member learns from a transition), "
                       f"got {p}")
    return indices.new_empty(indices.shape[0], members, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# iqn_fractions

class IqnFractions(NamedTuple):
    tau: Tensor         # [batch, n] float32: the online network's fractions on s
    tau_target: Tensor  # [batch, n_target] float32: the target network's fractions on s'


def iqn_fractions(rng: Tensor, batch: int, n: int, n_target: int, row_offset: int = 0) -> IqnFractions:
    """IQN's quantile fractions (Dabney et al. 2018) for a batch, drawn on ``rng``'s device
    without a host sync (docs/iqn-design.md, "Fractions in the trainer"):
    ``tau[b, i] = uniform(draw(seed, call, row_offset + b, i))`` and
    ``tau_target[b, j] = uniform(draw(seed, call, row_offset + b, 2^17 + j))`` (csrc/philox.h,
    stream kIqnFractions; the formula: csrc/iqn_fractions_args.h), ``uniform`` the draw's top 24
    bits / 2^24, in [0, 1 - 2^-24]. ``tau_target`` does not depend on ``n`` (nor ``tau`` on
    ``n_target``). The same bits on the CPU and CUDA.

    Args:
        rng: int64 [2] = (seed, call counter), contiguous; the call is read and advanced by one
            on the device (graph-capturable: each replay draws the next call's fractions).
        batch: the rows, >= 1.
        n, n_target: the fractions per row of each set, 1 <= n, n_target <= 2^17 - 1.
        row_offset: the batch's first global row (``rank * batch`` under data parallelism, so that
            ranks draw different fractions), >= 0, with ``row_offset + batch <= 2^32``.
    """
    return IqnFractions(*_call("iqn_fractions", rng, int(batch), int(n), int(n_target), int(row_offset)))


@torch.library.register_fake("dqn_ops::iqn_fractions")
def _(rng, batch, n, n_target, row_offset):
    op = "dqn_ops.iqn_fractions"
    _check(rng.dtype == torch.int64, f"{op}: rng: expected dtype Long, got {rng.dtype}")
    _check(rng.shape == (2,), f"{op}: rng: expected shape [2], got {list(rng.shape)}")
    _check(batch >= 1, f"{op}: batch: expected at least 1 row, got {batch}")
    _check(1 <= n <= IQN_MAX_FRACTIONS, f"{op}: n: expected 1 <= n <= {IQN_MAX_FRACTIONS} (the fractions of a row "
                                        f"draw at philox slots below 2^17), got {n}")
    _check(1 <= n_target <= IQN_MAX_FRACTIONS,
           f"{op}: n_target: expected 1 <= n_target <= {IQN_MAX_FRACTIONS} (the target fractions of a row draw at "
           f"philox slots 2^17 + j, below 2^18), got {n_target}")
    _check(0 <= row_offset < 2 ** 32, f"{op}: row_offset: expected 0 <= row_offset < {2 ** 32} (philox's row is "
                                      f"32 bits), got {row_offset}")
    _check(batch <= 2 ** 32 - row_offset,
           f"{op}: batch: rows row_offset .. row_offset + batch - 1 must be below {2 ** 32} (philox's row is 32 "
           f"bits), got row_offset {row_offset} and batch {batch}")
    return rng.new_empty(batch, n, dtype=torch.float32), rng.new_empty(batch, n_target, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# replay (internal: the device state of dqn_ops/rl/replay.py's ReplayBuffer; the schemas may change)

def _replay_add(storage: Sequence[Tensor], cursor: Tensor, tree: Sequence[Tensor], counter: Tensor,
                rows: Sequence[Tensor]) -> None:
    """N rows = [states, actions, rewards, next_states, dones] into the ring at the cursor; their
    priority (prioritized: ``tree`` non-empty) the running max. One launch on CUDA."""
    _call("_replay_add", list(storage), cursor, list(tree), counter, list(rows))


@torch.library.register_fake("dqn_ops::_replay_add")
def _(storage, cursor, tree, counter, rows):
    _check(len(storage) == 5 and len(rows) == 5,
           f"dqn_ops._replay_add: expected 5 storage and 5 row tensors, got {len(storage)} and {len(rows)}")
    return None


def _replay_add_steps(storage: Sequence[Tensor], cursor: Tensor, tree: Sequence[Tensor], window: Sequence[Tensor],
                      counter: Tensor, obs: Tensor, actions: Tensor, rewards: Tensor, next_obs: Tensor,
                      terminated: Tensor, truncated: Tensor, gamma: float) -> None:
    """One step of E envs into their n-step windows, then the completed n-step transitions into
    the ring (csrc/replay_args.h: nstep_return, nstep_done). Two launches on CUDA."""
    _call("_replay_add_steps", list(storage), cursor, list(tree), list(window), counter, obs, actions, rewards,
          next_obs, terminated, truncated, float(gamma))


@torch.library.register_fake("dqn_ops::_replay_add_steps")
def _(storage, cursor, tree, window, counter, obs, actions, rewards, next_obs, terminated, truncated, gamma):
    _check(len(window) == 5, f"dqn_ops._replay_add_steps: window: expected 5 tensors, got {len(window)}")
    _check(obs.shape == next_obs.shape, f"dqn_ops._replay_add_steps: next_obs: expected shape {list(obs.shape)}, "
                                        f"got {list(next_obs.shape)}")
    return None


def _replay_sample(storage: Sequence[Tensor], cursor: Tensor, tree: Sequence[Tensor], beta: Tensor, rng: Tensor,
                   counter: Tensor, out: Sequence[Tensor]) -> None:
    """B = out[0].shape[0] draws into out = [states, actions, rewards, next_states, dones, weights,
    indices], advancing rng's call counter. One launch on CUDA."""
    _call("_replay_sample", list(storage), cursor, list(tree), beta, rng, counter, list(out))


@torch.library.register_fake("dqn_ops::_replay_sample")
def _(storage, cursor, tree, beta, rng, counter, out):
    _check(len(out) == 7, f"dqn_ops._replay_sample: out: expected 7 tensors, got {len(out)}")
    return None


def _replay_update_priorities(tree: Sequence[Tensor], cursor: Tensor, indices: Tensor, td_error: Tensor,
                              skipped: Tensor, alpha: float, eps: float) -> None:
    """p = (|td| + eps)^alpha at indices (duplicates: the largest); non-finite td_error (and, on
    CUDA, out-of-range indices) skipped and counted in ``skipped``. One launch on CUDA."""
    _call("_replay_update_priorities", list(tree), cursor, indices, td_error, skipped, float(alpha), float(eps))


@torch.library.register_fake("dqn_ops::_replay_update_priorities")
def _(tree, cursor, indices, td_error, skipped, alpha, eps):
    _check(td_error.shape == indices.shape, f"dqn_ops._replay_update_priorities: td_error: expected shape "
                                            f"{list(indices.shape)}, got {list(td_error.shape)}")


# ---------------------------------------------------------------------------------------
# environments (internal: dqn_ops.rl.envs.FuturesTradingEnv owns the tensors; the layout of
# each is in the schema comment, csrc/dqn_ops.cpp)

def _futures_env_step(actions: Tensor, state: Tensor, counters: Tensor, returns: Tensor, observations: Tensor,
                      info: Tensor, seed: int, episode_length: int, kappa: float, trend: float, sigma: float,
                      sigma_fair: float, switch_prob: float, cost: float) -> None:
    """One step of every environment of a FuturesTradingEnv, in place (one launch on CUDA)."""
    _call("_futures_env_step", actions, state, counters, returns, observations, info, seed, episode_length, kappa,
          trend, sigma, sigma_fair, switch_prob, cost)


@torch.library.register_fake("dqn_ops::_futures_env_step")
def _(actions, state, counters, returns, observations, info, seed, episode_length, kappa, trend, sigma,
      sigma_fair, switch_prob, cost):
    n = state.shape[1]
    _check(actions.shape == (n, 3),
           f"dqn_ops._futures_env_step: actions: expected shape [{n}, 3], got {list(actions.shape)}")
    return None


def _futures_env_reset(state: Tensor, counters: Tensor, returns: Tensor, observations: Tensor, sigma: float,
                       episode_length: int) -> None:
    """Every environment starts an episode (position and clock 0); writes observations[1]."""
    _call("_futures_env_reset", state, counters, returns, observations, sigma, episode_length)


@torch.library.register_fake("dqn_ops::_futures_env_reset")
def _(state, counters, returns, observations, sigma, episode_length):
    return None
