#!/usr/bin/env python3
"""Checks that rewind drafts with a checkpoint's MTP layer exactly as PyTorch does: greedy speculative decoding is
simulated in PyTorch (the target from transformers, the MTP layer as train_mtp.py builds it, loaded from the
checkpoint's `mtp.*` tensors) and compared with `rewind generate --spec mtp --temperature 0 --ignore-eos --json` on
held-out prompts: the generated tokens and the drafted / accepted / verify-step counters must be equal. Since every
verify's acceptance depends on the drafts, equal counters over many steps mean equal drafts.

The simulation follows rewind's coordinator: the prompt's step gives the first token; each later step drafts
min(T, remaining - 1) tokens (none: a plain decode) from the MTP layer run over every committed row (the target's
hidden states after its final norm, each with the token after it) and then on its own outputs; the verify accepts the
drafts that equal the target's greedy tokens, plus the target's token after them.

  python3 scripts/train/check_mtp_rewind.py --model /tmp/mtp/qwen3_5 [--rewind target/release/rewind]
"""
import argparse
import json
import lzma
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train_mtp import build_mtp  # noqa: E402


def load(model_dir: Path):
    import transformers
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mtp = build_mtp(model).eval()
    tensors = load_file(model_dir / "model.safetensors")
    mtp.load_state_dict({k[len("mtp."):]: v.float() for k, v in tensors.items() if k.startswith("mtp.")})
    return model, mtp


@torch.no_grad()
def simulate(model, mtp, prompt: list[int], window: int, max_tokens: int):
    """Greedy speculative decoding as rewind runs it: (generated tokens, drafted, accepted, verify steps)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()

    def target(seq):  # hidden rows after the final norm, greedy token after each position
        h = model.model(input_ids=torch.tensor([seq]), use_cache=False).last_hidden_state[0]
        return h, head(h).argmax(-1).tolist()

    def mtp_last(hidden, tokens):  # the MTP output of the last row, one causal pass from position 0
        n = hidden.shape[0]
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        return mtp(embed(torch.tensor([tokens])), hidden[None], torch.arange(n)[None], mask)[0, -1]

    seq = list(prompt)
    seq.append(target(seq)[1][-1])
    drafted = accepted = steps = 0
    while len(seq) - len(prompt) < max_tokens:
        m = min(window, max_tokens - (len(seq) - len(prompt)) - 1)
        if m == 0:
            seq.append(target(seq)[1][-1])
            continue
        h, _ = target(seq)
        rows, toks = list(h[:-1]), seq[1:]
        drafts = []
        x = mtp_last(torch.stack(rows), toks)
        while True:
            drafts.append(int(head(x).argmax()))
            if len(drafts) == m:
                break
            rows.append(x)
            toks = toks + [drafts[-1]]
            x = mtp_last(torch.stack(rows), toks)
        greedy = target(seq + drafts)[1][len(seq) - 1 :]
        k = 0
        while k < m and drafts[k] == greedy[k]:
            k += 1
        seq += drafts[:k] + [greedy[k]]
        drafted, accepted, steps = drafted + m, accepted + k, steps + 1
    return seq[len(prompt):], drafted, accepted, steps


def held_out_prompts(n: int, chars: int) -> list[str]:
    """The first `chars` characters (cut at a space) of `n` held-out chapters spread over the split."""
    with lzma.open(HERE / "data" / "valid.jsonl.xz", "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f if line.strip()]
    step = max(1, len(docs) // n)
    return [d[:chars].rsplit(" ", 1)[0] for d in docs[::step][:n]]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint dir with mtp.* tensors")
    ap.add_argument("--rewind", default=str(HERE.parents[1] / "target" / "release" / "rewind"))
    ap.add_argument("--windows", default="1,3,4")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-chars", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=24)
    a = ap.parse_args()

    from tokenizers import Tokenizer

    model_dir = Path(a.model)
    model, mtp = load(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    failures = 0
    for i, text in enumerate(held_out_prompts(a.prompts, a.prompt_chars)):
        prompt = tok.encode(text, add_special_tokens=False).ids
        for window in map(int, a.windows.split(",")):
            with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
                f.write(text + "\n")  # rewind drops one trailing newline of a prompt file
                f.flush()
                run = subprocess.run([a.rewind, "generate", "--model", str(model_dir), "--prompt-file", f.name,
                                      "--temperature", "0", "--ignore-eos", "--max-tokens", str(a.max_tokens),
                                      "--spec", "mtp", "--spec-window", str(window), "--json"],
                                     capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"rewind failed:\n{run.stderr}")
            got = json.loads(run.stdout)
            spec = got["stats"]["spec"]
            want = simulate(model, mtp, prompt, window, a.max_tokens)
            have = (got["tokens"], spec["drafted"], spec["accepted"], spec["steps"])
            ok = got["stats"]["prompt_tokens"] == len(prompt) and have == want
            failures += not ok
            print(f"prompt {i} T={window}: {'OK  ' if ok else 'DIFF'} drafted/accepted/steps "
                  f"rewind {have[1:]} pytorch {want[1:]}" + ("" if ok else f"\n  rewind  {have[0]}\n  pytorch {want[0]}"))
    print(f"{failures} of {a.prompts * len(a.windows.split(','))} runs differ")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
