//! The token trie llguidance walks, built from rewind's tokenizer: every id's bytes as the decoder writes them
//! (GPT-2 byte-level characters mapped back to bytes, SentencePiece byte-fallback `<0xNN>` pieces as their byte and
//! `▁` as a space), special added tokens behind toktrie's special marker (a grammar never reaches them through text),
//! and the ids the model has past the tokenizer's as placeholders no grammar allows.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::error::{EngineError, Result};
use crate::tokenizer::Tokenizer;

/// How the tokenizer's decoder turns a vocabulary entry into bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pieces {
    /// GPT-2 byte-level: each character stands for one byte.
    ByteLevel,
    /// SentencePiece: `<0xNN>` pieces are bytes (with byte fallback), `space` stands for a space.
    Metaspace { space: char },
}

/// What the decoder (serialized as `tokenizer.json` writes it) says about the pieces.
fn pieces_of(decoder: &Value) -> Option<Pieces> {
    let mut space = None;
    let mut metaspace = false;
    let mut byte_level = false;
    let mut visit = vec![decoder];
    while let Some(d) = visit.pop() {
        match d.get("type").and_then(Value::as_str) {
            Some("ByteLevel") => byte_level = true,
            Some("ByteFallback") => metaspace = true,
            Some("Metaspace") => {
                metaspace = true;
                space = d.get("replacement").and_then(Value::as_str).and_then(single_char);
            }
            Some("Replace") if d.get("content").and_then(Value::as_str) == Some(" ") => {
                space = d
                    .pointer("/pattern/String")
                    .and_then(Value::as_str)
                    .and_then(single_char);
            }
            Some("Sequence") => visit.extend(d.get("decoders").and_then(Value::as_array).into_iter().flatten()),
            _ => {}
        }
    }
    match (byte_level, metaspace) {
        (true, _) => Some(Pieces::ByteLevel),
        (false, true) => Some(Pieces::Metaspace {
            space: space.unwrap_or('▁'),
        }),
        (false, false) => None,
    }
}

fn single_char(s: &str) -> Option<char> {
    let mut c = s.chars();
    match (c.next(), c.next()) {
        (Some(ch), None) => Some(ch),
        _ => None,
    }
}

/// GPT-2's byte-to-character table, inverted: the printable Latin-1 bytes stand for themselves, the others for
/// U+0100 onwards in byte order.
fn byte_level_chars() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    let mut map = HashMap::with_capacity(256);
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
        map.insert(c, b);
    }
    map
}

/// A placeholder for an id that has no text a grammar may produce: behind the special marker, so only a grammar
/// naming it could allow it, and none does.
fn placeholder(id: u32) -> Vec<u8> {
    let mut bytes = format!(".<[{id}]>").into_bytes();
    bytes[0] = TokTrie::SPECIAL_TOKEN_MARKER;
    bytes
}

