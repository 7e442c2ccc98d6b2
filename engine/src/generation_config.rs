//! `generation_config.json`: the checkpoint's default sampling parameters and special token ids.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{EngineError, Result};
use crate::sample::SamplingParams;

/// Defaults read from `generation_config.json` (every field optional) merged with `config.json`'s token ids.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    /// End-of-sequence ids: generation_config's first, then config.json's, without duplicates.
    pub eos_token_ids: Vec<u32>,
    /// BOS id (generation_config, else config.json).
    pub bos_token_id: Option<u32>,
    /// Pad id (generation_config, else config.json).
    pub pad_token_id: Option<u32>,
    /// Default temperature.
    pub temperature: Option<f32>,
    /// Default nucleus threshold.
    pub top_p: Option<f32>,
    /// Default top-k (0 = off).
    pub top_k: Option<usize>,
    /// Default min-p.
    pub min_p: Option<f32>,
    /// Default repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// Default generation length.
    pub max_new_tokens: Option<usize>,
    /// `do_sample`; `Some(false)` means greedy decoding.
    pub do_sample: Option<bool>,
}

struct Fields<'a> {
    obj: Option<&'a Map<String, Value>>,
    source: String,
}

impl<'a> Fields<'a> {
    fn err(&self, field: &str, message: String) -> EngineError {
        EngineError::config(format!("{}: {field}", self.source), message)
    }

    fn get(&self, field: &str) -> Option<&'a Value> {
        self.obj.and_then(|o| o.get(field)).filter(|v| !v.is_null())
    }

    fn token_id(&self, field: &str, v: &Value) -> Result<u32> {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| self.err(field, format!("expected a non-negative token id, found {v}")))
    }

    fn ids(&self, field: &str) -> Result<Vec<u32>> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(|v| self.token_id(field, v)).collect(),
            Some(v) => Ok(vec![self.token_id(field, v)?]),
        }
    }

    fn id(&self, field: &str) -> Result<Option<u32>> {
        self.get(field).map(|v| self.token_id(field, v)).transpose()
    }

    fn float(&self, field: &str) -> Result<Option<f32>> {
        self.get(field)
            .map(|v| {
                v.as_f64()
                    .map(|f| f as f32)
                    .ok_or_else(|| self.err(field, format!("expected a number, found {v}")))
            })
            .transpose()
    }

    /// A number that must satisfy `ok` (described by `requirement`) when present.
    fn float_in(&self, field: &str, requirement: &str, ok: impl Fn(f32) -> bool) -> Result<Option<f32>> {
        match self.float(field)? {
            Some(v) if !ok(v) => {
                let raw = self.get(field).map(Value::to_string).unwrap_or_default();
                Err(self.err(field, format!("must be {requirement}, got {raw}")))
            }
            v => Ok(v),
        }
    }

    fn count(&self, field: &str) -> Result<Option<usize>> {
        self.get(field)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.err(field, format!("expected a non-negative integer, found {v}")))
            })
            .transpose()
    }

    fn flag(&self, field: &str) -> Result<Option<bool>> {
        self.get(field)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.err(field, format!("expected a boolean, found {v}")))
            })
            .transpose()
    }
}

impl GenerationDefaults {
    /// Reads `dir/generation_config.json` if it exists and merges the token ids of `config_json` (the parsed
    /// `config.json`; for multimodal checkpoints its `text_config` is consulted too). A malformed file, or a field of the
    /// wrong type or out of its range (a negative temperature, top-p above 1, ...), is an error naming the file's path
    /// and the field.
    pub fn from_dir(dir: impl AsRef<Path>, config_json: &Value) -> Result<Self> {
        let path = dir.as_ref().join("generation_config.json");
        let gen_json = if path.exists() {
            Some(crate::tokenizer::read_json(&path)?)
        } else {
            None
        };
        if let Some(v) = &gen_json {
            if !v.is_object() {
                return Err(EngineError::Json {
                    path,
                    message: "expected a JSON object at the top level".into(),
                });
            }
        }
        Self::parse(gen_json.as_ref(), path.display().to_string(), config_json)
    }

