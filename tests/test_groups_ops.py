"""Head groups through the ops (docs/combination-design.md): each group's layout
(``ParamLayout.encode(group=g)``, format 5) describes the trunk and that group's heads at their
offsets in the one buffer, so every op runs a group as the one-group network
``config.group_config(g)`` it is, and its gradient is zero on the other groups' parameters.

Checked on the CPU kernels: the views' encoding and its errors (Python's decode_config and
csrc/layout.h refuse the same broken views); each group's forward and gradient, BF16 path, bit
for bit the one-group network's on a buffer holding only that group; the whole network in
float64 against reference_groups_forward, and the gradient of a sum over the groups (autograd
adds the groups' trunk gradients) against autograd of the float64 reference, 1e-10 relative;
GroupsStep (the training step: per group its public ops' step, the weighted sums) on F32
networks against the references' step in float64; Trainer's step against GroupsStep, bit for bit.
"""
import copy

import pytest
import torch

from dqn_ops import DQNConfig, DuelingBranchQNet, HeadGroup, ParamLayout, Trainer, TrainerConfig, from_torch, ops
from dqn_ops.rl.baseline import TorchTrainer, torch_groups_loss
from dqn_ops.layout import GROUP_VIEW_FORMAT, LAYOUT_FORMAT, decode_config, group_prefix
from dqn_ops.step import GroupsStep, InternalOpsStep, PublicOpsStep, fused_loss_supported
from dqn_ops.trainer import greedy_actions, greedy_from_logits
from reference import layer_shapes, quantile_fractions, reference_groups_forward, rel_err
from conftest import DEVICES
from test_ensemble_trainer import reference_masks
from test_groups_reference import (GAMMA, LOSS_TYPES, NETS, V_MAX, V_MIN, assert_no_near_ties_per_group,
                                   group_fractions, group_masks, layers_of, leaf_layers, reference_step, seeded_net,
                                   step_inputs)
from step_check import same_bits, snapshot


def net_layers(net: DuelingBranchQNet) -> dict:
    """{layer name: (weight, bias)} views of a DuelingBranchQNet (the references' argument)."""
    views = net.layer_views()
    return {name: (views[f"{name}.weight"], views[f"{name}.bias"]) for name in layer_shapes(net.config)}


def group_network(net: DuelingBranchQNet, g: int) -> DuelingBranchQNet:
    """The one-group network config.group_config(g) with net's trunk and group g's head weights."""
    one = DuelingBranchQNet(net.config.group_config(g)).to(net.flat_params.device, net.flat_params.dtype)
    prefix, theirs = group_prefix(g), net.layer_views()
    with torch.no_grad():
        for name, view in one.layer_views().items():
            view.copy_(theirs[name if name.startswith("s") else prefix + name])
    one.refresh_mirror()
    return one


def group_segments(layout: ParamLayout, g: int) -> torch.Tensor:
    """A mask of the flat buffer: True on the trunk's and group g's views (a weight whose stored
    input width was rounded up is a strided view: layout.views places it)."""
    prefix = group_prefix(g)
    mask = torch.zeros(layout.numel, dtype=torch.bool)
    for name, view in layout.views(mask).items():
        is_aux = name[:1] == "g" and name.split(".", 1)[0][1:].isdigit()
        mine = name.startswith(prefix) if g else not is_aux
        if mine or name[:1] == "s":
            view.fill_(True)
    return mask


# ----------------------------------------------------------------------------------------
# The encoding

def test_each_group_encodes_as_its_one_group_network_in_the_whole_buffer():
    c = NETS["seed"]
    layout = ParamLayout(c)
    with pytest.raises(ValueError, match=r"^ParamLayout\.encode: a network with head groups \(DQNConfig\.aux: 2 "
                                         r"beside group 0\) has one layout per group: encode\(group=g\) for g in "
                                         r"range\(3\)"):
        layout.encode()
    with pytest.raises(ValueError, match=r"^ParamLayout\.encode: group must be < 3 \(the head groups\), got 3$"):
        layout.encode(group=3)
    for g in range(c.num_groups):
        view, alone = layout.encode(group=g), ParamLayout(c.group_config(g)).encode()
        assert view[0] == GROUP_VIEW_FORMAT and alone[0] == LAYOUT_FORMAT
        # the stored network's group: every hidden width rounded up to 8 (DQNConfig.aligned)
        assert decode_config(view) == c.group_config(g).aligned() == c.aligned().group_config(g)
        assert view[-1] == layout.numel > alone[-1]
        one_group = ParamLayout(c.group_config(g))
        n_sizes = len(alone) - len(one_group.segments) - 1
        assert view[1:n_sizes] == alone[1:n_sizes]  # the same sizes ...
        # ... and each segment's offset in the whole buffer: the trunk's (W_s*, b_s*) as they are,
        # the heads' under the group's prefix
        name_at = {offset: name for name, (offset, _) in one_group.segments.items()}
        whole = [layout.segments[name if name.startswith(("W_s", "b_s")) else group_prefix(g) + name][0]
                 for name in (name_at[offset] for offset in alone[n_sizes:-1])]
        assert view[n_sizes:-1] == whole
    one = ParamLayout(c.group_config(0))
    assert one.encode() == one.encode(group=0)


