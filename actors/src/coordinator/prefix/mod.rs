//! Automatic prefix caching: a server-wide radix tree over token ids ([`tree`]) whose entries are saved slot states
//! (the ranks' host snapshots, what a session's turn and a request's forked choices already keep), each the exact
//! state after the tokens on its path. A request whose prompt starts with an entry's tokens starts from that state,
//! restored into its slot as a session's turn is, and prefills only the rest of its prompt.
//!
//! What fills it costs nothing new on the serving path but one host copy per finished sequence: the state of a
//! sequence that finished (its prompt and every generated token but the last, which was sampled and never run) is
//! copied before its slot is released, unless an entry holds those tokens already or they are too few to be worth a
//! restore; a fork prefill's state (`choices.rs`) and a session turn's saved state (`sessions.rs`) go in as they are,
//! shared with their owner.
//!
//! An entry resumes at exactly its own length. Resuming inside it would need the slot's state at an earlier
//! position: input replay's ring gives the SSM state at any position since the checkpoint, but the depthwise conv
//! before the scan reads the `K − 1` conv inputs before the position, and a slot keeps only the latest `K − 1 + T`
//! of those (`engine/src/state/counters.rs`), and a prompt prefilled in the replay form is folded into the
//! checkpoint. So a prompt that leaves a cached path hits at the deepest entry at or before the point it leaves.
//! Entries are kept within a byte budget (`--prefix-cache-gib`), least recently used evicted first; a request that
//! hit holds its state until it ends, whatever the tree does meanwhile.

mod tree;

use std::sync::{Arc, Mutex};

use tracing::{debug, warn};

use self::tree::PrefixTree;
use rewind_engine::sched::{Planned, StepWork};

use super::{CoordinatorState, Fault};
use crate::metrics::Metrics;
use crate::rank_actor::RankActorMsg;
use crate::session::SavedState;

/// The prefix cache's settings; [`super::EngineConfig::prefix_cache`] is `None` when it is off
/// (`--no-enable-prefix-caching`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixCacheConfig {
    /// The most host bytes the cached states may hold together (`--prefix-cache-gib`).
    pub memory: usize,
    /// The fewest tokens worth caching and restoring (`--prefix-cache-min-tokens`): a shorter prefix costs more to
    /// copy back than to prefill.
    pub min_tokens: usize,
}

/// The cached states' default memory budget: 4 GiB (host memory on CPU ranks, device memory on each GPU).
pub const DEFAULT_PREFIX_CACHE_MEMORY: usize = 4 << 30;

/// The default fewest tokens a cached prefix holds.
pub const DEFAULT_PREFIX_MIN_TOKENS: usize = 16;

impl Default for PrefixCacheConfig {
    fn default() -> Self {
        PrefixCacheConfig {
            memory: DEFAULT_PREFIX_CACHE_MEMORY,
            min_tokens: DEFAULT_PREFIX_MIN_TOKENS,
        }
    }
}

/// A state in the ranks' stores (`Rank::store`), under one id on every rank. When its last holder (the tree, or a
/// request that hit it and may need it again after a preemption) lets go, its id is queued for the ranks to free.
#[derive(Debug)]
pub(crate) struct Stored {
    pub(super) id: u64,
    /// The most bytes any rank keeps for it.
    bytes: usize,
    /// The ranks' generation that holds it: a restart loses every stored state.
    pub(super) generation: u64,
    freed: Arc<Mutex<Vec<u64>>>,
}

impl Drop for Stored {
    fn drop(&mut self) {
        if let Ok(mut f) = self.freed.lock() {
            f.push(self.id);
        }
    }
}

/// A shared stored state.
pub(crate) type StoredState = Arc<Stored>;

/// The state a sequence starts from instead of prefilling its first tokens.
#[derive(Clone, Debug)]
pub(crate) enum Start {
    /// A host copy: a session's saved turn, a request's forked prompt.
    Host(SavedState),
    /// A prefix cache entry, in the ranks' stores.
    Stored(StoredState),
}

/// The cache itself: the tree and its settings.
pub(super) struct PrefixCache {
    tree: PrefixTree<StoredState>,
    config: PrefixCacheConfig,
    /// The next id to store a state under.
    next_id: u64,
    /// Ids of stored states no longer held, for the ranks to free.
    freed: Arc<Mutex<Vec<u64>>>,
    /// Bytes per token of the last state stored, to make room for the next one before storing it.
    bytes_per_token: usize,
}

impl PrefixCache {
    pub fn new(config: PrefixCacheConfig) -> Self {
        PrefixCache {
            tree: PrefixTree::new(),
            config,
            next_id: 1,
            freed: Arc::new(Mutex::new(Vec::new())),
            bytes_per_token: 0,
        }
    }

