//! Memory accounting, the one memory planner: bytes per sequence slot for each decode form and speculative window,
//! weight bytes, and how many sequences fit a memory budget on one GPU's share of a model ([`MemoryShare`]: the whole
//! model for `rewind plan-memory`, one tensor-parallel rank's shard for `rewind plan`).
//!
//! Bytes are those of the GPU layout, not of the f32 CPU pools: fp32 SSM state and ring scalars (`dt`, `g`); conv
//! inputs, ring vectors and attention KV in the activation type (bf16, or f32 under `--dtype f32`: the element size
//! is [`PlanOptions::act_bytes`]); bf16 weights. The element counts come from
//! [`LayerValues`], the same function the GPU pools are planned and allocated with (`gpu::state`), so the plan and
//! the allocator cannot disagree on a layer's size. Per SSM layer, with `S` the state, `C` one conv input row, `E`
//! one ring entry, `K` the conv width, `T` the speculative window and `L` the ring capacity:
//! - `recurrent`: `S + (K−1)·C` (no speculation);
//! - `spec-baseline` (the recurrent form at a window `T`), one state snapshot per draft: `(1 + T)·(S + (K−1)·C)`;
//! - `replay`: `S + L·E + (K−1+T)·C`;
//! - `kv-only`: below the threshold (≈ the state's key dim, KVBuffer §3.4) no state at all, a ring of
//!   `N + T` entries for a context of `N` tokens, plus the conv ring. A sequence whose context reaches the threshold
//!   must switch to replay, and a pool sized up front has to hold the switch: the checkpoint it creates plus the ring
//!   of `threshold + T` entries it compresses (at least the `L` of the replay it continues in) — more than
//!   `replay`. So kv-only saves memory only for contexts below the threshold. This is what the decoder's pools
//!   allocate per slot: a checkpoint and `max(L, threshold + T)` ring rows, since any slot may start kv-only.
//!   A GPU rank started with a verify window also keeps `T` state snapshots per slot ([`SlotRows::snapshots`]),
//!   so that a sequence in the recurrent form can verify drafts by the baseline.
//!
//! Each form adds the attention KV of `N` tokens, paged: `⌈N / block⌉·block` tokens of `2·kv_heads·head_dim` bf16
//! values per attention layer. The per-slot counters and block tables (a few bytes per slot) are not counted.

use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

use super::counters::DecodeForm;
use super::ssm::{RingElem, SsmDims};
use crate::error::{EngineError, Result};
use crate::model::spec::{Activation, AttentionSpec, RouterSpec};
use crate::model::{BlockKind, ModelConfig};

/// Bytes per fp32 value (SSM state, ring scalars).
pub const STATE_BYTES: u64 = 4;
/// Bytes per bf16 activation (conv inputs, ring vectors, attention KV): the GPU's default activation type.
pub const ACT_BYTES: u64 = 2;
/// Bytes per bf16 weight.
pub const WEIGHT_BYTES: u64 = 2;

/// What the plan assumes besides the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    /// Speculative window `T` (draft tokens per step).
    pub spec_window: usize,
    /// Input-ring capacity `L`.
    pub buffer_len: usize,
    /// Tokens of context each sequence reserves in its attention layers.
    pub context: usize,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    /// Context length below which kv-only keeps no state; `None`: [`kv_only_threshold`].
    pub kv_only_threshold: Option<usize>,
    /// Bytes per activation value: [`ACT_BYTES`] for bf16, 4 for f32.
    pub act_bytes: u64,
}

/// The values one layer keeps per sequence slot and per KV token, by element type: what the GPU pools allocate (the
/// recurrent state, conv history ring and input ring per slot, paged K and V per token) and what the byte model
/// multiplies by element sizes. Every count comes from the layer's spec alone, so it needs no device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerValues {
    /// fp32 SSM state values per slot.
    pub state: usize,
    /// Conv history values per slot, `(K − 1)·conv_dim`, in the activation type.
    pub conv: usize,
    /// Values of one conv input row (`conv_dim`), in the activation type.
    pub conv_row: usize,
    /// Values of one input-ring entry in the activation type (Mamba-2 `x`, `B`; GDN `u`, `k`).
    pub ring_act: usize,
    /// fp32 values of one input-ring entry (Mamba-2 `dt`, GDN `g`).
    pub ring_f32: usize,
    /// Attention K and V values per token, `2·kv_heads·head_dim`, in the activation type.
    pub kv_per_token: usize,
}

