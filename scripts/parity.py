"""Convergence parity: the BF16 dqn_ops path against the plain-PyTorch F32 path.

Same task (scripts/train.py, one process per run), same seeds (so the same initial weights,
spectral-norm vectors, markets, replay draws and exploration draws: `TorchTrainer` explores with
dqn_ops's Philox stream for the seed, `ops.epsilon_greedy`; `--torch-exploration torch` gives
the plain-PyTorch runs torch's generator instead, as the results before this option had),
`--epochs` epochs of 300 steps at B=256, for each of `--seeds`. The shared draws are common
random numbers: the two runs of a seed explore alike for as long as their greedy actions agree,
so the per-seed differences measure the paths, not the luck of two exploration streams.
`--f32-backend dqn_ops` (CPU only) makes the F32 side dqn_ops itself with nothing rounded
(`train.py --mirror f32`): the same formulas and the same random streams on both sides, so the
difference is BF16's own. Compared (docs/design.md's bars): final Sharpe within 5% relative,
mean Q within 10%, grad-norm mean and max within 20%, no NaN/Inf, peak VRAM within 10%.

Peak VRAM is checked as what the spec's criterion names it ("zero regression: no new CUDA errors,
no memory leaks (same peak VRAM +/- 10%)"): a regression check, so one-sided — the BF16 path's
peak may not exceed the F32 path's by more than 10% — plus the leak check itself, every run's
peak at the end within 10% of its peak after the first epoch. A BF16 peak more than 10% *below*
F32's (BF16 weights and activations are the point of the path) passes; the file still gives the
signed difference and what the two-sided reading would say (`two_sided_passed`).

RL runs diverge chaotically: the F32 runs of different seeds spread about as wide as their
mean (seed 4 of the committed result barely learns), 20x the Sharpe band, so neither one seed
nor the difference of two seed means can tell a real difference from luck. Both paths run the
same seeds (the same initial weights, markets and replay draws), so each figure
is compared on the paired per-seed differences d_s = BF16_s - F32_s, relative to |mean F32|: a
Student-t confidence interval of their mean (`--confidence`, 95% by default) is checked against
the band (an equivalence test; no band is widened):

    pass          the whole interval lies inside [-band, +band]
    fail          the whole interval lies outside it (a real difference)
    inconclusive  the interval straddles an edge: too few seeds for this spread

and the file gives the seeds that the observed spread of the differences would need
(`seeds_needed`; null where the observed mean difference itself is at the band's edge).
Peak VRAM is one-sided (above). The top-level "verdict" is "fail" if any figure fails or a run
had NaN/Inf, else "inconclusive" if any figure is, else "pass"; "pass" is true only for "pass".

`--reanalyze FILE` recomputes the figures and the verdict from the per-seed numbers of an
existing result file (no training), keeping its runs and meta (device, torch, date) and adding
the analysis date, and rewrites FILE and its .md beside it. `--merge FILE FILE ...` analyses the
seeds of several files as one (waves of seeds run in separate calls; they must have trained alike
on disjoint seeds) into <out>/<name>.json and .md.

"Final Sharpe" is the mean of the last 5 epochs' held-out evaluations (each a greedy episode
on 128 unseen markets), so that one noisy evaluation does not decide it.

`--jobs N` runs N training processes at once (one GPU is mostly idle at B=256: each process
is bound by its own host work). Every compared figure is per process (peak VRAM is the
process's own allocator peak), so concurrency changes none of them; the wall-clock timings in
the result file are then not comparable with a run alone, and the file records `jobs`.

`--train-args "--prioritized --n-step 3"` passes options to every training run (both paths),
and `--name` names the result (default "parity"; e.g. "parity-prioritized-n3").

Writes <out>/<name>.json (top-level "verdict" and "pass"; strict JSON: a non-finite number is
null; the date is inside) and <name>.md, overwriting the previous run's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_common import code_path_switches  # noqa: E402  (this script's folder is on the path)
from dqn_ops.rl.results import dump_json  # noqa: E402

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")

BANDS = dict(final_sharpe=0.05, mean_q=0.10, grad_norm_mean=0.20, grad_norm_max=0.20, peak_vram_bytes=0.10)
FIGURE_KEYS = dict(final_sharpe="final_sharpe_mean_last5", mean_q="mean_q", grad_norm_mean="grad_norm_mean",
                   grad_norm_max="grad_norm_max", peak_vram_bytes="peak_vram_bytes")
VRAM_GROWTH_BAND = 0.10  # each run's peak at the end vs after epoch 1: the spec's "no memory leaks"
CONFIDENCE = 0.95  # of the t-interval of the mean paired difference
MAX_SEEDS_NEEDED = 1000  # seeds_needed beyond this: reported as null
# The committed 6-seed result's paired differences (bench/results/parity.json, --reanalyze) need
# about 20 seeds (final Sharpe) and 21 (mean Q) for the 95% interval to fit the band: 24 by
# default, 48 runs, 6 at a time (the committed run's concurrency; the figures are per process).
DEFAULT_SEEDS = 24


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


# -- statistics (the standard library only) ---------------------------------------------------

def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta function (Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(1.0 - x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t (bisection on t_cdf; p in (0, 1))."""
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def paired_analysis(f32: list, bf16: list, band: float, confidence: float = CONFIDENCE,
                    one_sided: bool = False) -> dict:
    """The paired comparison of one figure: d_s = bf16_s - f32_s over the seeds, relative to
    |mean f32|; the t-interval of the mean difference at `confidence` and the verdict against
    the band (two-sided: equivalence within [-band, band]; `one_sided`: a regression check,
    only an increase beyond +band fails)."""
    n = len(f32)
    diffs = [b - a for a, b in zip(f32, bf16)]
    mean_f32 = sum(f32) / n
    scale = max(abs(mean_f32), 1e-12)
    mean_d = sum(diffs) / n
    rel_mean = mean_d / scale
    if n >= 2:
        sd = math.sqrt(sum((d - mean_d) ** 2 for d in diffs) / (n - 1))
        t = t_quantile(0.5 + confidence / 2.0, n - 1)
        half = t * sd / math.sqrt(n) / scale
    else:  # one seed: no spread, no interval
        sd, half = None, math.inf
    lo, hi = rel_mean - half, rel_mean + half
    if one_sided:
        verdict = "pass" if hi <= band else "fail" if lo > band else "inconclusive"
    else:
        verdict = "pass" if -band <= lo and hi <= band else "fail" if lo > band or hi < -band else "inconclusive"
    # The seeds the observed spread would need for the interval to fit inside the band (with the
    # observed mean difference): none if that mean is itself at or beyond the band's edge.
    needed = None
    edge = band - (rel_mean if one_sided else abs(rel_mean))
    if sd is not None and edge > 0:
        sd_rel = sd / scale
        for m in range(2, MAX_SEEDS_NEEDED + 1):
            if t_quantile(0.5 + confidence / 2.0, m - 1) * sd_rel / math.sqrt(m) <= edge:
                needed = m
                break
    return dict(n_seeds=n, f32_mean=mean_f32, bf16_mean=sum(bf16) / n, mean_difference=mean_d,
                relative_difference=rel_mean, sd_of_differences=sd, confidence=confidence,
                ci_low=lo, ci_high=hi, ci_half_width=half, verdict=verdict, seeds_needed=needed)


