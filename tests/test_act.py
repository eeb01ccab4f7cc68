"""act (epsilon-greedy acting on the device) against independent references: the float64
nn.Linear network and a float64 expectation for the greedy choice, the Python Philox of
tests/reference.py for every random draw, and greedy_from_logits(bf16_dueling_forward(...))."""
import math

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dqn_ops
from conftest import DEVICES, behind_a_sleep, requires_cuda, warm_side_stream
from dqn_ops import DQNConfig, DuelingBranchQNet, Trainer, TrainerConfig
from dqn_ops.trainer import greedy_actions, greedy_from_logits
from poison import poison_cuda_cache
from reference import STREAM_ACT, CONFIGS, TINY, philox_below, philox_draw, philox_uniform, reference_net_like

act_op = torch.ops.dqn_ops.act.default
V_MIN, V_MAX = -10.0, 10.0
# The expectation's own rounding (F32 on CUDA, double rounded to F32 on the CPU) on values of
# the support's scale: far above both, far below the BF16 logits' effect.
EXPECTATION_ATOL = 1e-4


def make_net(config, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    net = DuelingBranchQNet(config, generator=g).to(device)
    return net.double() if dtype == torch.float64 else net


def net_args(net):
    return net.flat_params.detach(), net.params_bf16, net._layout_ints


def int64_of(u: int) -> int:
    u &= (1 << 64) - 1
    return u - (1 << 64) if u >= 1 << 63 else u


def rng_of(seed: int, call: int, device) -> torch.Tensor:
    return torch.tensor([int64_of(seed), int64_of(call)], dtype=torch.int64, device=device)


def eps_of(value: float, device) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=device)


def call_act(net, states, epsilon, rng, v_min=V_MIN, v_max=V_MAX):
    return dqn_ops.ops.act(states, *net_args(net), v_min, v_max, epsilon, rng)


def expected_q_f64(q: torch.Tensor, v_min=V_MIN, v_max=V_MAX) -> torch.Tensor:
    """[N, A, atoms] logits -> [N, A] expected Q, in float64 (one atom: q)."""
    q = q.double().cpu()
    atoms = q.shape[-1]
    if atoms == 1:
        return q[..., 0]
    support = v_min + torch.arange(atoms, dtype=torch.float64) * ((v_max - v_min) / (atoms - 1))
    return (q.softmax(-1) * support).sum(-1)


def branch_slices(c):
    off = 0
    for n in c.branches:
        yield off, n
        off += n


def reference_random_actions(c, seed, call, rows):
    """[len(rows), D] of philox_below(philox_draw(STREAM_ACT, seed, call, n, 1 + d), n_d), n in rows (an int: range(rows))."""
    rows = range(rows) if isinstance(rows, int) else list(rows)
    return torch.tensor([[philox_below(philox_draw(STREAM_ACT, seed, call, n, 1 + d), nd) for d, nd in enumerate(c.branches)]
                         for n in rows], dtype=torch.int64).reshape(len(rows), c.num_branches)


def chosen_q(c, E, actions):
    """E [N, A] at each branch's action: [N, D]."""
    offsets = torch.tensor([off for off, _ in branch_slices(c)])
    return E.gather(1, actions.cpu() + offsets)


def reference_explores(seed, call, rows, epsilon):
    eps32 = np.float32(epsilon)
    return torch.tensor([np.float32(philox_uniform(philox_draw(STREAM_ACT, seed, call, n, 0))) < eps32 for n in range(rows)],
                        dtype=torch.bool)


def assert_greedy(c, actions, greedy_q, E, tol, what, min_decided=0.5):
    """actions [N, D] pick, per branch, an argmax of E [N, A] (float64) up to `tol` [N]: where
    the best and second-best are more than 2 tol apart the argmax itself, else (a near tie) an
    action within 2 tol of the best; greedy_q (None: not checked) within tol of E at the chosen
    action. Returns the number of decided (row, branch) pairs, at least `min_decided` of them."""
    actions = actions.cpu()
    greedy_q = None if greedy_q is None else greedy_q.double().cpu()
    N = actions.shape[0]
    rows = torch.arange(N)
    decided = 0
    for d, (off, n) in enumerate(branch_slices(c)):
        Ed = E[:, off:off + n]
        a = actions[:, d]
        assert ((a >= 0) & (a < n)).all(), f"{what}: branch {d}: an action out of range"
        best, arg = Ed.max(1)
        if n > 1:
            second = Ed.topk(2, dim=1).values[:, 1]
            clear = (best - second) > 2 * tol
        else:
            clear = torch.ones(N, dtype=torch.bool)
        chosen = Ed[rows, a]
        wrong = clear & (a != arg)
        assert not wrong.any(), (f"{what}: branch {d}: rows {wrong.nonzero().flatten()[:8].tolist()} chose "
                                 f"{a[wrong][:8].tolist()}, the reference {arg[wrong][:8].tolist()}")
        assert (chosen >= best - 2 * tol).all(), f"{what}: branch {d}: a near-tie choice beyond the tolerance"
        if greedy_q is not None:
            err = (greedy_q[:, d] - chosen).abs()
            assert (err <= tol).all(), (f"{what}: branch {d}: greedy_q off by {err.max().item():.3g} "
                                        f"(tol {tol.max():.3g})")
        decided += int(clear.sum())
    assert decided >= min_decided * N * c.num_branches, f"{what}: only {decided} decided pairs: a vacuous test"
    return decided


def bf16_tolerance(c, q_ours, q64):
    """Per row, a bound on how far the expected Q of the BF16 logits q_ours can be from that of
    the float64 logits q64. d E / d x_j = p_j (z_j - E), so |dE| <= max_j |dx_j| * sum_j p_j |z_j - E|
    <= max_j |dx_j| * std_p(z) <= max_j |dx_j| (v_max - v_min) / 2 along the whole path from q64
    to q_ours (one atom: |dE| = |dx|). The BF16 error max_j |dx_j| is measured on the row
    (bf16_dueling_forward's logits, the ones act computes), plus the expectation's own rounding."""
    dx = (q_ours.double().cpu() - q64.double().cpu()).abs().flatten(1).amax(1)
    scale = (V_MAX - V_MIN) / 2 if c.atoms > 1 else 1.0
    return dx * scale + EXPECTATION_ATOL


