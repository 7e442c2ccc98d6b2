#!/usr/bin/env python3
"""Trains a multi-token-prediction (MTP) layer for a trained checkpoint (kept frozen) on the training corpus, and
writes the checkpoint with it in the family's published layout (what rewind's `--spec mtp` loads; see
engine/src/model/mtp.rs):

  qwen3_5     mtp.fc, mtp.pre_fc_norm_{embedding,hidden}, mtp.layers.0.* (the family's full-attention decoder layer:
              gated attention, q/k norm, partial RoPE, dense SwiGLU MLP), mtp.norm; zero-centred norms
  nemotron_h  mtp.layers.0.{enorm,hnorm,eh_proj,norm,mixer.*} (attention), mtp.layers.1.{norm,mixer.*,final_layernorm}
              (the main model's dense ReLU² MLP): mtp_layers_block_type ["full_attention", "mlp"]

One MTP step: out = norm(layer(fc([norm_e(embed(x[t+1])), norm_h(h[t])]))), where h[t] is the target's hidden state
after its final norm, and out, through the target's LM head, predicts x[t+2]. Drafting repeats the step on its own
output: draft k + 1 comes from (out of step k, draft k), attending over the committed rows' keys and the earlier draft
steps of the same position, exactly as rewind's MtpDrafter runs it. Training unrolls `--steps` such steps with that
attention mask (teacher-forced tokens) and weights step k's loss by `--step-weight`^(k-1). The loss mixes the corpus's
next token with the target's own distribution at that position (`--distill`): drafts are accepted when they equal the
target's choice, not the corpus's.

The decoder layer is built from transformers' own classes of the family (Qwen3_5DecoderLayer, NemotronHBlock), so its
numerics are the reference's, and starts from the target's last attention and MLP layers. The target's hidden states
are computed once for the whole corpus (non-overlapping `--seq` windows) and kept; training then runs only the MTP
layer and the LM head, AdamW with warmup and cosine decay over the time budget. The held-out split is evaluated every
`--eval-every-s`; the best weights by held-out expected accepted drafts are kept.

  python3 scripts/train/train_mtp.py --ckpt models/default/qwen3_5 --out /tmp/mtp/qwen3_5 --minutes 2.5
  python3 scripts/train/train_mtp.py --ckpt models/default/nemotron_h --out /tmp/m --max-steps 20 \\
      --train-tokens 20000 --eval-tokens 4000 --batch 4 --seq 64        # CPU smoke test

Writes to --out: the checkpoint (every file of --ckpt; model.safetensors = the original tensors byte for byte plus the
`mtp.*` tensors in bf16; config.json with the MTP fields), mtp.safetensors (the new tensors alone, what
install_mtp.py merges into another copy), mtp_loss.csv, mtp_summary.json.
"""
import argparse
import copy
import csv
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from install_mtp import digest, merge, with_mtp_fields, write_config  # noqa: E402
from train import load_stream  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# The MTP layer: module attribute names are the checkpoint's tensor names under `mtp.`.
# ---------------------------------------------------------------------------------------------------------------


class QwenMtp(nn.Module):
    """Qwen3.5's MTP layer (vLLM's Qwen3NextMultiTokenPredictor layout)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import (
            Qwen3_5DecoderLayer, Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding)

        cfg = copy.deepcopy(config)
        cfg.layer_types, cfg.num_hidden_layers = ["full_attention"], 1
        cfg._attn_implementation = "sdpa"
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(cfg, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps)
        self.rotary = Qwen3_5TextRotaryEmbedding(cfg)  # no weights

    def forward(self, emb, hidden, positions, mask):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        # Text positions: the three M-RoPE streams are equal.
        pe = self.rotary(x, positions[None].expand(3, *positions.shape))
        return self.norm(self.layers[0](x, position_embeddings=pe, attention_mask=mask))

    def warm_start(self, model):
        """The decoder layer starts as the target's last full-attention layer (same classes and shapes)."""
        kinds = model.config.layer_types
        last = max(i for i, k in enumerate(kinds) if k == "full_attention")
        self.layers[0].load_state_dict(model.model.layers[last].state_dict())


