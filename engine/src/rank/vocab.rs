//! Merging the ranks' vocabulary slices: the one place where per-rank LM-head outputs become whole-vocabulary
//! answers. Ranks hold contiguous, ascending id ranges ([`crate::shard::even_split`] of the vocabulary); a row's
//! answer is the [`RowPass`] merge of the ranks' passes, which breaks ties to the lowest id whatever the split.
//!
//! - [`summarise_row`]: one rank's [`RowSummary`] of one row of its slice (what a CPU rank reports);
//! - [`merge_rows`]: the ranks' summaries of one row into the whole vocabulary's [`RowPass`];
//! - [`join_slices`]: the ranks' `[rows, slice]` logits into `[rows, vocab]`.

use std::ops::Range;

use rewind_kernels::cpu::lm_head::{summarise_logits, RowPass};

use super::plan::{RowSummary, StepOut};
use crate::error::{EngineError, Result};

/// Summarises one row of a rank's slice, whose first id is `first_id`. A NaN anywhere gives a NaN max.
pub fn summarise_row(row: &[f32], first_id: usize) -> RowSummary {
    RowSummary::from(summarise_logits(row, first_id as u32, None))
}

/// Merges the ranks' summaries of one row (in rank order) into the whole vocabulary's. A NaN from any rank gives a
/// NaN max; a speculative summary is the merge of the ranks' that computed one.
pub fn merge_rows(parts: &[RowSummary]) -> Result<RowPass> {
    parts
        .iter()
        .map(|p| p.pass)
        .reduce(RowPass::merge)
        .ok_or_else(|| EngineError::InvalidInput("no rank summarised the row".into()))
}

/// Joins the ranks' `[rows, slice]` logits (slices `ranges`, in rank order, covering `0..vocab`) into
/// `[rows, vocab]`.
pub fn join_slices(parts: &[&[f32]], ranges: &[Range<usize>], rows: usize, vocab: usize) -> Result<Vec<f32>> {
    if parts.len() != ranges.len() {
        return Err(EngineError::InvalidInput(format!(
            "{} logit slices for {} vocabulary ranges",
            parts.len(),
            ranges.len()
        )));
    }
    let mut covered = 0;
    for r in ranges {
        if r.start != covered {
            return Err(EngineError::InvalidInput(format!(
                "vocabulary slices are not contiguous: {r:?} after {covered}"
            )));
        }
        covered = r.end;
    }
    if covered != vocab {
        return Err(EngineError::InvalidInput(format!(
            "vocabulary slices cover {covered} ids, the model has {vocab}"
        )));
    }
    let mut out = vec![0.0f32; rows * vocab];
    for (part, range) in parts.iter().zip(ranges) {
        let w = range.len();
        if part.len() != rows * w {
            return Err(EngineError::InvalidInput(format!(
                "a rank returned {} logits for {rows} rows of its {w}-id slice",
                part.len()
            )));
        }
        for (r, src) in part.chunks_exact(w.max(1)).enumerate().take(rows) {
            out[r * vocab + range.start..r * vocab + range.end].copy_from_slice(&src[..w]);
        }
    }
    Ok(out)
}

/// The whole-vocabulary answer to one step: per reported row its summary (and sampled token), and the joined logits
/// when the plan asked for them.
#[derive(Clone, Debug, PartialEq)]
pub struct MergedStep {
    pub rows: Vec<RowPass>,
    /// Per row, the token the ranks sampled (every rank samples alike).
    pub sampled: Vec<Option<u32>>,
    /// `[rows, vocab]`.
    pub logits: Option<Vec<f32>>,
    /// `[rows, hidden]` final hidden states (rank 0's: every rank holds the same), when the plan asked for them.
    pub hidden: Option<Vec<f32>>,
}

