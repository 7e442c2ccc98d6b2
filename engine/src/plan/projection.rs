//! The projection: per-rank memory for each decode form, and a roofline over one decode step and over prefill.
//!
//! Decode step of `b` sequences on one rank (the slowest rank sets the step):
//! - **bytes** = dense weights (every tensor but the embedding table and the routed experts; the LM head whole),
//!   plus the routed experts the step activates (expected distinct experts `E·(1 − (1 − k/E)^n)` of `n` tokens,
//!   per MoE block), plus per sequence its SSM state traffic in the form (below) and its attention KV (the whole
//!   context read, the step's tokens written);
//! - **FLOPs** = `2 · rows · parameters per token` (dense + `k` experts) + attention `4 · rows · context · heads ·
//!   head_dim` per layer + `4 · state values` per SSM layer and row;
//! - **time** = `max(bytes / HBM bandwidth, FLOPs / bf16 dense throughput)` + all-reduces: one per residual block and
//!   one after the vocabulary-parallel embedding, each `rows · hidden` f32 values (`gpu/forward.rs`, `gpu/rank.rs`),
//!   plus one per Mamba-2 gated norm whose groups span ranks; a ring all-reduce moves `2(p − 1)/p` of the message
//!   per GPU over the per-direction link, plus the profile's fixed latency.
//!
//! SSM traffic per sequence and layer, with `S` the state, `C` a conv row, `E` a ring entry, `t` rows per step
//! (1, or `1 + T` when verifying), `a` tokens kept per step and `w = max(T, t)` the window the flush keeps free:
//! - recurrent: `2S + (K − 1 + t)·C` (state read and written, conv history read, new rows written);
//! - replay: `S` read, `a·m/2` ring entries read on average and `t` written, the state written once per cycle of
//!   `m + 1` steps (`m = ⌊(L − t − w)/a⌋ + 1` steps before the flush, `counters.rs` `decide`), plus the conv rows;
//! - kv-only: below the threshold the context's ring entries and no state; past it, replay.
//!
//! Left out: activations between kernels, launch overheads, the host. The calibration ratios carry them.

use serde::Serialize;

use super::calibration::{self, Applied};
use super::profiles::GpuProfile;
use super::rank::RankModel;
use super::{FormRow, PlanError};
use crate::model::ModelConfig;
use crate::state::memory::{kv_only_threshold, LayerValues, MemoryShare, PlanOptions, RowFit};
use crate::state::DecodeForm;

/// Bytes of one f32 all-reduced value.
const REDUCE_BYTES: f64 = 4.0;

/// Batch sizes of the decode table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Batch {
    /// A fixed batch.
    Fixed(usize),
    /// The most sequences of the form that fit.
    Max,
}

/// What the plan is asked.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlanInput {
    pub tp: usize,
    /// Nodes the `tp` ranks span (all-reduces then cross the inter-node network).
    pub nodes: usize,
    /// Independent replicas of the TP group (aggregate tokens/s only).
    pub replicas: usize,
    /// Tokens of context per sequence: KV reserved, and the position decode steps are priced at.
    pub context: usize,
    /// Speculative window `T` of the replay+spec form.
    pub spec_window: usize,
    /// Probability that each draft token is accepted (independent), for tokens per verify step.
    pub acceptance: f64,
    /// Input-ring capacity `L`.
    pub buffer_len: usize,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    /// Fraction of device memory the engine may use (`--gpu-memory-fraction`); the rest is reserve.
    pub memory_fraction: f64,
    /// Bytes per activation value (2: bf16).
    pub act_bytes: u64,
    pub forms: Vec<FormRow>,
    pub batches: Vec<Batch>,
    /// Prefill chunk (tokens per step), to spread collective latency over.
    pub prefill_chunk: usize,
}

/// One rank's memory for one form.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FormMemory {
    pub form: FormRow,
    pub spec_window: usize,
    pub ssm_bytes_per_seq: u64,
    pub kv_bytes_per_seq: u64,
    /// Sequences that fit on every rank.
    pub max_sequences: u64,
}

/// One rank's bytes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankMemory {
    pub rank: usize,
    pub weight_bytes: u64,
    /// Per form: SSM and KV bytes per sequence on this rank.
    pub ssm_bytes_per_seq: Vec<u64>,
    pub kv_bytes_per_seq: u64,
}

