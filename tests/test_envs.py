"""The RL parts (dqn_ops.rl): the environment protocol and the synthetic futures market (its op
against a float64 reference, its statistics, seeding, the CUDA graph), the eager path of a CPU
vector env, the replay buffer, a smoke run of scripts/train.py, and the boundary: importing
dqn_ops loads none of them."""
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import DEVICES, requires_cuda
from dqn_ops.rl.envs import (BRANCHES, DIRECTIONS, HISTORY, LOOKBACK, MA_WINDOWS, MOMENTUM_WINDOWS, SIZES, SPEEDS,
                             STATE_DIM, VOL_WINDOW, EnvStep, FuturesTradingEnv, VectorEnv, annualised_sharpe,
                             evaluate, flat_policy, random_policy)
from dqn_ops.rl.replay import ReplayBuffer
from reference import STREAM_ENV, philox_below, philox_draw, philox_uniform

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_the_ops_package_does_not_import_the_rl_parts():
    code = ("import sys, dqn_ops; loaded = sorted(m for m in sys.modules if m.startswith('dqn_ops.rl')); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300, cwd=ROOT)


# ---------------------------------------------------------------------------------------
# The op against a float64 reference of the same step

def _params(env):
    return dict(seed=env.seed, L=env.episode_length, kappa=env.kappa, trend=env.trend, sigma=env.sigma,
                sigma_fair=env.sigma_fair, switch_prob=env.switch_prob, cost=env.cost)


def reference_features(ring_row, steps, position, left, sigma):
    """The observation from its definition in float64: the returns oldest first, the log price's
    window means as prices (cumulative returns), the momentum sums and the sample std."""
    hist = torch.stack([ring_row[(steps + j) % HISTORY] for j in range(HISTORY)])  # oldest .. newest
    prices = hist.cumsum(0)  # log prices up to a constant (x_t = the last)
    x = prices[-1]
    ma = [x - prices[-w:].mean() for w in MA_WINDOWS]
    mom = [hist[-w:].sum() for w in MOMENTUM_WINDOWS]
    vol = hist[-VOL_WINDOW:].std()
    scale = 1.0 / sigma
    return torch.cat([hist[-LOOKBACK:] * scale, torch.stack(ma) * scale, torch.stack(mom) * scale,
                      torch.tensor([position, vol * scale, left, 0.0], dtype=torch.float64)])


def reference_step(env, actions):
    """One step of every env in float64 from the env's current tensors (read, not changed);
    Philox draws from tests/reference.py. Returns the expected tensors after the step."""
    p = _params(env)
    gap, regime, position = (t.double().cpu().clone() for t in env.state)
    steps, clock = (t.cpu().clone() for t in env.counters)
    ring = env.returns.double().cpu().clone()
    acts = actions.cpu()
    n = env.num_envs
    next_obs, obs = torch.zeros(n, STATE_DIM, dtype=torch.float64), torch.zeros(n, STATE_DIM, dtype=torch.float64)
    info = torch.zeros(5, n, dtype=torch.float64)
    for e in range(n):
        a = [int(v) for v in acts[e]]
        pos = float(position[e])
        nxt = pos + SPEEDS[a[2]] * (DIRECTIONS[a[0]] * SIZES[a[1]] - pos)
        traded = abs(nxt - pos)
        pos = nxt
        call = int(steps[e])
        w = [philox_draw(STREAM_ENV, p["seed"], call, e, slot) for slot in range(4)]
        if philox_uniform(w[0]) < float(np.float32(p["switch_prob"])):
            regime[e] = philox_below(w[1], 3) - 1
        u1, u2 = 1.0 - philox_uniform(w[2]), philox_uniform(w[3])
        radius = math.sqrt(-2.0 * math.log(u1))
        eps, eta = radius * math.cos(2 * math.pi * u2), radius * math.sin(2 * math.pi * u2)
        g = float(gap[e])
        r = p["kappa"] * g + p["trend"] * float(regime[e]) + p["sigma"] * eps
        gap[e] = g - r + p["sigma_fair"] * eta
        ring[e, call % HISTORY] = r
        steps[e] = call + 1
        pnl = pos * r - p["cost"] * traded
        c = int(clock[e]) + 1
        done = c >= p["L"]
        info[:, e] = torch.tensor([100 * pnl, float(done), 0.0, pnl, traded], dtype=torch.float64)
        next_obs[e] = reference_features(ring[e], call + 1, pos, 1 - c / p["L"], p["sigma"])
        obs[e] = reference_features(ring[e], call + 1, 0.0 if done else pos, 1.0 if done else 1 - c / p["L"],
                                    p["sigma"])
        position[e] = 0.0 if done else pos
        clock[e] = 0 if done else c
    return dict(state=torch.stack([gap, regime, position]), counters=torch.stack([steps, clock]), returns=ring,
                observations=torch.stack([next_obs, obs]), info=info)


def randomize(env, gen):
    """Fresh random state: market, positions, ring, step counters past 2^32 (Philox's call high
    word) and episode clocks anywhere in the episode (so envs end at different steps)."""
    n, dev = env.num_envs, env.device
    env.gap.copy_(0.03 * torch.randn(n, generator=gen))
    env.regime.copy_(torch.randint(-1, 2, (n,), generator=gen).float())
    env.position.copy_(4 * torch.rand(n, generator=gen) - 2)
    env.returns.copy_(0.01 * torch.randn(n, HISTORY, generator=gen))
    env.steps.copy_(torch.randint(0, 1 << 40, (n,), generator=gen).to(dev))
    env.clock.copy_(torch.randint(0, env.episode_length, (n,), generator=gen).to(dev))


def random_acts(n, gen, device="cpu"):
    return torch.stack([torch.randint(0, k, (n,), generator=gen) for k in BRANCHES], 1).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_the_step_matches_a_float64_reference_across_episode_ends(device):
    gen = torch.Generator().manual_seed(11)
    env = FuturesTradingEnv(7, episode_length=4, device=device, seed=int(torch.randint(0, 1 << 62, (1,),
                                                                                       generator=gen)),
                            switch_prob=0.3)  # switches often enough to be seen in 9 steps
    randomize(env, gen)
    ends, switches = 0, 0
    for step in range(9):
        acts = random_acts(7, gen, device)
        expected = reference_step(env, acts)
        regime_before = env.regime.clone()
        env.observations.fill_(float("nan"))  # poison: every output element must be written
        env.info.fill_(float("nan"))
        out = env.step(acts)
        tol = dict(rtol=1e-5, atol=1e-5)
        assert torch.equal(env.counters.cpu(), expected["counters"]), step
        assert torch.equal(env.regime.cpu().double(), expected["state"][1]), step
        torch.testing.assert_close(env.state.cpu().double(), expected["state"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(env.returns.cpu().double(), expected["returns"], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(env.observations.cpu().double(), expected["observations"], **tol)
        torch.testing.assert_close(env.info.cpu().double(), expected["info"], **tol)
        # the EnvStep fields are the env's buffers, in the protocol's order
        for field, buf in zip(out, (env.next_obs, env.reward, env.terminated, env.truncated, env.obs)):
            assert field.data_ptr() == buf.data_ptr()
        ends += int(env.terminated.sum())
        switches += int((env.regime != regime_before).sum())
    assert ends >= 7 * 2 and switches > 0  # every env crossed episode ends; regimes switched


def test_the_observation_layout_is_the_documented_one():
    """Columns as the module docstring and the reference network's state_dim say."""
    assert STATE_DIM == 96 == LOOKBACK + len(MA_WINDOWS) + len(MOMENTUM_WINDOWS) + 4
    assert HISTORY == max(LOOKBACK, max(MA_WINDOWS), max(MOMENTUM_WINDOWS), VOL_WINDOW)
    env = FuturesTradingEnv(3, episode_length=8, seed=5)
    env.step(torch.tensor([[2, 2, 0]] * 3))  # long 2 contracts at once
    for buf, pos, left in ((env.next_obs, 2.0, 7 / 8), (env.obs, 2.0, 7 / 8)):
        assert torch.equal(buf[:, -4], torch.full((3,), pos)) and torch.equal(buf[:, -2], torch.full((3,), left))
        assert torch.equal(buf[:, -1], torch.zeros(3))
    newest = env.returns.gather(1, ((env.steps - 1) % HISTORY)[:, None])[:, 0]
    torch.testing.assert_close(env.obs[:, LOOKBACK - 1], newest / env.sigma)


# ---------------------------------------------------------------------------------------
# The protocol, the episode clock, seeding and the market's statistics

@pytest.mark.parametrize("device", DEVICES)
def test_env_shapes_reward_and_episode_end(device):
    env = FuturesTradingEnv(16, episode_length=10, device=device, seed=0)
    assert isinstance(env, VectorEnv) and env.state_dim == STATE_DIM and env.branches == BRANCHES
    obs = env.reset()
    assert obs.shape == (16, STATE_DIM) and torch.isfinite(obs).all() and obs.device == env.device
    assert torch.equal(obs[:, -2], torch.ones(16, device=device))  # all the episode left
    buffers = [t.data_ptr() for t in env.step(env.random_actions())]
    env.reset()
    for t in range(10):
        before = env.position.clone()
        a = env.random_actions()
        out = env.step(a)
        assert [b.data_ptr() for b in out] == buffers  # fixed addresses: what a graph replays
        assert out.next_obs.shape == out.obs.shape == (16, STATE_DIM)
        assert out.reward.shape == out.terminated.shape == out.truncated.shape == (16,)
        assert out.reward.dtype == out.terminated.dtype == out.truncated.dtype == torch.float32
        assert torch.equal(out.terminated, torch.full_like(out.terminated, float(t == 9)))
        assert torch.equal(out.truncated, torch.zeros_like(out.truncated))  # the time left is observed
        target = torch.tensor(DIRECTIONS, device=device)[a[:, 0]] * torch.tensor(SIZES, device=device)[a[:, 1]]
        speed = torch.tensor(SPEEDS, device=device)[a[:, 2]]
        moved = before + speed * (target - before)
        torch.testing.assert_close(out.next_obs[:, -4], moved)  # position: `speed` of the way to the target
        torch.testing.assert_close(env.last_traded, (moved - before).abs())
        torch.testing.assert_close(out.reward, 100 * env.pnl)
        if t < 9:
            torch.testing.assert_close(env.position, moved)
            assert torch.equal(out.obs, out.next_obs) and bool((env.clock == t + 1).all())
        else:  # the episode ended: the terminal observation in next_obs, a new episode in obs
            assert torch.equal(out.next_obs[:, -2], torch.zeros(16, device=device))
            assert torch.equal(out.obs[:, -2], torch.ones(16, device=device))
            assert torch.equal(out.obs[:, -4], torch.zeros(16, device=device))
            assert torch.equal(out.obs[:, :-4], out.next_obs[:, :-4])  # the same market
            assert torch.equal(out.obs[:, -3], out.next_obs[:, -3])
    assert bool((env.clock == 0).all()) and torch.equal(env.position, torch.zeros_like(env.position))
    assert bool((env.steps == HISTORY + 11).all())  # the burn-in, then 11 steps: the market ran on


def test_reset_starts_episodes_without_moving_the_market():
    env = FuturesTradingEnv(5, episode_length=6, seed=2)
    for _ in range(3):
        env.step(torch.tensor([[2, 1, 0]] * 5))
    market = (env.gap.clone(), env.regime.clone(), env.returns.clone(), env.steps.clone(), env.next_obs.clone())
    obs = env.reset()
    assert obs.data_ptr() == env.obs.data_ptr()
    for a, b in zip(market, (env.gap, env.regime, env.returns, env.steps, env.next_obs)):
        assert torch.equal(a, b)
    assert torch.equal(env.clock, torch.zeros(5, dtype=torch.long)) and torch.equal(env.position, torch.zeros(5))
    assert torch.equal(obs[:, :-4], market[4][:, :-4]) and torch.equal(obs[:, -2], torch.ones(5))


@pytest.mark.parametrize("device", DEVICES)
def test_env_is_seeded(device):
    a = FuturesTradingEnv(4, episode_length=7, device=device, seed=3)
    b = FuturesTradingEnv(4, episode_length=7, device=device, seed=3)
    assert torch.equal(a.observe(), b.observe())
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):  # across episode ends
        acts = random_acts(4, gen, device)
        a.step(acts)
        b.step(acts)
        for x, y in zip((a.state, a.counters, a.returns, a.observations, a.info),
                        (b.state, b.counters, b.returns, b.observations, b.info)):
            assert torch.equal(x, y)
    assert not torch.equal(FuturesTradingEnv(4, device=device, seed=4).observe(),
                           FuturesTradingEnv(4, device=device, seed=3).observe())
    assert torch.equal(a.random_actions(), b.random_actions())


def test_market_statistics():
    """The draws and the dynamics, statistically: the return and fair-value noises recovered from
    the trajectory are independent standard normals, the regime is uniform over {-1, 0, 1} and
    changes at rate switch_prob * 2/3 (a switch draws the same regime a third of the time)."""
    n, steps = 256, 400
    env = FuturesTradingEnv(n, episode_length=50, seed=21)
    gen = torch.Generator().manual_seed(3)
    eps, eta, rets, regimes, changes = [], [], [], [], 0
    for _ in range(steps):
        g, reg = env.gap.double().clone(), env.regime.clone()
        env.step(random_acts(n, gen))
        r = env.returns.gather(1, ((env.steps - 1) % HISTORY)[:, None])[:, 0].double()
        rets.append(r)
        eps.append((r - env.kappa * g - env.trend * env.regime.double()) / env.sigma)
        eta.append((env.gap.double() - g + r) / env.sigma_fair)
        regimes.append(env.regime.clone())
        changes += int((env.regime != reg).sum())
    eps, eta, regimes = torch.cat(eps), torch.cat(eta), torch.cat(regimes)
    m = eps.numel()
    for z in (eps, eta):
        assert abs(z.mean().item()) < 5 / m ** 0.5
        assert abs(z.std().item() - 1) < 0.02
        assert abs((z ** 4).mean().item() - 3) < 0.15  # Gaussian kurtosis
    assert abs(torch.corrcoef(torch.stack([eps, eta]))[0, 1].item()) < 5 / m ** 0.5
    assert (eps.abs() > 4).double().mean().item() < 2e-4  # Gaussian tails (6.3e-5 expected)
    for v in (-1.0, 0.0, 1.0):
        assert abs((regimes == v).double().mean().item() - 1 / 3) < 0.05
    rate = changes / m
    assert abs(rate - env.switch_prob * 2 / 3) < 0.15 * env.switch_prob * 2 / 3
    # the returns' spread: sigma, plus the mean reversion's share of the mispricing
    assert env.sigma < torch.cat(rets).std().item() < 1.1 * env.sigma


def test_rewards_follow_the_position_and_the_return():
    """Held positions earn position x return (x100, in percent); a trade pays cost x size; the
    market does not depend on the actions (a twin env trading the opposite way sees the same
    returns and the opposite held PnL)."""
    acts = torch.tensor([[2, 2, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [0, 1, 0], [2, 1, 1]])
    held = torch.tensor([2.0, -2.0, 0.0, 0.5, -1.0, 0.5])  # after the first step (env 5 keeps trading)
    env, twin = FuturesTradingEnv(6, episode_length=100, seed=8), FuturesTradingEnv(6, episode_length=100, seed=8)
    opposite = acts.clone()
    opposite[:, 0] = 2 - opposite[:, 0]
    out, out_twin = env.step(acts), twin.step(opposite)
    r = env.returns.gather(1, ((env.steps - 1) % HISTORY)[:, None])[:, 0]
    torch.testing.assert_close(out.reward, 100 * (held * r - env.cost * held.abs()))
    signs_seen = set()
    for _ in range(30):
        out, out_twin = env.step(acts), twin.step(opposite)
        r = env.returns.gather(1, ((env.steps - 1) % HISTORY)[:, None])[:, 0]
        assert torch.equal(env.returns, twin.returns)
        pos = env.position
        assert torch.equal(env.last_traded[:5], torch.zeros(5))  # holding: no trades, no costs
        assert torch.equal(torch.sign(out.reward[:5]), torch.sign(pos[:5] * r[:5]))
        torch.testing.assert_close(out.reward[:5], 100 * pos[:5] * r[:5])
        assert torch.equal(out_twin.reward[:5], -out.reward[:5])
        assert out.reward[2] == 0  # flat earns nothing
        signs_seen |= set(torch.sign(out.reward[:2]).tolist())
    assert signs_seen == {-1.0, 1.0}


# ---------------------------------------------------------------------------------------
# The eager path of a CPU vector env (module docstring): pinned host buffers, non-blocking copies

class FakeHostVectorEnv:
    """A CPU vector env with numpy in and out, as Gymnasium's vector envs (same-step autoreset:
    an ended env's terminal observation in info["final_obs"], its reset observation returned).
    It logs every transition it made, for the test to compare with the replay buffer."""

    def __init__(self, num_envs, state_dim):
        self.n, self.sd = num_envs, state_dim
        self.lengths = 3 + np.arange(num_envs)  # env i ends every 3 + i steps
        self.t = np.zeros(num_envs, dtype=np.int64)
        self.x = np.zeros((num_envs, state_dim), dtype=np.float32)
        self.log = []

    def _first(self, i):
        return np.float32(0.1) * np.arange(self.sd, dtype=np.float32) + np.float32(i)

    def reset(self):
        self.t[:] = 0
        self.x = np.stack([self._first(i) for i in range(self.n)])
        return self.x.copy()

    def step(self, actions):
        assert actions.dtype == np.int64 and actions.shape[0] == self.n
        before = self.x.copy()
        self.x = self.x + np.float32(0.01) * actions.sum(1, keepdims=True).astype(np.float32)
        reward = (actions[:, 0] - 1).astype(np.float32)
        self.t += 1
        terminated = self.t >= self.lengths
        final = self.x.copy()
        for i in np.flatnonzero(terminated):
            self.x[i], self.t[i] = self._first(i), 0
        self.log.append((before, actions.copy(), reward, final, terminated.astype(np.float32)))
        return self.x.copy(), reward, terminated, np.zeros(self.n, dtype=bool), dict(final_obs=final)


class PinnedHostEnv:
    """A CPU vector env behind the VectorEnv protocol, eagerly: actions to a pinned host buffer
    (non_blocking, then an event wait: the CPU env needs them), its results into pinned host
    buffers and on to the device with non_blocking copies. The copies run on the current
    stream, so once the next step's actions have arrived the previous step's uploads are done
    and the pinned buffers may be rewritten. Pinned memory needs CUDA; on the CPU the same
    buffers are plain tensors and the copies are synchronous."""

    def __init__(self, host_env, branches, device):
        self.host_env, self.branches, self.device = host_env, tuple(branches), torch.device(device)
        self.num_envs, self.state_dim = host_env.n, host_env.sd
        n, sd, pin = self.num_envs, self.state_dim, self.device.type == "cuda"
        self.actions_h = torch.empty(n, len(self.branches), dtype=torch.long, pin_memory=pin)
        self.host = EnvStep(*(torch.empty(shape, pin_memory=pin) for shape in ((n, sd), (n,), (n,), (n,), (n, sd))))
        self.dev = EnvStep(*(torch.empty(t.shape, device=self.device) for t in self.host))
        self.arrived = torch.cuda.Event() if pin else None

    def _wait(self):
        """Until the stream's work so far (the actions' copy, the last uploads) has run."""
        if self.arrived is not None:
            self.arrived.record()
            self.arrived.synchronize()

    def _upload(self):
        for d, h in zip(self.dev, self.host):
            d.copy_(h, non_blocking=True)

    def reset(self):
        self._wait()  # the pinned buffers may still be uploading
        self.host.obs.copy_(torch.from_numpy(self.host_env.reset()))
        self.dev.obs.copy_(self.host.obs, non_blocking=True)
        return self.dev.obs

    def step(self, actions):
        self.actions_h.copy_(actions, non_blocking=True)
        self._wait()  # the CPU env reads the actions: the one sync of the eager path
        obs, reward, terminated, truncated, info = self.host_env.step(self.actions_h.numpy())
        done = terminated | truncated
        self.host.next_obs.copy_(torch.from_numpy(np.where(done[:, None], info["final_obs"], obs)))
        self.host.reward.copy_(torch.from_numpy(reward))
        self.host.terminated.copy_(torch.from_numpy(terminated.astype(np.float32)))
        self.host.truncated.copy_(torch.from_numpy(truncated.astype(np.float32)))
        self.host.obs.copy_(torch.from_numpy(obs))
        self._upload()
        return self.dev


@pytest.mark.parametrize("device", DEVICES)
def test_eager_path_of_a_cpu_vector_env_with_replay_and_trainer(device):
    from dqn_ops import DQNConfig, Trainer, TrainerConfig
    n, sd, steps, B = 4, 6, 12, 8
    host_env = FakeHostVectorEnv(n, sd)
    env = PinnedHostEnv(host_env, BRANCHES, device)
    assert isinstance(env, VectorEnv)
    cfg = DQNConfig(state_dim=sd, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=11, branches=BRANCHES)
    trainer = Trainer(cfg, TrainerConfig(batch_size=B, readback_interval=4), device=device, seed=0)
    replay = ReplayBuffer(100, sd, len(BRANCHES), device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    obs = env.reset().clone()  # ours: the env rewrites its buffers every step
    for step in range(steps):
        explore = torch.rand(n, 1, generator=gen, device=device) < 0.5
        random = torch.stack([torch.randint(0, k, (n,), generator=gen, device=device) for k in BRANCHES], 1)
        a = torch.where(explore, random, trainer.act(obs))
        out = env.step(a)
        replay.add(obs, a, out.reward, out.next_obs, out.terminated)
        obs.copy_(out.obs)
        if replay.size >= B:
            trainer.step(replay.sample(B))
    trainer.readback()
    assert trainer.steps == steps - (B - 1) // n
    s, a, r, s2, d = (torch.from_numpy(np.concatenate(x)) for x in zip(*host_env.log))
    rows = steps * n
    assert torch.equal(replay.states[:rows].cpu(), s) and torch.equal(replay.actions[:rows].cpu(), a)
    assert torch.equal(replay.rewards[:rows].cpu(), r) and torch.equal(replay.next_states[:rows].cpu(), s2)
    assert torch.equal(replay.dones[:rows].cpu(), d) and d.sum() >= n  # every env ended at least once


def test_the_market_rewards_mean_reversion_and_punishes_random_trading():
    """The task has something to learn: a hand-written mean-reversion rule on the MA-50
    deviation feature earns a clearly positive Sharpe; random trading loses its costs."""
    def mean_reversion(obs):
        dev = obs[:, 84 + 3]
        a = torch.ones(obs.shape[0], 3, dtype=torch.long)
        a[:, 0] = torch.where(dev > 0.5, 0, torch.where(dev < -0.5, 2, 1))
        return a
    assert evaluate(mean_reversion, 64)["sharpe"] > 1.0
    assert evaluate(random_policy(), 64)["sharpe"] < 0
    flat = evaluate(flat_policy, 64)
    assert flat["sharpe"] == 0 and flat["turnover"] == 0


def test_sharpe():
    pnl = torch.tensor([0.01, -0.005, 0.02, 0.0])
    expected = pnl.double().mean() / pnl.double().std() * 252 ** 0.5
    assert annualised_sharpe(pnl) == pytest.approx(expected.item())
    assert annualised_sharpe(torch.zeros(10)) == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_replay_ring_and_sampling(device):
    rb = ReplayBuffer(10, 3, 2, device=device)
    with pytest.raises(RuntimeError, match="empty"):
        rb.sample(4)
    for i in range(3):  # 12 rows into 10: the first two are overwritten
        s = torch.full((4, 3), float(i * 4), device=device) + torch.arange(4, device=device)[:, None]
        rb.add(s, torch.zeros(4, 2, dtype=torch.long, device=device), s[:, 0], s + 100, torch.zeros(4, device=device))
    assert rb.size == 10 and rb.next == 2
    assert sorted(rb.rewards.tolist()) == [float(x) for x in range(2, 12)]
    b = rb.sample(64)
    assert torch.equal(b["next_states"], b["states"] + 100) and torch.equal(b["rewards"], b["states"][:, 0])
    with pytest.raises(ValueError, match="do not fit"):
        rb.add(*(torch.zeros(11, k, device=device) for k in (3,)), torch.zeros(11, 2, dtype=torch.long, device=device),
               torch.zeros(11, device=device), torch.zeros(11, 3, device=device), torch.zeros(11, device=device))


def test_train_script_refuses_bad_flags_before_any_setup():
    script = os.path.join(ROOT, "scripts", "train.py")
    for flags, msg in ((["--epochs", "0"], "--epochs must be >= 1, got 0"), (["--n-step", "-1"], "--n-step must be >= 1"),
                       (["--gamma", "1.5"], r"--gamma must lie in \(0, 1\]"),
                       (["--act-ucb", "1"], "--act-ucb scores actions over an ensemble's members")):
        r = subprocess.run([sys.executable, script, "--device", "cpu", *flags], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and re.search(msg, r.stderr), (flags, r.stderr[-400:])


def test_train_script_runs_iqn_to_its_end(tmp_path):
    out = tmp_path / "iqn"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--device", "cpu", "--epochs", "1", "--steps",
           "4", "--batch", "16", "--num-envs", "4", "--eval-envs", "8", "--tiny", "--quiet", "--loss-type", "iqn",
           "--iqn-fractions", "8", "--iqn-embedding", "8", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    assert (out / "learning_curve.png").exists() and json.loads((out / "summary.json").read_text())["epochs"] == 1


def test_train_script_smoke(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--device", "cpu", "--epochs", "2", "--steps",
           "8", "--batch", "16", "--num-envs", "8", "--eval-envs", "8", "--tiny", "--quiet", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == 2 and not summary["non_finite"]
    rows = (out / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 3 and rows[0].startswith("epoch,")
    assert (out / "checkpoint.pt").exists() and (out / "learning_curve.png").exists()
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["steps"] == 16


@pytest.mark.parametrize("script", ["cleanrl_c51_torch.py", "cleanrl_c51_dqn_ops.py"])
def test_drop_in_example_scripts_run(script):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", script), "--device", "cpu", "--total-steps", "15",
           "--num-envs", "4", "--batch-size", "16"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    assert "held-out Sharpe:" in out


def test_step_benchmark_runs_on_cpu():
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "--device", "cpu", "--batches", "16",
           "--modes", "torch_eager_f32", "dqn_ops_eager", "dqn_ops_graph", "--iters", "2"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    assert "| 16 |" in out and "not run: needs CUDA" in out


def test_bad_input_to_env_and_replay():
    env = FuturesTradingEnv(4, seed=0)
    with pytest.raises(ValueError, match=r"actions: expected int64 \[4, 3\] on cpu, got torch.float32 \[4, 3\]"):
        env.step(torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"actions: expected int64 \[4, 3\] on cpu, got torch.int64 \[4, 2\]"):
        env.step(torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"actions: expected int64 \[4, 3\] on cpu, got torch.int64 \[4, 3\] on meta"):
        env.step(torch.zeros(4, 3, dtype=torch.long, device="meta"))
    before = [t.clone() for t in (env.state, env.counters, env.returns, env.observations, env.info)]
    with pytest.raises(RuntimeError, match=r"actions\[:, 1\]: expected values in \[0, 3\), got values in \[0, 3\]"):
        env.step(torch.tensor([[0, 0, 0], [1, 3, 0], [2, 1, 1], [0, 0, 2]]))
    with pytest.raises(RuntimeError, match=r"actions\[:, 2\]: expected values in \[0, 3\), got values in \[-1, 2\]"):
        env.step(torch.tensor([[0, 0, 0], [1, 2, -1], [2, 1, 1], [0, 0, 2]]))
    for a, b in zip(before, (env.state, env.counters, env.returns, env.observations, env.info)):
        assert torch.equal(a, b)  # a rejected step changes nothing
    for kw, err, msg in ((dict(num_envs=0), ValueError, r"num_envs must be >= 1 \(an int\), got 0"),
                         (dict(episode_length=0), ValueError, r"episode_length must be >= 1 \(an int\), got 0"),
                         (dict(num_envs=2.5), TypeError, "num_envs must be an int >= 1, got"),
                         (dict(seed=2 ** 64), ValueError, r"seed must be an int in \[-2\^63, 2\^64\)"),
                         (dict(sigma=0.0), ValueError, "sigma must be a finite number > 0"),
                         (dict(switch_prob=2.0), ValueError, "switch_prob must be a finite number >= 0 and <= 1"),
                         (dict(cost=-1.0), ValueError, "cost must be a finite number >= 0"),
                         (dict(kappa=float("nan")), ValueError, "kappa must be a finite number")):
        with pytest.raises(err, match=f"FuturesTradingEnv: {msg}"):
            FuturesTradingEnv(**{**dict(num_envs=4, episode_length=8), **kw})
    rb = ReplayBuffer(10, 3, 2)
    ok = [torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4), torch.zeros(4, 3), torch.zeros(4)]
    for i, (bad, msg) in enumerate([(torch.zeros(4, 5), r"states: expected torch.float32 \[4, 3\] on cpu, got "
                                                          r"torch.float32 \[4, 5\]"),
                                    (torch.zeros(4, 2), "actions: expected torch.int64"),
                                    (torch.zeros(3), r"rewards: expected torch.float32 \[4\]")]):
        args = list(ok)
        args[i] = bad
        with pytest.raises(ValueError, match=msg):
            rb.add(*args)
    with pytest.raises(ValueError, match="at least one transition"):
        rb.add(torch.zeros(0, 3), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0), torch.zeros(0, 3), torch.zeros(0))
    assert rb.size == 0


def _op_args(env, actions):
    return [actions, env.state, env.counters, env.returns, env.observations, env.info, *env._params]


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_to_the_ops(device):
    env = FuturesTradingEnv(4, episode_length=5, device=device, seed=0)
    acts = torch.ones(4, 3, dtype=torch.long, device=device)
    step, reset = torch.ops.dqn_ops._futures_env_step.default, torch.ops.dqn_ops._futures_env_reset.default

    def bad(i, value, msg):
        args = _op_args(env, acts)
        args[i] = value
        with pytest.raises(RuntimeError, match=msg):
            step(*args)

    bad(0, acts[:3], r"_futures_env_step: actions: expected shape \[4, 3\], got \[3, 3\]")
    bad(0, acts.int(), "actions: expected dtype Long, got Int")
    bad(0, torch.ones(3, 4, dtype=torch.long, device=device).t(), "actions: expected a contiguous tensor")
    bad(1, env.state[:2], r"state: expected shape \[3, \*\], got \[2, 4\]")
    bad(1, torch.zeros(3, 0, device=device), "state: expected at least one environment")
    bad(2, env.counters.float(), "counters: expected dtype Long, got Float")
    bad(3, env.returns[:, :50].contiguous(), r"returns: expected shape \[4, 84\], got \[4, 50\]")
    bad(4, env.observations[:1], r"observations: expected shape \[2, 4, 96\]")
    bad(5, env.info[:4], r"info: expected shape \[5, 4\]")
    shared = torch.zeros(8, 4, device=device)
    args = _op_args(env, acts)
    args[1], args[5] = shared[:3], shared[3:]
    step(*args)  # adjacent, not overlapping: fine
    args[5] = shared[2:7]
    with pytest.raises(RuntimeError, match="info and state must not share memory"):
        step(*args)
    args = _op_args(env, acts)  # the actions are read while the observations are written
    args[0] = env.observations.view(-1).view(torch.long)[:12].view(4, 3)
    with pytest.raises(RuntimeError, match="actions and observations must not share memory"):
        step(*args)
    bad(7, 0, "episode_length: expected >= 1, got 0")
    bad(8, float("nan"), "kappa: expected a finite number, got nan")
    bad(10, 0.0, "sigma: expected > 0")
    bad(13, float("inf"), "cost: expected a finite number")
    with pytest.raises(RuntimeError, match="_futures_env_reset: episode_length: expected >= 1, got 0"):
        reset(env.state, env.counters, env.returns, env.observations, env.sigma, 0)
    with pytest.raises(RuntimeError, match="_futures_env_reset: sigma: expected > 0"):
        reset(env.state, env.counters, env.returns, env.observations, -1.0, 5)
    with pytest.raises(RuntimeError, match="_futures_env_reset: returns: expected dtype Float"):
        reset(env.state, env.counters, env.returns.double(), env.observations, env.sigma, 5)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    env = FuturesTradingEnv(3, episode_length=4, device=device, seed=1)
    acts = torch.tensor([[0, 1, 2], [2, 2, 0], [1, 0, 1]], device=device)
    torch.library.opcheck(torch.ops.dqn_ops._futures_env_step.default, tuple(_op_args(env, acts)))
    torch.library.opcheck(torch.ops.dqn_ops._futures_env_reset.default,
                          (env.state, env.counters, env.returns, env.observations, env.sigma, env.episode_length))


# ---------------------------------------------------------------------------------------
# CUDA: the same markets as the CPU, deterministic, one launch, captured in a graph

@requires_cuda
def test_cuda_follows_the_cpu_markets_and_is_deterministic():
    cpu = FuturesTradingEnv(300, episode_length=40, device="cpu", seed=17)
    gpu = FuturesTradingEnv(300, episode_length=40, device="cuda", seed=17)
    gpu2 = FuturesTradingEnv(300, episode_length=40, device="cuda", seed=17)
    gen = torch.Generator().manual_seed(5)
    for step in range(200):  # five episodes
        acts = random_acts(300, gen)
        _, b, c = cpu.step(acts), gpu.step(acts.cuda()), gpu2.step(acts.cuda())
        for x, y in zip(b, c):
            assert torch.equal(x, y), step  # the same inputs: the same bits
        assert torch.equal(gpu.counters.cpu(), cpu.counters)
        assert torch.equal(gpu.regime.cpu(), cpu.regime)  # discrete draws: exact
        assert torch.equal(gpu.position.cpu(), cpu.position)  # from the actions only
        torch.testing.assert_close(gpu.gap.cpu(), cpu.gap, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(gpu.returns.cpu(), cpu.returns, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(gpu.observations.cpu(), cpu.observations, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gpu.info.cpu(), cpu.info, rtol=1e-4, atol=1e-5)
    assert cpu.terminated.sum() == 300  # step 200 ended the fifth episode


@requires_cuda
def test_cuda_step_matches_the_float64_reference_past_one_block():
    """More envs than one block of threads, with the reference on a sample of them."""
    gen = torch.Generator().manual_seed(12)
    env = FuturesTradingEnv(300, episode_length=3, device="cuda", seed=99)
    randomize(env, gen)
    for step in range(4):
        acts = random_acts(300, gen, "cuda")
        expected = reference_step(env, acts)
        env.observations.fill_(float("nan"))
        env.info.fill_(float("nan"))
        env.step(acts)
        assert torch.equal(env.counters.cpu(), expected["counters"]), step
        torch.testing.assert_close(env.state.cpu().double(), expected["state"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(env.observations.cpu().double(), expected["observations"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(env.info.cpu().double(), expected["info"], rtol=1e-5, atol=1e-5)


@requires_cuda
def test_cuda_out_of_range_actions_make_nan_rewards_not_trades():
    env = FuturesTradingEnv(4, episode_length=10, device="cuda", seed=3)
    twin = FuturesTradingEnv(4, episode_length=10, device="cuda", seed=3)
    env.step(torch.tensor([[2, 1, 0]] * 4, device="cuda"))
    twin.step(torch.tensor([[2, 1, 0]] * 4, device="cuda"))
    bad = torch.tensor([[2, 1, 0], [3, 1, 0], [0, -1, 0], [0, 0, 7]], device="cuda")
    out = env.step(bad)
    twin.step(torch.tensor([[2, 1, 0], [2, 1, 0], [2, 1, 0], [2, 1, 0]], device="cuda"))  # holds: no trade
    torch.cuda.synchronize()
    assert torch.isfinite(out.reward[0]) and torch.isnan(out.reward[1:]).all() and torch.isnan(env.pnl[1:]).all()
    assert torch.equal(env.position, twin.position) and torch.equal(env.last_traded, twin.last_traded)
    assert torch.equal(env.returns, twin.returns) and torch.isfinite(env.observations).all()


@requires_cuda
def test_cuda_step_is_one_kernel_launch():
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    env = FuturesTradingEnv(256, device="cuda", seed=0)
    acts = env.random_actions()
    env.step(acts)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        env.step(acts)
        torch.cuda.synchronize()
    on_gpu = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    assert len(on_gpu) == 1 and "futures_env_step" in on_gpu[0], on_gpu


@requires_cuda
def test_cuda_graph_replays_equal_eager_steps_across_episode_ends():
    n, L, K = 200, 5, 13
    env = FuturesTradingEnv(n, episode_length=L, device="cuda", seed=31)
    twin = FuturesTradingEnv(n, episode_length=L, device="cuda", seed=31)
    actions = torch.zeros(n, 3, dtype=torch.long, device="cuda")
    gen = torch.Generator().manual_seed(2)
    first = random_acts(n, gen, "cuda")
    actions.copy_(first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream, as torch.cuda.graphs asks
        env.step(actions)
    torch.cuda.current_stream().wait_stream(side)
    twin.step(first)
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()  # torch.cuda.graph's entry sync, done before the check: the capture must not sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(capture):
            graph.capture_begin()
            out = env.step(actions)
            graph.capture_end()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.current_stream().wait_stream(capture)
    buffers = (env.state, env.counters, env.returns, env.observations, env.info)
    ends = 0
    for k in range(K):
        acts = random_acts(n, gen, "cuda")
        actions.copy_(acts)
        env.observations.fill_(float("nan"))  # the replay must rewrite them
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
            twin_out = twin.step(acts)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for x, y in zip(buffers, (twin.state, twin.counters, twin.returns, twin.observations, twin.info)):
            assert torch.equal(x, y), k
        for x, y in zip(out, twin_out):
            assert torch.equal(x, y), k
        ends += int(out.terminated.sum())
    assert ends == 2 * n  # two episode ends inside the replays (after the warm-up step: clocks 1 .. 14)


def test_turnover_counts_trades_not_the_episode_reset():
    def always_long(obs):
        a = torch.zeros(obs.shape[0], 3, dtype=torch.long)
        a[:, 0], a[:, 1], a[:, 2] = 2, 1, 0  # long 1 contract, at once
        return a
    # one trade of 1 contract at the first step, then holding: turnover 1 / episode_length
    assert evaluate(always_long, 8, episode_length=16)["turnover"] == pytest.approx(1 / 16)
