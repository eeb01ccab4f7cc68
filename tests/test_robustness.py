"""Robust where users will take it: a second forward before backward, FusedAdamBF16 over several
tensors (one global norm and skip), dtype round trips with an optimizer attached, partial
state dicts, bounded readback memory, step numbers after a resume, acting on no environments."""
import io

import pytest
import torch

from conftest import DEVICES, requires_cuda
from dqn_ops import DQNConfig, DuelingBranchQNet, FusedAdamBF16, NonFiniteError, Trainer, TrainerConfig
from dqn_ops.readback import DeferredReadback
from dqn_ops.trainer import greedy_actions
from reference import TINY

TINY_C51 = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=11, branches=(2, 3))


def _batch(c, B, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    b = dict(states=torch.randn(B, c.state_dim, generator=g), next_states=torch.randn(B, c.state_dim, generator=g),
             actions=torch.stack([torch.randint(0, n, (B,), generator=g) for n in c.branches], 1),
             rewards=torch.randn(B, generator=g), dones=(torch.rand(B, generator=g) < 0.2).float())
    return {k: v.to(device) for k, v in b.items()}


def _states(n=8, seed=0):
    return torch.randn(n, TINY.state_dim, generator=torch.Generator().manual_seed(seed))


# -- 1. a second forward before backward ------------------------------------------------

@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_second_forward_before_backward_keeps_the_saved_mirror(precision):
    net = DuelingBranchQNet(TINY, backward_precision=precision)
    s, s2 = _states(seed=0), _states(seed=1)
    q = net(s)
    q.sum().backward()
    expected = net.flat_params.grad.clone()
    net.flat_params.grad = None

    q = net(s)
    with torch.no_grad():
        net(s2)            # e.g. the double-DQN choice on s'
    greedy_actions(net, s2)  # acting in between
    net(s2).sum()        # a forward with grad, not backpropagated
    q.sum().backward()   # the mirror the first forward saved is intact
    assert torch.equal(net.flat_params.grad, expected)


def test_an_optimizer_step_between_forward_and_backward_is_still_caught():
    net = DuelingBranchQNet(TINY)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    q = net(_states())
    net.flat_params.grad = torch.ones_like(net.flat_params)
    opt.step()  # an in-place update of what the forward saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        q.sum().backward()


def test_the_mirror_follows_every_kind_of_master_update():
    net = DuelingBranchQNet(TINY)
    opt = torch.optim.Adam(net.parameters(), lr=1e-1)
    s = _states()
    for _ in range(3):  # torch.optim step -> next forward refreshes
        opt.zero_grad()
        net(s).square().sum().backward()
        opt.step()
        net(s)
        assert torch.equal(net.params_bf16, net.flat_params.detach().to(torch.bfloat16))
    with torch.no_grad():  # a plain in-place write
        net.flat_params.mul_(0.5)
    net(s)
    assert torch.equal(net.params_bf16, net.flat_params.detach().to(torch.bfloat16))
    with torch.no_grad():  # the mirror overwritten by someone else
        net.params_bf16.zero_()
    net(s)
    assert torch.equal(net.params_bf16, net.flat_params.detach().to(torch.bfloat16))
    other = DuelingBranchQNet(TINY)
    net.load_state_dict(other.state_dict())
    net(s)
    assert torch.equal(net.params_bf16, other.params_bf16)


# -- 2. FusedAdamBF16 over several tensors --------------------------------------------------

def _two_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (37, 100)]


def test_several_tensors_non_finite_grad_skips_all_and_sets_the_flag():
    a, b = _two_params()
    opt = FusedAdamBF16([a, b], lr=1e-2, max_grad_norm=1.0)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    before = [x.detach().clone() for x in (a, b)] + [opt.mirror(x).clone() for x in (a, b)]
    states = [{k: v.clone() for k, v in opt.state[x].items()} for x in (a, b)]
    for bad in (float("nan"), float("inf")):
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
        a.grad[5] = bad  # only in the first tensor: the last call must not clear the flag
        opt.step()
        assert opt.found_inf.item() == 1
        assert not torch.isfinite(opt.grad_norm).all()
        after = [x.detach() for x in (a, b)] + [opt.mirror(x) for x in (a, b)]
        assert all(torch.equal(x, y) for x, y in zip(before, after))
        for x, st in zip((a, b), states):
            assert all(torch.equal(opt.state[x][k], v) for k, v in st.items())
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()  # a finite step again: updates both, flag cleared
    assert opt.found_inf.item() == 0
    assert not torch.equal(a.detach(), before[0]) and not torch.equal(b.detach(), before[1])
    assert opt.state[a]["step"].item() == opt.state[b]["step"].item() == 2