    /// [`GenerationDefaults::from_dir`] on already-parsed JSON (`generation` is the generation config, if any).
    pub fn from_json(generation: Option<&Value>, config_json: &Value) -> Result<Self> {
        Self::parse(generation, "generation_config.json".into(), config_json)
    }

    /// Reads the fields; `gen_source` names the generation config in errors (its path when read from a file). A
    /// sampling default out of its range is an error here, naming the file and the field, rather than later with no
    /// word of where the value came from.
    fn parse(generation: Option<&Value>, gen_source: String, config_json: &Value) -> Result<Self> {
        let gen = Fields {
            obj: generation.and_then(Value::as_object),
            source: gen_source,
        };
        let top = Fields {
            obj: config_json.as_object(),
            source: "config.json".into(),
        };
        let text = Fields {
            obj: config_json.get("text_config").and_then(Value::as_object),
            source: "config.json: text_config".into(),
        };
        let mut eos_token_ids = Vec::new();
        for ids in [
            gen.ids("eos_token_id")?,
            top.ids("eos_token_id")?,
            text.ids("eos_token_id")?,
        ] {
            for id in ids {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        let first = |field: &str| -> Result<Option<u32>> { Ok(gen.id(field)?.or(top.id(field)?).or(text.id(field)?)) };
        // The ranges `SamplingParams::validate_ranges` enforces.
        let max_new_tokens = gen.count("max_new_tokens")?;
        if max_new_tokens == Some(0) {
            return Err(gen.err("max_new_tokens", "must be at least 1, got 0".into()));
        }
        Ok(Self {
            eos_token_ids,
            bos_token_id: first("bos_token_id")?,
            pad_token_id: first("pad_token_id")?,
            temperature: gen.float_in("temperature", "a finite number >= 0", |t| t.is_finite() && t >= 0.0)?,
            top_p: gen.float_in("top_p", "in (0, 1]", |p| p > 0.0 && p <= 1.0)?,
            top_k: gen.count("top_k")?,
            min_p: gen.float_in("min_p", "in [0, 1]", |p| (0.0..=1.0).contains(&p))?,
            repetition_penalty: gen.float_in("repetition_penalty", "a finite number > 0", |r| {
                r.is_finite() && r > 0.0
            })?,
            max_new_tokens,
            do_sample: gen.flag("do_sample")?,
        })
    }

    /// Sampling parameters with these defaults applied over [`SamplingParams::default`]. `do_sample: false` gives
    /// greedy decoding (temperature 0) whatever the other fields say; an absent `do_sample` keeps the checkpoint's
    /// temperature / top-p / top-k, as serving engines do.
    pub fn sampling_params(&self) -> SamplingParams {
        let mut p = SamplingParams::default();
        if let Some(t) = self.temperature {
            p.temperature = t;
        }
        if let Some(v) = self.top_p {
            p.top_p = v;
        }
        if let Some(v) = self.top_k {
            p.top_k = v;
        }
        if let Some(v) = self.min_p {
            p.min_p = v;
        }
        if let Some(v) = self.repetition_penalty {
            p.repetition_penalty = v;
        }
        p.max_tokens = self.max_new_tokens;
        if self.do_sample == Some(false) {
            p.temperature = 0.0;
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merges_eos_from_both_files_without_duplicates() {
        let gen = json!({"eos_token_id": [151645, 151643], "bos_token_id": 151643, "temperature": 0.7,
                         "top_p": 0.8, "top_k": 20, "do_sample": true, "repetition_penalty": 1.05});
        let cfg = json!({"eos_token_id": 151645, "pad_token_id": 151643, "bos_token_id": 1});
        let d = GenerationDefaults::from_json(Some(&gen), &cfg).unwrap();
        assert_eq!(d.eos_token_ids, vec![151645, 151643]);
        assert_eq!(d.bos_token_id, Some(151643), "generation_config wins over config.json");
        assert_eq!(d.pad_token_id, Some(151643), "falls back to config.json");
        assert_eq!(d.top_k, Some(20));
        let p = d.sampling_params();
        assert_eq!((p.temperature, p.top_p, p.top_k), (0.7, 0.8, 20));
        assert_eq!(p.repetition_penalty, 1.05);
    }

    #[test]
    fn do_sample_false_is_greedy_and_text_config_is_read() {
        let gen = json!({"do_sample": false, "temperature": 0.6, "max_new_tokens": 77, "min_p": 0.05});
        let cfg = json!({"text_config": {"eos_token_id": [2, 11]}});
        let d = GenerationDefaults::from_json(Some(&gen), &cfg).unwrap();
        assert_eq!(d.eos_token_ids, vec![2, 11]);
        let p = d.sampling_params();
        assert_eq!(p.temperature, 0.0);
        assert_eq!(p.max_tokens, Some(77));
        assert_eq!(p.min_p, 0.05);
    }

    #[test]
    fn from_dir_without_file_uses_config_only_and_bad_types_name_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let d = GenerationDefaults::from_dir(dir.path(), &json!({"eos_token_id": 7, "pad_token_id": null})).unwrap();
        assert_eq!(d.eos_token_ids, vec![7]);
        assert_eq!(d.pad_token_id, None);
        assert_eq!(d.sampling_params(), SamplingParams::default());

        std::fs::write(dir.path().join("generation_config.json"), r#"{"eos_token_id": -3}"#).unwrap();
        let e = GenerationDefaults::from_dir(dir.path(), &json!({}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("generation_config.json: eos_token_id") && e.contains("-3"),
            "{e}"
        );

        std::fs::write(dir.path().join("generation_config.json"), r#"{"temperature": "hot"}"#).unwrap();
        let e = GenerationDefaults::from_dir(dir.path(), &json!({}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("temperature"), "{e}");

        std::fs::write(dir.path().join("generation_config.json"), "{not json").unwrap();
        let e = GenerationDefaults::from_dir(dir.path(), &json!({}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("generation_config.json") && e.contains("malformed JSON"),
            "{e}"
        );

        let e = GenerationDefaults::from_json(None, &json!({"eos_token_id": [1, "x"]}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("config.json: eos_token_id"), "{e}");
    }

    #[test]
    fn out_of_range_sampling_defaults_name_the_file_and_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("generation_config.json");
        for (text, field, value) in [
            (r#"{"temperature": -3}"#, "temperature", "-3"),
            (r#"{"temperature": 1e39}"#, "temperature", "1e+39"),
            (r#"{"top_p": 0}"#, "top_p", "0"),
            (r#"{"top_p": 1.5}"#, "top_p", "1.5"),
            (r#"{"min_p": -0.1}"#, "min_p", "-0.1"),
            (r#"{"repetition_penalty": 0}"#, "repetition_penalty", "0"),
            (r#"{"max_new_tokens": 0}"#, "max_new_tokens", "0"),
            (r#"{"do_sample": false, "temperature": -3}"#, "temperature", "-3"),
        ] {
            std::fs::write(&path, text).unwrap();
            let e = GenerationDefaults::from_dir(dir.path(), &json!({}))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("{}: {field}", path.display())) && e.contains(value),
                "{text}: {e}"
            );
        }
        // The ends of each range are accepted, and the parsed defaults pass the sampler's own check.
        std::fs::write(
            &path,
            r#"{"temperature": 0, "top_p": 1, "min_p": 0, "repetition_penalty": 1e-3, "max_new_tokens": 1,
                "top_k": 0}"#,
        )
        .unwrap();
        let d = GenerationDefaults::from_dir(dir.path(), &json!({})).unwrap();
        d.sampling_params().validate_ranges().unwrap();
        let e = GenerationDefaults::from_json(Some(&json!({"top_p": 2})), &json!({}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("generation_config.json: top_p"), "{e}");
    }
}
