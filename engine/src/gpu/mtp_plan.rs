//! The host half of the MTP layer's work on a GPU rank (`gpu/mtp.rs`): which launches run the jobs' rows
//! ([`plan_catch_up`]), what each launch uploads and copies ([`CatchUp::inputs`]), and the layer's block table
//! ([`mtp_table`]), and the draft loop's metadata ([`draft_meta`]). Pure functions of the jobs and the books, so the
//! device indexing they feed is tested here.

use rewind_kernels::cuda::ops::PagedKv;

use crate::error::{EngineError, Result};
use crate::rank::mtp::{MtpJob, MtpRow};
use crate::state::kv::{KvBlocks, NO_BLOCK};

/// One launch of the layer over target rows: per job, the job (its index) and the range of its rows.
pub(super) struct CatchUp {
    pub(super) parts: Vec<(usize, std::ops::Range<usize>)>,
}

impl CatchUp {
    /// Rows per job (equal for every job of a launch).
    pub(super) fn t(&self) -> usize {
        self.parts.first().map_or(0, |(_, r)| r.len())
    }

    /// What the launch uploads and copies, job `k` of the launch taking rows `k · t ..`: its rows from the step's
    /// rows (each slot's from `first_row[slot]`) and from the slots' saved rows (`keep` a slot, of positions from
    /// `saved_at(slot)`), the tokens after them, each row's slot and KV index, the slots and their KV lengths; and
    /// where the last output of each drafting job (`order`) whose rows end in this launch goes among the drafts'
    /// inputs.
    pub(super) fn inputs(
        &self,
        jobs: &[MtpJob],
        order: &[usize],
        first_row: &[Option<usize>],
        saved_at: impl Fn(usize) -> usize,
        keep: usize,
    ) -> Result<LaunchInputs> {
        let t = self.t();
        let mut x = LaunchInputs::default();
        for (k, (i, range)) in self.parts.iter().enumerate() {
            let job = &jobs[*i];
            let first = first_row.get(job.slot).copied().flatten().ok_or_else(|| {
                EngineError::InvalidInput(format!(
                    "slot {}: an MTP job of a sequence the step did not run",
                    job.slot
                ))
            })?;
            for (row, q) in range.clone().enumerate() {
                let dst = (k * t + row) as i32;
                match job.rows[q] {
                    MtpRow::Step(i) => x.from_step.extend([(first + i) as i32, dst]),
                    MtpRow::Saved(p) => {
                        let at = p.checked_sub(saved_at(job.slot)).filter(|&a| a < keep).ok_or_else(|| {
                            EngineError::InvalidInput(format!(
                                "slot {}: the MTP row of position {p} was not saved",
                                job.slot
                            ))
                        })?;
                        x.from_saved.extend([(job.slot * keep + at) as i32, dst]);
                    }
                }
                x.tokens.push(job.tokens[q] as i32);
                x.row_slots.push(job.slot as i32);
                x.row_pos.push((job.kv_index + q) as i32);
            }
            x.seq_slots.push(job.slot as i32);
            x.lens.push((job.slot, job.kv_index + range.end));
            if let Some(d) = order
                .iter()
                .position(|o| o == i)
                .filter(|_| range.end == job.rows.len())
            {
                x.last.extend([(k * t + t - 1) as i32, d as i32]);
            }
        }
        Ok(x)
    }
}

/// A catch-up launch's inputs ([`CatchUp::inputs`]): `(source, destination)` row pairs, per row the token after it,
/// its slot and KV index, per job its slot and `(slot, KV length)`.
#[derive(Debug, Default, PartialEq)]
pub(super) struct LaunchInputs {
    pub(super) from_step: Vec<i32>,
    pub(super) from_saved: Vec<i32>,
    pub(super) tokens: Vec<i32>,
    pub(super) row_slots: Vec<i32>,
    pub(super) row_pos: Vec<i32>,
    pub(super) seq_slots: Vec<i32>,
    pub(super) lens: Vec<(usize, usize)>,
    /// `(launch row, draft index)` pairs of the drafting jobs' last outputs.
    pub(super) last: Vec<i32>,
}

impl LaunchInputs {
    /// The launch's row pairs as one upload of fixed shape for `rows` rows of `seqs` jobs: the saved rows' pairs,
    /// then the step rows', `rows` pairs each, then the last outputs', `seqs` pairs; each part padded with
    /// `(-1, -1)`, which `copy_rows` skips. So every launch of one shape copies with the same launches (a captured
    /// graph's), whichever of its rows are repairs.
    pub(super) fn pair_words(&self, rows: usize, seqs: usize) -> Result<Vec<i32>> {
        let mut words = Vec::with_capacity(2 * (2 * rows + seqs));
        for (part, room, what) in [
            (&self.from_saved, rows, "saved rows"),
            (&self.from_step, rows, "step rows"),
            (&self.last, seqs, "last outputs"),
        ] {
            if part.len() > 2 * room {
                return Err(EngineError::InvalidInput(format!(
                    "an MTP catch-up launch of {rows} rows and {seqs} jobs copies {} {what}, more than its {room}",
                    part.len() / 2
                )));
            }
            words.extend_from_slice(part);
            words.resize(words.len() + 2 * room - part.len(), -1);
        }
        Ok(words)
    }
}

