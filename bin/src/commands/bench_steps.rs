//! The batched-step measures of `rewind bench` beyond plain decode: speculative verify steps of a fixed window at
//! every accepted count (`--verify-window T`), and on GPUs each step's byte roofline — the bytes the plan's byte model
//! (`engine/src/plan/projection.rs`: weights, active experts, SSM state and rings, KV) says the step must move, over a
//! device-to-device copy bandwidth measured in the same run.

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{Context, Result};
use rewind_engine::decode::FormChoice;
use rewind_engine::model::ModelConfig;
use rewind_engine::plan::projection::{tokens_per_verify, Batch};
use rewind_engine::plan::FormRow;
use rewind_engine::plan::{project, GpuProfile, PlanInput};
use rewind_engine::rank::{ChainedDecode, Commit, RankGroup, Rows, SeqKind, SeqStep, StageTimes, StepPlan};
use rewind_engine::spec::step_cost::{StepPoint, StepProfile, PROFILE_VERSION};
use rewind_engine::state::memory::kv_only_threshold;

use serde_json::{json, Value};

use super::backend::Loaded;
use super::bench::tokens;
use crate::cli::BenchArgs;
use crate::output::outln;

/// Warm-up steps before the timed ones.
const WARMUP: usize = 3;

/// The mean context of a batched measure's steps: the prompt, the warm-up and half the timed tokens.
pub(super) fn mean_context(prompt: usize, timed_tokens: usize, per_step: usize) -> usize {
    prompt + WARMUP * per_step + timed_tokens / 2
}

/// Opens `b` sequences in `form` and prefills each with `prompt` tokens; returns `(slot, next position, next
/// token)` per sequence.
pub(super) fn open_batch(
    group: &mut RankGroup,
    form: FormChoice,
    b: usize,
    prompt: usize,
    seed: u64,
) -> Result<Vec<(usize, usize, u32)>> {
    let vocab = group.vocab_size();
    let mut seqs = Vec::with_capacity(b);
    for i in 0..b {
        let slot = group.open(form)?;
        let out = group.step(prefill_plan(slot, form, tokens(prompt, vocab, 1000 + i as u64 + seed)))?;
        seqs.push((slot, prompt, out.rows[0].argmax));
    }
    Ok(seqs)
}

/// The plan that prefills a fresh sequence in `slot` with `prompt` in one step (the last row reported).
pub(super) fn prefill_plan(slot: usize, form: FormChoice, prompt: Vec<u32>) -> StepPlan {
    StepPlan::batch(vec![SeqStep {
        slot,
        kind: SeqKind::Prefill,
        position: 0,
        tokens: prompt,
        form,
        rows: Rows::Last,
        sample: None,
        spec: None,
        logprobs: None,
    }])
}

/// The shape of a batched-step measure: `batch` sequences of `prompt` tokens each, decoding (`window` 0) or verifying
/// `window` drafts and keeping `accepted` of them.
#[derive(Clone, Copy, Debug)]
pub(super) struct StepShape {
    pub batch: usize,
    pub prompt: usize,
    pub window: usize,
    pub accepted: usize,
    /// Decode steps per plan (1: one; more: `Program::DecodeChain`, decoding only).
    pub chain: usize,
}

