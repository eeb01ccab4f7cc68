"""scripts/parity.py's own logic on the CPU (the real check is tests/test_parity.py, GPU, slow):
two seeds x two paths as concurrent processes, a tiny network and a few steps, and the result
file it writes."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from parity import compare  # noqa: E402


def test_parity_script_runs_concurrent_jobs_and_writes_its_result(tmp_path):
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "parity.py"), "--epochs", "1", "--steps", "4",
                    "--tiny", "--device", "cpu", "--seeds", "0", "1", "--jobs", "4", "--out", str(tmp_path / "out"),
                    "--runs", str(tmp_path / "runs")], check=True, cwd=ROOT, capture_output=True)
    [result_file] = [p for p in (tmp_path / "out").iterdir() if p.name.endswith("-parity.json")]
    result = json.loads(result_file.read_text())
    assert isinstance(result["pass"], bool)
    assert result["meta"]["jobs"] == 4 and result["meta"]["seeds"] == [0, 1] and result["meta"]["tiny_network"]
    assert set(result["runs"]) == {"f32", "bf16"}
    for path, backend in (("f32", "torch"), ("bf16", "dqn_ops")):
        # each run's own summary, keyed by its seed (the jobs finish in any order)
        for seed in (0, 1):
            summary = json.loads((tmp_path / "runs" / f"{path}-seed{seed}" / "summary.json").read_text())
            assert summary["seed"] == seed and summary["backend"] == backend
            assert result["runs"][path][str(seed)]["mean_q"] == summary["mean_q"]
    figures = result["figures"]
    assert figures["peak_vram_bytes"]["passed"] is None  # no VRAM on the CPU: not compared
    compared = [f for f in figures.values() if f["passed"] is not None]
    assert len(compared) == 4
    assert result["pass"] == (all(f["passed"] for f in compared) and result["no_nan_or_inf"])
    for f in compared:
        assert f["passed"] == (f["relative_difference"] <= f["band"])


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


def test_figures_with_a_wide_seed_spread_are_compared_on_seed_means():
    runs = _synthetic_runs(bf16_vram=100.0)
    runs["f32"][0]["mean_q"], runs["f32"][1]["mean_q"] = 1.0, 2.0  # control spread 33% > 10%
    runs["bf16"][0]["mean_q"], runs["bf16"][1]["mean_q"] = 2.0, 1.1  # seed 0 differs 100%, the means 3.3%
    figures, ok = compare(runs, [0, 1])
    assert figures["mean_q"]["compared"].startswith("mean over seeds") and figures["mean_q"]["passed"] and ok
    runs["bf16"][1]["mean_q"] = 0.5  # means 1.25 vs 1.5: 16.7% apart
    figures, ok = compare(runs, [0, 1])
    assert not figures["mean_q"]["passed"] and not ok
