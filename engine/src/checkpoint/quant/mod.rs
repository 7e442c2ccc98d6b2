//! Quantized checkpoints as they are published, read into exact f32 weights: what `config.json`'s
//! `quantization_config` (or ModelOpt's `hf_quant_config.json`) says ([`Quantization`]) and the dequantization of
//! each layout (`dequant`, with the number formats of `rewind_kernels::cpu::quant`). The reader (`super::reader`)
//! checks each quantized weight's scales against the method and hands the dequantized weight out like any other
//! tensor, so every engine built on the [`TensorSource`](crate::model::tensors::TensorSource) loads these
//! checkpoints; the CPU engine is their exact reference.
//!
//! Layouts:
//! - fine-grained FP8 (`quant_method: fp8`, Qwen3-Next / Qwen3.5 / DeepSeek): `W.weight` E4M3, `W.weight_scale_inv`
//!   f32 per `weight_block_size` block (partial blocks at the edges), or one per tensor without a block size;
//! - ModelOpt FP8 (`quant_method: modelopt`, `quant_algo: FP8`, NVIDIA's Nemotron checkpoints): `W.weight` E4M3,
//!   `W.weight_scale` f32 per tensor or per output row, a static `W.input_scale`;
//! - ModelOpt NVFP4 (`quant_algo: NVFP4`): `W.weight` two E2M1 per byte, `W.weight_scale` E4M3 per 16 elements of a
//!   row, the f32 `W.weight_scale_2`, a static `W.input_scale`.
//!
//! Static activation scales (`input_scale`) and FP8 KV-cache scales (`k_scale`, `v_scale`) describe how a quantized
//! kernel would quantize activations; the reference computes on the exact weights in f32, so they are checked and
//! set aside.

pub mod dequant;
#[cfg(test)]
mod layout_tests;
pub mod quantize;

use std::path::Path;

use serde_json::Value;

use crate::error::{EngineError, Result};

/// The file ModelOpt writes beside `config.json`.
pub const MODELOPT_FILE: &str = "hf_quant_config.json";

/// How a checkpoint's quantized weights are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// Fine-grained FP8: E4M3 weights and `weight_scale_inv` per `[rows, cols]` block, or per tensor (`None`).
    Fp8 { block: Option<[usize; 2]> },
    /// ModelOpt FP8: E4M3 weights, `weight_scale` per tensor or per output row.
    ModelOptFp8,
    /// ModelOpt NVFP4: packed E2M1 weights, an E4M3 scale per `group` elements, a global f32 scale.
    Nvfp4 { group: usize },
}

/// A checkpoint's quantization, read from its configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quantization {
    pub method: Method,
    /// Module names the config leaves unquantized (`modules_to_not_convert`, `exclude_modules`, `ignore`): their
    /// weights are stored in a float dtype. Reported, not enforced: the stored dtype decides.
    pub unquantized: Vec<String>,
}

/// The NVFP4 group size ModelOpt publishes (and the only one NVIDIA's kernels take).
pub const NVFP4_GROUP: usize = 16;

fn bad(source: &str, what: String) -> EngineError {
    EngineError::Checkpoint(format!("{source}: {what}"))
}

