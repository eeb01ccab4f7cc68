"""Two trainers in lockstep: the same start, the same batches, step after step.

Where two training runs of the same task part ways (scripts/parity.py), this tells whether
their steps differ or only their data: dqn_ops's `Trainer` (BF16, or with `--ours-mirror f32` on
the CPU nothing rounded) and the plain-PyTorch `TorchTrainer` (F32) start from the same weights
(the same seed) and take the same replay batches of the futures task (random play, so both see
the same data whatever they learn), and each step's loss, gradient norm and mean Q are printed
side by side with the largest parameter difference. Equal formulas give equal figures to the
rounding of the arithmetic (F32: ~7 digits; a BF16 side: ~3), and parameters apart by at most
~2 x lr a step (Adam moves a parameter with a near-zero gradient by ~lr * sign(g), and the sign
of such a gradient is rounding noise).

    python3 scripts/lockstep.py --device cpu --ours-mirror f32 --loss-type qr --atoms 200 --steps 30
    python3 scripts/lockstep.py --device cuda --loss-type qr --atoms 200 --steps 300   # both graphed

`--reward-scale` multiplies the batches' rewards (large TD errors: the Huber's linear part),
`--max-grad-norm` sets the clip (small: the clip binds every step). `--out FILE` writes the
per-step rows as JSON.
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from dqn_ops import Trainer, TrainerConfig  # noqa: E402
from dqn_ops.rl.baseline import TorchTrainer  # noqa: E402
from dqn_ops.rl.envs import BRANCHES, STATE_DIM, FuturesTradingEnv  # noqa: E402
from dqn_ops.rl.replay import ReplayBuffer  # noqa: E402
from train import network_config  # noqa: E402


def fill_replay(device, num_envs: int, env_steps: int, seed: int) -> ReplayBuffer:
    """A replay buffer of `env_steps` steps of random play in `num_envs` futures markets."""
    env = FuturesTradingEnv(num_envs, device=device, seed=seed)
    replay = ReplayBuffer(num_envs * env_steps, STATE_DIM, len(BRANCHES), device=device, seed=seed,
                          num_envs=num_envs)
    obs = env.reset().clone()
    for _ in range(env_steps):
        actions = env.random_actions()
        r = env.step(actions)
        replay.add_steps(obs, actions, r.reward, r.next_obs, r.terminated, r.truncated)
        obs = r.obs.clone()
    return replay


def flat_params(trainer) -> torch.Tensor:
    """The online network's parameters by their plain-PyTorch names, in one flat tensor."""
    if isinstance(trainer, Trainer):
        views = trainer.online.layer_views()
    else:
        views = dict(trainer.online.named_parameters())
    return torch.cat([views[n].detach().flatten().float().cpu() for n in sorted(views)])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--loss-type", choices=("c51", "qr"), default="c51")
    ap.add_argument("--atoms", type=int, default=None, help="atoms (C51) or quantiles (QR); default 51")
    ap.add_argument("--tiny", action="store_true", help="train.py's small network")
    ap.add_argument("--ours-mirror", choices=("bf16", "f32"), default="bf16",
                    help="dqn_ops's mirror: f32 (CPU only) rounds nothing")
    ap.add_argument("--reward-scale", type=float, default=1.0)
    ap.add_argument("--max-grad-norm", type=float, default=10.0)
    ap.add_argument("--sigma-max", type=float, default=1.0)
    ap.add_argument("--no-graph", action="store_true", help="CUDA: both trainers eager")
    ap.add_argument("--env-steps", type=int, default=600, help="random-play steps that fill the replay (32 envs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the per-step rows here (JSON)")
    args = ap.parse_args(argv)
    if args.ours_mirror != "bf16" and args.device != "cpu":
        ap.error("--ours-mirror f32: dqn_ops's unrounded path runs on the CPU only (--device cpu)")

    net = network_config(args.tiny, args.atoms)
    # scripts/train.py's settings; readback every step (the figures of each step)
    cfg = TrainerConfig(batch_size=args.batch, lr=1e-4, gamma=0.9, v_min=-10.0, v_max=10.0, tau=0.005,
                        max_grad_norm=args.max_grad_norm, sigma_max=args.sigma_max, readback_interval=1,
                        use_cuda_graph=not args.no_graph, loss_type=args.loss_type)
    ours = Trainer(net, dataclasses.replace(cfg, mirror=args.ours_mirror), device=args.device, seed=args.seed)
    ref = TorchTrainer(net, cfg, device=args.device, seed=args.seed)
    replay = fill_replay(args.device, 32, args.env_steps, 1000 + args.seed)

    rows = []
    print(f"# dqn_ops (mirror {args.ours_mirror}) vs plain PyTorch F32, {args.device}, torch {torch.__version__}, "
          f"{args.loss_type} {net.atoms} atoms, B = {args.batch}")
    print(f"{'step':>5} {'loss ours':>12} {'loss torch':>12} {'gnorm ours':>11} {'gnorm torch':>11} "
          f"{'meanQ ours':>11} {'meanQ torch':>11} {'max|dp|':>9}")
    for i in range(args.steps):
        batch = {k: v.clone() for k, v in replay.sample(args.batch).items()}
        batch["rewards"] *= args.reward_scale
        ours.step(batch)
        ref.step(batch)
        m, r = ours.readback(), ref.readback()
        row = dict(step=i + 1, dones=float(batch["dones"].sum()),
                   loss=(m["loss_last"], r["loss_last"]),
                   grad_norm=(ours.stats.rows[-1]["grad_norm"], ref.stats.rows[-1]["grad_norm"]),
                   mean_q=(ours.stats.rows[-1]["mean_q"], ref.stats.rows[-1]["mean_q"]),
                   max_param_diff=float((flat_params(ours) - flat_params(ref)).abs().max()))
        rows.append(row)
        print(f"{row['step']:5d} {row['loss'][0]:12.6f} {row['loss'][1]:12.6f} {row['grad_norm'][0]:11.5f} "
              f"{row['grad_norm'][1]:11.5f} {row['mean_q'][0]:11.6f} {row['mean_q'][1]:11.6f} "
              f"{row['max_param_diff']:9.2e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), torch=torch.__version__, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
