//! A speculative decode chain on the device (`kernels/spec_chain.cu`; CPU twins in [`crate::cpu::chain`]): after
//! each verify step and its [`super::spec_accept`], [`chain_advance`] moves every sequence's counters and builds the
//! next step's metadata, [`chain_draft`] proposes the next step's drafts and, where sequences sample, [`chain_spec`]
//! writes their one-pass requests, so verify steps run back to back with no host round trip. A sequence that cannot
//! advance gets a sticky fault bit ([`crate::cpu::chain::FAULT_VERDICT`] and its siblings) and is skipped by every
//! later launch of the chain.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{after_launch, fits_u32, grid_1d, JUDGE_WORDS, REPLAY_META, SPEC_WORDS};
pub use crate::cpu::chain::{ChainParams, DraftMode};
use crate::cpu::chain::{CHAIN_SAMPLE_WORDS, CHAIN_STATE_WORDS};
use crate::cuda::device::CudaDevice;
use crate::cuda::{check_len, driver_err, ensure, Result};

/// Threads per sequence of [`chain_draft`] (one block each).
const DRAFT_THREADS: u32 = 128;

fn fits_i32(op: &'static str, what: &str, v: usize) -> Result<()> {
    ensure(op, v <= i32::MAX as usize, || format!("{what} = {v} exceeds i32"))
}

/// Advances `seqs` sequences past the verify step just judged, as [`crate::cpu::chain::advance_in`] does on the
/// host (with `lens.len()` slots): `verdict` `[seqs, 2]` from [`super::spec_accept`], `drafts` `[seqs, t − 1]` the
/// drafts that step verified, `state` `[seqs, 8]` ([`crate::cpu::chain::ChainSeq`]) and `hist` `[seqs, hist_cap]`
/// updated in place, `fault` `[seqs]` sticky bits; for every sequence that advances: `meta` `[seqs, 8]` its next
/// replay row, `tokens[q · t]` its next input token, `row_pos` `[seqs · t]` its rows' positions and `lens[slot]`
/// (`lens` `[max_seqs]`) its KV length after the next step. A faulted sequence writes nothing but its fault. The
/// sequences' slots must be distinct (each writes `lens[slot]`).
#[allow(clippy::too_many_arguments)]
pub fn chain_advance(
    dev: &CudaDevice,
    verdict: &impl DevicePtr<i32>,
    drafts: &impl DevicePtr<i32>,
    state: &mut impl DevicePtrMut<i32>,
    hist: &mut impl DevicePtrMut<i32>,
    fault: &mut impl DevicePtrMut<i32>,
    meta: &mut impl DevicePtrMut<i32>,
    tokens: &mut impl DevicePtrMut<i32>,
    row_pos: &mut impl DevicePtrMut<i32>,
    lens: &mut impl DevicePtrMut<i32>,
    p: &ChainParams,
    seqs: usize,
) -> Result<()> {
    const OP: &str = "chain_advance";
    let t = p.t;
    ensure(OP, t >= 1, || "t = 0 rows per sequence".into())?;
    for (what, v) in [
        ("t", t),
        ("ring_capacity", p.ring_capacity),
        ("window", p.window),
        ("threshold", p.threshold),
        ("conv_cap", p.conv_cap),
        ("hist_cap", p.hist_cap),
        ("lens", lens.len()),
    ] {
        fits_i32(OP, what, v)?;
    }
    check_len(OP, "verdict", verdict.len(), 2 * seqs)?;
    check_len(OP, "drafts", drafts.len(), seqs * (t - 1))?;
    check_len(OP, "state", state.len(), seqs * CHAIN_STATE_WORDS)?;
    check_len(OP, "hist", hist.len(), seqs * p.hist_cap)?;
    check_len(OP, "fault", fault.len(), seqs)?;
    check_len(OP, "meta", meta.len(), seqs * REPLAY_META)?;
    check_len(OP, "tokens", tokens.len(), seqs * t)?;
    check_len(OP, "row_pos", row_pos.len(), seqs * t)?;
    fits_u32(OP, "rows", seqs * t)?;
    if seqs == 0 {
        return Ok(());
    }
    let (seqs_i, max_i, t_i) = (seqs as i32, lens.len() as i32, t as i32);
    let (l_i, w_i, th_i) = (p.ring_capacity as i32, p.window as i32, p.threshold as i32);
    let (conv_i, hist_i) = (p.conv_cap as i32, p.hist_cap as i32);
    let (vp, _gv) = verdict.device_ptr(dev.stream());
    let (dp, _gd) = drafts.device_ptr(dev.stream());
    let (sp, _gs) = state.device_ptr_mut(dev.stream());
    let (hp, _gh) = hist.device_ptr_mut(dev.stream());
    let (fp, _gf) = fault.device_ptr_mut(dev.stream());
    let (mp, _gm) = meta.device_ptr_mut(dev.stream());
    let (tp, _gt) = tokens.device_ptr_mut(dev.stream());
    let (rp, _gr) = row_pos.device_ptr_mut(dev.stream());
    let (lp, _gl) = lens.device_ptr_mut(dev.stream());
    launch!(
        dev,
        "chain_advance",
        grid_1d(seqs),
        vp,
        dp,
        sp,
        hp,
        fp,
        mp,
        tp,
        rp,
        lp,
        seqs_i,
        max_i,
        t_i,
        l_i,
        w_i,
        th_i,
        conv_i,
        hist_i
    )
}

