"""The replay buffer on the device (dqn_ops/rl/replay.py, csrc/replay_*.{h,cpp}, csrc/cuda/replay.cu)
against independent Python references: Philox draws (tests/reference.py), the sum tree rebuilt
and descended in Python floats (IEEE doubles, summed in the same order as the kernels, so the
indices must be equal), float64 formulas for priorities, importance weights and n-step returns,
and chi-square tests of the sampled frequencies."""
import math

import numpy as np
import pytest
import torch

from conftest import DEVICES, requires_cuda
from dqn_ops import ops
from dqn_ops.rl.replay import BATCH_KEYS, FAN, ReplayBuffer, tree_layout
from reference import STREAM_REPLAY, philox_draw, philox_index_below

SD, D = 5, 2


def chi2_upper(df: int, z: float = 3.719) -> float:
    """The 1 - 1e-4 quantile of chi-square(df) (Wilson-Hilferty; z = the normal's 1 - 1e-4 quantile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts, probs) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def rows(n, device, gen, first=0.0):
    """n transitions; rewards = first, first + 1, ... (each row recognisable by its reward)."""
    s = torch.randn(n, SD, generator=gen).to(device)
    return (s, torch.randint(0, 7, (n, D), generator=gen).to(device),
            torch.arange(n, dtype=torch.float32).add(first).to(device), (s * 2 + 1), torch.zeros(n, device=device))


def state_of(rb: ReplayBuffer):
    """Every state tensor of a buffer, cloned (to check that a failed call changed nothing)."""
    ts = dict(storage=rb._storage, cursor=[rb.cursor], rng=[rb.rng], beta=[rb.beta],
              skipped=[rb.skipped_priority_updates], tree=rb._tree, window=getattr(rb, "_window", []))
    return {f"{k}{i}": t.clone() for k, v in ts.items() for i, t in enumerate(v)}


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) or (a[k].is_floating_point() and torch.equal(a[k].isnan(), b[k].isnan()) and
                                           torch.equal(a[k].nan_to_num(), b[k].nan_to_num())), k


# ---------------------------------------------------------------------------------------
# The Python reference of the tree (csrc/replay_args.h: recompute_node, descend).

def ref_levels(leaves, capacity):
    """[leaves padded, level 1 sums, ..., root]: each node the in-order sum of its 32 children."""
    stored0, _, levels = tree_layout(capacity)
    out = [list(leaves) + [0.0] * (stored0 - len(leaves))]
    for _ in range(levels):
        prev = out[-1]
        nodes = -(-len(prev) // FAN)
        level = []
        for node in range(nodes):
            s = 0.0
            for j in range(FAN):
                k = node * FAN + j
                s += prev[k] if k < len(prev) else 0.0
            level.append(s)
        out.append(level)
    return out


def stored_levels(rb):
    """rb.sums split into levels (the nodes that exist; the padding after them dropped)."""
    counts, out, off = [rb.capacity], [], 0
    _, _, levels = tree_layout(rb.capacity)
    sums = rb.sums.cpu().tolist()
    for l in range(1, levels + 1):
        counts.append(-(-counts[-1] // FAN))
        stored = (-(-counts[l] // FAN)) * FAN if l < levels else 1
        out.append(sums[off:off + counts[l]])
        off += stored
    return out


def ref_descend(levels, u):
    node = 0
    for l in range(len(levels) - 1, 0, -1):
        child = levels[l - 1]
        c = [child[node * FAN + j] if node * FAN + j < len(child) else 0.0 for j in range(FAN)]
        acc, pick, pick_base, last, last_base = 0.0, -1, 0.0, -1, 0.0
        for j in range(FAN):
            nxt = acc + c[j]
            if c[j] > 0.0:
                if pick < 0 and u < nxt:
                    pick, pick_base = j, acc
                last, last_base = j, acc
            acc = nxt
        if pick < 0:
            pick, pick_base = (0, 0.0) if last < 0 else (last, last_base)
        u = max(u - pick_base, 0.0)
        node = node * FAN + pick
    return node


def ref_prioritized_indices(rb, seed, call, B):
    leaves = rb.priorities.cpu().double().tolist()
    levels = ref_levels(leaves, rb.capacity)
    total = levels[-1][0]
    return [ref_descend(levels, (i + philox_draw(STREAM_REPLAY, seed, call, i, 0) * 2.0**-32) / B * total) for i in range(B)]


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


# ---------------------------------------------------------------------------------------
# Uniform

@pytest.mark.parametrize("device", DEVICES)
def test_uniform_indices_are_the_philox_draws_and_rows_are_gathered(device):
    gen = torch.Generator().manual_seed(0)
    rb = ReplayBuffer(100, SD, D, device, seed=77)
    rb.add(*rows(37, device, gen))
    for call in range(3):
        b = rb.sample(64)
        expected = [philox_index_below(philox_draw(STREAM_REPLAY, 77, call, i, 0), 37) for i in range(64)]
        assert b["indices"].tolist() == expected
        idx = b["indices"]
        for k in ("states", "actions", "rewards", "next_states", "dones"):
            assert torch.equal(b[k], getattr(rb, k)[idx]), k
        assert torch.equal(b["weights"], torch.ones(64, device=device))
    assert rb.rng.tolist() == [77, 3]


@pytest.mark.parametrize("device", DEVICES)
def test_uniform_frequencies_chi_square(device):
    gen = torch.Generator().manual_seed(1)
    rb = ReplayBuffer(64, SD, D, device, seed=3)
    rb.add(*rows(40, device, gen))  # 40 of 64 rows filled: the rest must never come
    counts = torch.zeros(64, dtype=torch.long)
    for _ in range(100):
        counts += torch.bincount(rb.sample(512)["indices"].cpu(), minlength=64)
    assert counts[40:].sum() == 0
    assert chi2(counts[:40].tolist(), [1 / 40] * 40) < chi2_upper(39)


@pytest.mark.parametrize("device", DEVICES)
def test_ring_wraps_and_overwrites_the_oldest(device):
    gen = torch.Generator().manual_seed(2)
    rb = ReplayBuffer(10, SD, D, device)
    for i in range(3):
        rb.add(*rows(4, device, gen, first=4.0 * i))
    assert rb.size == 10 and rb.next == 2
    assert rb.rewards.tolist() == [10.0, 11.0] + [float(x) for x in range(2, 10)]  # rows 0, 1 overwritten
    assert torch.equal(rb.next_states, rb.states * 2 + 1)
    b = rb.sample(256)
    assert torch.equal(b["rewards"], rb.rewards[b["indices"]])


@pytest.mark.parametrize("device", DEVICES)
def test_sample_writes_into_out_buffers(device):
    """The graphed loop's way: out = a trainer's inputs (s and s' halves of one buffer) + indices."""
    gen = torch.Generator().manual_seed(3)
    rb = ReplayBuffer(50, SD, D, device, prioritized=True)
    rb.add(*rows(30, device, gen))
    B = 16
    pairs = torch.full((2 * B, SD), math.nan, device=device)
    out = dict(states=pairs[:B], next_states=pairs[B:], actions=torch.full((B, D), -1, device=device),
               rewards=torch.full((B,), math.nan, device=device), dones=torch.full((B,), math.nan, device=device),
               weights=torch.full((B,), math.nan, device=device), indices=torch.full((B,), -1, device=device))
    ptrs = {k: v.data_ptr() for k, v in out.items()}
    b = rb.sample(B, out=out)
    assert {k: v.data_ptr() for k, v in b.items()} == ptrs
    idx = out["indices"]
    assert torch.equal(pairs[:B], rb.states[idx]) and torch.equal(pairs[B:], rb.next_states[idx])
    assert torch.equal(out["actions"], rb.actions[idx]) and torch.equal(out["rewards"], rb.rewards[idx])
    assert torch.isfinite(out["weights"]).all()


# ---------------------------------------------------------------------------------------
# Prioritized

def _prioritized(device, capacity=100, filled=80, seed=11, alpha=0.7, beta=0.5):
    gen = torch.Generator().manual_seed(seed)
    rb = ReplayBuffer(capacity, SD, D, device, seed=seed, prioritized=True, alpha=alpha, beta=beta)
    rb.add(*rows(filled, device, gen))
    td = (torch.randn(filled, generator=gen) * 3).exp().to(device)  # priorities spread over decades
    rb.update_priorities(torch.arange(filled, device=device), td)
    return rb, td


@pytest.mark.parametrize("device", DEVICES)
def test_prioritized_priorities_and_tree_against_float64(device):
    rb, td = _prioritized(device)
    expected = [f32((abs(t) + 1e-6) ** 0.7) for t in td.cpu().double().tolist()]
    got = rb.priorities.cpu().tolist()
    assert got[80:] == [0.0] * 20
    assert got[:80] == pytest.approx(expected, rel=1e-6)
    assert rb.max_priority.item() == pytest.approx(max(max(expected), 1.0), rel=1e-6)
    # every inner sum, bit for bit, as the in-order sums of its children; the min of the positive leaves
    ref = ref_levels(rb.priorities.cpu().double().tolist(), rb.capacity)
    assert stored_levels(rb) == [lvl[:len(s)] for lvl, s in zip(ref[1:], stored_levels(rb))]
    assert rb.mins[-1].item() == min(p for p in got if p > 0)


@pytest.mark.parametrize("device", DEVICES)
def test_prioritized_indices_equal_the_python_descent_and_weights_the_float64_formula(device):
    rb, _ = _prioritized(device, capacity=300, filled=250)
    p = rb.priorities.cpu().double()
    p_min = p[p > 0].min().item()
    for call in range(3):
        b = rb.sample(128)
        assert b["indices"].tolist() == ref_prioritized_indices(rb, 11, call, 128)
        pi = p[b["indices"].cpu()]
        size, total = 250, p.sum().item()
        # w = (size P(i))^-beta / max_j (size P(j))^-beta, written out in float64
        w = (size * pi / total) ** -0.5 / (size * p_min / total) ** -0.5
        assert torch.allclose(b["weights"].cpu().double(), w, rtol=2e-6, atol=0)
        assert b["weights"].max().item() <= 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_prioritized_frequencies_chi_square(device):
    rb, _ = _prioritized(device)
    p = rb.priorities.cpu().double()[:80]
    probs = (p / p.sum()).tolist()
    counts = torch.zeros(100, dtype=torch.long)
    for _ in range(100):
        counts += torch.bincount(rb.sample(500)["indices"].cpu(), minlength=100)
    assert counts[80:].sum() == 0
    assert chi2(counts[:80].tolist(), probs) < chi2_upper(79)
    assert chi2(counts[:80].tolist(), [1 / 80] * 80) > 100 * chi2_upper(79)  # the test can tell them apart


@pytest.mark.parametrize("device", DEVICES)
def test_update_then_resample_follows_the_new_priorities(device):
    rb, _ = _prioritized(device, capacity=64, filled=64)
    hot = torch.tensor([5, 40], device=device)
    rb.update_priorities(hot, torch.tensor([1e6, 1e6], device=device))
    p = rb.priorities.cpu().double()
    share = (p[5] + p[40]) / p.sum()
    b = rb.sample(1000)
    frac = torch.isin(b["indices"], hot).double().mean().item()
    assert abs(frac - share.item()) < 0.01  # stratified: within a stratum or two of the share
    assert rb.max_priority.item() == pytest.approx(f32((1e6 + 1e-6) ** 0.7), rel=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_duplicates_take_the_largest_and_new_rows_the_running_max(device):
    gen = torch.Generator().manual_seed(4)
    rb = ReplayBuffer(40, SD, D, device, prioritized=True, alpha=1.0)
    rb.add(*rows(10, device, gen))
    assert rb.priorities[:10].tolist() == [1.0] * 10  # the initial max priority
    rb.update_priorities(torch.tensor([3, 3, 7, 3, 7], device=device),
                         torch.tensor([2.0, -9.0, 0.5, 4.0, 0.25], device=device))
    pr = rb.priorities.tolist()
    assert pr[3] == f32(9.0 + 1e-6) and pr[7] == f32(0.5 + 1e-6)
    assert rb.max_priority.item() == f32(9.0 + 1e-6)
    rb.add(*rows(3, device, gen))  # new rows at the running max
    assert rb.priorities[10:13].tolist() == [f32(9.0 + 1e-6)] * 3
    rb.update_priorities(torch.tensor([0], device=device), torch.tensor([0.0], device=device))
    assert rb.max_priority.item() == f32(9.0 + 1e-6)  # the running max never shrinks


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_td_leaves_the_row_and_is_counted(device):
    rb, _ = _prioritized(device, capacity=64, filled=40)
    before = state_of(rb)
    idx = torch.tensor([1, 2, 3, 2], device=device)
    td = torch.tensor([math.nan, math.inf, 2.0, -math.inf], device=device)
    rb.update_priorities(idx, td)
    assert rb.skipped_priority_updates.item() == 3
    pr, old = rb.priorities.cpu(), before["tree0"][:64].cpu()
    assert pr[1] == old[1] and pr[2] == old[2]  # row 2: both its updates non-finite
    assert pr[3].item() == f32((2.0 + 1e-6) ** 0.7)
    assert torch.equal(pr[4:], old[4:]) and pr[0] == old[0]
    ref = ref_levels(pr.double().tolist(), 64)
    assert stored_levels(rb) == [lvl[:len(s)] for lvl, s in zip(ref[1:], stored_levels(rb))]


def test_cpu_out_of_range_index_raises_and_changes_nothing():
    rb, _ = _prioritized("cpu", capacity=64, filled=40)
    before = state_of(rb)
    for bad in (40, 64, -1):
        with pytest.raises(RuntimeError, match=r"indices: expected rows in \[0, 40\)"):
            rb.update_priorities(torch.tensor([0, bad]), torch.tensor([1.0, 1.0]))
    assert_same_state(before, state_of(rb))


@requires_cuda
def test_cuda_out_of_range_index_is_skipped_and_counted():
    rb, _ = _prioritized("cuda", capacity=64, filled=40)
    before = state_of(rb)
    rb.update_priorities(torch.tensor([40, 63, -5, 1000], device="cuda"), torch.ones(4, device="cuda"))
    assert rb.skipped_priority_updates.item() == 4
    before["skipped0"] += 4
    assert_same_state(before, state_of(rb))


# ---------------------------------------------------------------------------------------
# n-step

def ref_nstep(steps, n, gamma, num_envs):
    """Float64 transitions, in the order the buffer writes them: per step, env by env, each
    env's longest pending window first."""
    pending = [[] for _ in range(num_envs)]
    out = []
    for obs, act, rew, nobs, term, trunc in steps:
        for e in range(num_envs):
            pending[e].append((obs[e], act[e], float(rew[e])))
            ended = bool(term[e]) or bool(trunc[e])
            starts = range(len(pending[e])) if ended else ([0] if len(pending[e]) == n else [])
            for j in starts:
                win = pending[e][j:]
                m = len(win)
                R = sum(gamma ** k * r for k, (_, _, r) in enumerate(win))
                if term[e]:
                    done = 1.0
                elif m == n:
                    done = 0.0
                else:
                    done = 1.0 - gamma ** (m - n) if gamma > 0 else 1.0
                out.append((win[0][0], win[0][1], R, nobs[e], done, m, bool(term[e])))
            if ended:
                pending[e] = []
            elif len(pending[e]) == n:
                pending[e].pop(0)
    return out


def episode_steps(num_envs, T, gen, p_end=0.15):
    steps = []
    for _ in range(T):
        ends = torch.rand(num_envs, 2, generator=gen) < p_end
        steps.append((torch.randn(num_envs, SD, generator=gen), torch.randint(0, 5, (num_envs, D), generator=gen),
                      torch.randn(num_envs, generator=gen), torch.randn(num_envs, SD, generator=gen),
                      ends[:, 0], ends[:, 1] & ~ends[:, 0]))
    return steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,capacity", [(1, 1000), (3, 1000), (5, 1000), (3, 37)])
@pytest.mark.parametrize("prioritized", [False, True])
def test_nstep_against_a_float64_walk_of_each_episode(device, n, capacity, prioritized):
    E, T, gamma = 6, 40, 0.9
    gen = torch.Generator().manual_seed(10 + n)
    steps = episode_steps(E, T, gen)
    term = torch.stack([s[4] for s in steps]).T
    trunc = torch.stack([s[5] for s in steps]).T
    # the schedule covers what the test is about: terminations and truncations, at different steps
    assert term.any() and trunc.any() and len({tuple(r.nonzero().flatten().tolist()) for r in term | trunc}) > 1
    rb = ReplayBuffer(capacity, SD, D, device, prioritized=prioritized, n_step=n, gamma=gamma, num_envs=E)
    for k, (o, a, r, no, te, tr) in enumerate(steps):
        dtype = torch.bool if k % 2 else torch.float32  # both flag dtypes
        rb.add_steps(o.to(device), a.to(device), r.to(device), no.to(device), te.to(device, dtype), tr.to(device, dtype))
    ref = ref_nstep(steps, n, gamma, E)
    total = len(ref)
    assert rb.size == min(total, capacity) and rb.next == total % capacity
    keep = ref[-capacity:] if total > capacity else ref
    first = total - len(keep)
    pos = [(first + k) % capacity for k in range(len(keep))]
    assert torch.equal(rb.states[pos].cpu(), torch.stack([t[0] for t in keep]))
    assert torch.equal(rb.actions[pos].cpu(), torch.stack([t[1] for t in keep]))
    assert torch.equal(rb.next_states[pos].cpu(), torch.stack([t[3] for t in keep]))
    R = torch.tensor([t[2] for t in keep], dtype=torch.float64)
    assert torch.allclose(rb.rewards[pos].cpu().double(), R, rtol=1e-6, atol=1e-6)
    dones = torch.tensor([t[4] for t in keep], dtype=torch.float64)
    assert torch.allclose(rb.dones[pos].cpu().double(), dones, rtol=1e-6, atol=1e-7)
    # the loss's discount gamma^n (1 - done): gamma^m for a truncated window of m steps, 0 after a termination
    disc = rb.bootstrap_discount(rb.dones[pos].cpu().double())
    want = torch.tensor([0.0 if t[6] else gamma ** t[5] for t in keep], dtype=torch.float64)
    assert torch.allclose(disc, want, rtol=1e-5, atol=1e-7)
    if n > 1:
        assert any(t[5] < n and not t[6] for t in keep) and any(t[5] < n and t[6] for t in keep)
    if prioritized:
        assert rb.priorities[:rb.size].eq(1.0).all() and rb.priorities[rb.size:].eq(0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_nstep_one_stores_terminated_and_truncation_bootstraps(device):
    rb = ReplayBuffer(10, SD, D, device, n_step=1, gamma=0.5, num_envs=3)
    z = torch.zeros(3, SD, device=device)
    rb.add_steps(z, torch.zeros(3, D, dtype=torch.long, device=device), torch.tensor([1.0, 2.0, 3.0], device=device),
                 z, torch.tensor([True, False, False], device=device), torch.tensor([False, True, False], device=device))
    assert rb.size == 3 and rb.dones[:3].tolist() == [1.0, 0.0, 0.0] and rb.rewards[:3].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_before_a_window_completes_gives_zero_weights(device):
    rb = ReplayBuffer(20, SD, D, device, n_step=3, num_envs=2, prioritized=True)
    z, f = torch.zeros(2, SD, device=device), torch.zeros(2, dtype=torch.bool, device=device)
    rb.add_steps(z, torch.zeros(2, D, dtype=torch.long, device=device), torch.ones(2, device=device), z, f, f)
    assert rb.size == 0
    b = rb.sample(8)
    assert b["weights"].eq(0).all() and b["indices"].eq(0).all()


# ---------------------------------------------------------------------------------------
# Determinism, CPU == CUDA

def _scenario(device, seed, prioritized, n=3):
    """A fixed sequence of every call; returns the samples and the buffer."""
    gen = torch.Generator().manual_seed(99)
    rb = ReplayBuffer(500, SD, D, device, seed=seed, prioritized=prioritized, n_step=n, gamma=0.95, num_envs=7)
    rb.add(*rows(20, device, gen))
    samples = []
    for o, a, r, no, te, tr in episode_steps(7, 30, gen):
        rb.add_steps(o.to(device), a.to(device), r.to(device), no.to(device), te.to(device), tr.to(device))
        b = rb.sample(64)
        samples.append({k: v.cpu() for k, v in b.items()})
        if prioritized:
            td = torch.randn(64, generator=gen).to(device) * 2
            td[::17] = math.nan
            rb.update_priorities(b["indices"], td)
    return samples, rb


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prioritized", [False, True])
def test_same_seed_same_indices_twice(device, prioritized):
    a, _ = _scenario(device, 5, prioritized)
    b, _ = _scenario(device, 5, prioritized)
    c, _ = _scenario(device, 6, prioritized)
    for x, y in zip(a, b):
        for k in BATCH_KEYS:
            assert torch.equal(x[k], y[k]), k
    assert any(not torch.equal(x["indices"], z["indices"]) for x, z in zip(a, c))


@requires_cuda
@pytest.mark.parametrize("prioritized", [False, True])
def test_cpu_and_cuda_sample_the_same_indices(prioritized):
    cpu, rb_cpu = _scenario("cpu", 8, prioritized)
    gpu, rb_gpu = _scenario("cuda", 8, prioritized)
    for x, y in zip(cpu, gpu):
        assert torch.equal(x["indices"], y["indices"])
        for k in ("states", "actions", "rewards", "next_states", "dones"):
            assert torch.equal(x[k], y[k]), k
        assert torch.allclose(x["weights"], y["weights"], rtol=1e-6, atol=0)  # pow may differ in the last bit
    assert torch.equal(rb_cpu.cursor, rb_gpu.cursor.cpu())
    if prioritized:
        assert torch.equal(rb_cpu.sums, rb_gpu.sums.cpu()) and torch.equal(rb_cpu.leaves, rb_gpu.leaves.cpu())
        assert rb_cpu.skipped_priority_updates.item() == rb_gpu.skipped_priority_updates.item() > 0


# ---------------------------------------------------------------------------------------
# CUDA graph capture

@requires_cuda
@pytest.mark.parametrize("prioritized", [False, True])
def test_cuda_graph_capture_replays_equal_eager_calls_on_a_twin(prioritized):
    E, B, T, dev = 8, 32, 6, "cuda"
    kw = dict(seed=21, prioritized=prioritized, n_step=3, gamma=0.9, num_envs=E)
    graphed, eager = ReplayBuffer(300, SD, D, dev, **kw), ReplayBuffer(300, SD, D, dev, **kw)
    gen = torch.Generator().manual_seed(31)
    inputs = [tuple(t.to(dev) for t in s) for s in episode_steps(E, 3 + T, gen, p_end=0.3)]
    for s in inputs[:3]:  # both buffers hold the same transitions before the capture
        graphed.add_steps(*s)
        eager.add_steps(*s)
    static = [t.clone() for t in inputs[0]]

    def outs():
        pairs = torch.full((2 * B, SD), math.nan, device=dev)
        return dict(states=pairs[:B], next_states=pairs[B:], actions=torch.full((B, D), -1, device=dev),
                    rewards=torch.full((B,), math.nan, device=dev), dones=torch.full((B,), math.nan, device=dev),
                    weights=torch.full((B,), math.nan, device=dev), indices=torch.full((B,), -1, device=dev))

    out_g, out_e = outs(), outs()

    def body(rb, step_inputs, out):
        rb.add_steps(*step_inputs)
        rb.sample(B, out=out)
        if prioritized:
            td = out["rewards"].abs() + out["weights"]
            td = torch.where(out["indices"] % 5 == 0, torch.full_like(td, math.nan), td)
            rb.update_priorities(out["indices"], td)

    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # the mode is set inside: the context's own synchronize comes before
        torch.cuda.set_sync_debug_mode("error")
        try:
            body(graphed, static, out_g)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert_same_state(state_of(graphed), state_of(eager))  # capturing ran nothing
    for s in inputs[3:]:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for dst, src in zip(static, s):
                dst.copy_(src)
            g.replay()
            body(eager, s, out_e)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for k in BATCH_KEYS:
            assert torch.equal(out_g[k], out_e[k]), k
        assert_same_state(state_of(graphed), state_of(eager))
    assert graphed.rng[1].item() == T and graphed.size > 0
    if prioritized:
        assert graphed.skipped_priority_updates.item() > 0


# ---------------------------------------------------------------------------------------
# 10M rows at the reference state size

@requires_cuda
def test_cuda_ten_million_rows_at_state_dim_96(capsys):
    dev, C, chunk = "cuda", 10_000_000, 1_000_000
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    rb = ReplayBuffer(C, 96, 3, dev, seed=4, prioritized=True)
    for k in range(C // chunk):
        s = torch.randn(chunk, 96, device=dev)
        rb.add(s, torch.randint(0, 3, (chunk, 3), device=dev),
               torch.arange(k * chunk, (k + 1) * chunk, device=dev, dtype=torch.float32), s, torch.zeros(chunk, device=dev))
        del s
    assert rb.size == C and rb.next == 0
    assert rb.sums[-1].item() == C  # every row at priority 1, summed exactly in F64
    b = rb.sample(4096)
    idx = b["indices"]
    assert idx.min().item() >= 0 and idx.max().item() < C
    assert torch.equal(b["rewards"], idx.float()) and torch.equal(b["states"], rb.states[idx])
    rb.update_priorities(idx, torch.rand(4096, device=dev) * 5)
    assert rb.sums[-1].item() == pytest.approx(rb.priorities.double().sum().item(), rel=1e-12)
    b = rb.sample(4096)
    assert b["indices"].max().item() < C and b["weights"].le(1).all()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    buffer = sum(t.nbytes for t in rb._storage + rb._tree) / 2**30
    with capsys.disabled():
        print(f"\n10M-row prioritized buffer, state_dim 96: buffer {buffer:.2f} GiB, peak allocated {peak:.2f} GiB")
    assert buffer < 8.5 and peak < buffer + 2


# ---------------------------------------------------------------------------------------
# Bad input

@pytest.mark.parametrize("kwargs,msg", [
    (dict(capacity=0), "capacity must be an int in"), (dict(capacity=-3), "capacity must be"),
    (dict(capacity=2.5), "capacity must be"), (dict(state_dim=0), "state_dim must be"),
    (dict(num_branches=0), "num_branches must be"), (dict(alpha=-0.1), "alpha must be finite and >= 0"),
    (dict(alpha=math.nan), "alpha must be"), (dict(beta=1.5), r"beta must lie in \[0, 1\]"),
    (dict(beta=-0.1), "beta must lie"), (dict(priority_eps=0.0), "priority_eps must be finite and > 0"),
    (dict(priority_eps=-1e-6), "priority_eps"), (dict(n_step=0), "n_step must be an int >= 1"),
    (dict(gamma=1.5), r"gamma must lie in \[0, 1\]"), (dict(gamma=-0.5), "gamma must lie"),
    (dict(gamma=math.nan), "gamma must lie"), (dict(num_envs=0), "num_envs must be"),
    (dict(num_envs=20, n_step=3), "may write 60 rows"), (dict(seed=1.5), "seed must be an int"),
])
def test_bad_construction(kwargs, msg):
    args = dict(capacity=50, state_dim=SD, num_branches=D, prioritized=True)
    args.update(kwargs)
    with pytest.raises(ValueError, match=msg):
        ReplayBuffer(**args)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_add_and_add_steps_are_clear_errors_and_change_nothing(device):
    gen = torch.Generator().manual_seed(6)
    rb = ReplayBuffer(20, SD, D, device, prioritized=True, n_step=2, num_envs=3)
    rb.add(*rows(5, device, gen))
    before = state_of(rb)
    ok = list(rows(4, device, gen))
    bad_add = [(0, torch.zeros(4, SD + 1, device=device), r"states: expected torch.float32 \[4, 5\]"),
               (0, torch.zeros(4, SD, device=device, dtype=torch.float64), "states: expected torch.float32"),
               (1, torch.zeros(4, D, device=device), "actions: expected torch.int64"),
               (1, torch.zeros(4, D + 1, dtype=torch.long, device=device), r"actions: expected torch.int64 \[4, 2\]"),
               (2, torch.zeros(3, device=device), r"rewards: expected torch.float32 \[4\]"),
               (3, torch.zeros(4, SD, device="meta"), "next_states: expected .* on .*, got .* on meta"),
               (4, torch.zeros(4, device=device, dtype=torch.int32), "dones: expected torch.float32")]
    for i, t, msg in bad_add:
        args = list(ok)
        args[i] = t
        with pytest.raises(ValueError, match=msg):
            rb.add(*args)
    with pytest.raises(ValueError, match="do not fit a capacity of 20"):
        rb.add(*rows(21, device, gen))
    with pytest.raises(ValueError, match="at least one transition"):
        rb.add(*rows(0, device, gen))
    z = torch.zeros(3, SD, device=device)
    f = torch.zeros(3, dtype=torch.bool, device=device)
    step = [z, torch.zeros(3, D, dtype=torch.long, device=device), torch.zeros(3, device=device), z, f, f]
    bad_steps = [(0, torch.zeros(2, SD, device=device), r"obs: expected torch.float32 \[3, 5\]"),
                 (0, torch.zeros(3, SD, device="meta"), "obs: expected .* got .* on meta"),
                 (1, torch.zeros(3, D, device=device), "actions: expected torch.int64"),
                 (2, torch.zeros(3, 1, device=device), r"rewards: expected torch.float32 \[3\]"),
                 (3, torch.zeros(3, SD, dtype=torch.float16, device=device), "next_obs: expected torch.float32"),
                 (4, torch.zeros(3, dtype=torch.int64, device=device), "terminated: expected torch.bool or"),
                 (5, torch.zeros(4, dtype=torch.bool, device=device), r"truncated: expected .* \[3\]"),
                 (5, torch.zeros(3, device=device), "terminated and truncated must have one dtype")]
    for i, t, msg in bad_steps:
        args = list(step)
        args[i] = t
        with pytest.raises(ValueError, match=msg):
            rb.add_steps(*args)
    assert_same_state(before, state_of(rb))
    plain = ReplayBuffer(20, SD, D, device)
    with pytest.raises(ValueError, match="add_steps: needs num_envs"):
        plain.add_steps(*step)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_sample_and_update_are_clear_errors_and_change_nothing(device):
    gen = torch.Generator().manual_seed(7)
    empty = ReplayBuffer(20, SD, D, device, prioritized=True)
    with pytest.raises(RuntimeError, match="the buffer is empty"):
        empty.sample(4)
    rb = ReplayBuffer(20, SD, D, device, prioritized=True)
    rb.add(*rows(5, device, gen))
    before = state_of(rb)
    for bs in (0, -1, 2.0):
        with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
            rb.sample(bs)
    assert_same_state(before, state_of(rb))  # the refused batch sizes changed nothing (the rng included)
    out = {k: v for k, v in rb.sample(4).items()}
    before = state_of(rb)
    with pytest.raises(ValueError, match=r"out is missing \['indices'\]"):
        rb.sample(4, out={k: v for k, v in out.items() if k != "indices"})
    with pytest.raises(ValueError, match="expected 3 rows"):
        rb.sample(3, out=out)
    for k, t, msg in [("weights", torch.zeros(4, dtype=torch.float64, device=device), "out.weights: expected dtype Float"),
                      ("indices", torch.zeros(4, dtype=torch.int32, device=device), "out.indices: expected dtype Long"),
                      ("actions", torch.zeros(4, D + 1, dtype=torch.long, device=device), "out.actions: expected shape"),
                      ("next_states", rb.states[:4], "must not share memory")]:
        with pytest.raises(RuntimeError, match=msg):
            rb.sample(4, out={**out, k: t})
    with pytest.raises(ValueError, match=r"out\['dones'\]: expected a tensor on .*, got one on meta"):
        rb.sample(4, out={**out, "dones": torch.zeros(4, device="meta")})
    for idx, td, msg in [(torch.zeros(2, device=device), torch.zeros(2, device=device), "indices: expected dtype Long"),
                         (torch.zeros(2, dtype=torch.long, device=device), torch.zeros(3, device=device),
                          r"td_error: expected shape \[2\]"),
                         (torch.zeros(2, dtype=torch.long, device=device), torch.zeros(2, dtype=torch.float64,
                                                                                      device=device),
                          "td_error: expected dtype Float"),
                         ]:
        with pytest.raises(RuntimeError, match=msg):
            rb.update_priorities(idx, td)
    with pytest.raises(ValueError, match="td_error: expected a tensor on .*, got one on meta"):
        rb.update_priorities(torch.zeros(2, dtype=torch.long, device=device), torch.zeros(2, device="meta"))
    for beta in (1.5, -0.1, math.nan):
        with pytest.raises(ValueError, match="beta must lie"):
            rb.set_beta(beta)
    assert_same_state(before, state_of(rb))
    with pytest.raises(ValueError, match="the buffer is uniform"):
        ReplayBuffer(20, SD, D, device).update_priorities(torch.zeros(1, dtype=torch.long), torch.zeros(1))


@pytest.mark.parametrize("device", DEVICES)
def test_op_level_checks(device):
    """What the Python class cannot pass: a zero-capacity ring, a wrong tree, a bad gamma."""
    rb = ReplayBuffer(20, SD, D, device, prioritized=True, n_step=2, num_envs=2)
    empty_storage = [t[:0] for t in rb._storage]
    r = rows(1, device, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"_replay_add: capacity: expected 1 \.\. \d+ rows, got 0"):
        ops._replay_add(empty_storage, rb.cursor, [], rb._counters[0:1], r)
    with pytest.raises(RuntimeError, match=r"tree.sums: expected shape \[\d+\], got \[0\]"):
        ops._replay_add(rb._storage, rb.cursor, [rb.leaves, rb.sums[:0], rb.mins, rb.max_priority],
                        rb._counters[0:1], r)
    z = torch.zeros(2, SD, device=device)
    f = torch.zeros(2, dtype=torch.bool, device=device)
    with pytest.raises(RuntimeError, match=r"gamma: expected a value in \[0, 1\]"):
        ops._replay_add_steps(rb._storage, rb.cursor, rb._tree, rb._window, rb._counters[1:3], z,
                              torch.zeros(2, D, dtype=torch.long, device=device), torch.zeros(2, device=device), z, f,
                              f, 1.5)
    with pytest.raises(RuntimeError, match="alpha: expected a finite value >= 0"):
        ops._replay_update_priorities(rb._tree, rb.cursor, torch.zeros(0, dtype=torch.long, device=device),
                                      torch.zeros(0, device=device), rb.skipped_priority_updates, -1.0, 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_a_foreign_cursor_never_lets_update_write_past_the_leaves(device):
    """A cursor whose size exceeds the tree's stored leaves (written by someone else) is clamped
    to them: an index past them is refused (CPU) or skipped and counted (CUDA), never written.
    (The op sees no capacity, only the leaves: 32 stored for 20 rows.)"""
    rb = ReplayBuffer(20, SD, D, device, prioritized=True)
    rb.add(*rows(20, device, torch.Generator().manual_seed(0)))
    cursor = rb.cursor.clone()
    cursor[1] = 1000
    leaves = rb.leaves.clone()
    assert rb.leaves.numel() == 32
    beyond = torch.tensor([40], device=device)
    if torch.device(device).type == "cpu":
        with pytest.raises(RuntimeError, match=r"indices: expected rows in \[0, 32\)"):
            ops._replay_update_priorities(rb._tree, cursor, beyond, torch.ones(1), rb.skipped_priority_updates, 0.6,
                                          1e-6)
    else:
        before = rb.skipped_priority_updates.item()
        ops._replay_update_priorities(rb._tree, cursor, beyond, torch.ones(1, device=device),
                                      rb.skipped_priority_updates, 0.6, 1e-6)
        assert rb.skipped_priority_updates.item() == before + 1
    assert torch.equal(rb.leaves, leaves)


@requires_cuda
def test_cuda_inputs_on_the_cpu_are_rejected():
    rb = ReplayBuffer(20, SD, D, "cuda", n_step=2, num_envs=2)
    before = state_of(rb)
    z = torch.zeros(2, SD)
    f = torch.zeros(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="obs: expected torch.float32 .* on cuda:0, got .* on cpu"):
        rb.add_steps(z, torch.zeros(2, D, dtype=torch.long), torch.zeros(2), z, f, f)
    with pytest.raises(RuntimeError, match="obs: expected a tensor on cuda:0, got one on cpu"):
        ops._replay_add_steps(rb._storage, rb.cursor, [], rb._window, rb._counters[1:3], z,
                              torch.zeros(2, D, dtype=torch.long, device="cuda"), torch.zeros(2, device="cuda"),
                              z.cuda(), f.cuda(), f.cuda(), 0.9)
    assert_same_state(before, state_of(rb))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(8)
    rb = ReplayBuffer(64, SD, D, device, prioritized=True, n_step=2, num_envs=3)
    rb.add(*rows(10, device, gen))
    torch.library.opcheck(torch.ops.dqn_ops._replay_add.default,
                          (rb._storage, rb.cursor, rb._tree, rb._counters[0:1], list(rows(3, device, gen))))
    z = torch.randn(3, SD, device=device)
    f = torch.tensor([True, False, False], device=device)
    torch.library.opcheck(torch.ops.dqn_ops._replay_add_steps.default,
                          (rb._storage, rb.cursor, rb._tree, rb._window, rb._counters[1:3], z,
                           torch.zeros(3, D, dtype=torch.long, device=device), torch.ones(3, device=device), z, f,
                           ~f, 0.9))
    out = rb.sample(8)
    torch.library.opcheck(torch.ops.dqn_ops._replay_sample.default,
                          (rb._storage, rb.cursor, rb._tree, rb.beta, rb.rng, rb._counters[3:4],
                           [out[k] for k in BATCH_KEYS]))
    torch.library.opcheck(torch.ops.dqn_ops._replay_update_priorities.default,
                          (rb._tree, rb.cursor, out["indices"], torch.rand(8, device=device),
                           rb.skipped_priority_updates, 0.6, 1e-6))


def test_an_n_step_gamma_whose_encoding_overflows_is_refused():
    """A window cut short stores done = 1 - gamma^-(n - m) in float32: gamma ** (n - 1) must
    leave that finite."""
    with pytest.raises(ValueError, match=r"gamma \*\* \(n_step - 1\) = .* is too small"):
        ReplayBuffer(64, 1, 1, num_envs=1, n_step=25, gamma=0.01)
    ReplayBuffer(64, 1, 1, num_envs=1, n_step=25, gamma=0.5)  # 0.5^24: fine
    ReplayBuffer(64, 1, 1, num_envs=1, n_step=25, gamma=0.0)  # gamma 0: done = 1, no power taken
    with pytest.raises(ValueError, match=r"seed must be an int in \[-2\^63, 2\^64\)"):
        ReplayBuffer(64, 1, 1, seed=2 ** 64)


def test_set_beta_takes_any_real_number_and_only_a_prioritized_buffer():
    rb = ReplayBuffer(20, SD, D, prioritized=True)
    rb.set_beta(np.float32(0.5))
    assert rb.beta.item() == 0.5
    with pytest.raises(ValueError, match="beta must lie"):
        rb.set_beta(True)
    with pytest.raises(ValueError, match=r"ReplayBuffer.set_beta: the buffer is uniform"):
        ReplayBuffer(20, SD, D).set_beta(0.5)
