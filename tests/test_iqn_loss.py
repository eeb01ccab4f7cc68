"""dqn_loss with loss_type 'iqn' (docs/iqn-design.md, "Loss 'iqn'"): QR-DQN's quantile Huber loss
with each sample's own fractions (q [B, E * A, N] at fractions [B, N], q_next_online [B, E * A, K],
q_next_target [B, E * A, N'], N, K, N' free). Against the float64 reference written from the paper's
formula (tests/reference.py reference_iqn_loss), its gradient by autograd (and that autograd by
finite differences, gradcheck in float64); 'qr' as the case of the midpoint fractions; the argument
checks (the fake kernel's too); the op registrations (opcheck, torch.compile); non-finite inputs;
the CUDA kernel against the CPU kernel, its poisoning of a sample with a bad fraction, no host sync
and CUDA graph capture.

Tolerances: tests/test_qr.py's (its module docstring says why), the same arithmetic: the F32
kernels against float64 rtol 1e-4 on the loss and TD errors, the gradient rtol 1e-4 with an
absolute bar of 1e-5 of its largest element, mean_q 1e-5; the CUDA kernel against the CPU kernel
the same (both F32 targets, sums in F32 or double).
"""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import DEVICES, requires_cuda
from dqn_ops import DQNConfig, DuelingBranchQNet, Trainer, TrainerConfig, dqn_loss, ops
from dqn_ops.rl.baseline import TorchTrainer, torch_dqn_loss
from poison import poison_cuda_cache
from reference import assert_no_near_ties, quantile_fractions, reference_iqn_loss
from step_check import check_compile_fullgraph_equals_eager, same_bits
from test_ensemble_loss import masks_of
from test_iqn_reference import iqn_batch
from test_qr import check_against_reference

GAMMA = 0.97
V_MIN, V_MAX = -10.0, 10.0  # passed where an API takes them: 'iqn' does not use them
LOSS_OP = torch.ops.dqn_ops.dqn_loss.default
CUDA_MAX = ops.LOSS_CUDA_MAX_ATOMS  # N and N' on CUDA (csrc/loss_args.h)
BRANCHES = (3, 1, 4)

# (N, K, N'): all different, each of them 1 somewhere; on CUDA the direct version (N <= 32) with
# few and many targets, the sorted one (N > 32) with a sort of 4 (N' = 2), of 64 and of 256.
SHAPES = [(5, 9, 3), (1, 4, 6), (7, 1, 1), (32, 7, 33), (51, 13, 200), (40, 32, 2), (200, 64, 37)]


def shape_id(s):
    return "N{}_K{}_N'{}".format(*s)


def batch(B, E, N, K, N2, seed, branches=BRANCHES):
    """iqn_batch's inputs (values ~ N(0, 2^2), rewards both sides of kappa = 1, dones 20 %,
    weights in [0.5, 1.5), fractions uniform on [0, 1)) for E members, with a fraction at each
    end of [0, 1] exactly (both are fractions)."""
    q, qo, qt, actions, rewards, dones, weights, tau = iqn_batch(B, E * sum(branches), N, K, N2, branches, seed=seed)
    tau[0, 0] = 0.0
    tau[-1, -1] = 1.0
    return q, qo, qt, actions, rewards, dones, weights, tau


def to(device, *tensors):
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors]


