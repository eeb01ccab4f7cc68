"""A vectorised synthetic futures market on torch tensors: the seeded, self-contained
learning task of ``scripts/train.py`` (no downloads).

Market, per environment: the log price x drifts with a trend regime (-1, 0, +1, switching
now and then), is pulled back towards a slowly wandering fair value f, and is noisy:

    r_{t+1} = kappa (f_t - x_t) + mu regime_t + sigma eps,   f_{t+1} = f_t + sigma_f eta

Actions, three branches of three: direction (short, flat, long), size (0.5, 1, 2 contracts)
and speed (close all, half or a quarter of the gap to the target position this step: slower
trades less). Reward = 100 x (position r_{t+1} - cost |position change|): PnL net of
transaction costs, in percent. Observation (96 features, the reference network's state_dim):
the last 84 returns, the log price's deviation from its 5/10/20/50-step means, its 5/10/20/40-
step momentum, the position, the realised volatility and the time left in the episode.

All environments start and end their episodes together (``episode_length`` steps).
"""
from __future__ import annotations

import math
from typing import Callable, Dict

import torch
from torch import Tensor

DIRECTIONS = (-1.0, 0.0, 1.0)
SIZES = (0.5, 1.0, 2.0)
SPEEDS = (1.0, 0.5, 0.25)
BRANCHES = (3, 3, 3)
MA_WINDOWS = (5, 10, 20, 50)
MOMENTUM_WINDOWS = (5, 10, 20, 40)
LOOKBACK = 84
STATE_DIM = LOOKBACK + len(MA_WINDOWS) + len(MOMENTUM_WINDOWS) + 4
TRADING_DAYS = 252


