"""CleanRL's C51 (its c51.py QNetwork: Linear(obs, 120), ReLU, Linear(120, 84), ReLU, Linear(84, n * atoms)) on a
branching action space, in plain PyTorch: the "before" of the drop-in example (diff it against
cleanrl_c51_dqn_ops.py). Task: dqn_ops.rl.envs' futures market.

    python scripts/cleanrl_c51_torch.py --total-steps 3000
"""
import argparse
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
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


class QNetwork(nn.Module):
    """CleanRL's c51 network; its n actions are every branch's actions side by side."""

    def __init__(self, atoms):
        super().__init__()
        self.atoms, self.n = atoms, sum(BRANCHES)
        self.network = nn.Sequential(nn.Linear(STATE_DIM, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                                     nn.Linear(84, self.n * atoms))

    def forward(self, x):
        return self.network(x).view(len(x), self.n, self.atoms)  # [B, sum n, atoms]: branch d's n_d rows in turn


def c51_loss(logits, next_online, next_target, actions, rewards, dones):
    B, support = logits.shape[0], torch.linspace(args.v_min, args.v_max, args.atoms, device=device)
    dz, rows, loss, off = (args.v_max - args.v_min) / (args.atoms - 1), torch.arange(B, device=device), 0.0, 0
    tz = (rewards[:, None] + args.gamma * (1 - dones[:, None]) * support).clamp(args.v_min, args.v_max)
    b = ((tz - args.v_min) / dz).clamp(0, args.atoms - 1)
    lo, hi = b.floor().long(), b.ceil().long()
    lo = torch.where((hi > 0) & (lo == hi), lo - 1, lo)
    hi = torch.where((lo < args.atoms - 1) & (lo == hi), hi + 1, hi)
    for i, n in enumerate(BRANCHES):
        a_star = (next_online[:, off:off + n].softmax(-1) * support).sum(-1).argmax(1)
        p_next = next_target[:, off:off + n].softmax(-1)[rows, a_star]
        m = torch.zeros(B, args.atoms, device=device)
        m.scatter_add_(1, lo, p_next * (hi.float() - b))
        m.scatter_add_(1, hi, p_next * (b - lo.float()))
        loss = loss - (m * logits[:, off:off + n][rows, actions[:, i]].log_softmax(-1)).sum(-1).mean()
        off += n
    return loss / len(BRANCHES)


def greedy(net, obs):
    q = (net(obs).softmax(-1) * torch.linspace(args.v_min, args.v_max, args.atoms, device=device)).sum(-1)
    return torch.stack([x.argmax(1) for x in q.split(list(BRANCHES), 1)], 1)


q_network = QNetwork(args.atoms).to(device)
target_network = QNetwork(args.atoms).to(device)
target_network.load_state_dict(q_network.state_dict())
optimizer = torch.optim.Adam(q_network.parameters(), lr=args.lr)

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
        loss = c51_loss(q_network(data["states"]), next_online, next_target, data["actions"], data["rewards"],
                        data["dones"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for tp, qp in zip(target_network.parameters(), q_network.parameters()):
                tp.lerp_(qp, args.tau)
    if global_step % 1000 == 0 and global_step >= 10:
        print(f"step {global_step}  loss {loss.item():.4f}  {global_step / (time.time() - start):.0f} steps/s")
print("held-out Sharpe:", evaluate(lambda o: greedy(q_network, o), 128, device=device)["sharpe"])
