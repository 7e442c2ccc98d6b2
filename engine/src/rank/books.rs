//! The coordinator's books: every slot's form, committed length, pending verify and KV blocks, kept identically to
//! what every rank holds, so that a plan is checked once, here, before any rank computes — a bad plan fails the same
//! way for every rank and never strands one inside a collective.
//!
//! [`Books::validate`] checks a plan as a whole and changes nothing; [`Books::apply`] records it once the ranks have
//! run it. Slots are handed out by [`Books::open`] (deterministic, so a rank that keeps its own books — the GPU rank,
//! for its block tables — agrees); a rank claims a slot at its first step.

use super::plan::{Batch, Commit, Program, RankInfo, Rows, SeqKind, StepPlan, VerifyChain};
use super::spec_chain::ChainLog;
use crate::decode::FormChoice;
use crate::error::{EngineError, Result};
use crate::state::{KvBlocks, PoolError, SlotAllocator};
use rewind_kernels::cpu::lm_head::MAX_TOP;

/// One slot's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SlotBook {
    form: FormChoice,
    /// Committed tokens.
    len: usize,
    /// Drafts of a verify awaiting its commit.
    pending: usize,
    /// Whether the ranks hold the slot (it has run a step or been restored).
    started: bool,
}

/// What every rank of a group can do, and the state of every slot; see the module docs.
#[derive(Clone, Debug)]
pub struct Books {
    vocab: usize,
    max_context: usize,
    max_verify: usize,
    max_batch: Option<usize>,
    chunked_prefill: bool,
    forms: Vec<FormChoice>,
    spec_summaries: bool,
    logprobs: bool,
    hidden_states: bool,
    /// Whether every rank loaded the MTP layer ([`Batch::mtp`]).
    mtp: bool,
    max_chained: usize,
    /// Ranks in the group (tensor parallelism when more than one).
    ranks: usize,
    slots: SlotAllocator,
    seqs: Vec<SlotBook>,
    /// `None` when the model has no attention layer.
    kv: Option<KvBlocks>,
}

fn invalid(m: String) -> EngineError {
    EngineError::InvalidInput(m)
}

fn check_spec_temperature(slot: usize, temperature: f32) -> Result<()> {
    if temperature.is_finite() && temperature > 0.0 {
        return Ok(());
    }
    Err(invalid(format!(
        "slot {slot}: a speculative summary's temperature must be finite and > 0, got {temperature}"
    )))
}

impl Books {
    /// Books for a group whose ranks report `infos` (their common capacity: the smallest of each) over a vocabulary
    /// of `vocab` ids.
    pub fn new(infos: &[RankInfo], vocab: usize) -> Result<Self> {
        let Some(first) = infos.first() else {
            return Err(invalid("a group needs at least one rank".into()));
        };
        let min = |f: fn(&RankInfo) -> usize| infos.iter().map(f).min().unwrap_or(0);
        let slots = min(|i| i.slots);
        let kv_blocks = min(|i| i.kv_blocks);
        let block = first.kv_block_size.max(1);
        let max_context = min(|i| i.max_context);
        let kv = if kv_blocks > 0 {
            Some(KvBlocks::new(slots, block, max_context.div_ceil(block), kv_blocks)?)
        } else {
            None
        };
        Ok(Books {
            vocab,
            max_context,
            max_verify: min(|i| i.max_verify),
            max_batch: infos.iter().filter_map(|i| i.max_batch).min(),
            chunked_prefill: infos.iter().all(|i| i.chunked_prefill),
            forms: first
                .forms
                .iter()
                .copied()
                .filter(|f| infos.iter().all(|i| i.forms.contains(f)))
                .collect(),
            spec_summaries: infos.iter().all(|i| i.spec_summaries),
            logprobs: infos.iter().all(|i| i.logprobs),
            hidden_states: infos.iter().all(|i| i.hidden_states),
            mtp: infos.iter().all(|i| i.mtp),
            max_chained: min(|i| i.max_chained),
            ranks: infos.len(),
            slots: SlotAllocator::new(slots),
            seqs: vec![
                SlotBook {
                    form: FormChoice::Recurrent,
                    len: 0,
                    pending: 0,
                    started: false,
                };
                slots
            ],
            kv,
        })
    }