/// Words per slot of one draft step's metadata in [`draft_meta`]: its slot, its KV index and the slot's KV length.
pub(crate) const META_WORDS: usize = 3;

/// The draft loop's metadata, uploaded once before it: for each draft step `d` whose picks run through the layer
/// (every step but the last), `META_WORDS · max_seqs` words: the continuing jobs' slots (in drafting order `order`),
/// their KV indices (after their rows and the `d` drafts before), each slot's KV length (0 for the others).
pub(super) fn draft_meta(jobs: &[MtpJob], order: &[usize], max_seqs: usize) -> Result<Vec<i32>> {
    let steps = order.first().map_or(0, |&i| jobs[i].drafts);
    let mut meta = vec![0i32; steps.saturating_sub(1) * META_WORDS * max_seqs];
    for (d, row) in meta.chunks_exact_mut(META_WORDS * max_seqs).enumerate() {
        let (slots, rest) = row.split_at_mut(max_seqs);
        let (pos, lens) = rest.split_at_mut(max_seqs);
        for (k, &i) in order.iter().take_while(|&&i| jobs[i].drafts > d + 1).enumerate() {
            let job = &jobs[i];
            if job.slot >= max_seqs {
                return Err(EngineError::InvalidInput(format!(
                    "an MTP job of slot {}, past the rank's {max_seqs} slots",
                    job.slot
                )));
            }
            let at = job.kv_index + job.rows.len() + d;
            slots[k] = job.slot as i32;
            pos[k] = at as i32;
            lens[job.slot] = (at + 1) as i32;
        }
    }
    Ok(meta)
}

/// The catch-up launches of `jobs`: jobs of at most `batched` rows grouped by their row count, up to `max_seqs` jobs
/// and `max_rows` rows a launch; longer ones (prompt chunks) alone, in pieces of `piece` rows, in order.
pub(super) fn plan_catch_up(
    jobs: &[MtpJob],
    batched: usize,
    max_seqs: usize,
    max_rows: usize,
    piece: usize,
) -> Vec<CatchUp> {
    let mut launches = Vec::new();
    let mut counts: Vec<usize> = jobs
        .iter()
        .map(|j| j.rows.len())
        .filter(|&r| (1..=batched).contains(&r))
        .collect();
    counts.sort_unstable();
    counts.dedup();
    for r in counts {
        let per = max_seqs.min(max_rows / r).max(1);
        let group: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].rows.len() == r).collect();
        for chunk in group.chunks(per) {
            launches.push(CatchUp {
                parts: chunk.iter().map(|&i| (i, 0..r)).collect(),
            });
        }
    }
    for (i, j) in jobs.iter().enumerate().filter(|(_, j)| j.rows.len() > batched) {
        let n = j.rows.len();
        for lo in (0..n).step_by(piece.max(1)) {
            launches.push(CatchUp {
                parts: vec![(i, lo..(lo + piece).min(n))],
            });
        }
    }
    launches
}

