"""The graphed training step of two builds of dqn_ops, timed alternately in one run.

A refactor that should not change speed is checked by timing the step of the tree before it
(a copy of an older commit, built in place) and of this tree, in turns on the same GPU, so that
clock and thermal drift fall on both alike. Two builds of the extension register the same op
names, so each timing runs in a process of its own, with that tree first on ``PYTHONPATH``.

    git archive <base-commit> csrc dqn_ops scripts setup.py | tar -x -C .base   # then, on the GPU:
    (cd .base && python3 setup.py build_ext --inplace)
    python3 scripts/bench_ab.py --base .base --out gpu_out

Writes ``<out>/step-ab.{json,md}``: per network and batch size, the median over the rounds of
each tree's µs per step (``Trainer.step()`` replaying its CUDA graph on a fixed batch), and new /
base. The files are rewritten after every row, so a run cut short keeps the rows it finished.

The base may be this tree itself under other environment variables (a switch read at run time),
and the new tree's processes may take some of their own (a switch that is off by default). The
side streams' file is the base with them off against the default:

    python3 scripts/bench_ab.py --base . --base-env DQN_OPS_PDL=0 --name step-ab-pdl --out bench/results
    python3 scripts/bench_ab.py --base . --base-env DQN_OPS_SIDE_STREAM=0 --name step-ab-side-stream

The side streams are on by default in this tree and off in trees before it, so an A/B against
such a base that is not about them sets them on there (``--base-env DQN_OPS_SIDE_STREAM=1``);
each row records what each side's processes had (``side_streams``, the .md's last column).

``--networks`` times other networks of scripts/bench_networks.py (their trainer settings
included) than the reference one, one after the other into the same files; the base must have
the features those networks use.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Runs in the child process: only the public Trainer API, which both trees have, timed by
# bench_common.time_us as every benchmark here is.
TIMING = r"""
import json, sys, torch, dqn_ops
from bench_common import time_us
from dqn_ops import DQNConfig, Trainer, TrainerConfig
B, iters, repeats, network = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if network == "reference":
    # Written out, not bench.random_batch: this tree's bench.py imports parts of dqn_ops an older
    # base may lack (dqn_ops.step, dqn_ops.rl.baseline).
    c, trainer_kw = DQNConfig(), {}
    g = torch.Generator(device="cuda").manual_seed(B)
    batch = dict(states=torch.randn(B, c.state_dim, device="cuda", generator=g),
                 next_states=torch.randn(B, c.state_dim, device="cuda", generator=g),
                 actions=torch.stack([torch.randint(0, n, (B,), device="cuda", generator=g) for n in c.branches], 1),
                 rewards=torch.randn(B, device="cuda", generator=g),
                 dones=(torch.rand(B, device="cuda", generator=g) < 0.05).float())
else:  # the base has the network's features (--network's help), bench.py's imports included
    from bench import random_batch
    from bench_networks import NETWORKS
    c, trainer_kw = NETWORKS[network]
    batch = random_batch(c, B, "cuda")
t = Trainer(c, TrainerConfig(batch_size=B, on_non_finite="flag", **trainer_kw), device="cuda", seed=0)
t.step(batch)
for _ in range(10):
    t.step()
assert t.graphed, "the step did not capture"
us = time_us(t.step, iters, repeats)
try:  # the side streams as this process had them (their default differs between trees)
    from dqn_ops import side_stream
    side_streams = side_stream.enabled()
except ImportError:  # a tree from before them
    side_streams = None
