#!/usr/bin/env python3
"""Data-parallel scaling of the dqn_ops training step (issue 8): step time at a fixed batch
per GPU, one GPU vs N GPUs (weak scaling), with the flat-gradient all-reduce (NCCL) inside the
step's CUDA graph.

    torchrun --nproc-per-node 1 scripts/bench_distributed.py --out gpu_out   # the one-GPU reference
    torchrun --nproc-per-node 2 scripts/bench_distributed.py --out gpu_out
    python3 scripts/bench_distributed.py --merge gpu_out                     # the table

Each run writes <out>/distributed-world<N>.json (µs per step, the slowest rank's, for each
batch per GPU); --merge writes <out>/distributed.{json,md}: step time per world
size, samples per second, and the scaling efficiency t(1 GPU) / t(N GPUs) (1.0 = the all-reduce
costs nothing). Keep NVLink multicast off (NCCL_NVLS_ENABLE=0 and the others, as
scripts/gpu_check.sh sets them). On the CPU (gloo, --device cpu) it runs a tiny config: a
smoke test of the script, not a measurement; there a rank sometimes aborts in torch's teardown
("terminate called without an active exception") after the script's last line, its results
already written.
"""
from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dqn_ops import DQNConfig, Trainer, TrainerConfig  # noqa: E402
from dqn_ops.rl.results import dump_json  # noqa: E402

from bench import random_batch  # noqa: E402
from bench_common import run_meta, time_us, write_results  # noqa: E402

TINY = DQNConfig(state_dim=8, trunk_hidden=(16, 16), value_hidden=(8,), adv_hidden=(8,), atoms=5, branches=(2, 3))


def run(args):
    """One rank's part; torchrun's environment gives the rank, world size and rendezvous."""
    cuda = args.device == "cuda"
    if cuda:
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        c = DQNConfig() if cuda else TINY
        rows = []
        for B in args.batches:
            cfg = TrainerConfig(batch_size=B, readback_interval=100, on_non_finite="flag")
            t = Trainer(c, cfg, device=device, seed=0)
            batch = random_batch(c, B, device)
            batch["states"] += 0.01 * rank  # each rank its own shard
            for _ in range(cfg.warmup_steps + 5):  # eager warm-up, capture, a few replays
                t.step(batch)
            iters = args.iters or (200 if B <= 4096 else 30)
            us = torch.tensor([time_us(functools.partial(t.step, batch), iters, 3, warmup=0, device=device)], device=device)
            dist.all_reduce(us, op=dist.ReduceOp.MAX)  # the step is as slow as the slowest rank
            rows.append(dict(world=world, batch_per_gpu=B, step_us=round(float(us), 2), graphed=t.graphed,
                             samples_per_s=round(world * B / float(us) * 1e6)))
            if rank == 0:
                print(f"world {world}  B/GPU {B:6d}  {float(us):10.1f} us/step  graphed {t.graphed}", flush=True)
            del t
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            nccl = dict(nccl=list(torch.cuda.nccl.version())) if cuda else {}
            meta = run_meta(device, world=world, **nccl)
            with open(os.path.join(args.out, f"distributed-world{world}.json"), "w") as f:
                dump_json(dict(meta=meta, rows=rows), f)
    finally:
        dist.destroy_process_group()


def merge(out_dir: str):
    runs = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "distributed-world*.json"))):
        with open(path) as f:
            d = json.load(f)
        runs[d["meta"]["world"]] = d
    if 1 not in runs or len(runs) < 2:
        raise SystemExit(f"--merge needs distributed-world1.json and at least one more world size in {out_dir}")
    rows, worlds = [], sorted(runs)
    for r1 in runs[1]["rows"]:
        B = r1["batch_per_gpu"]
        for w in worlds:
            r = next((x for x in runs[w]["rows"] if x["batch_per_gpu"] == B), None)
            if r is None:
                continue
            rows.append(dict(r, scaling_efficiency=round(r1["step_us"] / r["step_us"], 3)))
    meta = dict(runs[worlds[-1]]["meta"], worlds=worlds)
    md = [f"# Data-parallel scaling (weak: fixed batch per GPU) — {meta['device']}, torch {meta['torch']}, "
          f"{meta['date']}", "",
          "µs per training step (the slowest rank's; the all-reduce of the flat F32 gradient inside the "
          "step's CUDA graph), samples per second over all GPUs, and t(1 GPU) / t(N GPUs).", "",
          "| batch per GPU | GPUs | µs per step | samples/s | scaling efficiency |", "|---|---|---|---|---|"]
    md += [f"| {r['batch_per_gpu']} | {r['world']} | {r['step_us']:.1f} | {r['samples_per_s']:,} | "
           f"{r['scaling_efficiency']:.3f} |" for r in rows]
    write_results(out_dir, "distributed", meta, rows, md)
    print("\n".join(md))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[4096, 65536], help="batch per GPU")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=0, help="steps per timing (default: by batch size)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "bench", "results"))
    ap.add_argument("--merge", metavar="DIR", help="only merge the distributed-world*.json files in DIR")
    args = ap.parse_args()
    if args.merge:
        merge(args.merge)
    else:
        run(args)


if __name__ == "__main__":
    main()
