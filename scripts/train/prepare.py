#!/usr/bin/env python3
"""Cleans the raw text from fetch_data.sh, splits it, and trains the byte-level BPE tokenizer.

Outputs (committed, all small):
  data/train.jsonl.xz, data/valid.jsonl.xz   one JSON object {"src", "text"} per document (a chapter)
  tokenizer/tokenizer.json, tokenizer/tokenizer_config.json

Held-out split: the last 5 % of the chapters of each book (the Bible counts as one book, each novel as one),
so both sources are represented and no validation chapter sits between two training chapters.

The tokenizer mirrors rewind's own init-model builder (engine/src/tokenizer/bpe_builder.rs): GPT-2 ByteLevel
pre-tokenizer/decoder without prefix space, ids 0/1/2 = <|endoftext|>, <|im_start|>, <|im_end|>, then the 256 byte
symbols, then merges; trained on the training split only.

Usage: python3 scripts/train/prepare.py [--vocab 6144]   (needs: pip install tokenizers)
"""
import argparse
import json
import lzma
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{%- if bos_token %}{{- bos_token }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
AUSTEN = ["sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion"]


def norm(s: str) -> str:
    s = s.replace("\r", "")
    s = s.replace("_", "")  # _italics_ markers
    s = re.sub(r"[ \t]+", " ", s)
    return s.strip()


def kjv_docs(path: Path):
    """One document per chapter, one verse per line, references stripped."""
    chapters, cur_key, cur = [], None, []
    ref = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        m = ref.match(line.strip())
        if not m:
            continue
        key = (m.group(1), m.group(2))
        if key != cur_key and cur:
            chapters.append("\n".join(cur))
            cur = []
        cur_key = key
        cur.append(norm(m.group(4)))
    if cur:
        chapters.append("\n".join(cur))
    return chapters


def austen_docs(path: Path):
    """One document per chapter; wrapped lines joined into paragraphs; titles, VOLUME/CHAPTER headings dropped."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    heading = re.compile(r"^\s*(CHAPTER|Chapter)\s+([IVXLC]+|\d+)\.?\s*$")
    chapters, paras, para, started = [], [], [], False
    for line in lines + [""]:
        if heading.match(line):
            if para:
                paras.append(" ".join(para))
                para = []
            if started and paras:
                chapters.append("\n\n".join(paras))
            paras, started = [], True
            continue
        if not started:
            continue  # title page
        if re.match(r"^\s*(VOLUME|Volume)\s+[IVX]+\s*$", line) or re.match(r"^\s*(THE END|FINIS)\.?\s*$", line):
            continue
        if line.strip():
            para.append(norm(line))
        elif para:
            paras.append(" ".join(para))
            para = []
    if para:
        paras.append(" ".join(para))
    if paras:
        chapters.append("\n\n".join(paras))
    return [c for c in chapters if len(c) > 200]


def split(docs, frac=0.05):
    n_val = max(1, round(len(docs) * frac))
    return docs[:-n_val], docs[-n_val:]


def write_jsonl_xz(path: Path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(path, "wt", encoding="utf-8", preset=9) as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_jsonl_xz(path: Path):
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(l) for l in f if l.strip()]


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers, AddedToken

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    # Same post-processor rewind's builder uses (a no-op for ids; keeps offsets byte-level).
    from tokenizers import processors

    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )

    def paragraphs():
        for t in texts:
            for p in re.split(r"(?<=\n\n)", t):
                yield p

    tok.train_from_iterator(paragraphs(), trainer=trainer)
    have = tok.get_vocab_size(with_added_tokens=True)
    if have < vocab_size:  # keep the vocabulary exactly vocab_size, like rewind's builder
        tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(vocab_size - have)])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def write_tokenizer(tok, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    added = {}
    for i, t in sorted(tok.get_added_tokens_decoder().items()):
        added[str(i)] = {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                         "single_word": t.single_word, "special": t.special}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # Plain-text LM: documents are separated by <|endoftext|>, which is both EOS and pad; no BOS (Qwen style).
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1000000000000000000,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": added,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", default=str(HERE / "raw"))
    ap.add_argument("--data", default=str(HERE / "data"))
    ap.add_argument("--tokenizer-out", default=str(HERE / "tokenizer"))
    ap.add_argument("--vocab", type=int, default=6144)
    ap.add_argument("--tokenizer-only", action="store_true", help="reuse data/*.jsonl.xz, retrain the tokenizer")
    a = ap.parse_args()
    raw, data = Path(a.raw), Path(a.data)

    if not a.tokenizer_only:
        books = [("kjv", kjv_docs(raw / "kjv.txt"))]
        books += [(f"austen_{n}", austen_docs(raw / f"austen_{n}.txt")) for n in AUSTEN]
        train, valid = [], []
        for src, docs in books:
            if not docs:
                sys.exit(f"no documents parsed from {src}")
            tr, va = split(docs)
            train += [{"src": src, "text": d} for d in tr]
            valid += [{"src": src, "text": d} for d in va]
            print(f"{src:28s} {len(docs):5d} chapters  {sum(map(len, docs)):9d} chars  valid {len(va)}")
        write_jsonl_xz(data / "train.jsonl.xz", train)
        write_jsonl_xz(data / "valid.jsonl.xz", valid)
    train = read_jsonl_xz(data / "train.jsonl.xz")
    valid = read_jsonl_xz(data / "valid.jsonl.xz")
    print(f"train {len(train)} docs {sum(len(r['text']) for r in train)} chars; "
          f"valid {len(valid)} docs {sum(len(r['text']) for r in valid)} chars")

    tok = train_tokenizer([r["text"] for r in train], a.vocab)
    write_tokenizer(tok, Path(a.tokenizer_out))
    n_tr = sum(len(e.ids) for e in tok.encode_batch([r["text"] for r in train]))
    n_va = sum(len(e.ids) for e in tok.encode_batch([r["text"] for r in valid]))
    sample = "Emma Woodhouse, handsome, clever, and rich.\nIn the beginning God created the heaven and the earth."
    enc = tok.encode(sample)
    assert tok.decode(enc.ids, skip_special_tokens=False) == sample, "round trip failed"
    print(f"tokenizer vocab {a.vocab}: train {n_tr} tokens, valid {n_va} tokens "
          f"({sum(len(r['text']) for r in train) / max(n_tr, 1):.2f} chars/token); sample -> {len(enc.ids)} ids")


if __name__ == "__main__":
    main()
