use super::*;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use toktrie::TokTrie;

use crate::tokenizer::{Tokenizer, TokenizerConfig};

/// The tiny default model's tokenizer (GPT-2 byte-level BPE, 6144 ids plus three special added tokens).
fn default_tokenizer() -> Tokenizer {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/default/nemotron_h");
    Tokenizer::from_dir(dir).expect("the default model's tokenizer")
}

/// A SentencePiece-style tokenizer with byte fallback (as Llama's and Mistral's): `▁` for spaces, `<0xNN>` pieces.
fn byte_fallback_tokenizer() -> Tokenizer {
    let mut vocab = serde_json::Map::new();
    for (i, piece) in ["<unk>", "<s>", "</s>"].into_iter().enumerate() {
        vocab.insert(piece.into(), json!(i));
    }
    for b in 0..=255u32 {
        vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
    }
    for (i, piece) in ["▁", "a", "b", "▁a", "ab", "▁ab", "{", "}", "\"", ":", "1", "2"]
        .into_iter()
        .enumerate()
    {
        vocab.insert(piece.into(), json!(259 + i));
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": [["▁", "a"], ["a", "b"], ["▁a", "b"]]}
    });
    let inner = tokenizers::Tokenizer::from_bytes(tokenizer.to_string().as_bytes()).expect("tokenizer json");
    let config = TokenizerConfig {
        eos_token: Some("</s>".into()),
        bos_token: Some("<s>".into()),
        ..TokenizerConfig::default()
    };
    Tokenizer::from_parts(inner, config).expect("tokenizer")
}

fn compiler() -> (Tokenizer, GrammarCompiler) {
    let t = default_tokenizer();
    let eos = t.eos_token_id().expect("eos");
    // The model's rows are wider than the tokenizer's ids, as real checkpoints pad their vocabulary.
    let vocab = t.vocab_size() + 13;
    let c = GrammarCompiler::new(&t, vocab, &[eos]).expect("compiler");
    (t, c)
}

fn allowed(mask: &[u32]) -> Vec<u32> {
    (0..mask.len() * 32)
        .filter(|&i| (mask[i / 32] >> (i % 32)) & 1 == 1)
        .map(|i| i as u32)
        .collect()
}

/// Generates under `constraint` by picking uniformly among the allowed ids (a model that knows nothing: whatever
/// it picks, the grammar must keep the output valid) until EOS; returns the text.
fn random_walk(t: &Tokenizer, c: &GrammarCompiler, constraint: &Constraint, seed: u64) -> String {
    let eos = t.eos_token_id().expect("eos");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut state = constraint.start();
    let mut ids = Vec::new();
    for _ in 0..400 {
        let mask = state.mask(c.vocab()).expect("mask");
        let ok = allowed(&mask);
        assert!(ok.iter().all(|&id| (id as usize) < c.vocab()));
        // Prefer ending once the grammar allows it, half the time, so outputs stay short.
        let id = if ok.contains(&eos) && (state.is_complete() || rng.random::<bool>()) {
            eos
        } else {
            let choices: Vec<u32> = ok.iter().copied().filter(|&i| i != eos).collect();
            choices[rng.random_range(0..choices.len())]
        };
        state.accept(id).expect("an allowed token is accepted");
        if id == eos {
            return t.decode(&ids, true).expect("decode");
        }
        ids.push(id);
    }
    panic!("no EOS within 400 tokens: {:?}", t.decode(&ids, true));
}

#[test]
fn token_bytes_match_the_tokenizer() {
    let t = default_tokenizer();
    let vocab = t.vocab_size() + 3;
    let bytes = vocab::token_bytes(&t, vocab).expect("bytes");
    assert_eq!(bytes.len(), vocab);
    let mut checked = 0;
    for id in 0..t.vocab_size() as u32 {
        let b = &bytes[id as usize];
        let token = t.id_to_token(id).expect("token");
        if t.special_token_strings().contains(&token) {
            assert_eq!(b[0], TokTrie::SPECIAL_TOKEN_MARKER, "special token {token}");
            assert_eq!(&b[1..], token.as_bytes());
            continue;
        }
        // A piece that is whole UTF-8 decodes to exactly its bytes.
        if let Ok(text) = std::str::from_utf8(b) {
            assert_eq!(t.decode(&[id], false).expect("decode"), text, "token {id}");
            checked += 1;
        }
    }
    assert!(checked > 1000, "only {checked} tokens checked");
    for (id, b) in bytes.iter().enumerate().skip(t.vocab_size()) {
        assert_eq!(b[0], TokTrie::SPECIAL_TOKEN_MARKER, "padding id {id} is a placeholder");
    }
}

