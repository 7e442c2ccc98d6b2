//! `rewind logits`: per-position logits, prefill for the first N tokens and decode (or teacher-forced speculative
//! verify steps) for the rest, in the chosen decode form, on any backend (`--device`, `--tp`); with
//! `--reference-form`, the differences from a plain run in another form instead (the GPU's end-to-end check that every
//! form and the verify path compute what recurrent decoding computes).

use std::io::Write;

use anyhow::{bail, Context, Result};
use rewind_engine::decode::FormChoice;
use rewind_engine::rank::{GroupSequence, RankGroup, Rows, SeqKind, StepResult};
use serde::Serialize;

use super::backend::{self, Needs};
use crate::cli::LogitsArgs;
use crate::output::errln;

/// Teacher-forced verify steps: the window and the per-draft rejection probability, drawn from `seed`.
#[derive(Clone, Copy, Debug)]
struct Verify {
    window: usize,
    reject: f64,
    seed: u64,
}

/// What a teacher-forced run computed.
struct Run {
    rows: Vec<Vec<f32>>,
    verify_steps: usize,
    drafts_kept: usize,
}

/// One uniform draw in [0, 1) per (seed, index) (splitmix64), so a rejection pattern is reproducible.
fn uniform(seed: u64, index: u64) -> f64 {
    let mut z = seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Runs `tokens` through one sequence in `form`: the first `prefill` in one pass, the rest one decode each, or with
/// `verify` in verify steps that keep their tokens up to the first rejected draft. Returns every position's logits.
fn forced(
    group: &mut RankGroup,
    form: FormChoice,
    tokens: &[u32],
    prefill: usize,
    verify: Option<Verify>,
    vocab: usize,
) -> Result<Run> {
    let mut seq = GroupSequence::open(group, form, tokens.len())?;
    let mut run = Run {
        rows: Vec::with_capacity(tokens.len()),
        verify_steps: 0,
        drafts_kept: 0,
    };
    let rows_of = |out: StepResult, keep: usize, into: &mut Vec<Vec<f32>>| -> Result<()> {
        let l = out.logits.context("the step returned no logits")?;
        into.extend(l.chunks_exact(vocab).take(keep).map(<[f32]>::to_vec));
        Ok(())
    };
    if prefill > 0 {
        rows_of(
            seq.run(SeqKind::Prefill, &tokens[..prefill], Rows::All, true)?,
            prefill,
            &mut run.rows,
        )?;
    }
    let mut i = prefill;
    while i < tokens.len() {
        let Some(v) = verify else {
            rows_of(
                seq.run(SeqKind::Decode, &tokens[i..=i], Rows::Last, true)?,
                1,
                &mut run.rows,
            )?;
            i += 1;
            continue;
        };
        let chunk = &tokens[i..(i + 1 + v.window).min(tokens.len())];
        if chunk.len() == 1 {
            rows_of(seq.run(SeqKind::Decode, chunk, Rows::Last, true)?, 1, &mut run.rows)?;
            i += 1;
            continue;
        }
        let out = seq.run(SeqKind::Verify, chunk, Rows::All, true)?;
        let accepted = (1..chunk.len())
            .take_while(|&d| uniform(v.seed, (i + d) as u64) >= v.reject)
            .count();
        rows_of(out, 1 + accepted, &mut run.rows)?;
        seq.commit(chunk.len(), 1 + accepted)?;
        run.verify_steps += 1;
        run.drafts_kept += accepted;
        i += 1 + accepted;
    }
    Ok(run)
}

/// How a run's logits differ from the reference run's.
#[derive(Serialize)]
struct Comparison {
    form: String,
    reference_form: String,
    verify_window: Option<usize>,
    verify_reject: f64,
    verify_steps: usize,
    drafts_kept: usize,
    positions: usize,
    max_abs_diff: f64,
    /// The largest difference over the row's largest |logit| (of the reference).
    max_rel_diff: f64,
    worst_position: usize,
    argmax_agree: usize,
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) },
        )
        .0
}

