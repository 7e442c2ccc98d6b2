//! The draft-model drafter: a separate, smaller checkpoint (any supported family, sharing the target's tokenizer)
//! decoded on the CPU proposes the drafts.
//!
//! One [`DraftModel`] is loaded per server: one CPU [`Decoder`] (tensor parallelism 1) with a slot per concurrent
//! request. Each request opens a [`DraftModelDrafter`] session on it ([`DraftModel::session`]), which holds a slot
//! until it is dropped.
//!
//! Rollback goes through the decode forms' verify / commit, not snapshots. A session's slot decodes in the `replay`
//! form and keeps the tokens it has committed and those of its last verify, still pending. Each proposal:
//! 1. commits the part of the pending verify that the token stream kept (the accepted drafts; a commit of 0 when
//!    none was) and restarts the slot if its committed tokens are no longer a prefix of the stream (a coordinator
//!    only appends, so this is for robustness);
//! 2. catches up: the stream's uncommitted tokens but the last go through a verify committed whole (or a prefill
//!    when they are more than a verify takes) unless they fit in the drafting verifies below;
//! 3. drafts: step `j` commits 0 of the previous step's verify, verifies `[rest…, d_1 … d_{j−1}]` (the uncommitted
//!    tail of the stream, then the drafts so far) and picks `d_j` from the last row's logits (the head runs over
//!    that row alone).
//!
//! Batched drafting: the coordinator announces every sequence's proposal first ([`Drafter::prepare`], queued on the
//! thread), then asks for each. The first ask runs all the queued proposals together: each slot syncs and catches
//! up on its own, then draft step `j` of every slot still drafting is one batched verify, so a step of `B`
//! sequences reads the draft model's weights once per draft rather than `B` times.
//!
//! Why re-verify a growing window instead of decoding one token per draft: a replay verify reads the slot's
//! checkpoint plus its input ring whatever the window's length, so each draft costs about one decode step's weight
//! and state traffic, and nothing is ever written to the checkpoint; the drafts the target rejects are dropped by a
//! pointer move at the next proposal's commit, with no snapshot to take or restore.
//!
//! The decoder is sized for the spec window: `max_verify = window + 2` (the last token of the stream, a draft the
//! target accepted whole with its bonus token, and `window − 1` drafts) and a ring of at least `2·max_verify`. A
//! proposal drafts fewer tokens rather than fail near the context limit or when the catch-up leaves no room.
//!
//! Drafts are greedy (the argmax, lowest id on ties; `probs: None`) at temperature 0, else drawn from the draft
//! model's distribution after the [`DraftSampling`] filters, with their probabilities over the whole vocabulary.
//!
//! The [`Decoder`] is not `Send` (its communicator is not), so it cannot sit in a mutex shared between requests: it
//! lives on a thread of its own, which runs the sessions' operations one at a time in the order they were asked for
//! (what a mutex would give), each proposal blocking its caller until its drafts are ready.

mod worker;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Sender;

use self::worker::Worker;
use super::{Draft, DraftInput, Drafter};
use crate::decode::{Decoder, DecoderConfig};
use crate::error::{EngineError, Result};
use crate::model::ModelConfig;
use crate::sample::SamplingParams;
use crate::shard::ShardedModel;
use crate::state::DEFAULT_BUFFER_LEN;

/// How a session picks its drafts.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftSampling {
    /// 0: greedy drafts (the argmax); > 0: drafts drawn from the draft model's logits divided by this. Finite, ≥ 0.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables the filter.
    pub top_k: usize,
    /// Nucleus filter: the smallest most-likely set whose probability reaches `top_p`. In (0, 1]; 1 = off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` × the top token's. In [0, 1]; 0 = off.
    pub min_p: f32,
    /// Seed of the draws (`Sampler::draw_at(seed, i)` for the session's `i`-th draw). It should not be the seed of
    /// the target's acceptance draws: a draft correlated with the uniform that tests it biases the output.
    pub seed: u64,
}

impl Default for DraftSampling {
    fn default() -> Self {
        Self::greedy()
    }
}

impl DraftSampling {
    /// Greedy drafts.
    pub fn greedy() -> Self {
        DraftSampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }

    /// The target's temperature and filters, drawn from `seed`: a draft distribution shaped like the target's
    /// accepts more often. The repetition penalty is left out; acceptance only needs the drafts' true `q`.
    pub fn from_params(params: &SamplingParams, seed: u64) -> Self {
        DraftSampling {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
            min_p: params.min_p,
            seed,
        }
    }

    /// Checks the numeric ranges.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &str, requirement: &str, value: f32| {
            Err(EngineError::InvalidInput(format!(
                "draft sampling: {name} must be {requirement}, got {value}"
            )))
        };
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return bad("temperature", "a finite number >= 0", t);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "in (0, 1]", self.top_p);
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return bad("min_p", "in [0, 1]", self.min_p);
        }
        Ok(())
    }
}

/// An operation run on the draft model's thread.
type Job = Box<dyn FnOnce(&mut Worker) + Send>;