    /// The most further steps one plan may chain ([`DecodeChain::steps`](super::DecodeChain::steps)).
    pub fn max_chained(&self) -> usize {
        self.max_chained
    }

    /// Ranks in the group (more than one: tensor parallelism).
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The longest context a sequence may reach.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// The most tokens one verify may take (0: the ranks cannot verify).
    pub fn max_verify(&self) -> usize {
        self.max_verify
    }

    /// Whether every rank computes the one-pass speculative summaries.
    pub fn spec_summaries(&self) -> bool {
        self.spec_summaries
    }

    /// Whether every rank computes log-probability summaries ([`SeqStep::logprobs`](super::SeqStep::logprobs)).
    pub fn logprobs(&self) -> bool {
        self.logprobs
    }

    /// Whether every rank returns final hidden states.
    pub fn hidden_states(&self) -> bool {
        self.hidden_states
    }

    /// Whether every rank drafts with an MTP layer ([`Batch::mtp`]).
    pub fn mtp(&self) -> bool {
        self.mtp
    }

    /// Sequence slots.
    pub fn slots(&self) -> usize {
        self.seqs.len()
    }

    /// Slots holding a sequence.
    pub fn slots_in_use(&self) -> usize {
        self.slots.used_count()
    }

    /// The decode forms every rank runs.
    pub fn forms(&self) -> &[FormChoice] {
        &self.forms
    }

    /// Takes a free slot for a new sequence decoded in `form`.
    pub fn open(&mut self, form: FormChoice) -> Result<usize> {
        self.check_form(form)?;
        let slot = self.slots.alloc().map_err(|e| match e {
            PoolError::SlotsFull { capacity } => invalid(format!(
                "all {capacity} sequence slots are in use (finish or release a sequence, or raise --max-seqs)"
            )),
            other => other.into(),
        })?;
        self.seqs[slot] = SlotBook {
            form,
            len: 0,
            pending: 0,
            started: false,
        };
        Ok(slot)
    }

    /// Takes the free slot `slot` (a rank following the coordinator).
    pub fn open_at(&mut self, slot: usize, form: FormChoice) -> Result<()> {
        self.check_form(form)?;
        self.slots.claim(slot)?;
        self.seqs[slot] = SlotBook {
            form,
            len: 0,
            pending: 0,
            started: false,
        };
        Ok(())
    }

    fn check_form(&self, form: FormChoice) -> Result<()> {
        if self.forms.contains(&form) {
            return Ok(());
        }
        let names: Vec<&str> = self.forms.iter().map(|f| f.name()).collect();
        Err(EngineError::NotSupported(format!(
            "the {form} decode form on this backend (it runs: {})",
            names.join(", ")
        )))
    }

    /// Frees `slot` and its KV blocks; returns whether the ranks held it (and must release it too).
    pub fn close(&mut self, slot: usize) -> Result<bool> {
        self.slots.check_allocated(slot).map_err(|_| self.not_open(slot))?;
        if let Some(kv) = &mut self.kv {
            kv.fit(slot, 0)?;
        }
        self.slots.free(slot)?;
        Ok(std::mem::replace(&mut self.seqs[slot].started, false))
    }

    /// Records a slot the ranks restored from a snapshot of `len` committed tokens.
    pub fn restored(&mut self, slot: usize, len: usize) -> Result<()> {
        self.slots.check_allocated(slot).map_err(|_| self.not_open(slot))?;
        if let Some(kv) = &mut self.kv {
            kv.fit(slot, len)?;
        }
        let b = &mut self.seqs[slot];
        (b.len, b.pending, b.started) = (len, 0, true);
        Ok(())
    }

    fn not_open(&self, slot: usize) -> EngineError {
        invalid(format!("sequence slot {slot} is not open"))
    }

    /// A slot's committed length.
    pub fn len(&self, slot: usize) -> Result<usize> {
        self.slots.check_allocated(slot).map_err(|_| self.not_open(slot))?;
        Ok(self.seqs[slot].len)
    }

