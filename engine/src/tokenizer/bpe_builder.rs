//! A real byte-level BPE tokenizer built in code, for `rewind init-model` checkpoints.
//!
//! The tokenizer is trained with `tokenizers`' `BpeTrainer` on `corpus.txt` (about 100 KB of English prose, dialogue,
//! a few short passages in other languages, and code in several languages, all written for this project and shipped
//! under the project's license). Pre-tokenizer and decoder are GPT-2's ByteLevel, so every UTF-8 string round-trips
//! exactly and all 256 bytes are tokens.
//!
//! Id layout: the special tokens `<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2 come first, then the 256
//! byte symbols (in code-point order of their ByteLevel characters), then the learned merges. When the corpus runs out
//! of merges before `vocab_size`, the remaining ids are filled with `<|reserved_N|>` special tokens, so the vocabulary
//! is always exactly `vocab_size`.
//!
//! Training is deterministic: character ids are assigned in sorted order and the trainer breaks count ties by pair
//! ids, so hash-map iteration order (randomised per process) never reaches the output; a test checks that two builds
//! serialize to identical bytes.

use std::collections::HashSet;
use std::path::Path;

use serde_json::json;
use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::AddedToken;

use crate::error::{EngineError, Result};

/// End of a document; the pad token of init-model checkpoints.
pub const ENDOFTEXT: &str = "<|endoftext|>";
/// Opens a ChatML turn.
pub const IM_START: &str = "<|im_start|>";
/// Closes a ChatML turn; the EOS of init-model checkpoints.
pub const IM_END: &str = "<|im_end|>";
/// The special tokens, in id order (ids 0, 1, 2).
pub const SPECIAL_TOKENS: [&str; 3] = [ENDOFTEXT, IM_START, IM_END];
/// The smallest vocabulary: the special tokens plus the 256 byte symbols.
pub const MIN_VOCAB_SIZE: usize = SPECIAL_TOKENS.len() + 256;
/// Largest vocabulary accepted (ids must fit comfortably in `u32` and the reserved filler stays reasonable).
pub const MAX_VOCAB_SIZE: usize = 1 << 20;

/// The ChatML template written into `tokenizer_config.json`: `<|im_start|>role\ncontent<|im_end|>\n` per message,
/// `<|im_start|>assistant\n` as the generation prompt, and the BOS token first when the tokenizer has one.
pub const CHATML_TEMPLATE: &str = r#"{%- if bos_token %}{{- bos_token }}{%- endif %}
{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

const CORPUS: &str = include_str!("corpus.txt");

/// Trains a byte-level BPE tokenizer with exactly `vocab_size` ids (see the module docs for the id layout).
pub fn build_bpe_tokenizer(vocab_size: usize) -> Result<tokenizers::Tokenizer> {
    if !(MIN_VOCAB_SIZE..=MAX_VOCAB_SIZE).contains(&vocab_size) {
        return Err(EngineError::config(
            "vocab_size",
            format!("a byte-level BPE tokenizer needs {MIN_VOCAB_SIZE}..={MAX_VOCAB_SIZE} ids, got {vocab_size}"),
        ));
    }
    let specials: Vec<AddedToken> = SPECIAL_TOKENS.iter().map(|s| AddedToken::from(*s, true)).collect();
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let trainer = BpeTrainer::builder()
        .vocab_size(vocab_size)
        .min_frequency(0)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(alphabet)
        .build();
    let mut trainer = TrainerWrapper::BpeTrainer(trainer);

    let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
    // GPT-2 settings: no prefix space (so decode(encode(s)) == s), GPT-2's split regex.
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_post_processor(Some(ByteLevel::new(false, true, true)));
    // Paragraphs keep their newlines, so whitespace runs like "\n\n" can become tokens.
    tokenizer
        .train(&mut trainer, CORPUS.split_inclusive("\n\n"))
        .map_err(|e| EngineError::Tokenizer(format!("training the BPE tokenizer: {e}")))?;

    let have = tokenizer.get_vocab_size(true);
    if have < vocab_size {
        let filler: Vec<AddedToken> = (0..vocab_size - have)
            .map(|i| AddedToken::from(format!("<|reserved_{i}|>"), true))
            .collect();
        tokenizer.add_special_tokens(&filler);
    }
    let got = tokenizer.get_vocab_size(true);
    if got != vocab_size {
        return Err(EngineError::Tokenizer(format!(
            "BPE training produced {got} ids where {vocab_size} were asked for"
        )));
    }
    Ok(tokenizer)
}

/// Which special tokens an init-model checkpoint declares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialTokenChoice {
    /// BOS token; when set, encoding with special tokens prepends it and the chat template starts with it.
    pub bos_token: Option<String>,
    /// EOS token (the end of an assistant turn).
    pub eos_token: String,
    /// Pad token.
    pub pad_token: Option<String>,
}