@pytest.mark.parametrize("clip", [None, 0.5, 1e6])
@pytest.mark.parametrize("weight_decay,decoupled", [(0.0, False), (0.01, False), (0.01, True)])
def test_several_tensors_match_global_clip_grad_norm_and_adam(clip, weight_decay, decoupled):
    ours = _two_params()
    ref = [torch.nn.Parameter(p.detach().double().clone()) for p in ours]
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    opt = FusedAdamBF16(ours, **kw, decoupled_weight_decay=decoupled, max_grad_norm=clip)
    ref_opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)(ref, **kw, foreach=False)
    g = torch.Generator().manual_seed(1)
    for step in range(20):
        grads = [torch.randn(p.shape, generator=g) * (1 + 3 * i) for i, p in enumerate(ours)]
        for p, r, gr in zip(ours, ref, grads):
            p.grad, r.grad = gr.clone(), gr.double()
        norm = torch.linalg.vector_norm(torch.cat([gr.double() for gr in grads]))
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref, clip)
            torch.testing.assert_close(ref_norm, norm)
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(opt.grad_norm[0].double(), norm, rtol=1e-5, atol=0)
        assert opt.found_inf.item() == 0
        for p, r in zip(ours, ref):
            torch.testing.assert_close(p.detach().double(), r.detach(), rtol=1e-5, atol=1e-6)
            assert torch.equal(opt.mirror(p), p.detach().to(torch.bfloat16))


def test_several_tensors_clip_with_one_coefficient():
    """Clipping scales every tensor by the global coefficient: a tensor with a small gradient
    moves as if clip_grad_norm_ had scaled it with the others."""
    a, b = _two_params()
    opt = FusedAdamBF16([a, b], lr=1.0, betas=(0.0, 0.0), eps=1.0, max_grad_norm=1.0)
    with torch.no_grad():  # from 0: the update is read exactly
        a.zero_()
        b.zero_()
    a.grad, b.grad = torch.full_like(a, 1e-3), torch.full_like(b, 100.0)
    a0 = a.detach().clone()
    opt.step()
    norm = (a.numel() * 1e-6 + b.numel() * 1e4) ** 0.5
    coef = 1.0 / (norm + 1e-6)
    # beta1 = beta2 = 0: update = lr * g' / (|g'| + eps) with g' = coef * g
    g_a = 1e-3 * coef
    torch.testing.assert_close(a0 - a.detach(), torch.full_like(a, g_a / (g_a + 1.0)), rtol=1e-4, atol=0)


@requires_cuda
def test_several_tensors_on_cuda_never_sync_and_capture_into_a_graph():
    ours = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (37, 1000)]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt, opt_twin = (FusedAdamBF16(ps, lr=1e-2, max_grad_norm=1.0) for ps in (ours, twin))
    grads = [torch.randn_like(p) * 10 for p in ours]
    for p, q, g in zip(ours, twin, grads):
        p.grad, q.grad = g, g.clone()  # ours: static gradients the graph reads
    opt.step()  # (the state is allocated at the first step)
    opt_twin.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt_twin.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        opt.step()
    graph.replay()
    torch.cuda.synchronize()
    for p, q in zip(ours, twin):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(opt.mirror(p), p.detach().to(torch.bfloat16))
    torch.testing.assert_close(opt.grad_norm, opt_twin.grad_norm)
    before = [p.detach().clone() for p in ours]
    grads[0][3] = float("nan")  # in the first tensor only
    graph.replay()
    torch.cuda.synchronize()
    assert opt.found_inf.item() == 1
    assert all(torch.equal(p.detach(), b) for p, b in zip(ours, before))


def test_several_tensors_in_groups_and_without_a_gradient():
    a, b = _two_params()
    opt = FusedAdamBF16([{"params": [a], "lr": 1e-2}, {"params": [b], "lr": 0.0}], max_grad_norm=1.0)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    b0 = b.detach().clone()
    opt.step()
    assert torch.equal(b.detach(), b0)  # its group's lr
    a.grad, b.grad = torch.randn_like(a), None  # a parameter without a gradient is left alone
    opt.step()
    assert opt.state[a]["step"].item() == 2 and opt.state[b]["step"].item() == 1


# -- 6. dtype round trips with an optimizer attached ------------------------------------

def test_double_float_round_trip_keeps_the_optimizer_on_the_forwards_mirror():
    net = DuelingBranchQNet(TINY)
    opt = FusedAdamBF16.for_network(net, lr=1e-2)
    mirror = net.params_bf16
    net.double()
    assert net.params_bf16 is mirror and mirror.dtype == torch.float64
    net.float()
    assert net.params_bf16 is mirror and mirror.dtype == torch.bfloat16
    s = _states()
    before = net(s).detach()
    net(s).square().sum().backward()
    opt.step()
    assert opt.mirror(net.flat_params) is net.params_bf16
    assert torch.equal(net.params_bf16, net.flat_params.detach().to(torch.bfloat16))
    after = net(s).detach()
    assert not torch.equal(before, after)  # the forward reads the updated mirror
    fresh = DuelingBranchQNet(TINY)
    fresh.load_state_dict(net.state_dict())
    assert torch.equal(after, fresh(s).detach())


# -- 7. partial state dicts ------------------------------------------------------------

