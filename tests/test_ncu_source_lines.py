"""scripts/ncu_source_lines.py on a small CSV in the layout of Nsight Compute's source page
(--page source --csv --print-source cuda,sass): SASS rows add up under the source line above
them, per file; counters that do not apply ("-") count 0."""
import gzip
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from ncu_source_lines import per_line  # noqa: E402

HEADER = ('"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_long_sb","stall_barrier","stall_wait","stall_long_sb (Not Issued)"')
CSV = "\n".join([
    '"File Path","/x/loss.cu"',
    '"Function Name","k"',
    HEADER,
    '"10","a = b[i];","-","-","0","0","0","0","0","0"',
    '"","","0x1","LDG R1","5","100","4","0","1","9"',
    '"","","0x2","FADD R2","1","100","-","0","1","9"',
    '"11","__syncthreads();","-","-","0","0","0","0","0","0"',
    '"","","0x3","BAR","7","50","0","7","0","0"',
    '"File Path","/y/reductions.cuh"',
    '"Function Name","k"',
    HEADER,
    '"10","x += shfl(x);","-","-","0","0","0","0","0","0"',
    '"","","0x4","SHFL","2","300","0","0","2","0"',
    '"12","inline_helper();","-","-","0","0","0","0","0","0"',
    '"","","0x3","BAR","7","50","0","7","0","0"',  # 0x3 again: inlined here, counted once in the totals
])


def test_sass_rows_add_up_under_their_source_line(tmp_path):
    path = tmp_path / "source.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(CSV + "\n")
    lines, stalls, totals = per_line(str(path))
    assert lines[("loss.cu", 10)][:4] == [200, 6, 4, 0]
    assert lines[("loss.cu", 11)][:4] == [50, 7, 0, 7]
    assert lines[("reductions.cuh", 10)][:4] == [300, 2, 0, 0]  # same line number, another file
    assert lines[("reductions.cuh", 12)][:4] == [50, 7, 0, 7]  # an inlined line lists its rows too
    assert lines[("loss.cu", 10)][4] == "a = b[i];"
    assert stalls == {"long_sb": 4, "barrier": 7, "wait": 4}  # the "(Not Issued)" columns are not added
    assert totals == {"instructions": 550, "samples": 15}  # each address once


def test_instructions_read_per_warp_only_when_the_launch_warps_are_given(tmp_path):
    path = tmp_path / "source.csv"
    path.write_text(CSV + "\n")
    script = os.path.join(ROOT, "scripts", "ncu_source_lines.py")
    total = subprocess.run([sys.executable, script, str(path)], capture_output=True, text=True, check=True).stdout
    assert "instructions 550 (the launch's total)" in total and "instr/warp" not in total
    assert "       300.0        2" in total  # the SHFL line's instructions, not divided
    per_warp = subprocess.run([sys.executable, script, str(path), "--warps", "4"], capture_output=True, text=True,
                              check=True).stdout
    assert "instructions 550 (138 per warp over 4 warps)" in per_warp and "instr/warp" in per_warp
    assert "        75.0        2" in per_warp
