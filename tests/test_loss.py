"""dqn_loss against a plain-PyTorch float64 implementation written here (CleanRL-style)."""
import math

import pytest
import torch

from conftest import DEVICES, requires_cuda
from dqn_ops import dqn_loss
from dqn_ops.rl.baseline import taken_rows, torch_dqn_loss
from poison import poison_cuda_cache


def reference_c51(q, q_next_online, q_next_target, actions, rewards, dones, branches, v_min, v_max, gamma,
                  weights=None):
    """C51 double-DQN loss per branch, mean over branches, in float64; gradient by autograd."""
    B, _, NA = q.shape
    q = q.detach().double().cpu().requires_grad_()
    qo, qt = q_next_online.double().cpu(), q_next_target.double().cpu()
    a, r, d = actions.cpu(), rewards.double().cpu(), dones.double().cpu()
    support = torch.linspace(v_min, v_max, NA, dtype=torch.float64)
    dz = (v_max - v_min) / (NA - 1)
    rows = torch.arange(B)
    per_branch, q_taken, off = [], [], 0
    for i, n in enumerate(branches):
        with torch.no_grad():
            a_star = (qo[:, off:off + n].softmax(-1) * support).sum(-1).argmax(1)
            p_next = qt[:, off:off + n].softmax(-1)[rows, a_star]
            tz = (r[:, None] + gamma * (1 - d[:, None]) * support).clamp(v_min, v_max)
            bj = ((tz - v_min) / dz).clamp(0, NA - 1)
            lo, hi = bj.floor().long(), bj.ceil().long()
            lo = torch.where((hi > 0) & (lo == hi), lo - 1, lo)
            hi = torch.where((lo < NA - 1) & (lo == hi), hi + 1, hi)
            m = torch.zeros(B, NA, dtype=torch.float64)
            m.scatter_add_(1, lo, p_next * (hi.double() - bj))
            m.scatter_add_(1, hi, p_next * (bj - lo.double()))
        logits = q[:, off:off + n][rows, a[:, i]]
        per_branch.append(-(m * logits.log_softmax(-1)).sum(-1))
        q_taken.append((logits.softmax(-1) * support).sum(-1).detach())
        off += n
    per_sample = torch.stack(per_branch, 1).mean(1)
    w = torch.ones(B, dtype=torch.float64) if weights is None else weights.double().cpu()
    loss = (w * per_sample).mean()
    loss.backward()
    return loss.detach(), q.grad, per_sample.detach(), torch.stack(q_taken, 1).mean()


def reference_bdq(q, q_next_online, q_next_target, actions, rewards, dones, branches, gamma, loss_type, weights=None):
    """BDQ: y = r + gamma (1 - done) mean_d Q_target_d(s', argmax Q_online_d(s')); MSE or Huber per branch."""
    B = q.shape[0]
    q = q.detach().double().cpu().requires_grad_()
    qo, qt = q_next_online.double().cpu()[..., 0], q_next_target.double().cpu()[..., 0]
    a, r, d = actions.cpu(), rewards.double().cpu(), dones.double().cpu()
    rows = torch.arange(B)
    targets, taken, off = [], [], 0
    for i, n in enumerate(branches):
        targets.append(qt[:, off:off + n][rows, qo[:, off:off + n].argmax(1)])
        taken.append(q[:, off:off + n, 0][rows, a[:, i]])
        off += n
    y = r + gamma * (1 - d) * torch.stack(targets, 1).mean(1)
    qa = torch.stack(taken, 1)
    delta = y[:, None] - qa
    if loss_type == "mse":
        per = delta ** 2
    else:
        per = torch.nn.functional.huber_loss(qa, y[:, None].expand_as(qa), reduction="none", delta=1.0)
    w = torch.ones(B, dtype=torch.float64) if weights is None else weights.double().cpu()
    loss = (w * per.mean(1)).mean()
    loss.backward()
    return loss.detach(), q.grad, delta.abs().mean(1).detach(), qa.detach().mean()


