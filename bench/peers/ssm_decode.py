#!/usr/bin/env python3
"""Peer timings for `rewind bench kernels` (kernels/src/cuda/bench_decode): the SSM decode step of one layer at the
same shapes, batches and dtypes (fp32 state, bf16 x / B / C / q / k / v and outputs, fp32 dt / g / beta), CUDA
events, 3 warm-up calls then the median of 20 (bench/peers/timing.py, the same rule as the Rust side):

- Mamba-2 (Nemotron-H-8B layer, 128 heads x 64, state 128, 8 groups): mamba_ssm's Triton `selective_state_update`
  (dt, A, D and dt_bias broadcast over the head dim with stride 0, as Mamba-2 models call it; dt already softplus'd,
  as rewind's is);
- GDN (Qwen3.5-4B layer, 16 key / 32 value heads x 128): fla's `fused_recurrent_gated_delta_rule`, one token (the
  decode step) and T = 2, 4, 6 tokens (one launch over a window that writes only the final state), the state read
  from `initial_state` and written as the final state, value-major like rewind's (`state_v_first`).

Operands rotate between calls so HBM is measured, as on the Rust side: each call takes the next window of `batch`
states from a pool of at least 512 (2 GiB Mamba-2, 1 GiB GDN), and the next window of token rows from pools of at
least 256 MiB. Bytes follow rewind's byte model of a recurrent step (state read and written, the tokens' inputs,
A and D for Mamba-2, the outputs), and the fraction is of a device-to-device copy timed in this process.

Rows share the JSON schema of `rewind bench kernels --json` (`impl` names the peer), so the two files join on
(family, kernel, batch, window).

Peer code is never committed: run `python3 bench/peers/ssm_decode.py fetch` on the host (it has the network) to put
the mamba-ssm sdist and the fla-core wheel in `.whl/` (git-ignored, carried to the device); the run unpacks them into
a temporary folder (bench/peers/prefill.py's `unpack_peers`). On the device: `python3 bench/peers/ssm_decode.py
[--json FILE] [--batch 1,8,...]`, or bench/gpu/kernels_vs_peers.sh for both sides in one call.
"""
import argparse
import itertools
import json
import os
import subprocess
import sys

# The same layer shapes as kernels/src/cuda/bench_decode/mod.rs.
MAMBA2 = dict(heads=128, head_dim=64, state=128, groups=8)
GDN = dict(k_heads=16, v_heads=32, k_dim=128, v_dim=128)
BATCHES = [1, 8, 32, 64, 128, 256, 512]
WINDOWS = [2, 4, 6]
MIN_SLOTS = 512
TOKEN_POOL_BYTES = 512 << 20  # counted at 4 bytes an element, as on the Rust side

FLA_WHEEL = "fla-core==0.6.0"
MAMBA_SDIST = ("mamba_ssm-2.3.2.post1.tar.gz",
               "https://files.pythonhosted.org/packages/af/48/aa7bec0efc7453fa0512276c0069c854bf684219050294266534bfef34bb/"
               "mamba_ssm-2.3.2.post1.tar.gz")


def fetch(whl):
    """Downloads the peers into `whl` (host only: the device has no network)."""
    os.makedirs(whl, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", whl, FLA_WHEEL],
                   check=True)
    name, url = MAMBA_SDIST
    if not os.path.exists(os.path.join(whl, name)):
        subprocess.run(["curl", "-sSfL", "-o", os.path.join(whl, name), url], check=True)
    print(f"peers in {whl}: {sorted(os.listdir(whl))}")


def mamba2_step_bytes(t=1):
    """rewind's byte model (cpu::replay_mamba2::recurrent_step_traffic, over t tokens): fp32 state read and written,
    per token x, B, C bf16 and dt fp32, A and D fp32 once, bf16 outputs."""
    h, p, n, g = MAMBA2["heads"], MAMBA2["head_dim"], MAMBA2["state"], MAMBA2["groups"]
    token = 2 * h * p + 4 * h + 2 * 2 * g * n
    return 2 * 4 * h * p * n + t * (token + 2 * h * p) + 8 * h


def gdn_step_bytes(t=1):
    """rewind's byte model (cpu::replay_gdn::recurrent_step_traffic, over t tokens): fp32 state read and written, per
    token q, k, v bf16 and g, beta fp32, bf16 outputs."""
    hk, hv, dk, dv = GDN["k_heads"], GDN["v_heads"], GDN["k_dim"], GDN["v_dim"]
    token = 2 * (2 * hk * dk + hv * dv) + 4 * 2 * hv
    return 2 * 4 * hv * dv * dk + t * (token + 2 * hv * dv)


def row(peer, family, kernel, batch, window, ms, nbytes, copy_gbs):
    """One row in the schema of `rewind bench kernels --json` (no ring, no accepted count, no spread: timing.py
    reports the median only)."""
    gbs = nbytes / ms / 1e6
    return {"impl": peer, "family": family, "kernel": kernel, "batch": batch, "ring_len": None, "window": window,
            "accepted": None, "ms": ms, "ms_min": None, "ms_max": None, "bytes": nbytes, "gb_s": gbs,
            "frac_copy": gbs / copy_gbs, "vs_recurrent": None, "commit": None}