# ----------------------------------------------------------------------------------------
# epsilon = 0: the greedy choice

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_float64_reference_up_to_bf16_near_ties(device, name):
    c = CONFIGS[name]
    net = make_net(c, device)
    s = torch.randn(700, c.state_dim, device=device)
    ref = reference_net_like(net)
    q64, _ = ref(s.double().cpu())
    fwd = dqn_ops.bf16_dueling_forward(s, *net_args(net))
    if device == "cuda":
        poison_cuda_cache()
    rng = rng_of(123, 0, device)
    out = call_act(net, s, eps_of(0.0, device), rng)
    assert out.actions.shape == (700, c.num_branches) and out.actions.dtype == torch.int64
    assert out.greedy_q.shape == (700, c.num_branches) and out.greedy_q.dtype == torch.float32
    assert out.actions.device == s.device and out.greedy_q.device == s.device
    tol = bf16_tolerance(c, fwd.q_logits, q64)
    assert assert_greedy(c, out.actions, out.greedy_q, expected_q_f64(q64), tol, f"{name} vs float64")
    assert rng.tolist() == [123, 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_greedy_from_logits_of_bf16_dueling_forward(device, name):
    """The same logits as bf16_dueling_forward on the same backend: the choice is that of its
    q_logits' expected Q, up to the expectation's rounding (near ties of EXPECTATION_ATOL)."""
    c = CONFIGS[name]
    net = make_net(c, device)
    s = torch.randn(500, c.state_dim, device=device)
    q = dqn_ops.bf16_dueling_forward(s, *net_args(net)).q_logits
    out = call_act(net, s, eps_of(0.0, device), rng_of(5, 9, device))
    tol = torch.full((500,), EXPECTATION_ATOL, dtype=torch.float64)
    assert_greedy(c, out.actions, out.greedy_q, expected_q_f64(q), tol, name, min_decided=0.95)
    # greedy_from_logits (torch's float32 softmax) makes the same choices wherever they are decided.
    theirs = greedy_from_logits(q, c.branches, V_MIN, V_MAX).cpu()
    assert_greedy(c, theirs, out.greedy_q, expected_q_f64(q), tol, f"{name}: greedy_from_logits", 0.95)
    # greedy_actions and Trainer.act run the op: the same actions.
    assert torch.equal(greedy_actions(net, s, V_MIN, V_MAX), out.actions)


def test_float64_cpu_path_is_the_float64_reference():
    """The CPU's float64 path (mirror float64: nothing rounded) against the nn.Linear network in
    float64: logits and expectation to double precision, so greedy_q to 1e-10 and the actions
    exactly but for ties within that."""
    for name, c in CONFIGS.items():
        net = make_net(c, "cpu", torch.float64)
        s = torch.randn(300, c.state_dim, dtype=torch.float64)
        q64, _ = reference_net_like(net)(s)
        out = call_act(net, s, eps_of(0.0, "cpu"), rng_of(1, 2, "cpu"))
        assert out.greedy_q.dtype == torch.float64
        tol = torch.full((300,), 1e-10, dtype=torch.float64)
        assert_greedy(c, out.actions, out.greedy_q, expected_q_f64(q64), tol, name, min_decided=0.99)


@pytest.mark.parametrize("device", DEVICES)
def test_one_atom_greedy_is_the_forwards_q_bit_for_bit(device):
    """With one atom greedy_q is a q logit itself: act's logits are bf16_dueling_forward's, bit
    for bit, on each backend, and the choice is torch.argmax's (the first of equal maxima)."""
    c = CONFIGS["one_atom"]
    net = make_net(c, device)
    s = torch.randn(1000, c.state_dim, device=device)
    q = dqn_ops.bf16_dueling_forward(s, *net_args(net)).q_logits[..., 0]
    if device == "cuda":
        poison_cuda_cache()
    out = call_act(net, s, eps_of(0.0, device), rng_of(0, 0, device))
    for d, (off, n) in enumerate(branch_slices(c)):
        best, arg = q[:, off:off + n].max(1)
        assert torch.equal(out.actions[:, d], q[:, off:off + n].argmax(1))
        assert torch.equal(out.greedy_q[:, d], best)


@pytest.mark.parametrize("device", DEVICES)
def test_support_bounds_are_used(device):
    """v_min / v_max shift and scale the expected Q as the support does: greedy_q on [a, b]
    against the float64 expectation of the same logits on that support (C51), and ignored for one atom."""
    c = CONFIGS["odd_widths"]
    net = make_net(c, device)
    s = torch.randn(64, c.state_dim, device=device)
    q = dqn_ops.bf16_dueling_forward(s, *net_args(net)).q_logits
    for lo, hi in [(-1.0, 3.0), (0.0, 200.0)]:
        out = call_act(net, s, eps_of(0.0, device), rng_of(0, 0, device), lo, hi)
        E = expected_q_f64(q, lo, hi)
        tol = torch.full((64,), 1e-5 * (hi - lo), dtype=torch.float64)
        assert_greedy(c, out.actions, out.greedy_q, E, tol, f"support [{lo}, {hi}]", min_decided=0.9)
    one = make_net(CONFIGS["one_atom"], device)
    s1 = torch.randn(16, one.config.state_dim, device=device)
    a = call_act(one, s1, eps_of(0.0, device), rng_of(0, 0, device), 3.0, 3.0)  # not checked for one atom
    b = call_act(one, s1, eps_of(0.0, device), rng_of(0, 0, device))
    assert torch.equal(a.actions, b.actions) and torch.equal(a.greedy_q, b.greedy_q)


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_state_gives_nan_greedy_q_and_action_0_in_its_row_only(device):
    """torch.argmax's rule (the first NaN wins): a NaN state makes every logit of its row NaN."""
    c = CONFIGS["reference"]
    net = make_net(c, device)
    s = torch.randn(32, c.state_dim, device=device)
    s[7, 2] = float("nan")
    out = call_act(net, s, eps_of(0.0, device), rng_of(0, 0, device))
    assert torch.isnan(out.greedy_q[7]).all() and (out.actions[7] == 0).all()
    others = torch.cat([out.greedy_q[:7], out.greedy_q[8:]])
    assert torch.isfinite(others).all()
    q = dqn_ops.bf16_dueling_forward(s, *net_args(net)).q_logits
    assert torch.equal(greedy_from_logits(q, c.branches, V_MIN, V_MAX)[7], out.actions[7])


# ----------------------------------------------------------------------------------------
# Exploration: Philox draws

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_epsilon_one_takes_the_philox_reference_actions(device, name):
    c = CONFIGS[name]
    net = make_net(c, device)
    N = 150
    s = torch.randn(N, c.state_dim, device=device)
    seed, call = 0x9E3779B97F4A7C15, (1 << 32) + 3  # both words of the seed and of the counter
    rng = rng_of(seed, call, device)
    greedy = call_act(net, s, eps_of(0.0, device), rng_of(seed, call, device))
    if device == "cuda":
        poison_cuda_cache()
    out = call_act(net, s, eps_of(1.0, device), rng)
    assert torch.equal(out.actions.cpu(), reference_random_actions(c, seed, call, N))
    assert rng.tolist() == [int64_of(seed), call + 1]
    # greedy_q is the greedy action's, before exploration
    assert torch.equal(out.greedy_q, greedy.greedy_q)


@pytest.mark.parametrize("device", DEVICES)
def test_each_call_draws_anew_and_a_seed_reproduces(device):
    c = TINY
    net = make_net(c, device)
    s = torch.randn(200, c.state_dim, device=device)
    one = eps_of(1.0, device)
    rng = rng_of(42, 0, device)
    runs = [call_act(net, s, one, rng).actions for _ in range(3)]
    assert rng.tolist() == [42, 3]
    for call, a in enumerate(runs):
        assert torch.equal(a.cpu(), reference_random_actions(c, 42, call, 200))
    assert not torch.equal(runs[0], runs[1]) and not torch.equal(runs[1], runs[2])
    again = rng_of(42, 1, device)
    assert torch.equal(call_act(net, s, one, again).actions, runs[1])
    other_seed = call_act(net, s, one, rng_of(43, 1, device)).actions
    assert not torch.equal(other_seed, runs[1])


@pytest.mark.parametrize("device", DEVICES)
def test_the_call_counter_wraps_as_unsigned(device):
    c = TINY
    net = make_net(c, device)
    s = torch.randn(20, c.state_dim, device=device)
    rng = rng_of(7, (1 << 64) - 1, device)  # -1 as int64
    out = call_act(net, s, eps_of(1.0, device), rng)
    assert torch.equal(out.actions.cpu(), reference_random_actions(c, 7, (1 << 64) - 1, 20))
    assert rng.tolist() == [7, 0]
    rng = rng_of(7, (1 << 63) - 1, device)  # int64's largest: the next call is 2^63
    call_act(net, s, eps_of(1.0, device), rng)
    assert rng.tolist() == [7, int64_of(1 << 63)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("epsilon", [0.3, 0.85])
def test_explore_mask_is_the_references_u_below_epsilon(device, epsilon):
    c = CONFIGS["five_branches"]
    net = make_net(c, device)
    N = 2000
    s = torch.randn(N, c.state_dim, device=device)
    seed, call = 2024, 17
    greedy = call_act(net, s, eps_of(0.0, device), rng_of(seed, call, device))
    out = call_act(net, s, eps_of(epsilon, device), rng_of(seed, call, device))
    explore = reference_explores(seed, call, N, epsilon)
    random = reference_random_actions(c, seed, call, N)
    expected = torch.where(explore[:, None], random, greedy.actions.cpu())
    assert torch.equal(out.actions.cpu(), expected)
    assert torch.equal(out.greedy_q, greedy.greedy_q)
    # not vacuous: the mask decides many rows, and its rate is epsilon's (binomial, 6 sigma)
    visible = (random != greedy.actions.cpu()).any(1)
    assert (visible & explore).sum() > 0.25 * epsilon * N and (visible & ~explore).sum() > 0.1 * N
    assert abs(explore.float().mean().item() - epsilon) < 6 * math.sqrt(epsilon * (1 - epsilon) / N)


@pytest.mark.parametrize("device", DEVICES)
def test_epsilon_edge_values(device):
    """epsilon <= 0 never explores, >= 1 always, NaN never (every comparison with NaN is false)."""
    c = TINY
    net = make_net(c, device)
    s = torch.randn(300, c.state_dim, device=device)
    greedy = call_act(net, s, eps_of(0.0, device), rng_of(3, 0, device)).actions
    random = reference_random_actions(c, 3, 0, 300)
    for value, expected in [(-0.5, greedy), (float("nan"), greedy), (-float("inf"), greedy), (1.0, random),
                            (1.5, random), (float("inf"), random)]:
        out = call_act(net, s, eps_of(value, device), rng_of(3, 0, device))
        assert torch.equal(out.actions.cpu(), expected.cpu()), value
    assert not torch.equal(greedy.cpu(), random)


@pytest.mark.parametrize("device", DEVICES)
def test_random_actions_are_uniform_chi_square(device):
    """Each branch's random actions over many rows against the uniform distribution: Pearson's
    chi-square, p-value from the regularised upper incomplete gamma, at alpha = 1e-4 (the seed
    is fixed, so the verdict is too)."""
    c = CONFIGS["five_branches"]
    net = make_net(c, device)
    N = 40000
    s = torch.randn(N, c.state_dim, device=device)
    out = call_act(net, s, eps_of(1.0, device), rng_of(99, 5, device)).actions.cpu()
    for d, n in enumerate(c.branches):
        counts = torch.bincount(out[:, d], minlength=n).double()
        assert counts.numel() == n
        expected = N / n
        stat = ((counts - expected) ** 2 / expected).sum()
        p = torch.special.gammaincc(torch.tensor((n - 1) / 2, dtype=torch.float64), stat / 2).item()
        assert p > 1e-4, f"branch {d} ({n} actions): counts {counts.tolist()}, chi2 {stat.item():.1f}, p {p:.2e}"
    # and the explore bit is uniform too: its rate at epsilon = 0.5 within 5 sigma (the reference's
    # bits, which are the op's: test_explore_mask_is_the_references_u_below_epsilon)
    explore = reference_explores(99, 5, 4000, 0.5)
    assert abs(explore.float().mean().item() - 0.5) < 5 * math.sqrt(0.25 / 4000)


# ----------------------------------------------------------------------------------------
# Empty batches, shapes, opcheck, compile

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["reference", "one_atom"])
def test_zero_rows_return_empty_and_leave_rng(device, name):
    c = CONFIGS[name]
    net = make_net(c, device)
    rng = rng_of(11, 4, device)
    out = call_act(net, torch.zeros(0, c.state_dim, device=device), eps_of(1.0, device), rng)
    assert out.actions.shape == (0, c.num_branches) and out.actions.dtype == torch.int64
    assert out.greedy_q.shape == (0, c.num_branches) and out.greedy_q.device == rng.device
    assert rng.tolist() == [11, 4]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    c = CONFIGS["odd_widths"]
    net = make_net(c, device)
    s = torch.randn(12, c.state_dim, device=device)
    for eps in (0.0, 0.5):
        torch.library.opcheck(act_op, (s, *net_args(net), V_MIN, V_MAX, eps_of(eps, device), rng_of(8, 1, device)))
    torch.library.opcheck(act_op, (s[:0], *net_args(net), V_MIN, V_MAX, eps_of(0.5, device), rng_of(8, 1, device)))


def test_fake_kernel_shapes_and_errors():
    c = CONFIGS["five_branches"]
    net = make_net(c, "cpu")
    layout = net._layout_ints
    with FakeTensorMode():
        s = torch.empty(33, c.state_dim)
        p, m = torch.empty(net.layout.numel), torch.empty(net.layout.numel, dtype=torch.bfloat16)
        eps, rng = torch.empty(1), torch.empty(2, dtype=torch.int64)
        a, g = act_op(s, p, m, layout, V_MIN, V_MAX, eps, rng)
        assert a.shape == (33, 5) and a.dtype == torch.int64 and g.shape == (33, 5) and g.dtype == torch.float32
        with pytest.raises(RuntimeError, match=r"dqn_ops.act: states: expected shape \[\*, 24\]"):
            act_op(torch.empty(3, 23), p, m, layout, V_MIN, V_MAX, eps, rng)
        with pytest.raises(RuntimeError, match="dqn_ops.act: epsilon: expected one element"):
            act_op(s, p, m, layout, V_MIN, V_MAX, torch.empty(2), rng)
        with pytest.raises(RuntimeError, match=r"dqn_ops.act: rng: expected int64 \[2\]"):
            act_op(s, p, m, layout, V_MIN, V_MAX, eps, torch.empty(3, dtype=torch.int64))


def test_compile_fullgraph_matches_eager():
    c = TINY
    net = make_net(c, "cpu")
    s = torch.randn(40, c.state_dim)
    args = net_args(net)

    def f(states, epsilon, rng):
        return dqn_ops.ops.act(states, *args, V_MIN, V_MAX, epsilon, rng)

    compiled = torch.compile(f, fullgraph=True)
    eps = eps_of(0.5, "cpu")
    rng_c, rng_e = rng_of(6, 0, "cpu"), rng_of(6, 0, "cpu")
    for _ in range(2):  # the mutation of rng is part of the compiled graph
        a_c, q_c = compiled(s, eps, rng_c)
        a_e, q_e = f(s, eps, rng_e)
        assert torch.equal(a_c, a_e) and torch.equal(q_c, q_e)
        assert torch.equal(rng_c, rng_e)
    assert rng_c.tolist() == [6, 2]


# ----------------------------------------------------------------------------------------
# Bad input

def _bad_args(device, c=TINY):
    net = make_net(c, device)
    p, m, layout = net_args(net)
    return dict(states=torch.randn(4, c.state_dim, device=device), params=p, params_bf16=m, layout=layout,
                v_min=V_MIN, v_max=V_MAX, epsilon=eps_of(0.1, device), rng=rng_of(1, 0, device))


def _call(a):
    return act_op(a["states"], a["params"], a["params_bf16"], a["layout"], a["v_min"], a["v_max"], a["epsilon"],
                  a["rng"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(states=a["states"][:, :-1]), r"states: expected shape \[\*, 5\], got \[4, 4\]"),
    (lambda a: a.update(states=a["states"][None]), r"states: expected shape \[\*, 5\], got \[1, 4, 5\]"),
    (lambda a: a.update(states=a["states"].double()), "states: expected dtype Float, got Double"),
    (lambda a: a.update(states=torch.randn(5, 4, device=a["states"].device).t()), "states: expected a contiguous"),
    (lambda a: a.update(params=a["params"][:-8]), r"params: expected shape \["),
    (lambda a: a.update(params_bf16=a["params_bf16"].half()), "params_bf16: expected dtype BFloat16"),
    (lambda a: a.update(epsilon=torch.zeros(2, device=a["states"].device)), r"epsilon: expected one element, got shape \[2\]"),
    (lambda a: a.update(epsilon=torch.zeros((), device=a["states"].device)[None][:0]), "epsilon: expected one element"),
    (lambda a: a.update(epsilon=a["epsilon"].double()), "epsilon: expected dtype Float, got Double"),
    (lambda a: a.update(rng=a["rng"].int()), "rng: expected dtype Long, got Int"),
    (lambda a: a.update(rng=torch.zeros(3, dtype=torch.long, device=a["states"].device)), r"rng: expected shape \[2\], got \[3\]"),
    (lambda a: a.update(rng=torch.zeros(2, 2, dtype=torch.long, device=a["states"].device)[:, 0]), "rng: expected a contiguous"),
    (lambda a: a.update(epsilon=a["rng"].view(torch.float32)[1:2]), "rng and epsilon must not share memory"),
    (lambda a: a.update(layout=a["layout"][:-1]), "layout: ended after 25 entries, before the buffer length"),
    (lambda a: a.update(layout=[*a["layout"][:-1], 8]), "lies outside the buffer"),
    (lambda a: a.update(v_min=1.0, v_max=1.0), "v_min must be below v_max, both finite .*got v_min=1.0+, v_max=1.0+"),
    (lambda a: a.update(v_min=2.0, v_max=-2.0), "v_min must be below v_max"),
    (lambda a: a.update(v_max=float("inf")), "v_min must be below v_max, both finite"),
    (lambda a: a.update(v_min=float("nan")), "v_min must be below v_max, both finite"),
])
def test_bad_inputs_name_op_and_argument(device, mutate, match):
    a = _bad_args(device)
    mutate(a)
    before = a["rng"].clone()
    with pytest.raises(RuntimeError, match="dqn_ops.act: .*" + match):
        _call(a)
    assert torch.equal(a["rng"], before)


