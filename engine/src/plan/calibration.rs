//! Calibration: measured `rewind bench --device cuda` runs committed under `bench/results/`, the projection of the
//! same configuration, and their ratio (measured time / model time). `rewind plan` multiplies its projected step by
//! the ratio of the same decode form at the nearest measured batch size and prints it beside every projection, so a
//! reader sees both the roofline and how far the engine is from it today.
//!
//! Every measurement ran the random Nemotron-H-8B shape (`init-model --preset nemotron-h-8b`): 52 layers, 24 Mamba-2,
//! 24 MLP, 4 attention. Bench decode rows are sequences of a 16-token prompt, 3 warm-up steps, then the timed steps,
//! so the context a timed step sees averages `16 + 3 + steps / 2` tokens (`bin/src/commands/bench.rs`).
//! The ratios come from one model on Hopper; applying them to other shapes and to Blackwell is an extrapolation.

use std::sync::OnceLock;

use serde::Serialize;

use super::profiles::GpuProfile;
use super::projection::{project_ranks, Batch, PlanInput};
use super::rank::RankModel;
use super::FormRow;
use crate::model::{Family, ModelConfig};
use crate::presets::{preset_config, tokenizer_vocab};
use crate::state::memory::ACT_BYTES;
use crate::state::DecodeForm;

/// One measured number.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Measurement {
    /// The result file under `bench/results/`.
    pub file: &'static str,
    /// The built-in profile of the device it ran on.
    pub gpu: &'static str,
    pub tp: usize,
    /// Decode form; `None` for a prefill rate.
    pub form: Option<DecodeForm>,
    pub batch: usize,
    /// Mean context of the timed steps (decode), or the prompt length (prefill).
    pub context: usize,
    /// Input-ring capacity of the run.
    pub buffer_len: usize,
    /// Median step time in ms (decode) or tokens per second (prefill).
    pub measured: f64,
    /// Whether `rewind plan` applies this row's ratio (the latest run of each form on the H100).
    pub applied: bool,
}

const FORMS: &str = "gpu-replay-forms-nemotron-h-8b-2026-11-24.json";
const KERNELS: &str = "gpu-replay-kernels-2026-11-24.json";
const BENCH_24: &str = "gpu-bench-nemotron-h-8b-2026-11-24.json";
const BENCH_21: &str = "gpu-bench-nemotron-h-8b-2026-11-21.json";

#[allow(clippy::too_many_arguments)]
const fn decode(
    file: &'static str,
    gpu: &'static str,
    tp: usize,
    form: DecodeForm,
    batch: usize,
    steps: usize,
    measured: f64,
    applied: bool,
) -> Measurement {
    Measurement {
        file,
        gpu,
        tp,
        form: Some(form),
        batch,
        context: 16 + 3 + steps / 2,
        buffer_len: 16,
        measured,
        applied,
    }
}

const fn prefill(file: &'static str, gpu: &'static str, tp: usize, measured: f64, applied: bool) -> Measurement {
    Measurement {
        file,
        gpu,
        tp,
        form: None,
        batch: 1,
        context: 1024,
        buffer_len: 16,
        measured,
        applied,
    }
}

/// The measured runs: medians of 3 (step ms) from the named files. Recurrent is applied from the replay-forms run
/// (the recurrent step kernels it timed are today's); replay and kv-only (`--decode auto` with 16-token prompts
/// stays below the kv-only threshold of 128) from the replay-kernels run, whose replay kernels replaced the ones
/// the replay-forms run timed.
pub const MEASUREMENTS: &[Measurement] = &[
    decode(FORMS, "h100", 1, DecodeForm::Recurrent, 1, 32, 7.592, true),
    decode(FORMS, "h100", 1, DecodeForm::Recurrent, 64, 32, 13.080, true),
    decode(FORMS, "h100", 1, DecodeForm::Recurrent, 256, 32, 30.312, true),
    decode(KERNELS, "h100", 1, DecodeForm::Recurrent, 1, 32, 7.668, false),
    decode(KERNELS, "h100", 1, DecodeForm::Recurrent, 64, 32, 13.139, false),
    decode(KERNELS, "h100", 1, DecodeForm::Recurrent, 256, 32, 30.487, false),
    decode(KERNELS, "h100", 1, DecodeForm::Replay, 1, 32, 7.807, true),
    decode(KERNELS, "h100", 1, DecodeForm::Replay, 64, 32, 12.824, true),
    decode(KERNELS, "h100", 1, DecodeForm::Replay, 256, 32, 27.332, true),
    decode(KERNELS, "h100", 1, DecodeForm::KvOnly, 1, 32, 7.978, true),
    decode(KERNELS, "h100", 1, DecodeForm::KvOnly, 64, 32, 12.53, true),
    decode(KERNELS, "h100", 1, DecodeForm::KvOnly, 256, 32, 26.61, true),
    decode(BENCH_24, "h100", 1, DecodeForm::Recurrent, 1, 64, 7.62, false),
    decode(BENCH_24, "h100", 1, DecodeForm::Recurrent, 64, 64, 13.16, false),
    decode(BENCH_21, "h200", 1, DecodeForm::Recurrent, 1, 64, 5.90, false),
    decode(BENCH_21, "h200", 1, DecodeForm::Recurrent, 64, 64, 9.88, false),
    decode(BENCH_21, "h200", 2, DecodeForm::Recurrent, 1, 64, 4.64, false),
    decode(BENCH_21, "h200", 2, DecodeForm::Recurrent, 64, 64, 6.87, false),
    prefill(BENCH_21, "h100", 1, 4207.0, true),
    prefill(BENCH_21, "h200", 1, 4273.0, false),
    prefill(BENCH_21, "h200", 2, 7656.0, false),
];

