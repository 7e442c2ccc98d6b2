//! The scheduler's state and its step planning; see the module docs of [`super`].

mod chain;
pub use chain::Chain;
mod requeue;
mod spec;

use std::collections::BTreeMap;

/// The scheduler's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedConfig {
    /// Sequence slots (the most sequences running at once).
    pub slots: usize,
    /// KV blocks shared by all sequences, and tokens per block.
    pub kv_blocks: usize,
    pub kv_block_size: usize,
    /// The most tokens one step may run (decodes and prompt chunks together; `--max-batch-tokens`).
    pub max_batch_tokens: usize,
    /// The longest context a sequence may reach.
    pub max_context: usize,
    /// The most decode steps one planned step may run back to back on the ranks (at least 1; 1 never chains): a
    /// steady decode batch then costs one host round trip per `decode_steps` tokens instead of one per token (see
    /// [`Step::chained`]).
    pub decode_steps: usize,
}

/// A request as the scheduler sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub id: u64,
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least 1).
    pub max_tokens: usize,
    /// Higher runs first; equal priorities run in arrival order.
    pub priority: i32,
    /// Leading tokens of `prompt` already in a saved state (a session's earlier turns): the ranks restore that state
    /// when the sequence starts, and only the rest of the prompt is prefilled. 0 for a fresh sequence.
    pub restored: usize,
    /// Whether its steps may chain on the ranks ([`Chain`]).
    pub chain: Chain,
}

/// Why a request cannot be taken.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    #[error("request {id}: the prompt is empty")]
    EmptyPrompt { id: u64 },
    #[error("request {id}: {restored} restored tokens leave none of the {prompt} prompt tokens to prefill")]
    NothingToPrefill { id: u64, restored: usize, prompt: usize },
    #[error("request {id}: max_tokens must be at least 1")]
    NoTokens { id: u64 },
    #[error("request {id}: {need} tokens (prompt and max_tokens) exceed the context limit of {limit}")]
    TooLong { id: u64, need: usize, limit: usize },
    #[error("request {id}: its context needs {need} KV blocks, the pool has {total}")]
    TooBig { id: u64, need: usize, total: usize },
    #[error("request {id} is already queued or running")]
    Duplicate { id: u64 },
    #[error("request {id} is not running")]
    NotRunning { id: u64 },
    #[error("request {id} has no verify in flight")]
    NotVerifying { id: u64 },
    #[error("the scheduler needs a slot, a token budget and a KV block size (slots {slots}, budget {budget})")]
    Config { slots: usize, budget: usize },
    #[error("decode_steps must be at least 1 (1 runs one decode step per planned step)")]
    NoDecodeSteps,
}

/// One running sequence. Its token stream is `history` (what must be prefilled: the prompt, or after a preemption the
/// prompt and every token generated before it) followed by the tokens generated since it was admitted; `in_state` of
/// them are in the slot's state.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Running {
    id: u64,
    slot: usize,
    priority: i32,
    arrival: u64,
    prompt_len: usize,
    /// Tokens the slot's state starts from (see [`Request::restored`]).
    restored: usize,
    history: Vec<u32>,
    /// Every token generated since the request arrived (kept across preemptions).
    generated: Vec<u32>,
    /// `generated.len()` when the sequence was admitted.
    generated_at_admission: usize,
    in_state: usize,
    max_tokens: usize,
    /// KV blocks held.
    blocks: usize,
    /// Whether the slot must be reset (the first step after admission).
    fresh: bool,
    /// See [`Request::chain`].
    chain: Chain,
    /// The prompt chunks' lengths so far, and those of an earlier admission still to repeat: a re-prefill takes
    /// the same chunks, then feeds the generated tokens one decode step each, so that it computes exactly what the
    /// first run did (a chunked scan rounds differently from token-by-token steps) and greedy outputs cannot change.
    chunks: Vec<usize>,
    replay: std::collections::VecDeque<usize>,
    /// See `Waiting::cut`.
    cut: Option<usize>,
    /// Drafts the coordinator proposed for the next step ([`Scheduler::propose`]).
    drafts: Vec<u32>,
    /// Drafts of the verify in flight (planned, not yet judged by [`Scheduler::verified`]).
    verifying: Option<usize>,
    /// Tokens of the last verify to commit in the next step (the input token plus the accepted drafts).
    pending_commit: Option<usize>,
}

impl Running {
    fn stream_len(&self) -> usize {
        self.history.len() + self.generated.len() - self.generated_at_admission
    }

