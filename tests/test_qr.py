"""QR-DQN (loss_type 'qr'): dqn_loss against the float64 reference written from the paper's
formula (tests/reference.py reference_qr: Dabney et al. 2017, eq. 10, kappa 1), its gradient by
autograd of that reference, non-finite inputs, the op registrations (opcheck, fake tensors,
torch.compile), act's quantile mean, the Trainer (its internal ops bit for bit the public ops,
it learns) and the plain-PyTorch baseline (torch_dqn_loss, TorchTrainer).

Tolerances of the F32 kernels against float64 (the inputs are F32 values, exact in float64):
  * a target T_j = r + gamma (1 - done) theta'_j and u_ij = T_j - theta_i round in F32 to
    ~6e-8 relative on values of size ~20 (rewards up to 15, quantiles ~N(0, 4)): ~1e-6
    absolute on u, below 1e-6 relative on each term huber(u) |tau - 1{u < 0}| (a sign flip of
    u within that error changes a term by |u| ~ 1e-6 times a weight below 1: as small);
  * the loss and TD error sum N^2 such positive terms per branch (up to 40,000 at N = 200):
    F32 accumulation errors are unbiased, ~sqrt(N^2) * 6e-8 ~ 1e-5 relative at the largest N,
    and the kernels may accumulate in double (smaller); rtol 1e-4 leaves a factor of 10;
  * a gradient element (w_b / (B D N)) sum_j |tau_i - 1{u_ij < 0}| clip(u_ij, -1, 1) may cancel
    to ~0, so besides rtol 1e-4 an absolute bar of 1e-5 of the largest element: the error of
    the sum is ~sqrt(N) * 1e-6 of the element scale, the largest element ~N / 2 of it;
  * mean_q is a mean of the inputs themselves: rtol / atol 1e-5.
"""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dqn_ops
from conftest import DEVICES, requires_cuda
from dqn_ops import DQNConfig, DuelingBranchQNet, Trainer, TrainerConfig, dqn_loss, ops
from dqn_ops.rl.baseline import TorchTrainer, torch_dqn_loss
from dqn_ops.trainer import greedy_actions, greedy_from_logits, resolve_loss_type
from poison import poison_cuda_cache
from reference import (SHAPES, assert_no_near_ties, huber1, qr_targets, quantile_fractions, reference_net_like,
                       reference_qr)
from test_act import assert_greedy
from step_check import (check_compile_fullgraph_equals_eager, check_graphed_trainer_equals_eager,
                        check_trainer_step_is_the_public_ops_step, same_bits)

GAMMA = 0.97
V_MIN, V_MAX = -10.0, 10.0  # passed where an API takes them: 'qr' does not use them
LOSS_OP = torch.ops.dqn_ops.dqn_loss.default
ACT_OP = torch.ops.dqn_ops.act.default
CUDA_MAX_ATOMS = ops.LOSS_CUDA_MAX_ATOMS  # the CUDA loss's limit (csrc/loss_args.h)

BRANCHES = [(3, 3, 3), (2,), (4, 1, 6)]
QUANTILES = [1, 2, 7, 51, 200]

TINY_QR = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=11, branches=(2, 3))


def qr_batch(B, branches, N, device, seed=0):
    """q, q_next_online, q_next_target [B, sum n_d, N] ~ N(0, 2^2); actions; rewards: a third
    small (N(0, 0.5^2)), the rest uniform on [-15, 15] (both sides of Huber's kappa = 1, and
    targets far from every quantile); dones 20 %; weights in [0.5, 1.5)."""
    A = sum(branches)
    g = torch.Generator().manual_seed(1000 * seed + 31 * B + N)
    q, qo, qt = (torch.randn(B, A, N, generator=g) * 2 for _ in range(3))
    actions = torch.stack([torch.randint(0, n, (B,), generator=g) for n in branches], 1)
    small = torch.rand(B, generator=g) < 1 / 3
    rewards = torch.where(small, torch.randn(B, generator=g) * 0.5, (torch.rand(B, generator=g) * 2 - 1) * 15)
    dones = (torch.rand(B, generator=g) < 0.2).float()
    weights = torch.rand(B, generator=g) + 0.5
    return [t.to(device) for t in (q, qo, qt, actions, rewards, dones, weights)]


