//! What crosses the process boundary between the coordinator and a rank's worker process: the worker actor's
//! messages ([`WorkerMsg`], serialized by `ractor_cluster`'s derive) and their payloads ([`Wire`], bincode).

use ractor::{BytesConvertable, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use rewind_engine::rank::{RankHealth, RankInfo, SlotSnapshot, StepOut, StepPlan};
use rewind_engine::EngineError;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// A rank's error as it crosses the boundary: the kinds the coordinator tells apart survive, the rest as text.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RemoteError {
    /// The rank panicked inside the call (its thread, and with it the worker, is ending).
    Panicked { rank: usize, message: String },
    /// The rank's thread has stopped and dropped the call: the coordinator hears a stopped rank, as in-process.
    Stopped,
    /// Any other error, as the rank wrote it.
    Other(String),
}

impl From<EngineError> for RemoteError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::RankPanicked { rank, message } => RemoteError::Panicked { rank, message },
            e => RemoteError::Other(e.to_string()),
        }
    }
}

impl RemoteError {
    /// The coordinator's error for it (`None`: the rank stopped; drop the caller's reply).
    pub fn into_engine(self) -> Option<EngineError> {
        match self {
            RemoteError::Panicked { rank, message } => Some(EngineError::RankPanicked { rank, message }),
            RemoteError::Stopped => None,
            RemoteError::Other(m) => Some(EngineError::Remote(m)),
        }
    }
}

/// A payload or answer, bincode-encoded. A payload that does not decode arrives as an error naming why, rather than
/// panicking inside the cluster's session actor.
pub struct Wire<T>(pub Result<T, RemoteError>);

impl<T> Wire<T> {
    /// A value to send.
    pub fn ok(v: T) -> Self {
        Wire(Ok(v))
    }
}

impl<T: Serialize + DeserializeOwned> BytesConvertable for Wire<T> {
    fn into_bytes(self) -> Vec<u8> {
        match bincode::serialize(&self.0) {
            Ok(b) => b,
            // Our own types always encode; should one not, the peer gets the reason instead of a value.
            Err(e) => {
                let err: Result<T, RemoteError> = Err(RemoteError::Other(format!("encoding a message: {e}")));
                bincode::serialize(&err).unwrap_or_default()
            }
        }
    }

    fn from_bytes(bytes: Vec<u8>) -> Self {
        Wire(bincode::deserialize(&bytes).unwrap_or_else(|e| {
            Err(RemoteError::Other(format!(
                "a message from the other side of the process boundary did not decode ({e}): are both sides the \
                 same rewind binary?"
            )))
        }))
    }
}

/// What a worker needs to load its rank.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LoadArgs {
    /// Rank 0's rendezvous address ([`WorkerMsg::Listen`]); rank 0 ignores it.
    pub rendezvous: String,
    /// The engine's `--inject-fault` specs (`RANK:KIND@STEP`); step indices never repeat, so a fault that fired
    /// before a restart does not fire again.
    pub faults: Vec<String>,
}

/// A message to a rank's worker actor: the rank interface of [`crate::rank_actor::RankActorMsg`], over the wire.
#[derive(RactorClusterMessage)]
pub enum WorkerMsg {
    /// Rank 0 opens the generation's rendezvous and answers its address.
    #[rpc]
    Listen(RpcReplyPort<Wire<String>>),
    /// Loads the rank (meeting its peers at the rendezvous); answers what it reported.
    #[rpc]
    Load(Wire<LoadArgs>, RpcReplyPort<Wire<RankInfo>>),
    #[rpc]
    Step(Wire<(u64, Arc<StepPlan>)>, RpcReplyPort<Wire<StepOut>>),
    #[rpc]
    Release(Wire<usize>, RpcReplyPort<Wire<()>>),
    #[rpc]
    Health(RpcReplyPort<Wire<RankHealth>>),
    #[rpc]
    Snapshot(Wire<usize>, RpcReplyPort<Wire<SlotSnapshot>>),
    #[rpc]
    Restore(Wire<(usize, Box<SlotSnapshot>)>, RpcReplyPort<Wire<()>>),
    /// `(slot, id)`: the slot's state into the rank's store (`Rank::store`).
    #[rpc]
    Store(Wire<(usize, u64)>, RpcReplyPort<Wire<Option<u64>>>),
    /// `(slot, id)`: a sequence started from a stored state.
    #[rpc]
    RestoreStored(Wire<(usize, u64)>, RpcReplyPort<Wire<()>>),
    #[rpc]
    DropStored(Wire<Vec<u64>>, RpcReplyPort<Wire<()>>),
    /// Aborts the rank's collectives (its generation is ending).
    Abort(Wire<String>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip_and_garbage_is_an_error() {
        let w = Wire::<(u64, Vec<u32>)>::ok((7, vec![1, 2, 3]));
        let back = Wire::<(u64, Vec<u32>)>::from_bytes(w.into_bytes());
        assert_eq!(back.0, Ok((7, vec![1, 2, 3])));
        let e = Wire::<(u64, Vec<u32>)>::from_bytes(vec![9; 3]).0.expect_err("garbage");
        assert!(
            matches!(&e, RemoteError::Other(m) if m.contains("did not decode")),
            "{e:?}"
        );
        let p = RemoteError::from(EngineError::RankPanicked {
            rank: 1,
            message: "boom".into(),
        });
        assert!(matches!(
            p.into_engine(),
            Some(EngineError::RankPanicked { rank: 1, .. })
        ));
        assert!(RemoteError::Stopped.into_engine().is_none());
    }
}