def test_partial_state_dict_loads_what_is_given_and_names_what_is_missing():
    net, other = DuelingBranchQNet(TINY), DuelingBranchQNet(TINY)
    before = net.state_dict()
    sd = other.state_dict()
    given = ["s1.weight", "s1.bias", "v2.bias"]
    result = net.load_state_dict({k: sd[k] for k in given}, strict=False)
    assert sorted(result.missing_keys) == sorted(k for k in sd if k not in given)
    assert "flat_params" not in result.missing_keys and result.unexpected_keys == []
    now = net.state_dict()
    for k in sd:
        assert torch.equal(now[k], sd[k] if k in given else before[k]), k
    assert torch.equal(net.params_bf16, net.flat_params.detach().to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: .*\"v1.weight\""):
        net.load_state_dict({k: sd[k] for k in given})
    result = net.load_state_dict(sd)  # complete: as before
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert all(torch.equal(v, sd[k]) for k, v in net.state_dict().items())


def test_partial_state_dict_inside_a_parent_module():
    parent, other = torch.nn.ModuleDict(dict(q=DuelingBranchQNet(TINY))), DuelingBranchQNet(TINY)
    result = parent.load_state_dict({"q.s1.weight": other.state_dict()["s1.weight"], "x": torch.zeros(1)},
                                    strict=False)
    assert "q.s1.bias" in result.missing_keys and "q.s1.weight" not in result.missing_keys
    assert result.unexpected_keys == ["x"]
    assert torch.equal(parent["q"].state_dict()["s1.weight"], other.state_dict()["s1.weight"])


# -- 8. bounded readback, step numbers, empty batches ------------------------------------

def test_readback_memory_is_bounded_and_aggregates_cover_every_step():
    fields = ("loss", "grad_norm", "mean_q", "skipped")
    rb = DeferredReadback(fields, interval=3, device="cpu", window=10)
    vals = []
    for step in range(1000):
        v = [float(step % 17), float((step * 7) % 23), -float(step), 0.0]
        vals.append(v)
        rb.record([torch.tensor(x) for x in v], torch.zeros(1))
        rb.after_step()
        assert len(rb.rows) <= 20
    rb.readback()
    assert rb.steps_read == 1000 and 10 <= len(rb.rows) <= 20
    m = rb.summary()
    assert m["steps"] == 1000
    assert m["loss"] == pytest.approx(sum(v[0] for v in vals) / 1000)
    assert m["grad_norm_max"] == max(v[1] for v in vals) and m["loss_last"] == vals[-1][0]
    assert m["mean_q"] == pytest.approx(sum(v[2] for v in vals) / 1000)
    last = rb.summary(last=10)
    assert last["loss"] == pytest.approx(sum(v[0] for v in vals[-10:]) / 10)
    assert last["grad_norm_max"] == max(v[1] for v in vals[-10:])
    assert [r["loss"] for r in rb.rows[-10:]] == [v[0] for v in vals[-10:]]
    with pytest.raises(ValueError, match="window"):
        rb.summary(last=11)
    assert rb.summary(last=5000)["loss"] == m["loss"]  # more than was read: all of them


def test_trainer_metrics_last_and_all():
    t = Trainer(TINY_C51, TrainerConfig(batch_size=8, readback_interval=2, sigma_max=None), device="cpu")
    for i in range(9):
        t.step(_batch(TINY_C51, 8, seed=i))
    t.readback()
    rows = t.stats.rows
    m, m3 = t.metrics(), t.metrics(last=3)
    assert m["steps"] == 9
    assert m["loss"] == pytest.approx(sum(r["loss"] for r in rows) / 9)
    assert m3["loss"] == pytest.approx(sum(r["loss"] for r in rows[-3:]) / 3)


def test_non_finite_step_numbers_continue_after_a_resume():
    c = TINY_C51
    a = Trainer(c, TrainerConfig(batch_size=8, readback_interval=4, on_non_finite="flag"), device="cpu")
    good = _batch(c, 8)
    bad = dict(good, rewards=good["rewards"].clone())
    bad["rewards"][0] = float("nan")
    for _ in range(5):
        a.step(good)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = Trainer(c, TrainerConfig(batch_size=8, readback_interval=4, on_non_finite="flag"), device="cpu")
    b.step(good)  # a step before the load: row 0 of b's readback
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    assert b.steps == 5
    for batch in (good, bad, good, bad):  # steps 5, 6, 7, 8
        b.step(batch)
    b.readback()
    assert b.non_finite_steps == [6, 8]
    r = Trainer(c, TrainerConfig(batch_size=8, readback_interval=4), device="cpu")
    r.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    r.step(good)
    with pytest.raises(NonFiniteError):
        r.step(bad)
        r.readback()
    assert r.non_finite_steps == [6]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("c", [TINY_C51, DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8,
                                                    adv_hidden=8, atoms=1, branches=(3, 3, 3))],
                         ids=["c51", "one_atom"])
def test_acting_on_zero_environments(device, c):
    t = Trainer(c, TrainerConfig(batch_size=8), device=device)
    a = t.act(torch.zeros(0, c.state_dim, device=device))
    assert a.shape == (0, c.num_branches) and a.dtype == torch.int64 and a.device.type == device
    a = greedy_actions(t.online, torch.zeros(0, c.state_dim, device=device))
    assert a.shape == (0, c.num_branches) and a.dtype == torch.int64
    assert t.act(torch.randn(3, c.state_dim, device=device)).shape == (3, c.num_branches)
