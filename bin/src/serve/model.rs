//! [`ServedModel`]: what a front end needs of a checkpoint besides its weights — the config, the tokenizer and chat
//! template, the sampling defaults of `generation_config.json` and the end-of-sequence ids. The one place these are
//! read for serving (`generate`, `serve`, `chat` and `rewind-launch` all use it).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rewind_engine::generation_config::GenerationDefaults;
use rewind_engine::model::json::parse_relaxed;
use rewind_engine::model::ModelConfig;
use rewind_engine::sample::SamplingParams;
use rewind_engine::tokenizer::Tokenizer;

/// A checkpoint's serving metadata.
#[derive(Clone)]
pub struct ServedModel {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub defaults: GenerationDefaults,
    pub tokenizer: Tokenizer,
    /// Every id that ends a request unless it sets `ignore_eos`: generation_config.json's, config.json's and the
    /// tokenizer's, without repeats.
    pub eos_token_ids: Vec<u32>,
}

impl ServedModel {
    /// Reads `dir`'s config.json, generation_config.json (if any) and tokenizer files.
    pub fn load(dir: &Path) -> Result<Self> {
        let config_path = dir.join("config.json");
        let config_text =
            std::fs::read_to_string(&config_path).with_context(|| format!("reading {}", config_path.display()))?;
        let config_json =
            parse_relaxed(&config_text).with_context(|| format!("{}: malformed JSON", config_path.display()))?;
        let defaults = GenerationDefaults::from_dir(dir, &config_json)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        let config = ModelConfig::from_dir(dir)?;
        let mut eos = defaults.eos_token_ids.clone();
        for id in config.eos_token_ids.iter().chain(tokenizer.eos_token_id().as_ref()) {
            if !eos.contains(id) {
                eos.push(*id);
            }
        }
        Ok(ServedModel {
            dir: dir.to_path_buf(),
            config,
            defaults,
            tokenizer,
            eos_token_ids: eos,
        })
    }

    /// The sampling parameters a request starts from: generation_config.json's.
    pub fn sampling_defaults(&self) -> SamplingParams {
        self.defaults.sampling_params()
    }

    /// The name the APIs serve the model under: the checkpoint directory's last component.
    pub fn default_name(&self) -> String {
        self.dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "rewind".to_string())
    }
}
