#!/usr/bin/env python3
"""Puts a trained MTP layer into a checkpoint: the checkpoint's own tensors stay byte for byte, the `mtp.*` tensors
of `mtp.safetensors` are appended to its `model.safetensors`, and `config.json` gets the MTP fields. Standard
library only, so it runs where torch is not installed.

train_mtp.py uses `merge` and `with_mtp_fields` to write its output checkpoint; the command line installs what
run_gpu_mtp.sh brought back:

  python3 scripts/train/install_mtp.py --from DIR [--into models/default] [--archs "nemotron_h qwen3_5"]

DIR holds `<arch>_mtp.tar.xz` (or an unpacked `<arch>/`) with `mtp.safetensors` and `mtp_summary.json`. The
install refuses a head trained on other weights: the summary's digest of the base tensors must equal the target
checkpoint's (its `mtp.*` tensors, from an earlier install, are left out of the digest and replaced).
"""
import argparse
import hashlib
import json
import os
import struct
import sys
import tarfile
import tempfile
from pathlib import Path

MTP_PREFIX = "mtp."


def read_header(path: Path) -> tuple[dict, int]:
    """The safetensors header of `path` (tensor name -> {dtype, shape, data_offsets}, plus `__metadata__`) and the
    file offset where its data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header, 8 + n


def tensor_bytes(path: Path) -> dict[str, tuple[dict, bytes]]:
    """Every tensor of `path`: name -> (its header entry, its raw bytes)."""
    header, start = read_header(path)
    data = path.read_bytes()[start:]
    return {
        name: (info, data[info["data_offsets"][0] : info["data_offsets"][1]])
        for name, info in header.items()
        if name != "__metadata__"
    }


def digest(path: Path) -> str:
    """sha256 over the names, dtypes, shapes and bytes of the non-`mtp.*` tensors of `path`, in name order: the same
    for a checkpoint before and after an MTP layer is added."""
    h = hashlib.sha256()
    for name, (info, raw) in sorted(tensor_bytes(path).items()):
        if not name.startswith(MTP_PREFIX):
            h.update(json.dumps([name, info["dtype"], info["shape"]]).encode())
            h.update(raw)
    return h.hexdigest()


def merge(base: Path, mtp: Path, out: Path) -> None:
    """Writes `out`: the non-`mtp.*` tensors of `base` (bytes and header entries unchanged, in their order) followed
    by every tensor of `mtp`, which must all be `mtp.*`. `base`'s metadata is kept. `out` may be `base`."""
    old = tensor_bytes(base)
    new = tensor_bytes(mtp)
    stray = [n for n in new if not n.startswith(MTP_PREFIX)]
    if stray:
        raise SystemExit(f"{mtp}: tensors outside {MTP_PREFIX}*: {stray[:5]}")
    metadata = read_header(base)[0].get("__metadata__")
    kept = sorted(((n, t) for n, t in old.items() if not n.startswith(MTP_PREFIX)),
                  key=lambda item: item[1][0]["data_offsets"][0])
    header, chunks, offset = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (info, raw) in kept + sorted(new.items()):
        header[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for c in chunks:
            f.write(c)
    os.replace(tmp, out)


def with_mtp_fields(config: dict) -> dict:
    """`config` (a default model's config.json) declaring one MTP layer: Qwen's `mtp_num_hidden_layers`; for
    Nemotron-H `num_nextn_predict_layers` and `mtp_layers_block_type` [attention, dense MLP] (the published
    pattern's MoE would dwarf these dense models)."""
    out = dict(config)
    if config["model_type"] == "nemotron_h":
        out["num_nextn_predict_layers"] = 1
        out["mtp_layers_block_type"] = ["full_attention", "mlp"]
    elif config["model_type"].startswith("qwen3_5"):
        out["mtp_num_hidden_layers"] = 1
    else:
        raise SystemExit(f"no MTP layout for model_type {config['model_type']!r}")
    return out


def write_config(config: dict, path: Path) -> None:
    path.write_text(json.dumps(config, indent=2) + "\n")


def install(result: Path, dest: Path) -> None:
    """Adds the MTP layer in `result` (mtp.safetensors, mtp_summary.json) to the checkpoint `dest`, in place."""
    summary = json.loads((result / "mtp_summary.json").read_text())
    model = dest / "model.safetensors"
    have = digest(model)
    if have != summary["base_tensors_sha256"]:
        raise SystemExit(f"{dest}: its tensors (sha256 {have[:16]}…) are not the ones the MTP layer in {result} was "
                         f"trained on ({summary['base_tensors_sha256'][:16]}…)")
    merge(model, result / "mtp.safetensors", model)
    write_config(with_mtp_fields(json.loads((dest / "config.json").read_text())), dest / "config.json")
    if digest(model) != have:
        raise SystemExit(f"{model}: the base tensors changed while merging")
    acc = summary.get("heldout", {}).get("expected_accepted")
    print(f"installed {result / 'mtp.safetensors'} into {dest} ({len(tensor_bytes(result / 'mtp.safetensors'))} "
          f"mtp tensors; held-out expected accepted drafts at T={summary['args']['steps']}: {acc})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="src", required=True, help="where run_gpu_mtp.sh's files came back")
    ap.add_argument("--into", default=str(Path(__file__).resolve().parents[2] / "models" / "default"))
    ap.add_argument("--archs", default="nemotron_h qwen3_5")
    a = ap.parse_args()
    src = Path(a.src)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in a.archs.split():
            archive = src / f"{arch}_mtp.tar.xz"
            if archive.exists():
                with tarfile.open(archive) as t:
                    t.extractall(tmp, filter="data")
                result = Path(tmp) / arch
            else:
                result = src / arch
            if not (result / "mtp.safetensors").exists():
                sys.exit(f"neither {archive} nor {result}/mtp.safetensors exists")
            install(result, Path(a.into) / arch)


if __name__ == "__main__":
    main()
