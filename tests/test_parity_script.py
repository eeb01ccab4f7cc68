"""scripts/parity.py's own logic on the CPU (the real check is tests/test_parity.py, GPU, slow):
two seeds x two paths as concurrent processes, a tiny network and a few steps, and the result
file it writes."""
import json
import os
import subprocess
import sys

import pytest

from conftest import loads_strict_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from parity import compare, merge, paired_analysis, reanalyze, t_quantile  # noqa: E402


def test_parity_script_runs_concurrent_jobs_and_writes_its_result(tmp_path):
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "parity.py"), "--epochs", "1", "--steps", "4",
                    "--tiny", "--device", "cpu", "--seeds", "0", "1", "--jobs", "4", "--out", str(tmp_path / "out"),
                    "--runs", str(tmp_path / "runs"), "--train-args", "--prioritized --n-step 2", "--name",
                    "parity-prioritized"], check=True, cwd=ROOT, capture_output=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["parity-prioritized.json", "parity-prioritized.md"]
    result_file = tmp_path / "out" / "parity-prioritized.json"
    result = loads_strict_json(result_file.read_text())
    assert isinstance(result["pass"], bool) and result["verdict"] in ("pass", "fail", "inconclusive")
    assert result["pass"] == (result["verdict"] == "pass")
    assert result["meta"]["jobs"] == 4 and result["meta"]["seeds"] == [0, 1] and result["meta"]["tiny_network"]
    assert result["meta"]["train_args"] == "--prioritized --n-step 2"
    assert result["meta"]["torch_exploration"] == "philox"
    assert set(result["runs"]) == {"f32", "bf16"}
    for path, backend in (("f32", "torch"), ("bf16", "dqn_ops")):
        # each run's own summary, keyed by its seed (the jobs finish in any order)
        for seed in (0, 1):
            summary = loads_strict_json((tmp_path / "runs" / f"{path}-seed{seed}" / "summary.json").read_text())
            assert summary["seed"] == seed and summary["backend"] == backend
            assert summary["prioritized"] and summary["n_step"] == 2  # --train-args reached every run
            assert summary["exploration"] == "philox"  # both paths explore with the seed's Philox draws
            assert result["runs"][path][str(seed)]["mean_q"] == summary["mean_q"]
    figures = result["figures"]
    assert figures["peak_vram_bytes"]["passed"] is None  # no VRAM on the CPU: not compared
    compared = [f for f in figures.values() if f["passed"] is not None]
    assert len(compared) == 4
    assert result["pass"] == (all(f["passed"] for f in compared) and result["no_nan_or_inf"])
    for f in compared:  # two seeds: a t-interval with 1 degree of freedom
        assert f["n_seeds"] == 2 and f["ci_low"] <= f["relative_difference"] <= f["ci_high"]
        inside = -f["band"] <= f["ci_low"] and f["ci_high"] <= f["band"]
        assert f["passed"] == inside and f["verdict"] in ("pass", "fail", "inconclusive")
    assert result["meta"]["analysis"]["confidence"] == 0.95


