"""Result files as strict JSON (null, not NaN) and no GPU-only figures on a CPU run
(scripts/train.py; scripts/parity.py's file: tests/test_parity_script.py)."""
import io
import math
import os
import sys

import pytest

from conftest import loads_strict_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from dqn_ops.rl import results  # noqa: E402
from dqn_ops.rl.results import dumps_json, strict_json  # noqa: E402


def test_strict_json_maps_every_non_finite_float_to_null():
    obj = dict(a=float("nan"), b=[1.0, float("inf"), (-math.inf, 2)], c=dict(d=float("nan"), e="NaN"), f=3)
    assert strict_json(obj) == dict(a=None, b=[1.0, None, [None, 2]], c=dict(d=None, e="NaN"), f=3)
    text = dumps_json(obj)
    assert "NaN" not in text.replace('"NaN"', "") and "Infinity" not in text
    assert loads_strict_json(text)["b"] == [1.0, None, [None, 2]]


def test_dump_json_refuses_what_strict_json_would_let_through(monkeypatch):
    """allow_nan=False is the net behind strict_json: with the mapping gone, a NaN is an error,
    never a NaN token in the file."""
    monkeypatch.setattr(results, "strict_json", lambda obj: obj)
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        results.dumps_json({"x": float("nan")})
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        results.dump_json({"x": [1.0, float("inf")]}, io.StringIO())


def test_train_writes_strict_json_and_prints_wall_clock_on_the_cpu(tmp_path, monkeypatch, capsys):
    import train
    real_evaluate = train.evaluate

    def nan_sharpe(policy, n, device):  # a non-finite figure, as a degenerate evaluation gives
        out = real_evaluate(policy, n, device=device)
        return dict(out, sharpe=float("nan"))

    monkeypatch.setattr(train, "evaluate", nan_sharpe)
    args = train.parse_args(["--device", "cpu", "--tiny", "--epochs", "2", "--steps", "3", "--batch", "16",
                             "--num-envs", "8", "--eval-envs", "4", "--quiet", "--out", str(tmp_path)])
    args.quiet = False  # print the epoch lines
    summary = train.train(args)
    printed = capsys.readouterr().out
    text = (tmp_path / "summary.json").read_text()
    s = loads_strict_json(text)  # no NaN / Infinity tokens
    assert s["final_sharpe"] is None and s["final_sharpe_mean_last5"] is None
    assert s["baseline_sharpe"] == {"random": None, "flat": None}
    assert s["env_steps_per_second_median"] > 0 and s["loop"] == "eager"
    assert summary["seed"] == s["seed"]
    assert "env steps/s" in printed
    assert "nan" not in (tmp_path / "metrics.csv").read_text().lower()
