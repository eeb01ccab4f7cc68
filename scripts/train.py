"""Train the dueling branching C51 agent on the synthetic futures market (dqn_ops.rl.envs).

    python scripts/train.py --epochs 20                       # dqn_ops, BF16, CUDA graph
    python scripts/train.py --backend torch --epochs 20       # the plain-PyTorch F32 step
    python scripts/train.py --device cpu --epochs 1 --steps 20 --batch 32   # a smoke run
    python scripts/train.py --ensemble 5 --bootstrap-p 0.5 --act-ucb 1.0     # bootstrapped ensemble, UCB acting
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 scripts/train.py --distributed   # data-parallel

Each epoch: `steps` iterations of the training loop (dqn_ops.rl.loop.TrainingLoop): act
(epsilon-greedy, epsilon from 1 to 0.05 over the first 30% of the run) on `num_envs` markets,
step them, store the transitions (n-step with --n-step; prioritized with --prioritized), sample
a batch and run one training step (and update the priorities). On CUDA the epoch's iterations
are one CUDA graph (the first epoch runs eagerly as the warm-up, the second captures the graph,
every later one replays it without host syncs; --no-graph:
every launch from the host); the plain-PyTorch backends run the same loop with their own step
and acting. After each epoch: a forced readback and an evaluation of the greedy policy on
held-out markets (annualised Sharpe). Writes to --out: metrics.csv (one row per epoch),
checkpoint.pt, learning_curve.png and summary.json (with the random and flat policies' Sharpe
on the same held-out markets). summary.json is strict JSON: a non-finite figure is `null` (and
an empty cell in metrics.csv). Timing: each epoch's wall time and environment steps/s.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dqn_ops import DQNConfig, Trainer, TrainerConfig  # noqa: E402
from dqn_ops.rl.baseline import TorchTrainer  # noqa: E402
from dqn_ops.rl.envs import BRANCHES, STATE_DIM, FuturesTradingEnv, evaluate, flat_policy, random_policy  # noqa: E402
from dqn_ops.rl.loop import LoopConfig, TrainingLoop  # noqa: E402
from dqn_ops.rl.replay import ReplayBuffer  # noqa: E402
from dqn_ops.rl.results import dump_json, dumps_json, strict_json  # noqa: E402

from bench_common import headless_pyplot  # noqa: E402

BACKENDS = ("dqn_ops", "torch", "torch-bf16")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=BACKENDS, default="dqn_ops",
                    help="dqn_ops (BF16 ops) | torch (plain PyTorch F32) | torch-bf16 (autocast)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=300, help="loop iterations per epoch (one environment step and one training step each)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--num-envs", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda where torch has a CUDA device)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--gamma", type=float, default=0.9, help="discount per environment step")
    ap.add_argument("--n-step", type=int, default=1, help="n-step returns (the loss discounts by gamma ** n)")
    ap.add_argument("--prioritized", action="store_true", help="proportional prioritized replay (alpha 0.6, "
                    "beta 0.4 -> 1 over the run)")
    ap.add_argument("--replay-capacity", type=int, default=200_000)
    ap.add_argument("--eval-envs", type=int, default=128)
    ap.add_argument("--no-graph", action="store_true", help="run the loop eagerly (every launch from the host)")
    ap.add_argument("--out", default=None, help="output folder (default runs/<backend>-seed<seed>)")
    ap.add_argument("--quiet", action="store_true", help="no per-epoch lines")
    ap.add_argument("--tiny", action="store_true", help="a small network (for smoke tests)")
    ap.add_argument("--loss-type", choices=("c51", "qr", "iqn"), default="c51",
                    help="c51 (categorical, support [-10, 10]), qr (QR-DQN: the atoms are quantiles) or iqn "
                         "(implicit quantile network: one atom, the fractions sampled; --iqn-embedding, "
                         "--iqn-fractions)")
    ap.add_argument("--atoms", type=int, default=None,
                    help="atoms (C51) or quantiles (QR) per action (default: 51; --tiny: 11)")
    ap.add_argument("--iqn-embedding", type=int, default=64, help="IQN: cosines of each fraction (the paper's 64)")
    ap.add_argument("--iqn-fractions", type=int, default=32, help="IQN: fractions per sample, N = N' = K")
    ap.add_argument("--ensemble", type=int, default=1,
                    help="ensemble members on the shared trunk, each its own heads (DQNConfig.ensemble)")
    ap.add_argument("--bootstrap-p", type=float, default=1.0,
                    help="probability that a member learns from a transition (bootstrap masks drawn per replay "
                         "row; 1: every member from every transition)")
    ap.add_argument("--mirror", choices=("bf16", "f32"), default="bf16",
                    help="dqn_ops backend: the networks' mirror; f32 (--device cpu only) rounds nothing: the same "
                         "step in F32 (TrainerConfig.mirror)")
    ap.add_argument("--exploration", choices=("philox", "torch"), default="philox",
                    help="torch backends: act_explore's random numbers; philox (dqn_ops's draws for the seed, so both "
                         "backends of one seed explore alike) | torch (torch.rand)")
    ap.add_argument("--act-ucb", type=float, default=0.0,
                    help="acting scores each action by mean + C * std over the ensemble's members")
    ap.add_argument("--distributed", action="store_true",
                    help="data-parallel over the processes torchrun starts (NCCL on GPUs, gloo on the CPU); "
                         "--batch is per rank; rank 0 evaluates and writes the outputs")
    args = ap.parse_args(argv)
    # the flags' own errors, before any setup (the trainer's and the replay's name their fields, not the flags)
    for flag in ("epochs", "steps", "batch", "num_envs", "n_step", "replay_capacity", "eval_envs", "ensemble",
                 "iqn_embedding", "iqn_fractions"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.atoms is not None and args.atoms < 1:
        ap.error(f"--atoms must be >= 1, got {args.atoms}")
    if not 0.0 < args.gamma <= 1.0:
        ap.error(f"--gamma must lie in (0, 1], got {args.gamma}")
    if args.act_ucb != 0.0 and args.ensemble == 1:
        ap.error("--act-ucb scores actions over an ensemble's members: it needs --ensemble > 1")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.device == "cpu" and not args.quiet:
            # The CPU kernels are references: the full-size run takes about a minute an epoch there.
            print("train.py: no CUDA device here, training on the CPU (slow at full size; a smoke run: "
                  "--tiny --steps 20 --batch 32)", file=sys.stderr)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch has no CUDA device (pass --device cpu)")
    return args


def network_config(tiny: bool = False, atoms=None) -> DQNConfig:
    """The task's network: the reference one, or with `tiny` a small one; `atoms` atoms (C51) or
    quantiles (QR) per action (None: the network's default)."""
    net = DQNConfig(state_dim=STATE_DIM, branches=BRANCHES)
    if tiny:
        net = DQNConfig(state_dim=STATE_DIM, trunk_hidden=(32, 32), value_hidden=(16,), adv_hidden=(16,), atoms=11,
                        branches=BRANCHES)
    return net if atoms is None else dataclasses.replace(net, atoms=atoms)


def make_trainer(args):
    net = dataclasses.replace(network_config(args.tiny, args.atoms), ensemble=args.ensemble)
    if args.loss_type == "iqn":  # one value per action at each fraction
        net = dataclasses.replace(net, atoms=1, iqn_embedding=args.iqn_embedding)
    # gamma ** n: the loss discounts an n-step return's bootstrap; the readback ring holds an epoch
    # (one graph replay of the loop)
    cfg = TrainerConfig(batch_size=args.batch, lr=args.lr, gamma=args.gamma ** args.n_step, v_min=-10.0, v_max=10.0,
                        tau=0.005, max_grad_norm=10.0, sigma_max=1.0, use_cuda_graph=not args.no_graph,
                        readback_interval=args.steps, on_non_finite="flag", loss_type=args.loss_type,
                        bootstrap_p=args.bootstrap_p, act_ucb=args.act_ucb, iqn_fractions=args.iqn_fractions,
                        mirror=args.mirror)
    if args.backend == "dqn_ops":
        if args.exploration != "philox":
            raise SystemExit("--exploration torch takes the torch backends only (dqn_ops draws from its Philox stream)")
        return Trainer(net, cfg, device=args.device, seed=args.seed)
    if args.distributed or args.mirror != "bf16":
        raise SystemExit("--distributed and --mirror take the dqn_ops backend only")
    return TorchTrainer(net, cfg, device=args.device, seed=args.seed, amp=args.backend == "torch-bf16",
                        exploration=args.exploration)


def train(args) -> dict:
    """Runs the training; returns the summary (also written to <out>/summary.json)."""
    out = args.out or os.path.join("runs", f"{args.backend}-seed{args.seed}")
    rank = 0
    if args.distributed:
        import torch.distributed as dist

        cuda = args.device.startswith("cuda")
        dist.init_process_group("nccl" if cuda else "gloo")
        rank = dist.get_rank()
        if cuda:
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(args.device)
        args.quiet = args.quiet or rank != 0
    os.makedirs(out, exist_ok=True)
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    env_seed = args.seed + 1000 * rank  # each rank plays its own markets; the model is shared
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    trainer = make_trainer(args)
    env = FuturesTradingEnv(args.num_envs, device=dev, seed=env_seed)
    replay = ReplayBuffer(args.replay_capacity, STATE_DIM, len(BRANCHES), device=dev, seed=env_seed,
                          num_envs=args.num_envs, prioritized=args.prioritized, n_step=args.n_step, gamma=args.gamma)
    total = args.epochs * args.steps
    loop = TrainingLoop(trainer, env, replay, LoopConfig(
        iterations_per_graph=args.steps, use_cuda_graph=not args.no_graph, epsilon_start=1.0, epsilon_end=0.05,
        epsilon_decay_iterations=max(1, int(0.3 * total)),
        beta_anneal_iterations=total if args.prioritized else 0))
    # random play before training: a few batches' worth (n-step windows fill after n steps)
    loop.prefill(max(1, 4 * args.batch // args.num_envs) + args.n_step - 1)

    baselines = dict(random=evaluate(random_policy(), args.eval_envs, device=dev)["sharpe"],
                     flat=evaluate(flat_policy, args.eval_envs, device=dev)["sharpe"])
    rows, step = [], 0
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        # One epoch: `steps` iterations of act -> env.step -> replay -> training step: on CUDA one
        # graph replay (from the second epoch on; the first is the eager warm-up).
        loop.run(args.steps)
        step += args.steps
        trainer.readback()  # epoch end: forced readback (syncs)
        epoch_s = time.perf_counter() - t0
        eps = float(loop.epsilon)  # the exploration rate of the epoch's last iteration
        if rank != 0:
            continue  # rank 0 evaluates and reports
        ev = evaluate(trainer.act, args.eval_envs, device=dev)
        last = trainer.metrics(last=args.steps)
        row = dict(epoch=epoch + 1, steps=step, loss=last.get("loss"), mean_q=last.get("mean_q"),
                   grad_norm_mean=last.get("grad_norm_mean"), grad_norm_max=last.get("grad_norm_max"),
                   skipped=last.get("skipped"), eval_sharpe=ev["sharpe"], eval_pnl_pct=ev["mean_pnl_pct"],
                   eval_turnover=ev["turnover"], epsilon=eps, epoch_seconds=epoch_s,
                   env_steps_per_second=args.num_envs * args.steps / epoch_s,
                   # the allocator's peak so far (evaluation included): flat after epoch 1 unless memory leaks
                   peak_vram_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None)
        rows.append(row)
        if not args.quiet:
            print(f"epoch {epoch + 1:3d}  loss {row['loss']:.4f}  mean Q {row['mean_q']:+.3f}  "
                  f"grad {row['grad_norm_mean']:.3f}/{row['grad_norm_max']:.3f}  eval Sharpe {ev['sharpe']:+.2f}  "
                  f"({epoch_s:.2f} s, {row['env_steps_per_second']:,.0f} env steps/s)", flush=True)
    if args.distributed:
        torch.distributed.destroy_process_group()
        if rank != 0:
            return {}
    with open(os.path.join(out, "metrics.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(strict_json(rows))  # a non-finite figure: an empty cell, as a missing one
    torch.save(trainer.state_dict(), os.path.join(out, "checkpoint.pt"))
    whole_run = trainer.metrics()
    finite = all(all(v == v and abs(v) != float("inf") for v in r.values()) for r in trainer.stats.rows)
    summary = dict(backend=args.backend, loss_type=args.loss_type, atoms=trainer.net_config.atoms,
                   ensemble=trainer.net_config.members, bootstrap_p=args.bootstrap_p, act_ucb=args.act_ucb,
                   seed=args.seed, mirror=args.mirror if args.backend == "dqn_ops" else None,
                   exploration="philox" if args.backend == "dqn_ops" else args.exploration,
                   epochs=args.epochs, steps_per_epoch=args.steps,
                   world_size=trainer.world_size if isinstance(trainer, Trainer) else 1,
                   batch=args.batch, device=str(dev), torch=torch.__version__,
                   gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
                   final_sharpe=rows[-1]["eval_sharpe"],
                   final_sharpe_mean_last5=sum(r["eval_sharpe"] for r in rows[-5:]) / len(rows[-5:]),
                   mean_q=sum(r["mean_q"] for r in rows[-5:]) / len(rows[-5:]),
                   grad_norm_mean=whole_run["grad_norm_mean"], grad_norm_max=whole_run["grad_norm_max"],
                   non_finite=not finite, skipped=whole_run["skipped"],
                   peak_vram_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
                   peak_vram_first_epoch_bytes=rows[0]["peak_vram_bytes"],
                   epoch_seconds_median=sorted(r["epoch_seconds"] for r in rows)[len(rows) // 2],
                   env_steps_per_second_median=sorted(r["env_steps_per_second"] for r in rows)[len(rows) // 2],
                   loop="graphed" if loop.graphed else "eager", prioritized=args.prioritized, n_step=args.n_step,
                   baseline_sharpe=baselines)
    with open(os.path.join(out, "summary.json"), "w") as f:
        dump_json(summary, f)  # strict JSON: a non-finite figure is null
    _plot(rows, baselines, os.path.join(out, "learning_curve.png"), args.backend, args.loss_type)
    return summary


def _plot(rows, baselines, path, title, loss_type):
    plt = headless_pyplot("no learning-curve PNG")
    if plt is None:
        return
    ep = [r["epoch"] for r in rows]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(10, 4))
    a0.plot(ep, [r["loss"] for r in rows], label="loss")
    a0.set_xlabel("epoch")
    a0.set_ylabel({"c51": "C51 loss", "qr": "quantile Huber loss", "iqn": "IQN quantile Huber loss"}[loss_type])
    a0.set_title(f"training loss ({title})")
    a1.plot(ep, [r["eval_sharpe"] for r in rows], marker="o", label="trained policy")
    a1.axhline(baselines["random"], color="r", ls="--", label="random policy")
    a1.axhline(baselines["flat"], color="k", ls=":", label="flat policy")
    a1.set_xlabel("epoch")
    a1.set_ylabel("annualised Sharpe (held-out markets)")
    a1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    s = train(parse_args())
    if s:
        print(dumps_json(s))
