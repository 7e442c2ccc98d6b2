//! Sessions: a sequence whose state outlives its requests. A hybrid model's per-sequence state is a few MB whatever
//! the length (plus the attention layers' KV), so instead of re-prefilling a conversation every turn the coordinator
//! keeps, per session, the tokens so far and a host copy of the slot's state taken through the rank interface's
//! snapshot when a turn ends ([`Sessions`]). The next turn restores it into whatever slot is free and prefills only
//! the new tokens; a fork shares it (copy-on-write: a state is never changed, a turn saves a new one). Idle sessions
//! hold no slot, only host memory, capped by a budget that evicts the least recently used idle states; since the
//! copies live in the coordinator they also survive a rank-fault recovery. Each session belongs to an owner (the API
//! key that created it), and to anyone else it does not exist.
//!
//! A session's tokens are the prompt and generated tokens of every turn, in order: the token a turn ended with is
//! fed at the start of the next turn (it was sampled, never run), so a turn may even send no new tokens and simply
//! continue. A turn that fails or is cancelled leaves the session as it was before the turn.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rewind_engine::rank::SlotSnapshot;
use rewind_engine::sample::SamplingParams;
use serde::Serialize;

/// How a session's turns run unless a request says otherwise.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SessionOptions {
    /// Sampling parameters a turn starts from (the front end applies a request's overrides).
    pub defaults: SamplingParams,
    /// Whether the session's turns speculate when the engine does.
    pub speculate: bool,
}

/// A session as clients see it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SessionInfo {
    pub id: String,
    /// Tokens in the session (every turn's prompt and output).
    pub tokens: usize,
    /// Turns completed.
    pub turns: u64,
    /// A turn is running.
    pub busy: bool,
    /// Seconds since the session was created or last ran a turn.
    pub idle_seconds: f64,
    #[serde(skip)]
    pub defaults: SamplingParams,
    pub speculate: bool,
    /// The session this one was forked from.
    pub forked_from: Option<String>,
}

/// Who a session belongs to: the fingerprint of the API key that created it. Every operation on a session names its
/// caller's owner, and a session of another owner behaves exactly like one that does not exist. A server without API
/// keys has one owner ([`SessionOwner::default`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SessionOwner(u128);

impl SessionOwner {
    /// The owner a key fingerprint names (the front end fingerprints its keys; the key itself is never stored).
    pub const fn new(fingerprint: u128) -> Self {
        SessionOwner(fingerprint)
    }
}

/// Why a session operation was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    #[error("session {id} not found: {reason}")]
    NotFound { id: String, reason: String },
    #[error("session {id} is running a turn; wait for it to finish (or cancel it) first")]
    Busy { id: String },
    #[error("the engine holds its limit of {max} sessions; close some first")]
    Limit { max: usize },
    #[error(
        "session {id}'s state ({}) does not fit the session memory budget ({}): {} of it is held by sessions \
         running turns, and every idle session was evicted or would not free enough; close sessions, or raise \
         --session-memory",
        mib(*needed), mib(*budget), mib(*pinned)
    )]
    Memory {
        id: String,
        needed: usize,
        budget: usize,
        pinned: usize,
    },
}

/// Bytes in MiB, for messages.
fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

/// A slot's state at the end of a turn, per rank, and its host bytes. Sessions hold it behind an [`Arc`]: a fork
/// shares its parent's until one of them saves a new one, so the copies cost nothing until they diverge.
#[derive(Debug)]
pub(crate) struct Saved {
    pub ranks: Vec<SlotSnapshot>,
    pub bytes: usize,
}

impl Saved {
    pub fn new(ranks: Vec<SlotSnapshot>) -> Self {
        let bytes = ranks.iter().map(|r| r.bytes() as usize).sum();
        Saved { ranks, bytes }
    }
}

/// A saved state, shared between a session, its forks and the turn running from it.
pub(crate) type SavedState = Arc<Saved>;

