"""Every op of the network on shapes other than the reference one (tests/reference.py SHAPES:
trunk depth 1 and 3; head depth 0, 1 and 2; dueling on and off; C51 and one atom; one and
several branches of unequal sizes; CleanRL c51's QNetwork), against the float64 reference of
the general network written from dqn_ops/layout.py's formulas (tests/reference.py), with the
checks the reference shape gets elsewhere: gradcheck, opcheck, fake kernels, torch.compile,
the trainer's step (its internal ops bit for bit the public ops'), act; and, on CUDA, the
kernels against the CPU reference and the graphed trainer step."""
import pytest
import torch

import dqn_ops
from backward_check import BACKWARD_BARS, check_backward_within_bars
from conftest import DEVICES, requires_cuda
from dqn_ops import DQNConfig, DuelingBranchQNet, ParamLayout, Trainer, TrainerConfig, ops
from dqn_ops.step import InternalOpsStep, PublicOpsStep
from dqn_ops.trainer import expected_q, greedy_from_logits
from poison import poison_cuda_cache
from test_act import assert_greedy
from step_check import check_trainer_step_is_the_public_ops_step, same_bits, snapshot
from reference import (SHAPES, activation_columns, dueling_head_grad, logical_activations, padding_mask,
                       reference_backward, reference_forward_emulated, reference_net_like, rel_err, stored_activations)

V_MIN, V_MAX, GAMMA = -10.0, 10.0, 0.97
NAMES = list(SHAPES)


def make_net(c, device="cpu", seed=0):
    return DuelingBranchQNet(c, generator=torch.Generator().manual_seed(seed)).to(device)


def loss_type_of(c: DQNConfig) -> str:
    return "c51" if c.atoms > 1 else "huber"


def net_args(net):
    return net.flat_params.detach(), net.params_bf16, net._layout_ints


def batch_for(c: DQNConfig, B: int, device, seed=0):
    """state_pairs [2B, SD] = [s; s'], actions, rewards (some past the support), dones, weights."""
    g = torch.Generator().manual_seed(seed)
    b = dict(state_pairs=torch.randn(2 * B, c.state_dim, generator=g),
             actions=torch.stack([torch.randint(0, n, (B,), generator=g) for n in c.branches], 1),
             rewards=(torch.rand(B, generator=g) * 2 - 1) * 1.5 * V_MAX,
             dones=(torch.rand(B, generator=g) < 0.2).float(), weights=torch.rand(B, generator=g) + 0.5)
    return {k: v.to(device) for k, v in b.items()}


# ----------------------------------------------------------------------------------------
# The shapes themselves

def test_the_shapes_cover_what_they_claim():
    cs = SHAPES.values()
    assert {len(c.trunk_hidden) for c in cs} >= {1, 2, 3}
    assert {c.head_depth for c in cs} == {0, 1, 2}
    assert {c.dueling for c in cs} == {True, False}
    assert {c.atoms == 1 for c in cs} == {True, False}
    assert any(c.num_branches == 1 for c in cs) and any(len(set(c.branches)) > 1 for c in cs)
    cleanrl = SHAPES["cleanrl_c51"]
    assert (cleanrl.state_dim, cleanrl.hidden_widths, cleanrl.head_out) == (4, (120, 84), 2 * 51)
    assert ParamLayout(cleanrl).head_names() == ["q.0"]
    assert [n for n, _, _ in ParamLayout(cleanrl).tensors] == ["s1.weight", "s1.bias", "s2.weight", "s2.bias",
                                                              "q1.0.weight", "q1.0.bias"]


@pytest.mark.parametrize("name", NAMES)
def test_layout_views_tile_the_buffer_and_the_state_dict_is_the_plain_networks(name):
    c = SHAPES[name]
    net = make_net(c)
    mark = torch.zeros(net.layout.numel, dtype=torch.int32)
    for view in net.layout.views(mark).values():  # strided where a stored input width was rounded up
        view += 1
    assert mark.max() == 1 and mark.sum() == c.num_parameters
    ref = reference_net_like(net, torch.float32)  # strict: the reference builds its names from the config alone
    other = make_net(c, seed=1)
    other.load_state_dict(ref.state_dict())
    assert torch.equal(other.flat_params, net.flat_params)
    r = repr(net)
    assert f"dueling={c.dueling}" in r and f"value_hidden={c.value_hidden}" in r and f"adv_hidden={c.adv_hidden}" in r


