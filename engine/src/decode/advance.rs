//! One step's bookkeeping around the block loop: the whole batch checked before anything changes, each sequence's
//! form and flush decided as data (kv-only compression, the one-window-early flush), the KV grown, the blocks run
//! ([`super::step`]), then the slot counters moved by each sequence's phase ([`crate::state::SlotCounters::after_step`],
//! the rules the GPU rank applies too).

use super::step::{Phase, Seq};
use super::{Decoder, Item};
use crate::error::{EngineError, Result};
use crate::state::{DecodeForm, StepPhase};
use rewind_kernels::cpu::traffic::Traffic;

impl Decoder {
    /// Runs a batch of sequences — prompt chunks, decodes and verifies, each in its slot's form — after checking
    /// the whole batch (nothing changes when a check fails), and returns the final residual rows `[Σ t, hidden]`.
    pub(crate) fn advance(&mut self, items: &[Item]) -> Result<Vec<f32>> {
        if items.is_empty() {
            return Err(EngineError::InvalidInput("an empty step (no sequences)".into()));
        }
        for (i, it) in items.iter().enumerate() {
            self.check_idle(it.slot)?;
            if items[..i].iter().any(|o| o.slot == it.slot) {
                return Err(EngineError::InvalidInput(format!(
                    "slot {} appears twice in one step",
                    it.slot
                )));
            }
            let t = it.tokens.len();
            match it.phase {
                Phase::Prefill if t == 0 => {
                    return Err(EngineError::InvalidInput("no tokens to prefill".into()));
                }
                Phase::Decode if t != 1 => {
                    return Err(EngineError::InvalidInput(format!(
                        "a decode step takes 1 token per sequence, found {t}"
                    )));
                }
                Phase::Verify if t == 0 || t > self.config.max_verify => {
                    return Err(EngineError::InvalidInput(format!(
                        "a verify takes 1 to {} tokens, found {t}",
                        self.config.max_verify
                    )));
                }
                _ => {}
            }
            let pos = self.position[it.slot];
            self.model.check_tokens(it.tokens, pos)?;
            if pos + t > self.config.max_context {
                return Err(EngineError::InvalidInput(format!(
                    "slot {} would reach {} tokens, beyond the decoder's context of {}",
                    it.slot,
                    pos + t,
                    self.config.max_context
                )));
            }
        }
        self.traffic = Traffic::default();
        self.steps += 1;
        let mut seqs = Vec::with_capacity(items.len());
        for it in items {
            let (slot, t) = (it.slot, it.tokens.len());
            let pos = self.position[slot];
            let (form, flush) = match it.phase {
                Phase::Prefill => {
                    self.prepare_prefill(slot, t)?;
                    (self.pools.counters().form_of(slot), false)
                }
                Phase::Decode | Phase::Verify => self.plan_step(slot, t, it.phase)?,
            };
            seqs.push(Seq {
                slot,
                tokens: it.tokens,
                pos,
                phase: it.phase,
                form,
                flush,
            });
        }
        self.grow_kv(&seqs)?;
        let before: Vec<usize> = seqs.iter().map(|s| self.pools.counters().ring(s.slot).len).collect();
        let x = self.run(&seqs)?;
        for (s, h) in seqs.iter().zip(before) {
            let t = s.tokens.len();
            let phase = match s.phase {
                Phase::Prefill => StepPhase::Prefill { position: s.pos },
                Phase::Decode => StepPhase::Decode,
                Phase::Verify => StepPhase::Verify,
            };
            self.pools.after_step(s.slot, phase, s.form, s.flush, h, t)?;
            if s.phase == Phase::Verify {
                // The drafts wait for the commit.
                self.pending[s.slot] = t;
            } else {
                self.position[s.slot] += t;
            }
        }
        Ok(x)
    }

    /// Before a prompt chunk of `t` tokens: the slot's form and fold as [`crate::state::SlotCounters::decide`] rules.
    fn prepare_prefill(&mut self, slot: usize, t: usize) -> Result<()> {
        let phase = StepPhase::Prefill {
            position: self.position[slot],
        };
        let d = self
            .pools
            .counters()
            .decide(slot, phase, t, self.kv_threshold, self.config.max_verify);
        if d.start_replay {
            self.pools.set_form(slot, DecodeForm::Replay)?;
        }
        if d.fold_first {
            self.fold(slot)?;
        }
        self.pools.set_flush(slot, false)?;
        Ok(())
    }

    /// Decides, before a step appending `t` tokens to `slot`, its form (compressing a kv-only sequence whose context
    /// has reached the threshold) and its flush flag, which is written to the slot's counters
    /// ([`crate::state::SlotCounters::decide`]). A kv-only step starts with `h < threshold` committed entries and appends `t ≤ T`,
    /// so it fits the slot's ring of `threshold + T`; a verify may cross the threshold, and the step after its commit
    /// compresses.
    fn plan_step(&mut self, slot: usize, t: usize, phase: Phase) -> Result<(DecodeForm, bool)> {
        let phase = if phase == Phase::Verify {
            StepPhase::Verify
        } else {
            StepPhase::Decode
        };
        let d = self
            .pools
            .counters()
            .decide(slot, phase, t, self.kv_threshold, self.config.max_verify);
        if d.fold_first {
            self.fold(slot)?;
        }
        self.pools.set_flush(slot, d.flush)?;
        Ok((d.form, d.flush))
    }

    /// Grows every sequence's KV length by its tokens; on failure the ones already grown are rolled back.
    fn grow_kv(&mut self, seqs: &[Seq]) -> Result<()> {
        for (i, s) in seqs.iter().enumerate() {
            if let Err(e) = self.pools.kv_grow(s.slot, s.pos + s.tokens.len()) {
                for done in &seqs[..i] {
                    self.pools.kv_truncate(done.slot, done.pos)?;
                }
                return Err(e.into());
            }
        }
        Ok(())
    }
}
