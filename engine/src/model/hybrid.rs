//! The hybrid model: embedding, a stack of residual blocks `x += mixer(norm(x))`, final norm and LM head.
//!
//! Prefill runs a whole prompt through each block in one call (chunked SSM scans, GEMM-shaped attention); decode runs one
//! token through the recurrent steps. Both paths share the same per-sequence [`SequenceState`].

use rewind_kernels::cpu::{gemm, norm};
use tracing::debug_span;

use super::config::{BlockKind, ModelConfig};
use super::mixers::attention::{AttentionMixer, KvCache};
use super::mixers::ffn::{Mlp, Moe};
use super::mixers::gdn::{GdnMixer, GdnState};
use super::mixers::mamba2::{Mamba2Mixer, Mamba2State};
use super::tensors::TensorSource;
use crate::error::{EngineError, Result};

/// One block's mixer.
pub enum Mixer {
    Mamba2(Mamba2Mixer),
    Gdn(GdnMixer),
    Attention(AttentionMixer),
    Mlp(Mlp),
    Moe(Moe),
}

/// A residual block: `x += mixer(rms_norm(x))`.
pub struct Block {
    norm: Vec<f32>,
    mixer: Mixer,
}

/// The state one block keeps for one sequence.
#[derive(Clone)]
pub enum BlockState {
    /// FFN blocks keep nothing.
    Stateless,
    Mamba2(Mamba2State),
    Gdn(GdnState),
    Kv(KvCache),
}

/// Everything a sequence carries between forward calls (cloneable, so a test can branch a sequence).
#[derive(Clone)]
pub struct SequenceState {
    pub blocks: Vec<BlockState>,
    /// Number of tokens processed so far (the next token's position).
    pub position: usize,
}

/// Which positions' logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Every position: `[t, vocab]`.
    All,
    /// Only the last position: `[vocab]`.
    Last,
}

/// A loaded model, ready to run on the CPU.
pub struct Model {
    config: ModelConfig,
    embed: Vec<f32>,
    blocks: Vec<Block>,
    final_norm: Vec<f32>,
    /// `None` when the embeddings are tied.
    lm_head: Option<Vec<f32>>,
}

impl Model {
    /// Builds the model from `config`, taking every tensor from `src` (which must hold nothing else, but for the
    /// config's keep/ignore prefixes).
    pub fn load(config: ModelConfig, src: &mut dyn TensorSource) -> Result<Self> {
        let mut blocks = Vec::with_capacity(config.num_blocks());
        let outer = load_blocks(&config, src, |b| blocks.push(b))?;
        Ok(Model {
            config,
            embed: outer.embed,
            blocks,
            final_norm: outer.final_norm,
            lm_head: outer.lm_head,
        })
    }

    /// Loads `dir/config.json` and the safetensors checkpoint beside it.
    pub fn from_dir(dir: &std::path::Path) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let mut src = crate::checkpoint::SafetensorsSource::open(dir)?;
        Self::load(config, &mut src)
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// A fresh state for a new sequence.
    pub fn new_state(&self) -> SequenceState {
        let blocks = self
            .blocks
            .iter()
            .map(|b| match &b.mixer {
                Mixer::Mamba2(m) => BlockState::Mamba2(m.new_state()),
                Mixer::Gdn(m) => BlockState::Gdn(m.new_state()),
                Mixer::Attention(m) => BlockState::Kv(m.new_cache()),
                Mixer::Mlp(_) | Mixer::Moe(_) => BlockState::Stateless,
            })
            .collect();
        SequenceState { blocks, position: 0 }
    }

