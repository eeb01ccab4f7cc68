#!/usr/bin/env python3
"""Instructions and stall samples of one kernel per source line, from Nsight Compute's source
page: what bench/NOTES.md's per-line figures of the fused loss come from.

    ncu --set full --import-source yes -o loss --kernel-name regex:dqn_loss python3 scripts/ncu_driver.py --batch 4096
    ncu -i loss.ncu-rep --page source --csv --print-source cuda,sass > loss.csv
    python3 scripts/ncu_source_lines.py loss.csv --warps 12288      # or loss.csv.gz

--warps divides the instruction counts (the launch's warps: grid x block / 32) so they read per
warp. Prints the stall reasons over the whole kernel, then the source lines by instructions
executed and by stall samples.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip


def _int(x: str) -> int:
    try:
        return int(x)
    except ValueError:  # "-" or "" where a counter does not apply
        return 0


def per_line(path: str):
    """{(file, line): [instructions, samples, long_scoreboard, barrier, source]}, {stall: samples},
    {"instructions": n, "samples": n}. The source page lists a SASS row under the line of each
    function inlined at it (a cluster barrier under cooperative_groups.h and helpers.h alike): it
    counts in each such line's entry, and once, by its address, in the stalls and the totals."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    lines = collections.defaultdict(lambda: [0, 0, 0, 0, ""])
    stalls, totals, seen = collections.Counter(), collections.Counter(), set()
    col, file, current = None, None, None
    for row in rows:
        if not row:
            continue
        if row[0] == "File Path":  # each source file's block starts with its path
            file = row[1].rsplit("/", 1)[-1]
        elif row[0] == "Line No":
            col = {name: i for i, name in enumerate(row)}
        elif row[0] == "Function Name" or col is None:
            continue
        elif row[0]:  # a source line; the SASS rows under it have an empty first column
            current = (file, int(row[0]))
            lines[current][4] = row[1].strip()
        elif current is not None:
            entry = lines[current]
            entry[0] += _int(row[col["Instructions Executed"]])
            entry[1] += _int(row[col["Warp Stall Sampling (All Samples)"]])
            entry[2] += _int(row[col["stall_long_sb"]])
            entry[3] += _int(row[col["stall_barrier"]])
            address = row[col["Address"]]
            if address in seen:
                continue
            seen.add(address)
            totals["instructions"] += _int(row[col["Instructions Executed"]])
            totals["samples"] += _int(row[col["Warp Stall Sampling (All Samples)"]])
            for name, i in col.items():
                if name.startswith("stall_") and "Not Issued" not in name:
                    stalls[name[len("stall_"):]] += _int(row[i])
    return lines, stalls, totals


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source cuda,sass output (.csv or .csv.gz)")
    ap.add_argument("--warps", type=int, default=None,
                    help="warps of the launch, to print instructions per warp (without it: the launch's totals)")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    lines, stalls, totals = per_line(args.csv)
    if not lines:
        raise SystemExit(f"{args.csv}: no source lines (was it written with --print-source cuda,sass?)")
    instructions, samples = totals["instructions"], max(totals["samples"], 1)
    warps = args.warps or 1
    per = f"{instructions / warps:.0f} per warp over {args.warps} warps" if args.warps else "the launch's total"
    print(f"instructions {instructions} ({per}), stall samples {samples}")
    print("stalls: " + ", ".join(f"{k} {100 * v / samples:.1f}%" for k, v in stalls.most_common(10)))
    column = "instr/warp" if args.warps else "    instr"
    for title, key in (("by instructions", 0), ("by stall samples", 1)):
        print(f"\n{title}:  {column}  samples  long_sb  barrier  line")
        for (file, line), v in sorted(lines.items(), key=lambda kv: -kv[1][key])[: args.top]:
            print(f"  {v[0] / warps:10.1f}  {v[1]:7d}  {v[2]:7d}  {v[3]:7d}  {file}:{line}  {v[4][:80]}")


if __name__ == "__main__":
    main()