/// One session's record.
#[derive(Clone, Debug)]
pub(crate) struct Session {
    pub owner: SessionOwner,
    pub options: SessionOptions,
    /// Every token of the session.
    pub tokens: Vec<u32>,
    /// The state of `tokens[..in_state]`, when one was saved (`None` before the first turn, or when saving failed:
    /// the next turn then prefills every token).
    pub state: Option<(SavedState, usize)>,
    pub turns: u64,
    pub touched: Instant,
    pub forked_from: Option<String>,
    /// The request running a turn, if any (busy while it is live in the coordinator).
    pub turn: Option<u64>,
}

/// Ids of closed or evicted sessions remembered, so that a late client hears why its session is gone.
const GONE_REMEMBERED: usize = 4096;

/// Every session, and why recently removed ones went away.
#[derive(Debug)]
pub(crate) struct Sessions {
    live: HashMap<String, Session>,
    /// Why a session went, told only to its owner (anyone else hears of no such session).
    gone: HashMap<String, (SessionOwner, String)>,
    gone_order: VecDeque<String>,
    max: usize,
    idle_timeout: Option<Duration>,
    /// The most host bytes the saved states may hold together.
    memory: usize,
    /// Bytes of saved states dropped by their last holder since [`Sessions::take_freed`] last ran.
    freed: usize,
}

impl Sessions {
    /// An empty store holding at most `max` sessions whose saved states take at most `memory` host bytes together,
    /// evicting those idle longer than `idle_timeout`.
    pub fn new(max: usize, idle_timeout: Option<Duration>, memory: usize) -> Self {
        Sessions {
            live: HashMap::new(),
            gone: HashMap::new(),
            gone_order: VecDeque::new(),
            max,
            idle_timeout,
            memory,
            freed: 0,
        }
    }

    /// 128 bits from the thread's OS-seeded CSPRNG: an id names a session's whole conversation, so it must not be
    /// guessable from others (ids mixed from a counter were: two gave the next), and another engine's (a restarted
    /// server's) ids do not collide with these.
    fn new_id(&mut self) -> String {
        format!("sess-{:032x}", rand::random::<u128>())
    }

    fn insert(&mut self, s: Session) -> Result<String, SessionError> {
        if self.live.len() >= self.max {
            return Err(SessionError::Limit { max: self.max });
        }
        let id = self.new_id();
        self.live.insert(id.clone(), s);
        Ok(id)
    }

    /// Opens a session of `owner` with no tokens.
    pub fn create(&mut self, owner: SessionOwner, options: SessionOptions) -> Result<String, SessionError> {
        self.insert(Session {
            owner,
            options,
            tokens: Vec::new(),
            state: None,
            turns: 0,
            touched: Instant::now(),
            forked_from: None,
            turn: None,
        })
    }

    /// A copy of `owner`'s session `id` under a new id: its tokens, and its saved state shared rather than copied.
    /// `busy` says whether a request is live.
    pub fn fork(&mut self, owner: SessionOwner, id: &str, busy: impl Fn(u64) -> bool) -> Result<String, SessionError> {
        let s = self.owned(owner, id)?;
        if s.turn.is_some_and(&busy) {
            return Err(SessionError::Busy { id: id.to_string() });
        }
        let copy = Session {
            touched: Instant::now(),
            forked_from: Some(id.to_string()),
            turn: None,
            turns: 0,
            ..s.clone()
        };
        let new = self.insert(copy)?;
        if let Some(s) = self.live.get_mut(id) {
            s.touched = Instant::now();
        }
        Ok(new)
    }

    /// Removes `owner`'s session `id`, remembering why.
    pub fn close(&mut self, owner: SessionOwner, id: &str) -> Result<Session, SessionError> {
        self.owned(owner, id)?;
        self.remove(id, "it was closed".into())
            .ok_or_else(|| self.not_found(owner, id))
    }

    fn remove(&mut self, id: &str, why: String) -> Option<Session> {
        let s = self.live.remove(id)?;
        if self.gone_order.len() >= GONE_REMEMBERED {
            if let Some(old) = self.gone_order.pop_front() {
                self.gone.remove(&old);
            }
        }
        self.gone.insert(id.to_string(), (s.owner, why));
        self.gone_order.push_back(id.to_string());
        self.count_freed(s.state.as_ref().map(|(st, _)| st));
        Some(s)
    }