def check_against_reference(out, ref, what=""):
    loss, grad, td, mean_q = ref
    torch.testing.assert_close(out.loss.double().cpu(), loss, rtol=1e-4, atol=1e-7, msg=lambda m: f"{what} loss: {m}")
    torch.testing.assert_close(out.td_error.double().cpu(), td, rtol=1e-4, atol=1e-7,
                               msg=lambda m: f"{what} td_error: {m}")
    torch.testing.assert_close(out.grad_q.double().cpu(), grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(),
                               msg=lambda m: f"{what} grad_q: {m}")
    torch.testing.assert_close(out.mean_q.double().cpu(), mean_q, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{what} mean_q: {m}")


def taken_mask(shape, actions, branches):
    """True at [b, off_d + actions[b, d], :]: the rows a QR gradient may be nonzero on."""
    mask = torch.zeros(shape, dtype=torch.bool)
    rows = torch.arange(shape[0])
    off = 0
    for d, n in enumerate(branches):
        mask[rows, off + actions[:, d].cpu()] = True
        off += n
    return mask


# ----------------------------------------------------------------------------------------
# The reference itself, on a case small enough to write out by hand

def test_reference_on_one_hand_computed_sample():
    """One sample, one branch of 2 actions, N = 2 (tau = 1/4, 3/4): the reference's numbers
    from the formula written out term by term (u on both sides of 0 and of kappa = 1)."""
    q = torch.tensor([[[0.0, 0.0], [1.0, 3.0]]])          # theta = (1, 3): action 1 taken
    qo = torch.tensor([[[0.5, 0.5], [0.0, 0.2]]])         # means 0.5, 0.1: a* = 0
    qt = torch.tensor([[[2.0, 0.5], [9.0, 9.0]]])
    r, d, gamma = torch.tensor([0.5]), torch.tensor([0.0]), 0.5
    actions = torch.tensor([[1]])
    T = [0.5 + gamma * 2.0, 0.5 + gamma * 0.5]            # 1.5, 0.75
    theta, tau = [1.0, 3.0], [0.25, 0.75]
    expected, grads = 0.0, [0.0, 0.0]
    for i in range(2):
        for j in range(2):
            u = T[j] - theta[i]
            w = abs(tau[i] - (1.0 if u < 0 else 0.0))
            h = 0.5 * u * u if abs(u) <= 1 else abs(u) - 0.5
            expected += w * h / 2
            grads[i] += -w * max(-1.0, min(1.0, u)) / 2   # d/d theta_i of w huber(T_j - theta_i) / N
    loss, grad, td, mean_q = reference_qr(q, qo, qt, actions, r, d, (2,), gamma)
    assert loss.item() == pytest.approx(expected, rel=1e-12) and td.tolist() == pytest.approx([expected], rel=1e-12)
    assert mean_q.item() == pytest.approx(2.0, rel=1e-12)
    assert grad[0, 1].tolist() == pytest.approx(grads, rel=1e-12) and (grad[0, 0] == 0).all()
    assert quantile_fractions(2).tolist() == tau
    assert huber1(torch.tensor([0.5, -2.0], dtype=torch.float64)).tolist() == [0.125, 1.5]


# ----------------------------------------------------------------------------------------
# dqn_loss 'qr' against the float64 reference

# More branches than a CUDA block has warps (a warp then runs several branches of a sample, and
# marks several of them NaN when the sample is poisoned).
MANY_BRANCHES = (2,) * 10


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [7, 51])
def test_qr_loss_with_more_branches_than_warps_matches_float64_reference(device, N):
    B = 12
    q, qo, qt, actions, rewards, dones, weights = qr_batch(B, MANY_BRANCHES, N, device, seed=2)
    assert_no_near_ties(qo, MANY_BRANCHES)
    if device == "cuda":
        poison_cuda_cache()
    out = dqn_loss(q, qo, qt, actions, rewards, dones, MANY_BRANCHES, gamma=GAMMA, weights=weights, loss_type="qr")
    check_against_reference(out, reference_qr(q, qo, qt, actions, rewards, dones, MANY_BRANCHES, GAMMA, weights),
                            f"{len(MANY_BRANCHES)} branches")
    assert (out.grad_q.cpu()[~taken_mask(q.shape, actions, MANY_BRANCHES)] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", QUANTILES)
@pytest.mark.parametrize("branches", BRANCHES, ids=lambda b: "x".join(map(str, b)))
def test_qr_loss_matches_float64_reference(device, branches, N):
    B = 48 if N < 200 else 16
    q, qo, qt, actions, rewards, dones, weights = qr_batch(B, branches, N, device)
    assert_no_near_ties(qo, branches)
    # the data covers what the formula distinguishes: terminal and non-terminal samples, u on
    # both sides of 0 and of kappa = 1
    T, _, _ = qr_targets(qo, qt, rewards, dones, branches, GAMMA)
    theta = torch.stack([q.cpu().double()[torch.arange(B), off + actions[:, d].cpu()]
                         for d, off in enumerate([sum(branches[:k]) for k in range(len(branches))])], 1)
    u = T[:, :, None, :] - theta[:, :, :, None]
    assert 0 < dones.sum() < B
    assert 0.05 < (u.abs() <= 1).double().mean() < 0.95 and 0.05 < (u < 0).double().mean() < 0.95
    if device == "cuda":
        poison_cuda_cache()
    for w in (None, weights):
        out = dqn_loss(q, qo, qt, actions, rewards, dones, branches, v_min=V_MIN, v_max=V_MAX, gamma=GAMMA,
                       weights=w, loss_type="qr")
        assert out.grad_q.shape == q.shape and out.td_error.shape == (B,) and out.loss.shape == ()
        assert out.grad_q.dtype == out.loss.dtype == out.td_error.dtype == torch.float32
        ref = reference_qr(q, qo, qt, actions, rewards, dones, branches, GAMMA, w)
        check_against_reference(out, ref, f"weights {'None' if w is None else 'random'}")
        # only the taken actions' rows carry a gradient, exactly 0 elsewhere
        assert (out.grad_q.cpu()[~taken_mask(q.shape, actions, branches)] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_qr_ignores_v_min_and_v_max(device):
    """v_min / v_max are C51's: 'qr' gives the same bits for any values (even v_min >= v_max)."""
    q, qo, qt, actions, rewards, dones, weights = qr_batch(32, (3, 2), 9, device, seed=1)
    outs = [dqn_loss(q, qo, qt, actions, rewards, dones, (3, 2), v_min=lo, v_max=hi, gamma=GAMMA, weights=weights,
                     loss_type="qr") for lo, hi in [(-10.0, 10.0), (0.0, 0.5), (5.0, 5.0), (3.0, -3.0)]]
    for out in outs[1:]:
        for name in out._fields:
            same_bits(getattr(out, name), getattr(outs[0], name), name)


@pytest.mark.parametrize("device", DEVICES)
def test_qr_loss_backward_through_autograd_is_grad_q(device):
    q, qo, qt, actions, rewards, dones, weights = qr_batch(64, (3, 3), 11, device, seed=2)
    q.requires_grad_()
    out = dqn_loss(q, qo, qt, actions, rewards, dones, (3, 3), gamma=GAMMA, weights=weights, loss_type="qr")
    (3 * out.loss).backward()
    torch.testing.assert_close(q.grad, 3 * out.grad_q)
    assert (q.grad != 0).any()


@pytest.mark.parametrize("branches,N", [((3, 3, 3), 7), ((4, 1, 6), 51), ((2,), 1)])
def test_torch_baseline_qr_loss_matches_reference(branches, N):
    """dqn_ops.rl.baseline.torch_dqn_loss(loss_type='qr'), the benchmarks' baseline: in float64
    the reference to float64 rounding, gradient by autograd of each; in F32 within the kernels'
    tolerances."""
    q, qo, qt, actions, rewards, dones, weights = qr_batch(40, branches, N, "cpu", seed=3)
    assert_no_near_ties(qo, branches)
    ref = reference_qr(q, qo, qt, actions, rewards, dones, branches, GAMMA, weights)
    for dtype in (torch.float64, torch.float32):
        x = q.to(dtype).requires_grad_()
        loss, td, mean_q = torch_dqn_loss(x, qo.to(dtype), qt.to(dtype), actions, rewards.to(dtype), dones.to(dtype),
                                          branches, V_MIN, V_MAX, GAMMA, loss_type="qr", weights=weights.to(dtype))
        loss.backward()
        if dtype == torch.float64:
            for got, want in zip((loss.detach(), x.grad, td, mean_q), ref):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        else:
            out = ops.LossOutput(loss.detach(), x.grad, td, mean_q)
            check_against_reference(out, ref, "float32 baseline")


# ----------------------------------------------------------------------------------------
# Non-finite inputs and out-of-range actions

POISON_CASES = ["nan_reward", "inf_reward", "inf_done", "nan_done", "target_overflow", "one_quantile_overflows",
                "nan_target_quantile"]


def _poisoned_batch(device, case, B=32, branches=(3, 3), N=7, b=7):
    q, qo, qt, actions, rewards, dones, weights = qr_batch(B, branches, N, "cpu", seed=4)
    if case == "nan_reward":
        rewards[b] = float("nan")
    elif case == "inf_reward":
        rewards[b] = float("inf")
    elif case == "inf_done":
        dones[b] = float("inf")
    elif case == "nan_done":
        dones[b] = float("nan")
    elif case == "target_overflow":
        # r + gamma * theta' = 3e38 + 0.97 * 3e38 overflows F32 (finite in float64): every T_j inf
        rewards[b], dones[b] = 3e38, 0.0
        qt[b] = 3e38
    elif case == "one_quantile_overflows":
        rewards[b], dones[b] = 3e38, 0.0
        qt[b, :, 3] = 3e38  # T_3 overflows whichever a* is chosen; the other T_j stay finite
    elif case == "nan_target_quantile":
        dones[b] = 0.0
        qt[b, :, 5] = float("nan")  # one non-finite target quantile of every action
    elif case == "nan_q":
        q[b, actions[b, 0], 2] = float("nan")  # a NaN online quantile of branch 0's taken action
    else:
        raise ValueError(case)
    return [t.to(device) for t in (q, qo, qt, actions, rewards, dones, weights)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("branches", [(3, 3), MANY_BRANCHES], ids=lambda b: "x".join(map(str, b)))
@pytest.mark.parametrize("case", POISON_CASES)
def test_non_finite_target_poisons_the_sample(device, case, branches):
    B, b = 32, 7
    q, qo, qt, actions, rewards, dones, weights = _poisoned_batch(device, case, B, branches, b=b)
    if device == "cuda":
        poison_cuda_cache()
    out = dqn_loss(q, qo, qt, actions, rewards, dones, branches, gamma=GAMMA, weights=weights, loss_type="qr")
    assert out.loss.isnan(), f"{case}: loss {out.loss.item()}"
    assert out.td_error[b].isnan(), f"{case}: td {out.td_error[b].item()}"
    off = 0
    for d, n in enumerate(branches):  # the taken action's row of every branch has a NaN
        row = out.grad_q[b, off + actions[b, d]]
        assert row.isnan().any(), f"{case}: branch {d}: the taken action's gradient row is {row.tolist()}"
        off += n
    keep = torch.arange(B, device=device) != b
    assert torch.isfinite(out.td_error[keep]).all() and torch.isfinite(out.grad_q[keep]).all()
    # the other samples' values are those of the batch without the poisoned one
    ref = reference_qr(q[keep], qo[keep], qt[keep], actions[keep], rewards[keep], dones[keep], branches, GAMMA,
                       weights[keep])
    torch.testing.assert_close(out.td_error[keep].double().cpu(), ref[2], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(out.grad_q[keep].double().cpu() * B / (B - 1), ref[1], rtol=1e-4,
                               atol=1e-5 * ref[1].abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_quantile_makes_the_loss_and_its_own_gradient_nan(device):
    """theta_i NaN (a NaN online output, not a bad target): every u_ij of it is NaN, so are the
    sample's loss, TD error and mean Q, and theta_i's gradient (the optimizer's non-finite check
    then skips the step); the sample's other quantiles and branches keep finite gradients, as
    torch's huber_loss backward gives them (unlike a poisoned target, which NaNs every branch)."""
    B, branches, b = 32, (3, 3), 7
    q, qo, qt, actions, rewards, dones, weights = _poisoned_batch(device, "nan_q", B, branches, b=b)
    out = dqn_loss(q, qo, qt, actions, rewards, dones, branches, gamma=GAMMA, weights=weights, loss_type="qr")
    assert out.loss.isnan() and out.td_error[b].isnan() and out.mean_q.isnan()
    row = out.grad_q[b, actions[b, 0]]
    assert row[2].isnan(), f"the NaN quantile's gradient is {row[2].item()}"
    nan_at = torch.zeros_like(out.grad_q, dtype=torch.bool)
    nan_at[b, actions[b, 0], 2] = True
    assert torch.isfinite(out.grad_q[~nan_at]).all()
    keep = torch.arange(B, device=device) != b
    assert torch.isfinite(out.td_error[keep]).all()


def test_out_of_range_action_raises_on_cpu():
    q, qo, qt, actions, rewards, dones, weights = qr_batch(16, (2, 3), 5, "cpu", seed=5)
    for branch, bad in [(1, 3), (0, -1)]:
        a = actions.clone()
        a[5, branch] = bad
        n = (2, 3)[branch]
        with pytest.raises(RuntimeError, match=rf"dqn_ops.dqn_loss: actions: sample 5 takes action {bad} in branch "
                                               rf"{branch}, which has {n} actions"):
            dqn_loss(q, qo, qt, a, rewards, dones, (2, 3), gamma=GAMMA, weights=weights, loss_type="qr")


@requires_cuda
@pytest.mark.parametrize("bad", [-1, 3, 1 << 40])
def test_out_of_range_action_poisons_the_sample_on_cuda(bad):
    q, qo, qt, actions, rewards, dones, weights = qr_batch(16, (2, 3), 5, "cuda", seed=5)
    actions[5, 1] = bad
    poison_cuda_cache()
    loss, grad_q, td, mean_q = LOSS_OP(q, qo, qt, actions, rewards, dones, weights, [2, 3], V_MIN, V_MAX, GAMMA, "qr")
    others = torch.arange(16, device="cuda") != 5
    assert loss.isnan() and mean_q.isnan() and td[5].isnan()
    assert grad_q[5].isnan().any()  # so that the optimizer skips the step
    assert torch.isfinite(td[others]).all() and torch.isfinite(grad_q[others]).all()


@requires_cuda
@pytest.mark.parametrize("case", POISON_CASES + ["nan_q"])
def test_cpu_and_cuda_agree_on_non_finite_inputs(case):
    args = _poisoned_batch("cpu", case, B=64)
    cpu = dqn_loss(*args[:6], (3, 3), gamma=GAMMA, weights=args[6], loss_type="qr")
    gpu = dqn_loss(*(t.cuda() for t in args[:6]), (3, 3), gamma=GAMMA, weights=args[6].cuda(), loss_type="qr")
    for name in ("loss", "td_error", "mean_q"):
        a, b = getattr(cpu, name), getattr(gpu, name).cpu()
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf()), name
        fin = torch.isfinite(a)
        torch.testing.assert_close(a[fin], b[fin], rtol=1e-4, atol=1e-6)
    # the gradient: NaN in the same rows (which elements of a poisoned row are NaN may differ)
    a, b = cpu.grad_q, gpu.grad_q.cpu()
    assert torch.equal(a.isnan().any(-1), b.isnan().any(-1))
    fin = torch.isfinite(a).all(-1) & torch.isfinite(b).all(-1)
    torch.testing.assert_close(a[fin], b[fin], rtol=1e-4, atol=1e-5 * a[fin].abs().max().item())


# ----------------------------------------------------------------------------------------
# Argument checks

def _op_args(device, N=5, loss_type="qr", weights=True):
    q, qo, qt, actions, rewards, dones, w = qr_batch(16, (2, 3), N, device, seed=6)
    return (q, qo, qt, actions, rewards, dones, w if weights else None, [2, 3], V_MIN, V_MAX, GAMMA, loss_type)


@pytest.mark.parametrize("N", [1, 2, 300])
def test_qr_takes_any_number_of_quantiles_on_the_cpu(N):
    args = _op_args("cpu", N)
    loss, grad_q, td, mean_q = LOSS_OP(*args)
    ref = reference_qr(*args[:6], (2, 3), GAMMA, args[6])
    check_against_reference(ops.LossOutput(loss, grad_q, td, mean_q), ref, f"N={N}")


@requires_cuda
def test_cuda_atom_limit_is_a_clear_error():
    args = list(_op_args("cuda", CUDA_MAX_ATOMS + 1))
    with pytest.raises(RuntimeError, match=rf"dqn_ops.dqn_loss: the CUDA kernel takes at most {CUDA_MAX_ATOMS} "
                                           rf"atoms \(C51\) or quantiles \(QR\), got {CUDA_MAX_ATOMS + 1}"):
        LOSS_OP(*args)
    # the limit itself runs, and agrees with the CPU kernel
    args = list(_op_args("cuda", CUDA_MAX_ATOMS))
    gpu = ops.LossOutput(*LOSS_OP(*args))
    cpu = ops.LossOutput(*LOSS_OP(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)))
    check_against_reference(gpu, [t.double() for t in cpu], "256 atoms, cuda vs cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_unknown_loss_type_lists_qr(device):
    with pytest.raises(RuntimeError, match="dqn_ops.dqn_loss: loss_type: expected one of 'c51', 'qr', 'mse', 'huber', "
                                           "'iqn', got 'quantile'"):
        LOSS_OP(*_op_args(device, loss_type="quantile"))
    with pytest.raises(RuntimeError, match=r"dqn_ops.dqn_loss: loss_type 'mse' takes plain Q-values \(1 atom\), got 5 "
                                           r"atoms \(use 'c51' or 'qr'\)"):
        LOSS_OP(*_op_args(device, loss_type="mse"))
    real = _op_args("cpu", loss_type="quantile")
    with FakeTensorMode():  # the fake kernel (torch.compile's tracing) says the same
        fake = [torch.empty(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in real]
        with pytest.raises(RuntimeError, match=r"dqn_ops.dqn_loss: loss_type: expected one of \('c51', 'qr', 'mse', "
                                               r"'huber', 'iqn'\), got 'quantile'"):
            LOSS_OP(*fake)


# ----------------------------------------------------------------------------------------
# Registration: opcheck, fake tensors, torch.compile

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [1, 7])
@pytest.mark.parametrize("weights", [True, False], ids=["weights", "no_weights"])
def test_opcheck_dqn_loss(device, N, weights):
    torch.library.opcheck(LOSS_OP, _op_args(device, N, weights=weights))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_loss_on_logits(device):
    """The trainer's internal loss op with 'qr' (its fake kernel and autograd registration)."""
    c = TINY_QR
    online, target = (DuelingBranchQNet(c, generator=torch.Generator().manual_seed(s)).to(device) for s in (1, 2))
    B = 8
    g = torch.Generator().manual_seed(7)
    pairs = torch.randn(2 * B, c.state_dim, generator=g).to(device)
    actions = torch.stack([torch.randint(0, n, (B,), generator=g) for n in c.branches], 1).to(device)
    rewards, dones = torch.randn(B, generator=g).to(device), (torch.rand(B, generator=g) < 0.3).float().to(device)
    p, p_lp, layout = online.flat_params.detach(), online.params_bf16, online._layout_ints
    f = ops._online_and_target_logits(pairs, p, p_lp, target.flat_params.detach(), target.params_bf16, layout, False)
    for w in (None, torch.rand(B, generator=g).to(device) + 0.5):
        args = (f.logits[:B].contiguous(), f.logits[B:].contiguous(), f.logits_next_target.contiguous(), p,
                target.flat_params.detach(), actions, rewards, dones, w, layout, V_MIN, V_MAX, GAMMA, "qr")
        torch.library.opcheck(torch.ops.dqn_ops._dqn_loss_on_logits.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_act(device):
    net = DuelingBranchQNet(TINY_QR, generator=torch.Generator().manual_seed(3)).to(device)
    s = torch.randn(12, TINY_QR.state_dim, device=device)
    for eps in (0.0, 0.5):
        torch.library.opcheck(ACT_OP, (s, *net_args(net), V_MIN, V_MAX, eps_of(eps, device), rng_of(8, 1, device),
                                       "qr"))
    torch.library.opcheck(ACT_OP, (s[:0], *net_args(net), V_MIN, V_MAX, eps_of(0.5, device), rng_of(8, 1, device),
                                   "qr"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.backends.cuda.is_built(), reason="a CPU-only torch build makes no fake CUDA tensors"))])
def test_fake_kernel_shapes(device):
    with FakeTensorMode():
        B, A, N = 13, 7, 200
        q = torch.empty(B, A, N, device=device)
        a = torch.empty(B, 2, dtype=torch.long, device=device)
        r = torch.empty(B, device=device)
        loss, grad_q, td, mean_q = LOSS_OP(q, q, q, a, r, r, None, [3, 4], V_MIN, V_MAX, GAMMA, "qr")
        assert loss.shape == () and grad_q.shape == (B, A, N) and td.shape == (B,) and mean_q.shape == ()
        assert grad_q.dtype == torch.float32 and grad_q.device == q.device


def test_compile_fullgraph_matches_eager():
    branches = (3, 2)
    q, qo, qt, actions, rewards, dones, weights = qr_batch(64, branches, 11, "cpu", seed=8)

    def loss_fn(q):
        out = dqn_loss(q, qo, qt, actions, rewards, dones, branches, gamma=GAMMA, weights=weights, loss_type="qr")
        return out.loss * 2, out.td_error, out.mean_q

    check_compile_fullgraph_equals_eager(loss_fn, q)


@requires_cuda
@pytest.mark.parametrize("branches", BRANCHES, ids=lambda b: "x".join(map(str, b)))
def test_cuda_qr_loss_matches_cpu_kernel_and_reference_at_200_quantiles(branches):
    B, N = 300, 200
    args = qr_batch(B, branches, N, "cpu", seed=11)  # a seed whose next actions have no near tie
    assert_no_near_ties(args[1], branches)
    cpu = dqn_loss(*args[:6], branches, gamma=GAMMA, weights=args[6], loss_type="qr")
    poison_cuda_cache()
    gpu = dqn_loss(*(t.cuda() for t in args[:6]), branches, gamma=GAMMA, weights=args[6].cuda(), loss_type="qr")
    check_against_reference(gpu, [t.double() for t in cpu], "cuda vs cpu kernel")
    sub = torch.arange(0, B, 10)  # the float64 reference on every 10th sample (it is a Python loop)
    ref = reference_qr(*(t[sub] for t in args[:6]), branches, GAMMA, args[6][sub])
    torch.testing.assert_close(gpu.td_error[sub.cuda()].double().cpu(), ref[2], rtol=1e-4, atol=1e-7)
    grad_sub = gpu.grad_q[sub.cuda()].double().cpu() * B / len(sub)  # the reference's mean runs over len(sub)
    torch.testing.assert_close(grad_sub, ref[1], rtol=1e-4, atol=1e-5 * ref[1].abs().max().item())
    assert (gpu.grad_q.cpu()[~taken_mask(args[0].shape, args[3], branches)] == 0).all()


# ----------------------------------------------------------------------------------------
# act with loss_type 'qr': the quantiles' mean

def net_args(net):
    return net.flat_params.detach(), net.params_bf16, net._layout_ints


def eps_of(value, device):
    return torch.full((1,), value, dtype=torch.float32, device=device)


def rng_of(seed, call, device):
    return torch.tensor([seed, call], dtype=torch.int64, device=device)


def mean_tolerance(q):
    """Per row of logits q [N, A, atoms]: a bound on the F32 rounding of a quantile mean (a
    sequential F32 sum errs by at most (atoms - 1) u sum_j |x_j|, u = 2^-24; the division
    and the final rounding add a few u), with a factor 2 of margin, plus 1e-7 absolute."""
    atoms = q.shape[-1]
    mx = q.double().cpu().abs().flatten(1).amax(1)
    return 2 * (atoms + 2) * 2.0 ** -24 * mx + 1e-7


QR_NETS = {
    "reference": DQNConfig(),
    "tiny": TINY_QR,
    "no_dueling": SHAPES["head0_no_dueling"],
    "one_quantile": DQNConfig(state_dim=12, trunk_hidden=(32, 32), value_hidden=16, adv_hidden=16, atoms=1,
                              branches=(4, 2)),
}


def make_net(c, device, seed=0, dtype=torch.float32):
    net = DuelingBranchQNet(c, generator=torch.Generator().manual_seed(seed)).to(device)
    return net.double() if dtype == torch.float64 else net


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(QR_NETS))
def test_act_qr_is_the_quantile_mean_of_bf16_dueling_forward(device, name):
    c = QR_NETS[name]
    net = make_net(c, device, seed=11)
    s = torch.randn(300, c.state_dim, device=device)
    q = dqn_ops.bf16_dueling_forward(s, *net_args(net)).q_logits
    if device == "cuda":
        poison_cuda_cache()
    rng = rng_of(5, 9, device)
    out = ops.act(s, *net_args(net), V_MIN, V_MAX, eps_of(0.0, device), rng, "qr")
    assert out.actions.shape == (300, c.num_branches) and out.actions.dtype == torch.int64
    assert out.greedy_q.dtype == torch.float32 and out.actions.device == s.device
    assert rng.tolist() == [5, 10]
    E = q.double().cpu().mean(-1)  # the float64 mean of the quantiles
    tol = mean_tolerance(q)
    assert_greedy(c, out.actions, out.greedy_q, E, tol, f"{name}: act", min_decided=0.95)
    # greedy_from_logits (torch's F32 mean) makes the same decided choices
    theirs = greedy_from_logits(q, c.branches, V_MIN, V_MAX, loss_type="qr")
    assert_greedy(c, theirs, out.greedy_q, E, tol, f"{name}: greedy_from_logits", min_decided=0.95)
    # greedy_actions and the module's act run the op
    assert torch.equal(greedy_actions(net, s, V_MIN, V_MAX, loss_type="qr"), out.actions)
    assert torch.equal(net.act(s, eps_of(0.0, device), rng_of(5, 9, device), V_MIN, V_MAX, "qr").actions,
                       out.actions)
    if c.atoms > 1:  # not C51's rule: the expectation over the support picks other actions on some rows
        c51 = ops.act(s, *net_args(net), V_MIN, V_MAX, eps_of(0.0, device), rng_of(5, 9, device), "c51")
        assert (c51.actions != out.actions).any() and not torch.equal(c51.greedy_q, out.greedy_q)
    else:  # one quantile: the Q value itself, as 'mse' / 'huber' read it
        for lt in ("mse", "huber", "c51"):
            other = ops.act(s, *net_args(net), V_MIN, V_MAX, eps_of(0.0, device), rng_of(5, 9, device), lt)
            assert torch.equal(other.actions, out.actions) and torch.equal(other.greedy_q, out.greedy_q)


def test_act_qr_float64_cpu_path_is_the_float64_reference():
    for name, c in QR_NETS.items():
        net = make_net(c, "cpu", seed=12, dtype=torch.float64)
        s = torch.randn(200, c.state_dim, dtype=torch.float64)
        q64, _ = reference_net_like(net)(s)
        out = ops.act(s, *net_args(net), V_MIN, V_MAX, eps_of(0.0, "cpu"), rng_of(1, 2, "cpu"), "qr")
        assert out.greedy_q.dtype == torch.float64
        tol = torch.full((200,), 1e-10, dtype=torch.float64)
        assert_greedy(c, out.actions, out.greedy_q, q64.mean(-1), tol, name, min_decided=0.99)


@pytest.mark.parametrize("device", DEVICES)
def test_act_qr_ignores_the_support_and_explores_as_c51(device):
    c = TINY_QR
    net = make_net(c, device, seed=13)
    s = torch.randn(300, c.state_dim, device=device)
    base = ops.act(s, *net_args(net), V_MIN, V_MAX, eps_of(0.0, device), rng_of(3, 0, device), "qr")
    for lo, hi in [(0.0, 200.0), (1.0, 1.0), (float("nan"), float("inf"))]:  # not checked for 'qr'
        out = ops.act(s, *net_args(net), lo, hi, eps_of(0.0, device), rng_of(3, 0, device), "qr")
        assert torch.equal(out.actions, base.actions) and torch.equal(out.greedy_q, base.greedy_q)
    # exploration does not depend on the loss type: the same Philox draws
    for eps in (0.4, 1.0):
        qr = ops.act(s, *net_args(net), V_MIN, V_MAX, eps_of(eps, device), rng_of(3, 1, device), "qr")
        c51 = ops.act(s, *net_args(net), V_MIN, V_MAX, eps_of(eps, device), rng_of(3, 1, device), "c51")
        c51_greedy = ops.act(s, *net_args(net), V_MIN, V_MAX, eps_of(0.0, device), rng_of(3, 1, device), "c51")
        explored = c51.actions != c51_greedy.actions
        assert torch.equal(qr.actions[explored], c51.actions[explored])
        assert torch.equal(qr.greedy_q, base.greedy_q)
        if eps == 1.0:
            assert torch.equal(qr.actions, c51.actions)


@pytest.mark.parametrize("device", DEVICES)
def test_act_loss_type_errors(device):
    net = make_net(TINY_QR, device, seed=14)  # 11 atoms
    s = torch.randn(4, TINY_QR.state_dim, device=device)
    rng = rng_of(1, 0, device)
    mse_on_11_atoms = (r"dqn_ops.act: loss_type 'mse' takes plain Q-values \(1 atom\), got 11 atoms "
                       r"\(use 'c51' or 'qr'\)")
    with pytest.raises(RuntimeError, match=mse_on_11_atoms):
        ACT_OP(s, *net_args(net), V_MIN, V_MAX, eps_of(0.0, device), rng, "mse")
    with pytest.raises(RuntimeError, match="dqn_ops.act: loss_type: expected one of 'c51', 'qr', 'mse', 'huber', "
                                           "'iqn', got 'quantile'"):
        ACT_OP(s, *net_args(net), V_MIN, V_MAX, eps_of(0.0, device), rng, "quantile")
    assert rng.tolist() == [1, 0]  # nothing drawn
    with FakeTensorMode():
        fs, fe, fr = torch.empty(4, TINY_QR.state_dim), torch.empty(1), torch.empty(2, dtype=torch.int64)
        fp, fm = torch.empty(net.layout.numel), torch.empty(net.layout.numel, dtype=torch.bfloat16)
        a, g = ACT_OP(fs, fp, fm, net._layout_ints, V_MIN, V_MAX, fe, fr, "qr")
        assert a.shape == g.shape == (4, 2) and a.dtype == torch.int64
        with pytest.raises(RuntimeError, match=r"dqn_ops.act: loss_type: expected one of \('c51', 'qr', 'mse', "
                                               r"'huber', 'iqn'\), got 'quantile'"):
            ACT_OP(fs, fp, fm, net._layout_ints, V_MIN, V_MAX, fe, fr, "quantile")
        with pytest.raises(RuntimeError, match=mse_on_11_atoms):  # traced calls fail as the kernel does
            ACT_OP(fs, fp, fm, net._layout_ints, V_MIN, V_MAX, fe, fr, "mse")


@requires_cuda
@pytest.mark.parametrize("name", list(QR_NETS))
def test_cuda_act_qr_matches_cpu(name):
    c = QR_NETS[name]
    net = make_net(c, "cuda", seed=15)
    s = torch.randn(600, c.state_dim, device="cuda")
    poison_cuda_cache()
    g = ops.act(s, *net_args(net), V_MIN, V_MAX, eps_of(0.0, "cuda"), rng_of(31, 4, "cuda"), "qr")
    q_gpu = dqn_ops.bf16_dueling_forward(s, *net_args(net)).q_logits
    cpu_net = make_net(c, "cpu")
    cpu_net.load_state_dict(net.state_dict())
    q_cpu = dqn_ops.bf16_dueling_forward(s.cpu(), *net_args(cpu_net)).q_logits
    # the mean is 1-Lipschitz in the max norm: the measured CPU / GPU logit difference bounds it
    tol = (q_gpu.double().cpu() - q_cpu.double()).abs().flatten(1).amax(1) + mean_tolerance(q_cpu)
    assert_greedy(c, g.actions, g.greedy_q, q_cpu.double().mean(-1), tol, f"{name}: cuda vs cpu", min_decided=0.9)


# ----------------------------------------------------------------------------------------
# Trainer with loss_type 'qr'

def trainer_batch(c, B, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    pairs = torch.randn(2 * B, c.state_dim, generator=g)
    b = dict(state_pairs=pairs, states=pairs[:B], next_states=pairs[B:],
             actions=torch.stack([torch.randint(0, n, (B,), generator=g) for n in c.branches], 1),
             rewards=torch.randn(B, generator=g) * 3, dones=(torch.rand(B, generator=g) < 0.2).float(),
             weights=torch.rand(B, generator=g) + 0.5)
    return {k: v.to(device) for k, v in b.items()}


def test_trainer_qr_learns_a_fixed_batch():
    t = Trainer(TINY_QR, TrainerConfig(batch_size=32, loss_type="qr", lr=5e-2, sigma_max=None, tau=0.0,
                                       readback_interval=4, use_cuda_graph=False), device="cpu", seed=3)
    assert t.loss_type == "qr"
    b = trainer_batch(TINY_QR, 32, "cpu", seed=1)
    del b["state_pairs"]
    for _ in range(30):
        t.step(b)
    t.readback()
    rows = t.stats.rows
    assert len(rows) == 30 and all(math.isfinite(r["loss"]) and r["skipped"] == 0 for r in rows)
    first, last = sum(r["loss"] for r in rows[:5]), sum(r["loss"] for r in rows[-5:])
    assert last < 0.5 * first, (first, last)
    # the trained networks' dqn_loss 'qr' on the batch (the public op) is as low
    b2 = trainer_batch(TINY_QR, 32, "cpu", seed=1)
    with torch.no_grad():
        q, qt = t.online(b2["state_pairs"]), t.target(b2["next_states"])
    out = dqn_loss(q[:32], q[32:], qt, b2["actions"], b2["rewards"], b2["dones"], TINY_QR.branches,
                   gamma=t.config.gamma, weights=b2["weights"], loss_type="qr")
    assert out.loss.item() < 0.5 * first / 5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["reference", "no_dueling", "one_quantile"])
def test_trainer_step_is_the_public_ops_step(device, name):
    """The trainer's internal ops (graphed on CUDA after its warm-up steps) against PublicOpsStep
    (bf16_dueling_forward -> dqn_loss 'qr' -> mixed_backward, eager) on copies of its networks
    taken before the step: the same gradient, TD errors, loss and mean Q, bit for bit."""
    c, B = QR_NETS[name], 32
    cfg = TrainerConfig(batch_size=B, loss_type="qr", gamma=GAMMA, v_min=V_MIN, v_max=V_MAX, readback_interval=1,
                        on_non_finite="flag")
    t = Trainer(c, cfg, device=device, seed=7)
    n = cfg.warmup_steps + 2 if device == "cuda" else 2
    batches = [trainer_batch(c, B, device, seed=10 + i) for i in range(n)]
    check_trainer_step_is_the_public_ops_step(t, batches, V_MIN, V_MAX, GAMMA)
    assert not t.non_finite_steps and all(r["skipped"] == 0 and math.isfinite(r["loss"]) for r in t.stats.rows)


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_act_is_the_quantile_mean(device):
    c = TINY_QR
    t = Trainer(c, TrainerConfig(batch_size=8, loss_type="qr"), device=device, seed=4)
    s = torch.randn(300, c.state_dim, device=device)
    with torch.no_grad():
        q = t.online(s)
    E = q.double().cpu().mean(-1)
    a = t.act(s)
    out0 = ops.act(s, *net_args(t.online), V_MIN, V_MAX, eps_of(0.0, device), rng_of(0, 0, device), "qr")
    assert torch.equal(a, out0.actions)
    assert_greedy(c, a, out0.greedy_q, E, mean_tolerance(q), "Trainer.act", min_decided=0.95)
    acts, greedy_q = t.act_explore(s, eps_of(0.0, device))
    assert torch.equal(acts, a) and torch.equal(greedy_q, out0.greedy_q)


@requires_cuda
def test_graphed_trainer_equals_eager_trainer_and_never_syncs():
    c, B = DQNConfig(), 256
    batches = [trainer_batch(c, B, "cuda", seed=i) for i in range(8)]
    for b in batches:
        del b["state_pairs"]
    check_graphed_trainer_equals_eager(c, batches, batch_size=B, readback_interval=4, loss_type="qr")


@pytest.mark.parametrize("owner", [Trainer, TorchTrainer])
def test_resolve_loss_type_says_what_is_needed(owner):
    one = DQNConfig(state_dim=6, trunk_hidden=(8,), value_hidden=4, adv_hidden=4, atoms=1, branches=(2,))
    five = DQNConfig(state_dim=6, trunk_hidden=(8,), value_hidden=4, adv_hidden=4, atoms=5, branches=(2,))
    name = owner.__name__
    with pytest.raises(ValueError, match=rf"{name}: loss_type 'c51' needs atoms > 1, got a network of 1 atom\(s\)"):
        owner(one, TrainerConfig(loss_type="c51"), device="cpu")
    for lt in ("mse", "huber"):
        with pytest.raises(ValueError, match=rf"{name}: loss_type '{lt}' needs atoms == 1, got a network of 5 "
                                             rf"atom\(s\)"):
            owner(five, TrainerConfig(loss_type=lt), device="cpu")
    # 'qr' fits any atom count; None keeps its default
    for c in (one, five):
        assert owner(c, TrainerConfig(loss_type="qr", batch_size=4), device="cpu").loss_type == "qr"
    assert owner(five, TrainerConfig(batch_size=4), device="cpu").loss_type == "c51"
    assert resolve_loss_type(None, 1, "x") == "huber" and resolve_loss_type("qr", 1, "x") == "qr"
    with pytest.raises(ValueError, match=r"TrainerConfig: loss_type must be 'c51' or 'qr' or 'mse' or 'huber' or "
                                         r"'iqn' or None, got 'quantile'"):
        TrainerConfig(loss_type="quantile")


def test_a_checkpoint_loads_only_into_a_trainer_of_its_loss_type():
    """C51 and QR networks of one config have the same parameters: the loss type decides what
    the outputs mean, so a checkpoint of one does not load into the other."""
    c51 = Trainer(TINY_QR, TrainerConfig(batch_size=4), device="cpu", seed=3)
    qr = Trainer(TINY_QR, TrainerConfig(batch_size=4, loss_type="qr"), device="cpu", seed=3)
    with pytest.raises(ValueError, match=r"Trainer.load_state_dict: the checkpoint was trained with loss_type 'c51', "
                                         r"this trainer's is 'qr'"):
        qr.load_state_dict(c51.state_dict())
    with pytest.raises(ValueError, match=r"loss_type 'qr', this trainer's is 'c51'"):
        c51.load_state_dict(qr.state_dict())
    qr.load_state_dict(Trainer(TINY_QR, TrainerConfig(batch_size=4, loss_type="qr"), device="cpu").state_dict())


# ----------------------------------------------------------------------------------------
# The plain-PyTorch baseline: TorchTrainer(loss_type='qr')

def test_torch_trainer_qr_step_matches_the_trainers_first_step():
    """Same weights, same batch: loss and mean Q of the first step agree with the dqn_ops
    trainer's to its BF16 forward precision (as tests/test_trainer.py does for C51 / Huber)."""
    c = TINY_QR
    cfg = dict(batch_size=64, sigma_max=None, readback_interval=1, lr=1e-3, loss_type="qr")
    ours = Trainer(c, TrainerConfig(**cfg), device="cpu", seed=0)
    ref = TorchTrainer(c, TrainerConfig(**cfg), device="cpu", seed=0)
    assert ref.loss_type == "qr"
    b = trainer_batch(c, 64, "cpu", seed=2)
    del b["state_pairs"]
    ours.step(b)
    ref.step(b)
    m, r = ours.readback(), ref.readback()
    for k in ("loss", "grad_norm_mean", "mean_q"):
        assert math.isfinite(r[k]) and abs(m[k] - r[k]) <= 2e-2 * abs(r[k]) + 1e-3, (k, m[k], r[k])
    # the step is QR's: the baseline's loss of the same networks and batch (C51's would differ)
    with torch.no_grad():
        online = TorchTrainer(c, TrainerConfig(**cfg), device="cpu", seed=0)
        q = online.online(b["states"])[0]
        qn = online.online(b["next_states"])[0]
        qt = online.target(b["next_states"])[0]
        qr_loss = torch_dqn_loss(q, qn, qt, b["actions"], b["rewards"], b["dones"], c.branches, V_MIN, V_MAX,
                                 ref.config.gamma, "qr", b["weights"])[0]
        c51_loss = torch_dqn_loss(q, qn, qt, b["actions"], b["rewards"], b["dones"], c.branches, V_MIN, V_MAX,
                                  ref.config.gamma, "c51", b["weights"])[0]
    assert r["loss"] == pytest.approx(qr_loss.item(), rel=1e-6) and abs(r["loss"] - c51_loss.item()) > 1e-3


def _torch_trainer_and_states(seed=5):
    c = TINY_QR
    t = TorchTrainer(c, TrainerConfig(batch_size=8, loss_type="qr"), device="cpu", seed=seed)
    s = torch.randn(400, c.state_dim)
    with torch.no_grad():
        q = t.online(s)[0]
    return c, t, s, q


def test_torch_trainer_act_is_the_quantile_mean():
    c, t, s, q = _torch_trainer_and_states()
    E = q.double().mean(-1)
    a = t.act(s)
    assert_greedy(c, a, None, E, mean_tolerance(q), "TorchTrainer.act", min_decided=0.95)  # act has no greedy Q
    c51 = greedy_from_logits(q, c.branches, V_MIN, V_MAX, loss_type="c51")
    assert (c51 != a).any()  # not vacuous: C51's rule picks other actions on some rows


def test_torch_trainer_act_explore_greedy_is_the_quantile_mean():
    """The training loop (dqn_ops/rl/loop.py) acts through act_explore: with epsilon 0 its
    actions must be act's, and its greedy_q the quantile mean of the chosen action."""
    c, t, s, q = _torch_trainer_and_states()
    actions, greedy_q = t.act_explore(s, torch.zeros(1))
    assert torch.equal(actions, t.act(s))
    E = q.double().mean(-1)
    assert_greedy(c, actions, greedy_q, E, mean_tolerance(q), "TorchTrainer.act_explore", min_decided=0.95)
