//! Sessions: a sequence whose state outlives its requests. A hybrid model's per-sequence state is a few MB whatever
//! the length (plus the attention layers' KV), so instead of re-prefilling a conversation every turn the coordinator
//! keeps, per session, the tokens so far and a host copy of the slot's state taken through the rank interface's
//! snapshot when a turn ends ([`Sessions`]). The next turn restores it into whatever slot is free and prefills only
//! the new tokens; a fork copies it. Idle sessions hold no slot (only host memory), so they do not limit batching;
//! since the copies live in the coordinator they also survive a rank-fault recovery.
//!
//! A session's tokens are the prompt and generated tokens of every turn, in order: the token a turn ended with is
//! fed at the start of the next turn (it was sampled, never run), so a turn may even send no new tokens and simply
//! continue. A turn that fails or is cancelled leaves the session as it was before the turn.

use std::collections::{HashMap, VecDeque};
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

/// Why a session operation was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    #[error("session {id} not found: {reason}")]
    NotFound { id: String, reason: String },
    #[error("session {id} is running a turn; wait for it to finish (or cancel it) first")]
    Busy { id: String },
    #[error("the engine holds its limit of {max} sessions; close some first")]
    Limit { max: usize },
}

/// Per rank, the slot's state at the end of the last turn.
pub(crate) type SavedState = Arc<Vec<SlotSnapshot>>;

/// One session's record.
#[derive(Clone, Debug)]
pub(crate) struct Session {
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
    gone: HashMap<String, String>,
    gone_order: VecDeque<String>,
    max: usize,
    idle_timeout: Option<Duration>,
}

impl Sessions {
    /// An empty store holding at most `max` sessions, evicting those idle longer than `idle_timeout`.
    pub fn new(max: usize, idle_timeout: Option<Duration>) -> Self {
        Sessions {
            live: HashMap::new(),
            gone: HashMap::new(),
            gone_order: VecDeque::new(),
            max,
            idle_timeout,
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

    /// Opens a session with no tokens.
    pub fn create(&mut self, options: SessionOptions) -> Result<String, SessionError> {
        self.insert(Session {
            options,
            tokens: Vec::new(),
            state: None,
            turns: 0,
            touched: Instant::now(),
            forked_from: None,
            turn: None,
        })
    }

    /// A copy of session `id` (its tokens and saved state) under a new id. `busy` says whether a request is live.
    pub fn fork(&mut self, id: &str, busy: impl Fn(u64) -> bool) -> Result<String, SessionError> {
        let s = self.get(id)?;
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

    /// Removes session `id`, remembering why.
    pub fn close(&mut self, id: &str) -> Result<Session, SessionError> {
        self.remove(id, "it was closed".into())
            .ok_or_else(|| not_found(&self.gone, id))
    }

    fn remove(&mut self, id: &str, why: String) -> Option<Session> {
        let s = self.live.remove(id)?;
        if self.gone_order.len() >= GONE_REMEMBERED {
            if let Some(old) = self.gone_order.pop_front() {
                self.gone.remove(&old);
            }
        }
        self.gone.insert(id.to_string(), why);
        self.gone_order.push_back(id.to_string());
        Some(s)
    }

    /// Session `id`, or why there is none.
    pub fn get(&self, id: &str) -> Result<&Session, SessionError> {
        self.live.get(id).ok_or_else(|| not_found(&self.gone, id))
    }

    /// Session `id` for changing.
    pub fn get_mut(&mut self, id: &str) -> Result<&mut Session, SessionError> {
        self.live.get_mut(id).ok_or_else(|| not_found(&self.gone, id))
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

    /// What clients see of session `id`.
    pub fn info(&self, id: &str, busy: impl Fn(u64) -> bool) -> Result<SessionInfo, SessionError> {
        let s = self.get(id)?;
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

    /// Every session's id, sorted.
    pub fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.live.keys().cloned().collect();
        ids.sort();
        ids
    }

    /// Sessions held.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Host bytes held by the saved states (for the operator's metrics).
    pub fn state_bytes(&self) -> usize {
        self.live
            .values()
            .filter_map(|s| s.state.as_ref())
            .map(|(st, _)| st.iter().map(snapshot_bytes).sum::<usize>())
            .sum()
    }
}

/// Why there is no session `id`: the reason it went, if remembered.
fn not_found(gone: &HashMap<String, String>, id: &str) -> SessionError {
    SessionError::NotFound {
        id: id.to_string(),
        reason: gone.get(id).cloned().unwrap_or_else(|| "no session has this id".into()),
    }
}

/// The host bytes of one rank's slot snapshot.
fn snapshot_bytes(s: &SlotSnapshot) -> usize {
    let ssm: usize = s
        .ssm
        .iter()
        .map(|l| 4 * (l.state.len() + l.conv.len() + l.ring.len()))
        .sum();
    let kv: usize = s.kv.iter().map(|(k, v)| 4 * (k.len() + v.len())).sum();
    ssm + kv
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> SessionOptions {
        SessionOptions {
            defaults: SamplingParams::greedy(),
            speculate: true,
        }
    }

    #[test]
    fn ids_are_distinct_and_closed_sessions_say_why() {
        let mut s = Sessions::new(8, None);
        let a = s.create(options()).unwrap();
        let b = s.create(options()).unwrap();
        assert_ne!(a, b);
        // 128 random bits in hex: consecutive ids share no visible structure.
        for id in [&a, &b] {
            let hex = id.strip_prefix("sess-").expect("prefix");
            assert!(hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
        }
        let same_digits = a.chars().zip(b.chars()).skip(5).filter(|(x, y)| x == y).count();
        assert!(same_digits < 16, "{a} and {b} look related");
        s.close(&a).unwrap();
        match s.get(&a) {
            Err(SessionError::NotFound { reason, .. }) => assert!(reason.contains("closed"), "{reason}"),
            other => panic!("{other:?}"),
        }
        match s.get("sess-nope") {
            Err(SessionError::NotFound { reason, .. }) => assert!(reason.contains("no session"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(s.ids(), vec![b]);
    }

    #[test]
    fn the_limit_holds_and_forks_copy_tokens() {
        let mut s = Sessions::new(2, None);
        let a = s.create(options()).unwrap();
        s.get_mut(&a).unwrap().tokens = vec![1, 2, 3];
        s.get_mut(&a).unwrap().turns = 2;
        let f = s.fork(&a, |_| false).unwrap();
        assert_eq!(s.get(&f).unwrap().tokens, vec![1, 2, 3]);
        assert_eq!(s.get(&f).unwrap().forked_from.as_deref(), Some(a.as_str()));
        assert_eq!(s.create(options()), Err(SessionError::Limit { max: 2 }));
        // A session whose turn is live cannot be forked; once the turn's request is gone it can.
        s.close(&f).unwrap();
        s.get_mut(&a).unwrap().turn = Some(7);
        assert_eq!(s.fork(&a, |id| id == 7), Err(SessionError::Busy { id: a.clone() }));
        assert!(s.fork(&a, |_| false).is_ok());
    }

    #[test]
    fn idle_sessions_are_evicted_but_not_busy_ones() {
        let mut s = Sessions::new(8, Some(Duration::from_millis(1)));
        let a = s.create(options()).unwrap();
        let b = s.create(options()).unwrap();
        s.get_mut(&b).unwrap().turn = Some(3);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(s.evict_idle(|id| id == 3), 1);
        assert!(s.get(&b).is_ok());
        match s.get(&a) {
            Err(SessionError::NotFound { reason, .. }) => assert!(reason.contains("evicted"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }
}