/// The rows a slot's rings hold beyond the recurrent state: what the pools of every decode form at once need.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotRows {
    /// Input-ring rows per slot: `max(L, threshold + T)` (any slot may start kv-only); 0 for recurrent-only pools.
    pub ring: usize,
    /// Conv rows beyond the `K − 1` of history: the verify window `T`.
    pub conv_extra: usize,
    /// Full fp32 state snapshots per slot: the recurrent form's speculative baseline (ReplaySSM Alg. 3 / 7) writes
    /// one per verified token, so a pool that serves recurrent verifies of up to `T` tokens holds `T`; 0 without
    /// speculation. The conv history needs none: its ring already keeps `K − 1 + T` rows.
    pub snapshots: usize,
}

impl LayerValues {
    /// An SSM layer with these pool dims.
    pub fn ssm(d: &SsmDims) -> Self {
        let ring = |elem: RingElem| d.ring_fields.iter().filter(|f| f.elem == elem).map(|f| f.width).sum();
        LayerValues {
            state: d.state_len(),
            conv: d.conv_window * d.conv_dim,
            conv_row: d.conv_dim,
            ring_act: ring(RingElem::Act),
            ring_f32: ring(RingElem::F32),
            kv_per_token: 0,
        }
    }

    /// An attention layer.
    pub fn attention(a: &AttentionSpec) -> Self {
        LayerValues {
            kv_per_token: 2 * a.kv_heads * a.head_dim,
            ..LayerValues::default()
        }
    }

    /// Any block: zero for the stateless ones (MLP, MoE).
    pub fn of_block(kind: &BlockKind) -> Self {
        match kind {
            BlockKind::Mamba2(s) => LayerValues::ssm(&SsmDims::mamba2(s)),
            BlockKind::Gdn(s) => LayerValues::ssm(&SsmDims::gdn(s)),
            BlockKind::Attention(a) => LayerValues::attention(a),
            BlockKind::Mlp(_) | BlockKind::Moe(_) => LayerValues::default(),
        }
    }

    /// Bytes of one slot's recurrent state (and its speculative snapshots), conv history ring and input ring
    /// (`rows`) with activations of `act_bytes`.
    pub fn slot_bytes(&self, act_bytes: u64, rows: SlotRows) -> u64 {
        (1 + rows.snapshots as u64) * self.state as u64 * STATE_BYTES
            + (self.conv + rows.conv_extra * self.conv_row) as u64 * act_bytes
            + rows.ring as u64 * (self.ring_act as u64 * act_bytes + self.ring_f32 as u64 * STATE_BYTES)
    }

    /// Bytes of one token's K and V with activations of `act_bytes`.
    pub fn kv_bytes_per_token(&self, act_bytes: u64) -> u64 {
        self.kv_per_token as u64 * act_bytes
    }

    /// Bytes of the fp32 recurrent state of one slot.
    pub fn state_bytes(&self) -> u64 {
        self.state as u64 * STATE_BYTES
    }

    /// Bytes of one conv input row with activations of `act_bytes`.
    pub fn conv_row_bytes(&self, act_bytes: u64) -> u64 {
        self.conv_row as u64 * act_bytes
    }

    /// Bytes of the `K − 1` rows of conv history with activations of `act_bytes`.
    pub fn conv_history_bytes(&self, act_bytes: u64) -> u64 {
        self.conv as u64 * act_bytes
    }

    /// Bytes of one input-ring entry (every field) with activations of `act_bytes`.
    pub fn ring_entry_bytes(&self, act_bytes: u64) -> u64 {
        self.ring_act as u64 * act_bytes + self.ring_f32 as u64 * STATE_BYTES
    }

    /// Bytes one sequence keeps in this layer when decoded in `form` with room to verify `spec_window` drafts, under
    /// `opts` (ring `L`, context, activation size) and the kv-only `threshold` (module docs). The recurrent form at a
    /// window is the speculative baseline: one state and conv snapshot per draft.
    pub fn sequence_bytes(&self, form: DecodeForm, spec_window: usize, opts: &PlanOptions, threshold: usize) -> u64 {
        let act = opts.act_bytes;
        let (t, l, context, threshold) = (
            spec_window as u64,
            opts.buffer_len as u64,
            opts.context as u64,
            threshold as u64,
        );
        let (state, entry) = (self.state_bytes(), self.ring_entry_bytes(act));
        let conv = self.conv_history_bytes(act);
        let conv_ring = conv + t * self.conv_row_bytes(act);
        match form {
            DecodeForm::Recurrent => (1 + t) * (state + conv),
            DecodeForm::Replay => state + l * entry + conv_ring,
            DecodeForm::KvOnly if context < threshold => (context + t) * entry + conv_ring,
            DecodeForm::KvOnly => state + l.max(threshold + t) * entry + conv_ring,
        }
    }
}