def taken_rows(shape, actions, branches):
    """True at [b, e * A + off_d + actions[b, d], :] for every member e: the rows a gradient may be on."""
    mask = torch.zeros(shape, dtype=torch.bool)
    A = sum(branches)
    rows = torch.arange(shape[0])
    for e in range(shape[1] // A):
        off = e * A
        for d, n in enumerate(branches):
            mask[rows, off + actions[:, d].cpu()] = True
            off += n
    return mask


def call(device, q, qo, qt, actions, rewards, dones, weights, tau, masks=None, branches=BRANCHES, loss_type="iqn"):
    return dqn_loss(*to(device, q, qo, qt, actions, rewards, dones), branches, v_min=V_MIN, v_max=V_MAX, gamma=GAMMA,
                    weights=None if weights is None else weights.to(device), loss_type=loss_type,
                    masks=None if masks is None else masks.to(device),
                    fractions=None if tau is None else tau.to(device))


# ----------------------------------------------------------------------------------------
# Against the float64 reference

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("E,mask_kind", [(1, "none"), (3, "none"), (3, "random")])
def test_iqn_loss_matches_float64_reference(device, shape, E, mask_kind):
    N, K, N2 = shape
    B = 24
    q, qo, qt, actions, rewards, dones, weights, tau = batch(B, E, N, K, N2, seed=N + 3 * E)
    assert_no_near_ties(qo, BRANCHES)
    masks = masks_of(mask_kind, B, E, seed=N)
    if N * N2 >= 50:  # the data covers both sides of u = 0 and of kappa = 1 (with few pairs, by chance)
        T = rewards[:, None] + GAMMA * (1 - dones[:, None]) * qt[:, 0]  # one action's targets per sample
        u = T[:, None, :] - q[:, 0, :, None]
        assert 0.05 < (u.abs() <= 1).double().mean() < 0.95 and 0.05 < (u < 0).double().mean() < 0.95
    if device == "cuda":
        poison_cuda_cache()
    for w in (None, weights):
        out = call(device, q, qo, qt, actions, rewards, dones, w, tau, masks)
        assert out.grad_q.shape == q.shape and out.td_error.shape == (B,) and out.loss.shape == ()
        assert out.grad_q.dtype == out.loss.dtype == out.td_error.dtype == out.mean_q.dtype == torch.float32
        assert out.grad_q.device.type == out.loss.device.type == device
        ref = reference_iqn_loss(q, qo, qt, actions, rewards, dones, BRANCHES, GAMMA, tau, w, masks)
        check_against_reference(out, ref, f"{shape_id(shape)} E={E} masks {mask_kind} weights "
                                          f"{'None' if w is None else 'random'}")
        # the taken actions' rows alone carry a gradient: exactly 0 elsewhere
        assert (out.grad_q.cpu()[~taken_rows(q.shape, actions, BRANCHES)] == 0).all()
        assert ref[1].abs().max() > 0
        if masks is not None:  # sample 0 has every member masked: no gradient, its priority stays
            assert (out.grad_q[0] == 0).all() and out.td_error[0] > 0


def test_iqn_takes_any_slot_counts_on_the_cpu():
    """Beyond the CUDA kernel's limit (N, N' > LOSS_CUDA_MAX_ATOMS) the CPU kernel runs, against the reference."""
    for N, K, N2 in [(CUDA_MAX + 1, 3, 5), (4, CUDA_MAX + 40, CUDA_MAX + 9)]:
        q, qo, qt, actions, rewards, dones, weights, tau = batch(8, 1, N, K, N2, seed=N2)
        assert_no_near_ties(qo, BRANCHES)
        out = call("cpu", q, qo, qt, actions, rewards, dones, weights, tau)
        ref = reference_iqn_loss(q, qo, qt, actions, rewards, dones, BRANCHES, GAMMA, tau, weights)
        check_against_reference(out, ref, f"N={N} K={K} N'={N2}")


@pytest.mark.parametrize("device", DEVICES)
def test_fractions_are_per_sample_and_shared_by_the_members(device):
    """Reversing each sample's fractions (the values stay, the slots they weigh change) changes
    every sample's loss as the reference does; an ensemble's members read their sample's row."""
    N, K, N2, E, B = 6, 5, 4, 2, 16
    q, qo, qt, actions, rewards, dones, weights, tau = batch(B, E, N, K, N2, seed=5)
    flipped = tau.flip(1).contiguous()
    a = call(device, q, qo, qt, actions, rewards, dones, weights, tau)
    b = call(device, q, qo, qt, actions, rewards, dones, weights, flipped)
    assert (a.td_error != b.td_error).all()
    check_against_reference(b, reference_iqn_loss(q, qo, qt, actions, rewards, dones, BRANCHES, GAMMA, flipped,
                                                  weights), "reversed fractions")
    # mean_q reads q alone, not the fractions
    assert torch.equal(a.mean_q, b.mean_q)


# ----------------------------------------------------------------------------------------
# The gradient

def test_grad_q_is_the_float64_gradient_of_the_loss():
    """The loss as a float64 function of q (torch_dqn_loss 'iqn', tests/test_iqn_reference.py
    checks it against the reference) passes gradcheck (its autograd gradient is the finite
    differences'); the kernel's grad_q is that gradient and reference_iqn_loss's autograd one."""
    N, K, N2, E, B, branches = 5, 3, 4, 2, 4, (2, 3)
    q, qo, qt, actions, rewards, dones, weights, tau = batch(B, E, N, K, N2, seed=9, branches=branches)
    masks = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [0.5, 1.0]])
    d = [t.double() for t in (qo, qt, rewards, dones, weights, masks, tau)]

    def loss64(x):
        return torch_dqn_loss(x, d[0], d[1], actions, d[2], d[3], branches, V_MIN, V_MAX, GAMMA, "iqn",
                              weights=d[4], masks=d[5], fractions=d[6])[0]

    x = q.double().requires_grad_()
    assert torch.autograd.gradcheck(loss64, (x,), eps=1e-6, atol=1e-8, rtol=1e-5)
    (grad64,) = torch.autograd.grad(loss64(x), x)
    out = call("cpu", q, qo, qt, actions, rewards, dones, weights, tau, masks, branches=branches)
    ref = reference_iqn_loss(q, qo, qt, actions, rewards, dones, branches, GAMMA, tau, weights, masks)
    torch.testing.assert_close(ref[1], grad64, rtol=1e-10, atol=1e-14)
    check_against_reference(out, ref, "gradcheck case")
    assert grad64.abs().max() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E", [1, 3])
