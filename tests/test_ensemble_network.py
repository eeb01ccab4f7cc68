"""Ensemble networks (DQNConfig.ensemble = E > 1: E head sets on one trunk) on the CPU kernels:
the config and its errors, the layout (format 4) and the e<m>. names, E = 1 unchanged; the
forward against the float64 reference of tests/reference.py and against E single networks that
share the trunk, the backward, gradcheck, opcheck, fake kernels, torch.compile and the state-dict
round trip with the plain network (TorchQNet); on CUDA, the kernels against the CPU reference
and the trainer's internal ops against the public ops."""
import dataclasses
import itertools

import pytest
import torch

import dqn_ops
from backward_check import check_backward_within_bars
from conftest import requires_cuda
from dqn_ops import DQNConfig, DuelingBranchQNet, ParamLayout, from_torch, ops, to_torch
from dqn_ops.layout import decode_config
from dqn_ops.rl.baseline import TorchQNet
from dqn_ops.step import InternalOpsStep, PublicOpsStep
from step_check import same_bits
from test_network_shapes import (check_bf16_mirror_emulated, check_cuda_forward_backward_act, check_fake_kernels,
                                 check_float64_forward_backward, check_gradcheck_float64)
from reference import ReferenceNet


def config(E: int, dueling: bool, H: int, **kw) -> DQNConfig:
    """A small network of E members with H hidden layers per head, branches of unequal sizes."""
    adv = (6, 5)[:H]
    value = (7, 4)[:H] if dueling else None
    return DQNConfig(state_dim=6, trunk_hidden=(12, 10), value_hidden=value, adv_hidden=adv, atoms=3,
                     branches=(2, 3), dueling=dueling, ensemble=E, **kw)


CASES = {f"E{E}_{'dueling' if dueling else 'q'}_H{H}": config(E, dueling, H)
         for E, dueling, H in itertools.product((2, 5), (True, False), (0, 1, 2))}
NAMES = list(CASES)


def make_net(c, seed=0, dtype=torch.float32):
    return DuelingBranchQNet(c, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype)


def net_args(net):
    return net.flat_params.detach(), net.params_bf16, net._layout_ints


# ----------------------------------------------------------------------------------------
# Config, layout, names

def test_config_ensemble_field():
    c = config(3, True, 1)
    assert c.members == 3 and c.num_heads == 3 * (1 + 2) and c.q_rows == 3 * 5
    assert DQNConfig().ensemble == 1 and DQNConfig().members == 1 and DQNConfig().q_rows == DQNConfig().total_actions
    assert config(2, False, 0).num_heads == 2 * 2
    with pytest.raises(ValueError, match=r"^DQNConfig: ensemble must be >= 1 \(an int\), got 0$"):
        DQNConfig(ensemble=0)
    with pytest.raises(ValueError, match=r"^DQNConfig: ensemble must be >= 1 \(an int\), got -2$"):
        DQNConfig(ensemble=-2)
    for bad, shown in ((2.0, r"2\.0 \(float\)"), (True, r"True \(bool\)"), ("2", r"'2' \(str\)"), (None, "None")):
        with pytest.raises(TypeError, match=rf"^DQNConfig: ensemble must be an int >= 1, got {shown}"):
            DQNConfig(ensemble=bad)


@pytest.mark.parametrize("kw", [{}, dict(state_dim=9, trunk_hidden=(24,), value_hidden=7, adv_hidden=5, atoms=11,
                                         branches=(3, 2)),
                                dict(state_dim=8, trunk_hidden=(20, 16), adv_hidden=(), atoms=5, branches=(3, 3, 1),
                                     dueling=False),
                                dict(state_dim=10, trunk_hidden=(32, 24, 16), value_hidden=(12, 6), adv_hidden=(8, 5),
                                     atoms=7, branches=(2, 4, 3))])
def test_one_member_is_the_network_without_the_field(kw):
    """E = 1: the layout, names and offsets of the config written without the field; the layout
    differs from format 2 only by the format number and the member count after dueling. It
    encodes the stored network (DQNConfig.aligned: hidden widths rounded up to multiples of 8)."""
    plain, one = ParamLayout(DQNConfig(**kw)), ParamLayout(DQNConfig(**kw, ensemble=1))
    assert one.config == plain.config
    assert one.tensors == plain.tensors and one.segments == plain.segments and one.numel == plain.numel
    assert one.head_names() == plain.head_names() and all(not n.startswith("e") for n, _ in one.layers())
    enc = one.encode()
    assert enc == plain.encode() and enc[0] == 4 and enc[4] == 1 and enc[5] == 0  # E = 1, no IQN embedding
    assert enc[6] == len(plain.config.branches)
    assert decode_config(enc) == plain.config.aligned()