fn compare(run: &Run, reference: &[Vec<f32>]) -> (f64, f64, usize, usize) {
    let (mut max_abs, mut max_rel, mut worst, mut agree) = (0.0f64, 0.0f64, 0, 0);
    for (p, (a, b)) in run.rows.iter().zip(reference).enumerate() {
        let scale = b.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs())).max(1e-30);
        let d = a
            .iter()
            .zip(b)
            .fold(0.0f64, |m, (&x, &y)| m.max((f64::from(x) - f64::from(y)).abs()));
        max_abs = max_abs.max(d);
        if d / scale > max_rel {
            (max_rel, worst) = (d / scale, p);
        }
        agree += usize::from(argmax(a) == argmax(b));
    }
    (max_abs, max_rel, worst, agree)
}

pub fn run(args: LogitsArgs) -> Result<()> {
    // Bad device values are errors; GPU-only flags on the CPU get a note.
    args.device.check()?;
    if args.prefill > args.tokens.len() {
        bail!(
            "--prefill {} exceeds the number of tokens ({})",
            args.prefill,
            args.tokens.len()
        );
    }
    let verify = match args.verify_window {
        None => None,
        Some(0) => bail!("--verify-window must be at least 1 (drafts per verify step)"),
        Some(_) if args.prefill == 0 => {
            bail!("--verify-window needs --prefill of at least 1 (a verify continues a state)")
        }
        Some(window) => {
            if !(0.0..=1.0).contains(&args.verify_reject) {
                bail!(
                    "--verify-reject must be a probability in [0, 1], got {}",
                    args.verify_reject
                );
            }
            Some(Verify {
                window,
                reject: args.verify_reject,
                seed: args.seed,
            })
        }
    };
    let needs = Needs {
        mtp: false,
        time_mtp: false,
        slots: if args.reference_form.is_some() { 2 } else { 1 },
        context: args.tokens.len(),
        verify: 1 + args.verify_window.unwrap_or(0),
        prefix_store: 0,
    };
    let dir = super::generate::model_dir(&args.model)?;
    let mut loaded = backend::open(&dir, &args.device, Some(&args.decode), needs)?;
    let vocab = loaded.config.vocab_size;
    // Checked as a whole here: the steps see one token (or one window) at a time and would name its index in that.
    if let Some((i, t)) = args.tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        bail!("--tokens: token id {t} at position {i} is out of range (vocab size {vocab})");
    }
    let form = loaded.form;
    let run = forced(&mut loaded.group, form, &args.tokens, args.prefill, verify, vocab)?;
    let json = match args.reference_form {
        None => serde_json::json!({ "tokens": args.tokens, "logits": run.rows }),
        Some(reference_form) => {
            let reference = forced(
                &mut loaded.group,
                reference_form,
                &args.tokens,
                args.prefill,
                None,
                vocab,
            )?;
            let (max_abs_diff, max_rel_diff, worst_position, argmax_agree) = compare(&run, &reference.rows);
            let c = Comparison {
                form: form.to_string(),
                reference_form: reference_form.to_string(),
                verify_window: args.verify_window,
                verify_reject: args.verify_reject,
                verify_steps: run.verify_steps,
                drafts_kept: run.drafts_kept,
                positions: run.rows.len(),
                max_abs_diff,
                max_rel_diff,
                worst_position,
                argmax_agree,
            };
            errln!(
                "[{} vs {}: max |diff| {:.3e}, max rel {:.3e} at position {}, argmax agrees at {}/{} positions; {} \
                 verify steps kept {} drafts]",
                c.form,
                c.reference_form,
                c.max_abs_diff,
                c.max_rel_diff,
                c.worst_position,
                c.argmax_agree,
                c.positions,
                c.verify_steps,
                c.drafts_kept
            );
            serde_json::to_value(&c)?
        }
    };
    let file = std::fs::File::create(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    // A write can fail inside serde_json (when the buffer fills) or at the final flush (a full disk): both name the
    // file.
    let write = || -> Result<()> {
        let mut w = std::io::BufWriter::new(file);
        serde_json::to_writer(&mut w, &json)?;
        w.flush()?;
        Ok(())
    };
    write().with_context(|| format!("writing {}", args.out.display()))
}

#[cfg(test)]
mod tests {
    use super::uniform;

    #[test]
    fn draws_are_uniform_and_reproducible() {
        let draws: Vec<f64> = (0..10_000).map(|i| uniform(7, i)).collect();
        assert!(draws.iter().all(|u| (0.0..1.0).contains(u)));
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
        assert_eq!(uniform(7, 3), uniform(7, 3));
        assert_ne!(uniform(7, 3), uniform(8, 3));
    }
}