@requires_cuda
def test_cuda_rejects_other_devices_and_f64():
    a = _bad_args("cuda")
    for key, match in [("states", "states: expected a tensor on cuda:0, got one on cpu"),
                       ("epsilon", "epsilon: expected a tensor on cuda:0, got one on cpu"),
                       ("rng", "rng: expected a tensor on cuda:0, got one on cpu")]:
        with pytest.raises(RuntimeError, match="dqn_ops.act: " + match):
            _call(dict(a, **{key: a[key].cpu()}))
    with pytest.raises(RuntimeError, match="dqn_ops.act: params: expected dtype Float, got Double"):
        _call(dict(a, params=a["params"].double(), states=a["states"].double()))


def test_cpu_reference_path_dtype_rules():
    a = _bad_args("cpu")
    with pytest.raises(RuntimeError, match=r"dqn_ops.act: params_bf16: expected dtype BFloat16 \(or params' dtype"):
        _call(dict(a, params_bf16=a["params"].double()))


# ----------------------------------------------------------------------------------------
# Module and trainer

@pytest.mark.parametrize("device", DEVICES)
def test_module_and_trainer_act(device):
    c = CONFIGS["odd_widths"]
    t = Trainer(c, TrainerConfig(batch_size=8, v_min=-3.0, v_max=5.0), device=device, seed=77)
    s = torch.randn(300, c.state_dim, device=device)
    q = t.online(s)
    greedy = t.act(s)
    tol = torch.full((300,), EXPECTATION_ATOL, dtype=torch.float64)
    E = expected_q_f64(q, -3.0, 5.0)
    out0 = t.online.act(s, eps_of(0.0, device), rng_of(0, 0, device), -3.0, 5.0)
    assert torch.equal(greedy, out0.actions)
    assert_greedy(c, greedy, out0.greedy_q, E, tol, "Trainer.act", min_decided=0.95)
    assert t.act(s[:0]).shape == (0, c.num_branches)
    # act_explore: the trainer's seed and a counter it advances; epsilon read from the tensor
    eps = eps_of(1.0, device)
    a0, g0 = t.act_explore(s, eps)
    assert torch.equal(a0.cpu(), reference_random_actions(c, 77, 0, 300))
    assert torch.equal(g0, out0.greedy_q)
    eps.fill_(0.0)
    a1, _ = t.act_explore(s, eps)
    assert torch.equal(a1, greedy)
    eps.fill_(1.0)
    a2, _ = t.act_explore(s, eps)
    assert torch.equal(a2.cpu(), reference_random_actions(c, 77, 2, 300))
    assert t.explore_rng.tolist() == [77, 3]
    again = Trainer(c, TrainerConfig(batch_size=8, v_min=-3.0, v_max=5.0), device=device, seed=77)
    assert torch.equal(again.act_explore(s, eps_of(1.0, device))[0], a0)