    /// Checks that `tokens` can be appended to a sequence at `position`.
    pub fn check_tokens(&self, tokens: &[u32], position: usize) -> Result<()> {
        if let Some((i, &t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= self.config.vocab_size)
        {
            return Err(EngineError::InvalidInput(format!(
                "token id {t} at index {i} is out of range (vocab size {})",
                self.config.vocab_size
            )));
        }
        let end = position + tokens.len();
        if end > self.config.max_position_embeddings {
            return Err(EngineError::InvalidInput(format!(
                "context of {end} tokens exceeds the model's limit of {} (max_position_embeddings)",
                self.config.max_position_embeddings
            )));
        }
        Ok(())
    }

    /// Runs `tokens` through the model, appending them to `state`. More than one token takes the prefill path
    /// (chunked scans); one token takes the decode path (recurrent steps). Returns logits as `which` asks.
    pub fn forward(&self, tokens: &[u32], state: &mut SequenceState, which: Logits) -> Result<Vec<f32>> {
        let t = tokens.len();
        if t == 0 {
            return Err(EngineError::InvalidInput("no tokens to process".into()));
        }
        self.check_tokens(tokens, state.position)?;
        let _span = debug_span!("forward", tokens = t, position = state.position).entered();
        let hidden = self.config.hidden_size;
        let mut x = self.embed_tokens(tokens);
        let pos = state.position;
        for (block, bstate) in self.blocks.iter().zip(state.blocks.iter_mut()) {
            let h = self.block_input(block, &x);
            let y = match (&block.mixer, bstate) {
                (Mixer::Mamba2(m), BlockState::Mamba2(s)) => m.forward(&h, t, s),
                (Mixer::Gdn(m), BlockState::Gdn(s)) => m.forward(&h, t, s),
                (Mixer::Attention(m), BlockState::Kv(c)) => m.forward(&h, t, pos, c),
                (Mixer::Mlp(m), BlockState::Stateless) => m.forward(&h, t),
                (Mixer::Moe(m), BlockState::Stateless) => m.forward(&h, t),
                _ => {
                    return Err(EngineError::InvalidInput(
                        "sequence state does not belong to this model".into(),
                    ))
                }
            };
            for (xi, yi) in x.iter_mut().zip(&y) {
                *xi += yi;
            }
        }
        state.position += t;
        let rows = match which {
            Logits::All => t,
            Logits::Last => 1,
        };
        self.head_logits(&x[(t - rows) * hidden..], pos + t - rows)
    }

    /// The residual blocks, in model order (`layers` flattened).
    pub fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// The embedding rows of `tokens`, `[t, hidden]`. Ids must have passed [`Model::check_tokens`].
    pub fn embed_tokens(&self, tokens: &[u32]) -> Vec<f32> {
        let hidden = self.config.hidden_size;
        let mut x = Vec::with_capacity(tokens.len() * hidden);
        for &tok in tokens {
            let row = tok as usize * hidden;
            x.extend_from_slice(&self.embed[row..row + hidden]);
        }
        x
    }

    /// A block's mixer input: the residual stream `x` (`[t, hidden]`) under the block's RMSNorm.
    pub fn block_input(&self, block: &Block, x: &[f32]) -> Vec<f32> {
        norm::rms_norm_vec(x, &block.norm, self.config.norm_eps, self.config.norm_offset)
    }

    /// Final norm and LM head over residual rows `x` (`[rows, hidden]`), the first of which is at
    /// `first_position` (for the error message). Returns `[rows, vocab]`; non-finite logits are an error.
    pub fn head_logits(&self, x: &[f32], first_position: usize) -> Result<Vec<f32>> {
        let hidden = self.config.hidden_size;
        let rows = x.len() / hidden.max(1);
        let normed = norm::rms_norm_vec(x, &self.final_norm, self.config.norm_eps, self.config.norm_offset);
        let head = self.lm_head.as_deref().unwrap_or(&self.embed);
        let logits = gemm::linear(&normed, head, None, rows, hidden, self.config.vocab_size);
        if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
            let row = i / self.config.vocab_size;
            return Err(EngineError::NonFinite {
                position: first_position + row,
            });
        }
        Ok(logits)
    }
}

impl Block {
    /// The block's mixer.
    pub fn mixer(&self) -> &Mixer {
        &self.mixer
    }
}

/// The tensors outside the blocks.
pub struct OuterWeights {
    pub embed: Vec<f32>,
    pub final_norm: Vec<f32>,
    pub lm_head: Option<Vec<f32>>,
}

/// Loads every tensor of `config` from `src`, handing each block to `on_block` as soon as it is built (so a caller that
/// only wants the tensor list can drop blocks one at a time), then checks that nothing unexpected is left in `src`.
pub fn load_blocks(
    config: &ModelConfig,
    src: &mut dyn TensorSource,
    mut on_block: impl FnMut(Block),
) -> Result<OuterWeights> {
    let hidden = config.hidden_size;
    let vocab = config.vocab_size;
    let prefix = config
        .prefixes
        .iter()
        .find(|p| src.contains(&format!("{p}{}", config.embed_name)))
        .unwrap_or(&config.prefixes[0])
        .clone();
    let embed = src.take(&format!("{prefix}{}", config.embed_name), &[vocab, hidden])?;
    for (i, layer) in config.layers.iter().enumerate() {
        let layer_prefix = format!("{prefix}{}{i}.", config.layers_name);
        for plan in layer {
            let norm = src.take(&format!("{layer_prefix}{}", plan.norm), &[hidden])?;
            let mp = format!("{layer_prefix}{}", plan.mixer);
            let mixer = match &plan.kind {
                BlockKind::Mamba2(s) => Mixer::Mamba2(Mamba2Mixer::load(s, src, &mp)?),
                BlockKind::Gdn(s) => Mixer::Gdn(GdnMixer::load(s, src, &mp)?),
                BlockKind::Attention(s) => Mixer::Attention(AttentionMixer::load(s, src, &mp)?),
                BlockKind::Mlp(s) => Mixer::Mlp(Mlp::load(s, src, &mp)?),
                BlockKind::Moe(s) => Mixer::Moe(Moe::load(s, src, &mp)?),
            };
            on_block(Block { norm, mixer });
        }
    }
    let final_norm = src.take(&format!("{prefix}{}", config.final_norm_name), &[hidden])?;
    // A stored head wins over `tie_word_embeddings`: configs disagree on where the flag lives (top level or
    // `text_config`), while a tied checkpoint that stores a copy holds the same values anyway.
    let lm_head = if src.contains("lm_head.weight") || !config.tie_word_embeddings {
        Some(src.take("lm_head.weight", &[vocab, hidden])?)
    } else {
        None
    };
    let keep: Vec<&str> = config.keep_prefixes.iter().map(String::as_str).collect();
    let ignore: Vec<&str> = config.ignore_prefixes.iter().map(String::as_str).collect();
    src.finish(&keep, &ignore)?;
    Ok(OuterWeights {
        embed,
        final_norm,
        lm_head,
    })
}
