"""The RL parts (dqn_ops.rl): the synthetic futures market, the replay buffer, a smoke run of
scripts/train.py, and the boundary: importing dqn_ops loads none of them."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import DEVICES
from dqn_ops.rl.envs import (STATE_DIM, FuturesTradingEnv, annualised_sharpe, evaluate, flat_policy,
                             random_policy)
from dqn_ops.rl.replay import ReplayBuffer

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_the_ops_package_does_not_import_the_rl_parts():
    code = ("import sys, dqn_ops; loaded = sorted(m for m in sys.modules if m.startswith('dqn_ops.rl')); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("device", DEVICES)
def test_env_shapes_reward_and_episode_end(device):
    env = FuturesTradingEnv(16, episode_length=10, device=device, seed=0)
    obs = env.observe()
    assert obs.shape == (16, STATE_DIM) and torch.isfinite(obs).all()
    for t in range(10):
        before = env.position.clone()
        a = env.random_actions()
        nxt, r, d, pnl = env.step(a)
        assert nxt.shape == (16, STATE_DIM) and r.shape == d.shape == pnl.shape == (16,)
        assert torch.equal(d, torch.full_like(d, float(t == 9)))
        if t < 9:  # position follows the action: a fraction `speed` of the way to direction x size
            target = torch.tensor([-1.0, 0.0, 1.0], device=device)[a[:, 0]] * \
                torch.tensor([0.5, 1.0, 2.0], device=device)[a[:, 1]]
            speed = torch.tensor([1.0, 0.5, 0.25], device=device)[a[:, 2]]
            torch.testing.assert_close(env.position, before + speed * (target - before))
        torch.testing.assert_close(r, 100 * pnl)
    assert env.t == 0 and torch.equal(env.position, torch.zeros_like(env.position))  # reset after the end


def test_env_is_seeded():
    a, b = FuturesTradingEnv(4, seed=3), FuturesTradingEnv(4, seed=3)
    assert torch.equal(a.observe(), b.observe())
    acts = a.random_actions()
    b.random_actions()
    assert torch.equal(a.step(acts)[0], b.step(acts)[0])
    assert not torch.equal(FuturesTradingEnv(4, seed=4).observe(), a.observe())


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
    with pytest.raises(ValueError, match=r"actions\[:, 1\] must lie in \[0, 3\), got values in \[0, 3\]"):
        env.step(torch.tensor([[0, 0, 0], [1, 3, 0], [2, 1, 1], [0, 0, 2]]))
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


def test_turnover_counts_trades_not_the_episode_reset():
    def always_long(obs):
        a = torch.zeros(obs.shape[0], 3, dtype=torch.long)
        a[:, 0], a[:, 1], a[:, 2] = 2, 1, 0  # long 1 contract, at once
        return a
    # one trade of 1 contract at the first step, then holding: turnover 1 / episode_length
    assert evaluate(always_long, 8, episode_length=16)["turnover"] == pytest.approx(1 / 16)
