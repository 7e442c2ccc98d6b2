//! Token selection on the device: row argmax (greedy decoding), the repetition penalty, the additive logit bias, and
//! filtered sampling (temperature, top-k, top-p, min-p, inverse-CDF draw) with the CPU Sampler's semantics; the CPU
//! twin is [`crate::cpu::sample::sample_row`].

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{after_launch, fits_u32, grid_1d};
use crate::cuda::device::CudaDevice;
use crate::cuda::{check_len, driver_err, ensure, Result};

/// Threads per row of the row-wide selection kernels.
const ROW_THREADS: u32 = 1024;

fn per_row_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn check_rows(op: &'static str, len: usize, rows: usize) -> Result<usize> {
    ensure(op, rows > 0 && len.is_multiple_of(rows), || {
        format!("logits of {len} are not {rows} rows")
    })?;
    let vocab = len / rows;
    ensure(op, vocab > 0 && vocab <= i32::MAX as usize, || {
        format!("vocabulary {vocab} outside 1..=i32::MAX")
    })?;
    fits_u32(op, "rows", rows)?;
    Ok(vocab)
}

/// Per row of `logits` `[rows, vocab]`: the lowest index among the largest values (as
/// [`crate::cpu::sample::argmax`]), or −1 when the row holds a NaN.
pub fn argmax_rows(
    dev: &CudaDevice,
    logits: &impl DevicePtr<f32>,
    rows: usize,
    out: &mut impl DevicePtrMut<i32>,
) -> Result<()> {
    const OP: &str = "argmax_rows";
    check_len(OP, "out", out.len(), rows)?;
    if rows == 0 {
        return check_len(OP, "logits", logits.len(), 0);
    }
    let vocab = check_rows(OP, logits.len(), rows)? as i32;
    let (lp, _gl) = logits.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(dev, "argmax_rows", per_row_cfg(rows), lp, vocab, op)
}

/// HF repetition penalty on `logits` `[rows, vocab]` for each pair `i`: row `rows_of[i]`, token `tokens[i]`:
/// `l = l > 0 ? l / p : l · p` with `p = penalty[row]` (`penalty` `[rows]`). The pairs must be distinct (a repeated
/// pair would be penalised twice, racing); a pair outside the logits is skipped.
pub fn repetition_penalty(
    dev: &CudaDevice,
    logits: &mut impl DevicePtrMut<f32>,
    vocab: usize,
    rows_of: &impl DevicePtr<i32>,
    tokens: &impl DevicePtr<i32>,
    penalty: &impl DevicePtr<f32>,
) -> Result<()> {
    const OP: &str = "repetition_penalty";
    let rows = penalty.len();
    check_len(OP, "logits", logits.len(), rows * vocab)?;
    check_len(OP, "tokens", tokens.len(), rows_of.len())?;
    ensure(OP, vocab <= i32::MAX as usize && rows <= i32::MAX as usize, || {
        format!("[{rows}, {vocab}] exceeds i32")
    })?;
    fits_u32(OP, "pairs", tokens.len())?;
    if tokens.is_empty() || rows == 0 {
        return Ok(());
    }
    let (rows_i, vocab_i, n_i) = (rows as i32, vocab as i32, tokens.len() as i32);
    let cfg = grid_1d(tokens.len());
    let (lp, _gl) = logits.device_ptr_mut(dev.stream());
    let (rp, _gr) = rows_of.device_ptr(dev.stream());
    let (tp, _gt) = tokens.device_ptr(dev.stream());
    let (pp, _gp) = penalty.device_ptr(dev.stream());
    launch!(dev, "repetition_penalty", cfg, lp, rows_i, vocab_i, rp, tp, n_i, pp)
}