impl Default for SpecialTokenChoice {
    /// Qwen's choice: no BOS, `<|im_end|>` as EOS, `<|endoftext|>` as pad.
    fn default() -> Self {
        Self {
            bos_token: None,
            eos_token: IM_END.to_string(),
            pad_token: Some(ENDOFTEXT.to_string()),
        }
    }
}

/// Writes `dir/tokenizer.json` and `dir/tokenizer_config.json` (ChatML template, `PreTrainedTokenizerFast` class)
/// so that both rewind and `transformers.AutoTokenizer` load them. Every named token must be in the vocabulary.
pub fn write_tokenizer_files(
    dir: impl AsRef<Path>,
    tokenizer: &tokenizers::Tokenizer,
    choice: &SpecialTokenChoice,
) -> Result<()> {
    let dir = dir.as_ref();
    let id_of = |field: &str, token: &str| {
        tokenizer
            .token_to_id(token)
            .ok_or_else(|| EngineError::config(field, format!("token `{token}` is not in the tokenizer's vocabulary")))
    };
    id_of("eos_token", &choice.eos_token)?;
    if let Some(pad) = &choice.pad_token {
        id_of("pad_token", pad)?;
    }
    let mut tokenizer = tokenizer.clone();
    if let Some(bos) = &choice.bos_token {
        let bos_id = id_of("bos_token", bos)?;
        let template = TemplateProcessing::builder()
            .try_single(format!("{bos} $A"))
            .and_then(|b| b.try_pair(format!("{bos} $A {bos} $B:1")))
            .map_err(|e| EngineError::Tokenizer(format!("BOS post-processor: {e}")))?
            .special_tokens(vec![(bos.clone(), bos_id)])
            .build()
            .map_err(|e| EngineError::Tokenizer(format!("BOS post-processor: {e}")))?;
        tokenizer.with_post_processor(Some(template));
    }

    let mut added = serde_json::Map::new();
    for token in tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .collect::<std::collections::BTreeMap<_, _>>()
    {
        let (id, t) = token;
        added.insert(
            id.to_string(),
            json!({
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": t.special,
            }),
        );
    }
    let config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": choice.bos_token,
        "eos_token": choice.eos_token,
        "pad_token": choice.pad_token,
        "unk_token": null,
        "add_bos_token": choice.bos_token.is_some(),
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 1_000_000_000_000_000_000u64,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": added,
    });

    std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
    let tok_path = dir.join("tokenizer.json");
    let tok_json = tokenizer
        .to_string(true)
        .map_err(|e| EngineError::Tokenizer(format!("serializing tokenizer.json: {e}")))?;
    std::fs::write(&tok_path, tok_json).map_err(|e| EngineError::io(&tok_path, e))?;
    let cfg_path = dir.join("tokenizer_config.json");
    let cfg_json = serde_json::to_string_pretty(&config).map_err(|e| EngineError::Json {
        path: cfg_path.clone(),
        message: e.to_string(),
    })?;
    std::fs::write(&cfg_path, cfg_json + "\n").map_err(|e| EngineError::io(&cfg_path, e))?;
    Ok(())
}

#[cfg(test)]
#[path = "bpe_builder_tests.rs"]
mod tests;