/// One measure: seconds per step of `steps` steps over the shape's sequences after [`WARMUP`] untimed ones. With
/// `window` 0 each step decodes one token per sequence (greedy: the next token is the row's argmax), in plans of
/// `chain` chained steps (the seconds are per decode step, not per plan); otherwise each
/// sequence verifies its next token and `window` drafts and keeps exactly `accepted` of the drafts (so
/// `accepted + 1` tokens per step). The drafts are arbitrary ids: what is timed is the verify and its commit /
/// rollback, not a drafter.
pub(super) fn step_secs(
    group: &mut RankGroup,
    form: FormChoice,
    shape: StepShape,
    steps: usize,
    seed: u64,
) -> Result<(f64, Option<StageTimes>)> {
    let StepShape {
        batch: b,
        prompt,
        window,
        accepted,
        chain,
    } = shape;
    anyhow::ensure!(accepted <= window, "accepted {accepted} > window {window}");
    anyhow::ensure!(
        chain >= 1 && (chain == 1 || window == 0),
        "a chain of {chain} steps (only decodes chain)"
    );
    let steps = steps.div_ceil(chain);
    let vocab = group.vocab_size();
    let mut seqs = open_batch(group, form, b, prompt, seed)?;
    let mut commits: Vec<Commit> = Vec::new();
    let mut draft_seed = seed ^ 0x5eed;
    let mut step = |group: &mut RankGroup, seqs: &mut Vec<(usize, usize, u32)>, commits: &mut Vec<Commit>| {
        let batch: Vec<SeqStep> = seqs
            .iter()
            .map(|&(slot, pos, next)| {
                draft_seed = draft_seed.wrapping_add(1);
                let mut t = vec![next];
                t.extend(tokens(window, vocab, draft_seed));
                let (kind, rows) = if window == 0 {
                    (SeqKind::Decode, Rows::Last)
                } else {
                    (SeqKind::Verify, Rows::All)
                };
                SeqStep {
                    slot,
                    kind,
                    position: pos,
                    tokens: t,
                    form,
                    rows,
                    sample: None,
                    spec: None,
                    logprobs: None,
                }
            })
            .collect();
        let plan = if chain > 1 {
            // The checks above leave only greedy decodes here.
            let decodes = batch
                .iter()
                .map(|s| ChainedDecode {
                    slot: s.slot,
                    position: s.position,
                    token: s.tokens[0],
                    form,
                    sample: None,
                })
                .collect();
            StepPlan::decode_chain(decodes, chain - 1)
        } else {
            StepPlan::batch(batch)
        }
        .with_commits(std::mem::take(commits));
        let out = group.step(plan)?;
        let last_step = (chain - 1) * seqs.len();
        for (k, s) in seqs.iter_mut().enumerate() {
            // The row after the last kept draft gives the next token (the correction, or the bonus); a chain's
            // rows are step-major, its last step's last.
            let next = out.rows[last_step + k * (window + 1) + accepted].argmax;
            if window > 0 {
                commits.push(Commit {
                    slot: s.0,
                    accepted: accepted + 1,
                });
            }
            (s.1, s.2) = (s.1 + accepted + chain, next);
        }
        anyhow::Ok(())
    };
    for _ in 0..WARMUP {
        step(group, &mut seqs, &mut commits)?;
    }
    group.synchronize()?;
    let before = stage_report(group)?;
    let t0 = Instant::now();
    for _ in 0..steps {
        step(group, &mut seqs, &mut commits)?;
    }
    group.synchronize()?;
    let secs = t0.elapsed().as_secs_f64() / (steps * chain) as f64;
    let stages = match (stage_report(group)?, before) {
        (Some(after), Some(before)) => Some(after.since(&before)),
        _ => None,
    };
    for (slot, _, _) in seqs {
        group.release(slot)?;
    }
    Ok((secs, stages))
}

/// The step profile of the measured rows, for `--spec-profile`: each decode row's median step as window 0, and per
/// batch the verify rows' median steps averaged over their kept counts (a verify's cost barely depends on how many
/// drafts it keeps; the mean stands for the acceptance the server will meet). `context`: the steps' mean context.
pub(super) fn step_profile(decode: &[Value], verify: &[Value], loaded: &Loaded, context: usize) -> Result<StepProfile> {
    let field = |row: &Value, key: &str| -> Result<f64> {
        row[key]
            .as_f64()
            .with_context(|| format!("a measured step row has no `{key}`: {row}"))
    };
    let mut points = Vec::new();
    for row in decode {
        points.push(StepPoint {
            batch: field(row, "batch")? as usize,
            window: 0,
            step_ms: field(row, "step_ms_median")?,
        });
    }
    // (batch, window) → (sum of medians, rows)
    let mut verifies: BTreeMap<(usize, usize), (f64, usize)> = BTreeMap::new();
    for row in verify {
        let key = (field(row, "batch")? as usize, field(row, "window")? as usize);
        let e = verifies.entry(key).or_default();
        e.0 += field(row, "step_ms_median")?;
        e.1 += 1;
    }
    points.extend(verifies.into_iter().map(|((batch, window), (sum, n))| StepPoint {
        batch,
        window,
        step_ms: sum / n as f64,
    }));
    Ok(StepProfile {
        step_profile_version: PROFILE_VERSION,
        device: loaded.device.clone(),
        model: loaded.config.summary(),
        decode_form: loaded.form.name().to_string(),
        context,
        points,
    })
}