def broken_views(c: DQNConfig):
    """(what, layout): group 1's view with its output bias moved onto the trunk's first weight, off
    the alignment, past the buffer's end."""
    view = ParamLayout(c).encode(group=1)
    assert ParamLayout(c).segments["W_s1"][0] == 0
    overlap, misaligned, outside = list(view), list(view), list(view)
    # the output bias' offset is the entry before the buffer length; the trunk's first weight is at 0
    overlap[-2] = 0
    misaligned[-2] = view[-2] + 1
    outside[-2] = view[-1]
    return [("overlap", overlap), ("is not a non-negative multiple of 8", misaligned),
            ("lies outside the buffer", outside)]


@pytest.mark.parametrize("case", range(3), ids=["overlap", "misaligned", "outside"])
def test_broken_views_are_refused_by_python_and_the_kernels(case):
    c = NETS["seed"]
    what, layout = broken_views(c)[case]
    with pytest.raises(ValueError, match=what):
        decode_config(layout)
    net = DuelingBranchQNet(c)
    with pytest.raises(RuntimeError, match=what):
        torch.ops.dqn_ops.bf16_dueling_forward(torch.zeros(2, c.state_dim), net.flat_params.detach(),
                                               net.params_bf16, layout)


# ----------------------------------------------------------------------------------------
# Each group is its one-group network

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(NETS))
def test_each_groups_forward_and_gradient_are_its_one_group_networks_bits(name, device):
    """BF16 path (F32 params, BF16 mirror): group g's op on the whole buffer against the one-group
    network holding the same weights, the same bits; the gradient the same on the trunk and
    group g's parameters and zero on every other parameter."""
    c = NETS[name]
    torch.manual_seed(1)
    net = DuelingBranchQNet(c, backward_precision="bf16").to(device)
    s = torch.randn(5, c.state_dim, device=device)
    fractions = [None if f is None else f.float().to(device) for f in group_fractions(c, 5, 3, seed=2)]
    for g in range(c.num_groups):
        one = group_network(net, g)
        one.backward_precision = "bf16"
        q = net.forward(s, fractions[g], group=g)
        q_one = one(s, fractions[g])
        assert torch.equal(q, q_one)
        r = torch.randn(q.shape, device=device)
        (grad,) = torch.autograd.grad((q * r).sum(), net.flat_params)
        (grad_one,) = torch.autograd.grad((q_one * r).sum(), one.flat_params)
        mine = group_segments(net.layout, g).to(device)
        assert not grad[~mine].any(), "a gradient on another group's parameters"
        views, views_one, prefix = net.layer_views(grad), one.layer_views(grad_one), group_prefix(g)
        for k, v in views_one.items():
            assert torch.equal(views[k if k.startswith("s") else prefix + k], v), k


