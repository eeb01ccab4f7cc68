"""scripts/parity.py's own logic on the CPU (the real check is tests/test_parity.py, GPU, slow):
two seeds x two paths as concurrent processes, a tiny network and a few steps, and the result
file it writes."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