def test_parity_script_takes_dqn_ops_unrounded_as_its_f32_side(tmp_path):
    """--f32-backend dqn_ops: the F32 side is dqn_ops with an F32 mirror (CPU only)."""
    args = [sys.executable, os.path.join(ROOT, "scripts", "parity.py"), "--epochs", "1", "--steps", "4", "--tiny",
            "--seeds", "0", "--jobs", "2", "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs"),
            "--f32-backend", "dqn_ops"]
    subprocess.run(args + ["--device", "cpu"], check=True, cwd=ROOT, capture_output=True)
    result = loads_strict_json((tmp_path / "out" / "parity.json").read_text())
    assert "F32 mirror" in result["meta"]["f32_path"]
    assert result["meta"]["torch_exploration"] is None  # no plain-PyTorch run
    for path, mirror in (("f32", "f32"), ("bf16", "bf16")):
        summary = loads_strict_json((tmp_path / "runs" / f"{path}-seed0" / "summary.json").read_text())
        assert summary["backend"] == "dqn_ops" and summary["mirror"] == mirror
    refused = subprocess.run(args + ["--device", "cuda"], cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode == 2 and "runs on the CPU only" in refused.stderr


def test_parity_script_gives_plain_pytorch_its_own_exploration_on_request(tmp_path):
    """--torch-exploration torch: the plain-PyTorch runs draw with torch.rand, dqn_ops's with Philox."""
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "parity.py"), "--epochs", "1", "--steps", "4",
                    "--tiny", "--device", "cpu", "--seeds", "0", "--jobs", "2", "--out", str(tmp_path / "out"),
                    "--runs", str(tmp_path / "runs"), "--torch-exploration", "torch"], check=True, cwd=ROOT,
                   capture_output=True)
    assert loads_strict_json((tmp_path / "out" / "parity.json").read_text())["meta"]["torch_exploration"] == "torch"
    assert "plain PyTorch explores with torch.rand" in (tmp_path / "out" / "parity.md").read_text()
    for path, exploration in (("f32", "torch"), ("bf16", "philox")):
        summary = loads_strict_json((tmp_path / "runs" / f"{path}-seed0" / "summary.json").read_text())
        assert summary["exploration"] == exploration


def _synthetic_runs(bf16_vram: float, growth: float = 0.0) -> dict:
    """Two seeds per path, every figure equal between the paths except peak VRAM (F32: 100)."""
    def run(vram):
        return dict(final_sharpe=1.8, mean_q=1.5, grad_norm_mean=0.07, grad_norm_max=0.4, peak_vram_bytes=vram,
                    vram_growth=growth, non_finite=False)
    return {"f32": {0: run(100.0), 1: run(100.0)}, "bf16": {0: run(bf16_vram), 1: run(bf16_vram)}}


def test_peak_vram_is_a_one_sided_regression_check_plus_a_leak_check():
    figures, ok = compare(_synthetic_runs(bf16_vram=80.0), [0, 1])  # BF16 uses 20% less: not a regression
    vram = figures["peak_vram_bytes"]
    assert ok and vram["passed"] and not vram["two_sided_passed"]
    assert abs(vram["signed_difference"] + 0.20) < 1e-12
    assert figures["vram_growth"]["passed"]

    figures, ok = compare(_synthetic_runs(bf16_vram=111.0), [0, 1])  # 11% more: fails
    assert not ok and not figures["peak_vram_bytes"]["passed"]

    figures, ok = compare(_synthetic_runs(bf16_vram=100.0, growth=0.11), [0, 1])  # peak grew 11% over the run
    assert not ok and not figures["vram_growth"]["passed"] and figures["peak_vram_bytes"]["passed"]


def test_t_quantiles():
    for p, df, t in [(0.975, 1, 12.7062), (0.975, 5, 2.5706), (0.975, 30, 2.0423), (0.95, 10, 1.8125)]:
        assert abs(t_quantile(p, df) - t) < 1e-3


def _noisy(n, mean_f32, sd_seed, rel_diff, sd_pair, seed):
    """n seeds: F32 figures spread `sd_seed` (relative) around mean_f32; BF16 = F32 + rel_diff x
    mean_f32 plus pair noise of `sd_pair` (both relative to the mean)."""
    import random
    rng = random.Random(seed)
    f32 = [mean_f32 * (1 + rng.gauss(0, sd_seed)) for _ in range(n)]
    bf16 = [x + mean_f32 * (rel_diff + rng.gauss(0, sd_pair)) for x in f32]
    return f32, bf16


def test_paired_analysis_detects_a_known_difference():
    # BF16 12% above F32 on every seed, seed-to-seed spread 100% of the mean (as the real Sharpe),
    # pair noise 2%: the paired interval sits outside the 5% band -> fail.
    f32, bf16 = _noisy(8, 1.5, 1.0, 0.12, 0.02, seed=1)
    a = paired_analysis(f32, bf16, band=0.05)
    assert a["verdict"] == "fail" and a["ci_low"] > 0.05
    assert abs(a["relative_difference"] - 0.12) < 0.05


