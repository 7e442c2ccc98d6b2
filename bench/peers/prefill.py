#!/usr/bin/env python3
"""Peer timings for the prefill-scan and MoE rows of kernels/examples/cuda_timing.rs (its `scans` and `moe` sections),
same shapes and dtypes (bf16 operands, f32 state), CUDA events, 3 warm-up calls then the median of 20:

- Mamba-2 chunked scan: mamba_ssm's Triton `mamba_chunk_scan_combined` (initial state in, final state out, D skip),
  chunk 64 (the work rewind does) and 256 (mamba_ssm's default);
- GDN chunked delta rule: fla's `chunk_gated_delta_rule` (q, k repeated to the value heads: fla 0.6 wants equal heads);
- MoE: `torch._grouped_mm` for the up projection over the rows grouped by expert (the same routing draw shape as
  cuda_timing: top-k of a uniform random score per token).

Peer code is never committed: `.whl/` (git-ignored, carried to the device) holds the mamba-ssm sdist and the fla-core
wheel, fetched on the host with
  curl -o .whl/mamba_ssm-2.3.2.post1.tar.gz https://files.pythonhosted.org/packages/af/48/aa7bec0efc7453fa0512276c0069c854bf684219050294266534bfef34bb/mamba_ssm-2.3.2.post1.tar.gz
  python3 -m pip download --no-deps --only-binary=:all: -d .whl fla-core==0.6.0
and this script unpacks them into a temporary folder at run time (mamba_ssm's package `__init__` imports compiled
extensions, so it is emptied and only the Triton ops are used). Run on the device in the same call as cuda_timing:
`python3 bench/peers/prefill.py [--json FILE]`.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tarfile
import tempfile

import torch

from timing import median_ms  # bench/peers/timing.py, shared by the peer scripts


def unpack_peers(whl):
    site = tempfile.mkdtemp(prefix="rewind-peers-")
    sdist = glob.glob(os.path.join(whl, "mamba_ssm-*.tar.gz"))
    if sdist:
        with tarfile.open(sdist[0]) as tar:
            members = [m for m in tar.getmembers() if "/mamba_ssm/" in m.name and "/mamba3/" not in m.name]
            for m in members:
                m.name = m.name.split("/", 1)[1]
            tar.extractall(site, members=members, filter="data")
        # The package __init__ imports compiled extensions; the Triton ops need none of them.
        for init in [os.path.join(site, "mamba_ssm", "__init__.py")]:
            open(init, "w").close()
    wheels = glob.glob(os.path.join(whl, "fla_core-*.whl"))
    if wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, wheels[0]],
            check=True,
        )
    sys.path.insert(0, site)


def ssd(rows):
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    seq, heads, p, n, groups = 1024, 128, 64, 128, 8
    dev = "cuda"
    x = torch.randn(1, seq, heads, p, device=dev, dtype=torch.bfloat16)
    dt = torch.empty(1, seq, heads, device=dev).uniform_(0.01, 0.2)
    a = -torch.empty(heads, device=dev).uniform_(0.5, 4.0)
    b = torch.randn(1, seq, groups, n, device=dev, dtype=torch.bfloat16)
    c = torch.randn(1, seq, groups, n, device=dev, dtype=torch.bfloat16)
    d = torch.randn(heads, device=dev)
    s0 = torch.randn(1, heads, p, n, device=dev)
    for chunk in (64, 256):
        fn = lambda: mamba_chunk_scan_combined(
            x, dt, a, b, c, chunk, D=d, initial_states=s0, return_final_states=True
        )
        ms = median_ms(fn)
        rows.append({"op": "mamba2_chunked", "peer": f"mamba_ssm mamba_chunk_scan_combined chunk {chunk}",
                     "shape": f"Nemotron-H-8B 128×64 state 128, seq {seq}", "ms": ms})


def gdn(rows):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    seq, hk, hv, dk, dv = 1024, 16, 32, 128, 128
    dev = "cuda"
    q = torch.nn.functional.normalize(torch.randn(1, seq, hk, dk, device=dev), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, seq, hk, dk, device=dev), dim=-1).bfloat16()
    q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    v = torch.randn(1, seq, hv, dv, device=dev, dtype=torch.bfloat16)
    g = -torch.empty(1, seq, hv, device=dev).uniform_(0.01, 1.0)
    beta = torch.empty(1, seq, hv, device=dev).uniform_(0.1, 0.9).bfloat16()
    s0 = torch.randn(1, hv, dk, dv, device=dev) * 0.5
    fn = lambda: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    rows.append({"op": "gdn_chunked", "peer": "fla chunk_gated_delta_rule (q, k repeated to 32 heads)",
                 "shape": f"Qwen3.5-4B 16/32×128, seq {seq}", "ms": median_ms(fn)})


def moe(rows):
    dev = "cuda"
    for tokens, experts, top_k, h, i in [(64, 128, 6, 2688, 1856), (64, 512, 10, 2048, 512),
                                         (1024, 128, 6, 2688, 1856), (1024, 512, 10, 2048, 512)]:
        ids = torch.rand(tokens, experts, device=dev).topk(top_k, dim=1).indices.flatten()
        counts = torch.bincount(ids, minlength=experts)
        order = torch.argsort(ids, stable=True)
        x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
        a = x[order // top_k].contiguous()
        w = (torch.randn(experts, i, h, device=dev, dtype=torch.bfloat16) * 0.02)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        active = int((counts > 0).sum())
        fn = lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
        ms = median_ms(fn)
        rows.append({"op": "moe up GEMM", "peer": "torch._grouped_mm",
                     "shape": f"{experts} experts top-{top_k} {h}/{i}, {tokens} tokens", "ms": ms,
                     "active_experts": active, "weights_gbs": active * i * h * 2 / ms / 1e6,
                     "tflops": 2 * tokens * top_k * i * h / ms / 1e9})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--whl", default=".whl")
    args = ap.parse_args()
    unpack_peers(args.whl)
    rows = []
    for f in (ssd, gdn, moe):
        try:
            f(rows)
        except Exception as e:  # one peer failing must not hide the others
            rows.append({"op": f.__name__, "error": f"{type(e).__name__}: {e}"})
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