fn names(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

impl Quantization {
    /// The quantization of the checkpoint in `dir`: `config.json`'s `quantization_config`, else ModelOpt's
    /// `hf_quant_config.json`, else `None` (a float checkpoint). A directory without `config.json` has none.
    pub fn read(dir: &Path) -> Result<Option<Self>> {
        let config = dir.join("config.json");
        if config.is_file() {
            let json = read_json(&config)?;
            if let Some(q) = json.get("quantization_config").filter(|q| !q.is_null()) {
                return Self::from_config(q, &config.display().to_string()).map(Some);
            }
        }
        let modelopt = dir.join(MODELOPT_FILE);
        if modelopt.is_file() {
            let json = read_json(&modelopt)?;
            let name = modelopt.display().to_string();
            let q = json
                .get("quantization")
                .ok_or_else(|| bad(&name, "no `quantization` object".into()))?;
            return Self::modelopt(q, &name).map(Some);
        }
        Ok(None)
    }

    /// Parses a `quantization_config` object; `source` names the file in errors.
    pub fn from_config(q: &Value, source: &str) -> Result<Self> {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        match method {
            "fp8" => {
                if let Some(fmt) = q.get("fmt").and_then(Value::as_str) {
                    if fmt != "e4m3" {
                        return Err(bad(
                            source,
                            format!("quantization_config.fmt `{fmt}` is not supported (only e4m3)"),
                        ));
                    }
                }
                let block = match q.get("weight_block_size").filter(|b| !b.is_null()) {
                    None => None,
                    Some(b) => {
                        let dims: Vec<usize> = b
                            .as_array()
                            .map(|a| a.iter().filter_map(|x| x.as_u64().map(|x| x as usize)).collect())
                            .unwrap_or_default();
                        match dims[..] {
                            [r, c] if r > 0 && c > 0 => Some([r, c]),
                            _ => {
                                return Err(bad(
                                    source,
                                    format!(
                                        "quantization_config.weight_block_size must be two positive integers, got {b}"
                                    ),
                                ))
                            }
                        }
                    }
                };
                Ok(Quantization {
                    method: Method::Fp8 { block },
                    unquantized: names(q.get("modules_to_not_convert")),
                })
            }
            "modelopt" => Self::modelopt(q, source),
            "" => Err(bad(source, "quantization_config has no `quant_method`".into())),
            other => Err(bad(
                source,
                format!(
                    "quantization method `{other}` is not supported (rewind loads `fp8` and ModelOpt's FP8 and NVFP4)"
                ),
            )),
        }
    }

    /// Parses ModelOpt's description (`quant_algo`, `group_size`, `exclude_modules` / `ignore`).
    fn modelopt(q: &Value, source: &str) -> Result<Self> {
        let algo = q.get("quant_algo").and_then(Value::as_str).unwrap_or("");
        let unquantized = [names(q.get("exclude_modules")), names(q.get("ignore"))].concat();
        let method = match algo {
            "FP8" => Method::ModelOptFp8,
            "NVFP4" => {
                let group = q
                    .get("group_size")
                    .and_then(Value::as_u64)
                    .map_or(NVFP4_GROUP, |g| g as usize);
                if group != NVFP4_GROUP {
                    return Err(bad(
                        source,
                        format!("NVFP4 group_size {group} is not supported (only {NVFP4_GROUP})"),
                    ));
                }
                Method::Nvfp4 { group }
            }
            "" => return Err(bad(source, "the ModelOpt quantization has no `quant_algo`".into())),
            other => {
                return Err(bad(
                    source,
                    format!("ModelOpt quant_algo `{other}` is not supported (rewind loads FP8 and NVFP4)"),
                ))
            }
        };
        Ok(Quantization { method, unquantized })
    }

    /// A short description for load banners: `fp8 e4m3, blocks 128×128`.
    pub fn describe(&self) -> String {
        match self.method {
            Method::Fp8 { block: Some([r, c]) } => format!("fp8 e4m3, blocks {r}×{c}"),
            Method::Fp8 { block: None } => "fp8 e4m3, per tensor".into(),
            Method::ModelOptFp8 => "ModelOpt fp8 e4m3".into(),
            Method::Nvfp4 { group } => format!("ModelOpt nvfp4, groups of {group}"),
        }
    }

    /// Whether the reader sets tensor `name` aside rather than reporting it as unexpected: activation and KV-cache
    /// scales, which describe quantized kernels' activations, not weights.
    pub fn sets_aside(&self, name: &str) -> bool {
        [".input_scale", ".k_scale", ".v_scale"]
            .iter()
            .any(|s| name.ends_with(s))
    }
}

/// Reads a configuration file as transformers writes them: Python's `json` module spells non-finite floats
/// `Infinity` / `NaN` (Nemotron-H's `time_step_limit`), which strict JSON refuses.
fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
    crate::model::json::parse_relaxed(&text).map_err(|e| EngineError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_published_configs_parse() {
        let fp8 = json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                         "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]});
        let q = Quantization::from_config(&fp8, "c").unwrap();
        assert_eq!(
            q.method,
            Method::Fp8 {
                block: Some([128, 128])
            }
        );
        assert_eq!(q.unquantized, ["lm_head"]);
        let mo = json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                        "ignore": ["lm_head", "model.layers.0.mixer*"]});
        assert_eq!(
            Quantization::from_config(&mo, "c").unwrap().method,
            Method::Nvfp4 { group: 16 }
        );
        let mo = json!({"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]});
        assert_eq!(Quantization::from_config(&mo, "c").unwrap().method, Method::ModelOptFp8);
    }

    #[test]
    fn unsupported_methods_are_errors_naming_what_is_wrong() {
        for (q, want) in [
            (json!({"quant_method": "gptq", "bits": 4}), "quantization method `gptq`"),
            (json!({"quant_method": "fp8", "fmt": "e5m2"}), "fmt `e5m2`"),
            (
                json!({"quant_method": "fp8", "weight_block_size": [128]}),
                "weight_block_size",
            ),
            (
                json!({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}),
                "quant_algo `W4A8_AWQ`",
            ),
            (
                json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}),
                "group_size 32",
            ),
            (json!({"bits": 4}), "no `quant_method`"),
        ] {
            let e = Quantization::from_config(&q, "config.json").unwrap_err().to_string();
            assert!(e.contains(want), "{q}: {e}");
        }
    }

    #[test]
    fn modelopt_side_file_is_read_when_config_has_none() {
        let dir = tempfile::tempdir().unwrap();
        // Python's `Infinity`, as published Nemotron-H configs hold it, is read.
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"time_step_limit": [0.0, Infinity]}"#,
        )
        .unwrap();
        assert_eq!(Quantization::read(dir.path()).unwrap(), None);
        std::fs::write(
            dir.path().join(MODELOPT_FILE),
            r#"{"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}"#,
        )
        .unwrap();
        let q = Quantization::read(dir.path()).unwrap().unwrap();
        assert_eq!(q.method, Method::ModelOptFp8);
    }
}
