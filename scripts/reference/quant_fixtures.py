#!/usr/bin/env python3
"""Writes small quantized checkpoints in the three published layouts rewind loads, each with the weights
dequantized by an independent implementation of the format (numpy + ml_dtypes' float8_e4m3fn / float4_e2m1fn, the
number types JAX and the ModelOpt exporters use), for the Rust test
`engine/src/checkpoint/reader/tests.rs::published_quantized_layouts_dequantize_like_the_reference`.

Per layout, tests/fixtures/quant/<layout>/ holds `config.json` (its `quantization_config`), `model.safetensors`
(quantized weights, scales, a bf16 tensor left unquantized) and `expected.safetensors` (every weight in f32).

    pip install numpy ml_dtypes safetensors
    python3 scripts/reference/quant_fixtures.py            # rewrite the fixtures
    python3 scripts/reference/quant_fixtures.py --check    # fail if they are out of date
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "quant"
E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn


def weights(seed: int, shape) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Rows of very different magnitudes, so that per-block and per-group scales matter.
    return (rng.standard_normal(shape) * rng.choice([0.01, 0.3, 4.0], size=shape[:-1] + (1,))).astype(np.float32)


def fp8_codes(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -448.0, 448.0).astype(E4M3)


def fp8_block(w: np.ndarray, block):
    """Fine-grained FP8: one scale per block (partial blocks at the edges), dequant = code * weight_scale_inv."""
    rows, cols = w.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    scales = np.zeros((nr, nc), np.float32)
    codes = np.zeros(w.shape, E4M3)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            s = np.float32(np.abs(blk).max() / 448.0) or np.float32(1.0)
            scales[i, j] = s
            codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = fp8_codes(blk / s)
    full = np.repeat(np.repeat(scales, br, 0), bc, 1)[:rows, :cols]
    return codes, scales, codes.astype(np.float32) * full


def modelopt_fp8(w: np.ndarray, per_row: bool):
    s = (np.abs(w).max(axis=1, keepdims=True) if per_row else np.abs(w).max()) / np.float32(448.0)
    s = np.asarray(s, np.float32)
    codes = fp8_codes(w / s)
    return codes, s.reshape(-1) if per_row else s.reshape(()), codes.astype(np.float32) * s


def nvfp4(w: np.ndarray, group=16):
    """NVFP4: E2M1 elements two per byte (low nibble first), E4M3 scale per 16, f32 global scale."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    glob = np.float32(np.abs(w).max() / (448.0 * 6.0))
    scale_codes = fp8_codes(np.abs(g).max(axis=2) / 6.0 / glob)
    s = scale_codes.astype(np.float32) * glob
    safe = np.where(s > 0, s, 1.0)[..., None]
    q = np.clip(g / safe, -6.0, 6.0).astype(E2M1)
    nib = q.view(np.uint8).reshape(rows, cols) & 0x0F
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    deq = (q.astype(np.float32) * s[..., None]).reshape(rows, cols)
    return packed, scale_codes, glob, deq


def layouts():
    """(name, quantization_config, tensors, expected) per layout."""
    a, b = weights(1, (200, 144)), weights(2, (64, 48))
    kept = weights(3, (8, 16))
    kept_bf16 = kept.astype(ml_dtypes.bfloat16)
    kept_f32 = kept_bf16.astype(np.float32)
    out = []

    ca, sa, da = fp8_block(a, (128, 128))
    cb, sb, db = fp8_block(b, (128, 128))
    out.append((
        "fp8-block",
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
         "modules_to_not_convert": ["kept"]},
        {"a.weight": ca, "a.weight_scale_inv": sa, "b.weight": cb, "b.weight_scale_inv": sb,
         "kept.weight": kept_bf16},
        {"a.weight": da, "b.weight": db, "kept.weight": kept_f32},
    ))

    ca, sa, da = modelopt_fp8(a, per_row=False)
    cb, sb, db = modelopt_fp8(b, per_row=True)
    one = np.array(1.0, np.float32)
    out.append((
        "modelopt-fp8",
        {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["kept"]},
        {"a.weight": ca, "a.weight_scale": sa, "a.input_scale": one, "b.weight": cb, "b.weight_scale": sb,
         "b.input_scale": one, "kept.weight": kept_bf16},
        {"a.weight": da, "b.weight": db, "kept.weight": kept_f32},
    ))

    pa, qa, ga, da = nvfp4(a)
    pb, qb, gb, db = nvfp4(b)
    out.append((
        "nvfp4",
        {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["kept"]},
        {"a.weight": pa, "a.weight_scale": qa, "a.weight_scale_2": np.array(ga, np.float32), "a.input_scale": one,
         "b.weight": pb, "b.weight_scale": qb, "b.weight_scale_2": np.array(gb, np.float32), "b.input_scale": one,
         "kept.weight": kept_bf16},
        {"a.weight": da, "b.weight": db, "kept.weight": kept_f32},
    ))
    return out


def write(dest: Path):
    for name, qcfg, tensors, expected in layouts():
        d = dest / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps({"quantization_config": qcfg}, indent=2) + "\n")
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        save_file(expected, str(d / "expected.safetensors"), metadata={"format": "pt"})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed fixtures differ")
    args = ap.parse_args()
    if not args.check:
        write(OUT)
        return
    with tempfile.TemporaryDirectory() as tmp:
        write(Path(tmp))
        for name, *_ in layouts():
            for f in ["config.json", "model.safetensors", "expected.safetensors"]:
                if (Path(tmp) / name / f).read_bytes() != (OUT / name / f).read_bytes():
                    sys.exit(f"tests/fixtures/quant/{name}/{f} is out of date: run scripts/reference/quant_fixtures.py")


if __name__ == "__main__":
    main()