/// The first rank's device time by stage so far, when the ranks profile stages (`--stage-profile`). With tensor
/// parallelism every rank runs the same stages in lockstep, so the first one speaks for the step.
fn stage_report(group: &RankGroup) -> Result<Option<StageTimes>> {
    Ok(group.health()?.into_iter().next().and_then(|h| h.stages))
}

/// A stage profile as JSON per step: `steps` (forward passes profiled, counted by their embedding stage), and each
/// stage's milliseconds and runs per step; `other_ms` is the measured step time not inside any stage (host work,
/// uploads, the read-back and gaps between launches).
pub(super) fn stage_json(stages: &StageTimes, step_ms: f64) -> Value {
    let steps = stages.stages.get("embed").map_or(0, |t| t.count).max(1) as f64;
    let mut ms = serde_json::Map::new();
    let mut runs = serde_json::Map::new();
    for (k, t) in &stages.stages {
        ms.insert(k.clone(), json!(t.ns as f64 / 1e6 / steps));
        runs.insert(k.clone(), json!(t.count as f64 / steps));
    }
    let inside = stages.total_ms() / steps;
    json!({
        "steps": steps,
        "ms_per_step": ms,
        "runs_per_step": runs,
        "device_ms_per_step": inside,
        "other_ms": step_ms - inside,
    })
}

/// One line of a stage profile: `stage ms (runs×)` per stage, largest first, then the rest of the step.
pub(super) fn stage_line(profile: &Value) -> String {
    let mut parts: Vec<(String, f64, f64)> = profile["ms_per_step"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| {
            let runs = profile["runs_per_step"][k].as_f64().unwrap_or(0.0);
            (k.clone(), v.as_f64().unwrap_or(0.0), runs)
        })
        .collect();
    parts.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut line: Vec<String> = parts
        .iter()
        .map(|(k, ms, runs)| format!("{k} {ms:.3} ms ({runs:.0}×)"))
        .collect();
    line.push(format!(
        "outside the stages {:.3} ms",
        profile["other_ms"].as_f64().unwrap_or(0.0)
    ));
    line.join(", ")
}

/// The copy bandwidth (GB/s, read + write) of the first GPU of `devices`, measured now.
#[cfg(feature = "cuda")]
pub(super) fn copy_bandwidth(devices: &[usize]) -> Result<f64> {
    use rewind_engine::gpu::device::{copy_bandwidth, CudaDevice};
    let ordinal = devices.first().copied().unwrap_or(0);
    let dev = CudaDevice::open_with(ordinal, &[]).with_context(|| format!("opening GPU {ordinal}"))?;
    Ok(copy_bandwidth(&dev)?)
}

#[cfg(not(feature = "cuda"))]
pub(super) fn copy_bandwidth(_devices: &[usize]) -> Result<f64> {
    anyhow::bail!("this build has no CUDA support (built without the `cuda` feature)")
}

/// The plan's form for the engine's form at `context` tokens (`auto` is kv-only below the threshold, then replay).
fn plan_form(config: &ModelConfig, form: FormChoice, context: usize, verify: bool) -> FormRow {
    let replay = if verify { FormRow::REPLAY_SPEC } else { FormRow::REPLAY };
    match form {
        FormChoice::Recurrent => FormRow::RECURRENT,
        FormChoice::KvOnly => FormRow::KV_ONLY,
        FormChoice::Auto if context < kv_only_threshold(config) => FormRow::KV_ONLY,
        FormChoice::Replay | FormChoice::Auto => replay,
    }
}