    /// Whether the prompt is still being prefilled (in chunks).
    fn prefilling(&self) -> bool {
        self.in_state < self.prompt_len
    }

    /// Token `i` of the stream (history, then what was generated since admission).
    fn token_at(&self, i: usize) -> u32 {
        match self.history.get(i) {
            Some(&t) => t,
            None => self.generated[self.generated_at_admission + i - self.history.len()],
        }
    }
}

/// A waiting request (new, or preempted with the tokens it had generated).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Waiting {
    request: Request,
    arrival: u64,
    generated: Vec<u32>,
    /// The prompt chunks of an earlier admission (see `Running::chunks`).
    chunks: Vec<usize>,
    /// A position a prompt chunk must end at ([`Scheduler::cut_at`]).
    cut: Option<usize>,
}

/// What one sequence does in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepWork {
    /// A prompt chunk: `tokens` at `position`; `last` when it completes the prompt (its last row is sampled).
    Prefill {
        position: usize,
        tokens: Vec<u32>,
        last: bool,
    },
    /// One token at `position`: the last generated one, whose row is sampled (`sample`), or after a re-admission
    /// one of the tokens generated before it, fed again (sampled only for the last).
    Decode { position: usize, token: u32, sample: bool },
    /// A speculative verify at `position`: `tokens[0]` is the last generated token, the rest are drafts; every row
    /// is reported and judged, and [`Scheduler::verified`] says how many drafts were accepted.
    Verify { position: usize, tokens: Vec<u32> },
}

/// One sequence's part of a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    pub id: u64,
    pub slot: usize,
    /// The sequence (re)starts in this step: the ranks take the slot afresh.
    pub fresh: bool,
    /// With `fresh`: the ranks restore the sequence's saved state of this many tokens first ([`Request::restored`]).
    pub restored: usize,
    pub work: StepWork,
}

impl Planned {
    /// Whether this sequence's last row is sampled in the step.
    pub fn samples(&self) -> bool {
        match self.work {
            StepWork::Prefill { last, .. } => last,
            StepWork::Decode { sample, .. } => sample,
            StepWork::Verify { .. } => true,
        }
    }

    /// The position just past the last token this work feeds: the sequence has been computed this far once the
    /// step succeeds.
    pub fn end(&self) -> usize {
        match &self.work {
            StepWork::Prefill { position, tokens, .. } | StepWork::Verify { position, tokens } => {
                position + tokens.len()
            }
            StepWork::Decode { position, .. } => position + 1,
        }
    }
}

/// A step's plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Verifies of earlier steps to commit first: `(slot, tokens accepted)`.
    pub commits: Vec<(usize, usize)>,
    pub work: Vec<Planned>,
    /// Sequences preempted to make room, with the slots they freed (the ranks release them); each waits to be
    /// re-prefilled with its history.
    pub preempted: Vec<(u64, usize)>,
    /// Further decode steps the ranks run after this step's one, without a host round trip (0: none). When it is
    /// `c > 0`, every sequence of `work` is a sampled [`StepWork::Decode`] and runs `1 + c` tokens: the planned
    /// token at `position`, then each step's sampled token as the next step's input, at `position + 1 ..=
    /// position + c`. The coordinator then calls [`Scheduler::sampled`] with each sequence's `1 + c` tokens in
    /// order, stopping after the call that finishes it (the ranks' tokens after that are dropped with the slot).
    ///
    /// With [`Step::spec_chain`] the chained steps are verifies instead (see `chain_verifies`).
    pub chained: usize,
    /// Every sequence of `work` is a verify of the same window, and the ranks run up to `1 + chained` verifies,
    /// judging, committing and drafting between them ([`crate::rank::Program::VerifyChain`]). The coordinator then
    /// calls [`Scheduler::chain_verified`] with each sequence's accepted counts, then [`Scheduler::sampled`] with its
    /// tokens in order.
    pub spec_chain: bool,
}

impl Step {
    /// Tokens the step runs (with [`Step::chained`], in each of its `1 + chained` decode steps).
    pub fn tokens(&self) -> usize {
        self.work
            .iter()
            .map(|p| match &p.work {
                StepWork::Prefill { tokens, .. } | StepWork::Verify { tokens, .. } => tokens.len(),
                StepWork::Decode { .. } => 1,
            })
            .sum()
    }
}

/// The waiting queue and the running sequences; see the module docs.
#[derive(Clone, Debug)]
pub struct Scheduler {
    config: SchedConfig,
    /// Waiting requests by (−priority, arrival): the first entry is admitted next.
    waiting: BTreeMap<(i64, u64), Waiting>,
    running: Vec<Running>,
    free_slots: Vec<usize>,
    free_blocks: usize,
    arrivals: u64,
}