    /// Counts `state`'s bytes as freed when its holder is the last one (the caller is about to drop it). A turn
    /// running from it holds it too; it is freed uncounted when that turn ends, which only delays the next trim.
    fn count_freed(&mut self, state: Option<&SavedState>) {
        if let Some(st) = state.filter(|st| Arc::strong_count(st) == 1) {
            self.freed += st.bytes;
        }
    }

    /// Bytes of saved states freed since the last call (the coordinator hands memory back to the OS after enough).
    pub fn take_freed(&mut self) -> usize {
        std::mem::take(&mut self.freed)
    }

    /// Why `owner` finds no session `id`: the reason it went if it was theirs and is remembered. Another owner's
    /// session, live or gone, gets the answer of an id never used, so ids do not leak across keys.
    fn not_found(&self, owner: SessionOwner, id: &str) -> SessionError {
        let reason = match self.gone.get(id) {
            Some((o, why)) if *o == owner => why.clone(),
            _ => "no session has this id".into(),
        };
        SessionError::NotFound {
            id: id.to_string(),
            reason,
        }
    }

    /// `owner`'s session `id`, or why they have none.
    pub fn owned(&self, owner: SessionOwner, id: &str) -> Result<&Session, SessionError> {
        match self.live.get(id) {
            Some(s) if s.owner == owner => Ok(s),
            _ => Err(self.not_found(owner, id)),
        }
    }

    /// `owner`'s session `id` for changing.
    pub fn owned_mut(&mut self, owner: SessionOwner, id: &str) -> Result<&mut Session, SessionError> {
        // Made up front: the borrow checker cannot end the map's borrow in the arm that returns it.
        let missing = self.not_found(owner, id);
        match self.live.get_mut(id) {
            Some(s) if s.owner == owner => Ok(s),
            _ => Err(missing),
        }
    }

    /// Session `id` whoever owns it (the engine's own bookkeeping, e.g. a turn's save), or `None` once it is gone.
    pub fn get_mut(&mut self, id: &str) -> Option<&mut Session> {
        self.live.get_mut(id)
    }

    /// Evicts sessions idle past the timeout (never one running a turn); returns how many went.
    pub fn evict_idle(&mut self, busy: impl Fn(u64) -> bool) -> usize {
        let Some(limit) = self.idle_timeout else { return 0 };
        let now = Instant::now();
        let stale: Vec<String> = self
            .live
            .iter()
            .filter(|(_, s)| !s.turn.is_some_and(&busy) && now.duration_since(s.touched) > limit)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &stale {
            let why = format!("it was evicted after {} s idle (the idle timeout)", limit.as_secs_f64());
            self.remove(id, why);
        }
        stale.len()
    }

