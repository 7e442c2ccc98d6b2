#!/usr/bin/env python3
"""Load any checkpoint directory with transformers and write its reference logits.

    python scripts/reference/check_checkpoint.py DIR --tokens 1,2,3,4 --prefill 3 --out FILE.json [--compare OTHER.json]

DIR is loaded with `AutoModelForCausalLM.from_pretrained(DIR, dtype=float32)` (so a successful run also proves that
transformers accepts the checkpoint: config, tensor names and shapes; unexpected or missing tensors are reported and
make the run fail). FILE.json gets the fixture format of make_fixtures.py:
    {"tokens", "prefill_len", "logits", "full_logits", "self_check", ...}
where logits[0..prefill) come from one forward over the first `prefill` tokens and each later row from a
single-token forward reusing the returned cache. With --compare, OTHER.json (any file with "logits" rows for the
same tokens, e.g. the output of `rewind logits`) is compared row by row and the worst difference is printed; the exit
status is 1 if the relative difference exceeds --tol.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reflogits import reference_logits, round_list


def parse_tokens(text: str) -> list[int]:
    try:
        toks = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError as e:
        raise SystemExit(f"--tokens must be comma-separated integers: {e}") from None
    if not toks:
        raise SystemExit("--tokens is empty")
    return toks


def compare(ref_rows: list[list[float]], other_path: Path, tol: float) -> bool:
    other = json.loads(other_path.read_text())
    rows = other.get("logits")
    if not isinstance(rows, list) or len(rows) != len(ref_rows):
        raise SystemExit(f"{other_path}: expected {len(ref_rows)} logits rows, found {len(rows) if rows else 0}")
    a = torch.tensor(ref_rows, dtype=torch.float64)
    b = torch.tensor(rows, dtype=torch.float64)
    if a.shape != b.shape:
        raise SystemExit(f"{other_path}: logits shape {tuple(b.shape)} != reference {tuple(a.shape)}")
    diff = (a - b).abs().amax(dim=-1)
    rel = diff / a.abs().amax(dim=-1).clamp_min(1e-30)
    worst = int(rel.argmax())
    argmax_same = bool((a.argmax(-1) == b.argmax(-1)).all())
    print(
        f"compare {other_path}: max_abs={float(diff.max()):.3e} max_rel={float(rel.max()):.3e} "
        f"(worst position {worst}); argmax identical at every position: {argmax_same}"
    )
    return float(rel.max()) <= tol


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, help="checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    ap.add_argument("--prefill", type=int, required=True, help="number of tokens in the prefill forward")
    ap.add_argument("--out", type=Path, required=True, help="output JSON file")
    ap.add_argument("--compare", type=Path, help="JSON with 'logits' rows to compare against the reference")
    ap.add_argument("--tol", type=float, default=1e-4, help="relative tolerance for --compare (default 1e-4)")
    args = ap.parse_args()

    tokens = parse_tokens(args.tokens)
    if not 1 <= args.prefill <= len(tokens):
        raise SystemExit(f"--prefill must be in 1..{len(tokens)}")
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))

    model, info = AutoModelForCausalLM.from_pretrained(
        args.dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    model.eval()
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "mismatched_keys", "error_msgs")}
    unexpected = [k for k in info.get("unexpected_keys", []) if not k.startswith(("model.visual.", "mtp."))]
    if unexpected:
        problems["unexpected_keys"] = unexpected
    if problems:
        for k, v in problems.items():
            print(f"{k}: {sorted(v) if not isinstance(v, str) else v}", file=sys.stderr)
        raise SystemExit("checkpoint does not load cleanly in transformers")

    vocab = model.config.get_text_config().vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise SystemExit(f"token ids out of range 0..{vocab}: {bad}")

    res = reference_logits(model, tokens, args.prefill)
    out = {
        "checkpoint": str(args.dir),
        "model_class": type(model).__name__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokens": tokens,
        "prefill_len": args.prefill,
        "self_check": res["self_check"],
        "logits": round_list(res["logits"]),
        "full_logits": round_list(res["full_logits"]),
    }
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    sc = res["self_check"]
    print(
        f"{type(model).__name__}: {len(tokens)} tokens, prefill {args.prefill}; wrote {args.out}; "
        f"full vs prefill+decode max_rel={sc['max_rel_diff']:.3e}"
    )
    if args.compare is not None and not compare(res["logits"], args.compare, args.tol):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