    /// A slot's pending verify (0: none).
    pub fn pending(&self, slot: usize) -> Result<usize> {
        self.slots.check_allocated(slot).map_err(|_| self.not_open(slot))?;
        Ok(self.seqs[slot].pending)
    }

    /// Whether the ranks hold `slot`.
    pub fn started(&self, slot: usize) -> bool {
        self.slots.is_allocated(slot) && self.seqs[slot].started
    }

    /// The KV block tables (for a rank that uploads them), when the model has attention layers.
    pub fn kv(&self) -> Option<&KvBlocks> {
        self.kv.as_ref()
    }

    /// Checks `plan` as a whole against the books; changes nothing. What a plan's types already rule out (a chained
    /// prompt chunk, whole logits of a chain, ...) needs no check here.
    pub fn validate(&self, plan: &StepPlan) -> Result<()> {
        let after = self.check_commits(&plan.commits)?;
        let spans = plan.spans();
        if plan.commits.is_empty() && spans.is_empty() {
            return Err(invalid("an empty step (no sequences and no commits)".into()));
        }
        if let Some(max) = self.max_batch {
            if spans.len() > max {
                return Err(invalid(format!(
                    "a step of {} sequences exceeds the batch limit of {max} (--max-seqs)",
                    spans.len()
                )));
            }
        }
        match &plan.program {
            Program::Batch(b) => self.check_batch(b)?,
            Program::DecodeChain(c) => {
                if self.max_chained == 0 {
                    return Err(EngineError::NotSupported("chained decode steps on this backend".into()));
                }
                c.check(self.max_chained)?;
            }
            Program::VerifyChain(c) => {
                if self.max_chained == 0 || self.max_verify == 0 {
                    return Err(EngineError::NotSupported("chained verify steps on this backend".into()));
                }
                if c.seqs.iter().any(|s| s.spec.is_some()) && !self.spec_summaries {
                    return Err(EngineError::NotSupported(
                        "one-pass speculative sampling summaries on this backend".into(),
                    ));
                }
                c.check(self.vocab)?;
                if c.steps > self.max_chained {
                    return Err(EngineError::NotSupported(format!(
                        "a plan chaining {} verify steps: this backend chains at most {}",
                        c.steps, self.max_chained
                    )));
                }
                if c.window() > self.max_verify {
                    return Err(invalid(format!(
                        "a verify takes 1 to {} tokens, the chain's window is {}",
                        self.max_verify,
                        c.window()
                    )));
                }
                for s in &c.seqs {
                    if let Some(spec) = &s.spec {
                        check_spec_temperature(s.slot, spec.temperature)?;
                    }
                }
            }
        }
        let mut new_blocks = 0;
        for (i, s) in spans.iter().enumerate() {
            if spans[..i].iter().any(|o| o.slot == s.slot) {
                return Err(invalid(format!("slot {} appears twice in one step", s.slot)));
            }
            let b = self.book(s.slot)?;
            let committed = after.iter().find(|(slot, _)| *slot == s.slot).map(|&(_, len)| len);
            if b.pending > 0 && committed.is_none() {
                return Err(invalid(format!(
                    "slot {} has {} verified tokens awaiting commit",
                    s.slot, b.pending
                )));
            }
            let len = committed.unwrap_or(b.len);
            if s.position != len {
                return Err(invalid(format!(
                    "slot {} holds {len} tokens, the plan puts its tokens at position {}",
                    s.slot, s.position
                )));
            }
            if s.form != b.form {
                return Err(invalid(format!(
                    "slot {} decodes in the {} form, the plan says {}",
                    s.slot, b.form, s.form
                )));
            }
            if let Some((j, &tok)) = s.tokens.iter().enumerate().find(|(_, &tok)| tok as usize >= self.vocab) {
                return Err(invalid(format!(
                    "slot {}: token id {tok} at index {j} is out of range (vocab size {})",
                    s.slot, self.vocab
                )));
            }
            if len + s.span > self.max_context {
                return Err(invalid(format!(
                    "slot {} would reach {} tokens, beyond the context limit of {} (the pools' length, at most the \
                     model's max_position_embeddings; raise --max-model-len where the model allows)",
                    s.slot,
                    len + s.span,
                    self.max_context
                )));
            }
            if let Some(kv) = &self.kv {
                new_blocks += kv.blocks_for(len + s.span).saturating_sub(kv.held(s.slot));
            }
        }
        if let Some(kv) = &self.kv {
            // Commits before the step can only free blocks; count the step's needs against today's free list.
            if new_blocks > kv.free_count() {
                return Err(invalid(format!(
                    "the KV cache is full: the step needs {new_blocks} more blocks of {} tokens, {} are free \
                     (release sequences or give the pools more memory)",
                    kv.block_size(),
                    kv.free_count()
                )));
            }
        }
        Ok(())
    }