def test_cleanrl_widths_are_stored_rounded_up_to_8_and_the_extra_units_stay_zero():
    """The point of DQNConfig.aligned: CleanRL's 84-wide layer is stored 88 wide, so every weight
    row reading a hidden layer and every hidden activation row is a multiple of 8 elements (16
    bytes of BF16; the states keep their width); the extra units start at zero and training keeps
    them exactly zero (their gradients are exactly zero)."""
    c = SHAPES["cleanrl_c51"]
    layout = ParamLayout(c)
    assert dqn_ops.layout.decode_config(layout.encode()).trunk_hidden == (120, 88)
    assert layout.row_strides == {"s1.weight": 4, "s2.weight": 120, "q1.0.weight": 88}
    net = make_net(c)
    for pname, view in net.layer_views().items():
        if view.dim() == 2:  # every weight reading a hidden layer; s1 reads the states, which keep their width
            assert view.stride(0) == layout.row_strides[pname], pname
            assert view.stride(0) % 8 == 0 or pname == "s1.weight", pname
    acts = net.forward_full(torch.randn(5, c.state_dim)).activations
    assert [a.shape[1] for a in acts[1:]] == [120, 88]
    # The extra units' weights and biases: inside the stored network's views, outside c's.
    stored = ParamLayout(c.aligned())
    assert stored.segments == layout.segments
    extra = torch.zeros(layout.numel, dtype=torch.bool)
    for view in stored.views(extra).values():
        view.fill_(True)
    for view in layout.views(extra).values():
        view.fill_(False)
    assert extra.sum() == 4 * 120 + 4 + 102 * 4  # s2's 4 extra rows and biases, q1.0's 4 extra columns
    t = Trainer(c, TrainerConfig(batch_size=32, gamma=GAMMA, v_min=V_MIN, v_max=V_MAX), device="cpu", seed=3)
    before = t.online.flat_params.detach().clone()
    assert (before[extra] == 0).all()
    for i in range(5):
        b = batch_for(c, 32, "cpu", seed=20 + i)
        t.step(dict(states=b["state_pairs"][:32], next_states=b["state_pairs"][32:], actions=b["actions"],
                    rewards=b["rewards"], dones=b["dones"]))
    t.readback()
    after = t.online.flat_params.detach()
    assert not torch.equal(after[~extra], before[~extra])  # it trained
    assert (after[extra] == 0).all() and (t.target.flat_params.detach()[extra] == 0).all()
    logical_activations(c, t.online.forward_full(torch.randn(5, c.state_dim)).activations)  # asserts the zeros


# ----------------------------------------------------------------------------------------
# The CPU reference kernels against the float64 reference

def check_float64_forward_backward(net, B: int):
    """Mirror in float64 (net.double()): the ops are the formula to double precision, forward
    (q, head logits, every activation, tests/reference.py's general network) and every backward
    precision (all read the same float64 weights). tests/test_ensemble_network.py runs it on
    ensembles."""
    c = net.config
    s = torch.randn(B, c.state_dim, dtype=torch.float64)
    out = net.forward_full(s)
    q, head, acts = reference_forward_emulated(net, s)
    assert out.q_logits.shape == (B, c.q_rows, c.atoms) and out.head_logits.shape == (B, c.head_out)
    torch.testing.assert_close(out.q_logits, q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.head_logits, head, rtol=1e-12, atol=1e-12)
    assert len(out.activations) == len(acts) == 1 + len(c.hidden_widths)
    # The ops save the stored network's activations (DQNConfig.aligned): c's columns are the
    # reference's, the extra units' exactly zero (logical_activations asserts it).
    for i, (a, b) in enumerate(zip(logical_activations(c, out.activations), acts)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"activations[{i}]: {m}")
    torch.testing.assert_close(reference_net_like(net)(s)[0], q, rtol=1e-12, atol=1e-12)
    gq = torch.randn(B, c.q_rows, c.atoms, dtype=torch.float64)
    gh = torch.randn(B, c.head_out, dtype=torch.float64)
    ref_grad, ref_gs = reference_backward(net, stored_activations(c, acts), dueling_head_grad(c, gq) + gh, "master")
    for precision in ops.BACKWARD_PRECISIONS:
        grad, gs = dqn_ops.mixed_backward(gq, gh, out, *net_args(net)[:2], net._layout_ints, precision, True)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(gs, ref_gs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_float64_path_is_the_float64_reference(name):
    check_float64_forward_backward(make_net(SHAPES[name]).double(), B=19)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_mirror_path_is_the_emulated_rounding(name):
    """BF16 mirror: the reference rounds where the kernels round (mirror weights, states and every
    activation to BF16) and sums in float64 instead of F32: the activations agree but for
    one-ulp roundings of values the two sums put on either side of a rounding boundary."""
    c = SHAPES[name]
    check_bf16_mirror_emulated(make_net(c), torch.randn(300, c.state_dim))


def check_bf16_mirror_emulated(net, s):
    """The BF16 mirror path of `net` on states `s` against the emulated-rounding reference (see
    test_bf16_mirror_path_is_the_emulated_rounding); tests/test_ensemble_network.py runs it on
    ensembles. `net` and `s` on any device (the reference runs on the CPU)."""
    out = net.forward_full(s)
    q, head, acts = reference_forward_emulated(net, s)
    assert all(a.dtype == torch.bfloat16 for a in out.activations)
    # c's columns of the stored network's activations (the extra units' exactly zero)
    for i, (a, b) in enumerate(zip(logical_activations(net.config, out.activations), acts)):
        a = a.double().cpu()
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-6, msg=lambda m: f"activations[{i}]: {m}")
        assert (a != b).float().mean() < 1e-3, f"activations[{i}]"
    assert rel_err(out.q_logits, q) < 1e-4 and rel_err(out.head_logits, head) < 1e-4


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_backward_vs_float64_within_bars(name, precision):
    check_backward_within_bars(make_net(SHAPES[name]), name, precision, B=200)