@pytest.mark.parametrize("name", list(NETS))
def test_float64_groups_and_their_summed_gradient_match_the_reference(name):
    """The whole network in float64 (nothing rounded): every group's q against
    reference_groups_forward, and the gradient of sum_g <q_g, r_g> (autograd adds the groups'
    trunk gradients) against autograd of the reference on the same weights."""
    c = NETS[name]
    torch.manual_seed(3)
    net = DuelingBranchQNet(c).double()
    s = torch.randn(6, c.state_dim, dtype=torch.float64)
    fractions = group_fractions(c, 6, 4, seed=4)
    outs = net.forward_groups(s, fractions)
    leaves = leaf_layers(net_layers(net))
    ref, _, _ = reference_groups_forward(c, leaves, s, fractions)
    total = total_ref = 0.0
    g_ = torch.Generator().manual_seed(5)
    for g, (out, (q_ref, _)) in enumerate(zip(outs, ref)):
        assert out.q_logits.shape == q_ref.shape
        assert rel_err(out.q_logits, q_ref) < 1e-10, g
        r = torch.randn(q_ref.shape, generator=g_, dtype=torch.float64)
        total = total + (out.q_logits * r).sum()
        total_ref = total_ref + (q_ref * r).sum()
    total.backward()
    total_ref.backward()
    grads = net.layer_views(net.flat_params.grad)
    for layer, (w, b) in leaves.items():
        assert rel_err(grads[f"{layer}.weight"], w.grad) < 1e-10, layer
        assert rel_err(grads[f"{layer}.bias"], b.grad) < 1e-10, layer


def test_forward_groups_and_group_argument_errors():
    c = NETS["seed"]
    net = DuelingBranchQNet(c)
    s = torch.randn(2, c.state_dim)
    with pytest.raises(ValueError, match=r"^DuelingBranchQNet\.forward_groups: fractions must have one entry per "
                                         r"head group \(3\), got 2$"):
        net.forward_groups(s, [None, None])
    for bad in (3, -1, True, 1.0):
        with pytest.raises(ValueError, match=r"^DuelingBranchQNet: group must be an int in \[0, 3\) \(the head "
                                             r"groups\), got "):
            net.forward(s, group=bad)
    with pytest.raises(RuntimeError, match="fractions"):  # group 1 is IQN's: the op asks for its fractions
        net.forward(s, group=1)
    # a network without aux groups has group 0 only
    plain = DuelingBranchQNet(c.group_config(0))
    assert torch.equal(plain(s), plain.forward(s, group=0))
    with pytest.raises(ValueError, match=r"group must be an int in \[0, 1\)"):
        plain.forward(s, group=1)


# ----------------------------------------------------------------------------------------
# The training step: GroupsStep against the float64 references

def f32_network(c: DQNConfig, module) -> DuelingBranchQNet:
    """A DuelingBranchQNet with module's weights, F32 params and an F32 mirror (the CPU kernels then
    round nothing to BF16)."""
    net = from_torch(module, c, backward_precision="fp32")
    net.params_bf16.data = torch.empty_like(net.flat_params.detach())
    net.refresh_mirror()
    return net


@pytest.mark.parametrize("name", list(NETS))
def test_groups_step_is_the_references_step(name):
    """GroupsStep on F32 networks with F32 mirrors against the references' step in float64 on
    the same weights (the inputs exact in F32): online at s (tau) and s' (the midpoints of each
    IQN group's N), target at s' (tau'), reference_groups_loss, autograd through the online
    forward. Loss, TD error and mean Q 1e-4 relative, every parameter's gradient 1e-4 relative
    (norm-wise): tests/test_groups_reference.py's F32 bars, the next actions checked clear of ties."""
    c, loss_types = NETS[name], LOSS_TYPES[name]
    online, target = seeded_net(c, 30, torch.float32), seeded_net(c, 31, torch.float32)
    B = 12
    s, s2, actions, rewards, dones, weights = step_inputs(c, B, 32)
    inputs = (s.float().double(), s2.float().double(), actions, rewards.float().double(), dones,
              weights.float().double())
    tau, tau2 = ([None if f is None else f.float().double() for f in fr]
                 for fr in (group_fractions(c, B, 5, 33), group_fractions(c, B, 3, 34)))
    tau_hat = [None if t is None else quantile_fractions(t.shape[1]).expand(B, -1) for t in tau]
    masks = group_masks(c, B, 35)
    layers = leaf_layers(layers_of(online))
    with torch.no_grad():
        assert_no_near_ties_per_group([q for q, _ in reference_groups_forward(c, layers, inputs[1], tau_hat)[0]],
                                      loss_types, c)
    loss, _, td, mean_q, _ = reference_step(c, loss_types, layers, layers_of(copy.deepcopy(target).double()), inputs,
                                            tau, tau_hat, tau2, masks)

    step = GroupsStep(f32_network(c, online), f32_network(c, target), loss_types=loss_types, v_min=V_MIN,
                      v_max=V_MAX, gamma=GAMMA, precision="fp32")
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    out = step(torch.cat([inputs[0], inputs[1]]).float(), actions, f32(inputs[3]), f32(dones), f32(inputs[5]),
               [f32(m) for m in masks], [None if t is None else (f32(t), f32(t2)) for t, t2 in zip(tau, tau2)])
    torch.testing.assert_close(out.loss.double(), loss, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.td_error.double(), td, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.mean_q.double(), mean_q, rtol=1e-4, atol=1e-6)
    grads = step.online.layer_views(out.grad)
    for layer, (w, b) in layers.items():
        for got, want, what in ((grads[f"{layer}.weight"], w.grad, "weight"), (grads[f"{layer}.bias"], b.grad, "bias")):
            if want.abs().max() == 0:  # a branch of one action under dueling, ReLUs dead on the batch
                assert got.abs().max() == 0, f"{layer}.{what}"
            else:
                assert rel_err(got.double(), want) < 1e-4, (layer, what, rel_err(got.double(), want))
    assert grads["s1.weight"].abs().max() > 0