    /// Makes session `id`'s saved state `state` (of its first `tokens` tokens), within the memory budget: while the
    /// distinct states held would exceed it, the least recently used idle states are evicted with every session
    /// holding them (a state shared by forks is freed only with its last holder, so they go together; a state held
    /// by a session running a turn is never evicted). When even evicting every idle state would not make room,
    /// nothing is evicted, the session keeps its former state, and the error says so. Returns how many sessions went.
    pub fn save_state(
        &mut self,
        id: &str,
        state: SavedState,
        tokens: usize,
        busy: impl Fn(u64) -> bool,
    ) -> Result<usize, SessionError> {
        /// A distinct state other sessions hold.
        struct Held {
            bytes: usize,
            /// The latest use of any of its holders.
            used: Instant,
            /// A holder is running a turn.
            pinned: bool,
            holders: Vec<String>,
        }
        if !self.live.contains_key(id) {
            return Err(SessionError::NotFound {
                id: id.to_string(),
                reason: "it went while its turn ran".into(),
            });
        }
        let mut held: HashMap<*const Saved, Held> = HashMap::new();
        for (sid, s) in &self.live {
            let Some((st, _)) = s.state.as_ref().filter(|_| sid != id) else {
                continue;
            };
            let h = held.entry(Arc::as_ptr(st)).or_insert(Held {
                bytes: st.bytes,
                used: s.touched,
                pinned: false,
                holders: Vec::new(),
            });
            h.used = h.used.max(s.touched);
            h.pinned |= s.turn.is_some_and(&busy);
            h.holders.push(sid.clone());
        }
        let needed = state.bytes;
        let pinned: usize = held.values().filter(|h| h.pinned).map(|h| h.bytes).sum();
        if pinned.saturating_add(needed) > self.memory {
            return Err(SessionError::Memory {
                id: id.to_string(),
                needed,
                budget: self.memory,
                pinned,
            });
        }
        let mut total: usize = held.values().map(|h| h.bytes).sum();
        let mut idle: Vec<Held> = held.into_values().filter(|h| !h.pinned).collect();
        idle.sort_by_key(|h| h.used);
        let mut evicted = 0;
        for h in idle {
            if total + needed <= self.memory {
                break;
            }
            total -= h.bytes;
            let why = format!(
                "it was evicted to keep the saved session states within the session memory budget ({}) \
                 (the least recently used idle sessions go first)",
                mib(self.memory)
            );
            for sid in &h.holders {
                self.remove(sid, why.clone());
            }
            evicted += h.holders.len();
        }
        let s = self.live.get_mut(id).ok_or_else(|| SessionError::NotFound {
            id: id.to_string(),
            reason: "it went while its turn ran".into(),
        })?;
        let old = s.state.replace((state, tokens));
        self.count_freed(old.as_ref().map(|(st, _)| st));
        Ok(evicted)
    }

    /// What `owner` sees of their session `id`.
    pub fn info(&self, owner: SessionOwner, id: &str, busy: impl Fn(u64) -> bool) -> Result<SessionInfo, SessionError> {
        let s = self.owned(owner, id)?;
        Ok(SessionInfo {
            id: id.to_string(),
            tokens: s.tokens.len(),
            turns: s.turns,
            busy: s.turn.is_some_and(busy),
            idle_seconds: s.touched.elapsed().as_secs_f64(),
            defaults: s.options.defaults.clone(),
            speculate: s.options.speculate,
            forked_from: s.forked_from.clone(),
        })
    }