/// Every term of one projected decode step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepTerms {
    pub form: FormRow,
    pub batch: u64,
    /// Whether the row was asked as `max`.
    pub is_max: bool,
    /// Token rows the step computes (`batch · (1 + T)` when verifying).
    pub rows: u64,
    /// Tokens each sequence keeps per step on average.
    pub tokens_per_seq: f64,
    /// The rank whose step is slowest (its terms are these).
    pub rank: usize,
    pub dense_weight_bytes: f64,
    pub active_experts: f64,
    pub expert_bytes: f64,
    pub ssm_bytes: f64,
    pub kv_bytes: f64,
    pub total_bytes: f64,
    pub hbm_ms: f64,
    pub flops: f64,
    pub compute_ms: f64,
    /// Collectives per step and the bytes of each block output message.
    pub all_reduces: usize,
    pub all_reduce_message_bytes: f64,
    pub all_reduce_ms: f64,
    /// `max(hbm, compute) + all-reduce`.
    pub step_ms: f64,
    /// Per replica.
    pub tokens_per_s: f64,
    /// All replicas.
    pub aggregate_tokens_per_s: f64,
    /// The calibration applied, when a measured run covers this form.
    pub calibrated: Option<Applied>,
    /// Why the row is not a valid operating point, if it is not.
    pub flag: Option<String>,
}

/// The projected prefill rate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prefill {
    /// FLOPs per prompt token on the slowest rank, at the prompt's mean position (`context / 2`).
    pub flops_per_token: f64,
    pub compute_ms_per_token: f64,
    pub all_reduce_ms_per_token: f64,
    pub tokens_per_s: f64,
    pub calibrated: Option<Applied>,
}

/// A whole plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub gpu: GpuProfile,
    /// What was asked (TP, nodes, replicas, context, window, acceptance, ring, reserve, forms, batches).
    pub input: PlanInput,
    pub kv_only_threshold: usize,
    /// `memory_fraction` of the device memory.
    pub budget_bytes: f64,
    pub parameters_per_token: f64,
    pub ranks: Vec<RankMemory>,
    pub forms: Vec<FormMemory>,
    pub decode: Vec<StepTerms>,
    pub prefill: Prefill,
    pub notes: Vec<String>,
}

/// Expected tokens kept per verify step of window `t` with per-draft acceptance `p`: `1 + p + p² + … + p^t`.
pub fn tokens_per_verify(t: usize, p: f64) -> f64 {
    (0..=t).map(|i| p.powi(i as i32)).sum()
}

/// One decode or verify step as a sequence's SSM layers see it (module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SsmStep {
    /// Rows the step computes per sequence: 1, or `1 + T` when verifying.
    pub rows: u64,
    /// The window the flush keeps free: `T` when verifying, else 0.
    pub window: u64,
    /// Tokens each sequence keeps per step on average.
    pub kept: f64,
    /// Input-ring capacity `L`.
    pub buffer_len: u64,
    /// Tokens of context.
    pub context: u64,
    /// The kv-only threshold.
    pub threshold: u64,
}

/// Per-sequence SSM bytes `step` moves in one layer of `values` (activations of `act_bytes`) decoded in `form`
/// (module docs).
pub fn ssm_step_bytes(values: &LayerValues, act_bytes: u64, form: DecodeForm, step: &SsmStep) -> f64 {
    let conv = (values.conv_history_bytes(act_bytes) + step.rows * values.conv_row_bytes(act_bytes)) as f64;
    let (state, entry, t) = (
        values.state_bytes() as f64,
        values.ring_entry_bytes(act_bytes) as f64,
        step.rows as f64,
    );
    let replay = || {
        let w = step.window.max(step.rows);
        let free = step.buffer_len.saturating_sub(step.rows + w) as f64;
        let m = (free / step.kept.max(1.0)).floor() + 1.0;
        state + step.kept * m / 2.0 * entry + t * entry + state / (m + 1.0) + conv
    };
    match form {
        DecodeForm::Recurrent => 2.0 * state + conv,
        DecodeForm::KvOnly if step.context < step.threshold => (step.context as f64 + t) * entry + conv,
        DecodeForm::Replay | DecodeForm::KvOnly => replay(),
    }
}

