#!/usr/bin/env python3
"""Peer timings for the attention rows of kernels/examples/cuda_timing.rs: torch SDPA (flash backend) on the same
shapes, bf16, CUDA events, 3 warm-up calls then the median of 20, and the device-to-device copy bandwidth of this run.

Run on the device beside cuda_timing (same call): `python3 bench/peers/attention.py [--json FILE]`. SDPA reads
contiguous K/V ([batch, kv_heads, len, head_dim]), not pages; GQA through `enable_gqa=True` (K/V not repeated). A
shape the backend refuses with GQA is retried with K/V repeated to the query heads and marked so.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from timing import median_ms  # bench/peers/timing.py, shared by the peer scripts


def copy_gbs():
    n = 1 << 28
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * n * 4 / ms / 1e6


def row(copy, batch, t, length, heads, kvh, d):
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(batch, heads, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, kvh, length, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, kvh, length, d, device="cuda", dtype=torch.bfloat16, generator=g)
    # Decode (t = 1) sees every key; prefill of t tokens after length − t cached is causal from the bottom right.
    causal = t > 1
    if causal and t != length:
        mask = torch.ones(t, length, dtype=torch.bool, device="cuda").tril(diagonal=length - t)
    else:
        mask = None
    # The flash backend takes no mask (its is_causal aligns top left): the cached-prefix row runs the memory-efficient
    # backend with an explicit bottom-right mask.
    backend = SDPBackend.FLASH_ATTENTION if mask is None else SDPBackend.EFFICIENT_ATTENTION
    note = ("flash" if mask is None else "efficient, mask") + ", enable_gqa"
    with sdpa_kernel([backend]):

        def call(kk, vv, gqa):
            if mask is None:
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=gqa)

        try:
            call(k, v, True)
            ms = median_ms(lambda: call(k, v, True))
        except RuntimeError:
            kr, vr = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
            note = note.replace("enable_gqa", "K/V repeated")
            try:
                ms = median_ms(lambda: call(kr, vr, False))
            except RuntimeError as e:
                note, ms = f"flash refused: {str(e).splitlines()[0][:80]}", float("nan")
            del kr, vr
    kv_bytes = batch * length * kvh * d * 2 * 2
    flops = 4 * batch * heads * d * t * (length - (t - 1) / 2)
    out = {
        "batch": batch, "t": t, "len": length, "heads": heads, "kv_heads": kvh, "head_dim": d, "ms": ms,
        "kv_gbs": kv_bytes / ms / 1e6, "frac_copy": kv_bytes / ms / 1e6 / copy, "tflops": flops / ms / 1e9,
        "note": note,
    }
    print(f"sdpa  batch {batch} t {t} len {length} {heads}/{kvh}×{d}: {ms:.4f} ms, K/V {out['kv_gbs']:.0f} GB/s "
          f"({out['frac_copy']:.2f} of copy), {out['tflops']:.1f} TFLOP/s [{note}]", flush=True)
    del q, k, v
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    copy = copy_gbs()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; copy bandwidth {copy:.0f} GB/s", flush=True)
    shapes = [
        (32, 1, 4096, 32, 8, 128),
        (32, 1, 4096, 16, 4, 256),
        (32, 1, 4096, 16, 2, 256),
        (1, 1, 128, 32, 8, 128),
        (64, 1, 8192, 32, 8, 128),
        (64, 1, 8192, 16, 2, 256),
        (256, 1, 32768, 32, 8, 128),
        (256, 1, 32768, 16, 2, 256),
        (1, 1024, 1024, 32, 8, 128),
        (1, 1024, 1024, 16, 4, 256),
        (1, 1024, 4096, 32, 8, 128),
    ]
    rows = []
    for s in shapes:
        try:
            rows.append(row(copy, *s))
        except torch.cuda.OutOfMemoryError:
            print(f"sdpa  {s}: out of memory", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbs": copy,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
