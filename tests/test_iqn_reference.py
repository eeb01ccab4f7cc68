"""IQN's configuration and references (docs/iqn-design.md; the ops' IQN kernels are tested in
tests/test_iqn_network.py and tests/test_iqn_loss.py): DQNConfig's iqn_embedding and its errors;
ParamLayout's phi segments; the float64 references of tests/reference.py (reference_iqn_forward, reference_iqn_loss) checked
on hand-computed cases, against the plain network (phi = 1) and against the QR references at the
fixed fractions; the plain-PyTorch baseline (TorchQNet with phi, torch_dqn_loss 'iqn') against
those references, forward, loss and every parameter's gradient by autograd.

Tolerances: float64 against float64 runs the same formulas in another order: 1e-10 relative.
The F32 baseline's loss against float64 (inputs exact in both): the targets T_j and
u_ij = T_j - theta_i round to ~6e-8 relative on values of size ~20 and the loss sums N N'
positive terms (test_qr.py's reasoning): rtol 1e-4; the gradient with an absolute bar of 1e-5
of its largest element (an element can cancel to ~0).
"""
import dataclasses
import math

import pytest
import torch

from dqn_ops import DQNConfig, DuelingBranchQNet, ParamLayout
from dqn_ops.layout import ALIGN, LAYOUT_FORMAT
from dqn_ops.rl.baseline import TorchQNet, iqn_cosines, torch_dqn_loss
from reference import (ReferenceNet, assert_no_near_ties, branch_columns, layer_shapes, quantile_fractions,
                       reference_forward, reference_iqn_forward, reference_iqn_loss, reference_qr)
from test_ensemble_loss import GAMMA as ENSEMBLE_GAMMA
from test_ensemble_loss import reference as reference_ensemble

GAMMA = 0.97
V_MIN, V_MAX = -10.0, 10.0  # torch_dqn_loss takes them; 'qr' and 'iqn' do not use them


def iqn(c: DQNConfig, n: int = 8) -> DQNConfig:
    """The IQN version of a network: one atom and an embedding of n cosines."""
    return dataclasses.replace(c, atoms=1, iqn_embedding=n)


# CleanRL-style: CleanRL's c51 network (4 -> 120 -> 84, no head layer, no dueling, one branch)
# with IQN's embedding of the paper's 64 cosines.
CLEANRL_IQN = DQNConfig(state_dim=4, trunk_hidden=(120, 84), adv_hidden=(), atoms=1, branches=(2,), dueling=False,
                        iqn_embedding=64)
NETS = {
    "cleanrl": CLEANRL_IQN,
    "trunk1_head1": iqn(DQNConfig(state_dim=9, trunk_hidden=(24,), value_hidden=7, adv_hidden=5, branches=(3, 2)), 5),
    "trunk3_head2": iqn(DQNConfig(state_dim=10, trunk_hidden=(32, 24, 16), value_hidden=(12, 6), adv_hidden=(8, 5),
                                  branches=(2, 4, 3)), 16),
    # n = 1, the degenerate case: its one cosine is cos(0) = 1, so phi is the same at every fraction
    "head0_no_dueling": iqn(DQNConfig(state_dim=8, trunk_hidden=(20, 16), adv_hidden=(), branches=(3, 3, 1),
                                      dueling=False), 1),
    "ensemble3_dueling_h1": iqn(DQNConfig(state_dim=6, trunk_hidden=(12, 10), value_hidden=7, adv_hidden=6,
                                          branches=(2, 3), ensemble=3), 12),
    "ensemble2_q_h2": iqn(DQNConfig(state_dim=6, trunk_hidden=(12, 10), adv_hidden=(6, 5), branches=(2, 3),
                                    dueling=False, ensemble=2), 7),
}


def layers_of(module) -> dict:
    """{name: (weight, bias)} of a TorchQNet / ReferenceNet (the references' argument)."""
    return {name: (module.get_submodule(name).weight, module.get_submodule(name).bias)
            for name in layer_shapes(module.config)}


