//! [`MtpWeights`]: what the MTP drafter reads from a checkpoint, loaded once and shared by every request's drafter.
//! The MTP layer itself (its layout and forward pass) is [`crate::model::mtp`]; loading the embedding, LM head and
//! final norm beside it needs the checkpoint reader and the rank plan's tensor names, which sit above `model`.

use std::path::Path;
use std::sync::Arc;

use rewind_kernels::cpu::norm::rms_norm_vec;
use serde_json::Value;

use crate::error::{EngineError, Result};
use crate::model::mixers::attention::KvCache;
use crate::model::mtp::{mtp_layout, MtpHead};
use crate::model::tensors::TensorSource;
use crate::model::ModelConfig;
use crate::shard::model::OpenCheckpoint;
use crate::shard::RankPlan;

/// Everything the MTP drafter reads, shared by every request's drafter: the MTP head plus the embedding, the LM head
/// (or the tied embedding) and the main model's final norm, all f32 on the host.
pub struct MtpWeights {
    config: ModelConfig,
    /// `[vocab, hidden]`.
    embed: Vec<f32>,
    /// `[vocab, hidden]`; `None` when the LM head is the tied embedding.
    lm_head: Option<Vec<f32>>,
    /// The main model's final norm, applied to the target's hidden rows (which come before it).
    final_norm: Vec<f32>,
    head: MtpHead,
}

impl MtpWeights {
    /// Loads the MTP weights of the checkpoint in `dir` (config.json and its safetensors), and only those: the
    /// `mtp.` tensors, the embedding, the LM head and the final norm.
    ///
    /// A checkpoint without MTP layers (`mtp_num_hidden_layers` / `num_nextn_predict_layers` absent or 0, or no
    /// `mtp.*` tensors) is [`EngineError::InvalidInput`]; an MTP layer other than attention then FFN is
    /// [`EngineError::NotSupported`].
    pub fn load(dir: &Path) -> Result<Arc<Self>> {
        let mut c = OpenCheckpoint::open(dir, true)?;
        Ok(Arc::new(Self::from_source(c.config, &c.json, &mut c.src)?))
    }

    /// Loads from any tensor source; `config_json` is the config `config` was parsed from.
    pub fn from_source(config: ModelConfig, config_json: &Value, src: &mut dyn TensorSource) -> Result<Self> {
        // The one-rank plan names the embedding, final norm and LM head exactly as the model loader does.
        let plan = {
            let view: &dyn TensorSource = src;
            RankPlan::new(&config, 1, 0, &|n| view.contains(n))?
        };
        let (vocab, h) = (config.vocab_size, config.hidden_size);
        let embed = src.take(&plan.embed.name, &[vocab, h])?;
        let final_norm = src.take(&plan.final_norm.name, &[h])?;
        let lm_head = match &plan.lm_head {
            Some(t) => Some(src.take(&t.name, &[vocab, h])?),
            None => None,
        };
        let head = MtpHead::load(&config, &mtp_layout(config_json)?, src)?;
        Ok(MtpWeights {
            config,
            embed,
            lm_head,
            final_norm,
            head,
        })
    }

    /// The main model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The LM head `[vocab, hidden]` (the embedding when tied).
    pub fn lm_head(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }

    /// An empty KV cache for the MTP layer's attention.
    pub fn new_cache(&self) -> KvCache {
        self.head.new_cache()
    }

    /// The target's hidden rows `[t, hidden]` (before the final norm, as the ranks return them) under the main
    /// model's final norm: the `hidden` input of an MTP step.
    pub fn normalise_target(&self, rows: &[f32]) -> Vec<f32> {
        rms_norm_vec(rows, &self.final_norm, self.config.norm_eps, self.config.norm_offset)
    }

    /// One MTP step over `tokens.len()` rows, appending their keys and values to `cache`: `hidden` `[t, hidden]` is
    /// each row's hidden input ([`MtpWeights::normalise_target`] of the target's rows, or a previous step's output)
    /// and `tokens` the token that followed it. Returns the outputs `[t, hidden]` (after `mtp.norm`): the LM head's
    /// input, and the next step's `hidden`. RoPE positions are `cache.len()..`.
    pub fn forward(&self, hidden: &[f32], tokens: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        let (h, vocab, t) = (self.config.hidden_size, self.config.vocab_size, tokens.len());
        if hidden.len() != t * h {
            return Err(EngineError::InvalidInput(format!(
                "MTP step: {} hidden values for {t} rows of {h}",
                hidden.len()
            )));
        }
        let mut emb = Vec::with_capacity(t * h);
        for &tok in tokens {
            let id = tok as usize;
            if id >= vocab {
                return Err(EngineError::InvalidInput(format!(
                    "MTP step: token id {tok} is out of range (vocab size {vocab})"
                )));
            }
            emb.extend_from_slice(&self.embed[id * h..(id + 1) * h]);
        }
        if t == 0 {
            return Ok(Vec::new());
        }
        self.head.forward(&emb, hidden, t, cache, &mut |_| Ok(()))
    }
}