/// What GPU pool planning reserves for `layers` (one rank's blocks): bytes per sequence slot (recurrent state and its
/// speculative snapshots, conv history ring, input ring of `rows`) and bytes per KV block of `block` tokens, with
/// activations of `act_bytes`.
pub fn pool_bytes(
    layers: impl IntoIterator<Item = LayerValues>,
    block: usize,
    act_bytes: u64,
    rows: SlotRows,
) -> (u64, u64) {
    layers.into_iter().fold((0, 0), |(slot, kv), l| {
        (
            slot + l.slot_bytes(act_bytes, rows),
            kv + block as u64 * l.kv_bytes_per_token(act_bytes),
        )
    })
}

/// The pool dims of every SSM layer of `config`, in model order.
pub fn ssm_layers(config: &ModelConfig) -> Vec<SsmDims> {
    config
        .layers
        .iter()
        .flatten()
        .filter_map(|b| match &b.kind {
            BlockKind::Mamba2(s) => Some(SsmDims::mamba2(s)),
            BlockKind::Gdn(s) => Some(SsmDims::gdn(s)),
            _ => None,
        })
        .collect()
}

/// The default kv-only threshold: the largest key dimension of any SSM state (Mamba-2 `state_dim`, GDN `k_dim`);
/// 128 for every target model. KVBuffer (§3.4) prefers the KV form while the context is below the head dim `d`.
pub fn kv_only_threshold(config: &ModelConfig) -> usize {
    ssm_layers(config).iter().map(|d| d.key_dim).max().unwrap_or(0)
}

/// One GPU's share of a model as the memory planner prices it: the whole model on one GPU for `plan-memory`
/// ([`MemoryShare::whole`]), one tensor-parallel rank's shard for `plan` (`plan::RankModel::memory_share`).
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryShare {
    /// Bytes of the weights the GPU holds.
    pub weight_bytes: u64,
    /// The pool dims of its SSM layers, as the GPU allocates them.
    pub ssm: Vec<SsmDims>,
    /// K and V values per token over its attention layers.
    pub kv_values_per_token: u64,
}

/// What one sequence of a plan row keeps on a [`MemoryShare`], and how many such sequences fit next to its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowFit {
    /// Bytes of its SSM layers' state, rings and snapshots.
    pub ssm_bytes: u64,
    /// Bytes of its attention KV, in whole blocks.
    pub kv_bytes: u64,
    /// [`max_sequences`] of the budget.
    pub max_sequences: u64,
}

impl MemoryShare {
    /// The whole main stack of `config` on one GPU (bf16 weights from [`weight_bytes`]).
    pub fn whole(config: &ModelConfig) -> Self {
        MemoryShare {
            weight_bytes: weight_bytes(config),
            ssm: ssm_layers(config),
            kv_values_per_token: config
                .layers
                .iter()
                .flatten()
                .map(|b| LayerValues::of_block(&b.kind).kv_per_token as u64)
                .sum(),
        }
    }

    /// SSM bytes of one sequence in `form` with room for `spec_window` drafts (see [`LayerValues::sequence_bytes`]).
    pub fn ssm_bytes(&self, form: DecodeForm, spec_window: usize, opts: &PlanOptions, threshold: usize) -> u64 {
        self.ssm
            .iter()
            .map(|d| LayerValues::ssm(d).sequence_bytes(form, spec_window, opts, threshold))
            .sum()
    }

    /// Attention KV bytes of one sequence of `opts.context` tokens, paged: rounded up to whole KV blocks.
    pub fn kv_bytes(&self, opts: &PlanOptions) -> u64 {
        let block = opts.kv_block_size.max(1);
        (opts.context.div_ceil(block) * block) as u64 * self.kv_values_per_token * opts.act_bytes
    }

