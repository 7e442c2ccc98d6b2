//! `rewind init-model`: writes a complete HF-format checkpoint with seeded random weights.
//!
//! The tensor list is not written down a second time: the model's own loader is run against a [`ShapeRecorder`], which
//! answers every `take` with zeros and records the name and shape. Each recorded tensor is then filled from a
//! deterministic generator keyed by (seed, name, chunk) and streamed to disk, so even real-shape checkpoints never
//! sit in memory twice.
//!
//! The tokenizer is a byte-level BPE trained in code ([`build_bpe_tokenizer`]); for the real shapes, whose published
//! vocabularies are far larger than the shipped corpus can train, the ids past the trained ones are placeholder tokens
//! (`<|id_N|>`, see [`pad_tokenizer`]), so the tokenizer has exactly the config's `vocab_size` ids and every id decodes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde_json::json;

use crate::checkpoint::writer::{write_streaming, WriteDtype};
use crate::error::{EngineError, Result};
use crate::model::tensors::ShapeRecorder;
use crate::model::{Family, ModelConfig};
use crate::presets::{preset_config, tokenizer_vocab};
use crate::shard::ShardedModel;
use crate::tokenizer::bpe_builder::{
    build_bpe_tokenizer, write_tokenizer_files, SpecialTokenChoice, ENDOFTEXT, IM_END,
};

/// The `config.json` key (`true`) that marks a checkpoint of random weights written here; commands that load one say
/// its output is noise. Other readers (the config parser, transformers) ignore it.
pub const RANDOM_INIT_MARKER: &str = "rewind_random_init";

/// Whether the checkpoint in `dir` carries [`RANDOM_INIT_MARKER`]. A missing or unreadable `config.json` counts as
/// unmarked: loading the model reports that error.
pub fn has_random_init_marker(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|text| crate::model::json::parse_relaxed(&text).ok())
        .is_some_and(|v| v.get(RANDOM_INIT_MARKER).and_then(serde_json::Value::as_bool) == Some(true))
}

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
    /// Also write one random MTP layer for the MTP drafter: `mtp.*` in the family's published layout, with
    /// `mtp_num_hidden_layers: 1` (Qwen) or `num_nextn_predict_layers: 1` and `mtp_hybrid_override_pattern: "*E"`
    /// (Nemotron-3, as Nemotron-3-Super's config.json).
    pub mtp: bool,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct InitReport {
    pub dir: PathBuf,
    pub parameters: u64,
    pub tensors: usize,
    pub config: ModelConfig,
}

