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

use std::sync::Arc;

use tracing::{debug, warn};

use self::tree::PrefixTree;
use super::CoordinatorState;
use crate::metrics::Metrics;
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

/// The cached states' default host-memory budget: 4 GiB.
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

/// The cache itself: the tree and its settings.
pub(super) struct PrefixCache {
    tree: PrefixTree<SavedState>,
    config: PrefixCacheConfig,
}

impl PrefixCache {
    pub fn new(config: PrefixCacheConfig) -> Self {
        PrefixCache {
            tree: PrefixTree::new(),
            config,
        }
    }

    /// The longest cached prefix of `prompt` of at most `limit` tokens, when it is worth restoring.
    fn lookup(&mut self, prompt: &[u32], limit: usize) -> Option<(SavedState, usize)> {
        if limit < self.config.min_tokens.max(1) {
            return None;
        }
        let (n, state) = self.tree.longest(prompt, limit)?;
        (n >= self.config.min_tokens).then_some((state, n))
    }

    /// Whether a state of exactly `tokens` is worth copying in: long enough, and not cached already (which counts
    /// as a use of the entry there).
    fn wants(&mut self, tokens: &[u32]) -> bool {
        tokens.len() >= self.config.min_tokens.max(1) && !self.tree.contains(tokens)
    }

    /// Caches `state` as the state after `tokens`, evicting the least recently used entries past the budget; returns
    /// how many went. A state larger than the whole budget is not kept.
    fn insert(&mut self, tokens: &[u32], state: SavedState) -> Option<usize> {
        if state.bytes > self.config.memory {
            return None;
        }
        let bytes = state.bytes;
        self.tree.insert(tokens, state, bytes);
        Some(self.tree.evict_to(self.config.memory))
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
    pub(super) fn prefix_hit(&mut self, request: u64, prompt: &[u32], limit: usize) -> Option<(SavedState, usize)> {
        let cache = self.prefix.as_mut()?;
        Metrics::add(&self.metrics.prefix_cache_query_tokens, prompt.len() as u64);
        let hit = cache.lookup(prompt, limit)?;
        Metrics::add(&self.metrics.prefix_cache_hit_tokens, hit.1 as u64);
        debug!(request, cached = hit.1, prompt = prompt.len(), "prefix cache hit");
        Some(hit)
    }

    /// Whether the state of a sequence finishing in `slot` after `tokens` is worth copying into the cache: the cache
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

    /// Caches `state`, the state after `tokens` (shared with whoever else holds it).
    pub(super) fn prefix_insert(&mut self, tokens: &[u32], state: &SavedState) {
        let Some(cache) = self.prefix.as_mut() else { return };
        if !cache.wants(tokens) {
            return;
        }
        match cache.insert(tokens, Arc::clone(state)) {
            Some(evicted) => {
                Metrics::inc(&self.metrics.prefix_cache_inserts);
                Metrics::add(&self.metrics.prefix_cache_evictions, evicted as u64);
                debug!(
                    tokens = tokens.len(),
                    bytes = state.bytes,
                    evicted,
                    "cached a prefix state"
                );
            }
            None => debug!(
                tokens = tokens.len(),
                bytes = state.bytes,
                "a prefix state larger than the whole prefix cache is not kept"
            ),
        }
        self.prefix_gauges();
    }

    /// Copies the state of every sequence in `saves` (finished in this step, slots not yet released) into the
    /// cache. A copy that cannot be taken is a rank fault, as a session's save is.
    pub(super) async fn cache_finished(&mut self, saves: Vec<PrefixSave>) {
        for s in saves {
            match self.settle_snapshot(s.slot, s.tokens.len(), s.verify_at).await {
                Ok(state) => self.prefix_insert(&s.tokens, &state),
                Err(f) => {
                    warn!(fault = %f, "copying a finished sequence's state into the prefix cache failed");
                    self.pending_fault.get_or_insert(f);
                    return;
                }
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