class NemotronMtp(nn.Module):
    """Nemotron-H's MTP layer (vLLM's NemotronHMultiTokenPredictor layout) with the pattern attention, dense MLP."""

    PATTERN = ["full_attention", "mlp"]

    def __init__(self, config):
        super().__init__()
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock, NemotronHRMSNorm

        cfg = copy.deepcopy(config)
        cfg.layers_block_type = list(self.PATTERN)
        cfg._attn_implementation = "sdpa"
        h, eps = config.hidden_size, config.layer_norm_epsilon
        self.layers = nn.ModuleList([NemotronHBlock(cfg, i) for i in range(len(self.PATTERN))])
        first, last = self.layers[0], self.layers[-1]
        first.enorm = NemotronHRMSNorm(h, eps)
        first.hnorm = NemotronHRMSNorm(h, eps)
        first.eh_proj = nn.Linear(2 * h, h, bias=False)
        last.final_layernorm = NemotronHRMSNorm(h, eps)

    def forward(self, emb, hidden, positions, mask):  # Nemotron-H attention has no position encoding
        first, last = self.layers[0], self.layers[-1]
        x = first.eh_proj(torch.cat([first.enorm(emb), first.hnorm(hidden)], dim=-1))
        x = first(x, attention_mask=mask)
        for block in self.layers[1:]:
            x = block(x)
        return last.final_layernorm(x)

    def warm_start(self, model):
        """Each block starts as the target's last block of its kind (norm and mixer)."""
        kinds = model.config.layers_block_type
        for block, kind in zip(self.layers, self.PATTERN):
            src = model.model.layers[max(i for i, k in enumerate(kinds) if k == kind)]
            block.norm.load_state_dict(src.norm.state_dict())
            block.mixer.load_state_dict(src.mixer.state_dict())


def build_mtp(model) -> nn.Module:
    kind = model.config.model_type
    if kind == "nemotron_h":
        mtp = NemotronMtp(model.config)
    elif kind.startswith("qwen3_5"):
        mtp = QwenMtp(model.config)
    else:
        raise SystemExit(f"no MTP layout for model_type {kind!r}")
    std = model.config.initializer_range
    for m in mtp.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
    mtp.warm_start(model)
    return mtp


def draft_mask(steps: int, rows: int, device) -> torch.Tensor:
    """[steps·rows]² attention mask (True = attend) of `steps` unrolled MTP steps over `rows` positions, rows in
    step-major order. Step 1's row i sees step 1's rows j <= i (the committed rows). Step k > 1's row i is the (k-1)-th
    draft after position i: it sees step 1's rows j <= i and steps 2..k of row i, as the drafter's KV holds them."""
    step = torch.arange(steps, device=device).repeat_interleave(rows)
    pos = torch.arange(rows, device=device).repeat(steps)
    committed = (step[None, :] == 0) & (pos[None, :] <= pos[:, None])
    same_draft = (step[None, :] > 0) & (step[None, :] <= step[:, None]) & (pos[None, :] == pos[:, None])
    return committed | same_draft


def unrolled(mtp, embed, hidden, tokens, steps, mask):
    """Runs `steps` MTP steps for every row: hidden [B, L, H] (the target's), tokens [B, L + steps] (tokens[:, k + i] is
    step k + 1's input at row i). Returns outputs [steps, B, L, H]. Step k's inputs are step k - 1's outputs from the
    previous pass (without gradient: each step is trained on its own loss)."""
    b, l, _ = hidden.shape
    emb = embed(torch.stack([tokens[:, k + 1 : k + 1 + l] for k in range(steps)]))  # [steps, B, L, H]
    base = torch.arange(l, device=hidden.device)
    positions = torch.cat([base + k for k in range(steps)])[None].expand(b, -1)  # step k's row i: position i + k
    ins = [hidden]
    for k in range(1, steps + 1):
        with torch.set_grad_enabled(torch.is_grad_enabled() and k == steps):
            n = k * l
            out = mtp(emb[:k].transpose(0, 1).reshape(b, n, -1), torch.cat(ins, dim=1), positions[:, :n],
                      mask[:n, :n][None, None])
        if k < steps:
            ins.append(out[:, (k - 1) * l : k * l].detach())
    return out.view(b, steps, l, -1).transpose(0, 1)


