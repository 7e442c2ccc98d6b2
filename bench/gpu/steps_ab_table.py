#!/usr/bin/env python3
"""The table of bench/gpu/steps_ab.sh: for every model, each decode and verify row's median step time under every
build, and the last build's speed-up over the first (first / last). Also the chunked prefill of one 1024-token prompt.

    python3 bench/gpu/steps_ab_table.py DIR [--variants before,after] [--json out.json] > table.md
"""

import argparse
import glob
import json
import os
import re


def rows(bench):
    out = [("prefill 1024 tokens (s)", bench["prefill_median_s"])]
    for d in bench["decode"]:
        out.append((f"decode, batch {d['batch']}", d["step_ms_median"]))
    for v in bench["verify"]:
        out.append((f"verify T = {v['window']}, {v['kept_drafts']} kept, batch {v['batch']}", v["step_ms_median"]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--variants", default="before,after")
    ap.add_argument("--json")
    a = ap.parse_args()
    variants = a.variants.split(",")
    models = sorted({re.sub(r"-graphs-[^-]+\.json$", "", os.path.basename(p))
                     for p in glob.glob(os.path.join(a.dir, "*-graphs-*.json"))})
    report = {}
    head = " | ".join(f"{v} (ms)" for v in variants)
    print(f"| model | step | {head} | {variants[-1]} vs {variants[0]} |")
    print("|---|---|" + "---|" * len(variants) + "---|")
    for m in models:
        benches = {}
        for v in variants:
            p = os.path.join(a.dir, f"{m}-graphs-{v}.json")
            if os.path.exists(p):
                benches[v] = json.load(open(p))
        if len(benches) != len(variants):
            continue
        table = {v: dict(rows(b)) for v, b in benches.items()}
        report[m] = {"commits": {v: b.get("commit") for v, b in benches.items()}, "device": benches[variants[0]]["device"],
                     "steps": table}
        for name in table[variants[0]]:
            vals = [table[v].get(name) for v in variants]
            if None in vals:
                continue
            cells = " | ".join(f"{x:.4f}" if "prefill" in name else f"{x:.2f}" for x in vals)
            print(f"| {m} | {name} | {cells} | {vals[0] / vals[-1]:.3f}× |")
    if a.json:
        json.dump(report, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