def test_groups_step_argument_errors():
    c = NETS["seed"]
    net, tgt = DuelingBranchQNet(c), DuelingBranchQNet(c)
    with pytest.raises(ValueError, match=r"^GroupsStep: loss_types must have one entry per head group \(3\), got 2$"):
        GroupsStep(net, tgt, loss_types=("c51", "iqn"))
    with pytest.raises(ValueError, match=r"^GroupsStep: loss_types\[1\] must be 'iqn' \(group 1 is a 'iqn' group\), "
                                         r"got 'qr'$"):
        GroupsStep(net, tgt, loss_types=("c51", "qr", "c51"))
    step = GroupsStep(net, tgt, loss_types=("c51", "iqn", "c51"))
    B = 3
    batch = (torch.zeros(2 * B, c.state_dim), torch.zeros(B, 2, dtype=torch.long), torch.zeros(B), torch.zeros(B))
    with pytest.raises(ValueError, match=r"^GroupsStep: masks must have one entry per head group \(3\), got 1$"):
        step(*batch, None, [None])
    with pytest.raises(ValueError, match=r"an IQN network's step takes fractions \(tau, tau'\)"):
        step(*batch, None, None, None)  # group 1 is IQN's: its step needs (tau, tau')
    with pytest.raises(ValueError, match=r"^PublicOpsStep: group must be an int in \[0, 3\)"):
        PublicOpsStep(net, tgt, group=3)
    with pytest.raises(ValueError, match=r"^InternalOpsStep: networks with head groups run GroupsStep$"):
        InternalOpsStep(net, tgt)


# ----------------------------------------------------------------------------------------
# The Trainer

def trainer_batch(c: DQNConfig, B: int, seed: int, device="cpu") -> dict:
    g_ = torch.Generator().manual_seed(seed)
    s, s2 = torch.randn(B, c.state_dim, generator=g_), torch.randn(B, c.state_dim, generator=g_)
    return dict(states=s, next_states=s2, actions=torch.stack([torch.randint(0, n, (B,), generator=g_)
                                                               for n in c.branches], 1),
                rewards=(torch.rand(B, generator=g_) * 2 - 1) * 4, dones=(torch.rand(B, generator=g_) < 0.2).float(),
                weights=torch.rand(B, generator=g_) + 0.5, indices=torch.randint(0, 1000, (B,), generator=g_))


def on(device, batch: dict) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


# Two IQN groups and three ensembles (group 0's included): each group's own fractions and masks.
TWO_IQN = DQNConfig(state_dim=5, trunk_hidden=(10,), value_hidden=4, adv_hidden=4, atoms=1, branches=(2, 3), ensemble=2,
                    iqn_embedding=4, aux=(HeadGroup("iqn", members=2, iqn_embedding=3, adv_hidden=3),
                                          HeadGroup("c51", members=2, atoms=5, adv_hidden=())))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,bootstrap_p", [("seed", 0.5), ("iqn_main", 1.0), ("qr_main", 1.0), ("two_iqn", 0.5)])