    /// The ids of `owner`'s sessions, sorted.
    pub fn ids(&self, owner: SessionOwner) -> Vec<String> {
        let mut ids: Vec<String> = self
            .live
            .iter()
            .filter(|(_, s)| s.owner == owner)
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    /// Sessions held.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Host bytes held by the saved states, each shared state once (for the operator's metrics).
    pub fn state_bytes(&self) -> usize {
        let mut seen = HashSet::new();
        self.live
            .values()
            .filter_map(|s| s.state.as_ref())
            .filter(|(st, _)| seen.insert(Arc::as_ptr(st)))
            .map(|(st, _)| st.bytes)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANYONE: SessionOwner = SessionOwner(0);

    fn options() -> SessionOptions {
        SessionOptions {
            defaults: SamplingParams::greedy(),
            speculate: true,
        }
    }

    #[test]
    fn ids_are_distinct_and_closed_sessions_say_why() {
        let mut s = Sessions::new(8, None, usize::MAX);
        let a = s.create(ANYONE, options()).unwrap();
        let b = s.create(ANYONE, options()).unwrap();
        assert_ne!(a, b);
        // 128 random bits in hex: consecutive ids share no visible structure.
        for id in [&a, &b] {
            let hex = id.strip_prefix("sess-").expect("prefix");
            assert!(hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
        }
        let same_digits = a.chars().zip(b.chars()).skip(5).filter(|(x, y)| x == y).count();
        assert!(same_digits < 16, "{a} and {b} look related");
        s.close(ANYONE, &a).unwrap();
        match s.owned(ANYONE, &a) {
            Err(SessionError::NotFound { reason, .. }) => assert!(reason.contains("closed"), "{reason}"),
            other => panic!("{other:?}"),
        }
        match s.owned(ANYONE, "sess-nope") {
            Err(SessionError::NotFound { reason, .. }) => assert!(reason.contains("no session"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(s.ids(ANYONE), vec![b]);
    }

    #[test]
    fn the_limit_holds_and_forks_copy_tokens() {
        let mut s = Sessions::new(2, None, usize::MAX);
        let a = s.create(ANYONE, options()).unwrap();
        s.owned_mut(ANYONE, &a).unwrap().tokens = vec![1, 2, 3];
        s.owned_mut(ANYONE, &a).unwrap().turns = 2;
        let f = s.fork(ANYONE, &a, |_| false).unwrap();
        assert_eq!(s.owned(ANYONE, &f).unwrap().tokens, vec![1, 2, 3]);
        assert_eq!(s.owned(ANYONE, &f).unwrap().forked_from.as_deref(), Some(a.as_str()));
        assert_eq!(s.create(ANYONE, options()), Err(SessionError::Limit { max: 2 }));
        // A session whose turn is live cannot be forked; once the turn's request is gone it can.
        s.close(ANYONE, &f).unwrap();
        s.owned_mut(ANYONE, &a).unwrap().turn = Some(7);
        assert_eq!(
            s.fork(ANYONE, &a, |id| id == 7),
            Err(SessionError::Busy { id: a.clone() })
        );
        assert!(s.fork(ANYONE, &a, |_| false).is_ok());
    }

    #[test]
    fn idle_sessions_are_evicted_but_not_busy_ones() {
        let mut s = Sessions::new(8, Some(Duration::from_millis(1)), usize::MAX);
        let a = s.create(ANYONE, options()).unwrap();
        let b = s.create(ANYONE, options()).unwrap();
        s.owned_mut(ANYONE, &b).unwrap().turn = Some(3);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(s.evict_idle(|id| id == 3), 1);
        assert!(s.owned(ANYONE, &b).is_ok());
        match s.owned(ANYONE, &a) {
            Err(SessionError::NotFound { reason, .. }) => assert!(reason.contains("evicted"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    /// A saved state of `floats` floats (one rank, one attention layer).
    fn state(floats: usize) -> SavedState {
        Arc::new(Saved::new(vec![SlotSnapshot {
            form_choice: rewind_engine::decode::FormChoice::Auto,
            form: rewind_engine::state::DecodeForm::Recurrent,
            position: 1,
            ring_capacity: 0,
            ring_len: 0,
            ssm: Vec::new(),
            kv: vec![(vec![0.0; floats / 2], vec![0.0; floats - floats / 2])],
        }]))
    }

    const MB: usize = 1 << 20;

    /// A new session of `owner` holding a saved state of `bytes`.
    fn with_state(s: &mut Sessions, owner: SessionOwner, bytes: usize) -> String {
        let id = s.create(owner, options()).unwrap();
        s.save_state(&id, state(bytes / 4), 1, |_| false).unwrap();
        id
    }

    #[test]
    fn forks_share_their_state_and_closing_the_last_holder_frees_it() {
        let mut s = Sessions::new(8, None, usize::MAX);
        let a = with_state(&mut s, ANYONE, MB);
        assert_eq!(s.state_bytes(), MB);
        let forks: Vec<String> = (0..3).map(|_| s.fork(ANYONE, &a, |_| false).unwrap()).collect();
        // Four sessions, one state: counted (and held) once.
        assert_eq!(s.state_bytes(), MB);
        let shared = Arc::downgrade(&s.owned(ANYONE, &a).unwrap().state.as_ref().unwrap().0);
        assert_eq!(shared.strong_count(), 4);
        // A fork that saves a new state stops sharing; the others still share the old one.
        s.save_state(&forks[0], state(2 * MB / 4), 2, |_| false).unwrap();
        assert_eq!(s.state_bytes(), 3 * MB);
        s.close(ANYONE, &a).unwrap();
        s.close(ANYONE, &forks[1]).unwrap();
        assert_eq!(s.take_freed(), 0, "a fork still holds the state");
        assert!(shared.upgrade().is_some());
        s.close(ANYONE, &forks[2]).unwrap();
        assert!(shared.upgrade().is_none(), "closing the last holder frees the state");
        assert_eq!(s.take_freed(), MB);
        assert_eq!(s.state_bytes(), 2 * MB);
    }

    #[test]
    fn the_memory_budget_evicts_the_least_recently_used_idle_states() {
        let mut s = Sessions::new(16, None, 3 * MB);
        let old = with_state(&mut s, ANYONE, MB);
        let old_fork = s.fork(ANYONE, &old, |_| false).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        let busy = with_state(&mut s, ANYONE, MB);
        s.owned_mut(ANYONE, &busy).unwrap().touched -= Duration::from_secs(60);
        s.owned_mut(ANYONE, &busy).unwrap().turn = Some(9);
        std::thread::sleep(Duration::from_millis(2));
        let recent = with_state(&mut s, ANYONE, MB);
        assert_eq!(s.state_bytes(), 3 * MB);
        // One more MiB: the oldest idle state goes, with both sessions sharing it; the busy one is older but stays.
        let new = s.create(ANYONE, options()).unwrap();
        assert_eq!(s.save_state(&new, state(MB / 4), 1, |q| q == 9), Ok(2));
        assert_eq!(s.state_bytes(), 3 * MB);
        for id in [&old, &old_fork] {
            match s.owned(ANYONE, id) {
                Err(SessionError::NotFound { reason, .. }) => assert!(reason.contains("memory budget"), "{reason}"),
                other => panic!("{other:?}"),
            }
        }
        assert!(s.owned(ANYONE, &busy).is_ok() && s.owned(ANYONE, &recent).is_ok());
        // A session replacing its own state needs room only for the difference.
        assert_eq!(s.save_state(&recent, state(MB / 4), 2, |q| q == 9), Ok(0));
        // More than the budget leaves beside the busy state: refused, nothing evicted, the former state kept.
        let before = s
            .owned(ANYONE, &new)
            .unwrap()
            .state
            .as_ref()
            .map(|(st, n)| (Arc::as_ptr(st), *n));
        match s.save_state(&new, state(5 * MB / 2 / 4), 2, |q| q == 9) {
            Err(e @ SessionError::Memory { needed, pinned, .. }) => {
                assert_eq!((needed, pinned), (5 * MB / 2, MB));
                assert!(e.to_string().contains("--session-memory"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(s.len(), 3);
        let after = s
            .owned(ANYONE, &new)
            .unwrap()
            .state
            .as_ref()
            .map(|(st, n)| (Arc::as_ptr(st), *n));
        assert_eq!(before, after);
        // Once the busy session's turn is over its state may go too.
        assert_eq!(s.save_state(&new, state(5 * MB / 2 / 4), 2, |_| false), Ok(2));
        assert_eq!(s.ids(ANYONE), vec![new]);
    }

    #[test]
    fn sessions_are_invisible_to_other_owners() {
        let (alice, bob) = (SessionOwner::new(1), SessionOwner::new(2));
        let mut s = Sessions::new(8, None, usize::MAX);
        let a = s.create(alice, options()).unwrap();
        let gone = s.create(alice, options()).unwrap();
        s.close(alice, &gone).unwrap();
        let b = s.create(bob, options()).unwrap();
        assert_eq!(s.ids(alice), vec![a.clone()]);
        assert_eq!(s.ids(bob), vec![b.clone()]);
        // Bob hears of Alice's sessions, live or closed, what he hears of an id never used.
        let never = s.owned(bob, "sess-never").unwrap_err().to_string();
        for id in [&a, &gone] {
            let unknown = never.replace("sess-never", id);
            assert_eq!(s.owned(bob, id).unwrap_err().to_string(), unknown);
            assert_eq!(s.info(bob, id, |_| false).unwrap_err().to_string(), unknown);
            assert_eq!(s.fork(bob, id, |_| false).unwrap_err().to_string(), unknown);
            assert_eq!(s.close(bob, id).unwrap_err().to_string(), unknown);
        }
        assert!(s.owned(alice, &a).is_ok());
        assert!(s.owned(alice, &gone).unwrap_err().to_string().contains("closed"));
        // A fork belongs to its parent's owner.
        let f = s.fork(alice, &a, |_| false).unwrap();
        assert!(s.owned(alice, &f).is_ok() && s.owned(bob, &f).is_err());
    }
}