def test_paired_analysis_passes_a_null_difference_with_enough_seeds():
    # No difference, pair noise 3% of the mean: 20 seeds give an interval of about +-1.4%, inside 5%,
    # even though the seeds themselves spread 100% (the unpaired seed means could not tell).
    f32, bf16 = _noisy(20, 1.5, 1.0, 0.0, 0.03, seed=2)
    a = paired_analysis(f32, bf16, band=0.05)
    assert a["verdict"] == "pass" and -0.05 <= a["ci_low"] and a["ci_high"] <= 0.05
    assert a["seeds_needed"] is not None and a["seeds_needed"] <= 20


def test_paired_analysis_reports_a_noisy_small_sample_inconclusive():
    # 3 seeds, pair noise 10% of the mean: the interval is far wider than the band -> neither pass
    # nor fail; the number of seeds the observed spread would need is given.
    f32, bf16 = _noisy(3, 1.5, 1.0, 0.0, 0.10, seed=3)
    a = paired_analysis(f32, bf16, band=0.05)
    assert a["verdict"] == "inconclusive" and (a["ci_low"] < -0.05 or a["ci_high"] > 0.05)
    assert a["seeds_needed"] is None or a["seeds_needed"] > 3
    one = paired_analysis(f32[:1], bf16[:1], band=0.05)  # one seed: no interval at all
    assert one["verdict"] == "inconclusive" and one["sd_of_differences"] is None


def test_a_wide_seed_spread_no_longer_passes_on_seed_means():
    runs = _synthetic_runs(bf16_vram=100.0)
    runs["f32"][0]["mean_q"], runs["f32"][1]["mean_q"] = 1.0, 2.0  # control spread 33% > 10%
    runs["bf16"][0]["mean_q"], runs["bf16"][1]["mean_q"] = 2.0, 1.1  # seed means 3.3% apart, pairs +100%, -45%
    figures, ok = compare(runs, [0, 1])
    assert figures["mean_q"]["verdict"] == "inconclusive" and not figures["mean_q"]["passed"] and not ok
    assert figures["mean_q"]["compared"].startswith("paired per-seed differences")


def test_reanalyze_rewrites_a_result_file_from_its_per_seed_numbers(tmp_path):
    import shutil
    src = os.path.join(ROOT, "bench", "results", "parity.json")
    path = tmp_path / "parity.json"
    shutil.copy(src, path)
    original = json.loads(open(src).read())
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "parity.py"), "--reanalyze", str(path)],
                   check=True, cwd=ROOT, capture_output=True)
    result = loads_strict_json(path.read_text())
    assert result["runs"] == original["runs"]  # the runs' raw per-seed numbers kept
    for k in ("device", "torch", "date", "gpu", "seeds", "epochs"):
        assert result["meta"][k] == original["meta"][k]
    assert "date" in result["meta"]["analysis"]
    for name in ("final_sharpe", "mean_q", "grad_norm_mean", "grad_norm_max"):
        f = result["figures"][name]
        assert f["n_seeds"] == len(original["meta"]["seeds"]) and f["verdict"] in ("pass", "fail", "inconclusive")
        assert f["f32_per_seed"] == original["figures"][name]["f32_per_seed"]
    md = (tmp_path / "parity.md").read_text()
    assert f"verdict: {result['verdict']}" in md and "seeds needed" in md
    # reanalysing again gives the same figures (idempotent)
    reanalyze(str(path))
    assert loads_strict_json(path.read_text())["figures"] == result["figures"]


def _split(result: dict, seeds: list, path, **meta) -> str:
    """A result file holding `seeds` of `result` alone (one wave of a run split across calls)."""
    part = json.loads(json.dumps(result))
    part["meta"].update(seeds=seeds, **meta)
    part["runs"] = {p: {str(s): r for s, r in part["runs"][p].items() if int(s) in seeds} for p in part["runs"]}
    path.write_text(json.dumps(part))
    return str(path)