/// A measurement beside its projection.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CalibrationRow {
    pub measurement: Measurement,
    /// The projection: step ms (decode) or tokens/s (prefill).
    pub model: f64,
    /// Measured time over model time (for prefill: model rate over measured rate).
    pub ratio: f64,
}

/// A ratio applied to one projection.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Applied {
    /// Measured / model.
    pub ratio: f64,
    /// The result file under `bench/results/`.
    pub file: &'static str,
    /// Which measurement: form, batch, device.
    pub basis: String,
    /// The projected step times the ratio (decode only).
    pub step_ms: Option<f64>,
    /// Tokens per second after the ratio (per replica).
    pub tokens_per_s: f64,
}

/// The shape every measurement ran.
pub fn calibration_model() -> crate::Result<ModelConfig> {
    let json = preset_config(
        Family::NemotronH,
        "nemotron-h-8b",
        None,
        tokenizer_vocab("nemotron-h-8b"),
        1,
        2,
    )?;
    ModelConfig::from_json(&json)
}

fn model_of(config: &ModelConfig, m: &Measurement) -> crate::Result<f64> {
    let profile = GpuProfile::builtin(m.gpu)?;
    let ranks = RankModel::all(config, m.tp)?;
    let form = FormRow::decoding(m.form.unwrap_or(DecodeForm::Recurrent));
    let input = PlanInput {
        tp: m.tp,
        nodes: 1,
        replicas: 1,
        context: m.context,
        spec_window: 0,
        acceptance: 0.0,
        buffer_len: m.buffer_len,
        kv_block_size: 16,
        memory_fraction: 0.9,
        act_bytes: ACT_BYTES,
        forms: vec![form],
        batches: vec![Batch::Fixed(m.batch)],
        prefill_chunk: 512,
    };
    let plan = project_ranks(config, &profile, &input, &ranks, false)?;
    match m.form {
        None => Ok(plan.prefill.tokens_per_s),
        Some(_) => plan
            .decode
            .first()
            .map(|s| s.step_ms)
            .ok_or_else(|| crate::EngineError::InvalidInput("calibration: no decode row".into())),
    }
}

/// Every measurement with its projection and ratio (computed once).
pub fn table() -> Result<&'static [CalibrationRow], String> {
    static TABLE: OnceLock<Result<Vec<CalibrationRow>, String>> = OnceLock::new();
    TABLE
        .get_or_init(|| {
            let config = calibration_model().map_err(|e| e.to_string())?;
            MEASUREMENTS
                .iter()
                .map(|m| {
                    let model = model_of(&config, m).map_err(|e| e.to_string())?;
                    let ratio = match m.form {
                        Some(_) => m.measured / model,
                        None => model / m.measured,
                    };
                    Ok(CalibrationRow {
                        measurement: *m,
                        model,
                        ratio,
                    })
                })
                .collect()
        })
        .as_deref()
        .map_err(Clone::clone)
}

/// The applied row of `basis` nearest to `batch` (log scale).
fn nearest(basis: DecodeForm, batch: u64) -> Option<&'static CalibrationRow> {
    let distance = |r: &CalibrationRow| ((r.measurement.batch as f64).ln() - (batch.max(1) as f64).ln()).abs();
    table()
        .ok()?
        .iter()
        .filter(|r| r.measurement.applied && r.measurement.form == Some(basis))
        .min_by(|a, b| distance(a).total_cmp(&distance(b)))
}

/// The calibration of a decode projection of `form` (priced like plain decoding in `basis`; a verifying row takes its
/// form's, since verify steps are not measured) of `step_ms` producing `tokens` per step.
pub fn apply(form: FormRow, basis: DecodeForm, batch: u64, step_ms: f64, tokens: f64) -> Option<Applied> {
    let row = nearest(basis, batch)?;
    let m = &row.measurement;
    let calibrated = step_ms * row.ratio;
    let spec = match (form.verifies(), form.form(), basis) {
        (true, ..) => ", replay's ratio (verify steps not measured)",
        (false, DecodeForm::KvOnly, DecodeForm::Replay) => ", replay's ratio (past the kv-only threshold)",
        _ => "",
    };
    Some(Applied {
        ratio: row.ratio,
        file: m.file,
        basis: format!(
            "{} at batch {} on {} (Nemotron-H-8B){spec}",
            m.form.map_or("prefill", DecodeForm::name),
            m.batch,
            m.gpu
        ),
        step_ms: Some(calibrated),
        tokens_per_s: tokens / calibrated * 1e3,
    })
}

/// The calibration of a projected prefill rate.
pub fn apply_prefill(tokens_per_s: f64) -> Option<Applied> {
    let row = table()
        .ok()?
        .iter()
        .find(|r| r.measurement.applied && r.measurement.form.is_none())?;
    Some(Applied {
        ratio: row.ratio,
        file: row.measurement.file,
        basis: format!(
            "prefill of {} tokens on {} (Nemotron-H-8B)",
            row.measurement.context, row.measurement.gpu
        ),
        step_ms: None,
        tokens_per_s: tokens_per_s / row.ratio,
    })
}