#[test]
fn byte_fallback_pieces_are_their_bytes() {
    let t = byte_fallback_tokenizer();
    let bytes = vocab::token_bytes(&t, t.vocab_size()).expect("bytes");
    assert_eq!(bytes[3 + 0x0A], b"\n");
    assert_eq!(bytes[3 + 0xE2], [0xE2]);
    assert_eq!(bytes[t.token_to_id("▁ab").expect("id") as usize], b" ab");
    assert_eq!(bytes[t.token_to_id("ab").expect("id") as usize], b"ab");
    assert_eq!(bytes[2], [&[TokTrie::SPECIAL_TOKEN_MARKER][..], b"</s>"].concat());
    // A grammar over it: the mask allows `1`, `2` and the bytes that start them, never a special token.
    let c = GrammarCompiler::new(&t, t.vocab_size(), &[2]).expect("compiler");
    let constraint = c.compile(ConstraintSpec::Regex("[12]+".into())).expect("regex");
    let mut s = constraint.start();
    let ok = allowed(&s.mask(c.vocab()).expect("mask"));
    let one = t.token_to_id("1").expect("1");
    assert!(ok.contains(&one) && ok.contains(&(3 + u32::from(b'1'))));
    assert!(!ok.contains(&2) && !ok.contains(&1) && !ok.contains(&0));
    s.accept(one).expect("accept");
    assert!(
        allowed(&s.mask(c.vocab()).expect("mask")).contains(&2),
        "EOS once the regex matched"
    );
}

#[test]
fn json_schema_outputs_validate() {
    let (t, c) = compiler();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "kind": {"enum": ["cat", "dog"]},
            "home": {
                "type": "object",
                "properties": {"floor": {"type": "integer", "minimum": -2, "maximum": 9}},
                "required": ["floor"],
                "additionalProperties": false
            }
        },
        "required": ["name", "age", "kind", "home"],
        "additionalProperties": false
    });
    let constraint = c.compile(ConstraintSpec::JsonSchema(schema)).expect("schema");
    for seed in 0..8 {
        let text = random_walk(&t, &c, &constraint, seed);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
        let age = v["age"].as_i64().expect("integer age");
        assert!((0..=120).contains(&age), "{text}");
        assert!(v["name"].as_str().is_some_and(|n| n.chars().count() <= 8), "{text}");
        assert!(["cat", "dog"].contains(&v["kind"].as_str().expect("kind")), "{text}");
        let floor = v["home"]["floor"].as_i64().expect("floor");
        assert!((-2..=9).contains(&floor), "{text}");
        assert_eq!(v.as_object().map(|o| o.len()), Some(4), "{text}");
    }
}

#[test]
fn choices_regexes_objects_and_lark_hold() {
    let (t, c) = compiler();
    let choices = ConstraintSpec::Choice(vec!["yes".into(), "no".into(), "a.b (c)".into()]);
    let choice = c.compile(choices).expect("choice");
    for seed in 0..6 {
        let text = random_walk(&t, &c, &choice, seed);
        assert!(["yes", "no", "a.b (c)"].contains(&text.as_str()), "{text:?}");
    }
    let regex = c
        .compile(ConstraintSpec::Regex("[0-9]{3}-[a-z]{2,4}".into()))
        .expect("regex");
    for seed in 0..6 {
        let text = random_walk(&t, &c, &regex, seed);
        let (digits, letters) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
        assert!(
            digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()),
            "{text:?}"
        );
        assert!(
            (2..=4).contains(&letters.len()) && letters.bytes().all(|b| b.is_ascii_lowercase()),
            "{text:?}"
        );
    }
    let object = c.compile(ConstraintSpec::JsonObject).expect("json_object");
    for seed in 0..4 {
        let text = random_walk(&t, &c, &object, seed);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v.is_object(), "{text}");
    }
    let lark = r#"start: "call " %json {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false}"#;
    let tool = c.compile(ConstraintSpec::Lark(lark.into())).expect("lark");
    for seed in 0..4 {
        let text = random_walk(&t, &c, &tool, seed);
        let body = text.strip_prefix("call ").unwrap_or_else(|| panic!("{text:?}"));
        let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v["n"].is_i64(), "{text}");
    }
}

#[test]
fn bad_specs_fail_to_compile() {
    let (_, c) = compiler();
    let bad = [
        ConstraintSpec::Regex("(unclosed".into()),
        ConstraintSpec::Lark("start: undefined_rule".into()),
        ConstraintSpec::Lark("this is not a grammar".into()),
        ConstraintSpec::JsonSchema(json!({"type": "no-such-type"})),
        ConstraintSpec::JsonSchema(json!(42)),
        ConstraintSpec::Choice(Vec::new()),
        ConstraintSpec::Choice(vec!["".into()]),
        ConstraintSpec::Regex("a".repeat(MAX_CONSTRAINT_BYTES + 1)),
    ];
    for spec in bad {
        match c.compile(spec.clone()) {
            Err(EngineError::InvalidInput(m)) => assert!(!m.is_empty()),
            Err(e) => panic!("{spec:?}: not an invalid-input error: {e}"),
            Ok(_) => panic!("{spec:?} compiled"),
        }
    }
}