/// Additive logit bias on `logits` `[rows, vocab]` for each pair `i`: row `rows_of[i]`, token `tokens[i]`:
/// `l += bias[i]` (CPU twin `rewind_engine::sample::apply_logit_bias`). The pairs must be distinct (a repeated pair
/// would race); a pair outside the logits is skipped.
pub fn logit_bias(
    dev: &CudaDevice,
    logits: &mut impl DevicePtrMut<f32>,
    rows: usize,
    vocab: usize,
    rows_of: &impl DevicePtr<i32>,
    tokens: &impl DevicePtr<i32>,
    bias: &impl DevicePtr<f32>,
) -> Result<()> {
    const OP: &str = "logit_bias";
    check_len(OP, "logits", logits.len(), rows * vocab)?;
    check_len(OP, "tokens", tokens.len(), rows_of.len())?;
    check_len(OP, "bias", bias.len(), rows_of.len())?;
    ensure(OP, vocab <= i32::MAX as usize && rows <= i32::MAX as usize, || {
        format!("[{rows}, {vocab}] exceeds i32")
    })?;
    fits_u32(OP, "pairs", tokens.len())?;
    if tokens.is_empty() || rows == 0 {
        return Ok(());
    }
    let (rows_i, vocab_i, n_i) = (rows as i32, vocab as i32, tokens.len() as i32);
    let cfg = grid_1d(tokens.len());
    let (lp, _gl) = logits.device_ptr_mut(dev.stream());
    let (rp, _gr) = rows_of.device_ptr(dev.stream());
    let (tp, _gt) = tokens.device_ptr(dev.stream());
    let (bp, _gb) = bias.device_ptr(dev.stream());
    launch!(dev, "logit_bias", cfg, lp, rows_i, vocab_i, rp, tp, n_i, bp)
}

/// The token mask of constrained rows on `logits` `[rows, vocab]`: row `r` with `mask_row[r] >= 0` reads mask row
/// `mask_row[r]` of `masks` `[n, mask_words]` (one bit a token id, LSB first in each word; ids past the words are
/// clear) and every logit whose bit is clear becomes `f32::MIN`; a row with `mask_row[r] < 0` is left as it is (CPU
/// twin [`crate::cpu::sample::apply_token_mask`]). Applied after [`logit_bias`], before [`sample_rows`].
pub fn token_mask(
    dev: &CudaDevice,
    logits: &mut impl DevicePtrMut<f32>,
    rows: usize,
    vocab: usize,
    masks: &impl DevicePtr<u32>,
    mask_words: usize,
    mask_row: &impl DevicePtr<i32>,
) -> Result<()> {
    const OP: &str = "token_mask";
    check_len(OP, "logits", logits.len(), rows * vocab)?;
    check_len(OP, "mask_row", mask_row.len(), rows)?;
    ensure(OP, mask_words > 0 && masks.len() % mask_words == 0, || {
        format!("{} mask words are not whole rows of {mask_words}", masks.len())
    })?;
    ensure(
        OP,
        vocab <= i32::MAX as usize && rows <= i32::MAX as usize && mask_words <= i32::MAX as usize,
        || format!("[{rows}, {vocab}] or {mask_words} words exceed i32"),
    )?;
    if rows == 0 || vocab == 0 {
        return Ok(());
    }
    let (rows_i, vocab_i, words_i) = (rows as i32, vocab as i32, mask_words as i32);
    let cfg = grid_1d(rows * vocab);
    let (lp, _gl) = logits.device_ptr_mut(dev.stream());
    let (mp, _gm) = masks.device_ptr(dev.stream());
    let (rp, _gr) = mask_row.device_ptr(dev.stream());
    launch!(dev, "token_mask", cfg, lp, rows_i, vocab_i, mp, words_i, rp)
}