def test_trainer_seed_beyond_int64_is_its_low_64_bits():
    c = TINY
    t = Trainer(c, TrainerConfig(batch_size=4), device="cpu", seed=(1 << 64) - 2)
    assert t.explore_rng.tolist() == [-2, 0]
    s = torch.randn(30, c.state_dim)
    a, _ = t.act_explore(s, eps_of(1.0, "cpu"))
    assert torch.equal(a, reference_random_actions(c, (1 << 64) - 2, 0, 30))


# ----------------------------------------------------------------------------------------
# CUDA: the CPU reference, graphs, syncs, poison

@requires_cuda
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_matches_cpu_reference(name):
    """The CPU kernel rounds where the GPU does; only the GEMMs' and the expectation's F32
    summation order differ: near ties aside, the same choices; the same draws always."""
    c = CONFIGS[name]
    net = make_net(c, "cuda")
    s = torch.randn(600, c.state_dim, device="cuda")
    rng_g, rng_c = rng_of(31, 4, "cuda"), rng_of(31, 4, "cpu")
    poison_cuda_cache()
    g = call_act(net, s, eps_of(0.0, "cuda"), rng_g)
    q_gpu = dqn_ops.bf16_dueling_forward(s, *net_args(net)).q_logits
    net_cpu = make_net(c, "cpu")
    net_cpu.load_state_dict(net.state_dict())
    q_cpu = dqn_ops.bf16_dueling_forward(s.cpu(), *net_args(net_cpu)).q_logits
    cpu = call_act(net_cpu, s.cpu(), eps_of(0.0, "cpu"), rng_c)
    # a bound from the measured CPU/GPU logit difference, as bf16_tolerance; both devices' choices
    # against the CPU logits' expectation, so the two agree wherever the choice is clear
    tol = bf16_tolerance(c, q_gpu, q_cpu)
    E = expected_q_f64(q_cpu)
    assert_greedy(c, g.actions, g.greedy_q, E, tol, f"{name}: cuda vs cpu", min_decided=0.9)
    assert_greedy(c, cpu.actions, cpu.greedy_q, E, tol, f"{name}: cpu", min_decided=0.9)
    assert rng_g.tolist() == rng_c.tolist() == [31, 5]
    one_g = call_act(net, s, eps_of(1.0, "cuda"), rng_g).actions
    one_c = call_act(net_cpu, s.cpu(), eps_of(1.0, "cpu"), rng_c).actions
    assert torch.equal(one_g.cpu(), one_c)