/// The MTP layer's block table (`layout`: `GpuMtpLayer::kv_layout`): each slot's row holds the target's blocks
/// (`kv`'s table), then the slot's own blocks, which follow the target's in the layer's pool.
pub(super) fn mtp_table(kv: &KvBlocks, layout: PagedKv) -> Result<Vec<i32>> {
    let per = kv.blocks_per_slot();
    let extra = layout.blocks_per_slot.checked_sub(per).ok_or_else(|| {
        EngineError::Gpu(format!(
            "the MTP layer's table rows of {} blocks are narrower than the target's {per}",
            layout.blocks_per_slot
        ))
    })?;
    let shared = kv.total();
    if kv.tables().len() != layout.num_slots * per || layout.num_blocks != shared + layout.num_slots * extra {
        return Err(EngineError::Gpu(format!(
            "the MTP layer's KV layout {layout:?} does not extend the target's {} blocks of {} slots",
            shared,
            kv.tables().len() / per.max(1)
        )));
    }
    let mut table = vec![-1i32; layout.num_slots * layout.blocks_per_slot];
    for (slot, row) in table.chunks_exact_mut(layout.blocks_per_slot).enumerate() {
        let held = kv.held(slot);
        for (t, &b) in row.iter_mut().zip(kv.table(slot)) {
            *t = if b == NO_BLOCK { -1 } else { b as i32 };
        }
        for (j, t) in row[held..held + extra].iter_mut().enumerate() {
            *t = (shared + slot * extra + j) as i32;
        }
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(slot: usize, rows: usize) -> MtpJob {
        MtpJob {
            slot,
            kv_index: 0,
            rows: (0..rows).map(MtpRow::Step).collect(),
            tokens: vec![0; rows],
            drafts: 0,
            save: (0, 0..1),
            next: None,
        }
    }

    #[test]
    fn catch_up_groups_equal_counts_and_cuts_long_jobs_in_order() {
        let jobs = vec![job(0, 2), job(1, 1), job(2, 2), job(3, 11), job(4, 0), job(5, 2)];
        let launches = plan_catch_up(&jobs, 3, 2, 5, 4);
        let got: Vec<Vec<(usize, std::ops::Range<usize>)>> = launches.into_iter().map(|l| l.parts).collect();
        assert_eq!(
            got,
            vec![
                vec![(1, 0..1)],
                // At most two jobs a launch.
                vec![(0, 0..2), (2, 0..2)],
                vec![(5, 0..2)],
                // A long job alone, in pieces of four rows, in order; a job of no rows runs nothing.
                vec![(3, 0..4)],
                vec![(3, 4..8)],
                vec![(3, 8..11)],
            ]
        );
        // The rows of a launch bound its jobs too.
        let tight = plan_catch_up(&[job(0, 3), job(1, 3), job(2, 3)], 3, 8, 7, 4);
        assert_eq!(tight.iter().map(|l| l.parts.len()).collect::<Vec<_>>(), vec![2, 1]);
    }

    /// A repaired row comes from the slot's saved rows, the others from the step's; tokens, KV indices and lengths
    /// follow each job's, and only a drafting job whose rows end in the launch hands its last output on.
    #[test]
    fn a_launch_gathers_saved_and_step_rows_at_the_jobs_kv_indices() {
        // Slot 2 repairs position 9 (saved rows of positions 8.. in its place 2 · keep ..), then runs its step's rows
        // 0 and 1 (the step's rows of slot 2 start at row 5 of the kept rows); slot 0 runs rows 0..3 of its step.
        let repaired = MtpJob {
            slot: 2,
            kv_index: 4,
            rows: vec![MtpRow::Saved(9), MtpRow::Step(0), MtpRow::Step(1)],
            tokens: vec![70, 71, 72],
            drafts: 2,
            save: (10, 0..2),
            next: Some((12, 72)),
        };
        let plain = MtpJob {
            slot: 0,
            kv_index: 7,
            tokens: vec![80, 81, 82],
            drafts: 1,
            ..job(0, 3)
        };
        let jobs = vec![plain, repaired];
        let mut first_row = vec![None; 4];
        first_row[0] = Some(0);
        first_row[2] = Some(5);
        let keep = 4;
        let launch = CatchUp {
            parts: vec![(0, 0..3), (1, 0..3)],
        };
        // Drafting order: the job with more drafts first.
        let x = launch
            .inputs(&jobs, &[1, 0], &first_row, |slot| if slot == 2 { 8 } else { 0 }, keep)
            .expect("inputs");
        assert_eq!(x.from_step, vec![0, 0, 1, 1, 2, 2, 5, 4, 6, 5]);
        assert_eq!(x.from_saved, vec![(2 * keep + 1) as i32, 3]);
        assert_eq!(x.tokens, vec![80, 81, 82, 70, 71, 72]);
        assert_eq!(x.row_slots, vec![0, 0, 0, 2, 2, 2]);
        assert_eq!(x.row_pos, vec![7, 8, 9, 4, 5, 6]);
        assert_eq!(x.seq_slots, vec![0, 2]);
        assert_eq!(x.lens, vec![(0, 10), (2, 7)]);
        assert_eq!(x.last, vec![2, 1, 5, 0]);
        // A piece that does not end a job's rows hands nothing on; a later piece continues the KV indices.
        let long = MtpJob {
            kv_index: 3,
            tokens: (0..10).collect(),
            drafts: 1,
            ..job(0, 10)
        };
        let early = CatchUp { parts: vec![(0, 0..4)] };
        let x = early
            .inputs(std::slice::from_ref(&long), &[0], &first_row, |_| 0, keep)
            .expect("inputs");
        assert!(x.last.is_empty());
        let end = CatchUp {
            parts: vec![(0, 8..10)],
        };
        let x = end
            .inputs(std::slice::from_ref(&long), &[0], &first_row, |_| 0, keep)
            .expect("inputs");
        assert_eq!((x.row_pos, x.lens, x.last), (vec![11, 12], vec![(0, 13)], vec![1, 0]));
        // A repair whose row was not saved is refused, as is a job of a slot the step did not run.
        let lost = MtpJob {
            rows: vec![MtpRow::Saved(3)],
            tokens: vec![1],
            ..job(2, 1)
        };
        let one = CatchUp { parts: vec![(0, 0..1)] };
        assert!(one
            .inputs(std::slice::from_ref(&lost), &[], &first_row, |_| 8, keep)
            .is_err());
        assert!(one.inputs(&[job(1, 1)], &[], &first_row, |_| 0, keep).is_err());
    }

    /// Pairs are padded per part to the launch's shape, so launches of one shape copy alike; an overfull part is
    /// refused.
    #[test]
    fn pair_words_pad_each_part_to_the_launch_shape() {
        let x = LaunchInputs {
            from_step: vec![4, 0, 5, 2],
            from_saved: vec![9, 1],
            last: vec![2, 0],
            ..LaunchInputs::default()
        };
        let w = x.pair_words(3, 2).expect("words");
        assert_eq!(
            w,
            vec![9, 1, -1, -1, -1, -1, 4, 0, 5, 2, -1, -1, 2, 0, -1, -1],
            "saved, step and last parts of 3, 3 and 2 pairs"
        );
        assert!(x.pair_words(1, 2).is_err());
        assert!(x.pair_words(3, 0).is_err());
    }

    /// Every draft step but the last feeds its picks back: the continuing jobs (a prefix of the drafting order)
    /// at the KV index after their rows and earlier drafts, their slots' lengths one past it.
    #[test]
    fn draft_meta_lists_the_continuing_jobs_per_step() {
        let a = MtpJob {
            kv_index: 10,
            drafts: 3,
            ..job(2, 2)
        };
        let b = MtpJob {
            kv_index: 4,
            drafts: 2,
            ..job(0, 1)
        };
        let c = MtpJob { drafts: 1, ..job(1, 1) };
        let m = 4;
        let meta = draft_meta(&[b, c, a], &[2, 0, 1], m).expect("meta");
        assert_eq!(meta.len(), 2 * META_WORDS * m);
        // Step 0: jobs a (slot 2) and b (slot 0) draft again; c is done.
        assert_eq!(&meta[..m], &[2, 0, 0, 0]);
        assert_eq!(&meta[m..2 * m], &[12, 5, 0, 0]);
        assert_eq!(&meta[2 * m..3 * m], &[6, 0, 13, 0]);
        // Step 1: only a.
        let s1 = &meta[3 * m..];
        assert_eq!(
            (&s1[..m], &s1[m..2 * m], &s1[2 * m..]),
            (&[2, 0, 0, 0][..], &[13, 0, 0, 0][..], &[0, 0, 14, 0][..])
        );
        // One draft step runs no layer; no drafting job, nothing.
        assert!(draft_meta(&[job(0, 1)], &[], m).expect("none").is_empty());
        let one = MtpJob { drafts: 1, ..job(0, 1) };
        assert!(draft_meta(&[one], &[0], m).expect("one").is_empty());
        // A slot past the rank's is refused.
        let far = MtpJob { drafts: 2, ..job(7, 1) };
        assert!(draft_meta(&[far], &[0], m).is_err());
    }

    /// Each slot's row of the layer's table holds its target blocks, then its own blocks past the target's pool.
    #[test]
    fn the_layer_table_extends_each_slot_with_its_own_blocks() {
        let (slots, per, total, extra) = (3, 4, 6, 2);
        let mut kv = KvBlocks::new(slots, 16, per, total).expect("blocks");
        kv.fit(0, 20).expect("two blocks");
        kv.fit(2, 64).expect("four blocks");
        let layout = PagedKv {
            num_blocks: total + slots * extra,
            block_size: 16,
            kv_heads: 1,
            head_dim: 8,
            num_slots: slots,
            blocks_per_slot: per + extra,
        };
        let table = mtp_table(&kv, layout).expect("table");
        let rows: Vec<&[i32]> = table.chunks(per + extra).collect();
        let target = |slot: usize| kv.table(slot).iter().map(|&b| b as i32).collect::<Vec<_>>();
        assert_eq!(&rows[0][..2], &target(0)[..]);
        assert_eq!(&rows[0][2..], &[6, 7, -1, -1]);
        assert_eq!(rows[1], &[8, 9, -1, -1, -1, -1]);
        assert_eq!(&rows[2][..4], &target(2)[..]);
        assert_eq!(&rows[2][4..], &[10, 11]);
        // A layout that does not extend the target's pool is refused.
        let narrow = PagedKv {
            num_blocks: total,
            ..layout
        };
        assert!(mtp_table(&kv, narrow).is_err());
    }
}