/// Samples one id per row of `logits` `[rows, vocab]` with `params` `[rows, 4]` = (temperature, top_k as f32 (0 =
/// off), top_p (1 = off), min_p (0 = off)) and `uniforms` `[rows]` in `[0, 1)`; a temperature ≤ 0 is greedy
/// ([`argmax_rows`]). The filters and tie rules are the CPU Sampler's (see [`crate::cpu::sample::sample_row`]); the
/// draw is the first kept id, in ascending id order, whose cumulative weight exceeds `u · total`. A row holding a
/// non-finite logit gives −1 (the CPU Sampler refuses it). No sorting: the top-k / top-p cut-offs are found by
/// bisection over the logits' 32-bit order keys, about 32 passes over the row each.
pub fn sample_rows(
    dev: &CudaDevice,
    logits: &impl DevicePtr<f32>,
    rows: usize,
    vocab: usize,
    params: &impl DevicePtr<f32>,
    uniforms: &impl DevicePtr<f32>,
    out: &mut impl DevicePtrMut<i32>,
) -> Result<()> {
    const OP: &str = "sample_rows";
    check_len(OP, "logits", logits.len(), rows * vocab)?;
    check_len(OP, "params", params.len(), rows * 4)?;
    check_len(OP, "uniforms", uniforms.len(), rows)?;
    check_len(OP, "out", out.len(), rows)?;
    if rows == 0 {
        return Ok(());
    }
    let vocab_i = check_rows(OP, logits.len(), rows)? as i32;
    let (lp, _gl) = logits.device_ptr(dev.stream());
    let (pp, _gp) = params.device_ptr(dev.stream());
    let (up, _gu) = uniforms.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(dev, "sample_rows", per_row_cfg(rows), lp, vocab_i, pp, up, op)
}

/// One link of a chain of decode steps (CPU twin [`crate::cpu::sample::chain_pick`]): per row of this rank's
/// `local` summaries (`[rows, words]`) writes the next step's input token into `tokens` — `sampled[r]` when
/// `from_sampled`, else the argmax over the ranks' summaries `gathered` (`[world, rows, words]`, rank order; pass
/// `local` with `world` 1); an id outside `0 .. vocab` becomes 0 — and copies the row's local summary into
/// `log_words` and its sampled id (−1 when `from_sampled` is false) into `log_ids`. Device work only, so a chain of
/// steps runs with no host round trip.
#[allow(clippy::too_many_arguments)]
pub fn chain_pick(
    dev: &CudaDevice,
    local: &impl DevicePtr<u32>,
    gathered: &impl DevicePtr<u32>,
    world: usize,
    words: usize,
    sampled: &impl DevicePtr<i32>,
    from_sampled: bool,
    vocab: usize,
    tokens: &mut impl DevicePtrMut<i32>,
    log_words: &mut impl DevicePtrMut<u32>,
    log_ids: &mut impl DevicePtrMut<i32>,
) -> Result<()> {
    const OP: &str = "chain_pick";
    let rows = tokens.len();
    ensure(OP, (2..=64).contains(&words), || format!("{words} summary words"))?;
    ensure(OP, (1..=64).contains(&world), || format!("{world} ranks"))?;
    check_len(OP, "local", local.len(), rows * words)?;
    check_len(OP, "gathered", gathered.len(), world * rows * words)?;
    check_len(OP, "sampled", sampled.len(), rows)?;
    check_len(OP, "log_words", log_words.len(), rows * words)?;
    check_len(OP, "log_ids", log_ids.len(), rows)?;
    ensure(OP, (1..=i32::MAX as usize).contains(&vocab), || {
        format!("vocabulary {vocab}")
    })?;
    fits_u32(OP, "rows", rows)?;
    if rows == 0 {
        return Ok(());
    }
    let (world_i, words_i, from_i, rows_i, vocab_i) = (
        world as i32,
        words as i32,
        from_sampled as i32,
        rows as i32,
        vocab as i32,
    );
    let (lp, _gl) = local.device_ptr(dev.stream());
    let (gp, _gg) = gathered.device_ptr(dev.stream());
    let (ip, _gi) = sampled.device_ptr(dev.stream());
    let (tp, _gt) = tokens.device_ptr_mut(dev.stream());
    let (lw, _gw) = log_words.device_ptr_mut(dev.stream());
    let (li, _gd) = log_ids.device_ptr_mut(dev.stream());
    launch!(
        dev,
        "chain_pick",
        grid_1d(rows),
        lp,
        gp,
        world_i,
        words_i,
        ip,
        from_i,
        rows_i,
        vocab_i,
        tp,
        lw,
        li
    )
}