def test_trainer_step_is_the_groups_step(name, bootstrap_p, device):
    """Trainer's step on a network of head groups is GroupsStep's on copies of its networks, bit
    for bit (on CUDA the trainer's step graphed, GroupsStep eager): each IQN group draws its own
    (tau, tau') from fraction_rng in group order, each ensemble group its own masks (the Philox
    draws keyed by the trainer's seed plus g * 2^32, from the Python reference); group 0's loss
    type is the trainer's, an aux group's its kind's first."""
    c = TWO_IQN if name == "two_iqn" else NETS[name]
    B = 6
    t = Trainer(c, TrainerConfig(batch_size=B, gamma=GAMMA, v_min=V_MIN, v_max=V_MAX, readback_interval=1,
                                 iqn_fractions=3, bootstrap_p=bootstrap_p), device=device, seed=2)
    assert t.group_loss_types == (t.loss_type,) + tuple(group.loss_types[0] for group in c.aux)
    assert not t.uses_fused_path and not t.batch_networks
    # the groups never take the fused loss on CUDA, even where group 0 alone would (C51, one member)
    assert fused_loss_supported(c.group_config(0), t.loss_type, torch.device("cuda")) or name != "seed"
    assert not fused_loss_supported(c, t.loss_type, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"^Trainer\.batch_networks: a network of head groups runs each group's "
                                         r"public-ops step, the two networks apart$"):
        t.batch_networks = True
    for i in range(5 if device == "cuda" else 1):  # on CUDA: the warm-up steps and the capture
        t.step(on(device, trainer_batch(c, B, 10 + i)))
    b = on(device, trainer_batch(c, B, 1))
    online, target = snapshot(t.online), snapshot(t.target)
    rng = t.fraction_rng.clone()
    fractions = [ops.iqn_fractions(rng, B, 3, 3) if c.group_config(g).iqn else None for g in range(c.num_groups)]
    seed = 2  # the trainer's
    masks = ([reference_masks(b["indices"].cpu(), seed + (g << 32), c.group_config(g).members, bootstrap_p).to(device)
              if c.group_config(g).members > 1 else None for g in range(c.num_groups)] if bootstrap_p < 1 else None)
    if name == "two_iqn":  # the draws differ between groups, so a mix-up would show
        assert not torch.equal(fractions[0].tau, fractions[1].tau)
        assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    t.step(b)
    assert t.graphed == (device == "cuda")
    want = GroupsStep(online, target, loss_types=t.group_loss_types, v_min=V_MIN, v_max=V_MAX, gamma=GAMMA,
                      precision=t.config.backward_precision)(
        torch.cat([b["states"], b["next_states"]]), b["actions"], b["rewards"], b["dones"], b["weights"], masks,
        fractions)
    same_bits(t.online.flat_params.grad, want.grad, "grad")
    same_bits(t.td_error, want.td_error, "td_error")
    t.readback()
    row = t.stats.rows[-1]
    assert row["loss"] == want.loss.item() and row["mean_q"] == want.mean_q.item()
    assert torch.equal(t.fraction_rng, rng)  # the step drew as many fractions as the copy


def test_trainer_acts_with_group_0():
    """Acting reads group 0's layout view: the greedy actions of group 0's one-group network."""
    c = NETS["seed"]
    t = Trainer(c, TrainerConfig(batch_size=4, v_min=V_MIN, v_max=V_MAX), device="cpu", seed=3)
    s = torch.randn(7, c.state_dim)
    one = group_network(t.online, 0)
    assert torch.equal(t.act(s), greedy_actions(one, s, V_MIN, V_MAX, t.loss_type))


@pytest.mark.parametrize("g", [0, 1, 2])
def test_opcheck_on_group_views(g):
    """The ops' schemas, fake kernels (decode_config reads the view) and autograd on each group's
    view of the seed's combination (group 1 is IQN's: at fractions), CPU; and act on group 0's."""
    c = NETS["seed"]
    torch.manual_seed(g)
    net = DuelingBranchQNet(c)
    p, p_lp, layout = net.flat_params.detach(), net.params_bf16, net._group_layouts[g]
    gc, B, N = c.group_config(g), 5, 3
    s = torch.randn(B, c.state_dim)
    tau = (torch.rand(B, N),) if gc.iqn else ()
    torch.library.opcheck(torch.ops.dqn_ops.bf16_dueling_forward.default,
                          (s, p.clone().requires_grad_(), p_lp, layout, "bf16", *tau))
    fwd = torch.ops.dqn_ops.bf16_dueling_forward.default(s, p, p_lp, layout, "bf16", *tau)
    gq = torch.randn(fwd[0].shape)
    for need in (False, True):
        torch.library.opcheck(torch.ops.dqn_ops.mixed_backward.default,
                              (gq, fwd[1].clone(), fwd[2], p, p_lp, layout, "tf32", need))
    if g == 0:
        torch.library.opcheck(torch.ops.dqn_ops.act.default,
                              (s, p, p_lp, layout, -10.0, 10.0, torch.zeros(1), torch.tensor([1, 0])))