print(json.dumps(dict(us=us, dqn_ops=dqn_ops.__file__, side_streams=side_streams)))
"""


def time_tree(tree, B, iters, repeats, network="reference", extra_env=None, unset=()):
    """µs per step of `tree`'s graphed step, and whether its process had the side streams on
    (None: a tree without them)."""
    # the tree's dqn_ops first; this tree's scripts/ for the timing helper both trees share; the
    # variables either side sets are not inherited by the other (`unset`)
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree), HERE])
    run = subprocess.run([sys.executable, "-c", TIMING, str(B), str(iters), str(repeats), network], env=env,
                         cwd=tree, capture_output=True, text=True)
    if run.returncode != 0:  # the child's own error, not the timing script CalledProcessError would print
        raise SystemExit(f"AB FAILED: the timing of {tree} (B = {B}, {network}) exited with {run.returncode}:\n"
                         f"{run.stderr[-3000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    expected = os.path.join(os.path.abspath(tree), "dqn_ops")
    if not result["dqn_ops"].startswith(expected):
        raise SystemExit(f"bench_ab: {tree} imported dqn_ops from {result['dqn_ops']}, not from {expected}")
    return result["us"], result["side_streams"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the other tree, built in place")
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--rounds", type=int, default=5, help="alternations base, new per batch size")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--base-env", nargs="+", default=[], metavar="KEY=VALUE",
                    help="environment variables of the base's processes only")
    ap.add_argument("--new-env", nargs="+", default=[], metavar="KEY=VALUE",
                    help="environment variables of the new tree's processes only")
    ap.add_argument("--networks", "--network", nargs="+", default=["reference"],
                    help="networks of scripts/bench_networks.py (default: the reference one)")
    ap.add_argument("--name", default="step-ab", help="the result files' stem")
    ap.add_argument("--out", default=os.path.join(ROOT, "gpu_out"))
    args = ap.parse_args()
    for flag, pairs in (("--base-env", args.base_env), ("--new-env", args.new_env)):
        bad = [kv for kv in pairs if "=" not in kv or kv.startswith("=")]
        if bad:
            ap.error(f"{flag} takes KEY=VALUE pairs, got {bad}")
    if args.networks != ["reference"]:
        sys.path.insert(0, HERE)
        from bench_networks import NETWORKS
        unknown = [n for n in args.networks if n not in NETWORKS]
        if unknown:
            ap.error(f"--networks: each one of {sorted(NETWORKS)}, got {unknown}")
    env = dict(base=dict(kv.split("=", 1) for kv in args.base_env), new=dict(kv.split("=", 1) for kv in args.new_env))
    sys.path.insert(0, ROOT)
    import torch

    from bench_common import run_meta

    trees = dict(base=args.base, new=ROOT)
    unset = set(env["base"]) | set(env["new"])  # neither side inherits the other's variables
    meta = run_meta("cuda" if torch.cuda.is_available() else "cpu", base=os.path.abspath(args.base),
                    base_env=env["base"], new_env=env["new"], rounds=args.rounds, iters=args.iters,
                    networks=args.networks)
    rows = []
    for network in args.networks:
        for B in args.batches:
            times = {name: [] for name in trees}
            side_streams = {name: set() for name in trees}
            for r in range(args.rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))  # neither always goes first
                for name in order:
                    us, side = time_tree(trees[name], B, args.iters, 3, network, env[name], unset)
                    times[name].append(us)
                    side_streams[name].add(side)
            med = {name: statistics.median(v) for name, v in times.items()}
            rows.append(dict(network=network, batch=B, base_us=round(med["base"], 2), new_us=round(med["new"], 2),
                             ratio=round(med["new"] / med["base"], 4), base_all=times["base"], new_all=times["new"],
                             side_streams={name: v.pop() if len(v) == 1 else "mixed"
                                           for name, v in side_streams.items()}))
            print(f"{network:16s} B={B:6d}  base {med['base']:8.1f} us  new {med['new']:8.1f} us  "
                  f"new/base {med['new'] / med['base']:.3f}", flush=True)
            write(args, meta, rows)  # after every row: a run cut short keeps what it measured


def write(args, meta, rows):
    """<out>/<name>.json (meta + rows) and .md: the rows so far."""
    from dqn_ops.rl.results import dump_json

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.name + ".json"), "w") as f:
        dump_json(dict(meta=meta, rows=rows), f)

    def named(name, pairs):
        return name + (" (" + ", ".join(pairs) + ")" if pairs else "")
    done = len(rows) == len(args.networks) * len(args.batches)
    lines = [f"# Graphed step, {named('base', args.base_env)} vs {named('new tree', args.new_env)} — "
             f"{meta['device']}, torch {meta['torch']}, {meta['date']}", "",
             f"Median of {args.rounds} alternating rounds (each the median of 3 x {args.iters} steps)."
             + ("" if done else f" Unfinished: {len(rows)} of {len(args.networks) * len(args.batches)} rows."), "",
             "| network | B | base µs | new µs | new / base | side streams, base / new |",
             "|---|---|---|---|---|---|"]
    said = {True: "on", False: "off", None: "none", "mixed": "mixed"}
    lines += [f"| {r['network']} | {r['batch']} | {r['base_us']} | {r['new_us']} | {r['ratio']:.3f} | "
              f"{said[r['side_streams']['base']]} / {said[r['side_streams']['new']]} |" for r in rows]
    with open(os.path.join(args.out, args.name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
