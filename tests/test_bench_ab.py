"""scripts/bench_ab.py's bookkeeping on the CPU (its timings need a GPU: each is a child process
on CUDA, replaced here by a stand-in): rows per network and batch, alternating order, the files
rewritten after every row so that a run cut short keeps what it finished."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def bench_ab(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    import bench_ab
    return bench_ab


def run(bench_ab, monkeypatch, tmp_path, fail_after=None):
    calls = []

    def fake_time_tree(tree, B, iters, repeats, network, extra_env=None, unset=()):
        if fail_after is not None and len(calls) == fail_after:
            raise RuntimeError("the device call's limit")
        calls.append((os.path.abspath(tree), B, network, dict(extra_env)))
        new = os.path.abspath(tree) == ROOT
        return (80.0 if new else 100.0) + B / 100 + (len(calls) % 3), new  # new faster, a little noise

    monkeypatch.setattr(bench_ab, "time_tree", fake_time_tree)
    monkeypatch.setattr(sys, "argv", ["bench_ab.py", "--base", str(tmp_path), "--new-env", "DQN_OPS_SIDE_STREAM=1",
                                      "--networks", "reference", "cleanrl_c51", "--batches", "256", "4096",
                                      "--rounds", "3", "--out", str(tmp_path / "out"), "--name", "ab"])
    return calls


def test_rows_per_network_and_batch_in_one_file(bench_ab, monkeypatch, tmp_path):
    calls = run(bench_ab, monkeypatch, tmp_path)
    bench_ab.main()
    result = json.loads((tmp_path / "out" / "ab.json").read_text())
    assert [(r["network"], r["batch"]) for r in result["rows"]] == [
        ("reference", 256), ("reference", 4096), ("cleanrl_c51", 256), ("cleanrl_c51", 4096)]
    for r in result["rows"]:
        assert len(r["base_all"]) == len(r["new_all"]) == 3
        assert r["ratio"] == pytest.approx(r["new_us"] / r["base_us"], abs=1e-4) and r["ratio"] < 1
        assert r["side_streams"] == {"base": False, "new": True}  # as each side's processes said
    assert result["meta"]["networks"] == ["reference", "cleanrl_c51"]
    assert result["meta"]["new_env"] == {"DQN_OPS_SIDE_STREAM": "1"} and result["meta"]["base_env"] == {}
    # alternating: round 0 base first, round 1 new first; the new side alone gets its switch
    first = calls[:4]
    assert [c[0] == ROOT for c in first] == [False, True, True, False]
    assert all(c[3] == ({"DQN_OPS_SIDE_STREAM": "1"} if c[0] == ROOT else {}) for c in calls)
    md = (tmp_path / "out" / "ab.md").read_text()
    assert "| cleanrl_c51 | 4096 |" in md and "| off / on |" in md and "Unfinished" not in md


def test_a_run_cut_short_keeps_its_finished_rows(bench_ab, monkeypatch, tmp_path):
    run(bench_ab, monkeypatch, tmp_path, fail_after=6 * 2 + 1)  # two rows of 6 timings, then the cut
    with pytest.raises(RuntimeError, match="limit"):
        bench_ab.main()
    result = json.loads((tmp_path / "out" / "ab.json").read_text())
    assert [(r["network"], r["batch"]) for r in result["rows"]] == [("reference", 256), ("reference", 4096)]
    assert "Unfinished: 2 of 4 rows." in (tmp_path / "out" / "ab.md").read_text()


def test_an_unknown_network_is_refused(bench_ab, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["bench_ab.py", "--base", str(tmp_path), "--networks", "reference", "nope"])
    with pytest.raises(SystemExit):
        bench_ab.main()