#[test]
fn states_are_independent_and_masks_run_in_parallel() {
    let (t, c) = compiler();
    let constraint = c
        .compile(ConstraintSpec::Choice(vec!["ab".into(), "cd".into()]))
        .expect("choice");
    let (mut a, mut b) = (constraint.start(), constraint.start());
    let first = t.encode("ab", false).expect("encode")[0];
    a.accept(first).expect("accept");
    let masks = masks(&mut [&mut a, &mut b], c.vocab());
    let (ma, mb) = (masks[0].as_ref().expect("a"), masks[1].as_ref().expect("b"));
    assert_ne!(ma, mb, "a advanced, b did not");
    assert_eq!(mb, &constraint.start().mask(c.vocab()).expect("fresh"));
    assert_eq!(ma.len(), c.vocab().div_ceil(32));
    // The bits past the vocabulary are clear.
    let tail = c.vocab() % 32;
    assert_eq!(ma.last().copied().unwrap_or(0) >> tail, 0);
    // The grammar completes and then allows EOS alone.
    let mut whole = constraint.start();
    for id in t.encode("cd", false).expect("encode") {
        whole.accept(id).expect("accept");
    }
    let eos = t.eos_token_id().expect("eos");
    assert_eq!(allowed(&whole.mask(c.vocab()).expect("mask")), vec![eos]);
    whole.accept(eos).expect("eos after completion");
}

#[test]
fn a_forbidden_token_is_refused() {
    let (t, c) = compiler();
    let constraint = c.compile(ConstraintSpec::Regex("[0-9]+".into())).expect("regex");
    let mut s = constraint.start();
    let letter = t.encode("x", false).expect("encode")[0];
    assert!(matches!(s.accept(letter), Err(EngineError::InvalidInput(_))));
    let mut s = constraint.start();
    let digits = t.encode("12x", false).expect("encode");
    assert!(s.valid_prefix(&digits).expect("validate") < digits.len());
}

#[test]
fn draft_masks_are_the_masks_of_each_position_and_leave_the_grammar_where_it_was() {
    let (t, c) = compiler();
    let constraint = c.compile(ConstraintSpec::Regex("(ab )+(cd )*".into())).expect("regex");
    let valid = t.encode("ab ab cd ", false).expect("encode");
    let mut drafts = valid.clone();
    drafts.extend(t.encode("x", false).expect("encode"));
    drafts.extend(t.encode("ab ", false).expect("encode"));
    let mut s = constraint.start();
    let masks = s.draft_masks(&drafts, c.vocab()).expect("masks");
    assert_eq!(
        masks.len(),
        valid.len() + 1,
        "the walk ends at the first token its mask refuses"
    );
    let mut step = constraint.start();
    for (i, mask) in masks.iter().enumerate() {
        assert_eq!(mask, &step.mask(c.vocab()).expect("mask"), "position {i}");
        if let Some(&d) = valid.get(i) {
            assert!(allows(mask, d));
            step.accept(d).expect("accept");
        }
    }
    assert!(!allows(&masks[valid.len()], drafts[valid.len()]));
    // Rolled back: the state is where it was, and takes the drafts for real.
    assert_eq!(
        s.mask(c.vocab()).expect("mask"),
        constraint.start().mask(c.vocab()).expect("fresh")
    );
    for &d in &valid {
        s.accept(d).expect("accept");
    }
    // Past completion only EOS is allowed, and EOS drafts are taken as they are.
    let eos = t.eos_token_id().expect("eos");
    let whole = c.compile(ConstraintSpec::Regex("ab".into())).expect("regex");
    let mut s = whole.start();
    let ab = t.encode("ab", false).expect("encode");
    let mut drafts = ab.clone();
    drafts.extend([eos, eos]);
    let masks = s.draft_masks(&drafts, c.vocab()).expect("masks");
    assert_eq!(masks.len(), drafts.len() + 1);
    assert_eq!(allowed(masks.last().expect("a mask")), vec![eos]);
    assert_eq!(
        s.mask(c.vocab()).expect("mask"),
        whole.start().mask(c.vocab()).expect("fresh")
    );
    assert!(!s.is_complete());
    // In parallel, one result per state.
    let (mut a, mut b) = (constraint.start(), whole.start());
    let got = draft_masks(&mut [(&mut a, &valid[..]), (&mut b, &ab[..])], c.vocab());
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].as_ref().expect("a").len(), valid.len() + 1);
    assert_eq!(got[1].as_ref().expect("b").len(), ab.len() + 1);
}