/// A draft checkpoint loaded as one CPU decoder with a slot per concurrent session, shared (`Arc`) by the sessions
/// ([`DraftModel::session`]). Its decoder lives on a thread of its own (see the module docs), stopped when the last
/// `Arc` is dropped.
pub struct DraftModel {
    /// `None` only while dropping: closing the channel stops the thread.
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    dir: PathBuf,
    config: ModelConfig,
    slots: usize,
    window: usize,
    max_verify: usize,
    max_context: usize,
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModel")
            .field("dir", &self.dir)
            .field("slots", &self.slots)
            .field("window", &self.window)
            .field("max_verify", &self.max_verify)
            .field("max_context", &self.max_context)
            .finish_non_exhaustive()
    }
}

impl DraftModel {
    /// Loads the checkpoint in `dir` as a CPU decoder of `slots` sessions of up to `max_context` tokens (capped at
    /// the draft model's `max_position_embeddings`) drafting up to `window` tokens per proposal. The draft model's
    /// vocabulary must be the target's (`target_vocab` ids); with `target_dir`, their `tokenizer.json` files (when
    /// both have one) must also map the same tokens to the same ids.
    pub fn load(
        dir: &Path,
        target_vocab: usize,
        slots: usize,
        max_context: usize,
        window: usize,
        target_dir: Option<&Path>,
    ) -> Result<Arc<DraftModel>> {
        let bad = |m: String| Err(EngineError::InvalidInput(m));
        if slots == 0 {
            return bad("the draft model needs at least 1 slot".into());
        }
        if window == 0 {
            return bad("the draft model's window must be at least 1 token".into());
        }
        if max_context == 0 {
            return bad("the draft model's context must be at least 1 token".into());
        }
        // The config is read first so that a wrong model is refused before its weights are loaded.
        let config = ModelConfig::from_dir(dir)?;
        if config.vocab_size != target_vocab {
            return bad(format!(
                "the draft model in {} has a vocabulary of {} tokens, the target's has {target_vocab}; a draft \
                 model must share the target's tokenizer",
                dir.display(),
                config.vocab_size
            ));
        }
        if let Some(target) = target_dir {
            check_tokenizers(dir, target)?;
        }
        let max_verify = window
            .checked_add(2)
            .ok_or_else(|| EngineError::InvalidInput(format!("a window of {window} tokens is too large")))?;
        let decoder_config = DecoderConfig {
            slots,
            buffer_len: DEFAULT_BUFFER_LEN.max(2 * max_verify),
            max_verify,
            max_context,
            // Draft sequences are replay only: a threshold of 0 keeps the kv-only ring from sizing the ring rows.
            kv_only_threshold: Some(0),
        };
        let (ready_tx, ready_rx) = crossbeam_channel::bounded::<Result<usize>>(1);
        let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded::<Job>();
        let model_dir = dir.to_path_buf();
        let thread = std::thread::Builder::new()
            .name("draft-model".into())
            .spawn(move || {
                let built = ShardedModel::from_dir(&model_dir, 1, 0).and_then(|m| Decoder::single(m, decoder_config));
                let mut worker = match built {
                    Ok(decoder) => {
                        let _ = ready_tx.send(Ok(decoder.config().max_context));
                        Worker::new(decoder)
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                // Ends when the model is dropped (the sender closes).
                for job in jobs_rx {
                    job(&mut worker);
                }
            })
            .map_err(|e| EngineError::io(dir, e))?;
        let max_context = match ready_rx.recv() {
            Ok(Ok(context)) => context,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(stopped(dir));
            }
        };
        Ok(Arc::new(DraftModel {
            jobs: Some(jobs_tx),
            thread: Some(thread),
            dir: dir.to_path_buf(),
            config,
            slots,
            window,
            max_verify,
            max_context,
        }))
    }

    /// A drafter for one request, on a slot of its own until it is dropped. An error when every slot is taken.
    pub fn session(self: &Arc<Self>, sampling: DraftSampling) -> Result<DraftModelDrafter> {
        sampling.validate()?;
        let opened = sampling.clone();
        let slot = self.call(move |w| w.open(opened))??;
        Ok(DraftModelDrafter {
            model: Arc::clone(self),
            slot,
            sampling,
        })
    }

    /// The checkpoint's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The draft model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Sessions that can be open at once.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The most drafts one proposal was sized for.
    pub fn window(&self) -> usize {
        self.window
    }

    /// The decoder's largest verify (`window + 2`).
    pub fn max_verify(&self) -> usize {
        self.max_verify
    }

    /// The longest stream a session drafts after (the requested context, capped at the model's).
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Runs `job` on the draft model's thread and waits for its result.
    fn call<R: Send + 'static>(&self, job: impl FnOnce(&mut Worker) -> R + Send + 'static) -> Result<R> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.post(move |w| {
            // The caller only stops waiting by being gone; nothing to do then.
            let _ = tx.send(job(w));
        })?;
        rx.recv().map_err(|_| stopped(&self.dir))
    }

    /// Queues `job` on the draft model's thread without waiting.
    fn post(&self, job: impl FnOnce(&mut Worker) + Send + 'static) -> Result<()> {
        let jobs = self.jobs.as_ref().ok_or_else(|| stopped(&self.dir))?;
        jobs.send(Box::new(job)).map_err(|_| stopped(&self.dir))
    }
}