/// Proposes the next step's `t − 1` drafts of `seqs` sequences, as [`crate::cpu::chain::propose`] does on the host:
/// from each one's history row in `hist` `[seqs, hist_cap]` (its first `hist_len` tokens, `state` `[seqs, 8]`),
/// by prompt lookup ([`DraftMode::Ngram`], 1 ≤ `min_n` ≤ `max_n`) or from `table` `[seqs, table_cap]`
/// ([`DraftMode::Table`]; in n-gram mode `table` is not read and may be any non-empty buffer), padded with the
/// last token. Writes `drafts` `[seqs, t − 1]` and rows `1 .. t` of each sequence in `tokens` `[seqs · t]`; a
/// sequence whose `fault` `[seqs]` is set is skipped. `t == 1` proposes nothing.
#[allow(clippy::too_many_arguments)]
pub fn chain_draft(
    dev: &CudaDevice,
    hist: &impl DevicePtr<i32>,
    state: &impl DevicePtr<i32>,
    fault: &impl DevicePtr<i32>,
    mode: DraftMode,
    table: &impl DevicePtr<i32>,
    t: usize,
    drafts: &mut impl DevicePtrMut<i32>,
    tokens: &mut impl DevicePtrMut<i32>,
    seqs: usize,
) -> Result<()> {
    const OP: &str = "chain_draft";
    ensure(OP, t >= 1, || "t = 0 rows per sequence".into())?;
    fits_i32(OP, "t", t)?;
    check_len(OP, "state", state.len(), seqs * CHAIN_STATE_WORDS)?;
    check_len(OP, "fault", fault.len(), seqs)?;
    check_len(OP, "drafts", drafts.len(), seqs * (t - 1))?;
    check_len(OP, "tokens", tokens.len(), seqs * t)?;
    fits_u32(OP, "rows", seqs * t)?;
    if seqs == 0 {
        return check_len(OP, "hist", hist.len(), 0);
    }
    ensure(OP, hist.len().is_multiple_of(seqs), || {
        format!("hist of {} is not {seqs} rows", hist.len())
    })?;
    let hist_cap = hist.len() / seqs;
    fits_i32(OP, "hist_cap", hist_cap)?;
    let (mode_i, min_n, max_n, table_cap) = match mode {
        DraftMode::Ngram { min_n, max_n } => {
            ensure(OP, min_n >= 1 && min_n <= max_n, || {
                format!("n-grams of {min_n} ..= {max_n} tokens")
            })?;
            fits_i32(OP, "max_n", max_n)?;
            ensure(OP, !table.is_empty(), || "an empty table buffer".into())?;
            (0i32, min_n as i32, max_n as i32, 0i32)
        }
        DraftMode::Table { table_cap } => {
            fits_i32(OP, "table_cap", table_cap)?;
            check_len(OP, "table", table.len(), seqs * table_cap)?;
            (1i32, 0i32, 0i32, table_cap as i32)
        }
    };
    if t == 1 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (seqs as u32, 1, 1),
        block_dim: (DRAFT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (hist_i, t_i) = (hist_cap as i32, t as i32);
    let (hp, _gh) = hist.device_ptr(dev.stream());
    let (sp, _gs) = state.device_ptr(dev.stream());
    let (fp, _gf) = fault.device_ptr(dev.stream());
    let (bp, _gb) = table.device_ptr(dev.stream());
    let (dp, _gd) = drafts.device_ptr_mut(dev.stream());
    let (tp, _gt) = tokens.device_ptr_mut(dev.stream());
    launch!(
        dev,
        "chain_draft",
        cfg,
        hp,
        hist_i,
        sp,
        fp,
        mode_i,
        min_n,
        max_n,
        bp,
        table_cap,
        t_i,
        dp,
        tp
    )
}

/// Writes the one-pass requests of the next step of a chain whose sequences sample, as
/// [`crate::cpu::chain::spec_requests`] gives them: `sample` `[seqs, 6]` ([`crate::cpu::chain::ChainSample::encode`]),
/// `state` `[seqs, 8]` (the position chain_advance left), `tokens` `[seqs · t]` (the rows chain_draft left);
/// outputs the head's words `spec` `[seqs · t, SPEC_WORDS]` ([`super::encode_spec`]) and `judge`
/// `[seqs, JUDGE_WORDS]` ([`super::encode_judge`]). A sequence whose `fault` `[seqs]` is set is skipped.
#[allow(clippy::too_many_arguments)]
pub fn chain_spec(
    dev: &CudaDevice,
    state: &impl DevicePtr<i32>,
    fault: &impl DevicePtr<i32>,
    sample: &impl DevicePtr<u32>,
    tokens: &impl DevicePtr<i32>,
    t: usize,
    spec: &mut impl DevicePtrMut<u32>,
    judge: &mut impl DevicePtrMut<u32>,
    seqs: usize,
) -> Result<()> {
    const OP: &str = "chain_spec";
    ensure(OP, t >= 1, || "t = 0 rows per sequence".into())?;
    fits_i32(OP, "t", t)?;
    fits_i32(OP, "seqs", seqs)?;
    check_len(OP, "state", state.len(), seqs * CHAIN_STATE_WORDS)?;
    check_len(OP, "fault", fault.len(), seqs)?;
    check_len(OP, "sample", sample.len(), seqs * CHAIN_SAMPLE_WORDS)?;
    check_len(OP, "tokens", tokens.len(), seqs * t)?;
    check_len(OP, "spec", spec.len(), seqs * t * SPEC_WORDS)?;
    check_len(OP, "judge", judge.len(), seqs * JUDGE_WORDS)?;
    if seqs == 0 {
        return Ok(());
    }
    let (seqs_i, t_i) = (seqs as i32, t as i32);
    let (sp, _gs) = state.device_ptr(dev.stream());
    let (fp, _gf) = fault.device_ptr(dev.stream());
    let (ap, _ga) = sample.device_ptr(dev.stream());
    let (tp, _gt) = tokens.device_ptr(dev.stream());
    let (op, _go) = spec.device_ptr_mut(dev.stream());
    let (jp, _gj) = judge.device_ptr_mut(dev.stream());
    launch!(
        dev,
        "chain_spec",
        grid_1d(seqs * t),
        sp,
        fp,
        ap,
        tp,
        seqs_i,
        t_i,
        op,
        jp
    )
}
