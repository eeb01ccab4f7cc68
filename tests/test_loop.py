"""dqn_ops.rl.loop.TrainingLoop: what an iteration does (against the same calls made by hand),
its schedules, determinism, bad configurations; on CUDA the graphed loop against the eager one
(the same parameters, bit for bit) and no host sync in a replay."""
import copy

import numpy as np
import pytest
import torch

from conftest import DEVICES, requires_cuda
from dqn_ops import DQNConfig, Trainer, TrainerConfig
from dqn_ops.rl.baseline import TorchTrainer
from dqn_ops.rl.envs import BRANCHES, STATE_DIM, FuturesTradingEnv
from dqn_ops.rl.loop import LoopConfig, TrainingLoop
from dqn_ops.rl.replay import ReplayBuffer

NET = DQNConfig(state_dim=STATE_DIM, trunk_hidden=(32, 32), value_hidden=16, adv_hidden=16, atoms=11, branches=BRANCHES)


def make(device, envs=8, batch=16, K=10, graph=False, prioritized=False, n_step=1, seed=0, trainer_cls=Trainer,
         **loop_kwargs):
    cfg = TrainerConfig(batch_size=batch, gamma=0.9 ** n_step, readback_interval=max(K, 1), on_non_finite="flag",
                        use_cuda_graph=False)
    trainer = trainer_cls(NET, cfg, device=device, seed=seed)
    env = FuturesTradingEnv(envs, episode_length=7, device=device, seed=seed + 1)
    replay = ReplayBuffer(500, STATE_DIM, len(BRANCHES), device=device, seed=seed + 2, num_envs=envs,
                          prioritized=prioritized, n_step=n_step, gamma=0.9)
    loop = TrainingLoop(trainer, env, replay, LoopConfig(iterations_per_graph=K, use_cuda_graph=graph, **loop_kwargs))
    return trainer, env, replay, loop


def state_of(trainer, replay):
    out = [trainer.online.flat_params.detach().clone(), trainer.target.flat_params.clone(), replay.states.clone(),
           replay.rewards.clone(), replay.dones.clone(), replay.cursor.clone()]
    if replay.prioritized:
        out += [replay.leaves.clone(), replay.sums.clone()]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prioritized,n_step", [(False, 1), (True, 3)])