/// Every tensor (name → shape) a checkpoint of `config` holds.
pub fn plan_tensors(config: &ModelConfig) -> Result<BTreeMap<String, Vec<usize>>> {
    let mut rec = ShapeRecorder::default();
    ShardedModel::load_streaming(config.clone(), None, 1, 0, &mut rec, |_| Ok(()))?;
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

/// The text of the placeholder token that stands for `id` past a preset's trained BPE vocabulary.
pub fn placeholder_token(id: usize) -> String {
    format!("<|id_{id}|>")
}

/// Extends `tokenizer` to exactly `vocab_size` ids: each id past its vocabulary becomes the placeholder token
/// [`placeholder_token`]`(id)` in the BPE model's vocabulary. No merge produces a placeholder, so encoding never yields
/// one, while decoding one gives its text (the ByteLevel decoder passes printable ASCII through), so no id the model
/// can sample decodes to nothing. A tokenizer that already has `vocab_size` ids is returned as is.
pub fn pad_tokenizer(tokenizer: &tokenizers::Tokenizer, vocab_size: usize) -> Result<tokenizers::Tokenizer> {
    let have = tokenizer.get_vocab_size(true);
    if have == vocab_size {
        return Ok(tokenizer.clone());
    }
    if have > vocab_size {
        return Err(EngineError::config(
            "vocab_size",
            format!("the model's {vocab_size} ids cannot hold its tokenizer's {have}"),
        ));
    }
    let err = |message: String| EngineError::Tokenizer(format!("padding the tokenizer to {vocab_size} ids: {message}"));
    // The new ids must follow the existing ones without a gap or a collision.
    let ids = tokenizer.get_vocab(true);
    if ids.len() != have || ids.values().any(|&id| id as usize >= have) {
        return Err(err(format!("its {have} ids are not 0..{have}")));
    }
    let mut model = serde_json::to_value(tokenizer.get_model()).map_err(|e| err(e.to_string()))?;
    let vocab = model
        .get_mut("vocab")
        .and_then(serde_json::Value::as_object_mut)
        .ok_or_else(|| err("its model has no vocabulary".into()))?;
    for id in have..vocab_size {
        vocab.insert(placeholder_token(id), json!(id));
    }
    let model: tokenizers::models::ModelWrapper = serde_json::from_value(model).map_err(|e| err(e.to_string()))?;
    let mut padded = tokenizer.clone();
    padded.with_model(model);
    let got = padded.get_vocab_size(true);
    if got != vocab_size {
        return Err(err(format!("got {got} ids")));
    }
    Ok(padded)
}

/// What a preset's checkpoint holds besides its weights.
pub struct PresetFiles {
    /// `config.json` (with `torch_dtype` still `float32`).
    pub config: serde_json::Value,
    /// The tokenizer: trained BPE for the first [`tokenizer_vocab`] ids, placeholders ([`pad_tokenizer`]) up to the
    /// config's `vocab_size`, so it has exactly `vocab_size` ids.
    pub tokenizer: tokenizers::Tokenizer,
    /// BOS id (`<|endoftext|>`).
    pub bos: u32,
    /// EOS id (`<|im_end|>`).
    pub eos: u32,
}

/// The config and tokenizer of `preset` for `family`, cut to `layers` if given; no weights are planned or written.
pub fn preset_files(family: Family, preset: &str, layers: Option<usize>) -> Result<PresetFiles> {
    let trained = build_bpe_tokenizer(tokenizer_vocab(preset))?;
    let id = |tok: &str| {
        trained
            .token_to_id(tok)
            .ok_or_else(|| EngineError::Tokenizer(format!("built tokenizer lacks special token {tok}")))
    };
    let bos = id(ENDOFTEXT)?;
    let eos = id(IM_END)?;
    let config = preset_config(family, preset, layers, trained.get_vocab_size(true), bos, eos)?;
    let vocab_size = config["vocab_size"]
        .as_u64()
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| EngineError::config("vocab_size", format!("preset `{preset}` has no vocab_size")))?;
    let tokenizer = pad_tokenizer(&trained, vocab_size)?;
    Ok(PresetFiles {
        config,
        tokenizer,
        bos,
        eos,
    })
}

/// Files of an earlier checkpoint in the output directory that a loader would read in place of (or beside) the ones
/// init-model writes; they are removed before writing. Stale weight shards are removed by the writer.
const STALE_SIDE_FILES: &[&str] = &[
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

/// Checks that init-model may write into `out`: it must not exist, or be an empty directory, unless `force` (then any
/// directory will do, and the checkpoint files in it are replaced). Nothing is written or removed.
pub fn check_out_dir(out: &Path, force: bool) -> Result<()> {
    let meta = match std::fs::metadata(out) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(EngineError::io(out, e)),
    };
    if !meta.is_dir() {
        return Err(EngineError::InvalidInput(format!(
            "--out {} exists and is not a directory",
            out.display()
        )));
    }
    if force {
        return Ok(());
    }
    let mut entries = std::fs::read_dir(out).map_err(|e| EngineError::io(out, e))?;
    if let Some(entry) = entries.next() {
        let first = entry.map_err(|e| EngineError::io(out, e))?.file_name();
        return Err(EngineError::InvalidInput(format!(
            "--out {} already exists and is not empty (it holds {}{}); pass --force to write the new checkpoint \
             over the one there, or choose another directory",
            out.display(),
            first.to_string_lossy(),
            if entries.next().is_some() { ", ..." } else { "" }
        )));
    }
    Ok(())
}

