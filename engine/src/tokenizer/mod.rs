//! Tokenizer: loading a checkpoint's `tokenizer.json` / `tokenizer_config.json`, encoding and decoding, and an
//! incremental detokenizer for streaming.
//!
//! The heavy lifting is done by the `tokenizers` crate (the same Rust code behind Python's
//! `PreTrainedTokenizerFast`), so ids match what `transformers` produces for the same files.

pub mod bpe_builder;
pub mod chat;
pub mod reasoning;
mod turn;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

pub use chat::{ChatMessage, ChatTemplate, MessageFunctionCall, MessageToolCall};
pub use turn::TurnDelta;

use crate::error::{EngineError, Result};

/// The name HF gives the default entry of a list-form `chat_template`.
const DEFAULT_TEMPLATE_NAME: &str = "default";

/// A loaded tokenizer plus what `tokenizer_config.json` says about special tokens and chat formatting.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    vocab_size: usize,
    /// The longest vocabulary entry, in UTF-8 bytes of its string (see [`Tokenizer::max_text_bytes`]).
    max_token_bytes: usize,
    special: SpecialTokens,
    add_bos_token: Option<bool>,
    chat_template: Option<Arc<ChatTemplate>>,
    named_templates: BTreeMap<String, String>,
    /// The strings of the special added tokens (`<|im_start|>`, ...), which [`Tokenizer::encode_chat`] keeps as text
    /// inside message contents.
    special_strings: Arc<Vec<String>>,
    /// A copy of `inner` that encodes special token strings as text, made the first time a message needs it.
    plain: Arc<std::sync::OnceLock<tokenizers::Tokenizer>>,
}

/// What [`Tokenizer::encode_chat`] wraps a message's content in to find it in the rendered text: private-use
/// characters, which no tokenizer gives a meaning and no template tests for.
const CONTENT_OPEN: char = '\u{F8F0}';
const CONTENT_CLOSE: char = '\u{F8F1}';

/// Special token strings and their ids (an id is `None` when the string is not in the vocabulary).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning-of-sequence token.
    pub bos: Option<(String, Option<u32>)>,
    /// End-of-sequence token (the end-of-turn token for chat models).
    pub eos: Option<(String, Option<u32>)>,
    /// Padding token.
    pub pad: Option<(String, Option<u32>)>,
    /// Unknown-token placeholder.
    pub unk: Option<(String, Option<u32>)>,
}

/// What a `tokenizer_config.json` contributes; every field is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// The default chat template source.
    pub chat_template: Option<String>,
    /// Every named template of a list-form `chat_template` (the default one included).
    pub named_templates: BTreeMap<String, String>,
    /// `bos_token` as a string.
    pub bos_token: Option<String>,
    /// `eos_token` as a string.
    pub eos_token: Option<String>,
    /// `pad_token` as a string.
    pub pad_token: Option<String>,
    /// `unk_token` as a string.
    pub unk_token: Option<String>,
    /// `add_bos_token`, when the file sets it.
    pub add_bos_token: Option<bool>,
}

impl TokenizerConfig {
    /// Parses the JSON of a `tokenizer_config.json`; `path` is only used in error messages.
    pub fn from_json(value: &Value, path: &Path) -> Result<Self> {
        let obj = value.as_object().ok_or_else(|| EngineError::Json {
            path: path.to_path_buf(),
            message: "expected a JSON object at the top level".into(),
        })?;
        let field_err =
            |field: &str, message: String| EngineError::config(format!("{}: {field}", path.display()), message);
        let token = |field: &str| -> Result<Option<String>> {
            match obj.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(Value::Object(o)) => match o.get("content") {
                    Some(Value::String(s)) => Ok(Some(s.clone())),
                    _ => Err(field_err(field, "an object token needs a string `content`".into())),
                },
                Some(other) => Err(field_err(
                    field,
                    format!("expected a string or {{content: ...}}, found {other}"),
                )),
            }
        };
        let mut named_templates = BTreeMap::new();
        let chat_template = match obj.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => {
                for (i, entry) in list.iter().enumerate() {
                    let name = entry.get("name").and_then(Value::as_str);
                    let template = entry.get("template").and_then(Value::as_str);
                    match (name, template) {
                        (Some(n), Some(t)) => {
                            named_templates.insert(n.to_string(), t.to_string());
                        }
                        _ => {
                            return Err(field_err(
                                "chat_template",
                                format!("entry {i} needs string `name` and `template` fields"),
                            ))
                        }
                    }
                }
                named_templates.get(DEFAULT_TEMPLATE_NAME).cloned()
            }
            Some(other) => {
                return Err(field_err(
                    "chat_template",
                    format!(
                        "expected a string or a list of {{name, template}}, found {}",
                        type_name(other)
                    ),
                ))
            }
        };
        let add_bos_token = match obj.get("add_bos_token") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(other) => return Err(field_err("add_bos_token", format!("expected a boolean, found {other}"))),
        };
        Ok(Self {
            chat_template,
            named_templates,
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            pad_token: token("pad_token")?,
            unk_token: token("unk_token")?,
            add_bos_token,
        })
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Reads and parses a JSON file, naming the path in every error.
pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| EngineError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