def test_iqn_loss_backward_through_autograd_is_grad_q(device, E):
    q, qo, qt, actions, rewards, dones, weights, tau = batch(32, E, 9, 4, 40, seed=2)
    x = q.to(device).requires_grad_()
    out = dqn_loss(x, *to(device, qo, qt, actions, rewards, dones), BRANCHES, gamma=GAMMA, weights=weights.to(device),
                   loss_type="iqn", fractions=tau.to(device))
    (3 * out.loss).backward()
    torch.testing.assert_close(x.grad, 3 * out.grad_q)
    assert (x.grad != 0).any()


# ----------------------------------------------------------------------------------------
# 'qr' is 'iqn' at the midpoints

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [1, 2, 8, 64])
@pytest.mark.parametrize("E,mask_kind", [(1, "none"), (3, "random")])
def test_qr_is_iqn_at_the_midpoint_fractions_bit_for_bit(device, N, E, mask_kind):
    """N = K = N' and tau_i = (2i + 1) / 2N: the same kernel arithmetic, so the same bits
    (N a power of two: the midpoints are exact in F32, as the QR kernels' own are in double)."""
    B = 20
    q, qo, qt, actions, rewards, dones, weights, _ = batch(B, E, N, N, N, seed=N)
    masks = masks_of(mask_kind, B, E, seed=N)
    tau = quantile_fractions(N).float().expand(B, N).contiguous()
    assert torch.equal(tau.double(), quantile_fractions(N).expand(B, N))
    qr = call(device, q, qo, qt, actions, rewards, dones, weights, None, masks, loss_type="qr")
    iqn = call(device, q, qo, qt, actions, rewards, dones, weights, tau, masks)
    for name in qr._fields:
        same_bits(getattr(iqn, name), getattr(qr, name), f"N={N} {name}")
    assert (qr.grad_q != 0).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [7, 51])