    /// The longest cached prefix of `prompt` of at most `limit` tokens, when it is worth restoring.
    fn lookup(&mut self, prompt: &[u32], limit: usize) -> Option<(StoredState, usize)> {
        if limit < self.config.min_tokens.max(1) {
            return None;
        }
        let (n, state) = self.tree.longest(prompt, limit)?;
        (n >= self.config.min_tokens).then_some((state, n))
    }

    /// Whether a state of exactly `tokens` is worth storing: long enough, and not cached already (which counts
    /// as a use of the entry there).
    fn wants(&mut self, tokens: &[u32]) -> bool {
        tokens.len() >= self.config.min_tokens.max(1) && !self.tree.contains(tokens)
    }

    /// Caches `state` as the state after `tokens`, evicting the least recently used entries past the budget; returns
    /// how many went.
    fn insert(&mut self, tokens: &[u32], state: StoredState) -> usize {
        let bytes = state.bytes;
        self.bytes_per_token = bytes.div_ceil(tokens.len().max(1));
        self.tree.insert(tokens, state, bytes);
        self.tree.evict_to(self.config.memory)
    }

    /// Ids whose states the ranks may free.
    fn take_freed(&self) -> Vec<u64> {
        self.freed
            .lock()
            .map(|mut f| std::mem::take(&mut *f))
            .unwrap_or_default()
    }
}

/// A sequence that finished in the step just run, whose state may be cached before its slot is released.
pub(super) struct PrefixSave {
    pub slot: usize,
    /// The tokens the slot's state holds (the sequence's history but its last token).
    pub tokens: Vec<u32>,
    /// The position of the verify it finished in, if it did (see [`super::sessions::Save::verify_at`]).
    pub verify_at: Option<usize>,
}

impl CoordinatorState {
    /// The state a request with `prompt` starts from, when the cache holds a prefix of at most `limit` of its
    /// tokens: the state and its length. Counts the lookup's tokens.
    pub(super) fn prefix_hit(&mut self, request: u64, prompt: &[u32], limit: usize) -> Option<(Start, usize)> {
        let cache = self.prefix.as_mut()?;
        Metrics::add(&self.metrics.prefix_cache_query_tokens, prompt.len() as u64);
        let (state, n) = cache.lookup(prompt, limit)?;
        Metrics::add(&self.metrics.prefix_cache_hit_tokens, n as u64);
        debug!(request, cached = n, prompt = prompt.len(), "prefix cache hit");
        Some((Start::Stored(state), n))
    }

    /// Where a request with `prompt`, `restored` of whose tokens come from a cached state, leaves the cache's paths,
    /// when a state there is worth storing: its prompt chunk is then cut there ([`Scheduler::cut_at`]) and the state
    /// after the chunk stored ([`Self::note_branch_points`]), so that the prompts sharing that start (a common system
    /// prompt, a document asked about twice, the same prompt sent again) hit it.
    ///
    /// [`Scheduler::cut_at`]: rewind_engine::sched::Scheduler::cut_at
    pub(super) fn prefix_branch(&mut self, prompt: &[u32], restored: usize) -> Option<usize> {
        let cache = self.prefix.as_ref()?;
        let at = cache.tree.common(prompt).min(prompt.len().saturating_sub(1));
        let min = cache.config.min_tokens.max(1);
        (at >= min && at >= restored + min).then_some(at)
    }

    /// Queues for storing the state of every sequence whose prompt chunk in this step ended at its cut.
    pub(super) fn note_branch_points(&mut self, work: &[Planned]) {
        for p in work {
            let StepWork::Prefill {
                position,
                tokens,
                last: false,
            } = &p.work
            else {
                continue;
            };
            let end = position + tokens.len();
            let Some(l) = self.live.get(&p.id).filter(|l| l.cut == Some(end)) else {
                continue;
            };
            let tokens = l.history[..end].to_vec();
            if self.prefix_wants(p.slot, &tokens, None) {
                self.prefix_saves.push(PrefixSave {
                    slot: p.slot,
                    tokens,
                    verify_at: None,
                });
            }
        }
    }

    /// Whether the state of a sequence finishing in `slot` after `tokens` is worth storing in the cache: the cache
    /// is on, wants those tokens, and the slot holds exactly them (a chain of decodes may have run past a stop; a
    /// verify the sequence finished in is settled first, as a session's turn is).
    pub(super) fn prefix_wants(&mut self, slot: usize, tokens: &[u32], verify_at: Option<usize>) -> bool {
        let Some(cache) = self.prefix.as_mut() else {
            return false;
        };
        let keep = tokens.len();
        let exact = match (self.books.len(slot), self.books.pending(slot), verify_at) {
            (Ok(len), Ok(0), _) => len == keep,
            (Ok(len), Ok(pending), Some(at)) => len == at && keep > at && keep - at <= pending,
            _ => false,
        };
        exact && cache.wants(tokens)
    }