@requires_cuda
@pytest.mark.parametrize("name", ["reference", "one_atom", "five_branches"])
def test_cuda_graph_replays_draw_anew_and_read_epsilon(name):
    c = CONFIGS[name]
    net = make_net(c, "cuda")
    N, seed = 256, 0xDEADBEEF
    s = torch.randn(N, c.state_dim, device="cuda")
    eps = eps_of(1.0, "cuda")
    rng = rng_of(seed, 0, "cuda")
    greedy = call_act(net, s, eps_of(0.0, "cuda"), rng_of(seed, 0, "cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call_act(net, s, eps, rng)  # warm-up: cuBLAS handle and workspace before capture
    torch.cuda.current_stream().wait_stream(side)
    rng.copy_(rng_of(seed, 0, "cuda"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # (entering it synchronises: the check starts inside)
        torch.cuda.set_sync_debug_mode("error")
        try:
            static = call_act(net, s, eps, rng)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert rng.tolist() == [int64_of(seed), 0]  # capturing ran nothing
    for call, epsilon in enumerate([1.0, 1.0, 0.0, 0.5]):
        torch.cuda.set_sync_debug_mode("error")  # a schedule's epsilon change, poison, replay: no sync
        try:
            eps.fill_(epsilon)
            static.actions.fill_(-1)
            static.greedy_q.fill_(float("nan"))
            g.replay()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        explore = reference_explores(seed, call, N, epsilon)
        expected = torch.where(explore[:, None], reference_random_actions(c, seed, call, N), greedy.actions.cpu())
        assert torch.equal(static.actions.cpu(), expected), f"replay {call} (epsilon {epsilon})"
        assert torch.equal(static.greedy_q, greedy.greedy_q)
        assert rng.tolist() == [int64_of(seed), call + 1]


@requires_cuda
def test_no_host_sync_eager_and_outputs_in_range():
    c = CONFIGS["reference"]
    net = make_net(c, "cuda")
    s = torch.randn(1024, c.state_dim, device="cuda")
    eps, rng = eps_of(0.25, "cuda"), rng_of(1, 0, "cuda")
    call_act(net, s, eps, rng)  # warm-up outside the check
    torch.cuda.synchronize()
    poison_cuda_cache()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [call_act(net, s, eps, rng) for _ in range(3)]
        module_out = net.act(s, eps, rng)  # the module path: mirror check + op
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert rng.tolist() == [1, 5]  # the warm-up, three calls, the module's
    for out in outs + [module_out]:
        assert torch.isfinite(out.greedy_q).all()
        for d, n in enumerate(c.branches):
            assert ((out.actions[:, d] >= 0) & (out.actions[:, d] < n)).all()


@requires_cuda
@pytest.mark.parametrize("atoms,branches,rows", [
    (75, (40, 1, 3), 8 * 65536 + 3000),  # more rows than the grid's warps (grid-striding); 40 actions > 32 lanes
    (1000, (3, 2), 3000),                # fewer warps per block (the shared memory of 1000 atoms)
    (2, (1,), 5000),
])
def test_cuda_launch_shapes(atoms, branches, rows):
    """The float64 reference and the Philox draws on rows from the start and from the end of the
    batch (the last ones taken by grid-striding warps where the grid is capped)."""
    c = DQNConfig(state_dim=16, trunk_hidden=(32, 32), value_hidden=16, adv_hidden=16, atoms=atoms, branches=branches)
    net = make_net(c, "cuda")
    s = torch.randn(rows, c.state_dim, device="cuda")
    poison_cuda_cache()
    greedy = call_act(net, s, eps_of(0.0, "cuda"), rng_of(5, 0, "cuda"))
    rnd = call_act(net, s, eps_of(1.0, "cuda"), rng_of(5, 1, "cuda")).actions
    check = torch.cat([torch.arange(1000), torch.arange(rows - 1000, rows)])
    sub = s[check.cuda()]
    q64, _ = reference_net_like(net)(sub.double().cpu())
    fwd = dqn_ops.bf16_dueling_forward(sub, *net_args(net))
    assert_greedy(c, greedy.actions[check.cuda()], greedy.greedy_q[check.cuda()], expected_q_f64(q64),
                  bf16_tolerance(c, fwd.q_logits, q64), f"{atoms} atoms")
    assert torch.equal(rnd[check.cuda()].cpu(), reference_random_actions(c, 5, 1, check.tolist()))
    for d, n in enumerate(branches):  # every row written: the poison would be out of range
        assert ((greedy.actions[:, d] >= 0) & (greedy.actions[:, d] < n)).all()
        assert ((rnd[:, d] >= 0) & (rnd[:, d] < n)).all()
    assert torch.isfinite(greedy.greedy_q).all()


@requires_cuda
def test_cuda_atom_limit_is_a_clear_error():
    c = DQNConfig(state_dim=8, trunk_hidden=(8, 8), value_hidden=8, adv_hidden=8, atoms=6145, branches=(1,))
    net = make_net(c, "cuda")
    with pytest.raises(RuntimeError, match="dqn_ops.act: the CUDA kernel takes at most 6144 atoms, got 6145"):
        call_act(net, torch.randn(2, 8, device="cuda"), eps_of(0.0, "cuda"), rng_of(0, 0, "cuda"))


@requires_cuda
def test_cuda_runs_on_the_tensors_device_and_current_stream():
    c = CONFIGS["odd_widths"]
    net = make_net(c, "cuda")
    s = torch.randn(64, c.state_dim, device="cuda")
    fresh = torch.randn(64, c.state_dim, device="cuda")
    eps = eps_of(0.0, "cuda")
    side, expected = warm_side_stream(lambda: call_act(net, fresh, eps, rng_of(0, 0, "cuda")))
    rng = rng_of(0, 0, "cuda")
    with torch.cuda.stream(side), behind_a_sleep():
        s.copy_(fresh)
        out = call_act(net, s, eps, rng)
    torch.cuda.synchronize()
    assert torch.equal(out.actions, expected.actions) and torch.equal(out.greedy_q, expected.greedy_q)
    assert rng.tolist() == [0, 1]


# ----------------------------------------------------------------------------------------
# epsilon_greedy: act's exploration over greedy actions chosen elsewhere

eg_op = torch.ops.dqn_ops.epsilon_greedy.default


def random_greedy(c, N, device, generator=None):
    """[N, D] int64 greedy actions, each in [0, n_d)."""
    cols = [torch.randint(0, n, (N,), generator=generator) for n in c.branches]
    return torch.stack(cols, 1).to(device) if cols else torch.zeros(N, 0, dtype=torch.int64, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("epsilon", [0.0, 0.3, 1.0])
def test_epsilon_greedy_is_the_references_draws(device, epsilon):
    c = CONFIGS["five_branches"]
    N, seed, call = 1500, int(torch.randint(0, 2**62, ())), int(torch.randint(0, 2**40, ()))
    greedy = random_greedy(c, N, device)
    rng = rng_of(seed, call, device)
    out = dqn_ops.epsilon_greedy(greedy, c.branches, eps_of(epsilon, device), rng)
    explore = reference_explores(seed, call, N, epsilon)
    expected = torch.where(explore[:, None], reference_random_actions(c, seed, call, N), greedy.cpu())
    assert out.dtype == torch.int64 and out.device == greedy.device and out.data_ptr() != greedy.data_ptr()
    assert torch.equal(out.cpu(), expected)
    assert rng.tolist() == [seed, call + 1]
    if 0 < epsilon < 1:  # not vacuous: both kinds of rows occur
        assert 0 < explore.sum() < N and ((out.cpu() != greedy.cpu()).any(1) & explore).sum() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["five_branches", "odd_widths", "one_atom"])
def test_epsilon_greedy_explores_as_act_does(device, name):
    """act = epsilon_greedy(act's greedy actions) on the same rng: the same rows explore, the same
    random actions, the counter advanced alike."""
    c = CONFIGS[name]
    net = make_net(c, device)
    s = torch.randn(700, c.state_dim, device=device)
    seed, call = 2026, 40
    greedy = call_act(net, s, eps_of(0.0, device), rng_of(seed, call, device)).actions
    rng_act, rng_eg = rng_of(seed, call, device), rng_of(seed, call, device)
    for _ in range(3):  # consecutive calls draw from consecutive counters
        eps = eps_of(0.4, device)
        expected = call_act(net, s, eps, rng_act).actions
        assert torch.equal(dqn_ops.epsilon_greedy(greedy, c.branches, eps, rng_eg), expected)
        assert torch.equal(rng_eg, rng_act)
    assert not torch.equal(expected, greedy)


@pytest.mark.parametrize("device", DEVICES)
def test_epsilon_greedy_edges(device):
    """epsilon <= 0 / NaN never explores (greedy passes through unread, even out of range),
    >= 1 always; zero rows leave the rng."""
    c = TINY
    greedy = torch.full((50, c.num_branches), -7, dtype=torch.int64, device=device)
    random = reference_random_actions(c, 5, 9, 50)
    for value, expected in [(0.0, greedy.cpu()), (float("nan"), greedy.cpu()), (-1.0, greedy.cpu()), (1.0, random),
                            (float("inf"), random)]:
        out = dqn_ops.epsilon_greedy(greedy, c.branches, eps_of(value, device), rng_of(5, 9, device))
        assert torch.equal(out.cpu(), expected), value
    rng = rng_of(5, 9, device)
    empty = dqn_ops.epsilon_greedy(greedy[:0], c.branches, eps_of(1.0, device), rng)
    assert empty.shape == (0, c.num_branches) and rng.tolist() == [5, 9]


@pytest.mark.parametrize("device", DEVICES)
def test_epsilon_greedy_bad_input(device):
    c = TINY
    g = random_greedy(c, 6, device)
    eps, rng = eps_of(0.5, device), rng_of(1, 0, device)
    cases = [
        ((g, [], eps, rng), "branches: expected 1 to 256 branch sizes, got 0"),
        ((torch.zeros(6, 257, dtype=torch.int64, device=device), [2] * 257, eps, rng),
         "branches: expected 1 to 256 branch sizes, got 257"),
        ((g, [0] + list(c.branches[1:]), eps, rng), r"branches: expected every branch size in \[1, 16777216\], got 0 "
                                                    "at branch 0"),
        ((g, [c.branches[0], 2 ** 24 + 1], eps, rng), r"branches: expected every branch size in \[1, 16777216\], "
                                                       "got 16777217 at branch 1"),
        ((g.float(), c.branches, eps, rng), "greedy: expected dtype Long"),
        ((g[:, :1], c.branches, eps, rng), r"greedy: expected shape \[\*, %d\]" % c.num_branches),
        ((g.t().contiguous().t(), c.branches, eps, rng), "greedy: expected a contiguous tensor"),
        ((g, c.branches, eps.double(), rng), "epsilon: expected dtype Float"),
        ((g, c.branches, torch.zeros(2, device=device), rng), "epsilon: expected one element"),
        ((g, c.branches, eps, rng_of(1, 0, device)[:1]), r"rng: expected shape \[2\]"),
        ((g, c.branches, eps, rng.int()), "rng: expected dtype Long"),
        ((g, c.branches, rng.view(torch.float32)[:1], rng), "rng and epsilon must not share memory"),
    ]
    if device == "cuda":
        cases.append(((g, c.branches, eps.cpu(), rng), "epsilon: expected a tensor on cuda"))
        cases.append(((g, c.branches, eps, rng.cpu()), "rng: expected a tensor on cuda"))
    for args, msg in cases:
        with pytest.raises(RuntimeError, match="dqn_ops.epsilon_greedy: " + msg):
            eg_op(*args)
    assert rng.tolist() == [1, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_epsilon_greedy_opcheck(device):
    c = CONFIGS["five_branches"]
    g = random_greedy(c, 20, device)
    for eps in (0.0, 0.5):
        torch.library.opcheck(eg_op, (g, list(c.branches), eps_of(eps, device), rng_of(3, 1, device)))
    torch.library.opcheck(eg_op, (g[:0], list(c.branches), eps_of(0.5, device), rng_of(3, 1, device)))


def test_epsilon_greedy_fake_and_compile():
    c = CONFIGS["five_branches"]
    with FakeTensorMode():
        g, eps, rng = torch.empty(9, 5, dtype=torch.int64), torch.empty(1), torch.empty(2, dtype=torch.int64)
        out = eg_op(g, list(c.branches), eps, rng)
        assert out.shape == (9, 5) and out.dtype == torch.int64
        for args, msg in [((g[:, :4], list(c.branches), eps, rng), r"greedy: expected shape \[\*, 5\]"),
                          ((g.float(), list(c.branches), eps, rng), "greedy: expected dtype Long"),
                          ((g, [3, 0, 2, 2, 2], eps, rng), r"branches: expected every branch size in \[1, 16777216\], "
                                                           "got 0 at branch 1"),
                          ((g, list(c.branches), torch.empty(2), rng), "epsilon: expected one element"),
                          ((g, list(c.branches), eps, torch.empty(3, dtype=torch.int64)),
                           r"rng: expected shape \[2\]")]:
            with pytest.raises(RuntimeError, match="dqn_ops.epsilon_greedy: " + msg):
                eg_op(*args)

    def f(greedy, epsilon, rng):
        return dqn_ops.epsilon_greedy(greedy, c.branches, epsilon, rng)

    compiled = torch.compile(f, fullgraph=True)
    g = random_greedy(c, 64, "cpu")
    eps = eps_of(0.5, "cpu")
    rng_c, rng_e = rng_of(6, 0, "cpu"), rng_of(6, 0, "cpu")
    for _ in range(2):  # the rng's advance is part of the compiled graph
        assert torch.equal(compiled(g, eps, rng_c), f(g, eps, rng_e))
        assert torch.equal(rng_c, rng_e)
    assert rng_c.tolist() == [6, 2]


@requires_cuda
def test_epsilon_greedy_cuda_graph_replays_draw_anew():
    c = CONFIGS["five_branches"]
    g = random_greedy(c, 300, "cuda")
    eps, rng = eps_of(1.0, "cuda"), rng_of(12, 0, "cuda")
    out = dqn_ops.epsilon_greedy(g, c.branches, eps, rng)  # warm-up outside the capture: call 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # recorded, not run: the counter stays at 1
        out = dqn_ops.epsilon_greedy(g, c.branches, eps, rng)
    for call in (1, 2):
        out.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), reference_random_actions(c, 12, call, 300))
    assert rng.tolist() == [12, 3]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["five_branches", "one_atom"])
def test_torch_trainer_explores_with_the_trainers_draws(device, name):
    """TorchTrainer(exploration='philox') draws what Trainer(seed) draws: at epsilon 1 every
    action is the same; at epsilon 0.5 the same rows explore (where the greedy actions agree,
    the actions agree); 'torch' draws its own."""
    from dqn_ops.rl.baseline import TorchTrainer
    c = CONFIGS[name]
    cfg = TrainerConfig(batch_size=8, use_cuda_graph=False)
    ours = Trainer(c, cfg, device=device, seed=31)
    plain = TorchTrainer(c, cfg, device=device, seed=31)
    s = torch.randn(400, c.state_dim, device=device)
    a_ours, _ = ours.act_explore(s, eps_of(1.0, device))
    a_plain, _ = plain.act_explore(s, eps_of(1.0, device))
    assert torch.equal(a_plain, a_ours)
    assert torch.equal(a_plain.cpu(), reference_random_actions(c, 31, 0, 400))
    a_ours, _ = ours.act_explore(s, eps_of(0.5, device))
    a_plain, _ = plain.act_explore(s, eps_of(0.5, device))
    explore = reference_explores(31, 1, 400, 0.5).to(device)
    assert torch.equal(a_plain[explore], a_ours[explore])
    assert torch.equal(plain.explore_rng, ours.explore_rng)
    other = TorchTrainer(c, cfg, device=device, seed=31, exploration="torch")
    assert not torch.equal(other.act_explore(s, eps_of(1.0, device))[0].cpu(), reference_random_actions(c, 31, 0, 400))
    with pytest.raises(ValueError, match="TorchTrainer: exploration: expected 'philox'"):
        TorchTrainer(c, cfg, device=device, seed=31, exploration="numpy")
    with pytest.raises(ValueError, match="TorchTrainer: fractions: expected 'philox'"):
        TorchTrainer(c, cfg, device=device, seed=31, fractions="numpy")
