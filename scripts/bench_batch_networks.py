#!/usr/bin/env python3
"""Where the trainer's batched online + target hidden layers pay (``Trainer.batch_networks``,
by default up to dqn_ops/step.py's BATCH_NETWORKS_MAX_BATCH): the graphed training step with the
two networks' hidden layers as one batched GEMM each (fewer launches; the target also runs on s)
against two passes, per batch size.

    python3 scripts/bench_batch_networks.py --out bench/results   # or BENCHES=batch_networks bash scripts/gpu_check.sh

Writes <out>/batch-networks.{json,md} and prints the table.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dqn_ops import DQNConfig, Trainer, TrainerConfig  # noqa: E402
from dqn_ops.step import default_batch_networks  # noqa: E402

from bench import random_batch  # noqa: E402
from bench_common import run_meta, time_us, write_results  # noqa: E402


def step_us(c: DQNConfig, B: int, batch_networks: bool) -> float:
    cfg = TrainerConfig(batch_size=B, use_cuda_graph=True, readback_interval=100, on_non_finite="flag")
    trainer = Trainer(c, cfg, device="cuda", seed=0)
    assert trainer.uses_fused_path
    trainer.batch_networks = batch_networks  # before the first step: the graph captures this choice
    trainer.step(random_batch(c, B, "cuda"))
    return time_us(trainer.step, 200, 5)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192, 16384, 65536])
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    c, meta = DQNConfig(), run_meta()
    rows = []
    for B in args.batches:
        two, batched = step_us(c, B, False), step_us(c, B, True)
        rows.append(dict(batch=B, two_passes_us=round(two, 1), networks_batched_us=round(batched, 1),
                         trainer_batches=default_batch_networks(B)))
        print(f"B={B:6d}  two passes {two:8.1f} us  networks batched {batched:8.1f} us  "
              f"(trainer: {'batched' if default_batch_networks(B) else 'two passes'})", flush=True)
    md = [f"# Training step: online + target hidden layers batched vs two passes — {meta['device']}, torch "
          f"{meta['torch']}, {meta['date']}", "", "µs per graphed training step (median of 5 timings of 200 "
          "back-to-back steps).", "",
          "| B | two passes (µs) | networks batched (µs) | the trainer runs |", "|---:|---:|---:|---|"]
    md += [f"| {r['batch']} | {r['two_passes_us']} | {r['networks_batched_us']} | "
           f"{'batched' if r['trainer_batches'] else 'two passes'} |" for r in rows]
    write_results(args.out, "batch-networks", meta, rows, md)


if __name__ == "__main__":
    main()
