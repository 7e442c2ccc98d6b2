//! `rewind init-model`: writes a complete HF-format checkpoint with seeded random weights.
//!
//! The tensor list is not written down a second time: the model's own loader is run against a [`ShapeRecorder`], which
//! answers every `take` with zeros and records the name and shape. Each recorded tensor is then filled from a
//! deterministic generator keyed by (seed, name, chunk) and streamed to disk, so even real-shape checkpoints never
//! sit in memory twice.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde_json::json;

use crate::checkpoint::writer::{write_streaming, WriteDtype};
use crate::error::{EngineError, Result};
use crate::model::tensors::TensorSource;
use crate::model::{Family, ModelConfig};
use crate::presets::{preset_config, tokenizer_vocab};
use crate::shard::ShardedModel;
use crate::tokenizer::bpe_builder::{build_bpe_tokenizer, write_tokenizer_files, SpecialTokenChoice};

/// What to build.
#[derive(Clone, Debug)]
pub struct InitOptions {
    pub family: Family,
    pub preset: String,
    pub layers: Option<usize>,
    pub seed: u64,
    pub out: PathBuf,
    /// Storage dtype; `None` picks f32 for `tiny`/`small` and bf16 for real shapes.
    pub dtype: Option<WriteDtype>,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct InitReport {
    pub dir: PathBuf,
    pub parameters: u64,
    pub tensors: usize,
    pub config: ModelConfig,
}

/// A [`TensorSource`] that records every requested tensor and hands back zeros (allocated lazily by the OS).
#[derive(Default)]
pub struct ShapeRecorder {
    pub tensors: BTreeMap<String, Vec<usize>>,
}

impl TensorSource for ShapeRecorder {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        if self.tensors.insert(name.to_string(), shape.to_vec()).is_some() {
            return Err(EngineError::Checkpoint(format!("tensor `{name}` requested twice")));
        }
        Ok(vec![0.0; shape.iter().product()])
    }

    fn contains(&self, _name: &str) -> bool {
        false
    }

    fn shape_of(&self, _name: &str) -> Option<Vec<usize>> {
        None
    }

    fn finish(&mut self, _keep: &[&str], _ignore: &[&str]) -> Result<()> {
        Ok(())
    }
}

/// Every tensor (name → shape) a checkpoint of `config` holds.
pub fn plan_tensors(config: &ModelConfig) -> Result<BTreeMap<String, Vec<usize>>> {
    let mut rec = ShapeRecorder::default();
    ShardedModel::load_streaming(config.clone(), 1, 0, &mut rec, |_| Ok(()))?;
    Ok(rec.tensors)
}

/// How one tensor is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    /// Uniform with this standard deviation around `mean`.
    Uniform { mean: f32, std: f32 },
    /// `A_log = log(U(1, 16))`.
    ALog,
    /// `dt_bias = softplus⁻¹(dt)`, `dt` log-uniform in [0.001, 0.1].
    DtBias,
}

fn init_for(name: &str, shape: &[usize], family: Family, blocks: usize) -> Init {
    let last = *shape.last().unwrap_or(&1) as f32;
    let zero_centred = family != Family::NemotronH;
    if name.ends_with("A_log") {
        Init::ALog
    } else if name.ends_with("dt_bias") {
        Init::DtBias
    } else if name.ends_with(".D") {
        Init::Uniform { mean: 1.0, std: 0.1 }
    } else if name.ends_with("conv1d.weight") {
        Init::Uniform {
            mean: 0.0,
            std: 0.5 / last.sqrt(),
        }
    } else if name.ends_with(".bias") || name.ends_with("e_score_correction_bias") {
        Init::Uniform { mean: 0.0, std: 0.05 }
    } else if shape.len() == 1 {
        // Norm weights: plain weights sit around 1, zero-centred ones around 0 (the GDN gated norm is plain).
        let plain = !zero_centred || name.ends_with("linear_attn.norm.weight");
        Init::Uniform {
            mean: if plain { 1.0 } else { 0.0 },
            std: 0.1,
        }
    } else if name.ends_with("embeddings.weight") || name.ends_with("embed_tokens.weight") {
        Init::Uniform { mean: 0.0, std: 0.5 }
    } else if ["o_proj.weight", "out_proj.weight", "down_proj.weight"]
        .iter()
        .any(|s| name.ends_with(s))
        || name.ends_with("experts.down_proj")
    {
        // Residual outputs shrink with depth so the residual stream stays O(1).
        Init::Uniform {
            mean: 0.0,
            std: 1.0 / last.sqrt() / (blocks as f32).sqrt().max(1.0),
        }
    } else {
        Init::Uniform {
            mean: 0.0,
            std: 1.0 / last.sqrt(),
        }
    }
}