impl Scheduler {
    /// An empty scheduler.
    pub fn new(config: SchedConfig) -> Result<Self, SchedError> {
        if config.slots == 0 || config.max_batch_tokens == 0 || config.kv_block_size == 0 {
            return Err(SchedError::Config {
                slots: config.slots,
                budget: config.max_batch_tokens,
            });
        }
        if config.decode_steps == 0 {
            return Err(SchedError::NoDecodeSteps);
        }
        Ok(Scheduler {
            config,
            waiting: BTreeMap::new(),
            running: Vec::new(),
            free_slots: (0..config.slots).rev().collect(),
            free_blocks: config.kv_blocks,
            arrivals: 0,
        })
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.kv_block_size)
    }

    /// Queues a request after checking that it can ever run ([`Scheduler::check`]).
    pub fn submit(&mut self, request: Request) -> Result<(), SchedError> {
        self.check(&request)?;
        let arrival = self.arrivals;
        self.arrivals += 1;
        let key = (-i64::from(request.priority), arrival);
        self.waiting.insert(
            key,
            Waiting {
                request,
                arrival,
                generated: Vec::new(),
                chunks: Vec::new(),
                cut: None,
            },
        );
        Ok(())
    }

    /// Makes a prompt chunk of waiting request `id` end exactly at prompt position `at` (between its restored
    /// tokens and its prompt's end), so that the state there exists between two steps (where a prompt leaves the
    /// prefix cache's paths: the state at the branch point is cached for the prompts that share it). Returns
    /// whether it was taken.
    pub fn cut_at(&mut self, id: u64, at: usize) -> bool {
        let Some(w) = self.waiting.values_mut().find(|w| w.request.id == id) else {
            return false;
        };
        let ok = at > w.request.restored && at < w.request.prompt.len() && w.chunks.is_empty();
        if ok {
            w.cut = Some(at);
        }
        ok
    }

    /// Whether `request` could be queued: it has a prompt to prefill and tokens to generate, its id is not queued
    /// or running, and its whole context fits the context limit and the KV pool.
    pub fn check(&self, request: &Request) -> Result<(), SchedError> {
        let id = request.id;
        if request.prompt.is_empty() {
            return Err(SchedError::EmptyPrompt { id });
        }
        if request.max_tokens == 0 {
            return Err(SchedError::NoTokens { id });
        }
        if request.restored >= request.prompt.len() {
            return Err(SchedError::NothingToPrefill {
                id,
                restored: request.restored,
                prompt: request.prompt.len(),
            });
        }
        if self.contains(id) {
            return Err(SchedError::Duplicate { id });
        }
        let need = request.prompt.len() + request.max_tokens;
        if need > self.config.max_context {
            return Err(SchedError::TooLong {
                id,
                need,
                limit: self.config.max_context,
            });
        }
        let blocks = self.blocks_for(need);
        if blocks > self.config.kv_blocks {
            return Err(SchedError::TooBig {
                id,
                need: blocks,
                total: self.config.kv_blocks,
            });
        }
        Ok(())
    }

    /// Whether request `id` is waiting or running.
    pub fn contains(&self, id: u64) -> bool {
        self.running.iter().any(|r| r.id == id) || self.waiting.values().any(|w| w.request.id == id)
    }

    /// Removes request `id` wherever it is; returns the slot it frees (the ranks release it), if it was running.
    pub fn cancel(&mut self, id: u64) -> Option<usize> {
        if let Some(k) = self.waiting.iter().find(|(_, w)| w.request.id == id).map(|(k, _)| *k) {
            self.waiting.remove(&k);
            return None;
        }
        let i = self.running.iter().position(|r| r.id == id)?;
        Some(self.finish(i))
    }

    fn finish(&mut self, i: usize) -> usize {
        let r = self.running.swap_remove(i);
        self.free_slots.push(r.slot);
        self.free_blocks += r.blocks;
        r.slot
    }

    /// Requests waiting and sequences running.
    pub fn counts(&self) -> (usize, usize) {
        (self.waiting.len(), self.running.len())
    }

    /// Free slots and free KV blocks.
    pub fn free(&self) -> (usize, usize) {
        (self.free_slots.len(), self.free_blocks)
    }

    /// The slots of the running sequences (for invariant checks and metrics).
    pub fn running_slots(&self) -> Vec<usize> {
        self.running.iter().map(|r| r.slot).collect()
    }

    /// KV blocks held by running sequences.
    pub fn held_blocks(&self) -> usize {
        self.running.iter().map(|r| r.blocks).sum()
    }

    /// Plans the next step within the token budget: first one decode token for every running sequence past its
    /// prompt (by priority, then arrival; when one needs a KV block and none is free, the latest-arrived running
    /// sequences are preempted, or the sequence itself when it is the latest), then prompt chunks of running
    /// sequences, then newly admitted requests while slots, blocks and budget last.
    ///
    /// When nothing can run although sequences are running (every one is mid-prompt and the blocks are spent), the
    /// latest one is preempted and the plan retried: the first sequence always fits alone ([`Scheduler::submit`]
    /// refuses a request whose whole context exceeds the pool), so every step makes progress.
    ///
    /// The final plan may then chain its decode steps ([`Step::chained`], see `chain`).
    pub fn schedule(&mut self) -> Step {
        // Commits are taken once, whatever planning attempt runs; a sequence preempted meanwhile drops its own.
        let commits: Vec<(u64, usize, usize)> = self
            .running
            .iter_mut()
            .filter_map(|r| r.pending_commit.take().map(|n| (r.id, r.slot, n)))
            .collect();
        // Planning drops drafts it cannot verify; a drafter that proposed wants to see each token, so none chains.
        let drafted = self.running.iter().any(|r| !r.drafts.is_empty());
        let mut preempted = Vec::new();
        loop {
            let mut step = self.plan_once(&preempted);
            preempted.append(&mut step.preempted);
            if !step.work.is_empty() || self.running.is_empty() {
                step.preempted = preempted;
                step.commits = commits
                    .iter()
                    .filter(|(id, slot, _)| self.running.iter().any(|r| r.id == *id && r.slot == *slot))
                    .map(|&(_, slot, n)| (slot, n))
                    .collect();
                if drafted {
                    self.chain_verifies(&mut step);
                } else {
                    self.chain(&mut step);
                }
                return step;
            }
            let last = self.running.len() - 1;
            let mut scratch = Step::default();
            self.preempt(last, &mut scratch);
            preempted.append(&mut scratch.preempted);
        }
    }

    fn plan_once(&mut self, earlier: &[(u64, usize)]) -> Step {
        let mut step = Step::default();
        let mut budget = self.config.max_batch_tokens;
        self.running.sort_by_key(|r| (-i64::from(r.priority), r.arrival));
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let r = &self.running[i];
            if r.prefilling() || r.in_state >= r.stream_len() {
                i += 1;
                continue;
            }
            let need = self.blocks_for(r.in_state + 1).saturating_sub(r.blocks);
            while need > self.free_blocks && self.running.len() > i + 1 {
                let victim = self.running.len() - 1;
                self.preempt(victim, &mut step);
            }
            if need > self.free_blocks {
                self.preempt(i, &mut step);
                continue;
            }
            self.free_blocks -= need;
            let r = &self.running[i];
            let sample = r.in_state + 1 == r.stream_len();
            // Drafts ride along only on a sampled step, within the budget, the context and the free blocks (never
            // preempting anyone for a draft).
            let mut k = if sample { r.drafts.len() } else { 0 };
            k = k
                .min(budget - 1)
                .min(self.config.max_context.saturating_sub(r.in_state + 1));
            while k > 0 && self.blocks_for(r.in_state + 1 + k) > r.blocks + need + self.free_blocks {
                k -= 1;
            }
            let extra = self.blocks_for(r.in_state + 1 + k).saturating_sub(r.blocks + need);
            self.free_blocks -= extra;
            let r = &mut self.running[i];
            r.blocks += need + extra;
            let token = r.token_at(r.in_state);
            let drafts = std::mem::take(&mut r.drafts);
            let work = if k > 0 {
                let mut tokens = Vec::with_capacity(1 + k);
                tokens.push(token);
                tokens.extend_from_slice(&drafts[..k]);
                r.verifying = Some(k);
                StepWork::Verify {
                    position: r.in_state,
                    tokens,
                }
            } else {
                StepWork::Decode {
                    position: r.in_state,
                    token,
                    sample,
                }
            };
            step.work.push(Planned {
                id: r.id,
                slot: r.slot,
                fresh: std::mem::take(&mut r.fresh),
                restored: r.restored,
                work,
            });
            r.in_state += 1 + k;
            budget -= 1 + k;
            i += 1;
        }
        for idx in 0..self.running.len() {
            if budget == 0 {
                break;
            }
            if self.running[idx].prefilling() {
                budget -= self.chunk(idx, budget, &mut step);
            }
        }
        while budget > 0 && !self.free_slots.is_empty() {
            let Some((&key, w)) = self.waiting.iter().next() else {
                break;
            };
            // A sequence preempted in this step waits at least one step: re-admitting it at once would only churn.
            if step.preempted.iter().chain(earlier).any(|(id, _)| *id == w.request.id) {
                break;
            }
            if self.first_chunk(w, budget).is_none() {
                break;
            }
            let Some(w) = self.waiting.remove(&key) else {
                break;
            };
            let Some(slot) = self.free_slots.pop() else {
                break;
            };
            let mut history = w.request.prompt.clone();
            history.extend_from_slice(&w.generated);
            self.running.push(Running {
                id: w.request.id,
                slot,
                priority: w.request.priority,
                arrival: w.arrival,
                prompt_len: w.request.prompt.len(),
                restored: w.request.restored,
                history,
                generated_at_admission: w.generated.len(),
                generated: w.generated,
                in_state: w.request.restored,
                max_tokens: w.request.max_tokens,
                blocks: 0,
                fresh: true,
                chain: w.request.chain,
                chunks: Vec::new(),
                replay: w.chunks.into(),
                cut: w.cut,
                drafts: Vec::new(),
                verifying: None,
                pending_commit: None,
            });
            let idx = self.running.len() - 1;
            budget -= self.chunk(idx, budget, &mut step);
        }
        step
    }

    /// Plans the next prompt chunk of running sequence `idx` within `budget` tokens and the free KV blocks; returns
    /// the tokens it takes.
    fn chunk(&mut self, idx: usize, budget: usize, step: &mut Step) -> usize {
        let bs = self.config.kv_block_size;
        let r = &self.running[idx];
        let room = (r.blocks + self.free_blocks) * bs - r.in_state;
        let mut n = (r.prompt_len - r.in_state).min(budget).min(room);
        if let Some(cut) = r.cut.filter(|&c| c > r.in_state) {
            n = n.min(cut - r.in_state);
        }
        if let Some(&want) = r.replay.front() {
            // The chunk of the earlier run, or nothing this step.
            if want > n {
                return 0;
            }
            n = want;
        }
        if n == 0 {
            return 0;
        }
        let need = self.blocks_for(r.in_state + n) - r.blocks;
        self.free_blocks -= need;
        let r = &mut self.running[idx];
        r.blocks += need;
        r.replay.pop_front();
        r.chunks.push(n);
        let position = r.in_state;
        r.in_state += n;
        step.work.push(Planned {
            id: r.id,
            slot: r.slot,
            fresh: std::mem::take(&mut r.fresh),
            restored: r.restored,
            work: StepWork::Prefill {
                position,
                tokens: r.history[position..position + n].to_vec(),
                last: r.in_state == r.history.len(),
            },
        });
        n
    }

    /// The first prompt chunk waiting request `w` would start with in a step of `budget` tokens, or `None` when it
    /// cannot start in such a step: a request starts only when its first chunk's blocks are free (it never starts
    /// without room to progress), and a re-prefill repeats its first chunk whole, so it waits for a step with that
    /// much budget.
    fn first_chunk(&self, w: &Waiting, budget: usize) -> Option<usize> {
        let first = match w.chunks.first() {
            Some(&c) if c > budget => return None,
            Some(&c) => c,
            None => {
                let end = w.cut.unwrap_or(w.request.prompt.len());
                (end - w.request.restored).min(budget)
            }
        };
        (self.blocks_for(w.request.restored + first) <= self.free_blocks).then_some(first)
    }

    /// Records the token sampled for request `id` in the step just run; `stop` when the coordinator's stop rules
    /// (EOS, stop ids, stop strings) end it. Returns the slot to release when the request finished (here, or by
    /// reaching `max_tokens`). After a chained step ([`Step::chained`]) it is called for each of the sequence's
    /// tokens in order, until one finishes it.
    pub fn sampled(&mut self, id: u64, token: u32, stop: bool) -> Result<Option<usize>, SchedError> {
        let i = self
            .running
            .iter()
            .position(|r| r.id == id)
            .ok_or(SchedError::NotRunning { id })?;
        let r = &mut self.running[i];
        r.generated.push(token);
        if stop || r.generated.len() >= r.max_tokens {
            return Ok(Some(self.finish(i)));
        }
        Ok(None)
    }
}