fn check(input: &PlanInput, config: &ModelConfig, profile: &GpuProfile) -> Result<(), PlanError> {
    let bad = |m: String| Err(PlanError::Invalid(m));
    if input.nodes == 0 || input.replicas == 0 {
        return bad("--nodes and --replicas must be at least 1".into());
    }
    if !input.tp.is_multiple_of(input.nodes) {
        return bad(format!(
            "--tp {} cannot be spread evenly over --nodes {}",
            input.tp, input.nodes
        ));
    }
    if input.nodes > 1 && profile.inter_node_gb_s.is_none() {
        return bad(format!(
            "--nodes {} needs the profile's `inter_node_gb_s` (GPU profile `{}` has none)",
            input.nodes, profile.name
        ));
    }
    if input.context == 0 || input.context > config.max_position_embeddings {
        return bad(format!(
            "--context {} must be between 1 and the model's context limit of {} tokens (max_position_embeddings)",
            input.context, config.max_position_embeddings
        ));
    }
    if !(input.acceptance.is_finite() && (0.0..=1.0).contains(&input.acceptance)) {
        return bad(format!(
            "--acceptance must be between 0 and 1, got {}",
            input.acceptance
        ));
    }
    if !(input.memory_fraction > 0.0 && input.memory_fraction <= 1.0) {
        return bad(format!(
            "--memory-fraction must be in (0, 1], got {}",
            input.memory_fraction
        ));
    }
    let t = input.spec_window;
    if input.forms.iter().any(|f| f.verifies()) && (t == 0 || input.buffer_len < 1 + 2 * t) {
        return bad(format!(
            "replay+spec needs --spec-window T ≥ 1 and --buffer-len ≥ 1 + 2T (a verify of 1 + T rows and a free \
             window of T); got T = {t}, L = {}",
            input.buffer_len
        ));
    }
    if input.buffer_len < 2 || input.kv_block_size == 0 || input.prefill_chunk == 0 || input.act_bytes == 0 {
        return bad(
            "--buffer-len must be at least 2, and the KV block, prefill chunk and activation size at least 1".into(),
        );
    }
    if input.forms.is_empty() || input.batches.is_empty() {
        return bad("at least one decode form and one batch size are needed".into());
    }
    if input.batches.contains(&Batch::Fixed(0)) {
        return bad("batch sizes must be at least 1".into());
    }
    Ok(())
}

/// Ring all-reduce time of `collectives` messages of `bytes` each over `p` ranks.
fn all_reduce_ms(profile: &GpuProfile, input: &PlanInput, collectives: usize, bytes: f64) -> f64 {
    let p = input.tp as f64;
    if input.tp < 2 {
        return 0.0;
    }
    // Across nodes the ring's slowest hop is the network.
    let link = match (input.nodes > 1, profile.inter_node_gb_s) {
        (true, Some(net)) => net.min(profile.nvlink_gb_s),
        _ => profile.nvlink_gb_s,
    } * 1e9;
    collectives as f64 * profile.collective_latency_us * 1e-3 + 2.0 * (p - 1.0) / p * bytes / link * 1e3
}

/// One rank's step terms (no calibration, no flag).
fn rank_step(
    config: &ModelConfig,
    r: &RankModel,
    profile: &GpuProfile,
    input: &PlanInput,
    threshold: u64,
    form: FormRow,
    batch: u64,
) -> StepTerms {
    let verify = form.verifies();
    let t = if verify { 1 + input.spec_window as u64 } else { 1 };
    let window = if verify { input.spec_window as u64 } else { 0 };
    let kept = if verify {
        tokens_per_verify(input.spec_window, input.acceptance)
    } else {
        1.0
    };
    let rows = batch * t;
    let ctx = input.context as u64;
    let step = SsmStep {
        rows: t,
        window,
        kept,
        buffer_len: input.buffer_len as u64,
        context: ctx,
        threshold,
    };
    let ssm: f64 = r
        .ssm
        .iter()
        .map(|d| ssm_step_bytes(&LayerValues::ssm(d), input.act_bytes, form.form(), &step))
        .sum::<f64>()
        * batch as f64;
    let kv_token = (r.kv_values_per_token * input.act_bytes) as f64;
    let kv = batch as f64 * (ctx + t) as f64 * kv_token;
    let dense = r.dense_read_bytes() as f64 + rows as f64 * r.embed_bytes as f64 / config.vocab_size.max(1) as f64;
    let experts = r.active_expert_bytes(rows as f64);
    let active_experts = r.moe.iter().fold(0.0, |a, l| a + l.active_experts(rows as f64));
    let total = dense + experts + ssm + kv;
    let hbm_ms = total / profile.hbm_bytes_per_s() * 1e3;
    let flops = rows as f64 * flops_per_row(r, ctx as f64);
    let compute_ms = flops / profile.flops_per_s() * 1e3;
    let message = rows as f64 * config.hidden_size as f64 * REDUCE_BYTES;
    let collectives = 1 + r.blocks + r.norm_reduce_layers;
    let reduce_bytes = (1 + r.blocks) as f64 * message + (rows as f64 * r.norm_reduce_values as f64 * REDUCE_BYTES);
    let comm = all_reduce_ms(profile, input, collectives, reduce_bytes);
    let step_ms = hbm_ms.max(compute_ms) + comm;
    let tokens_per_s = batch as f64 * kept / step_ms * 1e3;
    StepTerms {
        form,
        batch,
        is_max: false,
        rows,
        tokens_per_seq: kept,
        rank: r.rank,
        dense_weight_bytes: dense,
        active_experts,
        expert_bytes: experts,
        ssm_bytes: ssm,
        kv_bytes: kv,
        total_bytes: total,
        hbm_ms,
        flops,
        compute_ms,
        all_reduces: if input.tp > 1 { collectives } else { 0 },
        all_reduce_message_bytes: message,
        all_reduce_ms: comm,
        step_ms,
        tokens_per_s,
        aggregate_tokens_per_s: tokens_per_s * input.replicas as f64,
        calibrated: None,
        flag: None,
    }
}

