#!/usr/bin/env python3
"""Trains a small hybrid-SSM LM (Nemotron-H or Qwen3.5) on the cleaned corpus for a fixed wall-clock budget.

Uses transformers' own model classes built from a config (the sizes of rewind's init-model presets, scaled down),
bf16 autocast on CUDA, AdamW + warmup + cosine decay over the *time* budget, random 256-token windows from the
training stream (documents joined by <|endoftext|>), periodic held-out evaluation, keeps the best-validation
weights, and saves an ordinary HF checkpoint in bf16 (config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) that both transformers and rewind load.

  python3 scripts/train/train.py --arch nemotron_h --minutes 3.5 --out $OUT/nemotron_h
  python3 scripts/train/train.py --arch qwen3_5 --tiny --max-steps 5 --out /tmp/t   # CPU smoke test

Outputs in --out: the checkpoint files, loss.csv (step, seconds, tokens, lr, train loss, val loss),
summary.json, samples.txt, loss.png (if matplotlib is importable).
"""
import argparse
import copy
import csv
import json
import lzma
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
EOS_ID = 0  # <|endoftext|>: document separator, EOS and pad

# ---------------------------------------------------------------------------------------------------------------
# Model configs. Field sets follow what `rewind init-model --arch ... --preset small` writes; sizes are ours.
# ---------------------------------------------------------------------------------------------------------------


def nemotron_h_config(vocab: int, tiny: bool) -> dict:
    if tiny:
        pattern, hidden, heads, mheads, inter = "M-M*-", 64, 2, 2, 128
    else:
        # 14 layers: 7 Mamba-2 (8 heads x 64), 5 MLP (1024), 2 attention (4 q / 2 kv heads x 64): 9.42M parameters
        # with vocab 6144. Embeddings stay untied: transformers' NemotronHForCausalLM does not tie them.
        pattern, hidden, heads, mheads, inter = "M-M-M*-M-M-M*M", 256, 4, 8, 1024
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "hybrid_override_pattern": pattern,
        "num_hidden_layers": len(pattern),
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": 64 if not tiny else 32,
        "attention_bias": False,
        "intermediate_size": inter,
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "mamba_num_heads": mheads,
        "mamba_head_dim": 64 if not tiny else 64,
        "mamba_hidden_act": "silu",
        "n_groups": 2,
        "ssm_state_size": 64 if not tiny else 16,
        "conv_kernel": 4,
        "chunk_size": 64,
        "use_conv_bias": True,
        "use_bias": False,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "num_logits_to_keep": 1,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "use_cache": True,
    }


def qwen3_5_config(vocab: int, tiny: bool) -> dict:
    if tiny:
        kinds, hidden, heads, inter = ["linear_attention", "full_attention"], 64, 2, 128
    else:
        # 8 layers: 6 Gated-DeltaNet (2 key / 4 value heads x 64) + 2 full attention (4 q / 2 kv heads x 64), every
        # layer with a SwiGLU MLP (640); tied input/output embeddings: 9.54M parameters.
        kinds, hidden, heads, inter = (["linear_attention"] * 3 + ["full_attention"]) * 2, 320, 4, 640
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": len(kinds),
        "layer_types": kinds,
        "intermediate_size": inter,
        "hidden_act": "silu",
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": 64 if not tiny else 32,
        "attention_bias": False,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64 if not tiny else 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4 if not tiny else 2,
        "linear_value_head_dim": 64 if not tiny else 16,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000.0,
            "rope_type": "default",
        },
        "tie_word_embeddings": True,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "use_cache": True,
    }


def build_model(arch: str, vocab: int, tiny: bool):
    import transformers

    if arch == "nemotron_h":
        cfg_dict = nemotron_h_config(vocab, tiny)
        config = transformers.NemotronHConfig(**{k: v for k, v in cfg_dict.items() if k != "model_type"})
        model = transformers.NemotronHForCausalLM(config)
    elif arch == "qwen3_5":
        cfg_dict = qwen3_5_config(vocab, tiny)
        config = transformers.Qwen3_5TextConfig(**{k: v for k, v in cfg_dict.items() if k != "model_type"})
        model = transformers.Qwen3_5ForCausalLM(config)
    else:
        raise SystemExit(f"unknown --arch {arch}")
    return model


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def load_stream(path: Path, tok) -> torch.Tensor:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        texts = [json.loads(l)["text"] for l in f if l.strip()]
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def random_batch(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, batch: int, seq: int, device, amp, max_windows: int = 0) -> float:
    """Mean next-token loss over non-overlapping windows of the held-out stream."""
    model.eval()
    n = (stream.numel() - 1) // seq
    if max_windows:
        n = min(n, max_windows)
    tot, cnt = 0.0, 0
    for i in range(0, n, batch):
        rows = [stream[j * seq : j * seq + seq + 1] for j in range(i, min(i + batch, n))]
        x = torch.stack(rows).to(device)
        with amp():
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
        )
        tot += loss.item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / max(cnt, 1)


