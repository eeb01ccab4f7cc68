"""Property-based tests (hypothesis) of the CPU reference path over random sizes and configs:
every op against an independent float64 reference, and the Trainer's step staying finite."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dqn_ops
from dqn_ops import DQNConfig, DuelingBranchQNet, Trainer, TrainerConfig
from reference import power_iteration_f64, reference_net_like
from test_loss import _check, reference_bdq, reference_c51, sample_batch
from test_spectral_norm import _buffers

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

@st.composite
def configs(draw):
    """Any network shape: 1-3 trunk layers, 0-2 head layers, dueling or not."""
    depth, dueling = draw(st.integers(0, 2)), draw(st.booleans())
    widths = st.lists(st.integers(1, 9), min_size=depth, max_size=depth).map(tuple)
    return DQNConfig(state_dim=draw(st.integers(1, 12)),
                     trunk_hidden=draw(st.lists(st.integers(1, 16), min_size=1, max_size=3).map(tuple)),
                     value_hidden=draw(widths) if dueling else (), adv_hidden=draw(widths),
                     atoms=draw(st.one_of(st.just(1), st.integers(2, 9))),
                     branches=draw(st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)), dueling=dueling)


@SETTINGS
@given(c=configs(), batch=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_float64_forward_and_backward_equal_the_nn_linear_reference(c, batch, seed):
    g = torch.Generator().manual_seed(seed)
    net = DuelingBranchQNet(c, generator=g).double()
    ref = reference_net_like(net)
    s = torch.randn(batch, c.state_dim, dtype=torch.float64, generator=g).requires_grad_()
    s_ref = s.detach().clone().requires_grad_()
    gq = torch.randn(batch, c.total_actions, c.atoms, dtype=torch.float64, generator=g)
    q = net(s)
    (q * gq).sum().backward()
    q_ref, _ = ref(s_ref)
    (q_ref * gq).sum().backward()
    torch.testing.assert_close(q, q_ref, rtol=1e-10, atol=1e-10)
    views = net.layer_views(net.flat_params.grad)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(views[name], p.grad, rtol=1e-9, atol=1e-10, msg=name)
    torch.testing.assert_close(s.grad, s_ref.grad, rtol=1e-9, atol=1e-10)


@SETTINGS
@given(branches=st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple), atoms=st.integers(1, 12),
       batch=st.integers(1, 40), gamma=st.floats(0.0, 1.0), weighted=st.booleans(),
       support=st.tuples(st.floats(-20, 0), st.floats(0.5, 20)))
def test_loss_equals_the_float64_reference(branches, atoms, batch, gamma, weighted, support):
    v_min, v_max = support[0], support[0] + support[1]
    q, qo, qt, actions, rewards, dones, weights = sample_batch(batch, branches, atoms, "cpu", v_max=max(abs(v_min),
                                                                                                       v_max))
    w = weights if weighted else None
    loss_type = "c51" if atoms > 1 else "mse"
    out = dqn_ops.dqn_loss(q, qo, qt, actions, rewards, dones, branches, v_min=v_min, v_max=v_max, gamma=gamma,
                           weights=w, loss_type=loss_type)
    if atoms > 1:
        ref = reference_c51(q, qo, qt, actions, rewards, dones, branches, v_min, v_max, gamma, w)
    else:
        ref = reference_bdq(q, qo, qt, actions, rewards, dones, branches, gamma, "mse", w)
    _check(out, ref)


@SETTINGS
@given(shapes=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=5),
       iterations=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_spectral_norm_equals_float64_power_iteration(shapes, iterations, seed):
    torch.manual_seed(seed)
    params, mirror, u, v, sigma, matrices = _buffers(shapes, "cpu")
    W0 = [params[o:o + r * c].view(r, c).clone() for o, r, c in zip(matrices[0::3], matrices[1::3], matrices[2::3])]
    u0 = torch.split(u.clone(), [r for r, _ in shapes])
    dqn_ops.batched_spectral_norm(params, mirror, u, v, sigma, matrices, [1e30] * len(shapes), iterations)
    for m, (W, u_start) in enumerate(zip(W0, u0)):
        s_ref, _, _ = power_iteration_f64(W, u_start, iterations)
        assert abs(sigma[m].item() - s_ref) <= 1e-5 * s_ref + 1e-7


@SETTINGS
@given(n=st.integers(1, 300), lr=st.floats(1e-5, 1e-1), wd=st.floats(0, 0.1), decoupled=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_adam_equals_torch_adam(n, lr, wd, decoupled, seed):
    g = torch.Generator().manual_seed(seed)
    p_ref = torch.nn.Parameter(torch.randn(n, generator=g))
    p = torch.nn.Parameter(p_ref.detach().clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = cls([p_ref], lr=lr, weight_decay=wd, foreach=False)
    ours = dqn_ops.FusedAdamBF16([p], lr=lr, weight_decay=wd, decoupled_weight_decay=decoupled)
    for _ in range(5):
        grad = torch.randn(n, generator=g)
        p_ref.grad, p.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(p.detach(), p_ref.detach(), rtol=2e-5, atol=1e-6)
    assert torch.equal(ours.mirror(p), p.detach().to(torch.bfloat16))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=configs(), batch=st.integers(1, 16), seed=st.integers(0, 1000))
def test_trainer_steps_stay_finite_on_any_config(c, batch, seed):
    t = Trainer(c, TrainerConfig(batch_size=batch, readback_interval=2), device="cpu", seed=seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        t.step(dict(states=torch.randn(batch, c.state_dim, generator=g),
                    next_states=torch.randn(batch, c.state_dim, generator=g),
                    actions=torch.stack([torch.randint(0, n, (batch,), generator=g) for n in c.branches], 1),
                    rewards=torch.randn(batch, generator=g), dones=(torch.rand(batch, generator=g) < 0.3).float()))
    m = t.readback()
    assert m["steps"] == 3 and m["skipped"] == 0 and t.non_finite_steps == []
    assert torch.isfinite(t.online.flat_params).all() and torch.isfinite(t.target.flat_params).all()