def check_gradcheck_float64(c: DQNConfig, fast_above: int):
    """bf16_dueling_forward's autograd formula (mixed_backward) against finite differences, with
    respect to the states and every parameter, on the float64 path; past `fast_above`
    parameters a random projection (gradcheck's fast mode) instead of every column."""
    layout = ParamLayout(c).encode()
    net = make_net(c).double()
    p = net.flat_params.detach().clone().requires_grad_()
    s = torch.randn(3, c.state_dim, dtype=torch.float64, requires_grad=True)

    def f(states, params):
        # The mirror is taken from params inside f, so gradcheck's perturbations reach it.
        out = dqn_ops.bf16_dueling_forward(states, params, params.detach().clone(), layout, "fp32")
        return out.q_logits, out.head_logits

    assert torch.autograd.gradcheck(f, (s, p), eps=1e-6, atol=1e-7, rtol=1e-6, fast_mode=c.num_parameters > fast_above)


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_float64(name):
    check_gradcheck_float64(SHAPES[name], fast_above=5000)  # CleanRL's network has 19k parameters


@pytest.mark.parametrize("name", NAMES)
def test_head_gradient_of_the_trainers_loss(name):
    """_dqn_loss_on_logits' d(loss)/d(head): the aggregation's backward of dqn_loss's grad_q
    (without dueling grad_q itself, column for column), and its BF16 copy in the padded layout."""
    c = SHAPES[name]
    online, target = make_net(c, seed=1), make_net(c, seed=2)
    b = batch_for(c, 24, "cpu", seed=4)
    kw = dict(loss_type=loss_type_of(c), v_min=V_MIN, v_max=V_MAX, gamma=GAMMA)
    grad_q = PublicOpsStep(online, target, **kw)(**b).loss_out.grad_q
    got = InternalOpsStep(online, target, **kw)(**b).loss_out
    want = dueling_head_grad(c, grad_q)
    if not c.dueling:
        same_bits(got.grad_head, grad_q.flatten(1), "grad_head")
    torch.testing.assert_close(got.grad_head.double(), want, rtol=1e-5, atol=1e-9)
    col = out_col = 0
    for width in c.head_out_widths():
        same_bits(got.grad_head_bf16[:, col:col + width], got.grad_head[:, out_col:out_col + width].bfloat16(), "copy")
        pad = -(-width // 8) * 8
        assert (got.grad_head_bf16[:, col + width:col + pad] == 0).all()
        col, out_col = col + pad, out_col + width
    assert col == c.head_ld == got.grad_head_bf16.shape[1]


# ----------------------------------------------------------------------------------------
# Registration: opcheck, fake kernels, torch.compile

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_opcheck(device, name):
    c = SHAPES[name]
    net, target = make_net(c, device, 1), make_net(c, device, 2)
    p, p_lp, layout = net_args(net)
    tp, tp_lp = target.flat_params.detach(), target.params_bf16
    B = 6
    s = torch.randn(B, c.state_dim, device=device)
    torch.library.opcheck(torch.ops.dqn_ops.bf16_dueling_forward.default,
                          (s, p.clone().requires_grad_(), p_lp, layout, "bf16"))
    fwd = torch.ops.dqn_ops.bf16_dueling_forward.default(s, p, p_lp, layout, "bf16")
    gq = torch.randn(B, c.total_actions, c.atoms, device=device)
    for need in (False, True):
        torch.library.opcheck(torch.ops.dqn_ops.mixed_backward.default,
                              (gq, fwd[1].clone(), fwd[2], p, p_lp, layout, "tf32", need))
    b = batch_for(c, B, device)
    for batch_networks in (False, True):
        torch.library.opcheck(torch.ops.dqn_ops._online_and_target_logits.default,
                              (b["state_pairs"], p, p_lp, tp, tp_lp, layout, batch_networks))
    f = torch.ops.dqn_ops._online_and_target_logits.default(b["state_pairs"], p, p_lp, tp, tp_lp, layout, False)
    logits = [f[0][:B].contiguous(), f[0][B:].contiguous(), f[1]]
    loss_args = (*logits, p, tp, b["actions"], b["rewards"], b["dones"], b["weights"], layout, V_MIN, V_MAX, GAMMA,
                 loss_type_of(c))
    torch.library.opcheck(torch.ops.dqn_ops._dqn_loss_on_logits.default, loss_args)
    r = torch.ops.dqn_ops._dqn_loss_on_logits.default(*loss_args)
    saved = [t[:B].contiguous() for t in f[2]]
    torch.library.opcheck(torch.ops.dqn_ops._mixed_backward_from_head.default,
                          (r[1], r[2], saved, p, p_lp, layout, "bf16"))
    eps = torch.full((1,), 0.5, device=device)
    rng = torch.tensor([3, 0], dtype=torch.long, device=device)
    torch.library.opcheck(torch.ops.dqn_ops.act.default, (s, p, p_lp, layout, V_MIN, V_MAX, eps, rng))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.backends.cuda.is_built(), reason="a CPU-only torch build makes no fake CUDA tensors"))])