# ---------------------------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------------------------


def save_checkpoint(model, out: Path, tok_dir: Path):
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.use_cache = True
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, out / name)
    gen = {
        "bos_token_id": EOS_ID,
        "eos_token_id": [EOS_ID],
        "pad_token_id": EOS_ID,
        "do_sample": True,
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
        "repetition_penalty": 1.0,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def plot(csv_path: Path, png_path: Path, title: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # matplotlib is optional on the device machine
        print(f"[plot] matplotlib unavailable ({e}); CSV only", flush=True)
        return False
    try:
        steps, tr, vs, vl = [], [], [], []
        with open(csv_path) as f:
            for r in csv.DictReader(f):
                if r["train_loss"]:
                    steps.append(int(r["step"]))
                    tr.append(float(r["train_loss"]))
                if r["val_loss"]:
                    vs.append(int(r["step"]))
                    vl.append(float(r["val_loss"]))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.plot(steps, tr, label="train loss", lw=1)
        if vs:
            ax.plot(vs, vl, "o-", label="held-out loss", lw=1.5)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(png_path, dpi=110)
        plt.close(fig)
        return True
    except Exception as e:
        print(f"[plot] failed ({e}); CSV only", flush=True)
        return False


# ---------------------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, choices=["nemotron_h", "qwen3_5"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=3.5, help="training wall budget (eval/save not included)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0 = time budget only)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100, help="warmup steps")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--max-epochs", type=float, default=5.0,
                    help="also end (and finish the LR decay) after this many passes over the training stream (0 = off)")
    ap.add_argument("--eval-every-s", type=float, default=10.0, help="held-out eval every this many seconds")
    ap.add_argument("--data", default=str(HERE / "data"))
    ap.add_argument("--tokenizer", default=str(HERE / "tokenizer"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tiny", action="store_true", help="toy sizes for a CPU smoke test")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (off by default)")
    a = ap.parse_args()

    t_start = time.time()
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    device = torch.device("cuda" if (a.device == "auto" and torch.cuda.is_available()) else
                          ("cpu" if a.device == "auto" else a.device))
    use_amp = device.type == "cuda"
    if use_amp:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def amp():
        if use_amp:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    from tokenizers import Tokenizer

    tok_dir = Path(a.tokenizer)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    train_stream = load_stream(Path(a.data) / "train.jsonl.xz", tok)
    val_stream = load_stream(Path(a.data) / "valid.jsonl.xz", tok)
    print(f"[data] vocab {vocab}; train {train_stream.numel()} tokens, held-out {val_stream.numel()} tokens "
          f"({time.time() - t_start:.1f}s)", flush=True)

    model = build_model(a.arch, vocab, a.tiny).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    emb_in, emb_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    n_embed = emb_in.numel() + (0 if emb_out is emb_in else emb_out.numel())
    print(f"[model] embeddings {'tied' if emb_out is emb_in else 'untied'}", flush=True)
    print(f"[model] {a.arch}: {n_params / 1e6:.2f}M parameters ({(n_params - n_embed) / 1e6:.2f}M without "
          f"embeddings/head) on {device}", flush=True)
    model.train()
    fwd = torch.compile(model) if a.compile else model

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
    )
    budget = a.minutes * 60.0
    token_budget = a.max_epochs * train_stream.numel() if a.max_epochs > 0 else float("inf")

    def lr_at(step: int, frac: float) -> float:
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        frac = min(max(frac, 0.0), 1.0)
        return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "loss.csv"
    fcsv = open(csv_path, "w", newline="")
    w = csv.writer(fcsv)
    w.writerow(["step", "seconds", "tokens", "lr", "train_loss", "val_loss"])
    gen = torch.Generator().manual_seed(a.seed)
    eval_windows = 0 if not a.tiny else 8

    best = (float("inf"), -1, None)
    step, tokens, last_eval = 0, 0, 0.0
    t0 = time.time()
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or tokens >= token_budget or (a.max_steps and step >= a.max_steps):
            break
        if step > a.warmup and a.max_steps == 0:
            # LR decays over whichever budget (wall clock or epochs) runs out first.
            frac = max(elapsed / budget, tokens / token_budget)
        else:
            frac = step / max(a.max_steps, 1) if a.max_steps else 0.0
        lr = lr_at(step, frac)
        for g in opt.param_groups:
            g["lr"] = lr
        x = random_batch(train_stream, a.batch, a.seq, gen).to(device, non_blocking=True)
        with amp():
            logits = fwd(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        step += 1
        tokens += x[:, 1:].numel()
        if step % a.log_every == 0 or step <= 3:
            el = time.time() - t0
            li = loss.item()
            if not math.isfinite(li):
                sys.exit(f"[train] loss is {li} at step {step}; stopping")
            val = ""
            if el - last_eval >= a.eval_every_s:
                vl = evaluate(model, val_stream, a.batch, a.seq, device, amp, eval_windows)
                last_eval = el
                val = f"{vl:.4f}"
                if vl < best[0]:
                    best = (vl, step, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
            w.writerow([step, f"{el:.1f}", tokens, f"{lr:.3e}", f"{li:.4f}", val])
            fcsv.flush()
            print(f"[train] step {step:5d} {el:6.1f}s tok {tokens / 1e6:6.2f}M lr {lr:.2e} loss {li:.4f}"
                  + (f" val {val} (ppl {math.exp(float(val)):.1f})" if val else ""), flush=True)
    train_s = time.time() - t0

    final_val = evaluate(model, val_stream, a.batch, a.seq, device, amp, eval_windows)
    w.writerow([step, f"{train_s:.1f}", tokens, "", "", f"{final_val:.4f}"])
    fcsv.close()
    if final_val <= best[0]:
        best = (final_val, step, None)
    else:
        print(f"[train] held-out loss was best at step {best[1]} ({best[0]:.4f} < final {final_val:.4f}); "
              "saving those weights", flush=True)
        model.load_state_dict(best[2])
    best_val, best_step = best[0], best[1]
    print(f"[eval] final held-out loss {final_val:.4f} (ppl {math.exp(final_val):.2f}); saved weights: step "
          f"{best_step}, loss {best_val:.4f} (ppl {math.exp(best_val):.2f})", flush=True)

    save_checkpoint(model, out, tok_dir)

    # Reload the saved bf16 checkpoint through transformers' Auto classes: the round trip rewind's users rely on.
    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).to(device)
    reload_val = evaluate(reloaded, val_stream, a.batch, a.seq, device, lambda: torch.autocast("cpu", enabled=False),
                          eval_windows)
    print(f"[reload] bf16 checkpoint via AutoModelForCausalLM: held-out loss {reload_val:.4f} "
          f"(ppl {math.exp(reload_val):.2f})", flush=True)

    samples = []
    reloaded.eval()
    g = torch.Generator(device=device).manual_seed(a.seed)
    for prompt in ["Elizabeth", "In the beginning", "It is a truth universally acknowledged", "And he said unto"]:
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids], device=device)
        with torch.no_grad():
            for _ in range(60):
                logits = reloaded(input_ids=ids).logits[0, -1].float() / 0.8
                v, ix = torch.topk(logits, 40)
                nxt = ix[torch.multinomial(torch.softmax(v, -1), 1, generator=g)]
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
                if nxt.item() == EOS_ID:
                    break
        samples.append(f"--- {prompt!r}\n{tok.decode(ids[0].tolist(), skip_special_tokens=False)}\n")
    (out / "samples.txt").write_text("\n".join(samples))
    print("".join(samples), flush=True)

    plotted = plot(csv_path, out / "loss.png", f"{a.arch}: {n_params / 1e6:.1f}M params, {tokens / 1e6:.0f}M tokens")
    summary = {
        "arch": a.arch,
        "parameters": n_params,
        "parameters_without_embeddings": n_params - n_embed,
        "vocab_size": vocab,
        "train_tokens_in_corpus": int(train_stream.numel()),
        "heldout_tokens": int(val_stream.numel()),
        "steps": step,
        "tokens_seen": tokens,
        "epochs": tokens / train_stream.numel(),
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "final_heldout_loss": final_val,
        "saved_step": best_step,
        "saved_heldout_loss": best_val,
        "saved_heldout_ppl": math.exp(best_val),
        "reloaded_bf16_heldout_loss": reload_val,
        "reloaded_bf16_heldout_ppl": math.exp(reload_val),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "args": vars(a),
        "loss_png": plotted,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[done] {out} in {time.time() - t_start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
