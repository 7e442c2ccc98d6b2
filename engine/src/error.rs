//! The engine's error type. Every variant names what was wrong, so the CLI can print it as is.

use std::path::PathBuf;

/// Errors raised by the engine. Messages are complete sentences for the user; no variant carries a backtrace.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A file or directory could not be read or written.
    // The I/O error is part of the message rather than a `source`, so a printed error chain names it once.
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    /// A JSON file could not be parsed.
    #[error("{path}: malformed JSON: {message}")]
    Json { path: PathBuf, message: String },
    /// A config field is missing, of the wrong type, or out of range.
    #[error("config: field `{field}`: {message}")]
    Config { field: String, message: String },
    /// The checkpoint's `model_type` / architecture is not one rewind supports.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A checkpoint file is malformed, truncated, or holds a tensor of the wrong name, dtype or shape.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A tensor the model needs is absent from the checkpoint.
    #[error("checkpoint: missing tensor `{name}` (expected shape {expected:?})")]
    MissingTensor { name: String, expected: Vec<usize> },
    /// A tensor has a different shape from the one the config implies.
    #[error("checkpoint: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    /// Tensors the model does not use were left over in the checkpoint.
    #[error("checkpoint: unexpected tensor(s) not used by the model: {0}")]
    UnexpectedTensors(String),
    /// The tokenizer or chat template failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A request or sampling parameter is invalid.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A state-pool operation failed (pool full, double free, ring or KV bounds).
    // Transparent, so a printed error chain states the pool's message once.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The forward pass produced NaN or infinite logits.
    #[error("non-finite logits at position {position} (a NaN or infinity came out of the model)")]
    NonFinite { position: usize },
    /// A tensor-parallel collective failed: a rank left (panicked, aborted) or ranks disagreed on the operation.
    #[error("communicator: {0}")]
    Communicator(String),
    /// A feature this backend cannot run yet (a decode form, speculation, snapshots on the GPU, ...).
    #[error("not supported yet: {0}")]
    NotSupported(String),
    /// A rank failed a step the coordinator had validated, so the ranks may disagree on the sequences' state: the
    /// group refuses further steps until it is rebuilt (restart the ranks, re-prefill the sequences).
    #[error("the rank group failed a step and must be restarted: {0}")]
    GroupFailed(String),
    /// A rank's thread stopped (it panicked, or its device failed) and cannot answer.
    #[error("rank {rank} has stopped")]
    RankStopped { rank: usize },
    /// A rank panicked inside a call; its thread has stopped.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked { rank: usize, message: String },
    /// A rank failed to load (the message is the rank's error).
    #[error("loading the ranks: {0}")]
    RankLoad(String),
    /// An error a rank in a worker process of its own reported, as that rank wrote it (it crossed the process
    /// boundary as text: `rewind_actors::rank_process`).
    #[error("{0}")]
    Remote(String),
    /// A fault injected for testing (`--inject-fault`).
    #[error("injected fault: {0}")]
    Injected(String),
    /// The GPU backend failed (no usable device, a CUDA / cuBLAS / NCCL call failed) or a model does not fit on it.
    #[error("GPU: {0}")]
    Gpu(String),
}

#[cfg(feature = "cuda")]
impl From<rewind_kernels::cuda::CudaError> for EngineError {
    fn from(e: rewind_kernels::cuda::CudaError) -> Self {
        EngineError::Gpu(e.to_string())
    }
}

/// The engine's result type.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

impl EngineError {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            error: source,
        }
    }

    /// A config error for `field`.
    pub fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        EngineError::Config {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// What went wrong in a state-pool operation. The scheduler matches on the variant (a full pool is a reason to
/// wait, a double free is a bug); the messages are complete sentences for logs.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Every slot is in use.
    #[error("all {capacity} sequence slots are in use")]
    SlotsFull { capacity: usize },
    /// A slot index beyond the pool.
    #[error("slot {slot} is out of range (the pool has {capacity} slots)")]
    SlotOutOfRange { slot: usize, capacity: usize },
    /// `free` of a slot that is not allocated.
    #[error("slot {slot} freed twice (it is not allocated)")]
    DoubleFree { slot: usize },
    /// Taking a slot that is already allocated.
    #[error("slot {slot} is already in use")]
    InUse { slot: usize },
    /// Access to a slot that is not allocated.
    #[error("slot {slot} is not allocated")]
    NotAllocated { slot: usize },
    /// Growing a KV cache needs more free blocks than the pool has.
    #[error("KV blocks exhausted: slot {slot} needs {needed} more block(s), {free} free")]
    KvBlocksFull { slot: usize, needed: usize, free: usize },
    /// A KV length beyond what a slot's block table can map.
    #[error("slot {slot}: KV length {len} exceeds the per-slot limit of {max} tokens")]
    KvTooLong { slot: usize, len: usize, max: usize },
    /// A KV growth that would shorten the cache, or a truncation that would lengthen it.
    #[error("slot {slot}: cannot {op} KV length {len} to {new_len}")]
    KvLength {
        slot: usize,
        op: &'static str,
        len: usize,
        new_len: usize,
    },
    /// A ring operation that would overfill or underflow a slot's input ring.
    #[error("slot {slot}: input ring holds {len} of {capacity} entries; {op} {n} is not possible")]
    Ring {
        slot: usize,
        op: &'static str,
        n: usize,
        len: usize,
        capacity: usize,
    },
    /// A conv-ring advance longer than the speculative room of the ring.
    #[error("slot {slot}: conv ring can advance at most {max} entries at once, asked {n}")]
    ConvAdvance { slot: usize, n: usize, max: usize },
    /// A layer index beyond the pool, or of the wrong kind.
    #[error("layer {layer}: {message}")]
    Layer { layer: usize, message: String },
    /// A pool configuration that cannot work.
    #[error("invalid pool configuration: {0}")]
    Config(String),
}