def copy_bandwidth():
    """GB/s of a 1 GiB device-to-device copy, read + write (timing::copy_bandwidth's measure)."""
    import torch
    from timing import median_ms

    src = torch.zeros(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * (1 << 30) / ms / 1e6


class Windows:
    """Rotating windows over the leading dim of a pool: call `i` gets rows [(i mod W)·n, +n)."""

    def __init__(self, rows, n):
        self.n, self.count, self.i = n, max(rows // n, 1), itertools.count()

    def next(self):
        w = next(self.i) % self.count
        return slice(w * self.n, (w + 1) * self.n)


def token_rows(row_elems, batches, windows):
    return max(max(batches) * max(windows + [1]), TOKEN_POOL_BYTES // (4 * row_elems) + 1)


def mamba2(rows, batches, copy_gbs):
    import torch
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    from timing import median_ms

    h, p, n, g = MAMBA2["heads"], MAMBA2["head_dim"], MAMBA2["state"], MAMBA2["groups"]
    slots = max(MIN_SLOTS, max(batches))
    dev, bf = "cuda", torch.bfloat16
    state = torch.randn(slots, h, p, n, device=dev) * 0.5
    tr = token_rows(2 * h * p + h + 2 * g * n, batches, [1])
    x = torch.randn(tr, h, p, device=dev, dtype=bf) * 0.5
    dt = torch.empty(tr, h, device=dev).uniform_(0.01, 0.1)
    b = torch.randn(tr, g, n, device=dev, dtype=bf) * 0.5
    c = torch.randn(tr, g, n, device=dev, dtype=bf) * 0.5
    # Per-head parameters broadcast over the head dim (stride 0): the kernel's tied-head-dim path.
    a = (-torch.empty(h, device=dev).uniform_(0.5, 4.0))[:, None, None].expand(h, p, n)
    d = torch.ones(h, device=dev)[:, None].expand(h, p)
    dt_bias = torch.zeros(h, device=dev)[:, None].expand(h, p)
    for batch in batches:
        sw, tw = Windows(slots, batch), Windows(tr, batch)

        def step():
            s, t = sw.next(), tw.next()
            selective_state_update(state[s], x[t], dt[t][:, :, None].expand(batch, h, p), a, b[t], c[t], D=d,
                                   dt_bias=dt_bias, dt_softplus=False)

        rows.append(row("mamba_ssm selective_state_update", "mamba2", "recurrent_step", batch, 1, median_ms(step),
                        batch * mamba2_step_bytes(), copy_gbs))
        print(json.dumps(rows[-1]), flush=True)


def gdn(rows, batches, copy_gbs):
    import torch
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from timing import median_ms

    hk, hv, dk, dv = GDN["k_heads"], GDN["v_heads"], GDN["k_dim"], GDN["v_dim"]
    slots = max(MIN_SLOTS, max(batches))
    dev, bf = "cuda", torch.bfloat16
    # Value-major [slots, HV, V, K], as rewind stores it (state_v_first).
    state = torch.randn(slots, hv, dv, dk, device=dev) * 0.5
    tr = token_rows(2 * hk * dk + 2 * hv * dv + 2 * hv, batches, WINDOWS)
    q = torch.nn.functional.normalize(torch.randn(tr, hk, dk, device=dev), dim=-1).to(bf)
    k = torch.nn.functional.normalize(torch.randn(tr, hk, dk, device=dev), dim=-1).to(bf)
    v = torch.randn(tr, hv, dv, device=dev, dtype=bf) * 0.5
    gg = -torch.empty(tr, hv, device=dev).uniform_(0.01, 0.1)
    beta = torch.empty(tr, hv, device=dev).uniform_(0.1, 0.9)
    layout = {"state_v_first": True}

    def call(batch, t, s, r):
        shape = lambda z: z[r].view(batch, t, *z.shape[1:])
        # k_dim = v_dim, so the pool serves either layout as it is (only the meaning of the last two dims differs).
        fused_recurrent_gated_delta_rule(shape(q), shape(k), shape(v), g=shape(gg), beta=shape(beta), scale=dk ** -0.5,
                                         initial_state=state[s], output_final_state=True, **layout)

    try:
        call(1, 1, slice(0, 1), slice(0, 1))
    except Exception as e:  # an fla without value-major states: key-major ones move the same bytes
        print(f"fla refused state_v_first ({type(e).__name__}: {e}); using key-major states", flush=True)
        layout.clear()
    for t in [1] + WINDOWS:
        for batch in batches:
            sw, tw = Windows(slots, batch), Windows(tr, batch * t)
            step = lambda: call(batch, t, sw.next(), tw.next())
            kernel = "recurrent_step" if t == 1 else "recurrent_window"
            peer = f"fla fused_recurrent_gated_delta_rule (T = {t}, final state only{'' if layout else ', key-major'})"
            rows.append(row(peer, "gdn", kernel, batch, t, median_ms(step), batch * gdn_step_bytes(t), copy_gbs))
            print(json.dumps(rows[-1]), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", default="run", choices=["run", "fetch"])
    ap.add_argument("--json")
    ap.add_argument("--whl", default=".whl")
    ap.add_argument("--batch", default=",".join(map(str, BATCHES)))
    ap.add_argument("--family", default="all", choices=["mamba2", "gdn", "all"])
    args = ap.parse_args()
    if args.what == "fetch":
        return fetch(args.whl)
    import torch
    from prefill import unpack_peers  # bench/peers/prefill.py: the sdist and wheel into a temporary folder

    batches = [int(b) for b in args.batch.split(",")]
    unpack_peers(args.whl)
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s", flush=True)
    rows, errors = [], []
    for name, f in (("mamba2", mamba2), ("gdn", gdn)):
        if args.family not in (name, "all"):
            continue
        try:
            f(rows, batches, copy_gbs)
        except Exception as e:  # one peer failing must not hide the other
            errors.append({"family": name, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(errors[-1]), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gb_s": copy_gbs,
                       "dtypes": "bf16 inputs and outputs; fp32 state, dt, g, beta", "rows": rows, "errors": errors},
                      fh, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