    /// One row of a plan on this share: a sequence in `form` with room for `spec_window` drafts, in `budget` bytes.
    pub fn fit(
        &self,
        form: DecodeForm,
        spec_window: usize,
        budget: u64,
        opts: &PlanOptions,
        threshold: usize,
    ) -> RowFit {
        let (ssm_bytes, kv_bytes) = (self.ssm_bytes(form, spec_window, opts, threshold), self.kv_bytes(opts));
        RowFit {
            ssm_bytes,
            kv_bytes,
            max_sequences: max_sequences(budget, self.weight_bytes, ssm_bytes + kv_bytes),
        }
    }
}

/// Parameters of the model's main stack (embedding, decoder layers, final norm, LM head unless tied). MTP layers
/// are not included.
pub fn parameter_count(config: &ModelConfig) -> u64 {
    let h = config.hidden_size as u64;
    let v = config.vocab_size as u64;
    let head = if config.tie_word_embeddings { 0 } else { v * h };
    let blocks: u64 = config
        .layers
        .iter()
        .flatten()
        .map(|b| h + block_parameters(&b.kind))
        .sum();
    v * h + blocks + h + head
}

fn mlp_parameters(h: u64, i: u64, act: Activation, bias: bool) -> u64 {
    let (mats, bias_len) = match act {
        Activation::Relu2 => (2, i + h),
        Activation::SwiGlu => (3, 2 * i + h),
    };
    mats * i * h + if bias { bias_len } else { 0 }
}

fn block_parameters(kind: &BlockKind) -> u64 {
    match kind {
        BlockKind::Mamba2(s) => {
            let (h, heads) = (s.hidden as u64, s.heads as u64);
            let di = heads * s.head_dim as u64;
            let conv_dim = di + 2 * (s.groups * s.state_dim) as u64;
            let in_proj = di + conv_dim + heads;
            let bias = |b: bool, n: u64| if b { n } else { 0 };
            in_proj * h
                + bias(s.proj_bias, in_proj)
                + conv_dim * s.conv_kernel as u64
                + bias(s.conv_bias, conv_dim)
                + 3 * heads
                + di
                + h * di
                + bias(s.proj_bias, h)
        }
        BlockKind::Gdn(s) => {
            let h = s.hidden as u64;
            let vh = s.v_heads as u64;
            let value_dim = vh * s.v_head_dim as u64;
            let conv_dim = 2 * (s.k_heads * s.k_head_dim) as u64 + value_dim;
            (conv_dim + value_dim + 2 * vh) * h
                + conv_dim * s.conv_kernel as u64
                + 2 * vh
                + s.v_head_dim as u64
                + h * value_dim
        }
        BlockKind::Attention(a) => {
            let (h, d) = (a.hidden as u64, a.head_dim as u64);
            let q = a.heads as u64 * d * if a.output_gate { 2 } else { 1 };
            let kv = a.kv_heads as u64 * d;
            let bias = if a.bias { q + 2 * kv + h } else { 0 };
            let norms = if a.qk_norm.is_some() { 2 * d } else { 0 };
            (q + 2 * kv) * h + h * a.heads as u64 * d + bias + norms
        }
        BlockKind::Mlp(m) => mlp_parameters(m.hidden as u64, m.intermediate as u64, m.act, m.bias),
        BlockKind::Moe(m) => {
            let (h, e) = (m.hidden as u64, m.num_experts as u64);
            let router = e * h
                + match m.router {
                    RouterSpec::SigmoidGrouped { .. } => e,
                    RouterSpec::Softmax { .. } => 0,
                };
            // Experts read and write the latent width of a latent MoE (Nemotron-3 Super), which adds its two
            // projections `[latent, hidden]` and `[hidden, latent]` (with biases under `mlp_bias`).
            let d = m.expert_dim() as u64;
            let experts = e * mlp_parameters(d, m.expert_intermediate as u64, m.act, false);
            let latent = m.latent.as_ref().map_or(0, |l| {
                let l_size = l.size as u64;
                2 * l_size * h + if l.bias { l_size + h } else { 0 }
            });
            let shared = m.shared.as_ref().map_or(0, |s| {
                mlp_parameters(h, s.intermediate as u64, m.act, false) + if s.sigmoid_gate { h } else { 0 }
            });
            router + experts + latent + shared
        }
    }
}

/// Weight bytes (bf16) of the main stack.
pub fn weight_bytes(config: &ModelConfig) -> u64 {
    parameter_count(config) * WEIGHT_BYTES
}