@pytest.mark.parametrize("name", NAMES)
def test_fake_kernels_give_every_op_its_shapes(device, name):
    check_fake_kernels(SHAPES[name], device, B=5)


def check_fake_kernels(c: DQNConfig, device, B: int):
    """The fake kernels (torch.compile / FakeTensor tracing): the shapes follow the stored
    network's hidden widths (DQNConfig.aligned; an ensemble's q rows: its members'), on fake
    tensors of either device (no GPU needed). tests/test_ensemble_network.py runs it on ensembles."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layout = ParamLayout(c).encode()
    n = layout[-1]
    widths = [width for _, width in activation_columns(c)]
    assert widths == [c.state_dim, *c.aligned().hidden_widths]
    with FakeTensorMode():
        p, p_lp = torch.empty(n, device=device), torch.empty(n, device=device, dtype=torch.bfloat16)
        out = ops.bf16_dueling_forward(torch.empty(B, c.state_dim, device=device), p, p_lp, layout)
        assert out.q_logits.shape == (B, c.q_rows, c.atoms) and out.head_logits.shape == (B, c.head_out)
        assert [tuple(t.shape) for t in out.activations] == [(B, w) for w in widths]
        assert all(t.dtype == torch.bfloat16 for t in out.activations)
        grad, gs = ops.mixed_backward(torch.empty(B, c.q_rows, c.atoms, device=device), None, out, p, p_lp,
                                      layout, "bf16", True)
        assert grad.shape == (n,) and gs.shape == (B, c.state_dim)
        with pytest.raises(RuntimeError, match=f"dqn_ops.mixed_backward: activations: expected {len(widths)} tensors"):
            ops.mixed_backward(None, out.head_logits, out.activations[:-1], p, p_lp, layout)
        f = ops._online_and_target_logits(torch.empty(2 * B, c.state_dim, device=device), p, p_lp, p, p_lp, layout,
                                          True)
        assert f.logits.shape == (2 * B, c.head_ld) and f.logits_next_target.shape == (B, c.head_ld)
        assert [tuple(t.shape) for t in f.activations] == [(2 * B, w) for w in widths]
        r = ops._dqn_loss_on_logits(f.logits[:B], f.logits[B:], f.logits_next_target, p, p,
                                    torch.empty(B, c.num_branches, dtype=torch.long, device=device),
                                    torch.empty(B, device=device), torch.empty(B, device=device), None, layout,
                                    V_MIN, V_MAX, GAMMA, loss_type_of(c))
        assert r.grad_head.shape == (B, c.head_out) and r.grad_head_bf16.shape == (B, c.head_ld)
        g = ops._mixed_backward_from_head(r.grad_head, r.grad_head_bf16, [t[:B] for t in f.activations], p, p_lp,
                                          layout)
        assert g.shape == (n,)
        a = ops.act(torch.empty(7, c.state_dim, device=device), p, p_lp, layout, V_MIN, V_MAX,
                    torch.empty(1, device=device), torch.empty(2, dtype=torch.long, device=device))
        assert a.actions.shape == (7, c.num_branches) and a.greedy_q.shape == (7, c.num_branches)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,backend", [(n, "aot_eager") for n in NAMES] +
                         [("trunk3_head2", "inductor"), ("cleanrl_c51", "inductor")])
def test_compile_fullgraph_forward_loss_backward_matches_eager(device, name, backend):
    """torch.compile(fullgraph=True) of the module's forward on [s; s'], the target's forward and
    dqn_loss; then the loss's backward (the compiled graph's backward: mixed_backward): the same
    bits as eager. aot_eager traces the fake kernels and the autograd formulas without
    inductor's code generation; inductor on two shapes does both."""
    c = SHAPES[name]
    net, target = make_net(c, device, 1), make_net(c, device, 2)
    b = batch_for(c, 8, device)
    B = 8

    def step(state_pairs, actions, rewards, dones, weights):
        q = net(state_pairs)
        with torch.no_grad():
            q_next_target = target(state_pairs[B:])
        return dqn_ops.dqn_loss(q[:B], q[B:].detach(), q_next_target, actions, rewards, dones, c.branches,
                                v_min=V_MIN, v_max=V_MAX, gamma=GAMMA, weights=weights,
                                loss_type=loss_type_of(c)).loss

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    losses, grads = [], []
    for fn in (compiled, step):
        net.flat_params.grad = None
        loss = fn(**b)
        loss.backward()
        losses.append(loss.detach())
        grads.append(net.flat_params.grad.clone())
    same_bits(losses[0], losses[1], "loss")
    same_bits(grads[0], grads[1], "grad")
    assert torch.isfinite(grads[0]).all() and (grads[0] != 0).any()