# ---------------------------------------------------------------------------------------------------------------
# Data: the target's hidden states, once.
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def target_hidden(model, stream, seq, batch, device, amp) -> torch.Tensor:
    """The target's hidden state after its final norm at every position of `stream` [N, H] (bf16 on `device`),
    computed over non-overlapping windows of `seq` tokens."""
    h = model.config.hidden_size
    out = torch.empty(stream.numel(), h, dtype=torch.bfloat16, device=device)
    starts = list(range(0, stream.numel(), seq))
    for i in range(0, len(starts), batch):
        group = starts[i : i + batch]
        full = [s for s in group if s + seq <= stream.numel()]
        if full:
            x = torch.stack([stream[s : s + seq] for s in full]).to(device)
            with amp():
                hs = model.model(input_ids=x, use_cache=False).last_hidden_state
            for j, s in enumerate(full):
                out[s : s + seq] = hs[j].to(torch.bfloat16)
        for s in group:  # the stream's tail, shorter than a window
            if s + seq > stream.numel():
                with amp():
                    tail = model.model(input_ids=stream[s:][None].to(device), use_cache=False).last_hidden_state
                    out[s:] = tail[0].to(torch.bfloat16)
    return out


def windows(stream, hidden, starts, seq, steps):
    """Rows starting at `starts`: the target's hidden rows [B, seq + steps, H] (the last `steps` for the distillation
    targets) and tokens [B, seq + steps + 1]."""
    idx = starts[:, None] + torch.arange(seq + steps + 1, device=starts.device)
    return hidden[idx[:, :-1]].float(), stream[idx]


def losses(mtp, model, hid, tok, seq, steps, mask, distill, step_weight, amp):
    """Weighted MTP loss over `steps` unrolled steps, and per step (pred [B, L], corpus next [B, L], target greedy
    [B, L]) for the metrics."""
    head = model.get_output_embeddings()
    with amp():
        outs = unrolled(mtp, model.get_input_embeddings(), hid[:, :seq], tok, steps, mask)
    total, picks = 0.0, []
    for k in range(steps):
        with amp():
            logits = head(outs[k]).float()
            with torch.no_grad():
                target = head(hid[:, k + 1 : k + 1 + seq]).float()  # the target's distribution for that token
        corpus = tok[:, k + 2 : k + 2 + seq]
        logp = torch.log_softmax(logits, -1)
        ce = nn.functional.nll_loss(logp.flatten(0, 1), corpus.flatten())
        kd = -(torch.softmax(target, -1) * logp).sum(-1).mean()
        total = total + step_weight**k * ((1 - distill) * ce + distill * kd)
        picks.append((logits.argmax(-1), corpus, target.argmax(-1)))
    return total, picks


