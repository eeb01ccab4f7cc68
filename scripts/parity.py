"""Convergence parity: the BF16 dqn_ops path against the plain-PyTorch F32 path.

Same task (scripts/train.py, one process per run), same seeds (so the same initial weights,
spectral-norm vectors, markets, exploration and replay samples), `--epochs` epochs of 300 steps at B=256, for each of
`--seeds`. Compared (docs/design.md's bars): final Sharpe within 5% relative, mean Q within 10%,
grad-norm mean and max within 20%, no NaN/Inf, peak VRAM within 10%.

Peak VRAM is checked as what the spec's criterion names it ("zero regression: no new CUDA errors,
no memory leaks (same peak VRAM +/- 10%)"): a regression check, so one-sided — the BF16 path's
peak may not exceed the F32 path's by more than 10% — plus the leak check itself, every run's
peak at the end within 10% of its peak after the first epoch. A BF16 peak more than 10% *below*
F32's (BF16 weights and activations are the point of the path) passes; the file still gives the
signed difference and what the two-sided reading would say (`two_sided_passed`).

RL runs diverge chaotically, so the control is measured too: the spread of each figure between
the F32 runs of different seeds (max |x_i - mean| / |mean|). Where that spread is wider than a
figure's band, a single-seed comparison cannot pass or fail meaningfully, and that figure is
compared on seed-averaged values over the same seeds for both paths; the result file says which
comparison each figure used. No band is widened.

"Final Sharpe" is the mean of the last 5 epochs' held-out evaluations (each a greedy episode
on 128 unseen markets), so that one noisy evaluation does not decide it.

`--jobs N` runs N training processes at once (one GPU is mostly idle at B=256: each process
is bound by its own host work). Every compared figure is per process (peak VRAM is the
process's own allocator peak), so concurrency changes none of them; the wall-clock timings in
the result file are then not comparable with a run alone, and the file records `jobs`.

Writes <out>/<date>-parity.json (top-level "pass") and <date>-parity.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")

BANDS = dict(final_sharpe=0.05, mean_q=0.10, grad_norm_mean=0.20, grad_norm_max=0.20, peak_vram_bytes=0.10)
FIGURE_KEYS = dict(final_sharpe="final_sharpe_mean_last5", mean_q="mean_q", grad_norm_mean="grad_norm_mean",
                   grad_norm_max="grad_norm_max", peak_vram_bytes="peak_vram_bytes")
VRAM_GROWTH_BAND = 0.10  # each run's peak at the end vs after epoch 1: the spec's "no memory leaks"


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def compare(runs: dict, seeds: list) -> tuple[dict, bool]:
    """Each figure of BANDS (and the VRAM growth) compared between the paths: the figures dict written
    to the result file, and whether all passed. `runs[path][seed]` holds one run's figures."""
    ref_seed = seeds[0]
    figures, ok = {}, True
    for name, band in BANDS.items():
        f32 = [runs["f32"][s][name] for s in seeds]
        bf16 = [runs["bf16"][s][name] for s in seeds]
        if None in f32 or None in bf16:  # peak VRAM on the CPU: not measured, not compared
            figures[name] = dict(band=band, compared="not measured on this device", bf16=None, f32=None,
                                 relative_difference=None, passed=None, f32_control_spread=None,
                                 f32_per_seed=f32, bf16_per_seed=bf16)
            continue
        mean_f32, mean_bf16 = sum(f32) / len(f32), sum(bf16) / len(bf16)
        control_spread = max(rel(x, mean_f32) for x in f32) if len(f32) > 1 else 0.0
        if control_spread <= band:
            compared, a, b = f"seed {ref_seed}", runs["bf16"][ref_seed][name], runs["f32"][ref_seed][name]
        else:
            compared, a, b = f"mean over seeds {seeds}", mean_bf16, mean_f32
        d = rel(a, b)
        figures[name] = dict(band=band, compared=compared, bf16=a, f32=b, relative_difference=d, passed=d <= band,
                             f32_control_spread=control_spread, f32_per_seed=f32, bf16_per_seed=bf16)
        if name == "peak_vram_bytes":  # a regression check (module docstring): only more memory fails
            signed = (a - b) / b
            figures[name].update(criterion="one-sided: BF16 peak <= (1 + band) x F32 peak", signed_difference=signed,
                                 passed=signed <= band, two_sided_passed=d <= band)
        ok &= figures[name]["passed"]
    growth = {p: [runs[p][s]["vram_growth"] for s in seeds] for p in runs}
    if None not in growth["f32"] + growth["bf16"]:
        worst = max(growth["f32"] + growth["bf16"])
        figures["vram_growth"] = dict(band=VRAM_GROWTH_BAND, compared="every run: peak at the end vs after epoch 1",
                                      bf16=max(growth["bf16"]), f32=max(growth["f32"]), relative_difference=worst,
                                      passed=worst <= VRAM_GROWTH_BAND, f32_control_spread=None,
                                      f32_per_seed=growth["f32"], bf16_per_seed=growth["bf16"])
        ok &= figures["vram_growth"]["passed"]
    return figures, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "bench", "results"))
    ap.add_argument("--runs", default="runs/parity")
    ap.add_argument("--jobs", type=int, default=1, help="training processes at once (default 1)")
    ap.add_argument("--steps", type=int, default=300, help="training steps per epoch (the check: 300)")
    ap.add_argument("--tiny", action="store_true", help="train.py's small network (a smoke test of this script)")
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error(f"--jobs: expected at least 1, got {args.jobs}")

    def run(path: str, backend: str, seed: int) -> dict:
        # One process per run: peak VRAM and every other figure measured from a clean start.
        out = os.path.join(args.runs, f"{path}-seed{seed}")
        subprocess.run([sys.executable, TRAIN, "--backend", backend, "--epochs", str(args.epochs), "--seed",
                        str(seed), "--steps", str(args.steps), "--device", args.device, "--quiet", "--out", out]
                       + (["--tiny"] if args.tiny else []), check=True,
                       stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
        r = {k: s[v] for k, v in FIGURE_KEYS.items()}
        first = s["peak_vram_first_epoch_bytes"]
        r.update(vram_growth=None if first is None else (s["peak_vram_bytes"] - first) / first)
        r.update(non_finite=s["non_finite"], epoch_seconds_median=s["epoch_seconds_median"],
                 train_step_ms_per_epoch_median=s["train_step_ms_per_epoch_median"])
        print(f"{path} seed {seed}: " + ", ".join(f"{k}={_fmt(r[k])}" for k in FIGURE_KEYS), flush=True)
        return r

    jobs = [(path, backend, seed) for seed in args.seeds for path, backend in (("f32", "torch"), ("bf16", "dqn_ops"))]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda j: run(*j), jobs))
    runs = {"f32": {}, "bf16": {}}
    for (path, _, seed), r in zip(jobs, results):
        runs[path][seed] = r

    seeds = args.seeds
    figures, ok = compare(runs, seeds)
    no_nan = not any(r["non_finite"] for p in runs.values() for r in p.values())
    ok &= no_nan
    result = {"pass": ok, "no_nan_or_inf": no_nan, "figures": figures, "runs": runs,
              "meta": dict(epochs=args.epochs, steps_per_epoch=args.steps, batch=256, seeds=seeds,
                           device=args.device, jobs=args.jobs, tiny_network=args.tiny,
                           gpu=torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
                           torch=torch.__version__, date=__import__("datetime").date.today().isoformat(),
                           final_sharpe_definition="mean of the last 5 epochs' held-out evaluations",
                           vram_criterion="the spec's 'zero regression: no memory leaks (same peak VRAM +/- 10%)': "
                                          "BF16 peak at most 10% above F32's (one-sided), and every run's peak "
                                          "at the end within 10% of its peak after epoch 1",
                           f32_path="dqn_ops.rl.baseline.TorchTrainer (plain PyTorch, F32, TF32 off)",
                           bf16_path="dqn_ops.Trainer (BF16 forward, bf16 backward, CUDA graph)")}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{result['meta']['date']}-parity")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Convergence parity, BF16 (dqn_ops) vs F32 (PyTorch) — {result['meta']['gpu'] or args.device}, "
             f"torch {torch.__version__}, {result['meta']['date']}", "",
             f"{args.epochs} epochs x {args.steps} steps, B=256, seeds {seeds}, {args.jobs} run(s) at a time"
             f"{' (tiny network: a smoke test)' if args.tiny else ''}. "
             f"**pass: {ok}** (no NaN/Inf: {no_nan})", "",
             "| figure | band | compared | BF16 | F32 | rel. diff | F32 seed spread | pass |",
             "|---|---|---|---|---|---|---|---|"]
    for name, f in figures.items():
        if f["passed"] is None:
            lines.append(f"| {name} | {f['band']:.0%} | {f['compared']} | | | | | |")
            continue
        if name == "vram_growth":  # growth of each path's worst run, not a BF16-vs-F32 difference
            lines.append(f"| {name} | {f['band']:.0%} | {f['compared']} | {f['bf16']:+.1%} | {f['f32']:+.1%} | | | "
                         f"{f['passed']} |")
            continue
        if name == "peak_vram_bytes":
            rel_cell = f"{f['signed_difference']:+.1%} (one-sided; two-sided: {f['two_sided_passed']})"
        else:
            rel_cell = f"{f['relative_difference']:.1%}"
        lines.append(f"| {name} | {f['band']:.0%} | {f['compared']} | {f['bf16']:.4g} | {f['f32']:.4g} | "
                     f"{rel_cell} | {f['f32_control_spread']:.1%} | {f['passed']} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
