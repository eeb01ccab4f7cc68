"""Environments on the device: the protocol the collector drives, and a vectorised synthetic
futures market, the seeded, self-contained learning task of ``scripts/train.py`` (no downloads).

The protocol (``VectorEnv``): ``num_envs``, ``state_dim``, ``branches``, ``device``;
``reset() -> obs [N, state_dim] float32`` and ``step(actions [N, D] int64) -> EnvStep``:

    next_obs    [N, state_dim] F32  the observation the action led to (replay's s')
    reward      [N] F32
    terminated  [N] F32  1.0 where the episode ended in a terminal state
    truncated   [N] F32  1.0 where it was cut off by a limit the observation does not show
    obs         [N, state_dim] F32  the observation to act on next: next_obs, or the first
                                    observation of a new episode where an env reset itself

All on the env's device, static shapes, written into the same preallocated tensors every call
(a CUDA graph replays the same addresses), no host sync: a captured graph can hold
act -> env.step -> replay.add. The tensors are overwritten by the next ``step`` or ``reset``:
copy what must outlive it (the observation a transition starts from, say) first.

The market (``FuturesTradingEnv``), per environment: the log price x drifts with a trend regime
(-1, 0, +1, switching now and then), is pulled back towards a slowly wandering fair value f,
and is noisy:

    r_{t+1} = kappa (f_t - x_t) + mu regime_t + sigma eps,   f_{t+1} = f_t + sigma_f eta

Actions, three branches of three: direction (short, flat, long), size (0.5, 1, 2 contracts)
and speed (close all, half or a quarter of the gap to the target position this step: slower
trades less). Reward = 100 x (position r_{t+1} - cost |position change|): PnL net of
transaction costs, in percent. Observation (96 features, the reference network's state_dim):
the last 84 returns, the log price's deviation from its 5/10/20/50-step means, its 5/10/20/40-
step momentum, the position, the realised volatility, the time left in the episode and a zero
(95 features, padded to the reference network's 96).

A step of all N environments is one op (``dqn_ops._futures_env_step``: one kernel launch on
CUDA; the arithmetic in csrc/env_math.h, the same on the CPU). The market state, a ring of the
last 84 returns, each env's step counter and episode clock live in device tensors; random
numbers are Philox draws (csrc/philox.h) keyed by the seed and counted by the env's step
counter, so a CPU and a CUDA env of one seed follow the same markets (up to float rounding).
The market is stationary and keeps running across episodes: an episode ends after
``episode_length`` steps (a termination: the observation shows the time left), which resets
the position and the episode clock only. The initial state is drawn on the host from the seed
and run for 84 steps before the first decision, once, at construction.

CPU environments (e.g. Gymnasium vector envs) stay on the eager path: act on the GPU, copy the
actions to a pinned host buffer (``non_blocking=True``, then wait on an event recorded after
the copy: the CPU env needs them, the one sync per step), step the CPU env, write its results
into pinned host buffers and copy those to device buffers with ``non_blocking=True`` (on the
same stream, so the next step's wait for its actions also waits for these uploads: only then
are the pinned buffers written again); then ``ReplayBuffer.add`` and ``Trainer.step`` as with
a device env. ``tests/test_envs.py`` (``PinnedHostEnv``, ``FakeHostVectorEnv``) has a small example.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, NamedTuple, Protocol, Tuple, runtime_checkable

import torch
from torch import Tensor

from dqn_ops import ops
from dqn_ops.layout import check_float, check_int, check_seed

DIRECTIONS = (-1.0, 0.0, 1.0)
SIZES = (0.5, 1.0, 2.0)
SPEEDS = (1.0, 0.5, 0.25)
BRANCHES = (3, 3, 3)
MA_WINDOWS = (5, 10, 20, 50)
MOMENTUM_WINDOWS = (5, 10, 20, 40)
VOL_WINDOW = 20
LOOKBACK = 84
HISTORY = max(LOOKBACK, max(MA_WINDOWS), max(MOMENTUM_WINDOWS), VOL_WINDOW)  # the ring of returns
STATE_DIM = LOOKBACK + len(MA_WINDOWS) + len(MOMENTUM_WINDOWS) + 4
TRADING_DAYS = 252


class EnvStep(NamedTuple):
    next_obs: Tensor    # [N, state_dim] F32: the observation the action led to (replay's s')
    reward: Tensor      # [N] F32
    terminated: Tensor  # [N] F32, 1.0 / 0.0
    truncated: Tensor   # [N] F32, 1.0 / 0.0
    obs: Tensor         # [N, state_dim] F32: the observation to act on next


@runtime_checkable
class VectorEnv(Protocol):
    """N environments stepped together on one device (see the module docstring)."""
    num_envs: int
    state_dim: int
    branches: Tuple[int, ...]
    device: torch.device

    def reset(self) -> Tensor:
        ...

    def step(self, actions: Tensor) -> EnvStep:
        ...


class FuturesTradingEnv:
    """N synthetic futures markets (the module docstring); a ``VectorEnv``.

    Device tensors (read them, do not resize them): ``position`` [N], ``regime`` [N], ``clock``
    [N] int64 (steps into the episode), ``steps`` [N] int64 (market steps), ``returns`` [N, 84]
    (the ring); after a step ``pnl`` [N] (PnL before the x100 of the reward) and
    ``last_traded`` [N] (|position change| of the step's trade; an episode end's reset is not a trade).
    """

    state_dim = STATE_DIM
    branches = BRANCHES

    def __init__(self, num_envs: int, episode_length: int = 256, device="cpu", seed: int = 0, kappa: float = 0.08,
                 trend: float = 1e-3, sigma: float = 0.01, sigma_fair: float = 0.002, switch_prob: float = 0.02,
                 cost: float = 5e-4):
        n = "FuturesTradingEnv"
        num_envs = check_int(n, "num_envs", num_envs, minimum=1)
        episode_length = check_int(n, "episode_length", episode_length, minimum=1)
        seed = check_seed(n, seed)
        for field, value in (("kappa", kappa), ("trend", trend), ("sigma_fair", sigma_fair)):
            check_float(n, field, value)
        sigma = check_float(n, "sigma", sigma, low=0.0, low_open=True)  # the features are in units of it
        switch_prob = check_float(n, "switch_prob", switch_prob, low=0.0, high=1.0)
        cost = check_float(n, "cost", cost, low=0.0)
        self.num_envs, self.episode_length, self.seed = num_envs, episode_length, seed
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        self.kappa, self.trend, self.sigma, self.sigma_fair = kappa, trend, sigma, sigma_fair
        self.switch_prob, self.cost = switch_prob, cost
        self._params = (seed, episode_length, kappa, trend, sigma, sigma_fair, switch_prob, cost)
        n, dev = num_envs, self.device
        # The initial market, from the seed on the host (the same on every device): a fair value
        # off the price by N(0, 0.03^2), a uniform regime.
        host = torch.Generator().manual_seed(seed)
        self.state = torch.zeros(3, n)  # gap = f - x, regime, position
        self.state[0] = 0.03 * torch.randn(n, generator=host)
        self.state[1] = torch.randint(-1, 2, (n,), generator=host).float()
        self.state = self.state.to(dev)
        self.counters = torch.zeros(2, n, dtype=torch.long, device=dev)  # steps, clock
        self.returns = torch.zeros(n, HISTORY, device=dev)
        self.observations = torch.zeros(2, n, STATE_DIM, device=dev)  # next_obs, obs
        self.info = torch.zeros(5, n, device=dev)  # reward, terminated, truncated, pnl, traded
        self.gap, self.regime, self.position = self.state.unbind(0)
        self.steps, self.clock = self.counters.unbind(0)
        self.next_obs, self.obs = self.observations.unbind(0)
        self.reward, self.terminated, self.truncated, self.pnl, self.last_traded = self.info.unbind(0)
        self._result = EnvStep(self.next_obs, self.reward, self.terminated, self.truncated, self.obs)
        self.gen = torch.Generator(device=dev).manual_seed(seed)  # random_actions only
        flat = torch.tensor([[1, 0, 0]], dtype=torch.long, device=dev).expand(n, 3).contiguous()
        for _ in range(HISTORY):  # burn-in: a full ring of returns before the first decision
            ops._futures_env_step(flat, self.state, self.counters, self.returns, self.observations, self.info,
                                  *self._params)
        self.info.zero_()
        self.reset()

    def reset(self) -> Tensor:
        """Every env starts an episode (position and clock 0; the market does not move).
        Returns ``obs``, the buffer every step rewrites."""
        ops._futures_env_reset(self.state, self.counters, self.returns, self.observations, self.sigma,
                               self.episode_length)
        return self.obs

    def observe(self) -> Tensor:
        """The observation to act on (``obs``; rewritten by the next step)."""
        return self.obs

    def step(self, actions: Tensor) -> EnvStep:
        """actions [N, 3] int64 -> EnvStep (buffers of this env, rewritten by the next step).

        Action ranges are checked on the CPU only (on a GPU that would need a host sync): on
        CUDA an action outside [0, 3) trades nothing and makes that env's reward NaN."""
        if actions.shape != (self.num_envs, len(BRANCHES)) or actions.dtype != torch.long or \
                actions.device != self.device:
            raise ValueError(f"FuturesTradingEnv.step: actions: expected int64 [{self.num_envs}, {len(BRANCHES)}] on "
                             f"{self.device}, got {actions.dtype} {list(actions.shape)} on {actions.device}")
        ops._futures_env_step(actions.contiguous(), self.state, self.counters, self.returns, self.observations,
                              self.info, *self._params)
        return self._result

    def random_actions(self) -> Tensor:
        return torch.stack([torch.randint(0, n, (self.num_envs,), generator=self.gen, device=self.device)
                            for n in BRANCHES], 1)


