"""Ensembles in the loss and in acting, on the CPU and CUDA kernels.

dqn_loss with E members (q [B, E * sum n_d, NA]) and bootstrap masks [B, E] against a float64
reference written here from the formulas of csrc/dqn_ops.cpp (independent of the kernels and
of dqn_ops/rl/baseline.py), every loss type, its gradient by autograd of that reference:
  per sample b, member e, branch d the term L_bed of the loss type on member e's rows (its own
  double-DQN next action and target; 'mse' / 'huber': the BDQ target y_be per member),
  loss = (1/B) sum_b w_b (1/(E D)) sum_e m_be sum_d L_bed, td[b] = (1/(E D)) sum_{e,d} L_bed
  (|y_be - Q| for 'mse' / 'huber'), mean_q = the mean expected Q of the taken actions;
masks scale the loss and gradient only. E = 1 with masks of ones gives masks=None's bits.
act's ucb: unchanged for one member; a hand-checkable case and float64 scores.

Tolerances (kernel vs float64 on F32 inputs): C51 is computed in double and rounded to F32
(rtol 1e-5); QR's targets are F32 (as on CUDA): rtol 1e-4 with an absolute bar of 1e-5 of the
largest gradient element (tests/test_qr.py says why); MSE / Huber run in F32: rtol 1e-4. The
CUDA kernels compute C51 in F32 too: rtol 1e-4 for every loss type there (CUDA_TOL).
"""
import math
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import DEVICES, requires_cuda
from dqn_ops import DQNConfig, DuelingBranchQNet, dqn_loss, ops
from dqn_ops.rl.baseline import torch_dqn_loss
from dqn_ops.step import InternalOpsStep, PublicOpsStep
from step_check import check_compile_fullgraph_equals_eager, same_bits

LOSS_OP = torch.ops.dqn_ops.dqn_loss.default
ON_LOGITS_OP = torch.ops.dqn_ops._dqn_loss_on_logits.default
ACT_OP = torch.ops.dqn_ops.act.default
V_MIN, V_MAX, GAMMA = -10.0, 10.0, 0.97
LOSS_TYPES = ("c51", "qr", "mse", "huber")
ATOMS = {"c51": 11, "qr": 7, "mse": 1, "huber": 1}
TOL = {"c51": dict(rtol=1e-5, atol=1e-7), "qr": dict(rtol=1e-4, atol=1e-6), "mse": dict(rtol=1e-4, atol=1e-6),
       "huber": dict(rtol=1e-4, atol=1e-6)}
CUDA_TOL = dict(rtol=1e-4, atol=1e-6)
BRANCHES = (3, 2)


def batch(B, E, branches, loss_type, seed=0, atoms=None):
    """q, q_next_online, q_next_target [B, E * A, NA] (NA = atoms, else ATOMS[loss_type]),
    actions, rewards, dones, weights. C51 logits ~ N(0, 1); QR quantiles and plain Q ~ N(0, 2^2);
    rewards on [-4, 4] (Huber's both sides, C51 targets inside and beyond the support's ends with
    gamma z); dones 25 %."""
    g = torch.Generator().manual_seed(100 * seed + 10 * E + B)
    NA, A = atoms or ATOMS[loss_type], sum(branches)
    scale = 1.0 if loss_type == "c51" else 2.0
    q, qo, qt = (torch.randn(B, E * A, NA, generator=g) * scale for _ in range(3))
    actions = torch.stack([torch.randint(0, n, (B,), generator=g) for n in branches], 1)
    rewards = (torch.rand(B, generator=g) * 2 - 1) * 4
    dones = (torch.rand(B, generator=g) < 0.25).float()
    weights = torch.rand(B, generator=g) + 0.5
    return q, qo, qt, actions, rewards, dones, weights


def masks_of(kind, B, E, seed=0):
    """None, random 0/1 (sample 0's members all 0, sample 1's all 1), or all ones."""
    if kind == "none":
        return None
    if kind == "ones":
        return torch.ones(B, E)
    g = torch.Generator().manual_seed(seed + 77)
    m = (torch.rand(B, E, generator=g) < 0.5).float()
    m[0] = 0
    m[1] = 1
    return m


