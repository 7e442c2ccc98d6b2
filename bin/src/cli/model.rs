//! `--model DIR` and `--default-model ARCH`: which model a command runs (shared by `generate`, `bench`, `serve`,
//! `chat`, `perplexity`, `logits` and `rewind-launch`; resolved by `commands::generate::model_dir`).

use std::path::PathBuf;

use clap::Args;

use crate::default_model::DefaultModel;

/// The model a command runs: a directory, else one of the embedded trained default models.
#[derive(Args, Debug, Clone, Default)]
pub struct ModelArgs {
    /// Model directory (config.json, *.safetensors, tokenizer.json). Default: the embedded trained model that
    /// --default-model names.
    #[arg(long = "model", id = "model", value_name = "DIR")]
    pub path: Option<PathBuf>,
    /// The embedded trained model run when --model is left out: nemotron_h or qwen3_5, both small models trained on the
    /// King James Bible and Jane Austen's novels.
    #[arg(long, value_enum, value_name = "ARCH", default_value_t = DefaultModel::NemotronH, conflicts_with = "model")]
    pub default_model: DefaultModel,
}

impl ModelArgs {
    /// `--model dir`.
    pub fn dir(dir: PathBuf) -> Self {
        ModelArgs {
            path: Some(dir),
            default_model: DefaultModel::default(),
        }
    }
}
