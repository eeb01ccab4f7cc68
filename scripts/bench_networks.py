"""The training step on networks of other shapes: dqn_ops against the strongest plain-PyTorch
recipe, in one run.

    python3 scripts/bench_networks.py                          # every network, B = 256 and 4096
    python3 scripts/bench_networks.py --networks cleanrl_c51 --batches 256
    python3 scripts/bench_networks.py --device cpu --batches 32 --modes dqn_ops_eager torch_eager_f32 --iters 3
    python3 scripts/bench_networks.py --networks iqn_32 --merge bench/results/networks.json   # one network again

The networks (NETWORKS below) are the reference config of docs/design.md, CleanRL's c51.py network
(4 -> 120 -> 84 -> 2 x 101 atoms, no dueling, no head layer), a 3 x 512 trunk with the reference
heads, QR-DQN with 200 quantiles on the reference network (loss_type 'qr'), an ensemble of 5
head sets on the reference trunk (bootstrap masks, p = 0.5), IQN on the reference network (64
cosines, N = N' = K = 32 fractions; loss 'iqn') and the seed's combination (the reference C51
network with an IQN head group and an ensemble of 5 C51 head sets on its trunk). The step is dqn_ops.Trainer's (graphed) against dqn_ops.rl.baseline.TorchTrainer with
torch.compile of the forward + loss and of the updates, the whole step in one CUDA graph, under
autocast BF16 (scripts/bench.py's torch_compile_graph_bf16, the fastest PyTorch recipe there).
Target (issue 20): dqn_ops >= 4x faster for each network at B = 256 and 4096. torch.compile
recompiles for every network and batch (tens of seconds each). Writes <out>/networks.{json,md};
with --merge, the rows of the networks not run come from an earlier file of the same device,
torch and modes (each row keeps its run's date; a network's modes are always from one run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dqn_ops  # noqa: E402
from dqn_ops import DQNConfig, HeadGroup  # noqa: E402

from bench import MODES, make_step  # noqa: E402
from bench_common import kernels_per_call, run_meta, switches_note, time_us, write_results  # noqa: E402

# name -> (network, TrainerConfig fields beside the defaults; no loss_type: C51 for atoms > 1)
NETWORKS = {
    "reference": (DQNConfig(), {}),
    "cleanrl_c51": (DQNConfig(state_dim=4, trunk_hidden=(120, 84), adv_hidden=(), atoms=101, branches=(2,),
                              dueling=False), {}),
    "trunk_3x512": (DQNConfig(trunk_hidden=(512, 512, 512)), {}),
    "qr_dqn_200": (DQNConfig(atoms=200), dict(loss_type="qr")),
    "ensemble_5": (DQNConfig(ensemble=5), dict(bootstrap_p=0.5)),  # bootstrapped DQN's masks
    # IQN on the reference network: the paper's 64 cosines, N = N' = K = 32 fractions
    "iqn_32": (DQNConfig(atoms=1, iqn_embedding=64), dict(iqn_fractions=32)),
    # the seed's combination (issue 20, item 5): the reference C51 network with an IQN head group
    # (64 cosines, 32 fractions) and an ensemble of 5 C51 head sets on the same trunk
    "seed_combination": (DQNConfig(aux=(HeadGroup("iqn", iqn_embedding=64), HeadGroup("c51", members=5))),
                         dict(iqn_fractions=32)),
}


def describe(name: str) -> str:
    c, kw = NETWORKS[name]
    return f"`{name}` = `{c}`" + "".join(f", {k} {v}" for k, v in kw.items())
DEFAULT_MODES = ("dqn_ops_graph", "torch_compile_graph_bf16")
TARGET_SPEEDUP = 4.0


def switches_sentence(rows) -> str:
    """What the markdown says of dqn_ops's code-path switches over `rows` (bench_common.switches_note)."""
    notes = sorted({switches_note(r["switches"]) if "switches" in r else "not recorded" for r in rows})
    if notes == ["not recorded"]:
        return ""
    if len(notes) == 1:
        return f" dqn_ops: {notes[0]}."
    return (" dqn_ops's switches differ between the merged runs (each row's in networks.json): " + "; ".join(notes)
            + ".")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=300, help="steps per timing")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "bench", "results"))
    ap.add_argument("--merge", metavar="JSON",
                    help="an earlier networks.json (same device, torch, modes): its rows of the networks not run now "
                         "are kept, so one network is measured again without running them all")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not (torch.cuda.is_available() and dqn_ops.cuda_kernels_built()):
        raise SystemExit("bench_networks.py on cuda needs a CUDA device and dqn_ops built with its CUDA kernels")
    torch.backends.cuda.matmul.allow_tf32 = False  # an F32 baseline is F32
    meta = run_meta(device, modes=args.modes, tf32=False, target_speedup=TARGET_SPEEDUP)
    merged = merged_rows(args.merge, meta, args.networks) if args.merge else []
    rows = []
    for name in args.networks:
        c, trainer_kw = NETWORKS[name]
        loss_type = trainer_kw.get("loss_type")
        for B in args.batches:
            for mode in args.modes:
                if device.type != "cuda" and ("graph" in mode or "compile" in mode):
                    continue
                try:
                    t0 = time.time()
                    fn = make_step(mode, c, B, device, **trainer_kw)
                    us = time_us(fn, args.iters, 3, device=device)
                    k = kernels_per_call(fn) if device.type == "cuda" else None
                    row = dict(network=name, loss=loss_type or "c51", params=c.num_parameters, batch=B, mode=mode,
                               status="ok",
                               step_us=round(us, 2), kernels=k, setup_s=round(time.time() - t0, 1))
                except Exception as e:  # reported; the run goes on
                    row = dict(network=name, loss=loss_type or "c51", params=c.num_parameters, batch=B, mode=mode,
                               status=f"failed: {type(e).__name__}: {str(e)[:300]}")
                row["date"] = meta["date"]
                if "switches" in meta:  # each row's own: --merge keeps rows of runs with other switches
                    row["switches"] = meta["switches"]
                rows.append(row)
                print(f"{name:12s} B={B:5d}  {mode:26s}  " +
                      (f"{row['step_us']:9.1f} us/step  kernels {row['kernels']}" if row["status"] == "ok"
                       else row["status"]), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if device.type == "cuda":  # after every network: a run cut short keeps the networks it finished
            write_results(args.out, "networks", meta, merged + rows, report_lines(args, meta, merged + rows))
    if device.type != "cuda":
        print("\n".join(report_lines(args, meta, merged + rows)))


def report_lines(args, meta, rows):
    """The markdown of `rows` (this run's and the merged ones); sets each row's speedup."""
    names = [n for n in NETWORKS if any(r["network"] == n for r in rows)]
    dates = sorted({r["date"] for r in rows})

    def row_of(name, B, mode):
        return next((r for r in rows if r["network"] == name and r["batch"] == B and r["mode"] == mode), None)

    def us(name, B, mode):
        r = row_of(name, B, mode)
        return r["step_us"] if r is not None and r["status"] == "ok" else None

    ours, theirs = args.modes[0], args.modes[-1]
    unfinished = [n for n in args.networks if not any(r["network"] == n for r in rows)]
    lines = [f"# Training step by network shape — {meta['device']}, torch {meta['torch']}, {', '.join(dates)}", "",
             f"µs per step (median of 3 timings of {args.iters} back-to-back steps); kernels per step from the "
             f"torch profiler; speedup = {theirs} / {ours} (target >= {TARGET_SPEEDUP:g}x)." +
             (" Rows of several runs (--merge; each row's date in networks.json); a network's modes are from one run."
              if args.merge else "") + switches_sentence(rows) +
             (f" Unfinished: {', '.join(unfinished)} not run yet." if unfinished else ""), "",
             "| network | parameters | B | " + " | ".join(args.modes) + " | speedup |",
             "|---|---|---|" + "---|" * len(args.modes) + "---|"]
    for name in names:
        for B in sorted({r["batch"] for r in rows if r["network"] == name}):
            cells = []
            for m in args.modes:
                r = row_of(name, B, m)
                cells.append("not run" if r is None else f"{r['step_us']:.1f} ({r['kernels']} k)"
                             if r["status"] == "ok" else r["status"][:60])
            a, b = us(name, B, ours), us(name, B, theirs)
            speedup = f"{b / a:.1f}x" if a and b and ours != theirs else "-"
            for r in rows:
                if r["network"] == name and r["batch"] == B and a and b:
                    r["speedup"] = round(b / a, 2)
            lines.append(f"| {name} | {NETWORKS[name][0].num_parameters:,} | {B} | " + " | ".join(cells) +
                         f" | {speedup} |")
    return lines + ["", "Networks: " + "; ".join(describe(n) for n in names)]


def merged_rows(path, meta, networks):
    """The rows of `path` (an earlier networks.json) of the networks not in `networks`, each with
    its run's date; the file must come from the same device, torch and modes as `meta`."""
    with open(path) as f:
        earlier = json.load(f)
    for key in ("device", "torch", "modes"):
        if earlier["meta"].get(key) != meta.get(key):
            raise SystemExit(f"--merge {path}: its {key} is {earlier['meta'].get(key)!r}, this run's {meta.get(key)!r}")
    return [dict(r, date=r.get("date", earlier["meta"]["date"])) for r in earlier["rows"] if r["network"] not in networks]


if __name__ == "__main__":
    main()
