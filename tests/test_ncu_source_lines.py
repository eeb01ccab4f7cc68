"""scripts/ncu_source_lines.py on a small CSV in the layout of Nsight Compute's source page
(--page source --csv --print-source cuda,sass): SASS rows add up under the source line above
them, per file; counters that do not apply ("-") count 0."""
import gzip
import os
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
])


def test_sass_rows_add_up_under_their_source_line(tmp_path):
    path = tmp_path / "source.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(CSV + "\n")
    lines, stalls = per_line(str(path))
    assert lines[("loss.cu", 10)][:4] == [200, 6, 4, 0]
    assert lines[("loss.cu", 11)][:4] == [50, 7, 0, 7]
    assert lines[("reductions.cuh", 10)][:4] == [300, 2, 0, 0]  # same line number, another file
    assert lines[("loss.cu", 10)][4] == "a = b[i];"
    assert stalls == {"long_sb": 4, "barrier": 7, "wait": 4}  # the "(Not Issued)" columns are not added