# ----------------------------------------------------------------------------------------
# The float64 reference

def expected_q(x, loss_type, v_min=V_MIN, v_max=V_MAX):
    """Expected Q of atoms x [..., NA] (float64): C51 sum softmax(x) z; QR the quantiles' mean; one atom: x."""
    NA = x.shape[-1]
    if NA == 1:
        return x[..., 0]
    if loss_type == "qr":
        return x.mean(-1)
    z = torch.linspace(v_min, v_max, NA, dtype=torch.float64)
    return (x.softmax(-1) * z).sum(-1)


def reference(q, qo, qt, actions, rewards, dones, branches, loss_type, weights=None, masks=None, *, gamma=GAMMA,
              v_min=V_MIN, v_max=V_MAX):
    """(loss, grad_q by autograd, td [B], mean_q) in float64, from the formulas of the docstring."""
    B, width, NA = q.shape
    A, D = sum(branches), len(branches)
    E = width // A
    x = q.detach().double().requires_grad_()
    xv, ov, tv = x.view(B, E, A, NA), qo.double().view(B, E, A, NA), qt.double().view(B, E, A, NA)
    r, disc = rewards.double()[:, None], gamma * (1 - dones.double())[:, None]      # [B, 1]: per sample
    w = torch.ones(B, dtype=torch.float64) if weights is None else weights.double()
    m = torch.ones(B, E, dtype=torch.float64) if masks is None else masks.double()

    def rows(t, off, n, index):  # t[b, e, off + index[b, e], :] -> [B, E, NA]
        return t[:, :, off:off + n].gather(2, index[:, :, None, None].expand(B, E, 1, NA)).squeeze(2)

    offsets = [sum(branches[:d]) for d in range(D)]
    taken = [rows(xv, off, n, actions[:, d, None].expand(B, E)) for d, (off, n) in enumerate(zip(offsets, branches))]
    # each member's own next action (the first of equal maxima) and its target's atoms
    nxt = [rows(tv, off, n, expected_q(ov[:, :, off:off + n], loss_type, v_min, v_max).argmax(-1))
           for off, n in zip(offsets, branches)]
    terms, td_terms = [], []
    if loss_type == "c51":
        z = torch.linspace(v_min, v_max, NA, dtype=torch.float64)
        dz = (v_max - v_min) / (NA - 1)
        b_j = ((r + disc * z).clamp(v_min, v_max) - v_min) / dz                      # [B, NA (i)]
        # projection: atom i's mass to atom j in proportion max(0, 1 - |b_i - j|)
        share = (1 - (b_j[:, :, None] - torch.arange(NA, dtype=torch.float64)).abs()).clamp(min=0)  # [B, i, j]
        for t, n_atoms in zip(taken, nxt):
            target = torch.einsum("bei,bij->bej", n_atoms.softmax(-1), share)
            terms.append(-(target * t.log_softmax(-1)).sum(-1))
        td_terms = terms
    elif loss_type == "qr":
        tau = (2 * torch.arange(NA, dtype=torch.float64) + 1) / (2 * NA)
        for t, n_atoms in zip(taken, nxt):
            T = r[:, :, None] + disc[:, :, None] * n_atoms                             # [B, E, NA (j)]
            u = T[:, :, None, :] - t[:, :, :, None]                                    # [B, E, i, j]
            huber = torch.where(u.abs() <= 1, 0.5 * u * u, u.abs() - 0.5)
            rho = (tau[:, None] - (u.detach() < 0).double()).abs() * huber
            terms.append((rho.sum(-1) / NA).sum(-1))
        td_terms = terms
    else:
        y = r + disc * torch.stack([n_atoms[..., 0] for n_atoms in nxt], -1).mean(-1)   # [B, E]: per member
        for t in taken:
            delta = y - t[..., 0]
            terms.append(delta ** 2 if loss_type == "mse"
                         else torch.where(delta.abs() <= 1, 0.5 * delta ** 2, delta.abs() - 0.5))
            td_terms.append(delta.detach().abs())
    L = torch.stack(terms, -1)                                                         # [B, E, D]
    loss = (w * (m * L.sum(-1)).sum(-1) / (E * D)).sum() / B
    loss.backward()
    td = torch.stack(td_terms, -1).detach().sum((1, 2)) / (E * D)
    mean_q = torch.stack([expected_q(t.detach(), loss_type, v_min, v_max) for t in taken], -1).mean()
    return loss.detach(), x.grad, td, mean_q