@torch.no_grad()
def evaluate(mtp, model, stream, hidden, a, mask, amp, device):
    """Held-out metrics over non-overlapping windows: per step, top-1 accuracy on the corpus's token and agreement
    with the target's greedy token; `expected_accepted`: the mean count of leading steps agreeing with the target
    (drafts a greedy verify of window `steps` would accept, with teacher-forced inputs)."""
    mtp.eval()
    n = (stream.numel() - a.steps - 2) // a.seq
    if a.eval_tokens:
        n = min(n, max(1, a.eval_tokens // a.seq))
    hits = torch.zeros(a.steps, device=device)
    agree = torch.zeros(a.steps, device=device)
    chain = torch.zeros((), device=device)
    rows, loss = 0, 0.0
    for i in range(0, n, a.batch):
        starts = torch.arange(i, min(i + a.batch, n), device=device) * a.seq
        hid, tok = windows(stream, hidden, starts, a.seq, a.steps)
        l, picks = losses(mtp, model, hid, tok, a.seq, a.steps, mask, a.distill, a.step_weight, amp)
        alive = torch.ones_like(picks[0][0], dtype=torch.bool)
        for k, (pred, corpus, greedy) in enumerate(picks):
            hits[k] += (pred == corpus).sum()
            agree[k] += (pred == greedy).sum()
            alive &= pred == greedy
            chain += alive.sum()
        rows += picks[0][0].numel()
        loss += l.item() * picks[0][0].numel()
    mtp.train()
    return {
        "loss": loss / rows,
        "top1": [round(x, 4) for x in (hits / rows).tolist()],
        "agree": [round(x, 4) for x in (agree / rows).tolist()],
        "expected_accepted": round(chain.item() / rows, 4),
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="trained checkpoint dir (config.json, model.safetensors, tokenizer)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=2.5, help="training wall budget (data, eval, save not included)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0 = time budget only)")
    ap.add_argument("--steps", type=int, default=3, help="MTP steps unrolled in training (draft depth)")
    ap.add_argument("--step-weight", type=float, default=0.5, help="step k's loss is weighted by this^(k-1)")
    ap.add_argument("--distill", type=float, default=0.5,
                    help="loss weight of the target's distribution (the rest: the corpus's token)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every-s", type=float, default=15.0)
    ap.add_argument("--train-tokens", type=int, default=0, help="use only the first N training tokens (0 = all)")
    ap.add_argument("--eval-tokens", type=int, default=0, help="evaluate on the first N held-out tokens (0 = all)")
    ap.add_argument("--data", default=str(HERE / "data"))
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()

    t_start = time.time()
    torch.manual_seed(a.seed)
    device = torch.device("cuda" if (a.device == "auto" and torch.cuda.is_available()) else
                          ("cpu" if a.device == "auto" else a.device))
    use_amp = device.type == "cuda"
    if use_amp:
        torch.backends.cuda.matmul.allow_tf32 = True

    def amp():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_amp else torch.autocast("cpu", enabled=False)

    import transformers
    from tokenizers import Tokenizer

    ckpt, out = Path(a.ckpt), Path(a.out)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    train_stream = load_stream(Path(a.data) / "train.jsonl.xz", tok)
    val_stream = load_stream(Path(a.data) / "valid.jsonl.xz", tok)
    if a.train_tokens:
        train_stream = train_stream[: a.train_tokens]
    if a.eval_tokens:
        val_stream = val_stream[: a.eval_tokens + a.steps + 2]
    train_stream, val_stream = train_stream.to(device), val_stream.to(device)

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(device).eval()
    model.requires_grad_(False)
    t0 = time.time()
    train_h = target_hidden(model, train_stream, a.seq, a.batch, device, amp)
    val_h = target_hidden(model, val_stream, a.seq, a.batch, device, amp)
    print(f"[data] {model.config.model_type}: hidden states of {train_stream.numel()} training and "
          f"{val_stream.numel()} held-out tokens in {time.time() - t0:.1f}s", flush=True)

    mtp = build_mtp(model).to(device).train()
    n_params = sum(p.numel() for p in mtp.parameters())
    print(f"[mtp] {n_params / 1e6:.3f}M parameters, {len(mtp.state_dict())} tensors; {a.steps} steps unrolled, "
          f"distill {a.distill}, on {device}", flush=True)
    mask = draft_mask(a.steps, a.seq, device)
    decay = [p for p in mtp.parameters() if p.dim() >= 2]
    no_decay = [p for p in mtp.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    budget = a.minutes * 60.0

    def lr_at(step, frac):
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    out.mkdir(parents=True, exist_ok=True)
    fcsv = open(out / "mtp_loss.csv", "w", newline="")
    w = csv.writer(fcsv)
    w.writerow(["step", "seconds", "lr", "train_loss", "val_loss", "val_expected_accepted", "val_agree"])
    gen = torch.Generator(device=device).manual_seed(a.seed)
    n_starts = train_stream.numel() - a.seq - a.steps - 1
    best = evaluate(mtp, model, val_stream, val_h, a, mask, amp, device)
    best_state, best_step = copy.deepcopy(mtp.state_dict()), 0
    print(f"[eval] step 0 (warm start) {json.dumps(best)}", flush=True)
    step, last_eval, t0 = 0, 0.0, time.time()
    while True:
        el = time.time() - t0
        if el >= budget or (a.max_steps and step >= a.max_steps):
            break
        frac = step / a.max_steps if a.max_steps else el / budget
        lr = lr_at(step, frac)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n_starts, (a.batch,), device=device, generator=gen)
        hid, tok_b = windows(train_stream, train_h, starts, a.seq, a.steps)
        loss, _ = losses(mtp, model, hid, tok_b, a.seq, a.steps, mask, a.distill, a.step_weight, amp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), a.clip)
        opt.step()
        step += 1
        el = time.time() - t0
        last = a.max_steps and step >= a.max_steps
        if step % 20 == 0 or step <= 2 or last or el - last_eval >= a.eval_every_s:
            li = loss.item()
            if not math.isfinite(li):
                sys.exit(f"[train] loss is {li} at step {step}; stopping")
            row = [step, f"{el:.1f}", f"{lr:.3e}", f"{li:.4f}", "", "", ""]
            msg = f"[train] step {step:5d} {el:6.1f}s lr {lr:.2e} loss {li:.4f}"
            if el - last_eval >= a.eval_every_s or last or el >= budget:
                last_eval = el
                m = evaluate(mtp, model, val_stream, val_h, a, mask, amp, device)
                row[4:] = [f"{m['loss']:.4f}", m["expected_accepted"], " ".join(map(str, m["agree"]))]
                msg += f" | held-out loss {m['loss']:.4f} agree {m['agree']} expected accepted {m['expected_accepted']}"
                if m["expected_accepted"] > best["expected_accepted"]:
                    best, best_state, best_step = m, copy.deepcopy(mtp.state_dict()), step
            w.writerow(row)
            fcsv.flush()
            print(msg, flush=True)
    train_s = time.time() - t0
    final = evaluate(mtp, model, val_stream, val_h, a, mask, amp, device)
    if final["expected_accepted"] > best["expected_accepted"]:
        best, best_state, best_step = final, copy.deepcopy(mtp.state_dict()), step
    fcsv.close()
    mtp.load_state_dict(best_state)
    print(f"[train] {step} steps in {train_s:.1f}s; keeping step {best_step}: {json.dumps(best)}", flush=True)

    # The checkpoint: every file of --ckpt, the MTP tensors (bf16) merged into model.safetensors, the MTP fields.
    from safetensors.torch import save_file

    for f in ckpt.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    tensors = {f"mtp.{k}": v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in mtp.state_dict().items()}
    save_file(tensors, out / "mtp.safetensors", metadata={"format": "pt"})
    merge(ckpt / "model.safetensors", out / "mtp.safetensors", out / "model.safetensors")
    write_config(with_mtp_fields(json.loads((ckpt / "config.json").read_text())), out / "config.json")
    base_digest = digest(ckpt / "model.safetensors")
    assert digest(out / "model.safetensors") == base_digest, "the base tensors changed"

    # Reload: transformers still loads the model (mtp.* ignored), and the bf16 MTP tensors evaluate as trained.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device)
    same = all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), reloaded.state_dict().values()))
    mtp.load_state_dict({k[len("mtp."):]: v.float() for k, v in tensors.items()})
    bf16 = evaluate(mtp, model, val_stream, val_h, a, mask, amp, device)
    print(f"[reload] transformers loads {out} (target weights {'unchanged' if same else 'CHANGED'}); bf16 MTP "
          f"held-out: {json.dumps(bf16)}", flush=True)
    if not same:
        sys.exit("the reloaded target differs from the original")
    summary = {
        "ckpt": str(ckpt),
        "model_type": model.config.model_type,
        "mtp_parameters": n_params,
        "mtp_tensors": {k: list(v.shape) for k, v in tensors.items()},
        "base_tensors_sha256": base_digest,
        "train_tokens": int(train_stream.numel()),
        "heldout_tokens": int(val_stream.numel()),
        "steps_run": step,
        "saved_step": best_step,
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "heldout": best,
        "heldout_bf16": bf16,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "args": vars(a),
    }
    (out / "mtp_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[done] {out} in {time.time() - t_start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