def annualised_sharpe(pnl: Tensor) -> float:
    """Sharpe ratio of per-step (daily) PnL, pooled over all steps and environments, x sqrt(252).
    A policy that never trades has zero variance: its Sharpe is reported as 0 (so is a single
    step's, which has no variance to measure)."""
    pnl = pnl.double().flatten()
    if pnl.numel() < 2:
        return 0.0
    std = pnl.std().item()
    return 0.0 if std < 1e-12 else pnl.mean().item() / std * math.sqrt(TRADING_DAYS)


@torch.no_grad()
def evaluate(policy: Callable[[Tensor], Tensor], num_envs: int = 128, episode_length: int = 256, device="cpu",
             seed: int = 10_000) -> Dict[str, float]:
    """Runs one episode of `num_envs` held-out markets (seeds unseen in training) under `policy`
    (observations [N, 96] -> actions [N, 3]). Returns annualised Sharpe, mean PnL per step (%),
    and turnover."""
    env = FuturesTradingEnv(num_envs, episode_length, device=device, seed=seed)
    obs = env.reset()
    pnl = torch.empty(episode_length, num_envs, device=env.device)
    traded = torch.empty(episode_length, num_envs, device=env.device)
    for t in range(episode_length):
        obs = env.step(policy(obs)).obs
        pnl[t] = env.pnl
        traded[t] = env.last_traded
    return dict(sharpe=annualised_sharpe(pnl), mean_pnl_pct=100 * pnl.mean().item(),
                turnover=traded.mean().item())


def random_policy(seed: int = 1) -> Callable[[Tensor], Tensor]:
    gens = {}

    def act(obs):
        g = gens.setdefault(obs.device, torch.Generator(device=obs.device).manual_seed(seed))
        return torch.stack([torch.randint(0, n, (obs.shape[0],), generator=g, device=obs.device) for n in BRANCHES], 1)
    return act


def flat_policy(obs: Tensor) -> Tensor:
    a = torch.zeros(obs.shape[0], 3, dtype=torch.long, device=obs.device)
    a[:, 0] = 1  # direction: flat
    return a