fn tok_err(context: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(format!("{context}: {e}"))
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json`. A `dir/chat_template.jinja` file
    /// (how recent `transformers` versions save the template) takes precedence over the config's `chat_template`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let tok_path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&tok_path).map_err(|e| EngineError::io(&tok_path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| EngineError::Json {
            path: tok_path.clone(),
            message: format!("not a valid tokenizers file: {e}"),
        })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let mut config = if cfg_path.exists() {
            TokenizerConfig::from_json(&read_json(&cfg_path)?, &cfg_path)?
        } else {
            TokenizerConfig::default()
        };
        let jinja_path: PathBuf = dir.join("chat_template.jinja");
        if jinja_path.exists() {
            let source = std::fs::read_to_string(&jinja_path).map_err(|e| EngineError::io(&jinja_path, e))?;
            config.chat_template = Some(source);
        }
        Self::from_parts(inner, config)
    }

    /// Wraps an in-memory tokenizer (e.g. one from [`bpe_builder::build_bpe_tokenizer`]) with a config.
    pub fn from_parts(inner: tokenizers::Tokenizer, config: TokenizerConfig) -> Result<Self> {
        // Ids may have gaps (added tokens past the model vocab), so the size is the largest id + 1.
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        let max_token_bytes = inner.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1);
        let lookup = |name: &str, tok: Option<String>| {
            tok.map(|t| {
                let id = inner.token_to_id(&t);
                if id.is_none() {
                    tracing::warn!("tokenizer_config.json: {name} `{t}` is not in the vocabulary");
                }
                (t, id)
            })
        };
        let special = SpecialTokens {
            bos: lookup("bos_token", config.bos_token.clone()),
            eos: lookup("eos_token", config.eos_token.clone()),
            pad: lookup("pad_token", config.pad_token.clone()),
            unk: lookup("unk_token", config.unk_token.clone()),
        };
        let special_strings: Vec<String> = inner
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        let chat_template = match &config.chat_template {
            Some(src) => Some(Arc::new(ChatTemplate::new(
                src.clone(),
                config.bos_token.clone(),
                config.eos_token.clone(),
            )?)),
            None => None,
        };
        Ok(Self {
            inner: Arc::new(inner),
            vocab_size,
            max_token_bytes,
            special,
            add_bos_token: config.add_bos_token,
            chat_template,
            named_templates: config.named_templates,
            special_strings: Arc::new(special_strings),
            plain: Arc::new(std::sync::OnceLock::new()),
        })
    }

    /// The most bytes of text that `tokens` tokens can encode: a longer text needs more tokens, so it can be refused
    /// without tokenizing it (a request of many megabytes would otherwise hold gigabytes while it is encoded only to
    /// be found too long). Each token covers at most as many input bytes as its vocabulary string has UTF-8 bytes
    /// (byte-level BPE writes one character per byte, SentencePiece's `▁` stands for a 1-byte space in 3), times 4
    /// for normalizers that shrink text (NFKC folds at most a few bytes into one character).
    pub fn max_text_bytes(&self, tokens: usize) -> usize {
        tokens.saturating_mul(self.max_token_bytes).saturating_mul(4)
    }

    /// Encodes `text`. With `add_special_tokens` the tokenizer's post-processor runs (e.g. adds BOS), and when the
    /// config says `add_bos_token: true` but the post-processor did not add it, BOS is prepended, as `transformers`
    /// does. Text rendered by a chat template must be encoded with `add_special_tokens = false`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| tok_err("encode", e))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special_tokens && self.add_bos_token == Some(true) {
            if let Some(bos) = self.bos_token_id() {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    /// Encodes a chat that the template rendered as `rendered` from `messages` (with `add_generation_prompt`), the
    /// way vLLM does: the template's own markers are special tokens, while a message content's text is text even
    /// where it spells a special token (a user who writes `<|im_start|>` gets those characters, not a role marker).
    /// Contents without special token strings tokenize exactly as [`Tokenizer::encode`] would.
    ///
    /// An error when a content that holds a special token string cannot be told apart from the template's text (the
    /// template rewrote it in a way that depends on its exact characters).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        rendered: &str,
    ) -> Result<Vec<u32>> {
        self.encode_chat_from(messages, add_generation_prompt, rendered, 0)
    }

    /// [`Tokenizer::encode_chat`] of a chat rendered with extra template variables (`chat_template_kwargs`, see
    /// [`Tokenizer::render_with`]): the same variables must be given here.
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
        rendered: &str,
    ) -> Result<Vec<u32>> {
        self.encode_chat_impl(messages, add_generation_prompt, extra, rendered, 0)
    }

    /// [`Tokenizer::encode_chat`] of the part of `rendered` from byte `from` on, tokenized on its own (what a
    /// session lacks when it holds the text before `from`). `from` must be a character boundary of `rendered`.
    pub fn encode_chat_from(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        rendered: &str,
        from: usize,
    ) -> Result<Vec<u32>> {
        self.encode_chat_impl(messages, add_generation_prompt, &serde_json::Map::new(), rendered, from)
    }

    fn encode_chat_impl(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
        rendered: &str,
        from: usize,
    ) -> Result<Vec<u32>> {
        let tail = rendered.get(from..).ok_or_else(|| {
            EngineError::InvalidInput(format!(
                "byte {from} is not a character boundary of the rendered chat ({} bytes)",
                rendered.len()
            ))
        })?;
        let holds_special = |c: &str| self.special_strings.iter().any(|s| c.contains(s.as_str()));
        if !messages.iter().any(|m| holds_special(&m.content)) {
            return self.encode(tail, false);
        }
        let marker = |c: char| c == CONTENT_OPEN || c == CONTENT_CLOSE;
        let unclear = |why: &str| {
            EngineError::InvalidInput(format!(
                "a message's content spells a special token of this tokenizer, and {why}, so its text cannot be kept \
                 apart from the chat template's markers"
            ))
        };
        if messages.iter().any(|m| m.content.contains(marker)) {
            return Err(unclear(
                "a content also holds the private-use characters U+F8F0 / U+F8F1",
            ));
        }
        let wrapped: Vec<ChatMessage> = messages
            .iter()
            .map(|m| match holds_special(&m.content) {
                true => ChatMessage::new(m.role.clone(), format!("{CONTENT_OPEN}{}{CONTENT_CLOSE}", m.content)),
                false => m.clone(),
            })
            .collect();
        let marked = self.render_with(&wrapped, add_generation_prompt, extra)?;
        if marked.replace(marker, "") != rendered {
            return Err(unclear("the chat template renders it differently once it is marked"));
        }
        let plain = self.plain.get_or_init(|| {
            let mut t = (*self.inner).clone();
            t.set_encode_special_tokens(true);
            t
        });
        // A piece of the marked text is content (plain text) when a marker opened it or one closes it: a template
        // may keep only part of a content (an earlier turn's reasoning dropped), leaving one marker of the pair.
        // `at` is where the piece starts in `rendered` (the marked text less its markers).
        let mut ids = Vec::new();
        let mut start = 0;
        let mut at = 0;
        let mut opened = false;
        let ends = marked
            .match_indices(marker)
            .map(|(i, m)| (i, m.starts_with(CONTENT_CLOSE)));
        for (end, closes) in ends.map(|(i, c)| (i, Some(c))).chain([(marked.len(), None)]) {
            let whole = &marked[start..end];
            let piece = &whole[from.saturating_sub(at).min(whole.len())..];
            at += whole.len();
            if !piece.is_empty() {
                let tokenizer = if opened || closes == Some(true) {
                    plain
                } else {
                    &*self.inner
                };
                let enc = tokenizer.encode_fast(piece, false).map_err(|e| tok_err("encode", e))?;
                ids.extend_from_slice(enc.get_ids());
            }
            opened = closes == Some(false);
            start = end + CONTENT_OPEN.len_utf8();
        }
        Ok(ids)
    }

    /// Decodes `ids` to text. Ids with no token are skipped (as `transformers`' fast tokenizers do); byte-level pieces
    /// that do not form valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| tok_err("decode", e))
    }

    /// A streaming detokenizer over this tokenizer.
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream {
        DecodeStream::new(self.inner.clone(), skip_special)
    }

    /// Number of ids the tokenizer can produce: the largest id (added tokens included) + 1.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id of `token` (a vocabulary entry or an added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string for `id`.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Special tokens from the config, with their ids.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// The BOS token id, if the config names one that is in the vocabulary.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.special.bos.as_ref().and_then(|t| t.1)
    }

    /// The EOS token id, if the config names one that is in the vocabulary.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.special.eos.as_ref().and_then(|t| t.1)
    }

    /// The pad token id, if the config names one that is in the vocabulary.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.special.pad.as_ref().and_then(|t| t.1)
    }

    /// The text of every special token (added tokens marked special), in no particular order.
    pub fn special_token_strings(&self) -> &[String] {
        &self.special_strings
    }

    /// The default chat template, if the checkpoint has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_deref()
    }

    /// The source of a named template from a list-form `chat_template` (e.g. `"tool_use"`).
    pub fn named_template(&self, name: &str) -> Option<&str> {
        self.named_templates.get(name).map(String::as_str)
    }

    /// Renders `messages` with the default chat template.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// Renders `messages` with the default chat template and `extra` template variables (a request's
    /// `chat_template_kwargs`, e.g. `enable_thinking`); see [`ChatTemplate::render_with`].
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        self.chat_template
            .as_ref()
            .ok_or_else(|| EngineError::Tokenizer("this tokenizer has no chat template".into()))?
            .render_with(messages, add_generation_prompt, extra)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("special", &self.special)
            .field("add_bos_token", &self.add_bos_token)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// Incremental detokenizer: feed ids one at a time, get back only text that is final.
///
/// It keeps a small window of ids and decodes `window[prefix..]` against `window[prefix..read]`; new text is
/// released only when it does not end in U+FFFD, i.e. when the bytes decoded so far end on a complete character.
/// Decoding a window that starts one chunk back (rather than at the new ids) keeps decoders that treat the first
/// token specially (SentencePiece's leading-space strip) consistent. Every release ends on a complete character, so
/// the concatenation of all yielded text, plus [`DecodeStream::flush`] at the end, equals `decode(all ids)`.
pub struct DecodeStream {
    tokenizer: Arc<tokenizers::Tokenizer>,
    skip_special: bool,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl DecodeStream {
    /// A stream over `tokenizer`; `skip_special` is passed to every decode.
    pub fn new(tokenizer: Arc<tokenizers::Tokenizer>, skip_special: bool) -> Self {
        Self {
            tokenizer,
            skip_special,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, self.skip_special)
            .map_err(|e| tok_err("decode", e))
    }

    /// Adds one id; returns the text it completes, or `None` while a character is still incomplete.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        self.release(false)
    }

    /// Releases whatever is still held back (an incomplete character decodes to U+FFFD, exactly as `decode` would).
    /// Call once when generation ends.
    pub fn flush(&mut self) -> Result<Option<String>> {
        self.release(true)
    }

    fn release(&mut self, force: bool) -> Result<Option<String>> {
        let prefix_text = self.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let new_text = self.decode(&self.ids[self.prefix_offset..])?;
        if new_text.len() <= prefix_text.len() || (!force && new_text.ends_with('\u{FFFD}')) {
            return Ok(None);
        }
        let delta = match new_text.strip_prefix(prefix_text.as_str()) {
            Some(d) => d.to_string(),
            None => {
                return Err(EngineError::Tokenizer(format!(
                    "streaming decode: text `{new_text}` does not extend the text already emitted `{prefix_text}`"
                )))
            }
        };
        // The window now starts at the chunk just released; older ids are no longer needed.
        self.ids.drain(..self.read_offset);
        self.prefix_offset = 0;
        self.read_offset = self.ids.len();
        Ok(Some(delta))
    }
}

#[cfg(test)]
mod tests;