def sample_batch(B, branches, atoms, device, v_max=10.0, terminal_fraction=0.2, seed=None):
    A = sum(branches)
    g = torch.Generator().manual_seed(B * 7 + atoms if seed is None else seed)
    q, qo, qt = (torch.randn(B, A, atoms, generator=g) * 2 for _ in range(3))
    actions = torch.stack([torch.randint(0, n, (B,), generator=g) for n in branches], 1)
    # rewards up to 1.5x the support: r + gamma z clips at v_min / v_max for many atoms
    rewards = (torch.rand(B, generator=g) * 2 - 1) * 1.5 * v_max
    dones = (torch.rand(B, generator=g) < terminal_fraction).float()
    weights = torch.rand(B, generator=g) + 0.5
    return [t.to(device) for t in (q, qo, qt, actions, rewards, dones, weights)]


C51_CASES = [((3, 3, 3), 51, -10.0, 10.0), ((2, 5), 11, -3.0, 7.0), ((4,), 21, -1.0, 1.0), ((1, 1), 2, 0.0, 1.0),
             # more branches than a sample's 8 warps (a warp takes two)
             ((3,) * 10, 31, -5.0, 5.0),
             # the CUDA kernel's register version at its edges (lanes owning 1 or 2 atoms up to 64,
             # 3 or 4 up to 128), more actions than it reduces at once (4)
             ((6, 2), 33, -2.0, 3.0), ((3, 5), 64, -8.0, 8.0), ((3, 3), 65, -5.0, 5.0), ((2, 6), 97, -4.0, 4.0),
             ((4,), 128, -10.0, 10.0),
             # the general version: rows staged in shared memory
             ((3, 3), 129, -5.0, 5.0),
             # uneven branches, rows too large to stage: read from global memory
             ((2, 3, 1, 4, 3, 2, 5, 2, 3, 1), 201, -20.0, 20.0)]