impl Drop for DraftModel {
    fn drop(&mut self) {
        // Closing the queue ends the thread's loop once the queued jobs (a last session's release) have run.
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The error of an operation whose thread has stopped (a panic in the decoder ended it).
fn stopped(dir: &Path) -> EngineError {
    EngineError::Communicator(format!(
        "the draft model's thread ({}) has stopped; the draft model must be reloaded",
        dir.display()
    ))
}

/// Checks that the `tokenizer.json` files of `draft` and `target`, when both directories have one, map the same
/// tokens to the same ids: the drafter hands token ids between the models, so the id ↔ token map is what must agree
/// (byte-equal files agree without parsing).
fn check_tokenizers(draft: &Path, target: &Path) -> Result<()> {
    let (draft_file, target_file) = (draft.join("tokenizer.json"), target.join("tokenizer.json"));
    if !draft_file.is_file() || !target_file.is_file() {
        return Ok(());
    }
    let read = |p: &Path| std::fs::read(p).map_err(|e| EngineError::io(p, e));
    let (draft_bytes, target_bytes) = (read(&draft_file)?, read(&target_file)?);
    if draft_bytes == target_bytes {
        return Ok(());
    }
    let vocab = |p: &Path, bytes: &[u8]| -> Result<HashMap<String, u32>> {
        tokenizers::Tokenizer::from_bytes(bytes)
            .map(|t| t.get_vocab(true))
            .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", p.display())))
    };
    let (draft_vocab, target_vocab) = (vocab(&draft_file, &draft_bytes)?, vocab(&target_file, &target_bytes)?);
    if draft_vocab == target_vocab {
        return Ok(());
    }
    Err(EngineError::InvalidInput(format!(
        "the draft model in {} has a different tokenizer from the target's in {} ({}); a draft model must share the \
         target's tokenizer",
        draft.display(),
        target.display(),
        first_difference(&draft_vocab, &target_vocab)
    )))
}

/// The first token (in string order) that two different vocabularies map differently, for the error message.
fn first_difference(draft: &HashMap<String, u32>, target: &HashMap<String, u32>) -> String {
    let mut tokens: Vec<&String> = draft.keys().chain(target.keys()).collect();
    tokens.sort_unstable();
    tokens.dedup();
    let id = |v: Option<&u32>| v.map_or_else(|| "absent".to_string(), |i| format!("id {i}"));
    tokens
        .into_iter()
        .find(|t| draft.get(*t) != target.get(*t))
        .map_or_else(
            || format!("{} tokens against {}", draft.len(), target.len()),
            |t| {
                format!(
                    "token {t:?} is {} in the draft's and {} in the target's",
                    id(draft.get(t)),
                    id(target.get(t))
                )
            },
        )
}

/// A request's draft-model drafter: a slot of the shared [`DraftModel`], released when dropped.
pub struct DraftModelDrafter {
    model: Arc<DraftModel>,
    slot: usize,
    sampling: DraftSampling,
}

impl std::fmt::Debug for DraftModelDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModelDrafter")
            .field("dir", &self.model.dir)
            .field("slot", &self.slot)
            .field("sampling", &self.sampling)
            .finish()
    }
}

impl DraftModelDrafter {
    /// The draft model's slot this session holds.
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// How the session picks its drafts.
    pub fn sampling(&self) -> &DraftSampling {
        &self.sampling
    }

    /// The shared draft model.
    pub fn model(&self) -> &Arc<DraftModel> {
        &self.model
    }
}

impl Drafter for DraftModelDrafter {
    fn name(&self) -> &'static str {
        "draft"
    }

    fn propose(&mut self, input: &DraftInput<'_>) -> Result<Draft> {
        // The job outlives this borrow as far as the compiler knows, so it takes its own copy of the stream.
        let tokens = input.tokens.to_vec();
        let (slot, max) = (self.slot, input.max);
        self.model.call(move |w| w.propose(slot, &tokens, max))?
    }

    fn prepare(&mut self, input: &DraftInput<'_>) -> Result<()> {
        // Queued, not awaited: the thread runs jobs in order, so the proposals that follow find it queued.
        let tokens = input.tokens.to_vec();
        let (slot, max) = (self.slot, input.max);
        self.model.post(move |w| w.queue(slot, tokens, max))
    }
}

impl Drop for DraftModelDrafter {
    fn drop(&mut self) {
        let slot = self.slot;
        // Queued, not awaited: the thread runs jobs in order, so a session opened after this drop finds the slot
        // free. A stopped thread has nothing left to release.
        let _ = self.model.post(move |w| w.close(slot));
    }
}