def test_reference_config_keeps_its_layout():
    p = ParamLayout(DQNConfig())
    assert p.config.num_parameters == 287_998
    assert [n for n, _ in p.layers()] == ["s1", "s2", "v1", "v2", "a1.0", "a2.0", "a1.1", "a2.1", "a1.2", "a2.2"]
    assert p.encode()[:8] == [4, 96, 51, 1, 1, 0, 3, 3]


def test_ensemble_names_and_head_order():
    c = config(2, True, 2)
    p = ParamLayout(c)
    assert p.head_names() == ["e0.v", "e1.v", "e0.a.0", "e0.a.1", "e1.a.0", "e1.a.1"]
    assert [n for n, _ in p.layers()] == [
        "s1", "s2", "e0.v1", "e0.v2", "e0.v3", "e1.v1", "e1.v2", "e1.v3",
        "e0.a1.0", "e0.a2.0", "e0.a3.0", "e0.a1.1", "e0.a2.1", "e0.a3.1",
        "e1.a1.0", "e1.a2.0", "e1.a3.0", "e1.a1.1", "e1.a2.1", "e1.a3.1"]
    shapes = dict(p.layers())
    assert shapes["e1.v3"] == (3, 4) and shapes["e1.a3.1"] == (9, 5) and shapes["e0.a1.0"] == (6, 10)
    assert c.head_widths(0) == (7, 7, 6, 6, 6, 6) and c.head_out_widths() == (3, 3, 6, 9, 6, 9)
    assert c.head_out == 36 and c.hidden_widths == (12, 10, 2 * 7 + 4 * 6, 2 * 4 + 4 * 5)
    q = ParamLayout(config(3, False, 0))
    assert q.head_names() == [f"e{m}.q.{d}" for m in range(3) for d in range(2)]
    assert [n for n, _ in q.layers()] == ["s1", "s2"] + [f"e{m}.q1.{d}" for m in range(3) for d in range(2)]
    # the trunk's weights lead the buffer, where the plain network has them (the biases follow every weight)
    one = ParamLayout(config(1, True, 2))
    for name in ("s1.weight", "s2.weight"):
        assert dict((n, o) for n, _, o in p.tensors)[name] == dict((n, o) for n, _, o in one.tensors)[name]


@pytest.mark.parametrize("name", NAMES)
def test_layout_encodes_the_members_and_decodes(name):
    c = CASES[name]
    enc = ParamLayout(c).encode()
    assert enc[:7] == [4, c.state_dim, c.atoms, int(c.dueling), c.members, 0, c.num_branches]
    assert decode_config(enc) == c.aligned()  # the stored network: widths rounded up to multiples of 8
    net = make_net(c)
    mark = torch.zeros(net.layout.numel, dtype=torch.int32)
    for view in net.layout.views(mark).values():  # strided where a stored input width was rounded up
        view += 1
    assert mark.max() == 1 and mark.sum() == c.num_parameters
    assert f"ensemble={c.ensemble}" in repr(net)


def test_bad_member_counts_in_a_layout_are_clear_errors():
    c = config(2, True, 1)
    net = make_net(c)
    p, p_lp, layout = net_args(net)
    s = torch.randn(3, c.state_dim)
    op = "dqn_ops.bf16_dueling_forward: layout: "
    with pytest.raises(RuntimeError, match=op + "expected at least 1 ensemble member, got 0"):
        ops.bf16_dueling_forward(s, p, p_lp, [*layout[:4], 0, *layout[5:]])
    with pytest.raises(RuntimeError, match=op + r"30 heads \(10 members of 1 \+ 2\) do not fit in 29 entries"):
        ops.bf16_dueling_forward(s, p, p_lp, [*layout[:4], 10, *layout[5:]])
    with pytest.raises(ValueError, match=r"\(format 4\), got dueling=1, 0 members, IQN embedding 0, 2 branches"):
        decode_config([*layout[:4], 0, *layout[5:]])
    # three members' sizes, two members' offsets
    with pytest.raises(RuntimeError, match=op + "ended after"):
        ops.bf16_dueling_forward(s, p, p_lp, [*layout[:4], 3, *layout[5:]])