/// Builds the checkpoint `opts` describes. Files of an earlier checkpoint in `opts.out` are replaced; callers that must
/// not overwrite one check with [`check_out_dir`] first.
pub fn init_model(opts: &InitOptions) -> Result<InitReport> {
    let PresetFiles {
        config: cfg_json,
        tokenizer,
        bos,
        eos,
    } = preset_files(opts.family, &opts.preset, opts.layers)?;
    let mut cfg_json = cfg_json;
    if opts.mtp {
        if opts.family == Family::NemotronH {
            // An attention layer then a MoE layer, built from the preset's attention and MoE fields (every
            // nemotron_h preset has both, MoE layers or not).
            cfg_json["num_nextn_predict_layers"] = json!(1);
            cfg_json["mtp_hybrid_override_pattern"] = json!("*E");
        } else {
            // The presets' configs are text configs, where the published checkpoints keep this field.
            cfg_json["mtp_num_hidden_layers"] = json!(1);
        }
    }
    let config = ModelConfig::from_json(&cfg_json)?;
    let mut tensors = plan_tensors(&config)?;
    if opts.mtp {
        tensors.extend(crate::model::mtp::plan_mtp_tensors(&cfg_json, &config)?);
    }
    let dtype = opts
        .dtype
        .unwrap_or(if matches!(opts.preset.as_str(), "tiny" | "tiny-latent" | "small") {
            WriteDtype::F32
        } else {
            WriteDtype::BF16
        });
    std::fs::create_dir_all(&opts.out).map_err(|e| EngineError::io(&opts.out, e))?;
    for name in STALE_SIDE_FILES {
        let path = opts.out.join(name);
        if path.is_file() {
            std::fs::remove_file(&path).map_err(|e| EngineError::io(&path, e))?;
        }
    }
    let blocks = config.num_blocks();
    let specs: Vec<(String, Vec<usize>)> = tensors.iter().map(|(n, s)| (n.clone(), s.clone())).collect();
    let family = config.family;
    let seed = opts.seed;
    let elements: u64 = specs.iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum();
    let mut progress = crate::progress::Progress::new(
        format!("writing {} parameters to {}", elements, opts.out.display()),
        elements,
    );
    write_streaming(&opts.out, dtype, Some(4 << 30), &specs, |name, buf| {
        let shape = tensors.get(name).map(Vec::as_slice).unwrap_or(&[]);
        fill(seed, name, init_for(name, shape, family, blocks), buf);
        progress.advance(buf.len() as u64);
        Ok(())
    })?;
    cfg_json["torch_dtype"] = json!(match dtype {
        WriteDtype::F32 => "float32",
        WriteDtype::BF16 => "bfloat16",
    });
    cfg_json[RANDOM_INIT_MARKER] = json!(true);
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
        mtp: false,
    })
    .expect("init-model");
    dir
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::bpe_builder::SPECIAL_TOKENS;

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

    /// Every id of every preset's config vocabulary decodes to text with the tokenizer init-model writes (no weights).
    #[test]
    fn every_preset_tokenizer_covers_its_config_vocab() {
        use crate::presets::PRESETS;
        for p in PRESETS {
            let t = std::time::Instant::now();
            let files = preset_files(p.family, p.name, Some(1)).expect("preset files");
            let vocab_size = files.config["vocab_size"].as_u64().expect("vocab_size") as usize;
            let built = t.elapsed().as_secs_f64();
            let tok = &files.tokenizer;
            assert_eq!(tok.get_vocab_size(true), vocab_size, "{} {}", p.family.name(), p.name);
            assert!(tok.id_to_token(vocab_size as u32).is_none());
            let trained = tokenizer_vocab(p.name);
            let empty: Vec<u32> = (0..vocab_size as u32)
                .into_par_iter()
                .filter(|&id| {
                    // What generation shows (specials skipped) for every id but the specials themselves.
                    let skip = id as usize >= SPECIAL_TOKENS.len();
                    tok.decode(&[id], skip).map_or(true, |s| s.is_empty())
                })
                .collect();
            assert!(
                empty.is_empty(),
                "{} {}: ids decoding to nothing: {:?}",
                p.family.name(),
                p.name,
                &empty[..empty.len().min(10)]
            );
            if vocab_size > trained {
                let last = vocab_size as u32 - 1;
                assert_eq!(tok.decode(&[last], true).unwrap(), placeholder_token(last as usize));
                assert_eq!(tok.decode(&[trained as u32], true).unwrap(), placeholder_token(trained));
            }
            eprintln!(
                "{} {}: {vocab_size} ids, built in {built:.2} s",
                p.family.name(),
                p.name
            );
        }
    }

    /// Placeholders are reachable only by id: text that spells one encodes with trained tokens and round-trips.
    #[test]
    fn placeholders_never_come_out_of_encoding() {
        let trained = build_bpe_tokenizer(600).unwrap();
        let tok = pad_tokenizer(&trained, 5000).unwrap();
        assert_eq!(tok.get_vocab_size(true), 5000);
        assert_eq!(tok.token_to_id("<|id_4999|>"), Some(4999));
        for text in ["<|id_600|> and <|id_4999|>", "plain words, <|im_end|>", ""] {
            let enc = tok.encode(text, false).unwrap();
            assert!(enc.get_ids().iter().all(|&id| id < 600), "{text}: {:?}", enc.get_ids());
            assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), text);
            assert_eq!(enc.get_ids(), trained.encode(text, false).unwrap().get_ids());
        }
        // Same size: unchanged; smaller: an error naming both sizes.
        assert_eq!(
            pad_tokenizer(&trained, 600).unwrap().to_string(false).unwrap(),
            trained.to_string(false).unwrap()
        );
        let e = pad_tokenizer(&trained, 599).unwrap_err().to_string();
        assert!(
            e.contains("vocab_size") && e.contains("599") && e.contains("600"),
            "{e}"
        );
    }

    /// The padded tokenizer of the largest vocabulary survives its files: written, loaded back, same ids.
    #[test]
    fn padded_tokenizer_files_load_back() {
        let files = preset_files(Family::Qwen35, "qwen3.5-4b", Some(1)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer_files(dir.path(), &files.tokenizer, &SpecialTokenChoice::default()).unwrap();
        let bytes = std::fs::metadata(dir.path().join("tokenizer.json")).unwrap().len();
        let t = std::time::Instant::now();
        let tok = crate::tokenizer::Tokenizer::from_dir(dir.path()).unwrap();
        eprintln!(
            "tokenizer.json of 248320 ids: {:.1} MB, loads in {:.2} s",
            bytes as f64 / 1e6,
            t.elapsed().as_secs_f64()
        );
        assert_eq!(tok.vocab_size(), 248_320);
        assert_eq!(tok.decode(&[248_319], true).unwrap(), "<|id_248319|>");
        assert_eq!(
            tok.decode(&tok.encode("Hello, world", false).unwrap(), true).unwrap(),
            "Hello, world"
        );
    }

    /// init-model marks its checkpoints as random; the marker does not disturb the config parser, and a directory
    /// without it (or without a config) is unmarked.
    #[test]
    fn random_init_marker_is_written_and_read() {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().join("tiny");
        let opts = InitOptions {
            family: Family::Qwen35,
            preset: "tiny".into(),
            layers: Some(1),
            seed: 0,
            out: out.clone(),
            dtype: None,
            mtp: false,
        };
        init_model(&opts).unwrap();
        assert!(has_random_init_marker(&out));
        ModelConfig::from_dir(&out).unwrap();
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        config.as_object_mut().unwrap().remove(RANDOM_INIT_MARKER);
        std::fs::write(out.join("config.json"), config.to_string()).unwrap();
        assert!(!has_random_init_marker(&out));
        assert!(!has_random_init_marker(&root.path().join("missing")));
    }

    #[test]
    fn out_dir_must_be_absent_or_empty_unless_forced() {
        let root = tempfile::tempdir().unwrap();
        let missing = root.path().join("new");
        check_out_dir(&missing, false).unwrap();
        let empty = root.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        check_out_dir(&empty, false).unwrap();
        std::fs::write(empty.join("config.json"), "{}").unwrap();
        let e = check_out_dir(&empty, false).unwrap_err().to_string();
        assert!(
            e.contains(&empty.display().to_string()) && e.contains("not empty") && e.contains("--force"),
            "{e}"
        );
        check_out_dir(&empty, true).unwrap();
        let file = root.path().join("file");
        std::fs::write(&file, "x").unwrap();
        for force in [false, true] {
            let e = check_out_dir(&file, force).unwrap_err().to_string();
            assert!(e.contains("not a directory"), "{e}");
        }
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