def compare(runs: dict, seeds: list, confidence: float = CONFIDENCE) -> tuple[dict, bool]:
    """Each figure of BANDS (and the VRAM growth) compared between the paths: the figures dict
    written to the result file, and whether all passed (conclusively: see ``verdict``).
    `runs[path][seed]` holds one run's figures."""
    figures = {}
    for name, band in BANDS.items():
        f32 = [runs["f32"][s][name] for s in seeds]
        bf16 = [runs["bf16"][s][name] for s in seeds]
        if None in f32 or None in bf16:  # peak VRAM on the CPU: not measured, not compared
            figures[name] = dict(band=band, compared="not measured on this device", verdict="not measured",
                                 bf16=None, f32=None, relative_difference=None, passed=None,
                                 f32_control_spread=None, f32_per_seed=f32, bf16_per_seed=bf16)
            continue
        one_sided = name == "peak_vram_bytes"  # a regression check (module docstring): only more memory fails
        a = paired_analysis(f32, bf16, band, confidence, one_sided=one_sided)
        mean_f32 = a["f32_mean"]
        spread = max(rel(x, mean_f32) for x in f32) if len(f32) > 1 else 0.0
        figures[name] = dict(band=band, compared=f"paired per-seed differences over seeds {list(seeds)}",
                             bf16=a["bf16_mean"], f32=mean_f32, **{k: v for k, v in a.items()
                                                                    if k not in ("f32_mean", "bf16_mean")},
                             passed=a["verdict"] == "pass", f32_control_spread=spread,
                             f32_per_seed=f32, bf16_per_seed=bf16)
        if one_sided:
            figures[name].update(criterion="one-sided: BF16 peak <= (1 + band) x F32 peak (the interval's upper end)",
                                 signed_difference=a["relative_difference"],
                                 two_sided_passed=abs(a["relative_difference"]) <= band)
    growth = {p: [runs[p][s]["vram_growth"] for s in seeds] for p in runs}
    if None not in growth["f32"] + growth["bf16"]:
        worst = max(growth["f32"] + growth["bf16"])
        passed = worst <= VRAM_GROWTH_BAND
        figures["vram_growth"] = dict(band=VRAM_GROWTH_BAND, compared="every run: peak at the end vs after epoch 1",
                                      verdict="pass" if passed else "fail",
                                      bf16=max(growth["bf16"]), f32=max(growth["f32"]), relative_difference=worst,
                                      passed=passed, f32_control_spread=None,
                                      f32_per_seed=growth["f32"], bf16_per_seed=growth["bf16"])
    return figures, overall_verdict(figures, True) == "pass"


