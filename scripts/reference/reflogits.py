"""Shared by make_fixtures.py and check_checkpoint.py: the prefill + cached-decode logits protocol."""

from __future__ import annotations

import torch


def _sig(x: float) -> float:
    """Round to 7 significant digits (f32 carries ~7.2)."""
    return float(f"{x:.7g}")


def round_list(rows: list[list[float]]) -> list[list[float]]:
    return [[_sig(v) for v in row] for row in rows]


@torch.no_grad()
def reference_logits(model, tokens: list[int], prefill_len: int) -> dict:
    """Logits for `tokens` the way a serving engine produces them.

    Positions 0..prefill_len come from one forward over the prompt (use_cache=True); each later position t from a
    single-token forward at position t that feeds back the cache object returned by the previous call. `full_logits`
    is one cache-less forward over all tokens. Returns both plus their agreement (per position, the max absolute
    difference divided by the max absolute logit of that position).
    """
    if not 1 <= prefill_len <= len(tokens):
        raise ValueError(f"prefill_len {prefill_len} must be in 1..{len(tokens)}")
    ids = torch.tensor([tokens], dtype=torch.long)

    full = model(input_ids=ids, use_cache=False).logits[0].float()

    out = model(input_ids=ids[:, :prefill_len], use_cache=True)
    rows = [out.logits[0].float()]
    cache = out.past_key_values
    for t in range(prefill_len, len(tokens)):
        out = model(
            input_ids=ids[:, t : t + 1],
            past_key_values=cache,
            use_cache=True,
            position_ids=torch.tensor([[t]], dtype=torch.long),
        )
        cache = out.past_key_values
        rows.append(out.logits[0].float())
    stepped = torch.cat(rows, dim=0)

    if not (torch.isfinite(full).all() and torch.isfinite(stepped).all()):
        raise RuntimeError("non-finite logits")
    diff = (stepped - full).abs().amax(dim=-1)
    scale = full.abs().amax(dim=-1).clamp_min(1e-30)
    rel = diff / scale
    check = {
        "max_abs_diff": float(diff.max()),
        "max_rel_diff": float(rel.max()),
        "prefill_max_rel_diff": float(rel[:prefill_len].max()),
        "decode_max_rel_diff": float(rel[prefill_len:].max()) if len(tokens) > prefill_len else 0.0,
        "max_abs_logit": float(full.abs().max()),
    }
    return {"logits": stepped.tolist(), "full_logits": full.tolist(), "self_check": check}