def test_an_iteration_is_the_calls_made_by_hand(device, prioritized, n_step):
    # The loop against a twin driven by hand with the same objects' calls in the documented order.
    t, env, rb, loop = make(device, prioritized=prioritized, n_step=n_step, epsilon_decay_iterations=5,
                            epsilon_start=0.9, epsilon_end=0.1)
    t2, env2, rb2, _ = make(device, prioritized=prioritized, n_step=n_step)
    obs = env2.reset().clone()
    loop.prefill(4)
    ones = torch.ones(1, device=device)
    for _ in range(4):
        a, _ = t2.act_explore(obs, ones)
        s = env2.step(a)
        rb2.add_steps(obs, a, s.reward, s.next_obs, s.terminated, s.truncated)
        obs.copy_(s.obs)
    loop.run(13)  # one chunk of 10 and 3 eager iterations
    idx = torch.zeros(16, dtype=torch.long, device=device)
    out = dict(t2.inputs, indices=idx)
    for i in range(13):
        # epsilon_start + (end - start) / span * min(i, span): the product rounded to float32, then a float32 sum
        eps = np.float32(np.float64(min(i, 5)) * ((0.1 - 0.9) / 5)) + np.float32(0.9)
        a, _ = t2.act_explore(obs, torch.tensor([eps], device=device))
        s = env2.step(a)
        rb2.add_steps(obs, a, s.reward, s.next_obs, s.terminated, s.truncated)
        obs.copy_(s.obs)
        rb2.sample(16, out=out)
        t2.step()
        if prioritized:
            rb2.update_priorities(idx, t2.td_error)
    for x, y in zip(state_of(t, rb), state_of(t2, rb2)):
        assert torch.equal(x, y)
    assert torch.equal(loop.obs, obs)
    assert t.steps == 13 and loop.iterations == 13
    assert loop.epsilon.item() == pytest.approx(0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_train_every_and_the_readback(device):
    t, env, rb, loop = make(device, K=12, train_every=3)
    loop.prefill(3)
    loop.run(12 * 2 + 5)  # two chunks (4 trainings each), then 5 eager iterations (1 training)
    assert t.steps == 9
    m = t.readback()
    assert m["steps"] == 9 and all(v == v for v in m.values())


@pytest.mark.parametrize("device", DEVICES)
def test_beta_anneals_on_the_device(device):
    t, env, rb, loop = make(device, prioritized=True, beta_end=1.0, beta_anneal_iterations=10)
    loop.prefill(3)
    loop.run(4)
    assert rb.beta.item() == pytest.approx(0.4 + 0.6 * 3 / 10)  # the value the 4th iteration used
    loop.run(20)
    assert rb.beta.item() == pytest.approx(1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_same_seeds_same_run(device):
    runs = []
    for _ in range(2):
        t, env, rb, loop = make(device, prioritized=True, n_step=2)
        loop.prefill(3)
        loop.run(25)
        runs.append(state_of(t, rb))
    for x, y in zip(*runs):
        assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_plain_pytorch_learner_runs_the_same_loop(device):
    t, env, rb, loop = make(device, trainer_cls=TorchTrainer, prioritized=True)
    before = [p.detach().clone() for p in t.online.parameters()]
    loop.prefill(3)
    loop.run(12)
    assert t.steps == 12
    assert any(not torch.equal(a, b) for a, b in zip(before, t.online.parameters()))
    assert all(v == v for v in t.readback().values())


@pytest.mark.parametrize("device", DEVICES)
def test_train_every_follows_the_loops_count_however_run_is_called(device):
    runs = []
    for calls in ([1] * 6 + [14], [20]):
        t, env, rb, loop = make(device, K=4, train_every=2)
        loop.prefill(3)
        for n in calls:
            loop.run(n)
        assert loop.iterations == 20 and t.steps == 10
        runs.append(state_of(t, rb))
    for x, y in zip(*runs):
        assert torch.equal(x, y)


def test_eager_loop_needs_no_ring_for_a_whole_chunk():
    # Eagerly every training step has its own bookkeeping: K may exceed the readback ring.
    cfg = TrainerConfig(batch_size=16, readback_interval=3, use_cuda_graph=False)
    t = Trainer(NET, cfg, device="cpu")
    env = FuturesTradingEnv(8, device="cpu", seed=1)
    rb = ReplayBuffer(500, STATE_DIM, len(BRANCHES), seed=2, num_envs=8)
    loop = TrainingLoop(t, env, rb, LoopConfig(iterations_per_graph=10))
    loop.prefill(3)
    loop.run(25)
    assert t.readback()["steps"] == 25


def test_bad_configurations_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of train_every"):
        LoopConfig(iterations_per_graph=10, train_every=3)
    with pytest.raises(ValueError, match="epsilon_start"):
        LoopConfig(epsilon_start=1.5)
    with pytest.raises(ValueError, match="iterations_per_graph"):
        LoopConfig(iterations_per_graph=0)
    t, env, rb, _ = make("cpu")
    with pytest.raises(ValueError, match="num_envs"):
        TrainingLoop(t, FuturesTradingEnv(4, device="cpu"), rb)
    other = ReplayBuffer(50, STATE_DIM, len(BRANCHES), num_envs=8)
    with pytest.raises(ValueError, match="observations"):
        small = Trainer(DQNConfig(state_dim=8, trunk_hidden=(8, 8), value_hidden=4, adv_hidden=4, atoms=3,
                                  branches=BRANCHES), TrainerConfig(batch_size=4), device="cpu")
        TrainingLoop(small, env, other)
    with pytest.raises(ValueError, match="iterations"):
        TrainingLoop(t, env, rb).run(-1)
    with pytest.raises(ValueError, match="beta_anneal_iterations"):
        TrainingLoop(t, env, rb, LoopConfig(beta_anneal_iterations=10))
    t3, env3, rb3, _ = make("cpu", n_step=3)
    t1 = Trainer(NET, TrainerConfig(batch_size=16, gamma=0.9), device="cpu")
    with pytest.raises(ValueError, match=r"gamma \*\* 3"):
        TrainingLoop(t1, env3, rb3)
    with pytest.raises(ValueError, match="the replay stores states of 96 and actions of 2 branch"):
        TrainingLoop(t, env, ReplayBuffer(50, STATE_DIM, 2, num_envs=8))
    with pytest.raises(AttributeError):  # frozen: an edit cannot skip the checks
        LoopConfig().train_every = 0


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_run_needs_a_batch_in_the_replay_and_changes_nothing_without_one(prioritized):
    """Sampling a replay that holds less than a batch would train on unfilled rows (uniform) or
    fail after the optimizer stepped (prioritized): run() refuses before anything happens."""
    t, env, rb, loop = make("cpu", envs=4, batch=16, prioritized=prioritized, n_step=3)
    loop.prefill(4)  # 4 steps of 4 envs, 3-step windows: at most 8 rows so far
    before = t.online.flat_params.detach().clone()
    with pytest.raises(ValueError, match=r"TrainingLoop.run: the replay holds \d+ rows, fewer than a batch \(16\)"):
        loop.run(1)
    assert torch.equal(t.online.flat_params, before) and t.steps == 0 and loop.iterations == 0
    loop.prefill(6)
    loop.run(2)  # now it holds one
    assert t.steps == 2


@requires_cuda
def test_cuda_env_or_replay_on_another_device_is_rejected():
    t, env, rb, _ = make("cuda")
    with pytest.raises(ValueError, match="one device"):
        TrainingLoop(t, FuturesTradingEnv(8, device="cpu"), rb)


@requires_cuda
def test_cuda_readback_ring_must_hold_a_replay():
    t, env, rb, _ = make("cuda", K=10)
    with pytest.raises(ValueError, match="readback_interval"):
        TrainingLoop(t, env, rb, LoopConfig(iterations_per_graph=20))


@requires_cuda
@pytest.mark.parametrize("prioritized,n_step", [(False, 1), (True, 3)])
def test_cuda_graphed_loop_equals_the_eager_loop_bit_for_bit(prioritized, n_step):
    # The check: same seeds, 300 iterations, the same parameters (and replay) bit for bit.
    runs = []
    for graph in (False, True):
        t, env, rb, loop = make("cuda", envs=32, batch=64, K=100, graph=graph, prioritized=prioritized,
                                n_step=n_step)
        loop.prefill(4)
        loop.run(300)  # graphed: one eager warm-up chunk, the capture (replayed once), one more replay
        torch.cuda.synchronize()
        assert loop.graphed == graph
        runs.append(state_of(t, rb) + [t.optimizer.state[t.online.flat_params]["exp_avg"].clone()])
    for x, y in zip(*runs):
        assert torch.equal(x, y)


@requires_cuda
def test_cuda_graphed_runs_of_any_length_equal_one_eager_run():
    # Eager lead iterations up to the train_every pattern, whole replays, an eager rest: the
    # same iterations as one eager run; a checkpoint loaded in between is captured anew.
    runs = []
    for graph, calls in ((False, [400]), (True, [7, 250, 143])):  # after the load: 2 chunks (re-warm, capture)
        t, env, rb, loop = make("cuda", envs=32, batch=64, K=50, graph=graph, train_every=2, prioritized=True)
        loop.prefill(4)
        for n in calls:
            loop.run(n)
            if graph and n == 250:  # after a capture: a load replaces the optimizer's state tensors
                assert loop.graphed
                t.load_state_dict(copy.deepcopy(t.state_dict()))
        torch.cuda.synchronize()
        assert t.steps == 200 and loop.graphed == graph
        runs.append(state_of(t, rb) + [t.optimizer.state[t.online.flat_params]["exp_avg"].clone()])
    for x, y in zip(*runs):
        assert torch.equal(x, y)


@requires_cuda
def test_cuda_replays_do_not_sync_and_keep_learning():
    t, env, rb, loop = make("cuda", envs=32, batch=64, K=50, prioritized=True, n_step=3, graph=True)
    loop.prefill(4)
    loop.run(100)  # warm-up chunk, then the capture
    assert loop.graphed
    before = t.online.flat_params.detach().clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loop.run(200)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not torch.equal(before, t.online.flat_params)
    m = t.readback()
    assert m["steps"] == 300 and all(v == v for v in m.values())
    assert rb.skipped_priority_updates.item() == 0


@requires_cuda
def test_cuda_plain_pytorch_learner_graphs_with_the_loop():
    t, env, rb, loop = make("cuda", envs=32, batch=64, K=50, graph=True, trainer_cls=TorchTrainer)
    loop.prefill(4)
    loop.run(150)
    assert loop.graphed and t.steps == 150
    assert all(v == v for v in t.readback().values())
    # its exploration (ops.epsilon_greedy on explore_rng) drew anew in every iteration, replays included
    assert t.explore_rng[1].item() >= 150


def test_bench_loop_script_runs_on_the_cpu(tmp_path, monkeypatch):
    import json
    import os
    import sys
    scripts = os.path.join(os.path.dirname(__file__), "..", "scripts")
    monkeypatch.syspath_prepend(scripts)
    import bench_loop
    monkeypatch.setattr(sys, "argv", ["bench_loop.py", "--device", "cpu", "--tiny", "--cases", "8x16", "--iterations",
                                      "6", "--epochs", "1", "--capacity", "500", "--prioritized", "--n-step", "2",
                                      "--out", str(tmp_path)])
    bench_loop.main()
    rows = json.loads((tmp_path / "loop-prioritized-n2.json").read_text())["rows"]
    assert [r["loop"] for r in rows] == list(bench_loop.LOOPS)
    assert all(r["epoch_ms"] > 0 and r["env_steps_per_s"] > 0 for r in rows)