/// The bytes of every id below `vocab` (the model's vocabulary, at least the tokenizer's).
pub(super) fn token_bytes(tokenizer: &Tokenizer, vocab: usize) -> Result<Vec<Vec<u8>>> {
    let inner = tokenizer.inner();
    let unsupported = |why: String| {
        EngineError::NotSupported(format!(
            "structured outputs need a byte-level or SentencePiece tokenizer: {why}"
        ))
    };
    let decoder = inner
        .get_decoder()
        .ok_or_else(|| unsupported("the tokenizer has no decoder".into()))?;
    let decoder = serde_json::to_value(decoder).map_err(|e| unsupported(format!("its decoder: {e}")))?;
    let pieces = pieces_of(&decoder).ok_or_else(|| unsupported(format!("its decoder is {decoder}")))?;
    if tokenizer.vocab_size() > vocab {
        return Err(EngineError::InvalidInput(format!(
            "the tokenizer has {} ids, more than the model's vocabulary of {vocab}",
            tokenizer.vocab_size()
        )));
    }
    let added = inner.get_added_tokens_decoder();
    let chars = byte_level_chars();
    let mut bytes = Vec::with_capacity(vocab);
    for id in 0..vocab as u32 {
        if let Some(t) = added.get(&id) {
            bytes.push(match t.special {
                true => [&[TokTrie::SPECIAL_TOKEN_MARKER][..], t.content.as_bytes()].concat(),
                // A non-special added token is text: the decoder writes its content as it is.
                false => t.content.clone().into_bytes(),
            });
            continue;
        }
        let Some(piece) = inner.id_to_token(id) else {
            bytes.push(placeholder(id));
            continue;
        };
        bytes.push(match pieces {
            Pieces::ByteLevel => match piece
                .chars()
                .map(|c| chars.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
            {
                Some(b) => b,
                None => {
                    return Err(unsupported(format!(
                        "token {id} `{piece}` is not made of byte-level characters"
                    )))
                }
            },
            Pieces::Metaspace { space } => match byte_fallback(&piece) {
                Some(b) => vec![b],
                None => piece.replace(space, " ").into_bytes(),
            },
        });
    }
    Ok(bytes)
}

/// The byte of a SentencePiece byte-fallback piece `<0xNN>`.
fn byte_fallback(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}

/// The tokenizer environment llguidance computes masks over: the trie of [`token_bytes`], the model's EOS ids, and
/// the tokenizer itself for the canonical tokenization of forced text.
struct RewindTokEnv {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for RewindTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            // An encoding error leaves the trie's greedy tokenization, which is valid if not canonical.
            match self.tokenizer.encode_fast(text, false) {
                Ok(enc) => enc.get_ids().to_vec(),
                Err(_) => self.trie.greedy_tokenize(text.as_bytes()),
            }
        })
    }
}

/// The [`TokEnv`] of `tokenizer` over a model vocabulary of `vocab` ids whose end-of-sequence ids are `eos` (at least
/// one, each below `vocab`).
pub(super) fn tok_env(tokenizer: &Tokenizer, vocab: usize, eos: &[u32]) -> Result<TokEnv> {
    let (&first, _) = eos.split_first().ok_or_else(|| {
        EngineError::NotSupported("structured outputs need the model's end-of-sequence token id".into())
    })?;
    if let Some(&id) = eos.iter().find(|&&id| id as usize >= vocab) {
        return Err(EngineError::InvalidInput(format!(
            "end-of-sequence id {id} is outside the vocabulary of {vocab}"
        )));
    }
    let words = token_bytes(tokenizer, vocab)?;
    let vocab_u32 = u32::try_from(vocab)
        .map_err(|_| EngineError::InvalidInput(format!("a vocabulary of {vocab} ids exceeds u32")))?;
    let mut info = TokRxInfo::new(vocab_u32, first);
    info.tok_bos = tokenizer.bos_token_id();
    info.tok_pad = tokenizer.pad_token_id();
    let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
    Ok(Arc::new(RewindTokEnv {
        trie,
        tokenizer: tokenizer.inner().clone(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_level_table_covers_every_byte_once() {
        let map = byte_level_chars();
        assert_eq!(map.len(), 256);
        assert_eq!(map[&'A'], b'A');
        assert_eq!(map[&'Ġ'], b' ');
        assert_eq!(map[&'Ċ'], b'\n');
        let mut bytes: Vec<u8> = map.values().copied().collect();
        bytes.sort_unstable();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
    }

    #[test]
    fn decoders_are_recognised() {
        let bl: Value = serde_json::json!({"type": "ByteLevel", "add_prefix_space": true});
        assert_eq!(pieces_of(&bl), Some(Pieces::ByteLevel));
        let sp: Value = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]});
        assert_eq!(pieces_of(&sp), Some(Pieces::Metaspace { space: '▁' }));
        assert_eq!(pieces_of(&serde_json::json!({"type": "WordPiece"})), None);
        assert_eq!(byte_fallback("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_fallback("<0x0>"), None);
        assert_eq!(byte_fallback("hello"), None);
    }
}