def overall_verdict(figures: dict, no_nan: bool) -> str:
    verdicts = [f["verdict"] for f in figures.values() if f["verdict"] != "not measured"]
    if not no_nan or "fail" in verdicts:
        return "fail"
    return "inconclusive" if "inconclusive" in verdicts else "pass"


def analyse(runs: dict, seeds: list, meta: dict, confidence: float = CONFIDENCE) -> dict:
    """The result file's contents from the runs' per-seed figures."""
    figures, _ = compare(runs, seeds, confidence)
    no_nan = not any(runs[p][s]["non_finite"] for p in runs for s in seeds)
    verdict = overall_verdict(figures, no_nan)
    return {"pass": verdict == "pass", "verdict": verdict, "no_nan_or_inf": no_nan, "figures": figures,
            "runs": runs, "meta": meta}


def _pct(x) -> str:
    return "n/a" if x is None else "inf" if math.isinf(x) else f"{x:+.1%}"


def write_result(result: dict, stem: str) -> list:
    """Writes <stem>.json (strict JSON) and <stem>.md; returns the markdown's lines."""
    meta, figures = result["meta"], result["figures"]
    with open(stem + ".json", "w") as f:
        dump_json(result, f)
    seeds = meta["seeds"]
    analysis = meta.get("analysis", {})
    bf16_side = "PyTorch autocast" if "autocast" in meta.get("bf16_path", "") else "dqn_ops"
    lines = [f"# Convergence parity, BF16 ({bf16_side}) vs F32 (PyTorch) — {meta.get('gpu') or meta['device']}, "
             f"torch {meta['torch']}, {meta['date']}", "",
             f"{meta['epochs']} epochs x {meta['steps_per_epoch']} steps, B={meta['batch']}, seeds {seeds}, "
             f"{meta['jobs']} run(s) at a time{' (tiny network: a smoke test)' if meta.get('tiny_network') else ''}"
             f"{exploration_note(meta)}. "
             f"**verdict: {result['verdict']}** (pass: {result['pass']}; no NaN/Inf: {result['no_nan_or_inf']})", "",
             f"Each figure: the mean of the paired per-seed differences BF16 - F32 (same seed, same data), "
             f"relative to the F32 mean, with its {analysis.get('confidence', CONFIDENCE):.0%} t-interval over "
             f"{len(seeds)} seeds; pass if the interval lies inside the band, fail if outside, else inconclusive"
             f"{'; analysed ' + analysis['date'] if 'date' in analysis else ''}.", "",
             "| figure | band | BF16 mean | F32 mean | rel. diff | CI | verdict | seeds needed | F32 seed spread |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, f in figures.items():
        if f["passed"] is None:
            lines.append(f"| {name} | {f['band']:.0%} | | | | | {f['verdict']} | | |")
            continue
        if name == "vram_growth":  # growth of each path's worst run, not a BF16-vs-F32 difference
            lines.append(f"| {name} | {f['band']:.0%} | {f['bf16']:+.1%} | {f['f32']:+.1%} | worst run "
                         f"{f['relative_difference']:+.1%} | | {f['verdict']} | | |")
            continue
        ci = f"[{_pct(f['ci_low'])}, {_pct(f['ci_high'])}]"
        if name == "peak_vram_bytes":
            ci += " (one-sided)"
        needed = f["seeds_needed"] if f["seeds_needed"] is not None else f"> {MAX_SEEDS_NEEDED} or never"
        lines.append(f"| {name} | {f['band']:.0%} | {f['bf16']:.4g} | {f['f32']:.4g} | "
                     f"{_pct(f['relative_difference'])} | {ci} | {f['verdict']} | {needed} | "
                     f"{f['f32_control_spread']:.1%} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


ANALYSIS_METHOD = ("paired per-seed differences BF16 - F32 relative to |mean F32|, Student-t interval of their "
                   "mean; pass inside the band, fail outside, else inconclusive")

# What every merged file must agree on: the runs are one experiment's only if they trained alike
# (a key absent from a file, as in files written before it was recorded, agrees only with absent).
MERGE_KEYS = ("epochs", "steps_per_epoch", "batch", "device", "tiny_network", "train_args", "torch_exploration",
              "f32_path", "bf16_path", "switches")


def _load_runs(path: str) -> tuple[dict, dict, dict]:
    """A result file's contents, its meta and the runs of its seeds (meta["seeds"]) keyed by int
    seed, every seed present."""
    with open(path) as f:
        old = json.load(f)
    meta = dict(old["meta"])
    absent = [k for k in ("seeds", "device", "torch", "date") if k not in meta]
    if absent:
        raise SystemExit(f"parity.py: {path} is not a parity result file: its meta has no {absent}")
    runs = {p: {int(s): r for s, r in old["runs"][p].items() if int(s) in meta["seeds"]} for p in ("f32", "bf16")}
    missing = [(p, s) for p in runs for s in meta["seeds"] if s not in runs[p]]
    if missing:
        raise SystemExit(f"parity.py: {path} has no per-seed figures for {missing}")
    return old, meta, runs


def reanalyze(path: str, confidence: float = CONFIDENCE) -> tuple[dict, list]:
    """Re-analyses an existing result file from its runs' per-seed numbers (no training): keeps
    its runs and meta, adds meta["analysis"] (date, method) and rewrites it and its .md."""
    old, meta, runs = _load_runs(path)
    meta["analysis"] = dict(date=datetime.date.today().isoformat(), confidence=confidence, method=ANALYSIS_METHOD,
                            original=dict(passed=old.get("pass"),
                                          compared=sorted({f.get("compared", "") for f in old["figures"].values()})))
    result = analyse(runs, list(meta["seeds"]), meta, confidence)
    stem = path[:-len(".json")] if path.endswith(".json") else path
    return result, write_result(result, stem)


def merge(paths: list, stem: str, confidence: float = CONFIDENCE) -> tuple[dict, list]:
    """One analysis of the seeds of several result files (waves of seeds run in separate calls,
    e.g. a device's time limit): they must have trained alike (MERGE_KEYS) on disjoint seeds.
    Writes <stem>.json / .md; meta["parts"] keeps each file's seeds, GPU, torch and date."""
    parts = [(p, *_load_runs(p)[1:]) for p in paths]
    first = parts[0][1]
    for path, meta, _ in parts[1:]:
        differ = [k for k in MERGE_KEYS if meta.get(k) != first.get(k)]
        if differ:
            raise SystemExit(f"parity.py --merge: {path} differs from {parts[0][0]} in {differ}: not one experiment")
    seeds = [s for _, meta, _ in parts for s in meta["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"parity.py --merge: a seed is in more than one file: {sorted(seeds)}")
    runs = {p: {s: r for _, _, part in parts for s, r in part[p].items()} for p in ("f32", "bf16")}
    gpus = sorted({meta.get("gpu") or meta["device"] for _, meta, _ in parts})
    jobs = sorted({m["jobs"] for _, m, _ in parts if m.get("jobs") is not None})
    today = datetime.date.today().isoformat()
    meta = {k: first[k] for k in MERGE_KEYS if k in first}
    meta.update(seeds=sorted(seeds), gpu=" + ".join(gpus), torch=" + ".join(sorted({m["torch"] for _, m, _ in parts})),
                date=" .. ".join(sorted({m["date"] for _, m, _ in parts})),
                jobs=jobs[0] if len(jobs) == 1 else " / ".join(map(str, jobs)) or None,
                parts=[dict(file=os.path.basename(path), seeds=m["seeds"], gpu=m.get("gpu"), torch=m["torch"],
                            date=m["date"], jobs=m.get("jobs")) for path, m, _ in parts],
                **{k: first[k] for k in ("final_sharpe_definition", "vram_criterion") if k in first},
                analysis=dict(date=today, confidence=confidence, method=ANALYSIS_METHOD))
    result = analyse(runs, meta["seeds"], meta, confidence)
    return result, write_result(result, stem)


def exploration_note(meta: dict) -> str:
    """The plain-PyTorch runs' exploration draws, as the .md's header says them (older files: not recorded)."""
    mode = meta.get("torch_exploration", "unrecorded")
    if mode == "philox":
        return "; plain PyTorch explores with dqn_ops's Philox draws (paired exploration)"
    if mode == "torch":
        return "; plain PyTorch explores with torch.rand (each path its own exploration stream)"
    return "" if mode is None else "; exploration draws not recorded (before parity.py recorded them: separate streams)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(DEFAULT_SEEDS)),
                    help=f"seeds, each run on both paths (default 0..{DEFAULT_SEEDS - 1}: see DEFAULT_SEEDS)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "bench", "results"))
    ap.add_argument("--runs", default="runs/parity")
    ap.add_argument("--jobs", type=int, default=6, help="training processes at once (default 6)")
    ap.add_argument("--steps", type=int, default=300, help="training steps per epoch (the check: 300)")
    ap.add_argument("--tiny", action="store_true", help="train.py's small network (a smoke test of this script)")
    ap.add_argument("--confidence", type=float, default=CONFIDENCE,
                    help=f"confidence of the t-interval of the mean paired difference (default {CONFIDENCE})")
    ap.add_argument("--train-args", default="", help="options for every scripts/train.py run, e.g. "
                    "\"--prioritized --n-step 3\"")
    ap.add_argument("--name", default="parity", help="result file name (without .json)")
    ap.add_argument("--bf16-backend", choices=("dqn_ops", "torch-bf16"), default="dqn_ops",
                    help="the BF16 side: dqn_ops (the check) or plain PyTorch under autocast BF16 (separates what "
                         "BF16 itself does from what dqn_ops's kernels do)")
    ap.add_argument("--f32-backend", choices=("torch", "dqn_ops"), default="torch",
                    help="the F32 side: plain PyTorch (the check) or dqn_ops with nothing rounded (--mirror f32, "
                         "--device cpu only: BF16's own effect, the same formulas and random streams on both sides)")
    ap.add_argument("--torch-exploration", choices=("philox", "torch"), default="philox",
                    help="the plain-PyTorch runs' exploration draws: philox (dqn_ops's for the seed: common random "
                         "numbers, the check) or torch (torch.rand: each path its own stream)")
    ap.add_argument("--reanalyze", metavar="FILE",
                    help="re-analyse an existing result file from its per-seed figures (no training) and rewrite "
                         "it and its .md")
    ap.add_argument("--merge", metavar="FILE", nargs="+",
                    help="one analysis of the seeds of several result files (the same training on disjoint seeds, "
                         "run in separate calls), written as <out>/<name>.json and .md (no training)")
    args = ap.parse_args()
    if not 0 < args.confidence < 1:
        ap.error(f"--confidence: expected a number in (0, 1), got {args.confidence}")
    if args.reanalyze and args.merge:
        ap.error("--reanalyze and --merge: one at a time")
    if args.reanalyze or args.merge:
        if args.merge:
            os.makedirs(args.out, exist_ok=True)
            result, lines = merge(args.merge, os.path.join(args.out, args.name), args.confidence)
        else:
            result, lines = reanalyze(args.reanalyze, args.confidence)
        print("\n".join(lines))
        return
    if args.jobs < 1:
        ap.error(f"--jobs: expected at least 1, got {args.jobs}")
    if args.f32_backend == "dqn_ops" and args.device != "cpu":
        ap.error("--f32-backend dqn_ops: dqn_ops's unrounded path (an F32 mirror) runs on the CPU only: --device cpu")
    torch_side = ["--exploration", args.torch_exploration]
    backends = dict(f32=["--backend", "torch", *torch_side] if args.f32_backend == "torch"
                    else ["--backend", "dqn_ops", "--mirror", "f32"],
                    bf16=["--backend", args.bf16_backend] + (torch_side if args.bf16_backend == "torch-bf16" else []))

    def run(path: str, seed: int) -> dict:
        # One process per run: peak VRAM and every other figure measured from a clean start.
        out = os.path.join(args.runs, f"{path}-seed{seed}")
        subprocess.run([sys.executable, TRAIN, *backends[path], "--epochs", str(args.epochs), "--seed",
                        str(seed), "--steps", str(args.steps), "--device", args.device, "--quiet", "--out", out]
                       + (["--tiny"] if args.tiny else []) + shlex.split(args.train_args), check=True,
                       stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
        r = {k: s[v] for k, v in FIGURE_KEYS.items()}
        first = s["peak_vram_first_epoch_bytes"]
        r.update(vram_growth=None if first is None else (s["peak_vram_bytes"] - first) / first)
        r.update(non_finite=s["non_finite"], epoch_seconds_median=s["epoch_seconds_median"],
                 env_steps_per_second_median=s["env_steps_per_second_median"])
        print(f"{path} seed {seed}: " + ", ".join(f"{k}={_fmt(r[k])}" for k in FIGURE_KEYS), flush=True)
        return r

    jobs = [(path, seed) for seed in args.seeds for path in ("f32", "bf16")]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda j: run(*j), jobs))
    runs = {"f32": {}, "bf16": {}}
    for (path, seed), r in zip(jobs, results):
        runs[path][seed] = r

    seeds = args.seeds
    today = datetime.date.today().isoformat()
    meta = dict(epochs=args.epochs, steps_per_epoch=args.steps, batch=256, seeds=seeds,
                device=args.device, jobs=args.jobs, tiny_network=args.tiny, train_args=args.train_args,
                # the plain-PyTorch runs' exploration draws (None: no plain-PyTorch run)
                torch_exploration=(args.torch_exploration
                                   if args.f32_backend == "torch" or args.bf16_backend == "torch-bf16" else None),
                gpu=torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
                # dqn_ops's code-path switches, as the training processes inherit them
                switches=code_path_switches() if args.device.startswith("cuda") else None,
                torch=torch.__version__, date=today,
                final_sharpe_definition="mean of the last 5 epochs' held-out evaluations",
                vram_criterion="the spec's 'zero regression: no memory leaks (same peak VRAM +/- 10%)': "
                               "BF16 peak at most 10% above F32's (one-sided), and every run's peak "
                               "at the end within 10% of its peak after epoch 1",
                f32_path="dqn_ops.rl.baseline.TorchTrainer (plain PyTorch, F32, TF32 off)" if args.f32_backend == "torch"
                else "dqn_ops.Trainer with an F32 mirror (TrainerConfig(mirror='f32'): the same kernels, nothing rounded)",
                bf16_path="dqn_ops.Trainer (BF16 forward, bf16 backward, CUDA graph)" if args.bf16_backend == "dqn_ops"
                else "dqn_ops.rl.baseline.TorchTrainer under torch.autocast(bfloat16)",
                analysis=dict(date=today, confidence=args.confidence, method=ANALYSIS_METHOD))
    result = analyse(runs, seeds, meta, args.confidence)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name)
    lines = write_result(result, stem)
    print("\n".join(lines))
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
