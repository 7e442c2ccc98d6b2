#!/usr/bin/env python3
"""Tables from the Nsight Compute CSVs of bench/gpu/ncu_kernels.sh.

ncu writes the profiled program's own stdout into the same file before its CSV, so the labels come from there:
`rewind bench kernels` prints its markdown table (one row per case, each case launched at every --batch), and
`cuda_timing attention` prints one `paged_attention ...` line per shape. Launches are grouped by (kernel, grid,
block, shared memory) in the order they ran; every group is one case (warm-up and timed launches of it), reported as
the median over its launches. Durations are the profiled launches' own (ncu replays each launch once per counter
pass, with cold caches), so they are longer than the timed ones and are shown only to tell cases apart.

    python3 bench/gpu/ncu_summary.py ncu-gdn.csv ncu-mamba2.csv --batches 64,256 > replay.md
    python3 bench/gpu/ncu_summary.py ncu-attention.csv --stalls ncu-attention-stalls.csv > attention.md
"""

import argparse
import csv
import io
import json
import re
import statistics
import sys

DETAIL_METRICS = [
    ("Registers Per Thread", "regs"),
    ("Dynamic Shared Memory Per Block", "smem B"),
    ("Block Limit Registers", "blocks/SM by regs"),
    ("Block Limit Shared Mem", "by smem"),
    ("Theoretical Occupancy", "theor. occ. %"),
    ("Achieved Occupancy", "achieved %"),
    ("DRAM Throughput", "DRAM % of peak"),
    ("Compute (SM) Throughput", "SM % of peak"),
    ("Warp Cycles Per Issued Instruction", "cycles / issue"),
    ("Duration", "profiled µs"),
]
STALLS = ["long_scoreboard", "short_scoreboard", "barrier", "mio_throttle", "wait", "math_pipe_throttle",
          "lg_throttle", "not_selected", "dispatch_stall", "no_instruction"]


def split_file(path):
    """The program's stdout lines and the CSV rows of one ncu output file."""
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    head = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if head is None:
        return lines, []
    body = [l for l in lines[head:] if l.startswith('"')]
    return lines[:head], list(csv.DictReader(io.StringIO("\n".join(body))))


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def labels_of(stdout, batches):
    """Case labels in launch order."""
    attention = [l for l in stdout if l.startswith("paged_attention")]
    if attention:
        out = []
        for l in attention:
            m = re.match(r"paged_attention\s+(batch \d+ t \d+ len \d+ \S+):.*\[(.*)\]", l)
            out.append(f"{m.group(1)} [{m.group(2)}]" if m else l[:60])
        return out
    cases = []
    for l in stdout:
        if not l.startswith("| ") or l.startswith("| kernel") or "---" in l:
            continue
        name = l.split("|")[1].strip()
        if name.startswith(("recurrent rows", "replay", "verify")):
            cases.append(name)
    return [f"{c} · batch {b}" for c in cases for b in batches]


def groups_of(rows, key_metric="ID"):
    """Launches grouped by (kernel, grid, block, shared memory), first-seen order: {key: [per-launch dict]}."""
    launches = {}
    for r in rows:
        launches.setdefault(r[key_metric], []).append(r)
    groups = {}
    for rs in launches.values():
        m = {x.get("Metric Name", ""): x.get("Metric Value", "") for x in rs}
        smem = m.get("Dynamic Shared Memory Per Block") or rs[0].get("launch__shared_mem_per_block_dynamic", "")
        key = (rs[0]["Kernel Name"], rs[0]["Grid Size"], rs[0]["Block Size"], smem)
        stall_rule = next((x["Rule Description"] for x in rs if x.get("Rule Name") == "CPIStall"
                           and x.get("Rule Description", "").startswith("On average")), "")
        m["_stall"] = stall_rule
        m["_raw"] = rs[0]
        groups.setdefault(key, []).append(m)
    return groups


def median(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def top_stall(text):
    m = re.search(r"spends ([\d.]+) cycles being stalled (.*?)\.", text)
    return f"{m.group(1)} cyc: {m.group(2)}" if m else ""


def summarize(path, batches, stalls_path=None):
    stdout, rows = split_file(path)
    labels = labels_of(stdout, batches)
    groups = groups_of(rows)
    stall_groups = {}
    if stalls_path:
        _, srows = split_file(stalls_path)
        for r in srows:
            stall_groups.setdefault((r["Kernel Name"], r["Grid Size"], r["Block Size"]), []).append(r)
    out = []
    for i, (key, launches) in enumerate(groups.items()):
        rec = {"case": labels[i] if i < len(labels) else f"{key[0]} grid {key[1]}",
               "kernel": key[0], "grid": key[1], "block": key[2], "launches": len(launches)}
        for metric, short in DETAIL_METRICS:
            v = median(number(m.get(metric)) for m in launches)
            rec[short] = v / 1000 if (v is not None and metric == "Duration") else v
        rec["top stall (ncu rule)"] = top_stall(launches[-1]["_stall"])
        srs = stall_groups.get(key[:3])
        if srs:
            for s in STALLS:
                rec[f"stall {s}"] = median(number(r.get(f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio"))
                                           for r in srs)
        out.append(rec)
    return out


def markdown(records):
    if not records:
        return "(no profiled launches)\n"
    cols = ["case", "kernel"] + [s for _, s in DETAIL_METRICS] + ["top stall (ncu rule)"]
    stall_cols = [c for c in records[0] if c.startswith("stall ")]
    cols += stall_cols
    def cell(v):
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"
        return str(v)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        lines.append("| " + " | ".join(cell(r.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+", help="ncu --csv --page details outputs of ncu_kernels.sh")
    ap.add_argument("--batches", default="64,256", help="the --batch list of the profiled `rewind bench kernels`")
    ap.add_argument("--stalls", help="the --page raw stall-reason CSV of the same program (attention)")
    ap.add_argument("--json", help="write every record as JSON here too")
    args = ap.parse_args()
    batches = [b for b in args.batches.split(",") if b]
    everything = {}
    for path in args.csv:
        records = summarize(path, batches, args.stalls if len(args.csv) == 1 else None)
        everything[path] = records
        sys.stdout.write(f"### {path.split('/')[-1]}\n\n" + markdown(records) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