# ----------------------------------------------------------------------------------------
# The CPU kernels against the float64 references

def member_net(net, e: int) -> DuelingBranchQNet:
    """The single network (E = 1) of net's trunk and member e's heads."""
    c = net.config
    single = DuelingBranchQNet(dataclasses.replace(c, ensemble=1), generator=torch.Generator()).to(net.flat_params.dtype)
    prefix = f"e{e}."
    state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in net.state_dict().items()
             if k.startswith(prefix) or not k.startswith("e")}
    single.load_state_dict(state)
    return single


@pytest.mark.parametrize("name", NAMES)
def test_float64_forward_and_backward_are_the_reference(name):
    """Mirror in float64: the op is the formula to double precision (tests/reference.py's general
    network, its members' heads on the one trunk), forward and every backward precision."""
    check_float64_forward_backward(make_net(CASES[name], dtype=torch.float64), B=11)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_backward_vs_float64_within_bars(name, precision):
    check_backward_within_bars(make_net(CASES[name]), name, precision, B=200)


@pytest.mark.parametrize("name", NAMES)
def test_each_member_is_a_single_network_on_the_shared_trunk(name):
    """Member e's q rows and head logits are those of the E = 1 network with the same trunk and
    member e's head weights (the package's single-network kernels, float64 path); so are its head
    layers' gradients for its rows of dq, and the trunk's gradient is the sum over the members'."""
    c = CASES[name]
    net = make_net(c, seed=3, dtype=torch.float64)
    B, A = 9, c.total_actions
    s = torch.randn(B, c.state_dim, dtype=torch.float64)
    out = net.forward_full(s)
    bounds = [0] + torch.tensor(c.head_out_widths()).cumsum(0).tolist()
    values = c.members if c.dueling else 0
    gq = torch.randn(B, c.q_rows, c.atoms, dtype=torch.float64)
    grad, gs = dqn_ops.mixed_backward(gq, None, out, *net_args(net)[:2], net._layout_ints, "fp32", True)
    mine = net.layer_views(grad)
    trunk = {k: torch.zeros_like(v) for k, v in mine.items() if k.startswith("s")}
    gs_sum = torch.zeros_like(gs)
    for e in range(c.members):
        single = member_net(net, e)
        one = single.forward_full(s)
        torch.testing.assert_close(out.q_logits[:, e * A:(e + 1) * A], one.q_logits, rtol=1e-12, atol=1e-12)
        own = ([e] if c.dueling else []) + [values + e * c.num_branches + d for d in range(c.num_branches)]
        cols = torch.cat([out.head_logits[:, bounds[k]:bounds[k + 1]] for k in own], 1)
        torch.testing.assert_close(cols, one.head_logits, rtol=1e-12, atol=1e-12)
        g1, gs1 = dqn_ops.mixed_backward(gq[:, e * A:(e + 1) * A].contiguous(), None, one, *net_args(single)[:2],
                                         single._layout_ints, "fp32", True)
        gs_sum += gs1
        for k, v in single.layer_views(g1).items():
            if k in trunk:
                trunk[k] += v
            else:
                torch.testing.assert_close(mine[f"e{e}.{k}"], v, rtol=1e-12, atol=1e-12,
                                           msg=lambda m: f"member {e} {k}: {m}")
    for k, v in trunk.items():
        torch.testing.assert_close(mine[k], v, rtol=1e-10, atol=1e-12, msg=lambda m: f"{k}: {m}")
    torch.testing.assert_close(gs, gs_sum, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["E2_dueling_H2", "E5_q_H0"])
def test_bf16_mirror_path_is_the_emulated_rounding(name):
    c = CASES[name]
    check_bf16_mirror_emulated(make_net(c, seed=2), torch.randn(200, c.state_dim))


@pytest.mark.parametrize("name", ["E2_dueling_H2", "E2_q_H0", "E5_dueling_H1"])
def test_gradcheck_float64(name):
    """bf16_dueling_forward's autograd formula (mixed_backward) against finite differences, with
    respect to the states and every parameter, on the float64 path. E2_q_H0: every output head
    reads the trunk, whose gradient sums them all."""
    check_gradcheck_float64(CASES[name], fast_above=1500)


# ----------------------------------------------------------------------------------------
# Registration: opcheck, fake kernels, torch.compile