class FuturesTradingEnv:
    def __init__(self, num_envs: int, episode_length: int = 256, device="cpu", seed: int = 0, kappa: float = 0.08,
                 trend: float = 1e-3, sigma: float = 0.01, sigma_fair: float = 0.002, switch_prob: float = 0.02,
                 cost: float = 5e-4):
        if num_envs < 1 or episode_length < 1:
            raise ValueError(f"FuturesTradingEnv: num_envs and episode_length must be >= 1, got {num_envs}, "
                             f"{episode_length}")
        self.num_envs, self.episode_length = num_envs, episode_length
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        self.kappa, self.trend, self.sigma, self.sigma_fair = kappa, trend, sigma, sigma_fair
        self.switch_prob, self.cost = switch_prob, cost
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self._history_len = max(LOOKBACK, max(MA_WINDOWS), max(MOMENTUM_WINDOWS)) + 1
        self._dirs = torch.tensor(DIRECTIONS, device=self.device)
        self._sizes = torch.tensor(SIZES, device=self.device)
        self._speeds = torch.tensor(SPEEDS, device=self.device)
        self.reset()

    # -- the market ---------------------------------------------------------------------
    def _market_step(self) -> Tensor:
        n = self.num_envs
        switch = torch.rand(n, generator=self.gen, device=self.device) < self.switch_prob
        new_regime = torch.randint(-1, 2, (n,), generator=self.gen, device=self.device).float()
        self.regime = torch.where(switch, new_regime, self.regime)
        eps = torch.randn(2, n, generator=self.gen, device=self.device)
        r = self.kappa * (self.fair - self.x) + self.trend * self.regime + self.sigma * eps[0]
        self.x = self.x + r
        self.fair = self.fair + self.sigma_fair * eps[1]
        self.returns = torch.cat([self.returns[:, 1:], r[:, None]], 1)
        self.prices = torch.cat([self.prices[:, 1:], self.x[:, None]], 1)
        return r

    def reset(self) -> Tensor:
        n = self.num_envs
        self.x = torch.zeros(n, device=self.device)
        self.fair = 0.03 * torch.randn(n, generator=self.gen, device=self.device)
        self.regime = torch.randint(-1, 2, (n,), generator=self.gen, device=self.device).float()
        self.returns = torch.zeros(n, self._history_len, device=self.device)
        self.prices = torch.zeros(n, self._history_len, device=self.device)
        for _ in range(self._history_len):  # burn-in: a full history before the first decision
            self._market_step()
        self.position = torch.zeros(n, device=self.device)
        self.t = 0
        return self.observe()

    def observe(self) -> Tensor:
        scale = 1.0 / self.sigma
        x = self.prices[:, -1:]
        ma = [x[:, 0] - self.prices[:, -w:].mean(1) for w in MA_WINDOWS]
        mom = [self.returns[:, -w:].sum(1) for w in MOMENTUM_WINDOWS]
        vol = self.returns[:, -20:].std(1) * scale
        left = torch.full((self.num_envs,), 1.0 - self.t / self.episode_length, device=self.device)
        feats = [self.returns[:, -LOOKBACK:] * scale, torch.stack(ma, 1) * scale, torch.stack(mom, 1) * scale,
                 torch.stack([self.position, vol, left, self.regime.new_zeros(self.num_envs)], 1)]
        return torch.cat(feats, 1)

    def step(self, actions: Tensor):
        """actions [N, 3] int64 -> (next observation, reward [N], done [N] float, pnl [N]).

        Action ranges are checked on the CPU only (on a GPU that would need a host sync; an
        out-of-range index there fails as torch's indexing does)."""
        if actions.shape != (self.num_envs, len(BRANCHES)) or actions.dtype != torch.long or \
                actions.device != self.device:
            raise ValueError(f"FuturesTradingEnv.step: actions: expected int64 [{self.num_envs}, {len(BRANCHES)}] on "
                             f"{self.device}, got {actions.dtype} {list(actions.shape)} on {actions.device}")
        if self.device.type == "cpu":
            for d, n in enumerate(BRANCHES):
                if actions[:, d].min() < 0 or actions[:, d].max() >= n:
                    raise ValueError(f"FuturesTradingEnv.step: actions[:, {d}] must lie in [0, {n}), got values in "
                                     f"[{int(actions[:, d].min())}, {int(actions[:, d].max())}]")
        target = self._dirs[actions[:, 0]] * self._sizes[actions[:, 1]]
        new_position = self.position + self._speeds[actions[:, 2]] * (target - self.position)
        traded = (new_position - self.position).abs()
        self.last_traded = traded  # kept apart: on the last step the reset zeroes the position
        self.position = new_position
        r = self._market_step()
        pnl = self.position * r - self.cost * traded
        self.t += 1
        done = self.t >= self.episode_length
        dones = torch.full((self.num_envs,), float(done), device=self.device)
        obs = self.observe()  # the terminal observation (stored in replay as s')
        if done:
            self.reset()
        return obs, 100.0 * pnl, dones, pnl

    def random_actions(self) -> Tensor:
        return torch.stack([torch.randint(0, n, (self.num_envs,), generator=self.gen, device=self.device)
                            for n in BRANCHES], 1)


def annualised_sharpe(pnl: Tensor) -> float:
    """Sharpe ratio of per-step (daily) PnL, pooled over all steps and environments, x sqrt(252).
    A policy that never trades has zero variance: its Sharpe is reported as 0."""
    pnl = pnl.double().flatten()
    std = pnl.std().item()
    return 0.0 if std < 1e-12 else pnl.mean().item() / std * math.sqrt(TRADING_DAYS)


@torch.no_grad()
def evaluate(policy: Callable[[Tensor], Tensor], num_envs: int = 128, episode_length: int = 256, device="cpu",
             seed: int = 10_000) -> Dict[str, float]:
    """Runs one episode of `num_envs` held-out markets (seeds unseen in training) under `policy`
    (observations [N, 96] -> actions [N, 3]). Returns annualised Sharpe, mean PnL per step (%),
    and turnover."""
    env = FuturesTradingEnv(num_envs, episode_length, device=device, seed=seed)
    obs = env.observe()
    pnls, turnover = [], 0.0
    for _ in range(episode_length):
        obs, _, _, pnl = env.step(policy(obs))
        turnover = turnover + env.last_traded.mean()
        pnls.append(pnl)
    pnl = torch.stack(pnls)
    return dict(sharpe=annualised_sharpe(pnl), mean_pnl_pct=100 * pnl.mean().item(),
                turnover=float(turnover) / episode_length)


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