/// `floor((budget − weights) / per_sequence)`, 0 when the weights alone fill the budget.
pub fn max_sequences(budget: u64, weights: u64, per_sequence: u64) -> u64 {
    budget.saturating_sub(weights).checked_div(per_sequence).unwrap_or(0)
}

/// One row of a memory plan: sequences decoded in `form` with room to verify `spec_window` drafts.
#[derive(Clone, Debug, PartialEq)]
pub struct FormPlan {
    pub form: DecodeForm,
    pub spec_window: usize,
    pub bytes_per_sequence: u64,
    /// The SSM part of `bytes_per_sequence`.
    pub ssm_bytes: u64,
    /// The attention-KV part of `bytes_per_sequence`.
    pub kv_bytes: u64,
    pub max_sequences: u64,
    /// `max_sequences` over the spec-baseline's at the plan's window (recurrent's when the window is 0); `None`
    /// when the baseline fits no sequence.
    pub vs_baseline: Option<f64>,
}

impl FormPlan {
    /// The row's name in tables and JSON: the form's, except that the recurrent form with a window is
    /// `spec-baseline` (speculation by one state snapshot per draft, vLLM's path).
    pub fn name(&self) -> &'static str {
        match self.form {
            DecodeForm::Recurrent if self.spec_window > 0 => "spec-baseline",
            form => form.name(),
        }
    }
}

// By hand so that `form` is the row's name (`spec-baseline` is a row, not a decode form).
impl Serialize for FormPlan {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let mut row = serializer.serialize_struct("FormPlan", 7)?;
        row.serialize_field("form", self.name())?;
        row.serialize_field("spec_window", &self.spec_window)?;
        row.serialize_field("bytes_per_sequence", &self.bytes_per_sequence)?;
        row.serialize_field("ssm_bytes", &self.ssm_bytes)?;
        row.serialize_field("kv_bytes", &self.kv_bytes)?;
        row.serialize_field("max_sequences", &self.max_sequences)?;
        row.serialize_field("vs_baseline", &self.vs_baseline)?;
        row.end()
    }
}

/// How many sequences of each form fit a budget.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryPlan {
    pub budget_bytes: u64,
    pub weights_bytes: u64,
    pub parameters: u64,
    pub context: usize,
    pub spec_window: usize,
    pub buffer_len: usize,
    pub kv_block_size: usize,
    pub kv_only_threshold: usize,
    pub forms: Vec<FormPlan>,
    /// Caveats for the reader (weights over budget, kv-only beyond its threshold, MTP not counted).
    pub notes: Vec<String>,
}

/// The rows of a plan at window `t`: recurrent, then spec-baseline (recurrent at `t`), replay and kv-only at window 0
/// and at `t`.
fn rows(t: usize) -> Vec<(DecodeForm, usize)> {
    let mut rows = vec![(DecodeForm::Recurrent, 0)];
    if t > 0 {
        rows.push((DecodeForm::Recurrent, t));
    }
    for form in [DecodeForm::Replay, DecodeForm::KvOnly] {
        rows.push((form, 0));
        if t > 0 {
            rows.push((form, t));
        }
    }
    rows
}