# ----------------------------------------------------------------------------------------
# The trainer's step and act

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch_networks", [False, True], ids=["two_passes", "networks_batched"])
def test_internal_ops_give_the_public_ops_bits(device, name, batch_networks):
    c = SHAPES[name]
    online, target = make_net(c, device, 1), make_net(c, device, 2)
    kw = dict(loss_type=loss_type_of(c), v_min=V_MIN, v_max=V_MAX, gamma=GAMMA, precision="bf16")
    b = batch_for(c, 37, device, seed=5)
    cuda = device == "cuda"
    if cuda:
        poison_cuda_cache()
    want = PublicOpsStep(online, target, **kw)(**b)
    if cuda:
        poison_cuda_cache()
    got = InternalOpsStep(online, target, batch_networks=batch_networks, **kw)(**b)
    assert len(got.saved) == len(want.saved) == 1 + len(c.hidden_widths)
    for i, (x, y) in enumerate(zip(got.saved, want.saved)):
        same_bits(x, y, f"saved activation {i}")
    for k in ("loss", "td_error", "mean_q", "grad"):
        same_bits(getattr(got, k), getattr(want, k), k)
    assert torch.isfinite(got.grad).all() and torch.isfinite(got.td_error).all()
    assert (got.grad[padding_mask(online.layout, device)] == 0).all()


def _trainer_step_is_the_public_ops_step(c, device):
    """The trainer's step (graphed on CUDA after 3 warm-up steps) against PublicOpsStep on copies
    of its networks taken before the step: the same gradient, TD errors, loss and mean Q."""
    B = 32
    cfg = TrainerConfig(batch_size=B, gamma=GAMMA, v_min=V_MIN, v_max=V_MAX, readback_interval=1,
                        on_non_finite="flag")
    t = Trainer(c, cfg, device=device, seed=7)
    batches = [batch_for(c, B, device, seed=10 + i) for i in range(5)]
    for b in batches:
        b.update(states=b["state_pairs"][:B], next_states=b["state_pairs"][B:])
    check_trainer_step_is_the_public_ops_step(t, batches, V_MIN, V_MAX, GAMMA)
    assert not t.non_finite_steps and all(r["skipped"] == 0 for r in t.stats.rows)
    return t


@pytest.mark.parametrize("name", NAMES)
def test_trainer_step_on_the_cpu(name):
    c = SHAPES[name]
    t = _trainer_step_is_the_public_ops_step(c, "cpu")
    assert t.metrics()["steps"] == 5
    # it trains: a fixed batch's loss falls (C51's cross-entropy stays above the target's entropy)
    t = Trainer(c, TrainerConfig(batch_size=32, lr=1e-2, sigma_max=None, tau=0.0, readback_interval=4), device="cpu",
                seed=1)
    b = batch_for(c, 32, "cpu", seed=2)
    b = dict(states=b["state_pairs"][:32], next_states=b["state_pairs"][32:], actions=b["actions"],
             rewards=b["rewards"] / 5, dones=b["dones"])
    for _ in range(40):
        t.step(b)
    t.readback()
    rows = t.stats.rows
    assert sum(r["loss"] for r in rows[-5:]) < 0.9 * sum(r["loss"] for r in rows[:5])


