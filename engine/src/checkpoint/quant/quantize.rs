//! Turning a float checkpoint into a quantized one in a published layout (`rewind init-model --quant`), for tests
//! and benchmarks of the quantized paths: the linear layers' weights are quantized as the publishers' tools do
//! (amax scaling, round to nearest even), everything else is kept, and `config.json` gains the
//! `quantization_config` that [`super::Quantization::read`] reads back.

use std::path::Path;

use safetensors::tensor::Dtype;
use serde_json::{json, Value};

use super::{Method, NVFP4_GROUP};
use crate::checkpoint::writer::{write_stored, StoredTensor};
use crate::checkpoint::SafetensorsSource;
use crate::error::{EngineError, Result};
use crate::model::tensors::TensorSource;
use rewind_kernels::cpu::quant::{e4m3_to_f32, f32_to_e2m1, f32_to_e4m3, E2M1_MAX, E4M3_MAX};

/// The fine-grained FP8 block the Qwen and DeepSeek checkpoints use.
pub const FP8_BLOCK: [usize; 2] = [128, 128];

/// What [`quantize_in_place`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizeReport {
    /// Weights quantized, and tensors kept as they were.
    pub quantized: usize,
    pub kept: usize,
}

/// Whether a weight is one of the linear layers publishers quantize: a matrix (or stacked matrices) named `.weight`,
/// not an embedding, the LM head, a norm, a convolution or a MoE router; NVFP4 also needs whole 16-element groups.
pub fn quantizable(name: &str, shape: &[usize], method: Method) -> bool {
    let excluded = ["embed", "lm_head", "norm", "conv1d"].iter().any(|s| name.contains(s))
        || name.ends_with(".gate.weight")
        || name.ends_with("shared_expert_gate.weight");
    let fits = match method {
        Method::Nvfp4 { group } => shape.last().is_some_and(|c| c % group == 0),
        _ => true,
    };
    name.ends_with(".weight") && shape.len() >= 2 && !excluded && fits
}

fn amax(values: impl Iterator<Item = f32>) -> f32 {
    values.fold(0.0f32, |m, v| m.max(v.abs()))
}