/// Plans `budget` bytes for `config`. Errors on options that cannot describe a pool (no stateful layer, a ring too
/// short for one verify step, a zero block size).
pub fn plan_memory(config: &ModelConfig, budget: u64, opts: &PlanOptions) -> Result<MemoryPlan> {
    let t = opts.spec_window;
    if opts.kv_block_size == 0 {
        return Err(EngineError::InvalidInput(
            "the KV block size must be at least 1 token".into(),
        ));
    }
    if opts.buffer_len < t + 1 {
        return Err(EngineError::InvalidInput(format!(
            "--buffer-len {} cannot hold one verify step of {} tokens (--spec-window {t} + 1)",
            opts.buffer_len,
            t + 1
        )));
    }
    if opts.act_bytes == 0 {
        return Err(EngineError::InvalidInput(
            "the activation element size must be at least 1 byte".into(),
        ));
    }
    let share = MemoryShare::whole(config);
    if share.ssm.is_empty() && share.kv_values_per_token == 0 {
        return Err(EngineError::InvalidInput(
            "the model has no SSM or attention layer: it keeps no per-sequence state".into(),
        ));
    }
    let threshold = opts.kv_only_threshold.unwrap_or_else(|| kv_only_threshold(config));
    let weights = share.weight_bytes;
    let mut forms: Vec<FormPlan> = rows(t)
        .into_iter()
        .map(|(form, w)| {
            let fit = share.fit(form, w, budget, opts, threshold);
            FormPlan {
                form,
                spec_window: w,
                bytes_per_sequence: fit.ssm_bytes + fit.kv_bytes,
                ssm_bytes: fit.ssm_bytes,
                kv_bytes: fit.kv_bytes,
                max_sequences: fit.max_sequences,
                vs_baseline: None,
            }
        })
        .collect();
    // The baseline is the spec-baseline row at the plan's window (recurrent's when the window is 0).
    let base = forms
        .iter()
        .find(|f| f.form == DecodeForm::Recurrent && f.spec_window == t)
        .map_or(0, |f| f.max_sequences);
    for f in &mut forms {
        f.vs_baseline = (base > 0).then(|| f.max_sequences as f64 / base as f64);
    }
    let mut notes = Vec::new();
    if weights >= budget {
        notes.push(format!(
            "the weights alone ({}) exceed the budget ({}): no sequence fits",
            format_bytes(weights),
            format_bytes(budget)
        ));
    }
    if threshold > 0 && opts.context >= threshold {
        notes.push(format!(
            "kv-only keeps no state only below {threshold} tokens of context; at {} tokens a slot must hold the \
             switch to replay (checkpoint + ring of {threshold} + T entries), more than replay",
            opts.context
        ));
    }
    if threshold + t > opts.buffer_len {
        notes.push(format!(
            "pools that may hold kv-only or auto sequences give every slot {} ring entries (threshold {threshold} + \
             T {t}) instead of L = {}: a replay slot in them takes the kv-only row's bytes",
            threshold + t,
            opts.buffer_len
        ));
    }
    if opts.context > config.max_position_embeddings {
        notes.push(format!(
            "the context ({}) exceeds the model's max_position_embeddings ({})",
            opts.context, config.max_position_embeddings
        ));
    }
    if config.mtp_layers > 0 {
        notes.push(format!(
            "the {} MTP layer(s) are not counted: `--spec mtp` loads them, adding their weights and one attention layer's KV",
            config.mtp_layers
        ));
    }
    Ok(MemoryPlan {
        budget_bytes: budget,
        weights_bytes: weights,
        parameters: parameter_count(config),
        context: opts.context,
        spec_window: t,
        buffer_len: opts.buffer_len,
        kv_block_size: opts.kv_block_size,
        kv_only_threshold: threshold,
        forms,
        notes,
    })
}

/// Parses a byte count: plain bytes (`1048576`) or a number with a unit — decimal `B`, `KB`, `MB`, `GB`, `TB` or
/// binary `KiB`, `MiB`, `GiB`, `TiB`, case-insensitive (`70GiB`, `70 GB`, `1.5GiB`). The result must be positive.
pub fn parse_bytes(text: &str) -> Result<u64> {
    let bad = |why: &str| EngineError::InvalidInput(format!("`{text}` is not a byte count: {why}"));
    let t = text.trim();
    if t.starts_with('-') {
        return Err(bad("a negative size; it must be positive, e.g. 70GiB"));
    }
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => {
            return Err(bad(&format!(
                "unknown unit `{}` (expected B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)",
                unit.trim()
            )))
        }
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() {
        return Err(bad("expected a number, e.g. 70GiB"));
    }
    if frac.contains('.') || frac.len() > 18 {
        return Err(bad("malformed number"));
    }
    let digits = |s: &str| -> Option<u128> {
        s.bytes()
            .try_fold(0u128, |a, b| a.checked_mul(10)?.checked_add((b - b'0') as u128))
    };
    let scale = 10u128.pow(frac.len() as u32);
    let value = digits(int)
        .and_then(|i| i.checked_mul(scale))
        .and_then(|i| i.checked_add(digits(frac)?))
        .and_then(|v| v.checked_mul(mult))
        .map(|v| v / scale)
        .ok_or_else(|| bad("too large"))?;
    if value == 0 {
        return Err(bad("must be positive"));
    }
    u64::try_from(value).map_err(|_| bad("too large"))
}

/// A byte count for people: `53.77 GiB`, `1.50 MiB`, `512 B`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (name, size) in UNITS {
        if bytes >= size {
            return format!("{:.2} {name}", bytes as f64 / size as f64);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
#[path = "memory_tests.rs"]
mod tests;
