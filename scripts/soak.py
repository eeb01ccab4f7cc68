"""Soak: many training steps at B=256, checking that nothing grows or goes non-finite.

    python3 scripts/soak.py                      # 100,000 graph replays, then 10,000 eager steps
    python3 scripts/soak.py --graph-steps 2000 --eager-steps 200     # a short run

For each mode: after a warm-up, CUDA memory allocated and reserved are sampled every
`--sample-every` steps and must not grow; every step's scalars must come back through the
deferred-readback ring, in order, all finite, and the rows the host has read must trail the
steps the GPU has finished by at most two readback intervals (the last copy, plus the one in
flight). The host itself may run ahead of the GPU (graph replays are one launch each, so when
the GPU is the bottleneck the host is as far ahead as the CUDA launch queue lets it be); that
lead is measured with an event per step and reported. Growth tolerance: 1 MiB over the run.
Batches cycle through 16 pre-made ones on the device.
Writes <out>/soak.json (top-level "pass") and prints a summary.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import deque

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dqn_ops import DQNConfig, Trainer, TrainerConfig  # noqa: E402
from dqn_ops.rl.results import dump_json, dumps_json  # noqa: E402

from bench import random_batch  # noqa: E402
from bench_common import result_path, run_meta  # noqa: E402


TOLERANCE = 1 << 20  # bytes


def soak(mode: str, steps: int, sample_every: int, interval: int, device) -> dict:
    c = DQNConfig()
    cfg = TrainerConfig(batch_size=256, use_cuda_graph=mode == "graph", readback_interval=interval,
                        on_non_finite="flag")
    t = Trainer(c, cfg, device=device, seed=0)
    batches = [random_batch(c, 256, device) for _ in range(16)]
    for i, b in enumerate(batches):
        b["states"] += 0.01 * i  # distinct batches
    warmup = max(2 * interval, 50)
    lag_max = lead_max = behind_gpu_max = 0
    samples = []
    in_flight = deque()  # (event after step i, i + 1): the GPU's progress, queried without a sync
    gpu_done = 0
    t0 = time.time()
    for i in range(warmup + steps):
        t.step(batches[i % 16])
        event = torch.cuda.Event()
        event.record()
        in_flight.append((event, i + 1))
        while in_flight and in_flight[0][0].query():
            gpu_done = in_flight.popleft()[1]
        if i >= warmup:
            recorded, read = t.stats.steps_recorded, t.stats.steps_read
            lag_max = max(lag_max, recorded - read)
            lead_max = max(lead_max, recorded - gpu_done)
            behind_gpu_max = max(behind_gpu_max, gpu_done - read)
        if i >= warmup and (i - warmup) % sample_every == 0:
            samples.append(dict(step=i, allocated=torch.cuda.memory_allocated(device),
                                reserved=torch.cuda.memory_reserved(device)))
    t.readback()
    seconds = time.time() - t0
    rows = t.stats.rows
    finite = all(math.isfinite(v) for r in rows for v in r.values())
    alloc = [s["allocated"] for s in samples]
    reserved = [s["reserved"] for s in samples]
    result = dict(mode=mode, steps=steps, warmup=warmup, seconds=round(seconds, 1),
                  us_per_step_wall=round(seconds / (warmup + steps) * 1e6, 1),
                  allocated_first=alloc[0], allocated_max=max(alloc), allocated_last=alloc[-1],
                  reserved_first=reserved[0], reserved_max=max(reserved), reserved_last=reserved[-1],
                  rows_read=len(rows), rows_expected=warmup + steps, all_finite=finite,
                  non_finite_steps=len(t.non_finite_steps), skipped=sum(r["skipped"] for r in rows),
                  readback_lag_max=lag_max, host_lead_max=lead_max, read_behind_gpu_max=behind_gpu_max,
                  readback_interval=interval,
                  loss_first=rows[0]["loss"], loss_last=rows[-1]["loss"])
    # a leak of even 100 bytes a step would pass 1 MiB within 10,000 steps
    checks = dict(no_allocated_growth=max(alloc) <= alloc[0] + TOLERANCE, no_reserved_growth=max(reserved) <= reserved[0] + TOLERANCE,
                  every_step_read_back=len(rows) == warmup + steps, all_finite=finite and not t.non_finite_steps,
                  # rows read trail the GPU's finished steps by at most the steps since the last
                  # enqueued copy plus the copy in flight: two intervals (the host's own lead over
                  # the GPU, host_lead_max, is the launch queue's business, not the ring's)
                  readback_lag_bounded=behind_gpu_max <= 2 * interval)
    result.update(checks=checks, passed=all(checks.values()))
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph-steps", type=int, default=100_000)
    ap.add_argument("--eager-steps", type=int, default=10_000)
    ap.add_argument("--sample-every", type=int, default=1000)
    ap.add_argument("--readback-interval", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "bench", "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("soak.py needs a CUDA device")
    device = torch.device("cuda")
    results = []
    for mode, steps in (("graph", args.graph_steps), ("eager", args.eager_steps)):
        r = soak(mode, steps, min(args.sample_every, max(1, steps // 10)), args.readback_interval, device)
        results.append(r)
        print(dumps_json(r), flush=True)
    meta = run_meta(batch=256, config="reference")
    out = {"pass": all(r["passed"] for r in results), "meta": meta, "runs": results}
    path = result_path(args.out, meta, "soak.json")
    with open(path, "w") as f:
        dump_json(out, f)
    print(f"soak pass: {out['pass']}; wrote {path}")


if __name__ == "__main__":
    main()