    /// Stores the state of `slot`, which holds exactly `tokens`, in the ranks' stores and caches it (a device copy on
    /// GPU ranks). When a store has no room, least recently used entries are evicted until it has; a state that does
    /// not fit an empty store is not kept. A failed call is a rank fault.
    pub(super) async fn prefix_store(&mut self, slot: usize, tokens: &[u32]) -> Result<(), Fault> {
        let Some(cache) = self.prefix.as_mut() else {
            return Ok(());
        };
        if !cache.wants(tokens) {
            return Ok(());
        }
        // Room for a state like the last one first, so that a full store rarely costs a second call.
        let guess = cache.bytes_per_token.saturating_mul(tokens.len());
        let evicted = cache.tree.evict_to(cache.config.memory.saturating_sub(guess));
        Metrics::add(&self.metrics.prefix_cache_evictions, evicted as u64);
        loop {
            self.free_stored().await?;
            let cache = self.prefix.as_mut().ok_or(Fault::Stopped(0))?;
            let id = cache.next_id;
            cache.next_id += 1;
            let g = self.ranks.as_ref().ok_or(Fault::Stopped(0))?;
            let kept = g
                .call(|reply| RankActorMsg::Store(slot, id, reply), self.config.step_deadline)
                .await?;
            let cache = self.prefix.as_mut().ok_or(Fault::Stopped(0))?;
            let state = Arc::new(Stored {
                id,
                bytes: kept.iter().map(|b| b.unwrap_or(0) as usize).max().unwrap_or(0),
                generation: self.generation,
                freed: cache.freed.clone(),
            });
            if kept.iter().all(Option::is_some) {
                let bytes = state.bytes;
                let evicted = cache.insert(tokens, state);
                Metrics::inc(&self.metrics.prefix_cache_inserts);
                Metrics::add(&self.metrics.prefix_cache_evictions, evicted as u64);
                debug!(tokens = tokens.len(), bytes, evicted, "cached a prefix state");
                break;
            }
            // A store without room (the others', if any kept it, freed with `state`): make room and try again.
            drop(state);
            if cache.tree.len() == 0 {
                debug!(
                    tokens = tokens.len(),
                    "a prefix state larger than the whole store is not kept"
                );
                break;
            }
            let evicted = cache.tree.evict_to(cache.tree.bytes().saturating_sub(1));
            Metrics::add(&self.metrics.prefix_cache_evictions, evicted as u64);
        }
        self.prefix_gauges();
        Ok(())
    }

    /// Frees on the ranks the stored states no longer held.
    pub(super) async fn free_stored(&mut self) -> Result<(), Fault> {
        let Some(cache) = self.prefix.as_ref() else {
            return Ok(());
        };
        let ids = cache.take_freed();
        if ids.is_empty() {
            return Ok(());
        }
        let g = self.ranks.as_ref().ok_or(Fault::Stopped(0))?;
        g.call(
            |reply| RankActorMsg::DropStored(ids.clone(), reply),
            self.config.step_deadline,
        )
        .await?;
        Ok(())
    }

    /// Forgets every stored state (the ranks restarted without them): the cache empties, and a queued sequence
    /// that was to start from one prefills its whole prompt instead.
    pub(super) fn lose_stored(&mut self) {
        let Some(cache) = self.prefix.as_mut() else { return };
        cache.tree.clear();
        let generation = self.generation;
        let lost: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, l)| matches!(&l.fork, Some((Start::Stored(s), _)) if s.generation != generation))
            .map(|(&id, _)| id)
            .collect();
        for id in lost {
            if let Some(l) = self.live.get_mut(&id) {
                l.fork = None;
                l.cached = 0;
            }
            self.sched.unrestore(id);
        }
        // The ids the tree and those requests held: the restarted ranks never had them.
        if let Some(cache) = self.prefix.as_ref() {
            cache.take_freed();
        }
        self.prefix_gauges();
    }

    /// Stores the state of every sequence in `saves` (finished in this step, slots not yet released) in the
    /// cache. A state that cannot be taken is a rank fault, as a session's save is.
    pub(super) async fn cache_finished(&mut self, saves: Vec<PrefixSave>) {
        for s in saves {
            let stored = match self.settle(s.slot, s.tokens.len(), s.verify_at).await {
                Ok(()) => self.prefix_store(s.slot, &s.tokens).await,
                Err(f) => Err(f),
            };
            if let Err(f) = stored {
                warn!(fault = %f, "storing a finished sequence's state in the prefix cache failed");
                self.pending_fault.get_or_insert(f);
                return;
            }
        }
    }

    fn prefix_gauges(&self) {
        if let Some(cache) = &self.prefix {
            Metrics::set(&self.metrics.prefix_cache_states, cache.tree.len() as u64);
            Metrics::set(&self.metrics.prefix_cache_bytes, cache.tree.bytes() as u64);
        }
    }
}