def test_torch_trainer_trains_head_groups():
    """TorchTrainer (the plain-PyTorch baseline) on a network of head groups: its loss is
    torch_groups_loss of the groups' forwards (a network without IQN groups or masks, so nothing
    is drawn), a step moves every group's parameters, acting is group 0's."""
    c = DQNConfig(state_dim=5, trunk_hidden=(12,), adv_hidden=6, atoms=7, branches=(2, 3),
                  aux=(HeadGroup("c51", members=3, atoms=5, adv_hidden=()), HeadGroup("q", loss_weight=0.5)))
    B = 6
    t = TorchTrainer(c, TrainerConfig(batch_size=B, gamma=GAMMA, v_min=V_MIN, v_max=V_MAX, readback_interval=1),
                     device="cpu", seed=4)
    assert t.group_loss_types == ("c51", "c51", "mse")
    b = trainer_batch(c, B, 0)
    del b["indices"]
    t.step(b)
    x = t.inputs
    with torch.no_grad():
        outs_next, outs_target, outs = t.online(x["next_states"]), t.target(x["next_states"]), t.online(x["states"])
        want = torch_groups_loss(c, [q for q, _ in outs], [q for q, _ in outs_next], [q for q, _ in outs_target],
                                 x["actions"], x["rewards"], x["dones"], V_MIN, V_MAX, GAMMA, t.group_loss_types,
                                 x["weights"])
        got = t._loss_part()
    for a, w in zip(got, want):
        assert torch.equal(a, w)
    before = {k: v.clone() for k, v in t.online.state_dict().items()}
    b = trainer_batch(c, B, 1)
    del b["indices"]
    t.step(b)
    moved = {k.split(".", 1)[0] for k, v in t.online.state_dict().items() if not torch.equal(v, before[k])}
    assert {"s1", "v1", "g1", "g2"} <= moved, moved
    s = torch.randn(4, c.state_dim)
    assert torch.equal(t.act(s), greedy_from_logits(t.online(s)[0][0], c.branches, V_MIN, V_MAX, "c51"))


def test_aux_loss_types_choose_each_groups_loss():
    """TrainerConfig.aux_loss_types: one entry per aux group (None: its kind's first), checked
    against the group's kind by both trainers; the step then runs that loss for the group."""
    c = NETS["q_main"]  # aux: an IQN group, a 'q' ensemble
    cfg = TrainerConfig(batch_size=4, aux_loss_types=(None, "huber"), iqn_fractions=2)
    t = Trainer(c, cfg, device="cpu")
    assert t.group_loss_types == ("huber", "iqn", "huber")
    assert [s.loss_type for s in t.gradient_step.groups] == ["huber", "iqn", "huber"]
    assert TorchTrainer(c, cfg, device="cpu").group_loss_types == ("huber", "iqn", "huber")
    assert Trainer(c, TrainerConfig(batch_size=4), device="cpu").group_loss_types == ("huber", "iqn", "mse")
    with pytest.raises(ValueError, match=r"^Trainer: TrainerConfig\.aux_loss_types\[1\] must be 'mse' or 'huber' "
                                         r"\(group 2 is a 'q' group\), got 'c51'$"):
        Trainer(c, TrainerConfig(batch_size=4, aux_loss_types=(None, "c51")), device="cpu")
    with pytest.raises(ValueError, match=r"^TorchTrainer: TrainerConfig\.aux_loss_types must have one entry per aux "
                                         r"head group \(2\) or none, got 1$"):
        TorchTrainer(c, TrainerConfig(batch_size=4, aux_loss_types=("iqn",)), device="cpu")
    with pytest.raises(ValueError, match=r"^TrainerConfig: aux_loss_types\[0\] must be 'c51' or 'qr' or 'mse' or "
                                         r"'huber' or 'iqn' or None, got 'l1'$"):
        TrainerConfig(aux_loss_types=("l1",))
    with pytest.raises(TypeError, match=r"^TrainerConfig: aux_loss_types must be a sequence"):
        TrainerConfig(aux_loss_types="huber")