@pytest.mark.parametrize("name", ["E2_dueling_H2", "E5_q_H0", "E2_dueling_H0"])
def test_opcheck(name):
    c = CASES[name]
    net, target = make_net(c, 1), make_net(c, 2)
    p, p_lp, layout = net_args(net)
    tp, tp_lp = target.flat_params.detach(), target.params_bf16
    B = 5
    s = torch.randn(B, c.state_dim)
    torch.library.opcheck(torch.ops.dqn_ops.bf16_dueling_forward.default,
                          (s, p.clone().requires_grad_(), p_lp, layout, "bf16"))
    fwd = torch.ops.dqn_ops.bf16_dueling_forward.default(s, p, p_lp, layout, "bf16")
    gq = torch.randn(B, c.q_rows, c.atoms)
    for need in (False, True):
        torch.library.opcheck(torch.ops.dqn_ops.mixed_backward.default,
                              (gq, fwd[1].clone(), fwd[2], p, p_lp, layout, "tf32", need))
    pairs = torch.cat([s, torch.randn(B, c.state_dim)])
    for batch_networks in (False, True):
        torch.library.opcheck(torch.ops.dqn_ops._online_and_target_logits.default,
                              (pairs, p, p_lp, tp, tp_lp, layout, batch_networks))
    f = torch.ops.dqn_ops._online_and_target_logits.default(pairs, p, p_lp, tp, tp_lp, layout, False)
    gh = torch.randn(B, c.head_out)
    gh_bf16 = torch.zeros(B, c.head_ld, dtype=torch.bfloat16)
    col = out_col = 0
    for w in c.head_out_widths():
        gh_bf16[:, col:col + w] = gh[:, out_col:out_col + w].bfloat16()
        col, out_col = col + -(-w // 8) * 8, out_col + w
    saved = [t[:B].contiguous() for t in f[2]]
    torch.library.opcheck(torch.ops.dqn_ops._mixed_backward_from_head.default,
                          (gh, gh_bf16, saved, p, p_lp, layout, "bf16"))
    # the step's pieces compose to the public ops: the online logits + bias are the head logits
    head = torch.cat([f[0][:B, c2:c2 + w] for c2, w in zip(
        [sum(-(-x // 8) * 8 for x in c.head_out_widths()[:k]) for k in range(c.num_heads)], c.head_out_widths())], 1)
    b_out = net.layout.segments["b_out"][0]
    torch.testing.assert_close(head + p[b_out:b_out + c.head_out], fwd[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.backends.cuda.is_built(), reason="a CPU-only torch build makes no fake CUDA tensors"))])
@pytest.mark.parametrize("name", NAMES)
def test_fake_kernels_give_the_ensembles_shapes(device, name):
    check_fake_kernels(CASES[name], device, B=4)


@pytest.mark.parametrize("name", ["E2_dueling_H1", "E5_q_H2"])
def test_compile_fullgraph_forward_backward_matches_eager(name):
    """torch.compile(fullgraph=True, aot_eager) of the forward and a loss on every member's q and
    the head logits; its backward runs mixed_backward: the same bits as eager."""
    c = CASES[name]
    net = make_net(c, 1)
    s = torch.randn(8, c.state_dim)
    w = torch.randn(8, c.q_rows, c.atoms)

    def step(states):
        out = net.forward_full(states)
        return (out.q_logits * w).sum() + out.head_logits.square().mean()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    losses, grads = [], []
    for fn in (compiled, step):
        net.flat_params.grad = None
        loss = fn(s)
        loss.backward()
        losses.append(loss.detach())
        grads.append(net.flat_params.grad.clone())
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])
    assert torch.isfinite(grads[0]).all() and (grads[0] != 0).any()


# ----------------------------------------------------------------------------------------
# The plain network and conversion

@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_with_the_plain_network(name):
    """TorchQNet has our names (e<m>.-prefixed head layers); from_torch / to_torch move its weights
    both ways unchanged, and in float64 both compute the same q and head logits to 1e-12."""
    c = CASES[name]
    torch.manual_seed(5)
    plain = TorchQNet(c).double()
    assert set(plain.state_dict()) == {n for n, _, _ in ParamLayout(c).tensors}
    net = from_torch(plain, c)
    assert net.flat_params.dtype == torch.float64
    back = to_torch(net)
    assert isinstance(back, TorchQNet)
    for k, v in plain.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
        assert torch.equal(net.state_dict()[k], v), k
    s = torch.randn(13, c.state_dim, dtype=torch.float64)
    q, head = plain(s)
    out = net.forward_full(s)
    torch.testing.assert_close(out.q_logits, q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.head_logits, head, rtol=1e-12, atol=1e-12)
    ref = ReferenceNet(c).double()
    ref.load_state_dict(plain.state_dict())
    torch.testing.assert_close(ref(s)[0], q, rtol=1e-12, atol=1e-12)
    # into a given module, by name
    other = TorchQNet(c).double()
    assert to_torch(net, other) is other
    assert all(torch.equal(other.state_dict()[k], v) for k, v in plain.state_dict().items())


def test_split_members_and_branches():
    c = config(3, True, 1)
    net = make_net(c)
    q = net(torch.randn(4, c.state_dim))
    members = net.split_members(q)
    assert len(members) == 3 and all(m.shape == (4, 5, 3) for m in members)
    per = net.split_branches(q)
    assert len(per) == 3 and [t.shape[1] for t in per[1]] == [2, 3]
    assert torch.equal(per[2][1], q[:, 2 * 5 + 2:3 * 5])
    assert [t.shape[1] for t in net.split_branches(members[0])] == [2, 3]


# ----------------------------------------------------------------------------------------
# CUDA: the kernels against the CPU reference (tests/test_network_shapes.py's check), and an
# ensemble with the reference network's heads (5 members, 51 atoms, 3 x 3 actions) on a small trunk

CUDA_CASES = dict(CASES, e5_51atoms=DQNConfig(state_dim=16, trunk_hidden=(64, 64), value_hidden=32, adv_hidden=32,
                                              atoms=51, branches=(3, 3, 3), ensemble=5))


@requires_cuda
@pytest.mark.parametrize("name", list(CUDA_CASES))
def test_cuda_forward_backward_and_act_match_the_cpu_reference(name):
    check_cuda_forward_backward_act(CUDA_CASES[name], name)


@requires_cuda
@pytest.mark.parametrize("name", ["E2_dueling_H1", "E5_q_H0", "e5_51atoms"])
def test_cuda_trainer_logits_and_loss_on_logits_are_the_public_ops_bits(name):
    """The trainer's internal ops on an ensemble (the fused loss kernel for C51, the composed one
    for Huber) give the public ops' bits, with bootstrap masks."""
    c = CUDA_CASES[name]
    online, target = (make_net(c, seed).cuda() for seed in (1, 2))
    B = 40
    g = torch.Generator().manual_seed(3)
    sample = [torch.stack([torch.randint(0, n, (B,), generator=g) for n in c.branches], 1),
              (torch.rand(B, generator=g) * 2 - 1) * 4, (torch.rand(B, generator=g) < 0.25).float(),
              torch.rand(B, generator=g) + 0.5]
    sample = [t.cuda() for t in sample]
    masks = (torch.rand(B, c.members, generator=g) < 0.5).float().cuda()
    loss_type = "c51" if c.atoms > 1 else "huber"
    kw = dict(loss_type=loss_type, v_min=-10.0, v_max=10.0, gamma=0.97, precision="bf16")
    internal, public = InternalOpsStep(online, target, **kw), PublicOpsStep(online, target, **kw)
    s = torch.randn(2 * B, c.state_dim, device="cuda")
    fi, fp = internal.forward(s), public.forward(s)
    p = internal._params()
    got = ops._dqn_loss_on_logits(fi.logits[:B], fi.logits[B:], fi.logits_next_target, p.online, p.target, *sample,
                                  online._layout_ints, -10.0, 10.0, 0.97, loss_type, masks)
    q = fp.online.q_logits
    want = ops.dqn_loss(q[:B], q[B:], fp.q_next_target, *sample[:3], c.branches, v_min=-10.0, v_max=10.0, gamma=0.97,
                        weights=sample[3], loss_type=loss_type, masks=masks)
    for k in ("loss", "td_error", "mean_q"):
        same_bits(getattr(got, k), getattr(want, k), k)
    same_bits(internal.backward(fi, got), public.backward(fp, want), "grad")
    member_rows = want.grad_q.view(B, c.members, c.total_actions, c.atoms)
    assert (member_rows[masks == 0] == 0).all() and (member_rows[masks == 1] != 0).any()
