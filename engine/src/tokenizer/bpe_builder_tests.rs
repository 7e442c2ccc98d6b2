use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::tokenizer::tests::{random_text, small_bpe};

#[test]
fn training_is_deterministic_byte_for_byte() {
    let a = build_bpe_tokenizer(700).unwrap().to_string(true).unwrap();
    let b = build_bpe_tokenizer(700).unwrap().to_string(true).unwrap();
    assert!(a == b, "two builds with the same vocab_size serialized differently");
    // And via the files init-model writes.
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let choice = SpecialTokenChoice::default();
    write_tokenizer_files(d1.path(), small_bpe(), &choice).unwrap();
    write_tokenizer_files(d2.path(), &build_bpe_tokenizer(600).unwrap(), &choice).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        let x = std::fs::read(d1.path().join(f)).unwrap();
        let y = std::fs::read(d2.path().join(f)).unwrap();
        assert!(x == y, "{f} differs between two builds");
    }
}

#[test]
fn layout_specials_first_then_all_bytes_then_merges() {
    let tok = small_bpe();
    assert_eq!(tok.get_vocab_size(true), 600);
    for (i, s) in SPECIAL_TOKENS.iter().enumerate() {
        assert_eq!(tok.token_to_id(s), Some(i as u32));
    }
    let vocab = tok.get_vocab(false);
    for c in ByteLevel::alphabet() {
        let id = vocab[&c.to_string()];
        assert!((3..259).contains(&id), "byte symbol {c:?} has id {id}");
    }
    // Learned merges exist and common English words became single tokens.
    assert!(vocab.values().any(|&id| id >= 259));
    let the = tok.encode(" the", false).unwrap();
    assert_eq!(the.len(), 1, "\" the\" should be one token: {:?}", the.get_tokens());
}

#[test]
fn every_string_round_trips() {
    let tok = small_bpe();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for _ in 0..300 {
        let text = random_text(&mut rng, 30);
        let ids = tok.encode(text.as_str(), false).unwrap();
        assert_eq!(tok.decode(ids.get_ids(), false).unwrap(), text);
    }
    // Arbitrary code points, including controls and astral planes.
    for _ in 0..300 {
        let text: String = (0..rng.random_range(0..40))
            .filter_map(|_| char::from_u32(rng.random_range(0..0x11_0000)))
            .collect();
        let ids = tok.encode(text.as_str(), false).unwrap();
        assert_eq!(tok.decode(ids.get_ids(), false).unwrap(), text);
    }
}

#[test]
fn large_vocab_is_padded_with_reserved_specials() {
    // The corpus supports far fewer merges than this, so the tail is reserved tokens.
    let size = 40_000;
    let tok = build_bpe_tokenizer(size).unwrap();
    assert_eq!(tok.get_vocab_size(true), size);
    let learned = tok.get_vocab_size(false);
    eprintln!("the corpus supports {learned} learned ids");
    assert!(learned > 4096 && learned < size, "{learned}");
    assert_eq!(tok.id_to_token(learned as u32).as_deref(), Some("<|reserved_0|>"));
    let last = tok.id_to_token(size as u32 - 1).unwrap();
    assert!(last.starts_with("<|reserved_"), "{last}");
    assert_eq!(tok.decode(&[size as u32 - 1], true).unwrap(), "");
    assert_eq!(tok.id_to_token(size as u32), None);
}

#[test]
fn rejects_out_of_range_sizes_and_unknown_tokens() {
    let e = build_bpe_tokenizer(MIN_VOCAB_SIZE - 1).unwrap_err().to_string();
    assert!(e.contains("vocab_size"), "{e}");
    assert!(build_bpe_tokenizer(MIN_VOCAB_SIZE).is_ok());
    let dir = tempfile::tempdir().unwrap();
    let choice = SpecialTokenChoice {
        eos_token: "<|nope|>".into(),
        ..SpecialTokenChoice::default()
    };
    let e = write_tokenizer_files(dir.path(), small_bpe(), &choice)
        .unwrap_err()
        .to_string();
    assert!(e.contains("eos_token") && e.contains("<|nope|>"), "{e}");
}

/// Training speed for the usual init-model size; the budget is 2 s on one core, asserted loosely because test
/// machines are shared.
#[test]
fn training_4096_is_fast() {
    let t = Instant::now();
    let tok = build_bpe_tokenizer(4096).unwrap();
    let secs = t.elapsed().as_secs_f64();
    eprintln!("build_bpe_tokenizer(4096): {secs:.3} s");
    assert_eq!(tok.get_vocab_size(true), 4096);
    assert!(tok.id_to_token(4095).is_some_and(|t| !t.starts_with("<|reserved_")));
    assert!(secs < 20.0, "training took {secs:.1} s");
}