/// The per-draft acceptance whose expected kept tokens per verify equal `kept` (bisection on the monotone
/// `tokens_per_verify`).
fn acceptance_for(window: usize, kept: f64) -> f64 {
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if tokens_per_verify(window, mid) < kept {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// What the byte model says one step must move, and the FLOPs it computes.
pub(super) struct StepBytes {
    pub form: FormRow,
    pub bytes: f64,
    pub flops: f64,
}

/// The time `flops` take at the dense bf16 peak of the built-in profile (`rewind plan --gpu`) whose name the device's
/// contains, and that profile's name: a floor below the byte roofline's reach at large batches, where the dense GEMMs
/// turn compute-bound (at batch 512 the 8B model's step does 8.3 TFLOP). None for a device without a profile.
pub(super) fn compute_floor(flops: f64, device: &str) -> Option<(&'static str, f64)> {
    let name = device.to_lowercase();
    rewind_engine::plan::profiles::BUILTIN_GPUS
        .into_iter()
        .find(|g| name.contains(g))
        .and_then(|g| GpuProfile::builtin(g).ok().map(|p| (g, flops / p.flops_per_s() * 1e3)))
}

/// The bytes of one decode (`window` 0) or verify step (`window` drafts, `accepted` of them kept) of `batch`
/// sequences at `context` tokens, on the slowest of `tp` ranks, activations of `act_bytes`.
#[allow(clippy::too_many_arguments)]
pub(super) fn step_bytes(
    config: &ModelConfig,
    form: FormChoice,
    tp: usize,
    batch: usize,
    context: usize,
    window: usize,
    accepted: usize,
    buffer_len: usize,
    act_bytes: u64,
) -> Result<StepBytes> {
    let pf = plan_form(config, form, context, window > 0);
    // Only the byte terms are read; the profile's speeds and memory do not enter them.
    let mut profile = GpuProfile::builtin("h100")?;
    profile.memory_gb = 1e6;
    let input = PlanInput {
        tp,
        nodes: 1,
        replicas: 1,
        context: context.min(config.max_position_embeddings),
        spec_window: window,
        acceptance: if window > 0 {
            acceptance_for(window, accepted as f64 + 1.0)
        } else {
            0.0
        },
        buffer_len,
        kv_block_size: rewind_engine::state::DEFAULT_KV_BLOCK_SIZE,
        memory_fraction: 1.0,
        act_bytes,
        forms: vec![pf],
        batches: vec![Batch::Fixed(batch)],
        prefill_chunk: 512,
    };
    let plan = project(config, &profile, &input)?;
    let row = plan.decode.first().context("the byte model returned no step")?;
    Ok(StepBytes {
        form: pf,
        bytes: row.total_bytes,
        flops: row.flops,
    })
}

/// Adds the byte roofline of a measured step to its JSON `row` on GPUs (where `copy_gbs` was measured): the byte
/// model's bytes, the time they take at the copy bandwidth, and that time's fraction of the measured `step_ms`.
#[allow(clippy::too_many_arguments)]
pub(super) fn roofline(
    row: &mut serde_json::Value,
    loaded: &Loaded,
    args: &BenchArgs,
    copy_gbs: Option<f64>,
    batch: usize,
    context: usize,
    window: usize,
    accepted: usize,
    step_ms: f64,
) -> Result<()> {
    let Some(gbs) = copy_gbs else { return Ok(()) };
    let act_bytes = if args.run.device.dtype == "f32" { 4 } else { 2 };
    let b = step_bytes(
        &loaded.config,
        loaded.form,
        loaded.group.tp(),
        batch,
        context,
        window,
        accepted,
        args.run.decode.buffer_len,
        act_bytes,
    )?;
    let ms = b.bytes / (gbs * 1e9) * 1e3;
    row["byte_model_form"] = json!(b.form.name());
    row["byte_model_context"] = json!(context);
    row["byte_model_bytes"] = json!(b.bytes);
    row["roofline_ms"] = json!(ms);
    row["roofline_fraction"] = json!(ms / step_ms);
    row["byte_model_flops"] = json!(b.flops);
    if let Some((profile, floor)) = compute_floor(b.flops, &loaded.device) {
        row["compute_floor_ms"] = json!(floor);
        row["compute_floor_profile"] = json!(profile);
    }
    Ok(())
}

/// The step table: each decode row and verify row with its time and, on GPUs, its roofline fraction.
pub(super) fn print_steps(rows: &[serde_json::Value], verify: &[serde_json::Value]) -> Result<()> {
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let frac = |v: &serde_json::Value| {
        let floor = v.get("compute_floor_ms").map_or(String::new(), |_| {
            format!(
                "; {:.1} TFLOP, {:.2} ms at the {} profile's dense bf16 peak",
                f(v, "byte_model_flops") / 1e12,
                f(v, "compute_floor_ms"),
                v["compute_floor_profile"].as_str().unwrap_or("?")
            )
        });
        v.get("roofline_fraction").map_or(String::new(), |_| {
            format!(
                ", {:.2} of its byte roofline ({:.2} GB in {:.2} ms{floor})",
                f(v, "roofline_fraction"),
                f(v, "byte_model_bytes") / 1e9,
                f(v, "roofline_ms")
            )
        })
    };
    for r in rows.iter().filter(|r| r.get("roofline_fraction").is_some()) {
        outln!(
            "| decode step, batch {} | {:.2} ms{} |",
            r["batch"],
            f(r, "step_ms_median"),
            frac(r)
        )?;
    }
    for v in verify {
        outln!(
            "| verify T = {}, {} kept, batch {} | {:.2} ms ({:.2}× a decode step, {:.2}× its tokens/s){} |",
            v["window"],
            v["kept_drafts"],
            v["batch"],
            f(v, "step_ms_median"),
            f(v, "vs_decode_step"),
            f(v, "speedup_over_decode"),
            frac(v)
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_profile_is_per_step_and_keeps_the_rest_of_the_step() {
        let mut t = StageTimes::default();
        for _ in 0..4 {
            t.add("embed", 0.1);
            t.add("gdn", 1.0);
            t.add("gdn", 1.0);
            t.add("head", 0.5);
        }
        let p = stage_json(&t, 3.0);
        assert_eq!(p["steps"], 4.0);
        assert!((p["ms_per_step"]["gdn"].as_f64().unwrap() - 2.0).abs() < 1e-9, "{p}");
        assert_eq!(p["runs_per_step"]["gdn"], 2.0);
        assert!((p["device_ms_per_step"].as_f64().unwrap() - 2.6).abs() < 1e-9, "{p}");
        assert!((p["other_ms"].as_f64().unwrap() - 0.4).abs() < 1e-9, "{p}");
        let line = stage_line(&p);
        assert!(
            line.starts_with("gdn 2.000 ms (2×), head 0.500 ms (1×), embed 0.100 ms (1×)"),
            "{line}"
        );
        assert!(line.ends_with("outside the stages 0.400 ms"), "{line}");
    }

    #[test]
    fn the_compute_floor_uses_the_matching_profile() {
        let (name, ms) = compute_floor(989e12, "NVIDIA H100 80GB HBM3").expect("an H100 profile");
        assert_eq!(name, "h100");
        assert!((ms - 1000.0).abs() < 1e-6, "{ms}");
        assert_eq!(compute_floor(1e12, "NVIDIA H200").map(|(n, _)| n), Some("h200"));
        assert_eq!(compute_floor(1e12, "NVIDIA A100-SXM4-80GB"), None);
    }

    #[test]
    fn acceptance_inverts_the_kept_tokens() {
        for t in [1, 4, 6] {
            for k in 0..=t {
                let p = acceptance_for(t, k as f64 + 1.0);
                assert!((tokens_per_verify(t, p) - (k as f64 + 1.0)).abs() < 1e-9, "{t} {k} {p}");
            }
        }
    }
}
