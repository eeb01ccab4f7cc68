"""The training loop end to end (dqn_ops.rl.loop): epoch wall time and environment steps/s.

    python scripts/bench_loop.py --out bench/results           # the issue's configurations (CUDA)
    python scripts/bench_loop.py --cases 32x256 --epochs 3 --out /tmp/x

An epoch is `--iterations` (300) iterations of act -> env.step -> replay.add_steps -> sample ->
training step (one per iteration; -> priority update with --prioritized) on FuturesTradingEnv.
Loops, in one run, on the same environment and replay code:
  graphed          dqn_ops.rl.loop.TrainingLoop, K = 300 iterations per CUDA graph (the default)
  eager            the same TrainingLoop with use_cuda_graph=False: every launch from the host
  host + graphed step   a Python loop around the trainer's own graphed step (Trainer.step):
                   the structure scripts/train.py had before the loop moved onto the device
  pytorch          TrainingLoop driving dqn_ops.rl.baseline.TorchTrainer (plain PyTorch F32 step
                   and acting, graphed with the loop): the same loop with the learner in plain PyTorch
Each row: the median epoch wall time over --epochs epochs (after the warm-up epochs: one, and
for the graphed loops the capture's too; the host waits for the GPU at the end of each), env steps/s = envs x iterations / epoch time, and
for the graphed loop the time split: the same K iterations of each part alone in a graph of its
own (act, env, replay = add_steps + sample [+ update_priorities], step), timed with CUDA events.
Writes <out>/loop.json and loop.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dqn_ops import DQNConfig, Trainer, TrainerConfig  # noqa: E402
from dqn_ops.rl.baseline import TorchTrainer  # noqa: E402
from dqn_ops.rl.envs import BRANCHES, STATE_DIM, FuturesTradingEnv  # noqa: E402
from dqn_ops.rl.loop import LoopConfig, TrainingLoop  # noqa: E402
from dqn_ops.rl.replay import ReplayBuffer  # noqa: E402

from bench_common import graphed, run_meta, time_us, write_results  # noqa: E402

LOOPS = ("graphed", "eager", "host + graphed step", "pytorch")
# (envs, batch): the three env counts at B = 256, and 4096 envs with a B = 4096 step
DEFAULT_CASES = ((32, 256), (256, 256), (4096, 256), (4096, 4096))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=[f"{e}x{b}" for e, b in DEFAULT_CASES],
                    help="envs x batch, e.g. 32x256")
    ap.add_argument("--loops", nargs="+", default=list(LOOPS), choices=LOOPS)
    ap.add_argument("--iterations", type=int, default=300, help="iterations per epoch (and per graph)")
    ap.add_argument("--epochs", type=int, default=5, help="timed epochs per loop (median)")
    ap.add_argument("--prioritized", action="store_true", help="prioritized replay")
    ap.add_argument("--n-step", type=int, default=1)
    ap.add_argument("--capacity", type=int, default=1_000_000)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small network and replay (a CPU smoke run)")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def make(args, loop_kind, envs, batch, seed=0):
    dev = torch.device(args.device)
    steps_per_graph = args.iterations
    cfg = TrainerConfig(batch_size=batch, gamma=0.9 ** args.n_step, readback_interval=steps_per_graph,
                        on_non_finite="flag")
    net = DQNConfig(state_dim=STATE_DIM, branches=BRANCHES)
    if args.tiny:
        net = DQNConfig(state_dim=STATE_DIM, trunk_hidden=(32, 32), value_hidden=(16,), adv_hidden=(16,), atoms=11,
                        branches=BRANCHES)
    # the plain-PyTorch learner draws in plain PyTorch too (torch.rand, not dqn_ops's epsilon_greedy)
    trainer = (TorchTrainer(net, cfg, device=dev, seed=seed, exploration="torch", fractions="torch")
               if loop_kind == "pytorch"
               else Trainer(net, cfg, device=dev, seed=seed))
    env = FuturesTradingEnv(envs, device=dev, seed=seed + 1)
    replay = ReplayBuffer(args.capacity, STATE_DIM, len(BRANCHES), device=dev, seed=seed + 2, num_envs=envs,
                          prioritized=args.prioritized, n_step=args.n_step, gamma=0.9)
    loop = TrainingLoop(trainer, env, replay, LoopConfig(iterations_per_graph=args.iterations,
                                                         use_cuda_graph=loop_kind != "eager"))
    loop.prefill(max(2, -(-2 * batch // envs)))  # at least two batches' worth of transitions
    return trainer, env, replay, loop


def host_loop_epoch(trainer, env, replay, loop, iterations):
    """The Python loop around Trainer.step (its own graphed step), as scripts/train.py had it."""
    B = trainer.config.batch_size
    out = dict(trainer.inputs, indices=loop.indices)
    for _ in range(iterations):
        loop._schedules()
        actions, _ = trainer.act_explore(loop.obs, loop.epsilon)
        step = env.step(actions)
        replay.add_steps(loop.obs, actions, step.reward, step.next_obs, step.terminated, step.truncated)
        loop.obs.copy_(step.obs)
        replay.sample(B, out=out)
        trainer.step()
        if replay.prioritized:
            replay.update_priorities(loop.indices, trainer.td_error)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def epoch_times(args, loop_kind, envs, batch):
    trainer, env, replay, loop = make(args, loop_kind, envs, batch)
    run = ((lambda: host_loop_epoch(trainer, env, replay, loop, args.iterations)) if loop_kind == "host + graphed step"
           else (lambda: loop.run(args.iterations)))
    # untimed: the warm-up epochs (the graphed loop runs its first epoch eagerly and captures in
    # the second; the others' first epoch warms cuBLAS and the trainer's own graph)
    for _ in range(1 + (loop.config.warmup_chunks if loop_kind in ("graphed", "pytorch") else 0)):
        run()
    if loop_kind in ("graphed", "pytorch") and torch.device(args.device).type == "cuda":
        assert loop.graphed, "the loop should be captured after its warm-up"
    times = []
    for _ in range(args.epochs):
        _sync(args.device)
        t0 = time.perf_counter()
        run()
        _sync(args.device)
        times.append(time.perf_counter() - t0)
    trainer.readback()
    times.sort()
    return times[len(times) // 2], (trainer, env, replay, loop)


def time_split(args, trainer, env, replay, loop):
    """µs per iteration of each part alone, K iterations in a graph of their own."""
    K, B = args.iterations, trainer.config.batch_size
    out = dict(trainer.inputs, indices=loop.indices)
    actions, _ = trainer.act_explore(loop.obs, loop.epsilon)
    actions = actions.clone()
    step = env.step(actions)

    def act():
        for _ in range(K):
            trainer.act_explore(loop.obs, loop.epsilon)

    def env_step():
        for _ in range(K):
            env.step(actions)

    def replay_part():
        for _ in range(K):
            replay.add_steps(loop.obs, actions, step.reward, step.next_obs, step.terminated, step.truncated)
            replay.sample(B, out=out)
            if replay.prioritized:
                replay.update_priorities(loop.indices, trainer.td_error)

    def train_step():
        for _ in range(K):
            trainer.device_step()

    parts = dict(act=act, env=env_step, replay=replay_part, step=train_step)
    return {name: time_us(graphed(fn), 1, 5, warmup=1) / K for name, fn in parts.items()}


def main():
    args = parse_args()
    meta = run_meta(args.device, iterations=args.iterations, epochs=args.epochs, prioritized=args.prioritized,
                    n_step=args.n_step, capacity=args.capacity)
    rows = []
    for case in args.cases:
        envs, batch = (int(x) for x in case.split("x"))
        for kind in args.loops:
            sec, objs = epoch_times(args, kind, envs, batch)
            row = dict(envs=envs, batch=batch, loop=kind, epoch_ms=1e3 * sec,
                       env_steps_per_s=envs * args.iterations / sec)
            if kind == "graphed" and torch.device(args.device).type == "cuda":
                split = time_split(args, *objs)
                row.update({f"{k}_us": v for k, v in split.items()})
                row["step_share"] = split["step"] * args.iterations / (1e6 * sec)
            rows.append(row)
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            del objs
            if torch.device(args.device).type == "cuda":
                torch.cuda.empty_cache()
    title = (f"# Training loop, {args.iterations} iterations per epoch ({meta['device']}, torch {meta['torch']}, "
             f"{meta['date']}; {'prioritized' if args.prioritized else 'uniform'} replay, n = {args.n_step})")
    md = [title, "", "| envs | B | loop | epoch (ms) | env steps/s | act / env / replay / step (µs per iteration, "
          "each alone) | step share |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        split = (" / ".join(f"{r[k + '_us']:.1f}" for k in ("act", "env", "replay", "step")) if "act_us" in r else "")
        share = f"{100 * r['step_share']:.0f}%" if "step_share" in r else ""
        md.append(f"| {r['envs']} | {r['batch']} | {r['loop']} | {r['epoch_ms']:.1f} | {r['env_steps_per_s']:,.0f} | "
                  f"{split} | {share} |")
    print("\n".join(md))
    if args.out:
        kind = "loop" + ("-prioritized" if args.prioritized else "") + (f"-n{args.n_step}" if args.n_step > 1 else "")
        write_results(args.out, kind, meta, rows, md)


if __name__ == "__main__":
    main()
