#!/usr/bin/env python3
"""Compact tables from bench/gpu/kernel_times.sh's Nsight Compute CSVs (`--page raw`, the duration metric only).

    python3 bench/gpu/kernel_times_table.py ncu.csv --compact out.csv    # kernel, grid, block, ns per launch, in order
    python3 bench/gpu/kernel_times_table.py ncu.csv --around replay --nth -8 --before 12 --after 28

`--around NAME` prints the launches around the nth launch whose kernel contains NAME (one layer of a decode step).
"""

import argparse
import csv
import io


def launches(path):
    text = open(path).read()
    rows = list(csv.reader(io.StringIO(text[text.index('"ID"'):])))
    head = rows[0]
    k, g, b, t = (head.index(c) for c in ("Kernel Name", "Grid Size", "Block Size", "gpu__time_duration.sum"))
    # rows[1] holds the units (ns).
    return [(r[k], r[g], r[b], float(r[t].replace(",", ""))) for r in rows[2:] if r[t]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--compact")
    ap.add_argument("--around")
    ap.add_argument("--nth", type=int, default=-1)
    ap.add_argument("--before", type=int, default=12)
    ap.add_argument("--after", type=int, default=28)
    a = ap.parse_args()
    ls = launches(a.csv)
    if a.compact:
        with open(a.compact, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["kernel", "grid", "block", "ns"])
            for name, grid, block, ns in ls:
                w.writerow([name.split("(")[0][:80], grid, block, f"{ns:.0f}"])
    if a.around:
        hits = [i for i, l in enumerate(ls) if a.around in l[0]]
        at = hits[a.nth]
        print("| launch | kernel | grid | block | µs |")
        print("|---|---|---|---|---|")
        for i in range(max(0, at - a.before), min(len(ls), at + a.after)):
            name, grid, block, ns = ls[i]
            print(f"| {i} | `{name.split('(')[0][:60]}` | {grid} | {block} | {ns / 1e3:.2f} |")


if __name__ == "__main__":
    main()