/// A scale mapping `amax` onto `top` (1 for an all-zero block, whose codes are zero anyway).
fn scale_for(amax: f32, top: f32) -> f32 {
    if amax > 0.0 && amax.is_finite() {
        amax / top
    } else {
        1.0
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn tensor(name: String, dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>) -> StoredTensor {
    StoredTensor {
        name,
        dtype,
        shape,
        bytes,
    }
}

/// The stored tensors of weight `base.weight` (values `w`, shape `[lead.., rows, cols]`) in `method`'s layout.
fn quantize_weight(base: &str, w: &[f32], shape: &[usize], method: Method) -> Vec<StoredTensor> {
    let cols = shape[shape.len() - 1];
    let rows = shape[shape.len() - 2];
    let mats = w.len() / (rows * cols).max(1);
    let scalar = |name: String, v: f32| tensor(name, Dtype::F32, Vec::new(), v.to_le_bytes().to_vec());
    match method {
        Method::Fp8 { block } => {
            let [br, bc] = block.unwrap_or([rows, cols]);
            let (nr, nc) = (rows.div_ceil(br), cols.div_ceil(bc));
            let mut scales = vec![0f32; mats * nr * nc];
            let mut codes = vec![0u8; w.len()];
            for m in 0..mats {
                for (bi, bj) in (0..nr).flat_map(|i| (0..nc).map(move |j| (i, j))) {
                    let cells = || {
                        (bi * br..((bi + 1) * br).min(rows)).flat_map(move |r| {
                            (bj * bc..((bj + 1) * bc).min(cols)).map(move |c| (m * rows + r) * cols + c)
                        })
                    };
                    let scale = scale_for(amax(cells().map(|k| w[k])), E4M3_MAX);
                    scales[(m * nr + bi) * nc + bj] = scale;
                    for k in cells() {
                        codes[k] = f32_to_e4m3(w[k] / scale);
                    }
                }
            }
            let scale_shape = match block {
                Some(_) => [&shape[..shape.len() - 2], &[nr, nc]].concat(),
                None => Vec::new(),
            };
            vec![
                tensor(format!("{base}.weight"), Dtype::F8_E4M3, shape.to_vec(), codes),
                tensor(
                    format!("{base}.weight_scale_inv"),
                    Dtype::F32,
                    scale_shape,
                    f32_bytes(&scales),
                ),
            ]
        }
        Method::ModelOptFp8 => {
            let scale = scale_for(amax(w.iter().copied()), E4M3_MAX);
            let codes = w.iter().map(|&v| f32_to_e4m3(v / scale)).collect();
            vec![
                tensor(format!("{base}.weight"), Dtype::F8_E4M3, shape.to_vec(), codes),
                scalar(format!("{base}.weight_scale"), scale),
                scalar(format!("{base}.input_scale"), 1.0),
            ]
        }
        Method::Nvfp4 { group } => {
            let global = scale_for(amax(w.iter().copied()), E4M3_MAX * E2M1_MAX);
            let mut scales = Vec::with_capacity(w.len() / group);
            let mut packed = vec![0u8; w.len() / 2];
            for (g, chunk) in w.chunks(group).enumerate() {
                let code = f32_to_e4m3(amax(chunk.iter().copied()) / E2M1_MAX / global);
                scales.push(code);
                let s = e4m3_to_f32(code) * global;
                for (k, &v) in chunk.iter().enumerate() {
                    let q = if s > 0.0 { f32_to_e2m1(v / s) } else { 0 };
                    let at = g * group + k;
                    packed[at / 2] |= if at % 2 == 0 { q } else { q << 4 };
                }
            }
            let mut packed_shape = shape.to_vec();
            let mut scale_shape = shape.to_vec();
            *packed_shape.last_mut().expect("a matrix") /= 2;
            *scale_shape.last_mut().expect("a matrix") /= group;
            vec![
                tensor(format!("{base}.weight"), Dtype::U8, packed_shape, packed),
                tensor(format!("{base}.weight_scale"), Dtype::F8_E4M3, scale_shape, scales),
                scalar(format!("{base}.weight_scale_2"), global),
                scalar(format!("{base}.input_scale"), 1.0),
            ]
        }
    }
}

/// The `quantization_config` of `method`, naming the `kept` modules (left in their float dtype).
pub fn quantization_config(method: Method, kept: &[String]) -> Value {
    match method {
        Method::Fp8 { block } => json!({
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": block, "modules_to_not_convert": kept,
        }),
        Method::ModelOptFp8 => json!({"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": kept}),
        Method::Nvfp4 { group } => json!({
            "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": group, "exclude_modules": kept,
        }),
    }
}

/// Quantizes the float checkpoint in `dir` in place to `method`'s layout: its weight files are rewritten (the
/// tensors are read completely before anything is written, so the files are never read while replaced) and
/// `config.json` gains the `quantization_config`. Tensors that are not quantized keep their stored dtype.
pub fn quantize_in_place(dir: &Path, method: Method) -> Result<QuantizeReport> {
    if let Method::Nvfp4 { group } = method {
        if group != NVFP4_GROUP {
            return Err(EngineError::InvalidInput(format!(
                "NVFP4 groups are {NVFP4_GROUP} elements, not {group}"
            )));
        }
    }
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| EngineError::io(&config_path, e))?;
    let config: Value = crate::model::json::parse_relaxed(&text).map_err(|e| EngineError::Json {
        path: config_path.clone(),
        message: e.to_string(),
    })?;
    if config.get("quantization_config").is_some_and(|q| !q.is_null()) {
        return Err(EngineError::InvalidInput(format!(
            "{} is already quantized ({})",
            dir.display(),
            config["quantization_config"]
        )));
    }
    let mut stored = Vec::new();
    let (mut quantized, mut kept_modules, mut kept) = (0, Vec::new(), 0);
    {
        let mut src = SafetensorsSource::open(dir)?;
        for name in src.names() {
            let shape = src
                .shape_of(&name)
                .ok_or_else(|| EngineError::Checkpoint(format!("`{name}` vanished")))?;
            let dtype = match src.dtype_of(&name).as_deref() {
                Some("F32") => Dtype::F32,
                _ => Dtype::BF16,
            };
            let values = src.take(&name, &shape)?;
            if quantizable(&name, &shape, method) {
                let base = name
                    .strip_suffix(".weight")
                    .expect("quantizable names end with .weight");
                stored.extend(quantize_weight(base, &values, &shape, method));
                quantized += 1;
            } else {
                if let Some(base) = name.strip_suffix(".weight").filter(|_| shape.len() >= 2) {
                    kept_modules.push(base.to_string());
                }
                let bytes = if dtype == Dtype::F32 {
                    f32_bytes(&values)
                } else {
                    values
                        .iter()
                        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                        .collect()
                };
                stored.push(tensor(name, dtype, shape, bytes));
                kept += 1;
            }
        }
    }
    write_stored(dir, Some(4 << 30), &stored)?;
    let text = with_entry(
        &text,
        "quantization_config",
        &quantization_config(method, &kept_modules),
    )
    .ok_or_else(|| EngineError::Checkpoint(format!("{} is not a JSON object", config_path.display())))?;
    std::fs::write(&config_path, text).map_err(|e| EngineError::io(&config_path, e))?;
    Ok(QuantizeReport { quantized, kept })
}

/// `config` (a JSON object's text) with `key: value` added as its first entry. The rest of the text is kept as it is:
/// a published config may hold Python's `Infinity`, which a round trip through a JSON value would lose.
fn with_entry(config: &str, key: &str, value: &Value) -> Option<String> {
    let open = config.find('{')?;
    let (head, rest) = config.split_at(open + 1);
    let sep = if rest.trim_start().starts_with('}') { "" } else { "," };
    Some(format!("{head}\n  {}: {value}{sep}{rest}", Value::String(key.into())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_entry_goes_first_and_the_rest_of_the_text_is_kept() {
        let config = "{\n  \"time_step_limit\": [0.0, Infinity]\n}\n";
        let out = with_entry(config, "quantization_config", &json!({"quant_method": "fp8"})).unwrap();
        assert_eq!(
            out,
            "{\n  \"quantization_config\": {\"quant_method\":\"fp8\"},\n  \"time_step_limit\": [0.0, Infinity]\n}\n"
        );
        let parsed = crate::model::json::parse_relaxed(&out).unwrap();
        assert_eq!(parsed["quantization_config"]["quant_method"], "fp8");
        assert_eq!(with_entry("{}", "k", &json!(1)).unwrap(), "{\n  \"k\": 1}");
        assert_eq!(with_entry("[1]", "k", &json!(1)), None);
    }
}