def f32_sum_tolerance(E):
    """Per row, how far act's F32 expected Q (a softmax-weighted sum over the atoms, or the
    members' mean) may be from the float64 one of the same logits: a few F32 ulps of the row's
    largest magnitude."""
    return 1e-5 * (1 + E.abs().max(1).values)

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_act(device, name):
    """Greedy: the argmax of the expected Q of bf16_dueling_forward's q logits (the same logits:
    the same choice wherever the expectation is decided); on the float64 path the reference's
    expected Q to 1e-10. Exploring: every branch's action in range, the counter advanced."""
    c = SHAPES[name]
    net = make_net(c, device)
    s = torch.randn(400, c.state_dim, device=device)
    out = ops.act(s, *net_args(net), V_MIN, V_MAX, torch.zeros(1, device=device),
                  torch.tensor([1, 0], device=device))
    q = ops.bf16_dueling_forward(s, *net_args(net)).q_logits
    E = expected_q(q.double(), V_MIN, V_MAX).cpu()
    assert_greedy(c, out.actions, out.greedy_q, E, f32_sum_tolerance(E), f"act {name}", min_decided=0.9)
    rng = torch.tensor([2, 5], device=device)
    rnd = ops.act(s, *net_args(net), V_MIN, V_MAX, torch.ones(1, device=device), rng).actions
    assert rng.tolist() == [2, 6]
    for d, n in enumerate(c.branches):
        assert ((rnd[:, d] >= 0) & (rnd[:, d] < n)).all()
    if device == "cpu":
        net64 = make_net(c).double()
        s64 = torch.randn(200, c.state_dim, dtype=torch.float64)
        out64 = ops.act(s64, *net_args(net64), V_MIN, V_MAX, torch.zeros(1), torch.tensor([1, 0]))
        q64, _ = reference_net_like(net64)(s64)
        if c.atoms > 1:
            support = torch.linspace(V_MIN, V_MAX, c.atoms, dtype=torch.float64)
            eq = (q64.softmax(-1) * support).sum(-1)
        else:
            eq = q64[..., 0]
        best = torch.stack([e.max(1).values for e in torch.split(eq, list(c.branches), 1)], 1)
        torch.testing.assert_close(out64.greedy_q, best, rtol=0, atol=1e-10)
        assert torch.equal(out64.actions, greedy_from_logits(q64, c.branches, V_MIN, V_MAX))


# ----------------------------------------------------------------------------------------
# Bad layouts

def _old_format_layout(c: DQNConfig):
    """The layout an older dqn_ops encoded (no format entry; the fixed network: state_dim, both
    trunk widths, the value and branch hidden widths, atoms, D, n_1..n_D, then offsets)."""
    p = ParamLayout(c)
    seg = p.segments
    sizes = [c.state_dim, *c.trunk_hidden, c.value_hidden[0], c.adv_hidden[0], c.atoms, c.num_branches, *c.branches]
    offsets = [seg["W_s1"][0], seg["W_s2"][0], seg["W_h1"][0]] + [seg[f"W_out{j}"][0] for j in range(c.num_heads)]
    return sizes + offsets + [seg[k][0] for k in ("b_s1", "b_s2", "b_h1", "b_out")] + [p.numel]