def _check(out, ref, atoms=1):
    loss, grad, td, mean_q = ref
    torch.testing.assert_close(out.loss.double().cpu(), loss, rtol=2e-5, atol=1e-6)
    # Past 64 atoms the support is finer and the F32 positions of the projection (test_robust_cuda_paths
    # saw gradient elements of ~1e-4 land up to ~3e-8 from float64 at 127-205 atoms): 1e-7 there.
    torch.testing.assert_close(out.grad_q.double().cpu(), grad, rtol=1e-4, atol=1e-8 if atoms <= 64 else 1e-7)
    torch.testing.assert_close(out.td_error.double().cpu(), td, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.mean_q.double().cpu(), mean_q, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("branches,atoms,v_min,v_max", C51_CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_c51_matches_float64_reference(device, branches, atoms, v_min, v_max, weighted):
    if device == "cuda":
        poison_cuda_cache()
    q, qo, qt, actions, rewards, dones, weights = sample_batch(300, branches, atoms, device, v_max)
    w = weights if weighted else None
    out = dqn_loss(q, qo, qt, actions, rewards, dones, branches, v_min=v_min, v_max=v_max, gamma=0.97, weights=w,
                   loss_type="c51")
    assert dones.sum() > 0 and (rewards.abs() > v_max).any()  # terminal transitions and clipping happen
    _check(out, reference_c51(q, qo, qt, actions, rewards, dones, branches, v_min, v_max, 0.97, w), atoms)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("atoms", [21, 101])  # the CUDA register version with 1 / 4 atoms a lane
def test_c51_returns_landing_exactly_on_atoms(device, atoms):
    # support -h..h step 1: a reward of 2 with gamma 1 moves every atom onto another atom
    # (floor == ceil, the case the projection must handle); terminal transitions put all the
    # mass on the reward's atom, including the ends of the support.
    branches, h = (3, 2), (atoms - 1) / 2
    q, qo, qt, actions, _, _, _ = sample_batch(8, branches, atoms, device)
    rewards = torch.tensor([2.0, -3.0, 0.0, h, -h, 4.0, 0.0, -h], device=device)
    dones = torch.tensor([0, 0, 1, 1, 1, 0, 0, 0], dtype=torch.float32, device=device)
    out = dqn_loss(q, qo, qt, actions, rewards, dones, branches, v_min=-h, v_max=h, gamma=1.0)
    _check(out, reference_c51(q, qo, qt, actions, rewards, dones, branches, -h, h, 1.0), atoms)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("branches,atoms", [((3, 3), 97), ((4,), 128), ((6, 2), 120)])
def test_c51_short_horizon_matches_float64_reference(device, branches, atoms):
    # gamma 0.3 squeezes the target onto a few atoms in the support's middle: long runs of sources
    # sharing a lower atom that begin and end inside a lane and cross lanes, away from the clipping
    q, qo, qt, actions, rewards, dones, weights = sample_batch(300, branches, atoms, device, 10.0)
    rewards = rewards / 4
    out = dqn_loss(q, qo, qt, actions, rewards, dones, branches, v_min=-10.0, v_max=10.0, gamma=0.3, weights=weights)
    _check(out, reference_c51(q, qo, qt, actions, rewards, dones, branches, -10.0, 10.0, 0.3, weights), atoms)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", ["mse", "huber"])
@pytest.mark.parametrize("branches", [(3, 3, 3), (5,), (2, 4, 1, 6)])
def test_bdq_losses_match_float64_reference(device, loss_type, branches):
    q, qo, qt, actions, rewards, dones, weights = sample_batch(257, branches, 1, device)
    rewards = rewards / 5  # |delta| on both sides of Huber's delta = 1
    for w in (None, weights):
        out = dqn_loss(q, qo, qt, actions, rewards, dones, branches, gamma=0.9, weights=w, loss_type=loss_type)
        _check(out, reference_bdq(q, qo, qt, actions, rewards, dones, branches, 0.9, loss_type, w))


@pytest.mark.parametrize("device", DEVICES)
def test_loss_backward_through_autograd_is_grad_q(device):
    q, qo, qt, actions, rewards, dones, _ = sample_batch(64, (3, 3), 11, device)
    q.requires_grad_()
    out = dqn_loss(q, qo, qt, actions, rewards, dones, (3, 3))
    (3 * out.loss).backward()
    torch.testing.assert_close(q.grad, 3 * out.grad_q)


def _op_args(device, atoms=5, loss_type="c51"):
    q, qo, qt, actions, rewards, dones, weights = sample_batch(16, (2, 3), atoms, device)
    return (q, qo, qt, actions, rewards, dones, weights, [2, 3], -2.0, 2.0, 0.9, loss_type)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("atoms,loss_type", [(5, "c51"), (1, "huber")])
def test_opcheck(device, atoms, loss_type):
    torch.library.opcheck(torch.ops.dqn_ops.dqn_loss.default, _op_args(device, atoms, loss_type))


BAD = [
    (0, lambda t: t.double(), "q: expected dtype Float, got Double"),
    (1, lambda t: t[:, :4], r"q_next_online: expected shape \[16, 5, 5\], got \[16, 4, 5\]"),
    (2, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), "q_next_target: expected a contiguous tensor"),
    (3, lambda t: t.int(), "actions: expected dtype Long, got Int"),
    (3, lambda t: t[:, :1], r"actions: expected shape \[16, 2\], got \[16, 1\]"),
    (4, lambda t: t[:8], r"rewards: expected shape \[16\], got \[8\]"),
    (5, lambda t: t.bool(), "dones: expected dtype Float, got Bool"),
    (6, lambda t: t[None], r"weights: expected shape \[16\], got \[1, 16\]"),
    (7, [2, 2], r"q: expected shape \[16, 4, 5\], got \[16, 5, 5\]"),
    (7, [2, 0, 3], "branches: branch 1 must have >= 1 action, got 0"),
    (8, 5.0, "v_min must be below v_max"),
    (10, 1.5, r"gamma: expected a value in \[0, 1\]"),
    (11, "mse", "loss_type 'mse' takes plain Q-values \\(1 atom\\), got 5 atoms \\(use 'c51' or 'qr'\\)"),
    (11, "quantile", "loss_type: expected one of 'c51', 'qr', 'mse', 'huber', 'iqn', got 'quantile'"),
]


@pytest.mark.parametrize("index,value,match", BAD)
def test_bad_input(index, value, match):
    args = list(_op_args("cpu"))
    args[index] = value(args[index]) if callable(value) else value
    with pytest.raises(RuntimeError, match="dqn_ops.dqn_loss: " + match):
        torch.ops.dqn_ops.dqn_loss.default(*args)


def test_c51_needs_two_atoms():
    args = list(_op_args("cpu", atoms=1))
    with pytest.raises(RuntimeError, match="loss_type 'c51' needs at least 2 atoms, got 1"):
        torch.ops.dqn_ops.dqn_loss.default(*args)


def test_out_of_range_action_raises_on_cpu():
    args = list(_op_args("cpu"))
    args[3][5, 1] = 3
    with pytest.raises(RuntimeError, match="actions: sample 5 takes action 3 in branch 1, which has 3 actions"):
        torch.ops.dqn_ops.dqn_loss.default(*args)


@requires_cuda
@pytest.mark.parametrize("atoms,loss_type", [(5, "c51"), (1, "mse")])
def test_out_of_range_action_poisons_the_loss_on_cuda(atoms, loss_type):
    args = list(_op_args("cuda", atoms, loss_type))
    args[3][5, 1] = -1
    loss, grad_q, td, mean_q = torch.ops.dqn_ops.dqn_loss.default(*args)
    others = torch.arange(16, device="cuda") != 5
    assert loss.isnan() and mean_q.isnan() and td[5].isnan()
    assert grad_q[5].isnan().any()  # so that the optimizer skips the step
    assert torch.isfinite(td[others]).all() and torch.isfinite(grad_q[others]).all()


@pytest.mark.parametrize("atoms,loss_type", [(5, "c51"), (5, "qr"), (1, "mse")])
def test_plain_pytorch_loss_refuses_an_out_of_range_action_on_cpu(atoms, loss_type):
    q, qo, qt, actions, rewards, dones, weights = sample_batch(16, (2, 3), atoms, "cpu")
    actions[5, 1] = 3
    with pytest.raises(ValueError, match=r"^torch_dqn_loss: actions: sample 5 takes action 3 in branch 1, which "
                                         r"has 3 actions$"):
        torch_dqn_loss(q, qo, qt, actions, rewards, dones, [2, 3], -2.0, 2.0, 0.9, loss_type, weights)


@pytest.mark.parametrize("device", DEVICES)
def test_plain_pytorch_c51_poisons_a_non_finite_reward_or_done(device):
    """As dqn_loss's kernels: the sample's TD error and gradient NaN (an Inf reward too, which a
    clamp onto the support would hide), the others finite; a NaN position never indexes."""
    q, qo, qt, actions, rewards, dones, weights = sample_batch(16, (2, 3), 11, device)
    rewards[3], rewards[5], dones[7] = float("nan"), float("inf"), float("nan")
    q.requires_grad_(True)
    loss, td, mean_q = torch_dqn_loss(q, qo, qt, actions, rewards, dones, [2, 3], -2.0, 2.0, 0.9, "c51", weights)
    loss.backward()
    bad = torch.zeros(16, dtype=torch.bool, device=device)
    bad[[3, 5, 7]] = True
    assert loss.isnan() and td[bad].isnan().all() and q.grad[bad].isnan().flatten(1).any(1).all()
    assert torch.isfinite(td[~bad]).all() and torch.isfinite(q.grad[~bad]).all()


def test_taken_rows_poisons_an_out_of_range_action_and_its_gradient():
    """The plain-PyTorch loss's gather (what its CUDA path runs on a bad action, here on the CPU)."""
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    actions = torch.tensor([0, 2, 3, -1])
    out = taken_rows(x, actions)
    assert torch.equal(out[:2], x[[0, 1], [0, 2]]) and out[2:].isnan().all()
    out.pow(2).sum().backward()  # a loss of the rows: its derivative at a NaN row is NaN
    expected = torch.zeros(2, 3, 5, dtype=torch.float64)
    expected[[0, 1], [0, 2]] = 2 * x.detach()[[0, 1], [0, 2]]
    assert torch.equal(x.grad[:2], expected)
    assert x.grad[2:].isnan().any(dim=(1, 2)).all()  # so that the step's gradient norm is not finite


@requires_cuda
@pytest.mark.parametrize("atoms,loss_type", [(5, "c51"), (5, "qr"), (1, "mse")])
@pytest.mark.parametrize("bad", [-1, 3])
def test_plain_pytorch_loss_poisons_an_out_of_range_action_on_cuda(atoms, loss_type, bad):
    """As dqn_loss's CUDA kernel: the sample's TD error, the loss and the sample's gradient NaN
    (so the step's gradient norm is not finite), the other samples' finite; no device-side assert."""
    q, qo, qt, actions, rewards, dones, weights = sample_batch(16, (2, 3), atoms, "cuda")
    actions[5, 1] = bad
    q.requires_grad_(True)
    loss, td, mean_q = torch_dqn_loss(q, qo, qt, actions, rewards, dones, [2, 3], -2.0, 2.0, 0.9, loss_type, weights)
    loss.backward()
    others = torch.arange(16, device="cuda") != 5
    assert loss.isnan() and mean_q.isnan() and td[5].isnan()
    assert q.grad[5].isnan().any()
    assert torch.isfinite(td[others]).all() and torch.isfinite(q.grad[others]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("atoms,loss_type", [(11, "c51"), (1, "huber")])
@pytest.mark.parametrize("field,value", [("rewards", float("nan")), ("rewards", float("inf")),
                                         ("dones", float("nan")), ("states", float("nan"))])
def test_non_finite_inputs_poison_loss_and_gradient(device, atoms, loss_type, field, value):
    # Clamping onto the support must not hide a NaN or Inf reward: the loss and the sample's
    # gradient become NaN (the trainer's optimizer then skips the step and reports it).
    q, qo, qt, actions, rewards, dones, _ = sample_batch(32, (3, 3), atoms, device)
    if field == "rewards":
        rewards[7] = value
    elif field == "dones":
        dones[7] = value
    else:
        q[7, 0, 0] = value  # a NaN state gives NaN logits
        actions[7, 0] = 0
    out = dqn_loss(q, qo, qt, actions, rewards, dones, (3, 3), loss_type=loss_type)
    assert out.loss.isnan() and out.td_error[7].isnan() and out.grad_q[7].isnan().any()
    keep = torch.arange(32, device=device) != 7
    assert torch.isfinite(out.td_error[keep]).all() and torch.isfinite(out.grad_q[keep]).all()


@requires_cuda
@pytest.mark.parametrize("loss_type", ["c51", "qr"])
def test_cuda_graph_replay_equals_eager_and_never_syncs(loss_type):
    q, qo, qt, actions, rewards, dones, weights = sample_batch(1000, (3, 3, 3), 51, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dqn_loss(q, qo, qt, actions, rewards, dones, (3, 3, 3), weights=weights, loss_type=loss_type)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = dqn_loss(q, qo, qt, actions, rewards, dones, (3, 3, 3), weights=weights, loss_type=loss_type)
    results = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            q.normal_()
            rewards.uniform_(-12, 12)
            g.replay()
            eager = dqn_loss(q, qo, qt, actions, rewards, dones, (3, 3, 3), weights=weights, loss_type=loss_type)
            results.append(([t.clone() for t in static], eager))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for replayed, eager in results:
        for x, y in zip(replayed, eager):
            assert torch.equal(x, y)  # deterministic: the same bits


def test_compile_fullgraph_matches_eager():
    q, qo, qt, actions, rewards, dones, weights = sample_batch(64, (3, 2), 11, "cpu")

    def loss_fn(q):
        out = dqn_loss(q, qo, qt, actions, rewards, dones, (3, 2), weights=weights)
        return out.loss * 2, out.td_error

    results = []
    for fn in (torch.compile(loss_fn, fullgraph=True), loss_fn):
        x = q.clone().requires_grad_()
        loss, td = fn(x)
        loss.backward()  # the compiled backward comes from the op's registered autograd
        results.append((loss.detach(), td, x.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


# -- MSE / Huber: the same non-finite behaviour on the CPU as on CUDA (F32 arithmetic) ------------

def _bdq_args(device, loss_type, B=16, branches=(3, 3)):
    q, qo, qt, actions, rewards, dones, _ = sample_batch(B, branches, 1, device)
    return q, qo, qt, actions, rewards, dones


@pytest.mark.parametrize("device", DEVICES)
def test_mse_overflowing_in_f32_gives_an_inf_loss_not_an_error(device):
    # y = 1e30 is finite in F32, (y - q)^2 = 1e60 is not: the loss is inf (the F32 result of both
    # backends; a sum in double could not store 1e60 in the F32 loss), the
    # gradient -2 delta / (B D) stays finite, and the trainer's optimizer skips on the inf norm.
    q, qo, qt, actions, rewards, dones = _bdq_args(device, "mse")
    rewards[3] = 1e30
    out = dqn_loss(q, qo, qt, actions, rewards, dones, (3, 3), gamma=0.9, loss_type="mse")
    assert out.loss.isinf() and out.loss > 0
    assert torch.isfinite(out.grad_q).all() and torch.isfinite(out.mean_q)
    assert out.td_error[3].item() == pytest.approx(1e30, rel=1e-6)
    rows = actions[3] + torch.tensor([0, 3], device=device)  # the taken action's row in each branch
    taken = out.grad_q[3, rows, 0]
    assert torch.allclose(taken, torch.full_like(taken, -2e30 / (16 * 2)), rtol=1e-5)
    others = torch.ones(6, dtype=torch.bool, device=device)
    others[rows] = False
    assert (out.grad_q[3, others, 0] == 0).all()
    keep = torch.arange(16, device=device) != 3
    assert torch.isfinite(out.td_error[keep]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_huber_on_a_huge_reward_stays_finite(device):
    q, qo, qt, actions, rewards, dones = _bdq_args(device, "huber")
    rewards[3] = 1e30
    out = dqn_loss(q, qo, qt, actions, rewards, dones, (3, 3), gamma=0.9, loss_type="huber")
    assert torch.isfinite(out.loss) and out.loss.item() == pytest.approx((1e30 - 0.5) / 16, rel=1e-5)
    assert torch.isfinite(out.grad_q).all() and out.grad_q.abs().max() <= 1 / (16 * 2) * (1 + 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", ["mse", "huber"])
def test_a_target_overflowing_f32_poisons_the_sample(device, loss_type):
    # r + gamma * Q_target = 3e38 + 0.9 * 3e38 overflows F32: y = inf, the sample is poisoned (NaN
    # loss, TD error and gradient rows of every action of the sample), on both devices.
    q, qo, qt, actions, rewards, dones = _bdq_args(device, loss_type)
    rewards[5], dones[5] = 3e38, 0.0
    qt[5] = 3e38
    out = dqn_loss(q, qo, qt, actions, rewards, dones, (3, 3), gamma=0.9, loss_type=loss_type)
    assert out.loss.isnan() and out.mean_q.isnan() and out.td_error[5].isnan()
    assert out.grad_q[5].isnan().all()
    keep = torch.arange(16, device=device) != 5
    assert torch.isfinite(out.grad_q[keep]).all() and torch.isfinite(out.td_error[keep]).all()


@requires_cuda
@pytest.mark.parametrize("loss_type", ["mse", "huber"])
@pytest.mark.parametrize("case", ["reward_1e30", "target_overflow", "nan_reward", "inf_done", "nan_q"])
def test_cpu_and_cuda_agree_on_non_finite_inputs(loss_type, case):
    q, qo, qt, actions, rewards, dones = _bdq_args("cpu", loss_type, B=64)
    if case == "reward_1e30":
        rewards[3] = 1e30
    elif case == "target_overflow":
        rewards[3], dones[3], qt[3] = 3e38, 0.0, 3e38
    elif case == "nan_reward":
        rewards[3] = float("nan")
    elif case == "inf_done":
        dones[3] = float("inf")
    else:
        q[3, actions[3, 0], 0] = float("nan")
    args = (q, qo, qt, actions, rewards, dones)
    cpu = dqn_loss(*args, (3, 3), gamma=0.9, loss_type=loss_type)
    gpu = dqn_loss(*(t.cuda() for t in args), (3, 3), gamma=0.9, loss_type=loss_type)
    for name in ("loss", "grad_q", "td_error", "mean_q"):
        a, b = getattr(cpu, name), getattr(gpu, name).cpu()
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf()), name
        fin = torch.isfinite(a)
        torch.testing.assert_close(a[fin], b[fin], rtol=1e-5, atol=1e-6)


# -- what a non-finite step changes, as NonFiniteError says -------------------------------------

def _trainer(atoms, sigma_max, on_non_finite="raise"):
    from dqn_ops import DQNConfig, Trainer, TrainerConfig
    c = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=atoms, branches=(2, 3))
    cfg = TrainerConfig(batch_size=16, readback_interval=1, sigma_max=sigma_max, on_non_finite=on_non_finite,
                        loss_type="mse" if atoms == 1 else None)
    return Trainer(c, cfg, device="cpu", seed=1)


def _batch(t, seed=0):
    c, B = t.net_config, t.config.batch_size
    g = torch.Generator().manual_seed(seed)
    return dict(states=torch.randn(B, c.state_dim, generator=g), next_states=torch.randn(B, c.state_dim, generator=g),
                actions=torch.stack([torch.randint(0, n, (B,), generator=g) for n in c.branches], 1),
                rewards=torch.randn(B, generator=g), dones=torch.zeros(B))


@pytest.mark.parametrize("sigma_max", [None, 1.0])
def test_non_finite_error_states_exactly_what_the_step_changed(sigma_max):
    from dqn_ops import NonFiniteError
    t = _trainer(11, sigma_max)
    t.step(_batch(t, 0))  # a finite step first: the target then differs from the online network
    p = t.online.flat_params
    state = t.optimizer.state[p]
    before = dict(params=p.detach().clone(), target=t.target.flat_params.detach().clone(),
                  step=state["step"].clone(), exp_avg=state["exp_avg"].clone(), exp_avg_sq=state["exp_avg_sq"].clone())
    bad = _batch(t, 1)
    bad["rewards"][4] = float("nan")
    with pytest.raises(NonFiniteError) as ei:
        t.step(bad)
    msg = str(ei.value)
    assert "step 1 was non-finite" in msg
    assert "The optimizer skipped it (non-finite gradient): the parameters, the Adam moments and the step count " \
           "are unchanged" in msg
    assert "the target network's EMA toward the online weights" in msg
    # what the message says, checked
    assert torch.equal(state["step"], before["step"]) and torch.equal(state["exp_avg"], before["exp_avg"])
    assert torch.equal(state["exp_avg_sq"], before["exp_avg_sq"])
    assert not torch.equal(t.target.flat_params, before["target"])  # the EMA ran
    if sigma_max is None:
        assert "spectral" not in msg
        assert torch.equal(p, before["params"])  # nothing else touches the parameters
    else:
        assert "the spectral-norm clamp (weights rescaled to sigma <= sigma_max" in msg
    assert "parameters are unchanged" not in msg  # the old, too-broad claim


def test_non_finite_error_says_when_the_optimizer_applied_the_step():
    # MSE on a reward of 1e30: the loss overflows to inf; if the gradient stays finite the
    # optimizer applies the step, and the message must not claim it was skipped.
    from dqn_ops import NonFiniteError
    t = _trainer(1, None)
    b = _batch(t, 0)
    b["rewards"][2] = 1e30
    with pytest.raises(NonFiniteError) as ei:
        t.step(b)
        t.readback()  # a finite gradient sets no device flag: the readback finds the inf loss
    msg = str(ei.value)
    row = t.stats.rows[0]
    assert row["loss"] == float("inf")
    # the gradient, -2 delta / (B D) ~ 1e28 through the network, stays finite: the step is applied
    assert math.isfinite(row["grad_norm"]) and row["skipped"] == 0
    assert "the optimizer applied it" in msg and "skipped it" not in msg
