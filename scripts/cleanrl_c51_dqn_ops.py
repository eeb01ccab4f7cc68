"""CleanRL's C51 (its c51.py QNetwork) on a branching action space, on dqn_ops: the "after" of the drop-in
example (diff it against cleanrl_c51_torch.py). The network, the loss, the optimizer and the target update become
dqn_ops calls; the rest of the script is unchanged.

    python scripts/cleanrl_c51_dqn_ops.py --total-steps 3000
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dqn_ops  # noqa: E402
from dqn_ops.rl.envs import BRANCHES, STATE_DIM, FuturesTradingEnv, evaluate  # noqa: E402
from dqn_ops.rl.replay import ReplayBuffer  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--total-steps", type=int, default=3000)
p.add_argument("--num-envs", type=int, default=32)
p.add_argument("--batch-size", type=int, default=256)
p.add_argument("--lr", type=float, default=1e-4)
p.add_argument("--gamma", type=float, default=0.9)
p.add_argument("--tau", type=float, default=0.005)
p.add_argument("--atoms", type=int, default=51)
p.add_argument("--v-min", type=float, default=-10.0)
p.add_argument("--v-max", type=float, default=10.0)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = p.parse_args()
device = torch.device(args.device)
torch.manual_seed(args.seed)


def greedy(net, obs):
    q = (net(obs).softmax(-1) * torch.linspace(args.v_min, args.v_max, args.atoms, device=device)).sum(-1)
    return torch.stack([x.argmax(1) for x in q.split(list(BRANCHES), 1)], 1)


# CleanRL's network, Linear(obs, 120), ReLU, Linear(120, 84), ReLU, Linear(84, n * atoms): a trunk of 120 and 84, no
# head layers and no dueling; its last layer's rows are the branches' output layers (docs/networks.md).
config = dqn_ops.DQNConfig(state_dim=STATE_DIM, trunk_hidden=(120, 84), adv_hidden=(), atoms=args.atoms,
                           branches=BRANCHES, dueling=False)
q_network = dqn_ops.DuelingBranchQNet(config, backward_precision="bf16").to(device)
target_network = dqn_ops.DuelingBranchQNet(config).to(device)
target_network.load_state_dict(q_network.state_dict())
optimizer = dqn_ops.FusedAdamBF16.for_network(q_network, lr=args.lr)

envs = FuturesTradingEnv(args.num_envs, device=device, seed=args.seed)
rb = ReplayBuffer(100_000, STATE_DIM, len(BRANCHES), device=device, seed=args.seed)
obs, start = envs.reset().clone(), time.time()  # ours: the env rewrites its buffers every step
for global_step in range(args.total_steps):
    epsilon = max(0.05, 1 - global_step / (0.3 * args.total_steps))
    with torch.no_grad():
        explore = torch.rand(args.num_envs, 1, device=device) < epsilon
        actions = torch.where(explore, envs.random_actions(), greedy(q_network, obs))
    next_obs, rewards, terminated, _, reset_obs = envs.step(actions)
    rb.add(obs, actions, rewards, next_obs, terminated)
    obs.copy_(reset_obs)  # next_obs, or a new episode's first observation where an env ended
    if global_step >= 10:
        data = rb.sample(args.batch_size)
        with torch.no_grad():
            next_online, next_target = q_network(data["next_states"]), target_network(data["next_states"])
        loss = dqn_ops.dqn_loss(q_network(data["states"]), next_online, next_target, data["actions"],
                                data["rewards"], data["dones"], BRANCHES, v_min=args.v_min, v_max=args.v_max,
                                gamma=args.gamma).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        dqn_ops.ema_update_(target_network, q_network, args.tau)
    if global_step % 1000 == 0 and global_step >= 10:
        print(f"step {global_step}  loss {loss.item():.4f}  {global_step / (time.time() - start):.0f} steps/s")
print("held-out Sharpe:", evaluate(lambda o: greedy(q_network, o), 128, device=device)["sharpe"])
