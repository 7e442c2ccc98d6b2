//! One-pass LM-head summaries on the device (FlashSpec; CPU twin [`crate::cpu::lm_head`]): a chunk of logits
//! (`[rows, ld]`, columns `0 .. len` of vocabulary ids `first_id ..`) is folded into per-row partial summaries of
//! [`PART_WIDTH`] ids each, and [`head_summary_merge`] folds a row's partials into its [`RowPass`]. The caller
//! produces the logits a bounded chunk at a time (`engine/src/gpu/head.rs`), so nothing of the vocabulary's size is
//! kept per row.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{after_launch, fits_grid_y, fits_u32};
use crate::cpu::lm_head::{LogprobRequest, LogprobSummary, RowPass, SpecRequest, SpecSummary, TopK, MAX_TOP};
use crate::cuda::device::CudaDevice;
use crate::cuda::{check_len, driver_err, ensure, Result};

/// Vocabulary ids one partial summary covers (one block of the parts kernel).
pub const PART_WIDTH: usize = 2048;
/// Words (u32) per stored summary.
pub const SUMMARY_WORDS: usize = 8;
/// Words (u32) per row of the speculative requests.
pub const SPEC_WORDS: usize = 6;

const THREADS: u32 = 256;

/// Encodes one row's speculative request as the kernel reads it (`None`: a plain row). A draft outside `i32` is
/// refused by the caller's validation before it gets here; it is encoded as "no draft".
pub fn encode_spec(spec: Option<&SpecRequest>) -> [u32; SPEC_WORDS] {
    match spec {
        None => [(-2i32) as u32, 0, 0, 0, 0, 0],
        Some(r) => {
            let draft = r.draft.and_then(|d| i32::try_from(d).ok()).unwrap_or(-1);
            [
                draft as u32,
                (1.0 / r.temperature).to_bits(),
                r.seed as u32,
                (r.seed >> 32) as u32,
                r.index as u32,
                (r.index >> 32) as u32,
            ]
        }
    }
}

/// Decodes the stored summaries of rows whose speculative requests were `spec` (`words` `[rows, 8]`).
pub fn decode_summaries(words: &[u32], spec: &[bool]) -> Vec<RowPass> {
    words
        .chunks_exact(SUMMARY_WORDS)
        .zip(spec)
        .map(|(w, &spec)| RowPass {
            argmax: w[0],
            max: f32::from_bits(w[1]),
            lse: f32::from_bits(w[2]),
            spec: spec.then(|| SpecSummary {
                lse: f32::from_bits(w[3]),
                drafted: (w[5] != 0).then(|| f32::from_bits(w[4])),
                candidate: w[6],
                score: f32::from_bits(w[7]),
            }),
            logprob: None,
        })
        .collect()
}

/// Encodes a summary in the stored layout [`decode_summaries`] reads (the log-probability part is not stored): how a
/// rank sends a summary it holds on the host through a device gather (`engine/src/gpu/mtp.rs`).
pub fn encode_summary(pass: &RowPass) -> [u32; SUMMARY_WORDS] {
    let sp = pass.spec;
    let drafted = sp.and_then(|s| s.drafted);
    [
        pass.argmax,
        pass.max.to_bits(),
        pass.lse.to_bits(),
        sp.map_or(0, |s| s.lse.to_bits()),
        drafted.unwrap_or(0.0).to_bits(),
        u32::from(drafted.is_some()),
        sp.map_or(0, |s| s.candidate),
        sp.map_or(0, |s| s.score.to_bits()),
    ]
}

/// The partials a chunk of `len` ids needs.
pub fn parts_for(len: usize) -> usize {
    len.div_ceil(PART_WIDTH)
}

/// Checks one vocabulary chunk of a head pass (`rows` rows of `len` ids from `first_id`, row stride `ld`, in
/// `logits_len` values) against the part slots `part_offset ..` of `total_parts`; returns how many parts it folds into.
/// Shared by the summary and the top-k passes, which tile the chunk alike.
#[allow(clippy::too_many_arguments)]
fn check_chunk(
    op: &'static str,
    logits_len: usize,
    ld: usize,
    rows: usize,
    len: usize,
    first_id: u32,
    total_parts: usize,
    part_offset: usize,
) -> Result<usize> {
    ensure(op, len <= ld, || {
        format!("chunk of {len} ids wider than its row stride {ld}")
    })?;
    ensure(op, rows == 0 || logits_len >= (rows - 1) * ld + len, || {
        format!("logits of {logits_len} hold no {rows} rows of stride {ld}")
    })?;
    let n = parts_for(len);
    ensure(op, part_offset + n <= total_parts, || {
        format!("parts {part_offset} + {n} exceed {total_parts}")
    })?;
    ensure(op, first_id as usize + len <= i32::MAX as usize, || {
        "ids exceed i32".into()
    })?;
    fits_u32(op, "ld", ld)?;
    Ok(n)
}

