"""scripts/lockstep.py on the CPU: dqn_ops unrounded and plain PyTorch F32 step alike on the same
batches; with the BF16 mirror the figures part in the fourth digit or before."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from lockstep import main  # noqa: E402


@pytest.mark.parametrize("mirror", ["f32", "bf16"])
def test_lockstep_steps_alike_unrounded_and_apart_in_bf16(mirror, tmp_path, capsys):
    out = tmp_path / "rows.json"
    rows = main(["--device", "cpu", "--tiny", "--loss-type", "qr", "--ours-mirror", mirror, "--steps", "4",
                 "--env-steps", "40", "--batch", "32", "--max-grad-norm", "0.05", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    assert len(rows) == 4 and "max|dp|" in capsys.readouterr().out
    worst = max(abs(a - b) / abs(b) for row in rows for a, b in (row["loss"], row["grad_norm"]))
    if mirror == "f32":
        assert worst < 1e-5, rows
    else:
        assert worst > 1e-5, rows


def test_lockstep_refuses_an_unrounded_side_off_the_cpu():
    with pytest.raises(SystemExit):
        main(["--device", "cuda", "--ours-mirror", "f32"])
