#!/usr/bin/env python3
"""Writes tests/fixtures/mtp/<arch>/ for tests/tests/engine/mtp_parity.rs: a tiny random checkpoint (train.py's --tiny
sizes, vocabulary 256) carrying an MTP layer built by train_mtp.py (transformers' own layer classes), and
reference.json with what that layer computes in PyTorch (f32 from the bf16 weights):

  tokens         n token ids
  hidden         the target's hidden rows of positions 0..n-2, before its final norm (as rewind's ranks return them)
  outputs        the MTP layer's output of each row i (hidden i, token i + 1), one causal pass from position 0
  logits_last    the LM head over the last row's output (draft 1's logits)
  drafts         greedy drafts after the n tokens: draft k + 1 is the MTP step on (output of step k, draft k)
  draft_outputs  those steps' outputs

Every MTP weight is redrawn (norm weights away from their constructor values, so the zero-centred Qwen norms are
exercised); the draft logits' top-two margins are checked so that greedy picks cannot flip on rounding.

  python3 scripts/train/make_mtp_fixtures.py [--out tests/fixtures/mtp]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from install_mtp import merge, with_mtp_fields, write_config  # noqa: E402
from train import build_model  # noqa: E402
from train_mtp import build_mtp  # noqa: E402

VOCAB, TOKENS, DRAFTS = 256, 11, 4


def redraw(mtp, gen, zero_centred: bool):
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if p.dim() == 1:  # norm weights: around 0 for (1 + w) norms, around 1 otherwise
                p.copy_((torch.rand(p.shape, generator=gen) - 0.5) * 0.8 + (0.0 if zero_centred else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[1] ** -0.5))


def bf16_round(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


@torch.no_grad()
def mtp_rows(mtp, embed, hidden, tokens):
    """Outputs of one causal MTP pass over rows (hidden [N, H], tokens [N]) from position 0."""
    n = hidden.shape[0]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    return mtp(embed(tokens)[None], hidden[None], torch.arange(n)[None], mask)[0]


def make(arch: str, out: Path, seed: int):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build_model(arch, VOCAB, tiny=True).eval()
    for p in model.parameters():  # norms of the target away from 1 / 0 too: normalise_target uses the final norm
        if p.dim() == 1:
            with torch.no_grad():
                p.add_((torch.rand(p.shape, generator=gen) - 0.5) * 0.4)
    bf16_round(model)
    zero_centred = arch == "qwen3_5"
    mtp = build_mtp(model).eval()
    redraw(mtp, gen, zero_centred)
    bf16_round(mtp)

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.float()
    from safetensors.torch import save_file

    tensors = {f"mtp.{k}": v.to(torch.bfloat16).contiguous() for k, v in mtp.state_dict().items()}
    save_file(tensors, out / "mtp.safetensors", metadata={"format": "pt"})
    merge(out / "model.safetensors", out / "mtp.safetensors", out / "model.safetensors")
    (out / "mtp.safetensors").unlink()
    config = json.loads((out / "config.json").read_text())
    write_config(with_mtp_fields(config), out / "config.json")
    (out / "generation_config.json").unlink(missing_ok=True)

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    final_norm = model.model.norm if arch == "qwen3_5" else model.model.norm_f
    tokens = torch.randint(3, VOCAB, (TOKENS,), generator=gen)
    hidden = torch.randn(TOKENS - 1, model.config.hidden_size, generator=gen) * 2.0
    normed = final_norm(hidden)
    outputs = mtp_rows(mtp, embed, normed, tokens[1:])
    rows_h, rows_t = list(normed), list(tokens[1:])
    x, drafts, draft_outputs, margins = outputs[-1], [], [], []
    logits_last = head(x)
    for k in range(DRAFTS):
        logits = head(x)
        top = logits.topk(2).values
        margins.append(((top[0] - top[1]) / logits.abs().max()).item())
        d = int(logits.argmax())
        drafts.append(d)
        if k + 1 < DRAFTS:
            rows_h.append(x)
            rows_t.append(torch.tensor(d))
            x = mtp_rows(mtp, embed, torch.stack(rows_h), torch.stack(rows_t))[-1]
            draft_outputs.append(x)
    if min(margins) < 1e-3:
        raise SystemExit(f"{arch}: seed {seed} gives a near tie between draft logits ({min(margins):.2e}); pick another")

    def rows(t):
        return [[round(v, 7) for v in r] for r in torch.as_tensor(t).tolist()]

    reference = {
        "tokens": tokens.tolist(),
        "hidden": rows(hidden),
        "outputs": rows(outputs),
        "logits_last": [round(v, 7) for v in logits_last.tolist()],
        "drafts": drafts,
        "draft_outputs": rows(torch.stack(draft_outputs)),
        "seed": seed,
    }
    (out / "reference.json").write_text(json.dumps(reference) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{arch}: {out} ({size / 1024:.0f} KiB; {len(tensors)} mtp tensors; drafts {drafts}, "
          f"smallest top-2 margin {min(margins):.3f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE.parents[1] / "tests" / "fixtures" / "mtp"))
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    for arch in ("nemotron_h", "qwen3_5"):
        make(arch, Path(a.out) / arch, a.seed)


if __name__ == "__main__":
    main()