def test_merge_analyses_waves_of_seeds_as_one_run(tmp_path):
    src = os.path.join(ROOT, "bench", "results", "parity.json")
    whole = json.loads(open(src).read())
    seeds = whole["meta"]["seeds"]
    a = _split(whole, seeds[:2], tmp_path / "a.json", gpu="GPU A", date="2026-01-01")
    b = _split(whole, seeds[2:], tmp_path / "b.json", gpu="GPU B", date="2026-01-02")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "parity.py"), "--merge", b, a, "--out",
                    str(tmp_path / "out"), "--name", "merged"], check=True, cwd=ROOT, capture_output=True)
    merged = loads_strict_json((tmp_path / "out" / "merged.json").read_text())
    reanalyzed = tmp_path / "whole.json"
    reanalyzed.write_text(json.dumps(whole))
    reanalyze(str(reanalyzed))
    assert merged["figures"] == loads_strict_json(reanalyzed.read_text())["figures"]  # one analysis of all seeds
    assert merged["meta"]["seeds"] == sorted(seeds) and merged["runs"] == whole["runs"]
    assert merged["meta"]["gpu"] == "GPU A + GPU B" and merged["meta"]["date"] == "2026-01-01 .. 2026-01-02"
    assert [p["seeds"] for p in merged["meta"]["parts"]] == [seeds[2:], seeds[:2]]
    md = (tmp_path / "out" / "merged.md").read_text().splitlines()
    assert md[0].startswith("# Convergence parity") and "GPU A + GPU B" in md[0] and "2026-01-01 .. 2026-01-02" in md[0]
    assert f"seeds {sorted(seeds)}, {whole['meta']['jobs']} run(s) at a time" in md[2]
    assert merged["meta"]["jobs"] == whole["meta"]["jobs"]  # one number where the parts agree


def test_merge_refuses_runs_that_trained_differently_or_share_a_seed(tmp_path):
    whole = json.loads(open(os.path.join(ROOT, "bench", "results", "parity.json")).read())
    seeds = whole["meta"]["seeds"]
    a = _split(whole, seeds[:3], tmp_path / "a.json")
    other = _split(whole, seeds[3:], tmp_path / "b.json", train_args="--n-step 3")
    with pytest.raises(SystemExit, match="differs .* in \\['train_args'\\]"):
        merge([a, other], str(tmp_path / "m"))
    overlapping = _split(whole, seeds[2:], tmp_path / "c.json")
    with pytest.raises(SystemExit, match="a seed is in more than one file"):
        merge([a, overlapping], str(tmp_path / "m"))
    switched = _split(whole, seeds[3:], tmp_path / "d.json", switches=dict(side_streams=True, pdl=True))
    with pytest.raises(SystemExit, match="differs .* in \\['switches'\\]"):  # recorded in one, not the other
        merge([a, switched], str(tmp_path / "m"))


def test_merge_takes_only_the_runs_of_each_files_seeds(tmp_path):
    """A run left in a file beside its seeds (a seed dropped from meta) must not replace another
    file's run of that seed."""
    whole = json.loads(open(os.path.join(ROOT, "bench", "results", "parity.json")).read())
    seeds = whole["meta"]["seeds"]
    a = _split(whole, seeds[:3], tmp_path / "a.json")
    b = json.loads(json.dumps(whole))
    b["meta"]["seeds"] = seeds[3:]
    for p in b["runs"]:
        b["runs"][p][str(seeds[0])] = dict(b["runs"][p][str(seeds[0])], final_sharpe=-99.0)  # a stale run
    (tmp_path / "b.json").write_text(json.dumps(b))
    result, _ = merge([a, str(tmp_path / "b.json")], str(tmp_path / "m"))
    assert result["runs"]["f32"][seeds[0]]["final_sharpe"] == whole["runs"]["f32"][str(seeds[0])]["final_sharpe"]