/// FLOPs of one token row on a rank at `position` tokens of context.
fn flops_per_row(r: &RankModel, position: f64) -> f64 {
    let attention: f64 = r
        .attention
        .iter()
        .map(|a| 4.0 * position * (a.heads * a.head_dim) as f64)
        .sum();
    let ssm: f64 = r.ssm.iter().map(|d| 4.0 * d.state_len() as f64).sum();
    2.0 * r.params_per_token() + attention + ssm
}

/// Plans `config` on `profile` for `input`: memory per rank and form, decode steps, prefill. Errors name the input
/// that is out of range, the TP size the engine cannot split, or what does not fit.
pub fn project(config: &ModelConfig, profile: &GpuProfile, input: &PlanInput) -> Result<Plan, PlanError> {
    profile.validate()?;
    check(input, config, profile)?;
    let ranks = RankModel::all(config, input.tp)?;
    project_ranks(config, profile, input, &ranks, true)
}

/// [`project`] over ranks already planned; `calibrate` applies the committed calibration (off when computing it).
pub(crate) fn project_ranks(
    config: &ModelConfig,
    profile: &GpuProfile,
    input: &PlanInput,
    ranks: &[RankModel],
    calibrate: bool,
) -> Result<Plan, PlanError> {
    let threshold = kv_only_threshold(config) as u64;
    let budget = profile.memory_bytes() * input.memory_fraction;
    let ctx = input.context;
    let opts = PlanOptions {
        spec_window: input.spec_window,
        buffer_len: input.buffer_len,
        context: ctx,
        kv_block_size: input.kv_block_size,
        kv_only_threshold: Some(threshold as usize),
        act_bytes: input.act_bytes,
    };
    // Sequences are counted in whole bytes of the budget: no sequence fits in a fraction of one.
    let whole_budget = budget.floor() as u64;
    let shares: Vec<MemoryShare> = ranks.iter().map(RankModel::memory_share).collect();
    let fits: Vec<Vec<RowFit>> = shares
        .iter()
        .map(|share| {
            input
                .forms
                .iter()
                .map(|f| {
                    share.fit(
                        f.form(),
                        f.spec_window(input.spec_window),
                        whole_budget,
                        &opts,
                        threshold as usize,
                    )
                })
                .collect()
        })
        .collect();
    let rank_memory: Vec<RankMemory> = ranks
        .iter()
        .zip(&shares)
        .zip(&fits)
        .map(|((r, share), fits)| RankMemory {
            rank: r.rank,
            weight_bytes: share.weight_bytes,
            ssm_bytes_per_seq: fits.iter().map(|f| f.ssm_bytes).collect(),
            kv_bytes_per_seq: share.kv_bytes(&opts),
        })
        .collect();
    let heaviest = rank_memory.iter().map(|m| m.weight_bytes).max().unwrap_or(0);
    if heaviest as f64 >= budget {
        return Err(PlanError::DoesNotFit(format!(
            "the weights of one rank ({:.2} GB at --tp {}) exceed {:.2} GB ({} × {} GB of {}): use a larger --tp or \
             a GPU with more memory",
            heaviest as f64 / 1e9,
            input.tp,
            budget / 1e9,
            input.memory_fraction,
            profile.memory_gb,
            profile.name
        )));
    }
    let forms: Vec<FormMemory> = input
        .forms
        .iter()
        .enumerate()
        .map(|(i, &form)| FormMemory {
            form,
            spec_window: form.spec_window(input.spec_window),
            ssm_bytes_per_seq: rank_memory[0].ssm_bytes_per_seq[i],
            kv_bytes_per_seq: rank_memory[0].kv_bytes_per_seq,
            max_sequences: fits.iter().map(|f| f[i].max_sequences).min().unwrap_or(0),
        })
        .collect();
    if forms.iter().all(|f| f.max_sequences == 0) {
        let m = &rank_memory[0];
        return Err(PlanError::DoesNotFit(format!(
            "a context of {ctx} tokens does not fit: one sequence needs {:.2} GB per rank ({:.2} GB of KV), and \
             {:.2} GB are left after {:.2} GB of weights (rank 0 of {}, {} × {} GB of {}); lower --context or raise --tp",
            (m.ssm_bytes_per_seq[0] + m.kv_bytes_per_seq) as f64 / 1e9,
            m.kv_bytes_per_seq as f64 / 1e9,
            (budget - m.weight_bytes as f64) / 1e9,
            m.weight_bytes as f64 / 1e9,
            input.tp,
            input.memory_fraction,
            profile.memory_gb,
            profile.name
        )));
    }
    let mut decode = Vec::new();
    for f in &forms {
        for &b in &input.batches {
            let (batch, is_max) = match b {
                Batch::Fixed(n) => (n as u64, false),
                Batch::Max => (f.max_sequences, true),
            };
            if batch == 0 {
                continue;
            }
            let mut step = ranks
                .iter()
                .map(|r| rank_step(config, r, profile, input, threshold, f.form, batch))
                .max_by(|a, b| a.step_ms.total_cmp(&b.step_ms))
                .ok_or_else(|| PlanError::Invalid("no rank to plan".into()))?;
            step.is_max = is_max;
            if batch > f.max_sequences {
                step.flag = Some(format!(
                    "batch {batch} exceeds the {} sequences of {ctx} tokens that fit",
                    f.max_sequences
                ));
            }
            if calibrate {
                // Past the threshold a kv-only sequence runs as replay, so replay's ratio prices it (the kv-only
                // ratio was measured on short contexts, where its ring is the whole history).
                let basis = if f.form == FormRow::KV_ONLY && ctx as u64 >= threshold {
                    DecodeForm::Replay
                } else {
                    f.form.form()
                };
                let tokens = step.tokens_per_seq * batch as f64;
                step.calibrated = calibration::apply(f.form, basis, batch, step.step_ms, tokens);
            }
            decode.push(step);
        }
    }
    let prefill = prefill(config, profile, input, ranks, calibrate);
    let mut notes = Vec::new();
    if threshold > 0 && (ctx as u64) >= threshold && input.forms.contains(&FormRow::KV_ONLY) {
        notes.push(format!(
            "kv-only keeps no state only below {threshold} tokens; at {ctx} tokens its rows are replay's"
        ));
    }
    if config.mtp_layers > 0 {
        notes.push(format!(
            "the {} MTP layer(s) are not counted: `--spec mtp` loads them, adding their weights and one attention layer's KV",
            config.mtp_layers
        ));
    }
    Ok(Plan {
        gpu: profile.clone(),
        input: input.clone(),
        kv_only_threshold: threshold as usize,
        budget_bytes: budget,
        parameters_per_token: ranks.iter().map(RankModel::params_per_token).sum(),
        ranks: rank_memory,
        forms,
        decode,
        prefill,
        notes,
    })
}

fn prefill(
    config: &ModelConfig,
    profile: &GpuProfile,
    input: &PlanInput,
    ranks: &[RankModel],
    calibrate: bool,
) -> Prefill {
    let position = input.context as f64 / 2.0;
    let flops = ranks.iter().map(|r| flops_per_row(r, position)).fold(0.0, f64::max);
    let compute = flops / profile.flops_per_s() * 1e3;
    let chunk = input.prefill_chunk as f64;
    let blocks = ranks.first().map_or(0, |r| 1 + r.blocks + r.norm_reduce_layers);
    // A chunk of `chunk` tokens shares each collective's latency.
    let comm = all_reduce_ms(
        profile,
        input,
        blocks,
        blocks as f64 * config.hidden_size as f64 * REDUCE_BYTES * chunk,
    ) / chunk;
    let tokens_per_s = 1e3 / (compute + comm);
    Prefill {
        flops_per_token: flops,
        compute_ms_per_token: compute,
        all_reduce_ms_per_token: comm,
        tokens_per_s,
        calibrated: if calibrate {
            calibration::apply_prefill(tokens_per_s)
        } else {
            None
        },
    }
}