    /// Checks the commits; returns each committed slot's length after them.
    fn check_commits(&self, commits: &[Commit]) -> Result<Vec<(usize, usize)>> {
        let mut after = Vec::new();
        for (i, c) in commits.iter().enumerate() {
            if commits[..i].iter().any(|o| o.slot == c.slot) {
                return Err(invalid(format!("slot {} is committed twice in one step", c.slot)));
            }
            let b = self.book(c.slot)?;
            if b.pending == 0 {
                return Err(invalid(format!("slot {} has no verify to commit", c.slot)));
            }
            if c.accepted > b.pending {
                return Err(invalid(format!(
                    "slot {}: cannot accept {} of {} verified tokens",
                    c.slot, c.accepted, b.pending
                )));
            }
            after.push((c.slot, b.len + c.accepted));
        }
        Ok(after)
    }

    /// What a single step's sequences ask beyond their place in the books: outputs the ranks return, windows,
    /// rows, sampling and summaries.
    fn check_batch(&self, b: &Batch) -> Result<()> {
        if b.hidden && !self.hidden_states {
            return Err(EngineError::NotSupported(
                "returning hidden states (the MTP drafter needs them) on this backend".into(),
            ));
        }
        if !b.mtp.is_empty() && !self.mtp {
            return Err(EngineError::NotSupported(
                "MTP drafts on the ranks: these ranks loaded no MTP layer".into(),
            ));
        }
        for (i, r) in b.mtp.iter().enumerate() {
            if b.mtp[..i].iter().any(|o| o.slot == r.slot) {
                return Err(invalid(format!("slot {} asks for MTP drafts twice", r.slot)));
            }
            let s = b.seqs.iter().find(|s| s.slot == r.slot).ok_or_else(|| {
                invalid(format!(
                    "an MTP request names slot {}, which the step does not run",
                    r.slot
                ))
            })?;
            if s.hidden_row_count() != s.tokens.len() {
                return Err(invalid(format!(
                    "slot {}: a sequence drafting with MTP must report every row of its step",
                    r.slot
                )));
            }
            if r.window > self.max_verify.saturating_sub(1) {
                return Err(invalid(format!(
                    "slot {}: an MTP window of {} drafts exceeds the ranks' verify window ({} drafts)",
                    r.slot,
                    r.window,
                    self.max_verify.saturating_sub(1)
                )));
            }
        }
        for s in &b.seqs {
            if let Some(spec) = &s.spec {
                if !self.spec_summaries {
                    return Err(EngineError::NotSupported(
                        "one-pass speculative sampling summaries on this backend".into(),
                    ));
                }
                if s.kind != SeqKind::Verify || s.rows != Rows::All {
                    return Err(invalid(format!(
                        "slot {}: speculative summaries need a verify reporting every row",
                        s.slot
                    )));
                }
                check_spec_temperature(s.slot, spec.temperature)?;
            }
            let (t, len) = (s.tokens.len(), s.position);
            match s.kind {
                SeqKind::Prefill if t == 0 => return Err(invalid(format!("slot {}: no tokens to prefill", s.slot))),
                SeqKind::Prefill if len > 0 && !self.chunked_prefill => {
                    return Err(EngineError::NotSupported(format!(
                        "a prompt chunk at position {len} (slot {}) on this backend",
                        s.slot
                    )))
                }
                SeqKind::Decode if t != 1 => {
                    return Err(invalid(format!(
                        "slot {}: a decode step takes 1 token, found {t}",
                        s.slot
                    )))
                }
                SeqKind::Verify if self.max_verify == 0 => {
                    return Err(EngineError::NotSupported(
                        "speculative verification on this backend".into(),
                    ))
                }
                SeqKind::Verify if t == 0 || t > self.max_verify => {
                    return Err(invalid(format!(
                        "slot {}: a verify takes 1 to {} tokens, found {t}",
                        s.slot, self.max_verify
                    )))
                }
                _ => {}
            }
            if let Some(l) = &s.logprobs {
                if !self.logprobs {
                    return Err(EngineError::NotSupported(
                        "log-probabilities (top entries of the LM head's rows) on this backend".into(),
                    ));
                }
                if l.top > MAX_TOP {
                    return Err(invalid(format!(
                        "slot {}: at most {MAX_TOP} top log-probabilities a row, asked for {}",
                        s.slot, l.top
                    )));
                }
                if l.targets.len() != s.row_count() {
                    return Err(invalid(format!(
                        "slot {}: {} log-probability targets for {} reported rows",
                        s.slot,
                        l.targets.len(),
                        s.row_count()
                    )));
                }
                if let Some(t) = l.targets.iter().flatten().find(|&&t| t as usize >= self.vocab) {
                    return Err(invalid(format!(
                        "slot {}: log-probability target id {t} is out of range (vocab size {})",
                        s.slot, self.vocab
                    )));
                }
            }
            if let Some(sample) = &s.sample {
                if s.row_count() == 0 {
                    return Err(invalid(format!("slot {}: sampling needs a reported row", s.slot)));
                }
                sample.validate(self.vocab)?;
            }
        }
        Ok(())
    }