def test_qr_is_iqn_at_the_midpoint_fractions_to_their_f32_rounding(device, N):
    """Midpoints that F32 rounds: the fractions' rounding (2^-24 relative) is all that differs."""
    B = 20
    q, qo, qt, actions, rewards, dones, weights, _ = batch(B, 1, N, N, N, seed=N)
    tau = quantile_fractions(N).float().expand(B, N).contiguous()
    qr = call(device, q, qo, qt, actions, rewards, dones, weights, None, loss_type="qr")
    iqn = call(device, q, qo, qt, actions, rewards, dones, weights, tau)
    for name in ("loss", "td_error"):
        torch.testing.assert_close(getattr(iqn, name), getattr(qr, name), rtol=1e-6, atol=0)
    same_bits(iqn.mean_q, qr.mean_q, "mean_q")
    torch.testing.assert_close(iqn.grad_q, qr.grad_q, rtol=1e-5, atol=1e-6 * qr.grad_q.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_iqn_ignores_v_min_and_v_max(device):
    q, qo, qt, actions, rewards, dones, weights, tau = batch(16, 1, 6, 5, 7, seed=1)
    args = to(device, q, qo, qt, actions, rewards, dones, weights)
    outs = [ops.LossOutput(*LOSS_OP(*args, list(BRANCHES), lo, hi, GAMMA, "iqn", None, tau.to(device)))
            for lo, hi in [(-10.0, 10.0), (0.0, 0.5), (5.0, 5.0), (3.0, -3.0)]]
    for out in outs[1:]:
        for name in out._fields:
            same_bits(getattr(out, name), getattr(outs[0], name), name)


# ----------------------------------------------------------------------------------------
# Non-finite inputs

POISON_CASES = ["nan_reward", "inf_reward", "nan_done", "target_overflow", "nan_target_value"]


def poisoned_batch(case, B=24, E=3, N=6, K=5, N2=40, b=7):
    q, qo, qt, actions, rewards, dones, weights, tau = batch(B, E, N, K, N2, seed=4)
    if case == "nan_reward":
        rewards[b] = float("nan")
    elif case == "inf_reward":
        rewards[b] = float("inf")
    elif case == "nan_done":
        dones[b] = float("nan")
    elif case == "target_overflow":  # r + gamma * value overflows F32 (finite in float64)
        rewards[b], dones[b] = 3e38, 0.0
        qt[b] = 3e38
    elif case == "nan_target_value":
        dones[b] = 0.0
        qt[b, :, 3] = float("nan")  # one non-finite target value of every action
    elif case in ("nan_fraction", "negative_fraction", "fraction_above_one", "inf_fraction"):
        tau[b, 2] = {"nan_fraction": float("nan"), "negative_fraction": -1e-7, "fraction_above_one": 1.0 + 2 ** -23,
                     "inf_fraction": float("inf")}[case]
    else:
        raise ValueError(case)
    return q, qo, qt, actions, rewards, dones, weights, tau


def check_poisoned(out, args, masks, b, what):
    """Sample b: NaN loss, TD error and taken rows in every member's every branch (whatever the
    masks); the other samples finite and as the reference has them without sample b."""
    q, qo, qt, actions, rewards, dones, weights, tau = args
    B, A = q.shape[0], sum(BRANCHES)
    assert out.loss.isnan() and out.td_error[b].isnan(), f"{what}: loss {out.loss.item()}, td {out.td_error[b].item()}"
    g = out.grad_q.cpu()
    for e in range(q.shape[1] // A):
        off = e * A
        for d, n in enumerate(BRANCHES):
            row = g[b, off + actions[b, d]]
            assert row.isnan().any(), f"{what}: member {e} branch {d}: the taken row's gradient is {row.tolist()}"
            off += n
    keep = torch.arange(B) != b
    assert torch.isfinite(out.td_error.cpu()[keep]).all() and torch.isfinite(g[keep]).all()
    ref = reference_iqn_loss(*(t[keep] for t in (q, qo, qt, actions, rewards, dones)), BRANCHES, GAMMA, tau[keep],
                             weights[keep], masks[keep])
    torch.testing.assert_close(out.td_error.cpu()[keep].double(), ref[2], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(g[keep].double() * B / (B - 1), ref[1], rtol=1e-4, atol=1e-5 * ref[1].abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", POISON_CASES)
def test_non_finite_target_poisons_the_sample(device, case):
    B, E, b = 24, 3, 7
    args = poisoned_batch(case, B, E, b=b)
    masks = masks_of("random", B, E, seed=3)
    masks[b] = 0  # a masked-out sample stays poisoned: the optimizer must skip the step
    if device == "cuda":
        poison_cuda_cache()
    out = call(device, *args, masks)
    check_poisoned(out, args, masks, b, case)


# ----------------------------------------------------------------------------------------
# Argument checks

def op_args(loss_type="iqn", N=5, K=9, N2=3, E=1, B=16):
    """LOSS_OP's arguments: branches (2, 3), weights, no masks, fractions (None but for 'iqn')."""
    q, qo, qt, actions, rewards, dones, weights, tau = batch(B, E, N, K, N2, seed=6, branches=(2, 3))
    return [q, qo, qt, actions, rewards, dones, weights, [2, 3], V_MIN, V_MAX, GAMMA, loss_type, None,
            tau if loss_type == "iqn" else None]


FRACTIONS = 13  # LOSS_OP's argument index of fractions (12: masks)

BAD = [
    # (argument index, its change, the message after "dqn_ops.dqn_loss: ")
    (FRACTIONS, lambda t: None, r"fractions: loss_type 'iqn' needs q's fractions \[16, 5\], got None"),
    (FRACTIONS, lambda t: t[:, :4].contiguous(), r"fractions: expected shape \[16, 5\], got \[16, 4\]"),
    (FRACTIONS, lambda t: t[:8], r"fractions: expected shape \[16, 5\], got \[8, 5\]"),
    (FRACTIONS, lambda t: t[:, 0].contiguous(), r"fractions: expected shape \[16, 5\], got \[16\]"),
    (FRACTIONS, lambda t: t.double(), "fractions: expected dtype Float, got Double"),
    (FRACTIONS, lambda t: t.bfloat16(), "fractions: expected dtype Float, got BFloat16"),
    (FRACTIONS, lambda t: torch.rand(5, 16).t(), "fractions: expected a contiguous tensor"),
    (1, lambda t: t[:, :4].contiguous(), r"q_next_online: expected shape \[16, 5, \*\], got \[16, 4, 9\]"),
    (2, lambda t: t[:8], r"q_next_target: expected shape \[16, 5, \*\], got \[8, 5, 3\]"),
    (2, lambda t: t[0], r"q_next_target: expected shape \[16, 5, \*\], got \[5, 3\]"),
    (1, lambda t: t.double(), "q_next_online: expected dtype Float, got Double"),
    (1, lambda t: t[:, :, :0].contiguous(),
     r"q_next_online: expected at least 1 fraction per sample \(K\), got shape \[16, 5, 0\]"),
    (2, lambda t: t[:, :, :0].contiguous(),
     r"q_next_target: expected at least 1 fraction per sample \(N'\), got shape \[16, 5, 0\]"),
]


@pytest.mark.parametrize("index,change,match", BAD, ids=range(len(BAD)))
def test_bad_input(index, change, match):
    args = op_args()
    args[index] = change(args[index])
    with pytest.raises(RuntimeError, match="dqn_ops.dqn_loss: " + match):
        LOSS_OP(*args)


def test_q_without_slots():
    args = op_args()
    args[0], args[FRACTIONS] = args[0][:, :, :0].contiguous(), args[FRACTIONS][:, :0]
    with pytest.raises(RuntimeError, match=r"dqn_ops.dqn_loss: q: expected at least 1 fraction per sample \(N\), "
                                           r"got shape \[16, 5, 0\]"):
        LOSS_OP(*args)


# The fake kernel (torch.compile's tracing) checks what the shapes depend on, in its own words
# where the kernel's differ (it names dtypes otherwise) (BAD's cases by index).
FAKE_BAD = [
    (0, r"fractions: loss_type 'iqn' needs q's fractions \[16, 5\], got None"),
    (1, r"fractions: expected float32 \[16, 5\], got torch.float32 \[16, 4\]"),
    (4, r"fractions: expected float32 \[16, 5\], got torch.float64 \[16, 5\]"),
    (7, r"q_next_online: expected shape \[16, 5, \*\], got \[16, 4, 9\]"),
    (8, r"q_next_target: expected shape \[16, 5, \*\], got \[8, 5, 3\]"),
]


@pytest.mark.parametrize("case,match", FAKE_BAD)
def test_fake_kernel_checks_the_fractions(case, match):
    real = op_args()
    index, change, _ = BAD[case]
    real[index] = change(real[index])
    with FakeTensorMode():
        fake = [torch.empty(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in real]
        with pytest.raises(RuntimeError, match="dqn_ops.dqn_loss: " + match):
            LOSS_OP(*fake)


@pytest.mark.parametrize("loss_type", ["qr", "c51", "mse", "huber"])
def test_fractions_are_refused_for_the_other_loss_types(loss_type):
    N = 1 if loss_type in ("mse", "huber") else 5
    args = op_args(loss_type, N, N, N)
    args[FRACTIONS] = torch.rand(16, N)
    match = f"dqn_ops.dqn_loss: fractions: only loss_type 'iqn' takes fractions, got a tensor with loss_type " \
            f"'{loss_type}'"
    with pytest.raises(RuntimeError, match=match):
        LOSS_OP(*args)
    with FakeTensorMode():
        fake = [torch.empty(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(RuntimeError, match=match):
            LOSS_OP(*fake)
    args[FRACTIONS] = None
    LOSS_OP(*args)  # without them it runs


def test_qr_still_needs_equal_atoms_everywhere():
    args = op_args("qr", 5, 9, 5)
    with pytest.raises(RuntimeError, match=r"dqn_ops.dqn_loss: q_next_online: expected shape \[16, 5, 5\], got "
                                           r"\[16, 5, 9\]"):
        LOSS_OP(*args)


@pytest.mark.parametrize("value,text", [(-0.25, "-0.25"), (1.5, "1.5"), (float("nan"), "nan"), (float("inf"), "inf"),
                                        (float("-inf"), "-inf"), (-1e-9, "-1e-09"), (1.0 + 2 ** -23, "1.0000001")])
def test_a_fraction_outside_zero_one_raises_on_the_cpu_naming_sample_and_slot(value, text):
    args = op_args()
    args[FRACTIONS][5, 3] = value
    args[FRACTIONS][9, 0] = value  # a later one: the first is named
    with pytest.raises(RuntimeError, match=rf"dqn_ops.dqn_loss: fractions: sample 5 slot 3 is {text}, expected a "
                                           rf"value in \[0, 1\]"):
        LOSS_OP(*args)
    # the ends of [0, 1] (and -0.0) are fractions
    args[FRACTIONS][5, 3], args[FRACTIONS][9, 0], args[FRACTIONS][0, 1] = 0.0, 1.0, -0.0
    LOSS_OP(*args)


def test_unknown_loss_type_lists_iqn():
    args = op_args()
    args[11] = "implicit"
    with pytest.raises(RuntimeError, match="dqn_ops.dqn_loss: loss_type: expected one of 'c51', 'qr', 'mse', 'huber', "
                                           "'iqn', got 'implicit'"):
        LOSS_OP(*args)
    with FakeTensorMode():
        fake = [torch.empty(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(RuntimeError, match=r"dqn_ops.dqn_loss: loss_type: expected one of \('c51', 'qr', 'mse', "
                                               r"'huber', 'iqn'\), got 'implicit'"):
            LOSS_OP(*fake)


TINY = DQNConfig(state_dim=6, trunk_hidden=(16,), value_hidden=8, adv_hidden=8, atoms=5, branches=(2, 3))


def test_iqn_needs_an_iqn_network_and_the_fused_loss_op_refuses_it():
    """act takes 'iqn' for an IQN network only (tests/test_iqn_trainer.py acts with one); the
    trainer's loss op takes no fractions (the IQN step runs the public ops): 'iqn' is a name it
    does not know, in the kernel and the fake alike, never another type's arithmetic; the
    trainers refuse 'iqn' for a network without IQN at construction."""
    net = DuelingBranchQNet(TINY, generator=torch.Generator().manual_seed(1))
    p, p_lp, layout = net.flat_params.detach(), net.params_bf16, net._layout_ints
    s = torch.randn(4, TINY.state_dim)
    act_args = (s, p, p_lp, layout, V_MIN, V_MAX, torch.zeros(1), torch.tensor([1, 0]), "iqn")
    f = ops._online_and_target_logits(torch.cat([s, s]), p, p_lp, p, p_lp, layout, False)
    actions = torch.zeros(4, 2, dtype=torch.long)
    loss_args = (f.logits[:4].contiguous(), f.logits[4:].contiguous(), f.logits_next_target, p, p, actions,
                 torch.zeros(4), torch.zeros(4), None, layout, V_MIN, V_MAX, GAMMA, "iqn")
    act_match = r"dqn_ops.act: loss_type 'iqn': 'iqn' needs an IQN network \(iqn_embedding > 0\)"
    loss_match = ("dqn_ops._dqn_loss_on_logits: loss_type: expected one of 'c51', 'qr', 'mse', 'huber', got 'iqn'",
                  r"dqn_ops._dqn_loss_on_logits: loss_type: expected one of \('c51', 'qr', 'mse', 'huber'\), "
                  r"got 'iqn'")
    for op, args, (kernel_match, fake_match) in [(torch.ops.dqn_ops.act.default, act_args, (act_match, act_match)),
                                                 (torch.ops.dqn_ops._dqn_loss_on_logits.default, loss_args,
                                                  loss_match)]:
        with pytest.raises(RuntimeError, match=kernel_match):
            op(*args)
        with FakeTensorMode():
            fake = [torch.empty(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
            with pytest.raises(RuntimeError, match=fake_match):
                op(*fake)
    for owner in (Trainer, TorchTrainer):
        with pytest.raises(ValueError, match=rf"{owner.__name__}: loss_type 'iqn' needs an IQN network"):
            owner(TINY, TrainerConfig(loss_type="iqn", batch_size=4), device="cpu")


# ----------------------------------------------------------------------------------------
# Registration: opcheck, fake tensors, torch.compile

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(5, 9, 3), (40, 7, 33)], ids=shape_id)
@pytest.mark.parametrize("E,weighted,masked", [(1, True, False), (1, False, False), (3, True, True)])
def test_opcheck_dqn_loss_iqn(device, shape, E, weighted, masked):
    args = op_args("iqn", *shape, E=E, B=12)
    if not weighted:
        args[6] = None
    if masked:
        args[12] = masks_of("random", 12, E, seed=1)
    torch.library.opcheck(LOSS_OP, to(device, *args))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.backends.cuda.is_built(), reason="a CPU-only torch build makes no fake CUDA tensors"))])
def test_fake_kernel_shapes(device):
    with FakeTensorMode():
        B, W, N, K, N2 = 13, 14, 200, 3, 300
        q = torch.empty(B, W, N, device=device)
        a = torch.empty(B, 2, dtype=torch.long, device=device)
        r = torch.empty(B, device=device)
        loss, grad_q, td, mean_q = LOSS_OP(q, torch.empty(B, W, K, device=device), torch.empty(B, W, N2, device=device),
                                           a, r, r, None, [3, 4], V_MIN, V_MAX, GAMMA, "iqn",
                                           torch.empty(B, 2, device=device), torch.empty(B, N, device=device))
        assert loss.shape == () and grad_q.shape == (B, W, N) and td.shape == (B,) and mean_q.shape == ()
        assert grad_q.dtype == torch.float32 and grad_q.device == q.device


def test_compile_fullgraph_matches_eager():
    B, E = 16, 3
    q, qo, qt, actions, rewards, dones, weights, tau = batch(B, E, 9, 5, 12, seed=8)
    masks = masks_of("random", B, E, seed=8)

    def loss_fn(q):
        out = dqn_loss(q, qo, qt, actions, rewards, dones, BRANCHES, gamma=GAMMA, weights=weights, loss_type="iqn",
                       masks=masks, fractions=tau)
        return out.loss * 2, out.td_error, out.mean_q

    check_compile_fullgraph_equals_eager(loss_fn, q)


# ----------------------------------------------------------------------------------------
# CUDA

CUDA_SHAPES = [(5, 9, 3), (32, 1, 32), (33, 300, 1), (64, 32, 64), (200, 7, 201), (CUDA_MAX, 40, CUDA_MAX),
               (1, 1, CUDA_MAX)]


@requires_cuda
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=shape_id)
@pytest.mark.parametrize("E,mask_kind", [(1, "none"), (3, "random")])
def test_cuda_iqn_loss_matches_cpu_kernel(shape, E, mask_kind):
    """Both versions of the CUDA kernel (direct and sorted; N and N' up to the limit, K beyond
    it) against the CPU kernel, and the limit's case against the reference on a subset."""
    N, K, N2 = shape
    B = 300
    q, qo, qt, actions, rewards, dones, weights, tau = batch(B, E, N, K, N2, seed=11 + N)
    assert_no_near_ties(qo, BRANCHES)
    masks = masks_of(mask_kind, B, E, seed=2)
    cpu = call("cpu", q, qo, qt, actions, rewards, dones, weights, tau, masks)
    poison_cuda_cache()
    gpu = call("cuda", q, qo, qt, actions, rewards, dones, weights, tau, masks)
    check_against_reference(gpu, [t.double() for t in cpu], f"{shape_id(shape)}: cuda vs cpu kernel")
    assert (gpu.grad_q.cpu()[~taken_rows(q.shape, actions, BRANCHES)] == 0).all()
    sub = torch.arange(0, B, 15)  # the float64 reference on every 15th sample (it is a Python loop)
    ref = reference_iqn_loss(*(t[sub] for t in (q, qo, qt, actions, rewards, dones)), BRANCHES, GAMMA, tau[sub],
                             weights[sub], None if masks is None else masks[sub])
    torch.testing.assert_close(gpu.td_error.cpu()[sub].double(), ref[2], rtol=1e-4, atol=1e-7)


@requires_cuda
def test_cuda_limits_are_clear_errors():
    for N, N2, name, letter in [(CUDA_MAX + 1, 3, "q", "N"), (3, CUDA_MAX + 1, "q_next_target", "N'")]:
        args = to("cuda", *op_args("iqn", N, 4, N2))
        with pytest.raises(RuntimeError, match=rf"dqn_ops.dqn_loss: {name}: the CUDA kernel takes at most {CUDA_MAX} "
                                               rf"fractions per sample \(IQN's {letter}\), got {CUDA_MAX + 1} "
                                               rf"\(the CPU kernel takes any\)"):
            LOSS_OP(*args)


@requires_cuda
def test_fractions_on_another_device():
    args = to("cuda", *op_args())
    args[FRACTIONS] = args[FRACTIONS].cpu()
    with pytest.raises(RuntimeError, match="dqn_ops.dqn_loss: fractions: expected a tensor on cuda:0, got one on cpu"):
        LOSS_OP(*args)


@requires_cuda
@pytest.mark.parametrize("case", POISON_CASES + ["nan_fraction", "negative_fraction", "fraction_above_one",
                                                 "inf_fraction"])
@pytest.mark.parametrize("N", [6, 40])
def test_cuda_poisons_the_sample_without_a_host_sync(case, N):
    """A fraction outside [0, 1] (or NaN), which the CPU kernel raises on, poisons its sample on
    CUDA as a non-finite target does: no host sync (sync debug mode 'error')."""
    B, E, b = 24, 3, 7
    args = poisoned_batch(case, B, E, N=N, b=b)
    masks = masks_of("random", B, E, seed=3)
    masks[b] = 0
    dev = to("cuda", *args, masks)
    poison_cuda_cache()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = dqn_loss(*dev[:6], BRANCHES, gamma=GAMMA, weights=dev[6], loss_type="iqn", masks=dev[8],
                       fractions=dev[7])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    check_poisoned(out, args, masks, b, case)
    assert out.mean_q.isnan()


@requires_cuda
def test_cuda_graph_replays_with_new_fractions():
    """The op captured in a CUDA graph (no sync, no allocation outside the pool): each replay
    on new fractions and rewards written into the captured inputs gives the eager op's bits."""
    B, E, N, K, N2 = 64, 2, 40, 8, 33
    q, qo, qt, actions, rewards, dones, weights, tau = to("cuda", *batch(B, E, N, K, N2, seed=12))

    def run():
        return dqn_loss(q, qo, qt, actions, rewards, dones, BRANCHES, gamma=GAMMA, weights=weights, loss_type="iqn",
                        fractions=tau)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        tau.copy_(torch.rand(B, N, generator=g))
        rewards.copy_(torch.randn(B, generator=g) * 3)
        graph.replay()
        eager = run()
        for name in eager._fields:
            same_bits(getattr(captured, name), getattr(eager, name), name)
    assert math.isfinite(eager.loss.item())