@pytest.mark.parametrize("device", DEVICES)
def test_a_stale_layout_is_a_clear_error(device):
    c = DQNConfig()
    net = make_net(c, device)
    p, p_lp, _ = net_args(net)
    s = torch.randn(4, c.state_dim, device=device)
    fmt = (r"layout: expected the int\[\] from dqn_ops.ParamLayout.encode\(\) \(format 4, or 5 for a head group, its "
           r"first entry\), ")
    for layout, got in ((_old_format_layout(c), "got first entry 96"), ([1, *ParamLayout(c).encode()[1:]],
                                                                         "got first entry 1")):
        with pytest.raises(RuntimeError, match="dqn_ops.bf16_dueling_forward: " + fmt + got):
            ops.bf16_dueling_forward(s, p, p_lp, layout)
        with pytest.raises(RuntimeError, match="dqn_ops.act: " + fmt + got):
            ops.act(s, p, p_lp, layout, V_MIN, V_MAX, torch.zeros(1, device=device),
                    torch.zeros(2, dtype=torch.long, device=device))
        with pytest.raises(RuntimeError, match="dqn_ops._online_and_target_logits: " + fmt + got):
            ops._online_and_target_logits(torch.cat([s, s]), p, p_lp, p, p_lp, layout, False)
        out = ops.bf16_dueling_forward(s, p, p_lp, net._layout_ints)
        with pytest.raises(RuntimeError, match="dqn_ops.mixed_backward: " + fmt + got):
            ops.mixed_backward(None, out.head_logits, out, p, p_lp, layout)
    # the Python side (fake kernels) decodes it too, with the same verdict
    with pytest.raises(ValueError, match=r"layout: expected the int\[\] from dqn_ops.ParamLayout.encode\(\) "
                                         r"\(format 4\), got \[96, 256, 256, 128, 128\]"):
        dqn_ops.layout.decode_config(_old_format_layout(c))


@pytest.mark.parametrize("device", DEVICES)
def test_activations_of_another_shape_are_a_clear_error(device):
    """mixed_backward checks the saved activations against the layout: their count (a network of
    another depth) and each one's width."""
    deep, shallow = SHAPES["trunk3_head2"], SHAPES["head0_no_dueling"]
    net = make_net(deep, device)
    out = net.forward_full(torch.randn(4, deep.state_dim, device=device))
    other = make_net(shallow, device)
    op = "dqn_ops.mixed_backward: "
    with pytest.raises(RuntimeError, match=op + r"activations: expected 3 tensors \(the states and each hidden layer"):
        ops.mixed_backward(None, torch.zeros(4, shallow.head_out, device=device), out, *net_args(other))
    acts = list(out.activations)
    acts[4] = acts[5]
    # the stored widths (DQNConfig.aligned): head layer 1's 12 + 3 * 8 as 16 + 3 * 8, layer 2's 6 + 3 * 5 as 8 + 3 * 8
    with pytest.raises(RuntimeError, match=op + r"activations\[4\]: expected shape \[4, 40\], got \[4, 32\]"):
        ops.mixed_backward(None, out.head_logits, acts, *net_args(net))
    with pytest.raises(RuntimeError, match="dqn_ops._mixed_backward_from_head: activations: expected 6 tensors"):
        ops._mixed_backward_from_head(out.head_logits, torch.zeros(4, deep.head_ld, device=device,
                                                                   dtype=torch.bfloat16),
                                      acts[:5], *net_args(net))


# ----------------------------------------------------------------------------------------
# CUDA: the kernels against the CPU reference, the graphed trainer step