/// Merges every rank's [`StepOut`] (in rank order) for a model of `vocab` ids.
pub fn merge_step(outs: &[StepOut], vocab: usize) -> Result<MergedStep> {
    let Some(first) = outs.first() else {
        return Err(EngineError::InvalidInput("no rank answered the step".into()));
    };
    let rows = first.rows.len();
    if let Some(o) = outs.iter().find(|o| o.rows.len() != rows) {
        return Err(EngineError::InvalidInput(format!(
            "ranks disagree on the step's rows ({} and {rows})",
            o.rows.len()
        )));
    }
    let merged = (0..rows)
        .map(|r| merge_rows(&outs.iter().map(|o| o.rows[r]).collect::<Vec<_>>()))
        .collect::<Result<Vec<_>>>()?;
    // Every rank samples a sampled row alike (a tensor-parallel one from the row it joins): a difference means the
    // ranks saw different rows or draws.
    let sampled = (0..rows)
        .map(|r| {
            let first = first.rows[r].sampled;
            match outs.iter().position(|o| o.rows[r].sampled != first) {
                Some(k) => Err(EngineError::Communicator(format!(
                    "ranks 0 and {k} sampled row {r} differently ({first:?} and {:?})",
                    outs[k].rows[r].sampled
                ))),
                None => Ok(first),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let logits = match outs
        .iter()
        .map(|o| o.logits.as_deref())
        .collect::<Option<Vec<&[f32]>>>()
    {
        Some(parts) => {
            let ranges: Vec<Range<usize>> = outs.iter().map(|o| o.vocab.clone()).collect();
            Some(join_slices(&parts, &ranges, rows, vocab)?)
        }
        None => None,
    };
    Ok(MergedStep {
        rows: merged,
        sampled,
        logits,
        hidden: first.hidden.clone(),
    })
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::shard::even_split;

    fn whole(row: &[f32]) -> (u32, f32, f32) {
        let s = summarise_row(row, 0);
        (s.pass.argmax, s.pass.max, s.pass.lse)
    }

    #[test]
    fn merged_slices_equal_the_whole_row_for_every_split() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let vocab = 37;
        let rows = 3;
        let mut logits: Vec<f32> = (0..rows * vocab).map(|_| rng.random_range(-4.0..4.0)).collect();
        // A tie across a slice boundary: the lowest id must win.
        logits[5] = 9.0;
        logits[30] = 9.0;
        for tp in 1..=5 {
            let ranges: Vec<Range<usize>> = (0..tp).map(|r| even_split(vocab, tp, r)).collect();
            let outs: Vec<StepOut> = ranges
                .iter()
                .map(|r| {
                    let slice: Vec<f32> = logits
                        .chunks_exact(vocab)
                        .flat_map(|row| row[r.clone()].to_vec())
                        .collect();
                    StepOut {
                        vocab: r.clone(),
                        rows: slice
                            .chunks_exact(r.len())
                            .map(|row| summarise_row(row, r.start))
                            .collect(),
                        logits: Some(slice),
                        hidden: None,
                        chain: None,
                        mtp: Vec::new(),
                    }
                })
                .collect();
            let merged = merge_step(&outs, vocab).expect("merge");
            assert_eq!(merged.logits.as_deref(), Some(&logits[..]), "tp {tp}: joined logits");
            for (r, row) in logits.chunks_exact(vocab).enumerate() {
                let (arg, max, lse) = whole(row);
                let m = merged.rows[r];
                assert_eq!((m.argmax, m.max), (arg, max), "tp {tp} row {r}");
                let got = m.lse;
                assert!((got - lse).abs() < 1e-5, "tp {tp} row {r}: {got} vs {lse}");
            }
            assert_eq!(merged.rows[0].argmax, 5, "ties go to the lowest id");
        }
    }

    #[test]
    fn nan_poisons_the_row_and_bad_shapes_are_errors() {
        let row = [1.0, f32::NAN, 0.5];
        assert!(summarise_row(&row, 0).pass.max.is_nan());
        let a = summarise_row(&[1.0, 2.0], 0);
        let b = summarise_row(&[f32::NAN, 0.0], 2);
        assert!(merge_rows(&[a, b]).expect("merge").poisoned());
        assert!(merge_rows(&[]).is_err(), "no rank");
        let whole: [Range<usize>; 1] = [Range { start: 0, end: 3 }];
        assert!(join_slices(&[&[0.0; 4]], &whole, 2, 3).is_err(), "wrong length");
        assert!(
            join_slices(&[&[0.0; 2], &[0.0; 2]], &[0..1, 2..3], 2, 3).is_err(),
            "gap"
        );
        let short: [Range<usize>; 1] = [Range { start: 0, end: 1 }];
        assert!(join_slices(&[&[0.0; 2]], &short, 2, 3).is_err(), "short");
    }

    /// Every rank samples a sampled row itself (from the row it joins): the merged step carries their common id, and
    /// ranks that drew differently fail the step.
    #[test]
    fn ranks_must_sample_alike() {
        let out = |vocab: Range<usize>, sampled: Option<u32>| StepOut {
            rows: vec![RowSummary {
                sampled,
                ..summarise_row(&[0.5, 1.5], vocab.start)
            }],
            vocab,
            logits: None,
            hidden: None,
            chain: None,
            mtp: Vec::new(),
        };
        let agreed = merge_step(&[out(0..2, Some(3)), out(2..4, Some(3))], 4).expect("same draw");
        assert_eq!(agreed.sampled, vec![Some(3)]);
        let greedy = merge_step(&[out(0..2, None), out(2..4, None)], 4).expect("no draw");
        assert_eq!(greedy.sampled, vec![None]);
        for (a, b) in [(Some(3), Some(2)), (Some(3), None), (None, Some(1))] {
            match merge_step(&[out(0..2, a), out(2..4, b)], 4) {
                Err(EngineError::Communicator(m)) => assert!(m.contains("sampled row 0 differently"), "{m}"),
                other => panic!("{a:?} / {b:?}: {other:?}"),
            }
        }
    }
}
