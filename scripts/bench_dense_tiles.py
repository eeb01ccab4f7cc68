#!/usr/bin/env python3
"""The dense layer kernel's tile shapes, each forced on every launch, against the rule's choice:
the graphed step and each of its dense-kernel launches, per network and batch size.

csrc/cuda/dense_layer.cu picks a launch's tile (128 x 128, 64 x 64 or 32 x 64) from its grid
(pick_tile); every shape gives the same bits, so the choice is speed alone. DQN_OPS_DENSE_TILE
forces one shape for every launch of a process (read once per process, so each setting runs in
a child process of its own, in turns: auto, 128x128, 64x64, 32x64, for --rounds rounds).

    python3 scripts/bench_dense_tiles.py --out gpu_out
    python3 scripts/bench_dense_tiles.py --networks trunk_3x512 --batches 2048 4096 --rounds 2

Per (network, batch, setting): µs per graphed step (bench_common.time_us, the median over the
rounds), and for each dense-kernel launch of one replay (torch profiler, in start order) its tile
and the µs it added to the replay: its end minus the latest end of every activity that started
before it, 0 where one of those ends later (under programmatic dependent launch a kernel starts
before its predecessor ends, so its duration overstates what it costs; this is what the step's
span grows by). Writes <out>/dense-tiles.{json,md} (--name).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SETTINGS = ("auto", "128x128", "64x64", "32x64")

CHILD = r"""
import json, re, sys, torch
from bench import random_batch
from bench_common import time_us
from bench_networks import NETWORKS
from profile_step import kernel_trace
from dqn_ops import Trainer, TrainerConfig
networks, batches, iters = sys.argv[1].split(","), [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3])
out = []
for network in networks:
    c, trainer_kw = NETWORKS[network]
    for B in batches:
        t = Trainer(c, TrainerConfig(batch_size=B, on_non_finite="flag", **trainer_kw), device="cuda", seed=0)
        t.step(random_batch(c, B, "cuda"))
        for _ in range(10):
            t.step()
        assert t.graphed, "the step did not capture"
        us = time_us(t.step, iters, 3)
        trace, _ = kernel_trace(t.step)
        launches, latest = [], None
        for name, start, dur in trace:
            end = start + dur
            if "dense_layer_kernel" in name:
                m = re.search(r"dense_layer_kernel<(\d+), (\d+),", name)
                added = max(0.0, end - max(start, latest)) if latest is not None else dur
                launches.append(dict(tile=f"{m.group(1)}x{m.group(2)}", us=round(dur, 2), added_us=round(added, 2)))
            latest = end if latest is None else max(latest, end)
        out.append(dict(network=network, batch=B, step_us=round(us, 2), launches=launches))
        del t
        torch.cuda.empty_cache()
print(json.dumps(out))
"""


def run_setting(setting, networks, batches, iters):
    env = dict(os.environ, DQN_OPS_DENSE_TILE=setting)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE])
    r = subprocess.run([sys.executable, "-c", CHILD, ",".join(networks), ",".join(map(str, batches)), str(iters)],
                       env=env, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_dense_tiles: DQN_OPS_DENSE_TILE={setting} exited with {r.returncode}:\n"
                         f"{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--networks", nargs="+", default=["reference", "trunk_3x512", "iqn_32"],
                    help="networks of scripts/bench_networks.py")
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--rounds", type=int, default=2, help="turns of the four settings")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--name", default="dense-tiles", help="the result files' stem")
    ap.add_argument("--out", default=os.path.join(ROOT, "gpu_out"))
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    from bench_networks import NETWORKS
    unknown = [n for n in args.networks if n not in NETWORKS]
    if unknown:
        ap.error(f"--networks: each one of {sorted(NETWORKS)}, got {unknown}")
    sys.path.insert(0, ROOT)
    from bench_common import run_meta, write_results

    runs = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for s in SETTINGS if r % 2 == 0 else tuple(reversed(SETTINGS)):  # no setting always first
            runs[s].append(run_setting(s, args.networks, args.batches, args.iters))
            print(f"round {r + 1}: {s} done", flush=True)
    rows = []
    for i, first in enumerate(runs["auto"][0]):
        row = dict(network=first["network"], batch=first["batch"], settings={})
        for s in SETTINGS:
            per_round = [run[i] for run in runs[s]]
            launches = [dict(tile=l["tile"], added_us=round(statistics.median(r["launches"][j]["added_us"]
                                                                               for r in per_round), 2))
                        for j, l in enumerate(per_round[0]["launches"])]
            row["settings"][s] = dict(step_us=round(statistics.median(r["step_us"] for r in per_round), 2),
                                      step_all=[r["step_us"] for r in per_round], launches=launches)
        rows.append(row)
    meta = run_meta(rounds=args.rounds, iters=args.iters, networks=args.networks, batches=args.batches)
    lines = [f"# Dense kernel tile shapes, forced vs the rule — {meta['device']}, torch {meta['torch']}, "
             f"{meta['date']}", "",
             f"µs per graphed step (median of {args.rounds} rounds, each the median of 3 x {args.iters} steps), "
             "then each dense-kernel launch of one replay in start order: its tile under auto, and the µs it "
             "added past the latest end of everything that started before it, per setting "
             "(`DQN_OPS_DENSE_TILE`). Every setting gives the same bits.", "",
             "| network | B | " + " | ".join(SETTINGS) + " |", "|---|---|" + "---|" * len(SETTINGS)]
    for row in rows:
        steps = [row["settings"][s]["step_us"] for s in SETTINGS]
        best = min(steps)
        lines.append(f"| {row['network']} | {row['batch']} | "
                     + " | ".join(f"**{v}**" if v == best else f"{v}" for v in steps) + " |")
    lines += ["", "Per launch (µs added; auto's tile in brackets):", ""]
    for row in rows:
        lines.append(f"- {row['network']}, B = {row['batch']}: " + "; ".join(
            f"#{j} [{l['tile']}] " + " / ".join(f"{row['settings'][s]['launches'][j]['added_us']}"
                                                for s in SETTINGS)
            for j, l in enumerate(row["settings"]["auto"]["launches"])))
    lines += ["", "(each launch's four figures: " + " / ".join(SETTINGS) + ")"]
    write_results(args.out, args.name, meta, rows, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
