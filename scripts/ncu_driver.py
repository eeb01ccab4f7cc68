"""The program scripts/ncu_step.sh profiles: a few eager dqn_ops training steps, then one
between cudaProfilerStart and cudaProfilerStop (ncu --profile-from-start off measures only it)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dqn_ops import Trainer, TrainerConfig  # noqa: E402

from bench import random_batch  # noqa: E402
from bench_networks import NETWORKS  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--network", default="reference", choices=list(NETWORKS), help="a network of bench_networks.py")
    args = ap.parse_args()
    c, trainer_kw = NETWORKS[args.network]
    t = Trainer(c, TrainerConfig(batch_size=args.batch, use_cuda_graph=False, on_non_finite="flag", **trainer_kw),
                device="cuda")
    batch = random_batch(c, args.batch, torch.device("cuda"))
    for _ in range(3):
        t.step(batch)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    t.step(batch)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"ncu_driver: one profiled step of {args.network} at B = {args.batch}")


if __name__ == "__main__":
    main()