def seeded_net(c: DQNConfig, seed: int, dtype=torch.float64) -> TorchQNet:
    torch.manual_seed(seed)
    return TorchQNet(c).to(dtype)


def fractions(B, N, seed, dtype=torch.float64):
    return torch.rand(B, N, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------------------
# DQNConfig.iqn_embedding

def test_config_iqn_field_and_errors():
    assert DQNConfig().iqn_embedding == 0 and not DQNConfig().iqn
    c = DQNConfig(atoms=1, iqn_embedding=64)
    assert c.iqn and c.iqn_embedding == 64 and c.atoms == 1
    assert DQNConfig(atoms=1, iqn_embedding=1).iqn
    for bad in (-1, -64):
        with pytest.raises(ValueError, match=rf"^DQNConfig: iqn_embedding must be >= 0 \(an int\), got {bad}$"):
            DQNConfig(atoms=1, iqn_embedding=bad)
    for bad, shown in ((64.0, r"64\.0 \(float\)"), (True, r"True \(bool\)"), ("64", r"'64' \(str\)"), (None, "None")):
        with pytest.raises(TypeError, match=rf"^DQNConfig: iqn_embedding must be an int >= 0, got {shown}"):
            DQNConfig(atoms=1, iqn_embedding=bad)
    for atoms in (51, 2):
        with pytest.raises(ValueError, match=rf"^DQNConfig: atoms must be 1 with iqn_embedding=64 \(an IQN network "
                                             rf"gives one value per action at each quantile fraction it is given\), "
                                             rf"got {atoms}$"):
            DQNConfig(atoms=atoms, iqn_embedding=64)
    # any number of atoms without IQN, as before
    assert DQNConfig(atoms=51, iqn_embedding=0).atoms == 51


# ----------------------------------------------------------------------------------------
# ParamLayout: phi right after the trunk

def test_layout_of_cleanrl_iqn_written_out():
    """The offsets by hand. The buffer stores the trunk widths 120 and 88 (84 rounded up to 8;
    DQNConfig.aligned), so phi is 88 wide too and q1.0 reads rows of 88: W_s1 [120, 4] at 0 (480),
    W_s2 [88, 120] at 480 (10560), W_phi [88, 64] at 11040 (5632), q1.0's weight [2, 88] at 16672
    (8 rows reserved: 704), then the biases b_s1 (120) at 17376, b_s2 (88) at 17496, b_phi (88) at
    17584, b_out (2 -> 8) at 17672; 17680 in all. The views keep the config's shapes at those
    offsets: s2.weight [84, 120], phi.weight [84, 64], q1.0.weight [2, 84] with row stride 88."""
    layout = ParamLayout(CLEANRL_IQN)
    assert list(layout.segments) == ["W_s1", "W_s2", "W_phi", "W_out0", "b_s1", "b_s2", "b_phi", "b_out"]
    assert layout.segments["W_s1"] == (0, (120, 4)) and layout.segments["W_s2"] == (480, (88, 120))
    assert layout.segments["W_phi"] == (11040, (88, 64)) and layout.segments["W_out0"] == (16672, (2, 88))
    assert layout.segments["b_s1"] == (17376, (120,)) and layout.segments["b_s2"] == (17496, (88,))
    assert layout.segments["b_phi"] == (17584, (88,)) and layout.segments["b_out"] == (17672, (2,))
    assert layout.numel == 17680
    assert [(n, s, o) for n, s, o in layout.tensors if n.startswith("phi")] == [("phi.weight", (84, 64), 11040),
                                                                               ("phi.bias", (84,), 17584)]
    assert layout.row_strides == {"s1.weight": 4, "s2.weight": 120, "phi.weight": 64, "q1.0.weight": 88}
    assert [n for n, _ in layout.layers()] == ["s1", "s2", "phi", "q1.0"]
    assert CLEANRL_IQN.num_parameters == 480 + 120 + 84 * 120 + 84 + 84 * 64 + 84 + 2 * 84 + 2


@pytest.mark.parametrize("name", list(NETS))
def test_phi_shifts_only_the_segments_after_it(name):
    """The IQN layout is the plain network's (one atom) with W_phi inserted after the trunk's
    weights and b_phi after the trunk's biases: every other segment keeps its shape and moves
    by the aligned size of what was inserted before it; every view keeps its name and shape.
    The segments are the stored network's: phi has the trunk's stored width T rounded up to 8."""
    c = NETS[name]
    plain, net = ParamLayout(dataclasses.replace(c, iqn_embedding=0)), ParamLayout(c)
    T, n, L = c.trunk_hidden[-1], c.iqn_embedding, len(c.trunk_hidden)
    T_stored = -(-T // ALIGN) * ALIGN
    w_phi, b_phi = -(-T_stored * n // ALIGN) * ALIGN, T_stored  # their aligned sizes
    order = list(net.segments)
    assert order.index("W_phi") == L and order.index("b_phi") == order.index(f"b_s{L}") + 1
    assert [seg for seg in order if seg not in ("W_phi", "b_phi")] == list(plain.segments)
    last_trunk_off, (rows, cols) = plain.segments[f"W_s{L}"]
    assert net.segments["W_phi"] == (last_trunk_off + -(-rows * cols // ALIGN) * ALIGN, (T_stored, n))
    for seg, (off, shape) in plain.segments.items():
        shift = (w_phi if order.index(seg) > order.index("W_phi") else 0) + \
                (b_phi if order.index(seg) > order.index("b_phi") else 0)
        assert net.segments[seg] == (off + shift, shape), seg
    assert net.numel == plain.numel + w_phi + b_phi
    views = {v[0]: v[1] for v in net.tensors}
    assert views.pop("phi.weight") == (T, n) and views.pop("phi.bias") == (T,)
    assert views == {v[0]: v[1] for v in plain.tensors}
    assert c.num_parameters == plain.config.num_parameters + T * n + T


def test_the_plain_network_keeps_its_offsets_in_format_4():
    """Format 4 adds the embedding size (0 without IQN) after E: every offset and the length of
    a network without IQN are format 3's, and the kernels run it as before."""
    plain = dataclasses.replace(CLEANRL_IQN, iqn_embedding=0)
    enc = ParamLayout(plain).encode()
    assert enc[0] == LAYOUT_FORMAT == 4 and enc[5] == 0
    net = DuelingBranchQNet(plain, generator=torch.Generator().manual_seed(0)).double()
    s = torch.randn(5, 4, dtype=torch.float64)
    state = net.state_dict()
    layers = {name: (state[f"{name}.weight"], state[f"{name}.bias"]) for name in layer_shapes(plain)}
    torch.testing.assert_close(net(s), reference_forward(plain, layers, s)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(NETS))
def test_torch_qnet_and_reference_net_carry_the_layouts_names(name):
    c = NETS[name]
    names = [n for n, _, _ in ParamLayout(c).tensors]
    for module in (TorchQNet(c), ReferenceNet(c)):
        sd = module.state_dict()
        assert sorted(sd) == sorted(names)
        assert sd["phi.weight"].shape == (c.trunk_hidden[-1], c.iqn_embedding)
    # registered right after the trunk, as ParamLayout orders the layers (from_torch by order)
    keys = list(TorchQNet(c).state_dict())
    L = len(c.trunk_hidden)
    assert keys[2 * L:2 * L + 2] == ["phi.weight", "phi.bias"]


# ----------------------------------------------------------------------------------------
# reference_iqn_forward

def test_reference_iqn_forward_on_a_hand_computed_network():
    """state 1 -> trunk 2 -> phi (n = 3 cosines) -> one Q head of 2 actions, no dueling:
    h = relu(W_s s + b_s); c = (1, cos(pi tau), cos(2 pi tau)); phi = relu(W_phi c + b_phi);
    q(tau) = W_q (h * phi) + b_q; tau = 1/3 gives c = (1, 1/2, -1/2), tau = 1/2 gives (1, 0, -1)."""
    c = DQNConfig(state_dim=1, trunk_hidden=(2,), adv_hidden=(), atoms=1, branches=(2,), dueling=False,
                  iqn_embedding=3)
    t = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    layers = {"s1": (t([1.0], [-0.5]), t(0.5, 2.0)),                     # s = 2: h = (2.5, 1)
              "phi": (t([-0.5, 2.0, 0.0], [0.0, 1.0, -4.0]), t(0.0, 1.0)),  # rows of W_phi [2, 3]
              "q1.0": (t([1.0, 3.0], [-2.0, 1.0]), t(0.25, -0.5))}
    s, tau = t([2.0]), t([1 / 3, 1 / 2])
    q, head, acts = reference_iqn_forward(c, layers, s, tau)
    h = [2.5, 1.0]
    expected = []
    for cos in ([1.0, 0.5, -0.5], [1.0, 0.0, -1.0]):
        # phi = (0.5, 3.5) at tau = 1/3, (0 [ReLU of -0.5], 5) at tau = 1/2
        phi = [max(0.0, -0.5 * cos[0] + 2.0 * cos[1]), max(0.0, 1.0 * cos[1] - 4.0 * cos[2] + 1.0)]
        z = [h[0] * phi[0], h[1] * phi[1]]
        expected.append([1.0 * z[0] + 3.0 * z[1] + 0.25, -2.0 * z[0] + 1.0 * z[1] - 0.5])
    assert expected == [[1.25 + 10.5 + 0.25, -2.5 + 3.5 - 0.5], [15.25, 4.5]]
    expected = torch.tensor(expected, dtype=torch.float64)              # [fraction, action]
    assert q.shape == (1, 2, 2) and head.shape == (2, 2)
    torch.testing.assert_close(q[0].T, expected, rtol=1e-12, atol=1e-12)  # slot i = fraction i
    torch.testing.assert_close(head, expected, rtol=1e-12, atol=1e-12)    # row (b, i) = b * N + i
    torch.testing.assert_close(acts[2], t([1.0, 0.5, -0.5], [1.0, 0.0, -1.0]), rtol=0, atol=1e-15)  # the cosines


@pytest.mark.parametrize("name", list(NETS))
def test_reference_iqn_forward_with_phi_one_is_the_plain_network_at_every_fraction(name):
    """W_phi = 0, b_phi = 1: phi = 1 and z = h, so every slot of q is the plain network's Q
    (tests/reference.py's reference_forward, one atom) and the fractions change nothing."""
    c = NETS[name]
    ref = ReferenceNet(c).double()
    with torch.no_grad():
        ref.phi.weight.zero_()
        ref.phi.bias.fill_(1.0)
    B, N = 6, 5
    s = torch.randn(B, c.state_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q, head, acts = reference_iqn_forward(c, layers_of(ref), s, fractions(B, N, 2))
    plain = dataclasses.replace(c, iqn_embedding=0)
    layers = {k: v for k, v in layers_of(ref).items() if k != "phi"}
    q_plain, head_plain, _ = reference_forward(plain, layers, s)
    assert q.shape == (B, c.q_rows, N) and head.shape == (B * N, c.head_out)
    for i in range(N):
        torch.testing.assert_close(q[:, :, i], q_plain[:, :, 0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(head[i::N], head_plain, rtol=1e-12, atol=1e-12)
    L = len(c.trunk_hidden)
    assert [a.shape[0] for a in acts] == [B] * (L + 1) + [B * N] * (3 + c.head_depth)


# ----------------------------------------------------------------------------------------
# The plain-PyTorch network (TorchQNet) against the reference

def test_iqn_cosines():
    tau = torch.tensor([[0.0, 0.25], [0.5, 0.75]], dtype=torch.float64)
    got = iqn_cosines(tau, 4)
    assert got.shape == (2, 2, 4)
    expected = [[math.cos(math.pi * k * t) for k in range(4)] for t in (0.0, 0.25, 0.5, 0.75)]
    torch.testing.assert_close(got.reshape(4, 4), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", list(NETS))
def test_torch_qnet_matches_the_float64_reference(name):
    """Forward in float64: TorchQNet and reference_iqn_forward on the same weights; a row of q
    at slot i is the network on that sample alone at that fraction alone (the (b, i) order)."""
    c = NETS[name]
    net = seeded_net(c, 3)
    B, N = 7, 4
    s = torch.randn(B, c.state_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    tau = fractions(B, N, 5)
    q, head = net(s, tau)
    q_ref, head_ref, _ = reference_iqn_forward(c, layers_of(net), s, tau)
    assert q.shape == (B, c.q_rows, N) and head.shape == (B * N, c.head_out)
    torch.testing.assert_close(q, q_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(head, head_ref, rtol=1e-10, atol=1e-12)
    for b, i in ((0, 0), (3, 2), (B - 1, N - 1)):
        alone, _ = net(s[b:b + 1], tau[b:b + 1, i:i + 1])
        torch.testing.assert_close(alone[0, :, 0], q[b, :, i], rtol=1e-12, atol=1e-12)
    # permuted fractions permute the slots; other fractions give other values, except with one
    # cosine: cos(0 pi tau) = 1 makes phi, and so q, the same at every fraction
    torch.testing.assert_close(net(s, tau.flip(1))[0], q.flip(2), rtol=1e-12, atol=1e-12)
    change = (net(s, fractions(B, N, 99))[0] - q).abs().max()
    assert change > 1e-3 if c.iqn_embedding > 1 else change == 0


def test_torch_qnet_fraction_errors():
    net, plain = TorchQNet(CLEANRL_IQN), TorchQNet(dataclasses.replace(CLEANRL_IQN, iqn_embedding=0))
    s = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"^TorchQNet: an IQN network \(iqn_embedding > 0\) takes the fractions tau "
                                         r"\[B, N\], any other none; this one has iqn_embedding=64 and was not given "
                                         r"tau$"):
        net(s)
    with pytest.raises(ValueError, match=r"this one has iqn_embedding=0 and was given tau$"):
        plain(s, torch.rand(3, 2))
    for bad, shown in ((torch.rand(3), r"\[3\]"), (torch.rand(2, 5), r"\[2, 5\]"),
                       (torch.rand(3, 2, 1), r"\[3, 2, 1\]")):
        with pytest.raises(ValueError, match=rf"^TorchQNet: tau must be \[B, N\] with B = 3 \(the states' rows\), got "
                                             rf"{shown}$"):
            net(s, bad)


# ----------------------------------------------------------------------------------------
# reference_iqn_loss

def test_reference_iqn_loss_on_a_hand_computed_sample():
    """One sample, one branch of 2 actions; N = 2 online fractions (1/8, 5/8), K = 3 next-state
    online values, N' = 1 target value: the paper's sum over (i, j) term by term (u on both sides
    of 0 and of kappa = 1)."""
    q = torch.tensor([[[0.0, 0.0], [1.0, 3.0]]])           # action 1 taken: theta = (1, 3) at tau = (1/8, 5/8)
    qo = torch.tensor([[[0.3, 0.3, 0.3], [0.0, 0.9, 0.3]]])  # means 0.3 and 0.4: a* = 1
    qt = torch.tensor([[[9.0], [2.5]]])
    r, done, gamma = torch.tensor([0.5]), torch.tensor([0.0]), 0.5
    actions, tau = torch.tensor([[1]]), torch.tensor([[0.125, 0.625]])
    T = 0.5 + gamma * 2.5                                    # 1.75: the target of a* = 1
    expected, grads = 0.0, [0.0, 0.0]
    for i, (theta, t) in enumerate(zip([1.0, 3.0], [0.125, 0.625])):
        u = T - theta                                        # 0.75 (i = 0), -1.25 (i = 1)
        w = abs(t - (1.0 if T < theta else 0.0))
        h = 0.5 * u * u if abs(u) <= 1 else abs(u) - 0.5
        expected += w * h / 1                                # sum_i (1/N') sum_j, N' = 1
        grads[i] = -w * max(-1.0, min(1.0, u))
    loss, grad, td, mean_q = reference_iqn_loss(q, qo, qt, actions, r, done, (2,), gamma, tau)
    assert loss.item() == pytest.approx(expected, rel=1e-12) and td.tolist() == pytest.approx([expected], rel=1e-12)
    assert expected == 0.125 * 0.28125 + 0.375 * 0.75
    assert mean_q.item() == pytest.approx(2.0, rel=1e-12)
    assert grad[0, 1].tolist() == pytest.approx(grads, rel=1e-12) and (grad[0, 0] == 0).all()
    # other fractions weigh the same errors differently
    other, _, _, _ = reference_iqn_loss(q, qo, qt, actions, r, done, (2,), gamma, torch.tensor([[0.875, 0.25]]))
    assert other.item() == pytest.approx(0.875 * 0.28125 + 0.75 * 0.75, rel=1e-12)


def iqn_batch(B, width, N, K, N2, branches, seed=0):
    """q [B, width, N], q_next_online [B, width, K], q_next_target [B, width, N'] ~ N(0, 2^2);
    actions; rewards: a third N(0, 0.5^2), the rest uniform on [-15, 15]; dones 20 %; weights in
    [0.5, 1.5); fractions [B, N] uniform on [0, 1)."""
    g = torch.Generator().manual_seed(1000 * seed + 31 * B + N)
    q, qo, qt = (torch.randn(B, width, n, generator=g) * 2 for n in (N, K, N2))
    actions = torch.stack([torch.randint(0, n, (B,), generator=g) for n in branches], 1)
    small = torch.rand(B, generator=g) < 1 / 3
    rewards = torch.where(small, torch.randn(B, generator=g) * 0.5, (torch.rand(B, generator=g) * 2 - 1) * 15)
    dones = (torch.rand(B, generator=g) < 0.2).float()
    weights = torch.rand(B, generator=g) + 0.5
    tau = torch.rand(B, N, generator=g)
    return q, separate_near_ties(qo, branches), qt, actions, rewards, dones, weights, tau


def separate_near_ties(qo, branches, gap=1e-3):
    """qo with each (sample, member, branch)'s best mean raised by `gap` (every value of that
    action): with many samples two actions' means of randn values come within 1e-6 of each other,
    and F32 and float64 would then pick different next actions."""
    qo = qo.clone()
    rows = torch.arange(qo.shape[0])
    for first, n in branch_columns(qo.shape[1], branches):
        if n > 1:
            best = qo[:, first:first + n].double().mean(-1).argmax(1)
            qo[rows, first + best] += gap
    return qo


@pytest.mark.parametrize("branches", [(3, 3, 3), (2,), (4, 1, 6)], ids=lambda b: "x".join(map(str, b)))
@pytest.mark.parametrize("N", [1, 7, 51])
def test_reference_iqn_loss_at_the_midpoints_is_reference_qr(branches, N):
    """QR-DQN is IQN at tau_bi = (2i + 1) / 2N with N = N' = K: the two references, written
    apart, agree to float64 rounding (loss, gradient, TD error, mean Q), with and without weights."""
    B = 24
    q, qo, qt, actions, rewards, dones, weights, _ = iqn_batch(B, sum(branches), N, N, N, branches, seed=1)
    tau = quantile_fractions(N).expand(B, N)
    for w in (None, weights):
        got = reference_iqn_loss(q, qo, qt, actions, rewards, dones, branches, GAMMA, tau, w)
        want = reference_qr(q, qo, qt, actions, rewards, dones, branches, GAMMA, w)
        for name, a, b in zip(("loss", "grad_q", "td", "mean_q"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
    assert got[1].abs().sum() > 0


@pytest.mark.parametrize("E", [2, 3])
def test_reference_iqn_loss_of_an_ensemble_at_the_midpoints_is_the_ensemble_qr_reference(E):
    """Members and bootstrap masks: at the midpoints, test_ensemble_loss.py's QR reference."""
    branches, N, B = (3, 2), 7, 16
    q, qo, qt, actions, rewards, dones, weights, _ = iqn_batch(B, E * sum(branches), N, N, N, branches, seed=2)
    masks = (torch.rand(B, E, generator=torch.Generator().manual_seed(3)) < 0.5).float()
    masks[0], masks[1] = 0, 1
    tau = quantile_fractions(N).expand(B, N)
    got = reference_iqn_loss(q, qo, qt, actions, rewards, dones, branches, ENSEMBLE_GAMMA, tau, weights, masks)
    want = reference_ensemble(q, qo, qt, actions, rewards, dones, branches, "qr", weights, masks)
    for name, a, b in zip(("loss", "grad_q", "td", "mean_q"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------------------
# torch_dqn_loss 'iqn' against the reference

@pytest.mark.parametrize("E,masked", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("N,K,N2", [(8, 8, 8), (5, 9, 3), (1, 4, 6)])
def test_torch_baseline_iqn_loss_matches_reference(N, K, N2, E, masked):
    """torch_dqn_loss(loss_type='iqn'): in float64 the reference to float64 rounding, gradient by
    autograd of each; in F32 within the F32 tolerances (module docstring)."""
    branches, B = (3, 1, 4), 32
    q, qo, qt, actions, rewards, dones, weights, tau = iqn_batch(B, E * sum(branches), N, K, N2, branches,
                                                                 seed=10 * N + K)
    assert_no_near_ties(qo, branches)
    masks = (torch.rand(B, E, generator=torch.Generator().manual_seed(N2)) < 0.5).float() if masked else None
    ref = reference_iqn_loss(q, qo, qt, actions, rewards, dones, branches, GAMMA, tau, weights, masks)
    for dtype in (torch.float64, torch.float32):
        x = q.to(dtype).requires_grad_()
        loss, td, mean_q = torch_dqn_loss(x, qo.to(dtype), qt.to(dtype), actions, rewards.to(dtype), dones.to(dtype),
                                          branches, V_MIN, V_MAX, GAMMA, loss_type="iqn", weights=weights.to(dtype),
                                          masks=None if masks is None else masks.to(dtype), fractions=tau.to(dtype))
        loss.backward()
        rtol, atol = (1e-10, 1e-12) if dtype == torch.float64 else (1e-4, 1e-7)
        torch.testing.assert_close(loss.detach().double(), ref[0], rtol=rtol, atol=atol)
        torch.testing.assert_close(td.double(), ref[2], rtol=rtol, atol=atol)
        torch.testing.assert_close(mean_q.double(), ref[3], rtol=max(rtol, 1e-6), atol=atol)
        torch.testing.assert_close(x.grad.double(), ref[1], rtol=rtol,
                                   atol=max(atol, (0 if dtype == torch.float64 else 1e-5) * ref[1].abs().max().item()))
    assert ref[1].abs().max() > 0


def test_torch_baseline_iqn_loss_argument_errors():
    branches = (2, 3)
    q, qo, qt, actions, rewards, dones, weights, tau = iqn_batch(4, 5, 3, 3, 3, branches)
    args = (q, qo, qt, actions, rewards, dones, branches, V_MIN, V_MAX, GAMMA)
    with pytest.raises(ValueError, match=r"^torch_dqn_loss: loss_type 'iqn' takes the fractions of q \[B, N\], any "
                                         r"other none; got loss_type 'iqn' and fractions None$"):
        torch_dqn_loss(*args, loss_type="iqn")
    with pytest.raises(ValueError, match=r"got loss_type 'qr' and fractions given$"):
        torch_dqn_loss(*args, loss_type="qr", fractions=tau)
    with pytest.raises(ValueError, match=r"^torch_dqn_loss: fractions must be \[B, N\] = \[4, 3\] \(q's samples and "
                                         r"slots\), got \[4, 2\]$"):
        torch_dqn_loss(*args, loss_type="iqn", fractions=tau[:, :2])


# ----------------------------------------------------------------------------------------
# The whole baseline (TorchQNet forwards + torch_dqn_loss) against the references

@pytest.mark.parametrize("name", ["cleanrl", "trunk3_head2", "ensemble3_dueling_h1"])
def test_torch_baseline_step_gradients_match_the_float64_references(name):
    """The IQN loss of an online and a target TorchQNet in float64 (online on s at tau [B, N],
    online on s' at K fixed midpoints, target on s' at tau' [B, N']): loss, TD error and every
    parameter's gradient equal those of reference_iqn_forward + reference_iqn_loss, the
    reference's parameter gradients by autograd through reference_iqn_forward."""
    c = NETS[name]
    online, target = seeded_net(c, 6), seeded_net(c, 7)
    B, N, K, N2 = 12, 6, 5, 4
    g = torch.Generator().manual_seed(8)
    s, s2 = (torch.randn(B, c.state_dim, generator=g, dtype=torch.float64) for _ in range(2))
    actions = torch.stack([torch.randint(0, n, (B,), generator=g) for n in c.branches], 1)
    rewards = torch.randn(B, generator=g, dtype=torch.float64) * 3
    dones = (torch.rand(B, generator=g) < 0.25).double()
    tau, tau2 = fractions(B, N, 9), fractions(B, N2, 10)
    tau_hat = ((2 * torch.arange(K, dtype=torch.float64) + 1) / (2 * K)).expand(B, K)

    with torch.no_grad():
        qo, qt = online(s2, tau_hat)[0], target(s2, tau2)[0]
    q = online(s, tau)[0]
    loss, td, mean_q = torch_dqn_loss(q, qo, qt, actions, rewards, dones, c.branches, V_MIN, V_MAX, GAMMA,
                                      loss_type="iqn", fractions=tau)
    loss.backward()

    ref_layers = {k: (w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_())
                  for k, (w, b) in layers_of(online).items()}
    q_ref, _, _ = reference_iqn_forward(c, ref_layers, s, tau)
    qo_ref = reference_iqn_forward(c, ref_layers, s2, tau_hat)[0].detach()
    qt_ref = reference_iqn_forward(c, layers_of(target), s2, tau2)[0].detach()
    r_loss, r_grad_q, r_td, r_mean_q = reference_iqn_loss(q_ref, qo_ref, qt_ref, actions, rewards, dones, c.branches,
                                                          GAMMA, tau)
    q_ref.backward(r_grad_q)
    torch.testing.assert_close(loss.detach(), r_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(td, r_td, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mean_q, r_mean_q, rtol=1e-10, atol=1e-12)
    for layer, (w, b) in ref_layers.items():
        mod = online.get_submodule(layer)
        for got, want, what in ((mod.weight.grad, w.grad, "weight"), (mod.bias.grad, b.grad, "bias")):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{layer}.{what}: {m}")
    assert online.phi.weight.grad.abs().max() > 0 and online.s1.weight.grad.abs().max() > 0