def check_cuda_forward_backward_act(c: DQNConfig, name: str):
    """The CUDA kernels of network c against the CPU reference. Forward: the CPU kernel rounds
    where the GPU does; only the F32 summation order differs. Backward: every precision within
    its bar of the float64 backward of the GPU's forward. act: the greedy choice of the same
    logits (an ensemble's: by the mean over its members). tests/test_ensemble_network.py runs
    it on ensembles."""
    net = make_net(c, "cuda")
    B = 300
    s = torch.randn(B, c.state_dim, device="cuda")
    poison_cuda_cache()
    gpu = net.forward_full(s)
    cpu = snapshot(net).to("cpu").forward_full(s.cpu())
    named = [("q_logits", gpu.q_logits, cpu.q_logits), ("head_logits", gpu.head_logits, cpu.head_logits)]
    named += [(f"activations[{i}]", a, b) for i, (a, b) in enumerate(zip(gpu.activations, cpu.activations))]
    assert len(gpu.activations) == len(cpu.activations)
    for what, a, b in named:
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert rel_err(a, b) < 2e-3, f"{what}: {rel_err(a, b):.2e}"
    assert torch.equal(gpu.activations[0].cpu(), cpu.activations[0])
    gq = torch.randn(B, c.q_rows, c.atoms, device="cuda")
    gh = torch.randn(B, c.head_out, device="cuda") * 0.1
    d_head = dueling_head_grad(c, gq) + gh.double().cpu()
    pad = padding_mask(net.layout, "cuda")
    cpu_net = snapshot(net).to("cpu")
    for precision in ops.BACKWARD_PRECISIONS:
        poison_cuda_cache()
        grad, gs = dqn_ops.mixed_backward(gq, gh, gpu, *net_args(net)[:2], net._layout_ints, precision, True)
        ref_grad, ref_gs = reference_backward(net, gpu.activations, d_head,
                                              "mirror" if precision == "bf16" else "master")
        g, r = net.layer_views(grad), net.layer_views(ref_grad)
        # A tiny layer's bf16 gradient can miss the bar by its rounding alone (cancellation over
        # few elements): then the bar is twice the CPU kernel's error, which rounds where the
        # GPU does, on its own forward. That error is itself bounded (at most 1.5x the bar over
        # every shape and ensemble here, three seeds, on the CPU), so the GPU's bar stays within
        # 6x the fixed one.
        cpu_grad, _ = dqn_ops.mixed_backward(gq.cpu(), gh.cpu(), cpu, *net_args(cpu_net)[:2], net._layout_ints,
                                             precision, True)
        cpu_ref, _ = reference_backward(cpu_net, cpu.activations, d_head, "mirror" if precision == "bf16" else "master")
        g_cpu, r_cpu = cpu_net.layer_views(cpu_grad), cpu_net.layer_views(cpu_ref)
        for pname in r:
            e = rel_err(g[pname], r[pname])
            cpu_err = rel_err(g_cpu[pname], r_cpu[pname])
            assert cpu_err <= 3 * BACKWARD_BARS[precision], f"{name}/{precision}: {pname}: CPU error {cpu_err:.2e}"
            bar = max(BACKWARD_BARS[precision], 2 * cpu_err)
            assert e <= bar, f"{name}/{precision}: {pname} error {e:.2e} (bar {bar:.2e})"
        assert rel_err(gs, ref_gs) <= BACKWARD_BARS[precision]
        assert (grad[pad] == 0).all() and torch.isfinite(grad).all()
    a = ops.act(s, *net_args(net), V_MIN, V_MAX, torch.zeros(1, device="cuda"), torch.zeros(2, dtype=torch.long,
                                                                                           device="cuda"))
    mean_q = expected_q(gpu.q_logits.double(), V_MIN, V_MAX).view(B, c.members, c.total_actions).mean(1).cpu()
    assert_greedy(c, a.actions, a.greedy_q, mean_q, f32_sum_tolerance(mean_q), f"act {name}", min_decided=0.9)


@requires_cuda
@pytest.mark.parametrize("name", NAMES)
def test_cuda_forward_and_backward_match_the_cpu_reference(name):
    check_cuda_forward_backward_act(SHAPES[name], name)


@requires_cuda
@pytest.mark.parametrize("name", NAMES)
def test_cuda_graphed_trainer_step_is_the_public_ops_step(name):
    _trainer_step_is_the_public_ops_step(SHAPES[name], "cuda")


@requires_cuda
@pytest.mark.parametrize("state_dim", [1, 3, 4, 7, 8])
def test_cuda_first_layer_on_few_states_is_the_emulated_rounding(state_dim):
    """On fewer than 8 states (BF16 rows narrower than 16 bytes) the first layer runs its own
    kernel (csrc/cuda/dueling_forward.cu, narrow_input_layer_kernel) instead of a cuBLAS GEMM
    and a bias + ReLU pass; 8 states take the GEMM. Both against the emulated-rounding reference
    (1030 units, stored 1032: more groups of 4 than a block has threads, so a thread takes two),
    and a NaN state keeps its sample's outputs NaN as on the CPU."""
    c = DQNConfig(state_dim=state_dim, trunk_hidden=(1030, 20), value_hidden=6, adv_hidden=5, atoms=11,
                  branches=(2, 3))
    net = make_net(c, "cuda", seed=state_dim)
    poison_cuda_cache()
    check_bf16_mirror_emulated(net, torch.randn(300, state_dim, device="cuda"))
    s = torch.randn(40, state_dim, device="cuda")
    s[7, state_dim - 1] = float("nan")
    poison_cuda_cache()
    gpu = net.forward_full(s)
    cpu = snapshot(net).to("cpu").forward_full(s.cpu())
    nan_rows = gpu.q_logits.isnan().flatten(1).all(1).cpu()
    assert nan_rows.tolist() == [i == 7 for i in range(40)]
    assert torch.equal(cpu.q_logits.isnan(), gpu.q_logits.isnan().cpu())


def test_decode_config_refuses_a_layout_of_the_wrong_length():
    c = SHAPES["trunk3_head2"]
    layout = ParamLayout(c).encode()
    assert c.aligned() != c and dqn_ops.layout.decode_config(layout) == c.aligned()  # the stored network
    for bad in (layout[:-1], layout + [0]):
        with pytest.raises(ValueError, match=rf"\(format 4\), {len(layout)} entries for these sizes, got {len(bad)}"):
            dqn_ops.layout.decode_config(bad)