fn fnv1a(seed: u64, name: &str, chunk: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for b in name.bytes().chain(chunk.to_le_bytes()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

const FILL_CHUNK: usize = 1 << 16;

/// Fills `out` with the deterministic random values of tensor `name`.
fn fill(seed: u64, name: &str, init: Init, out: &mut [f32]) {
    out.par_chunks_mut(FILL_CHUNK).enumerate().for_each(|(i, chunk)| {
        let mut rng = ChaCha8Rng::seed_from_u64(fnv1a(seed, name, i as u64));
        for v in chunk.iter_mut() {
            let u: f32 = rng.random::<f32>();
            *v = match init {
                Init::Uniform { mean, std } => mean + (2.0 * u - 1.0) * std * 3f32.sqrt(),
                Init::ALog => (1.0 + 15.0 * u).ln(),
                Init::DtBias => {
                    let dt = (0.001f32.ln() + u * (0.1f32.ln() - 0.001f32.ln())).exp();
                    dt + (-(-dt).exp_m1()).ln()
                }
            };
        }
    });
}

/// Builds the checkpoint `opts` describes.
pub fn init_model(opts: &InitOptions) -> Result<InitReport> {
    let vocab = tokenizer_vocab(&opts.preset);
    let tokenizer = build_bpe_tokenizer(vocab)?;
    let id = |tok: &str| {
        tokenizer
            .token_to_id(tok)
            .ok_or_else(|| EngineError::Tokenizer(format!("built tokenizer lacks special token {tok}")))
    };
    let bos = id("<|endoftext|>")?;
    let eos = id("<|im_end|>")?;
    let cfg_json = preset_config(
        opts.family,
        &opts.preset,
        opts.layers,
        tokenizer.get_vocab_size(true),
        bos,
        eos,
    )?;
    let config = ModelConfig::from_json(&cfg_json)?;
    let tensors = plan_tensors(&config)?;
    let dtype = opts
        .dtype
        .unwrap_or(if matches!(opts.preset.as_str(), "tiny" | "small") {
            WriteDtype::F32
        } else {
            WriteDtype::BF16
        });
    std::fs::create_dir_all(&opts.out).map_err(|e| EngineError::io(&opts.out, e))?;
    let blocks = config.num_blocks();
    let specs: Vec<(String, Vec<usize>)> = tensors.iter().map(|(n, s)| (n.clone(), s.clone())).collect();
    let family = config.family;
    let seed = opts.seed;
    write_streaming(&opts.out, dtype, Some(4 << 30), &specs, |name, buf| {
        let shape = tensors.get(name).map(Vec::as_slice).unwrap_or(&[]);
        fill(seed, name, init_for(name, shape, family, blocks), buf);
        Ok(())
    })?;
    let mut cfg_json = cfg_json;
    cfg_json["torch_dtype"] = json!(match dtype {
        WriteDtype::F32 => "float32",
        WriteDtype::BF16 => "bfloat16",
    });
    write_json(&opts.out.join("config.json"), &cfg_json)?;
    write_json(
        &opts.out.join("generation_config.json"),
        &json!({"bos_token_id": bos, "eos_token_id": [eos], "pad_token_id": eos, "do_sample": true,
                "temperature": 0.7, "top_p": 0.9, "top_k": 40, "transformers_version": "5.17.0"}),
    )?;
    write_tokenizer_files(&opts.out, &tokenizer, &SpecialTokenChoice::default())?;
    let parameters = tensors.values().map(|s| s.iter().product::<usize>() as u64).sum();
    Ok(InitReport {
        dir: opts.out.clone(),
        parameters,
        tensors: tensors.len(),
        config,
    })
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| EngineError::Json {
        path: path.into(),
        message: e.to_string(),
    })?;
    std::fs::write(path, text + "\n").map_err(|e| EngineError::io(path, e))
}

/// A `tiny` checkpoint of `family` from `seed` in a temporary directory, for unit tests that need a whole model.
#[cfg(test)]
pub(crate) fn tiny_checkpoint(family: Family, seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    init_model(&InitOptions {
        family,
        preset: "tiny".into(),
        layers: None,
        seed,
        out: dir.path().to_path_buf(),
        dtype: None,
    })
    .expect("init-model");
    dir
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_is_deterministic_and_named() {
        let mut a = vec![0.0; 70_000];
        let mut b = vec![0.0; 70_000];
        fill(7, "x.weight", Init::Uniform { mean: 0.0, std: 1.0 }, &mut a);
        fill(7, "x.weight", Init::Uniform { mean: 0.0, std: 1.0 }, &mut b);
        assert_eq!(a, b);
        fill(7, "y.weight", Init::Uniform { mean: 0.0, std: 1.0 }, &mut b);
        assert_ne!(a, b);
        let std = (a.iter().map(|v| v * v).sum::<f32>() / a.len() as f32).sqrt();
        assert!((std - 1.0).abs() < 0.02, "std {std}");
    }

    #[test]
    fn dt_bias_inverts_softplus_into_range() {
        let mut v = vec![0.0; 1000];
        fill(1, "m.dt_bias", Init::DtBias, &mut v);
        for x in v {
            let dt = rewind_kernels::cpu::act::softplus(x);
            assert!((0.00099..=0.1001).contains(&dt), "dt {dt}");
        }
    }
}