def to(device, *tensors):
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors]


def assert_matches_reference(out, ref, loss_type, device="cpu"):
    loss, grad, td, mean_q = (t.double().cpu() for t in out)
    rl, rg, rtd, rq = ref
    tol = TOL[loss_type] if device == "cpu" else CUDA_TOL
    torch.testing.assert_close(loss, rl, **tol)
    torch.testing.assert_close(td, rtd, **tol)
    torch.testing.assert_close(mean_q, rq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, rg, rtol=tol["rtol"], atol=max(tol["atol"], 1e-5 * rg.abs().max().item()))


# ----------------------------------------------------------------------------------------
# The loss

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("E", [1, 2, 5])
@pytest.mark.parametrize("mask_kind", ["none", "random"])
@pytest.mark.parametrize("weighted", [False, True], ids=["no_weights", "weights"])
def test_loss_matches_float64_reference(device, loss_type, E, mask_kind, weighted):
    check_loss_against_reference(device, loss_type, ATOMS[loss_type], E, mask_kind, weighted, B=12, seed=E)


# The CUDA kernel's versions: C51's register (2 atoms a lane up to 64, 4 up to 128) and staged
# (more) versions, QR's direct (<= 32 quantiles) and sorted ones; 10 branches over 5 members is
# more entries than a block has warps.
CUDA_VERSIONS = [("c51", 51), ("c51", 101), ("c51", 151), ("qr", 7), ("qr", 200), ("huber", 1)]


@requires_cuda
@pytest.mark.parametrize("loss_type,atoms", CUDA_VERSIONS)
@pytest.mark.parametrize("E", [3, 5])
@pytest.mark.parametrize("mask_kind", ["none", "random"])
def test_cuda_kernel_versions_take_members_and_masks(loss_type, atoms, E, mask_kind):
    check_loss_against_reference("cuda", loss_type, atoms, E, mask_kind, True, B=70, seed=atoms)


def check_loss_against_reference(device, loss_type, atoms, E, mask_kind, weighted, B, seed):
    q, qo, qt, actions, rewards, dones, weights = batch(B, E, BRANCHES, loss_type, seed=seed, atoms=atoms)
    w = weights if weighted else None
    masks = masks_of(mask_kind, B, E, seed=seed)
    args = to(device, q, qo, qt, actions, rewards, dones, w)
    out = LOSS_OP(*args, list(BRANCHES), V_MIN, V_MAX, GAMMA, loss_type, *to(device, masks))
    assert out[1].shape == q.shape and out[1].device == q.to(device).device
    assert_matches_reference(out, reference(q, qo, qt, actions, rewards, dones, BRANCHES, loss_type, w, masks),
                             loss_type, device)
    if masks is not None:  # sample 0 has every member masked: no gradient, but its priority stays
        assert (out[1][0] == 0).all()
        assert out[2][0] > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("E", [1, 3])