    /// Records a plan the ranks have run (it must have passed [`Books::validate`]).
    pub fn apply(&mut self, plan: &StepPlan) -> Result<()> {
        for c in &plan.commits {
            let b = &mut self.seqs[c.slot];
            b.len += c.accepted;
            b.pending = 0;
            if let Some(kv) = &mut self.kv {
                kv.fit(c.slot, b.len)?;
            }
        }
        for s in plan.spans() {
            let b = &mut self.seqs[s.slot];
            b.started = true;
            // A chain of verifies holds blocks for its longest outcome until it settles (`settle_chain`).
            let reserve = if s.verify {
                b.pending = s.tokens.len();
                b.len + s.span
            } else {
                b.len += s.span;
                b.len
            };
            if let Some(kv) = &mut self.kv {
                kv.fit(s.slot, reserve)?;
            }
        }
        Ok(())
    }

    /// Records what a chain of verifies committed (applied before it ran): each sequence's committed tokens before
    /// its last step, whose verify stays pending; the blocks held for longer outcomes return. A rank may end a chain
    /// early (at least one step runs); the log says how many steps ran.
    pub fn settle_chain(&mut self, chain: &VerifyChain, log: &ChainLog) -> Result<()> {
        let n = chain.seqs.len();
        let steps = log.accepted.len() / n.max(1);
        let t = chain.window();
        if !(1..=1 + chain.steps).contains(&steps)
            || log.accepted.len() != n * steps
            || log.tokens.len() != n * steps
            || log.drafts.len() != n * steps * t.saturating_sub(1)
            || log.accepted.iter().any(|&a| a >= t)
        {
            return Err(invalid(format!(
                "a chain's log holds {} verdicts and {} drafts for {n} sequences of {t} tokens over at most {} steps",
                log.accepted.len(),
                log.drafts.len(),
                1 + chain.steps
            )));
        }
        for (s, committed) in chain.seqs.iter().zip(log.committed(n)) {
            if committed > t * (1 + chain.steps) {
                return Err(invalid(format!(
                    "slot {}: a chain committed {committed} tokens, more than its steps verified",
                    s.slot
                )));
            }
            let b = &mut self.seqs[s.slot];
            b.len += committed;
            if let Some(kv) = &mut self.kv {
                kv.fit(s.slot, b.len + b.pending)?;
            }
        }
        Ok(())
    }

    fn book(&self, slot: usize) -> Result<&SlotBook> {
        self.slots.check_allocated(slot).map_err(|_| self.not_open(slot))?;
        Ok(&self.seqs[slot])
    }
}