/// Folds `logits` columns `0 .. len` (row stride `ld`, ids `first_id ..`) of `rows` rows into
/// `parts[r, part_offset ..]` (`parts` `[rows, total_parts, 8]`); `spec` `[rows, 6]` from [`encode_spec`].
#[allow(clippy::too_many_arguments)]
pub fn head_summary_parts(
    dev: &CudaDevice,
    logits: &impl DevicePtr<f32>,
    ld: usize,
    rows: usize,
    len: usize,
    first_id: u32,
    spec: &impl DevicePtr<u32>,
    parts: &mut impl DevicePtrMut<u32>,
    total_parts: usize,
    part_offset: usize,
) -> Result<()> {
    const OP: &str = "head_summary_parts";
    check_len(OP, "spec", spec.len(), rows * SPEC_WORDS)?;
    check_len(OP, "parts", parts.len(), rows * total_parts * SUMMARY_WORDS)?;
    let n = check_chunk(OP, logits.len(), ld, rows, len, first_id, total_parts, part_offset)?;
    fits_grid_y(OP, "rows", rows)?;
    if rows == 0 || len == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (n as u32, rows as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (ld_i, len_i, first_i, width_i) = (ld as i32, len as i32, first_id as i32, PART_WIDTH as i32);
    let (total_i, offset_i) = (total_parts as i32, part_offset as i32);
    let (lp, _gl) = logits.device_ptr(dev.stream());
    let (sp, _gs) = spec.device_ptr(dev.stream());
    let (pp, _gp) = parts.device_ptr_mut(dev.stream());
    launch!(
        dev,
        "head_summary_parts",
        cfg,
        lp,
        ld_i,
        len_i,
        first_i,
        width_i,
        sp,
        pp,
        total_i,
        offset_i
    )
}

/// Folds each row's first `seen` partials of `parts` `[rows, total_parts, 8]` into `out` `[rows, 8]`.
pub fn head_summary_merge(
    dev: &CudaDevice,
    parts: &impl DevicePtr<u32>,
    rows: usize,
    total_parts: usize,
    seen: usize,
    out: &mut impl DevicePtrMut<u32>,
) -> Result<()> {
    const OP: &str = "head_summary_merge";
    check_len(OP, "parts", parts.len(), rows * total_parts * SUMMARY_WORDS)?;
    check_len(OP, "out", out.len(), rows * SUMMARY_WORDS)?;
    ensure(OP, seen <= total_parts, || format!("{seen} of {total_parts} parts"))?;
    fits_u32(OP, "rows", rows)?;
    if rows == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (total_i, seen_i) = (total_parts as i32, seen as i32);
    let (pp, _gp) = parts.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(dev, "head_summary_merge", cfg, pp, total_i, seen_i, op)
}

/// Summaries of whole logit rows `[rows, vocab]` already on the device (ids `first_id ..`): the parts and the merge
/// in one call, with `parts` `[rows, parts_for(vocab), 8]` as workspace.
#[allow(clippy::too_many_arguments)]
pub fn head_summaries(
    dev: &CudaDevice,
    logits: &impl DevicePtr<f32>,
    rows: usize,
    vocab: usize,
    first_id: u32,
    spec: &impl DevicePtr<u32>,
    parts: &mut (impl DevicePtrMut<u32> + DevicePtr<u32>),
    out: &mut impl DevicePtrMut<u32>,
) -> Result<()> {
    let total = parts_for(vocab);
    head_summary_parts(dev, logits, vocab, rows, vocab, first_id, spec, parts, total, 0)?;
    head_summary_merge(dev, parts, rows, total, total, out)
}

/// Words (u32) per stored top list of a log-probability row: count, 20 ids, 20 logits, has-target, target logit.
pub const TOPK_WORDS: usize = 2 * MAX_TOP + 3;

/// The requests of the rows asking for log-probabilities as [`head_topk_parts`] reads them: per row its `k` and
/// target id (−1: none; an id outside `i32` is refused by the caller's validation and encoded as none).
pub fn encode_logprob_requests(requests: &[LogprobRequest]) -> Vec<i32> {
    requests
        .iter()
        .flat_map(|r| {
            [
                r.top.min(MAX_TOP) as i32,
                r.target.and_then(|t| i32::try_from(t).ok()).unwrap_or(-1),
            ]
        })
        .collect()
}

/// Decodes stored top lists (`words` `[rows, TOPK_WORDS]`) of rows that asked for `requests`.
pub fn decode_topk(words: &[u32], requests: &[LogprobRequest]) -> Vec<LogprobSummary> {
    words
        .chunks_exact(TOPK_WORDS)
        .zip(requests)
        .map(|(w, r)| {
            let mut top = TopK::new(r.top);
            let n = (w[0] as usize).min(MAX_TOP);
            for e in 0..n {
                top.push(w[1 + e], f32::from_bits(w[1 + MAX_TOP + e]));
            }
            let target = r
                .target
                .filter(|_| w[1 + 2 * MAX_TOP] != 0)
                .map(|t| (t, f32::from_bits(w[2 + 2 * MAX_TOP])));
            LogprobSummary { top, target }
        })
        .collect()
}

/// Folds logits columns `0 .. len` (row stride `ld`, ids `first_id ..`) of the rows `lp_rows` (indices into the
/// chunk's rows) into their top lists `parts[j, part_offset ..]` (`parts` `[lp_rows, total_parts, TOPK_WORDS]`);
/// `req` `[lp_rows, 2]` from [`encode_logprob_requests`]. Only the asking rows are launched over.
#[allow(clippy::too_many_arguments)]
pub fn head_topk_parts(
    dev: &CudaDevice,
    logits: &impl DevicePtr<f32>,
    ld: usize,
    rows: usize,
    len: usize,
    first_id: u32,
    lp_rows: &impl DevicePtr<i32>,
    req: &impl DevicePtr<i32>,
    parts: &mut impl DevicePtrMut<u32>,
    total_parts: usize,
    part_offset: usize,
) -> Result<()> {
    const OP: &str = "head_topk_parts";
    let asking = lp_rows.len();
    check_len(OP, "req", req.len(), asking * 2)?;
    check_len(OP, "parts", parts.len(), asking * total_parts * TOPK_WORDS)?;
    let n = check_chunk(OP, logits.len(), ld, rows, len, first_id, total_parts, part_offset)?;
    fits_grid_y(OP, "asking rows", asking)?;
    if asking == 0 || len == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (n as u32, asking as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (ld_i, len_i, first_i, width_i) = (ld as i32, len as i32, first_id as i32, PART_WIDTH as i32);
    let (total_i, offset_i) = (total_parts as i32, part_offset as i32);
    let (lp, _gl) = logits.device_ptr(dev.stream());
    let (rp, _gr) = lp_rows.device_ptr(dev.stream());
    let (qp, _gq) = req.device_ptr(dev.stream());
    let (pp, _gp) = parts.device_ptr_mut(dev.stream());
    launch!(
        dev,
        "head_topk_parts",
        cfg,
        lp,
        ld_i,
        len_i,
        first_i,
        width_i,
        rp,
        qp,
        pp,
        total_i,
        offset_i
    )
}

/// Merges each asking row's first `seen` top lists of `parts` `[rows, total_parts, TOPK_WORDS]` into `out`
/// `[rows, TOPK_WORDS]`.
pub fn head_topk_merge(
    dev: &CudaDevice,
    parts: &impl DevicePtr<u32>,
    rows: usize,
    total_parts: usize,
    seen: usize,
    req: &impl DevicePtr<i32>,
    out: &mut impl DevicePtrMut<u32>,
) -> Result<()> {
    const OP: &str = "head_topk_merge";
    check_len(OP, "parts", parts.len(), rows * total_parts * TOPK_WORDS)?;
    check_len(OP, "req", req.len(), rows * 2)?;
    check_len(OP, "out", out.len(), rows * TOPK_WORDS)?;
    ensure(OP, seen <= total_parts, || format!("{seen} of {total_parts} parts"))?;
    fits_u32(OP, "rows", rows)?;
    if rows == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (total_i, seen_i) = (total_parts as i32, seen as i32);
    let (pp, _gp) = parts.device_ptr(dev.stream());
    let (qp, _gq) = req.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(dev, "head_topk_merge", cfg, pp, total_i, seen_i, qp, op)
}

/// Words (u32) per sequence of [`spec_accept`]'s parameters ([`encode_judge`]).
pub const JUDGE_WORDS: usize = 5;

/// One sequence's judging parameters as [`spec_accept`] reads them: `None` judges greedily, `Some((seed, index))`
/// samples keyed by the request's seed and the output index of the verify's first row.
pub fn encode_judge(sampled: Option<(u64, u64)>) -> [u32; JUDGE_WORDS] {
    match sampled {
        None => [0; JUDGE_WORDS],
        Some((seed, index)) => [1, seed as u32, (seed >> 32) as u32, index as u32, (index >> 32) as u32],
    }
}

/// Judges `seqs` speculative verifies of `t` rows each (`t − 1` drafts) on the device, as
/// [`crate::cpu::accept::judge`] does on the host: `gathered` `[world, seqs · t, 8]` the verify rows' summaries of
/// every rank (rank order), `drafts` `[seqs, t − 1]`, `params` `[seqs, 5]` from [`encode_judge`]; `out` `[seqs, 2]`
/// gets each sequence's accepted count and next token (−1 where the host must fail the verify: a NaN row, or nothing
/// left to resample).
#[allow(clippy::too_many_arguments)]
pub fn spec_accept(
    dev: &CudaDevice,
    gathered: &impl DevicePtr<u32>,
    world: usize,
    seqs: usize,
    t: usize,
    drafts: &impl DevicePtr<i32>,
    params: &impl DevicePtr<u32>,
    out: &mut impl DevicePtrMut<i32>,
) -> Result<()> {
    const OP: &str = "spec_accept";
    ensure(OP, world > 0 && t > 0, || format!("world {world}, t {t}"))?;
    check_len(OP, "gathered", gathered.len(), world * seqs * t * SUMMARY_WORDS)?;
    check_len(OP, "drafts", drafts.len(), seqs * (t - 1))?;
    check_len(OP, "params", params.len(), seqs * JUDGE_WORDS)?;
    check_len(OP, "out", out.len(), 2 * seqs)?;
    fits_u32(OP, "rows", seqs * t)?;
    if seqs == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: ((seqs as u32).div_ceil(THREADS), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (world_i, seqs_i, t_i) = (world as i32, seqs as i32, t as i32);
    let (gp, _gg) = gathered.device_ptr(dev.stream());
    let (dp, _gd) = drafts.device_ptr(dev.stream());
    let (pp, _gpp) = params.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(dev, "spec_accept", cfg, gp, world_i, seqs_i, t_i, dp, pp, op)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_words_round_trip_the_request() {
        let r = SpecRequest {
            draft: Some(70_000),
            temperature: 0.5,
            seed: 0x1234_5678_9abc_def0,
            index: 5,
        };
        let w = encode_spec(Some(&r));
        assert_eq!(w[0] as i32, 70_000);
        assert_eq!(f32::from_bits(w[1]), 2.0);
        assert_eq!(u64::from(w[2]) | (u64::from(w[3]) << 32), r.seed);
        assert_eq!(u64::from(w[4]) | (u64::from(w[5]) << 32), 5);
        assert_eq!(encode_spec(None)[0] as i32, -2);
        let no_draft = SpecRequest { draft: None, ..r };
        assert_eq!(encode_spec(Some(&no_draft))[0] as i32, -1);
    }

    #[test]
    fn stored_summaries_decode_by_field() {
        let words = [
            7,
            1.5f32.to_bits(),
            3.0f32.to_bits(),
            4.0f32.to_bits(),
            0.25f32.to_bits(),
            1,
            9,
            2.5f32.to_bits(),
        ];
        let got = decode_summaries(&words, &[true]);
        assert_eq!(got[0].argmax, 7);
        assert_eq!(got[0].lse, 3.0);
        let s = got[0].spec.expect("spec");
        assert_eq!((s.drafted, s.candidate, s.score), (Some(0.25), 9, 2.5));
        assert!(decode_summaries(&words, &[false])[0].spec.is_none());
    }

    #[test]
    fn encoded_summaries_decode_to_themselves() {
        let plain = RowPass {
            argmax: 11,
            max: f32::NAN,
            lse: -2.0,
            spec: None,
            logprob: None,
        };
        let spec = RowPass {
            spec: Some(SpecSummary {
                lse: 1.0,
                drafted: None,
                candidate: 4,
                score: f32::NEG_INFINITY,
            }),
            max: 0.5,
            ..plain
        };
        let drafted = RowPass {
            spec: spec.spec.map(|s| SpecSummary {
                drafted: Some(-0.0),
                ..s
            }),
            ..spec
        };
        let words: Vec<u32> = [plain, spec, drafted].iter().flat_map(encode_summary).collect();
        let back = decode_summaries(&words, &[false, true, true]);
        assert_eq!((back[0].argmax, back[0].lse, back[0].spec), (11, -2.0, None));
        assert!(back[0].max.is_nan());
        assert_eq!(back[1], spec);
        assert_eq!(
            back[2].spec.and_then(|s| s.drafted).map(f32::to_bits),
            Some((-0.0f32).to_bits())
        );
    }
}