def test_masks_of_ones_are_masks_none_bit_for_bit(device, loss_type, E):
    q, qo, qt, actions, rewards, dones, weights = batch(9, E, (2, 4, 1), loss_type, seed=5)
    args = (*to(device, q, qo, qt, actions, rewards, dones, weights), [2, 4, 1], V_MIN, V_MAX, GAMMA, loss_type)
    ones = torch.ones(9, E, device=device)
    for a, b, name in zip(LOSS_OP(*args, None), LOSS_OP(*args, ones), ("loss", "grad_q", "td", "mean_q")):
        same_bits(a, b, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_members_are_independent_learners(device, loss_type):
    """Member e's gradient rows and its part of the loss are those of a one-member loss on its
    rows alone (scaled by 1/E): no member reads another's rows."""
    B, E, A = 10, 3, sum(BRANCHES)
    q, qo, qt, actions, rewards, dones, weights = to(device, *batch(B, E, BRANCHES, loss_type, seed=9))
    masks = masks_of("random", B, E, seed=9).to(device)
    args = (actions, rewards, dones, weights, list(BRANCHES), V_MIN, V_MAX, GAMMA, loss_type)
    full = LOSS_OP(q, qo, qt, *args, masks)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for e in range(E):
        part = [t[:, e * A:(e + 1) * A].contiguous() for t in (q, qo, qt)]
        one = LOSS_OP(*part, *args, masks[:, e:e + 1].contiguous())
        torch.testing.assert_close(full[1][:, e * A:(e + 1) * A], one[1] / E, rtol=1e-5, atol=1e-8)
        loss += one[0].double() / E
    torch.testing.assert_close(full[0].double(), loss, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", ["c51", "qr", "huber"])
def test_a_masked_member_still_carries_a_poisoned_sample(device, loss_type):
    """A NaN reward poisons the sample whatever its masks (0 * NaN is NaN): the optimizer skips the step."""
    B, E = 6, 2
    q, qo, qt, actions, rewards, dones, _ = batch(B, E, BRANCHES, loss_type, seed=3)
    rewards[2] = float("nan")
    masks = torch.ones(B, E)
    masks[2] = 0
    loss, grad, td, _ = LOSS_OP(*to(device, q, qo, qt, actions, rewards, dones), None, list(BRANCHES), V_MIN, V_MAX,
                                GAMMA, loss_type, masks.to(device))
    assert loss.isnan() and td[2].isnan() and grad[2].isnan().any()
    others = torch.arange(B, device=device) != 2
    assert torch.isfinite(td[others]).all() and torch.isfinite(grad[others]).all()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("E", [1, 3])
def test_loss_backward_through_autograd_is_grad_q(loss_type, E):
    q, qo, qt, actions, rewards, dones, weights = batch(8, E, BRANCHES, loss_type, seed=2)
    masks = masks_of("random", 8, E)
    q.requires_grad_()
    out = dqn_loss(q, qo, qt, actions, rewards, dones, BRANCHES, v_min=V_MIN, v_max=V_MAX, gamma=GAMMA,
                   weights=weights, loss_type=loss_type, masks=masks)
    (3 * out.loss).backward()
    torch.testing.assert_close(q.grad, 3 * out.grad_q)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("E", [1, 3])
def test_torch_baseline_matches_kernel(loss_type, E):
    B = 10
    q, qo, qt, actions, rewards, dones, weights = batch(B, E, BRANCHES, loss_type, seed=4)
    masks = masks_of("random", B, E, seed=4)
    out = LOSS_OP(q, qo, qt, actions, rewards, dones, weights, list(BRANCHES), V_MIN, V_MAX, GAMMA, loss_type, masks)
    x = q.clone().requires_grad_()
    loss, td, mean_q = torch_dqn_loss(x, qo, qt, actions, rewards, dones, BRANCHES, V_MIN, V_MAX, GAMMA, loss_type,
                                      weights, masks)
    loss.backward()
    tol = TOL[loss_type]
    torch.testing.assert_close(loss, out[0], **tol)
    torch.testing.assert_close(td, out[2], **tol)
    torch.testing.assert_close(mean_q, out[3], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, out[1], rtol=tol["rtol"], atol=max(tol["atol"], 1e-5 * out[1].abs().max().item()))


# ----------------------------------------------------------------------------------------
# The trainer's loss on logits (one member here; tests/test_ensemble_network.py has ensembles)

def _logits_inputs(loss_type="c51", B=12):
    c = DQNConfig(state_dim=10, trunk_hidden=(32,), value_hidden=16, adv_hidden=16, atoms=ATOMS[loss_type],
                  branches=BRANCHES)
    online, target = (DuelingBranchQNet(c, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    g = torch.Generator().manual_seed(5)
    b = dict(state_pairs=torch.randn(2 * B, c.state_dim, generator=g),
             actions=torch.stack([torch.randint(0, n, (B,), generator=g) for n in c.branches], 1),
             rewards=(torch.rand(B, generator=g) * 2 - 1) * 4, dones=(torch.rand(B, generator=g) < 0.25).float(),
             weights=torch.rand(B, generator=g) + 0.5)
    return c, online, target, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_on_logits_with_masks_is_the_public_ops_bits(device, loss_type):
    """One member with masks (on CUDA the fused loss kernel, C51 and QR, or the composed one,
    Huber); tests/test_ensemble_network.py and test_fused_step.py have ensembles on CUDA."""
    c, online, target, b = _logits_inputs(loss_type)
    online, target, b = online.to(device), target.to(device), {k: v.to(device) for k, v in b.items()}
    B = b["actions"].shape[0]
    kw = dict(loss_type=loss_type, v_min=V_MIN, v_max=V_MAX, gamma=GAMMA, precision="bf16")
    internal, public = InternalOpsStep(online, target, **kw), PublicOpsStep(online, target, **kw)
    fi, fp = internal.forward(b["state_pairs"]), public.forward(b["state_pairs"])
    masks = masks_of("random", B, 1).to(device)
    sample = (b["actions"], b["rewards"], b["dones"], b["weights"])
    p, layout = internal._params(), online._layout_ints
    got = ops._dqn_loss_on_logits(fi.logits[:B], fi.logits[B:], fi.logits_next_target, p.online, p.target, *sample,
                                  layout, V_MIN, V_MAX, GAMMA, loss_type, masks)
    q = fp.online.q_logits
    want = ops.dqn_loss(q[:B], q[B:], fp.q_next_target, b["actions"], b["rewards"], b["dones"], c.branches,
                        v_min=V_MIN, v_max=V_MAX, gamma=GAMMA, weights=b["weights"], loss_type=loss_type, masks=masks)
    for k in ("loss", "td_error", "mean_q"):
        same_bits(getattr(got, k), getattr(want, k), k)
    same_bits(internal.backward(fi, got), public.backward(fp, want), "grad")
    assert (want.grad_q[masks[:, 0] == 0] == 0).all()
    unmasked = ops._dqn_loss_on_logits(fi.logits[:B], fi.logits[B:], fi.logits_next_target, p.online, p.target,
                                       *sample, layout, V_MIN, V_MAX, GAMMA, loss_type)
    ones = ops._dqn_loss_on_logits(fi.logits[:B], fi.logits[B:], fi.logits_next_target, p.online, p.target, *sample,
                                   layout, V_MIN, V_MAX, GAMMA, loss_type, torch.ones(B, 1, device=device))
    for a, b_, name in zip(unmasked, ones, unmasked._fields):
        same_bits(a, b_, name)


# ----------------------------------------------------------------------------------------
# Registration: opcheck, fake tensors, torch.compile

@pytest.mark.parametrize("loss_type", ["c51", "qr", "huber"])
@pytest.mark.parametrize("E,mask_kind", [(1, "random"), (3, "none"), (3, "random")])
def test_opcheck_dqn_loss(loss_type, E, mask_kind):
    q, qo, qt, actions, rewards, dones, weights = batch(8, E, BRANCHES, loss_type, seed=6)
    torch.library.opcheck(LOSS_OP, (q, qo, qt, actions, rewards, dones, weights, list(BRANCHES), V_MIN, V_MAX, GAMMA,
                                    loss_type, masks_of(mask_kind, 8, E)))


def test_opcheck_loss_on_logits_with_masks():
    c, online, target, b = _logits_inputs("qr", B=8)
    p, tp, layout = online.flat_params.detach(), target.flat_params.detach(), online._layout_ints
    f = ops._online_and_target_logits(b["state_pairs"], p, online.params_bf16, tp, target.params_bf16, layout, False)
    args = (f.logits[:8].contiguous(), f.logits[8:].contiguous(), f.logits_next_target.contiguous(), p, tp,
            b["actions"], b["rewards"], b["dones"], b["weights"], layout, V_MIN, V_MAX, GAMMA, "qr",
            masks_of("random", 8, 1))
    torch.library.opcheck(ON_LOGITS_OP, args)


def test_opcheck_act_with_ucb():
    c = DQNConfig(state_dim=6, trunk_hidden=(16,), value_hidden=8, adv_hidden=8, atoms=5, branches=(2, 3))
    net = DuelingBranchQNet(c, generator=torch.Generator().manual_seed(3))
    s = torch.randn(7, c.state_dim)
    for ucb in (0.0, 1.5, -2.0):
        torch.library.opcheck(ACT_OP, (s, net.flat_params.detach(), net.params_bf16, net._layout_ints, V_MIN, V_MAX,
                                       torch.full((1,), 0.3), torch.tensor([5, 1]), "c51", ucb))


def test_fake_kernels_take_members_and_masks():
    with FakeTensorMode():
        B, E, A, NA = 13, 4, 5, 7
        q = torch.empty(B, E * A, NA)
        a = torch.empty(B, 2, dtype=torch.long)
        r = torch.empty(B)
        loss, grad_q, td, mean_q = LOSS_OP(q, q, q, a, r, r, None, [2, 3], V_MIN, V_MAX, GAMMA, "qr",
                                           torch.empty(B, E))
        assert loss.shape == () and grad_q.shape == (B, E * A, NA) and td.shape == (B,) and mean_q.shape == ()
        with pytest.raises(RuntimeError, match=r"dqn_ops.dqn_loss: masks: expected float32 \[13, 4\], got "
                                               r"torch.float32 \[13, 3\]"):
            LOSS_OP(q, q, q, a, r, r, None, [2, 3], V_MIN, V_MAX, GAMMA, "qr", torch.empty(B, 3))
        with pytest.raises(RuntimeError, match=r"dqn_ops.dqn_loss: q: expected shape \[B, 5, atoms\], got "
                                               r"\[13, 22, 7\] \(an ensemble of E members: \[B, E \* 5, atoms\]\)"):
            LOSS_OP(torch.empty(B, 22, NA), q, q, a, r, r, None, [2, 3], V_MIN, V_MAX, GAMMA, "qr")
        # the kernels' branch checks come first (no division by an empty action count)
        for branches, why in (([], "expected at least one branch, got none"),
                              ([2, 0], "branch 1 must have >= 1 action, got 0")):
            with pytest.raises(RuntimeError, match=f"dqn_ops.dqn_loss: branches: {re.escape(why)}"):
                LOSS_OP(q, q, q, a, r, r, None, branches, V_MIN, V_MAX, GAMMA, "qr")


def test_compile_fullgraph_matches_eager():
    B, E = 16, 3
    q, qo, qt, actions, rewards, dones, weights = batch(B, E, BRANCHES, "c51", seed=8)
    masks = masks_of("random", B, E, seed=8)

    def loss_fn(q):
        out = dqn_loss(q, qo, qt, actions, rewards, dones, BRANCHES, v_min=V_MIN, v_max=V_MAX, gamma=GAMMA,
                       weights=weights, masks=masks)
        return out.loss * 2, out.td_error, out.mean_q

    check_compile_fullgraph_equals_eager(loss_fn, q)


# ----------------------------------------------------------------------------------------
# Bad inputs

def _bad_args(E=2):
    q, qo, qt, actions, rewards, dones, weights = batch(16, E, (2, 3), "c51", seed=1)
    return [q, qo, qt, actions, rewards, dones, weights, [2, 3], V_MIN, V_MAX, GAMMA, "c51", torch.ones(16, E)]


BAD = [
    (0, lambda t: t[:, :7], r"q: expected shape \[16, 5, 11\], got \[16, 7, 11\] \(an ensemble of E members: "
                            r"\[16, E \* 5, 11\]\)"),
    (0, lambda t: t[:, :0], r"q: expected shape \[16, 5, 11\], got \[16, 0, 11\] \(an ensemble of E members: "
                            r"\[16, E \* 5, 11\]\)"),
    (1, lambda t: t[:, :5], r"q_next_online: expected shape \[16, 10, 11\], got \[16, 5, 11\]"),
    (12, lambda t: t[:, :1], r"masks: expected shape \[16, 2\], got \[16, 1\]"),
    (12, lambda t: t[:8], r"masks: expected shape \[16, 2\], got \[8, 2\]"),
    (12, lambda t: t[:, 0], r"masks: expected shape \[16, 2\], got \[16\]"),
    (12, lambda t: t.double(), "masks: expected dtype Float, got Double"),
    (12, lambda t: t.bool(), "masks: expected dtype Float, got Bool"),
    (12, lambda t: torch.ones(2, 16).t(), "masks: expected a contiguous tensor"),
]


@pytest.mark.parametrize("index,change,match", BAD)
def test_bad_input(index, change, match):
    args = _bad_args()
    args[index] = change(args[index])
    with pytest.raises(RuntimeError, match="dqn_ops.dqn_loss: " + match):
        LOSS_OP(*args)


def test_loss_on_logits_masks_follow_the_layouts_members():
    c, online, target, b = _logits_inputs("c51", B=8)
    p, tp, layout = online.flat_params.detach(), target.flat_params.detach(), online._layout_ints
    f = ops._online_and_target_logits(b["state_pairs"], p, online.params_bf16, tp, target.params_bf16, layout, False)
    args = (f.logits[:8], f.logits[8:], f.logits_next_target, p, tp, b["actions"], b["rewards"], b["dones"], None,
            layout, V_MIN, V_MAX, GAMMA, "c51")
    with pytest.raises(RuntimeError, match=r"dqn_ops._dqn_loss_on_logits: masks: expected shape \[8, 1\], got \[8, 2\]"):
        ops._dqn_loss_on_logits(*args, torch.ones(8, 2))


@requires_cuda
def test_masks_on_another_device():
    args = _bad_args()
    args[12] = args[12].cuda()
    with pytest.raises(RuntimeError, match="dqn_ops.dqn_loss: masks: expected a tensor on cpu, got one on cuda"):
        LOSS_OP(*args)


# ----------------------------------------------------------------------------------------
# act with ucb

ACT_CONFIG = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=11, branches=(3, 4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("atoms,loss_type", [(11, "c51"), (7, "qr"), (1, "mse")])
def test_ucb_changes_nothing_for_one_member(device, atoms, loss_type):
    c = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=atoms, branches=(3, 4))
    net = DuelingBranchQNet(c, generator=torch.Generator().manual_seed(4)).to(device)
    s = torch.randn(33, c.state_dim, device=device)
    eps = torch.full((1,), 0.2, device=device)
    want = ops.act(s, net.flat_params.detach(), net.params_bf16, net._layout_ints, V_MIN, V_MAX, eps,
                   torch.tensor([9, 4], device=device), loss_type)
    for ucb in (0.0, 2.5, -1.0, 1e30):
        got = ops.act(s, net.flat_params.detach(), net.params_bf16, net._layout_ints, V_MIN, V_MAX, eps,
                      torch.tensor([9, 4], device=device), loss_type, ucb)
        same_bits(got.actions, want.actions, f"actions, ucb {ucb}")
        same_bits(got.greedy_q, want.greedy_q, f"greedy_q, ucb {ucb}")


@pytest.mark.parametrize("ucb", [float("nan"), float("inf"), -float("inf")])
def test_ucb_must_be_finite(ucb):
    net = DuelingBranchQNet(ACT_CONFIG, generator=torch.Generator().manual_seed(4))
    args = (torch.randn(3, 6), net.flat_params.detach(), net.params_bf16, net._layout_ints, V_MIN, V_MAX,
            torch.zeros(1), torch.tensor([1, 0]), "c51", ucb)
    match = r"dqn_ops.act: ucb: expected a finite value \(either sign\), got " + ("nan" if math.isnan(ucb) else "-?inf")
    with pytest.raises(RuntimeError, match=match):
        ACT_OP(*args)
    with FakeTensorMode():
        fake = [torch.empty(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(RuntimeError, match=match):
            ACT_OP(*fake)


@pytest.mark.parametrize("device", DEVICES)
def test_ucb_flips_the_choice_by_hand(device):
    """Two members, one branch of two actions, plain Q-values set by the output biases (every
    weight 0): member 0 Q = [1, 0], member 1 Q = [1, 1.5]: means [1, 0.75], population stds
    [0, 0.75]. ucb 0 takes action 0 (mean 1); ucb 0.5 scores [1, 1.125]: action 1, greedy_q its
    mean 0.75; ucb -1 scores [1, 0]: action 0."""
    c = DQNConfig(state_dim=3, trunk_hidden=(4,), value_hidden=None, adv_hidden=(), atoms=1, branches=(2,),
                  dueling=False, ensemble=2)
    net = DuelingBranchQNet(c)
    with torch.no_grad():
        net.flat_params.zero_()
        views = net.layer_views()
        views["e0.q1.0.bias"].copy_(torch.tensor([1.0, 0.0]))
        views["e1.q1.0.bias"].copy_(torch.tensor([1.0, 1.5]))
    net.refresh_mirror()
    net = net.to(device)
    s = torch.randn(4, 3, device=device)
    for ucb, action, greedy_q in ((0.0, 0, 1.0), (0.5, 1, 0.75), (-1.0, 0, 1.0), (1e-3, 0, 1.0)):
        out = ops.act(s, net.flat_params.detach(), net.params_bf16, net._layout_ints, V_MIN, V_MAX,
                      torch.zeros(1, device=device), torch.tensor([1, 0], device=device), "mse", ucb)
        assert (out.actions == action).all(), (ucb, out.actions)
        assert (out.greedy_q == greedy_q).all(), (ucb, out.greedy_q)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type,atoms", [("c51", 11), ("qr", 7), ("c51", 51)])
@pytest.mark.parametrize("dueling", [True, False], ids=["dueling", "q"])
def test_ensemble_act_scores_against_float64(device, loss_type, atoms, dueling):
    """Per branch the first argmax of mean_e Q_e + ucb std_e Q_e over bf16_dueling_forward's
    q_logits [N, E * A, atoms], greedy_q the chosen action's mean (the CUDA kernel scores in F32:
    at most a near-tie in a thousand rows may break the other way there)."""
    E, N = 3, 1000 if device == "cuda" else 40
    c = DQNConfig(state_dim=6, trunk_hidden=(16,), value_hidden=8 if dueling else None, adv_hidden=8, atoms=atoms,
                  branches=(3, 4), dueling=dueling, ensemble=E)
    net = DuelingBranchQNet(c, generator=torch.Generator().manual_seed(2)).to(device)
    s = torch.randn(N, 6, device=device)
    q = ops.bf16_dueling_forward(s, net.flat_params.detach(), net.params_bf16, net._layout_ints).q_logits
    Q = expected_q(q.double().cpu().view(N, E, sum(c.branches), atoms), loss_type)           # [N, E, A]
    for ucb in (0.0, 0.7, -0.7):
        out = ops.act(s, net.flat_params.detach(), net.params_bf16, net._layout_ints, V_MIN, V_MAX,
                      torch.zeros(1, device=device), torch.tensor([1, 0], device=device), loss_type, ucb)
        actions, greedy_q = out.actions.cpu(), out.greedy_q.double().cpu()
        mean, std = Q.mean(1), Q.std(1, unbiased=False)
        score = mean + ucb * std
        off = 0
        for d, n in enumerate(c.branches):
            a = score[:, off:off + n].argmax(1)
            same = actions[:, d] == a
            assert same.all() if device == "cpu" else same.float().mean() >= 0.999, (ucb, d, same.float().mean())
            torch.testing.assert_close(greedy_q[same, d], mean[:, off:off + n].gather(1, a[:, None])[same, 0],
                                       rtol=1e-5, atol=1e-5)
            off += n
