//! How to place and size a GPU model: devices (one tensor-parallel rank each), memory fraction, pool sizes, prefill
//! chunk and storage type.

use crate::error::{EngineError, Result};

/// How to place and size the GPU model.
#[derive(Clone, Debug)]
pub struct GpuOptions {
    /// GPU ordinals, one per tensor-parallel rank (`[0]` for one GPU, `[0, 1]` for `--tp 2`).
    pub devices: Vec<usize>,
    /// Fraction of each GPU's memory rewind may use (weights, activations, state pools).
    pub gpu_memory_fraction: f64,
    /// Most sequences alive at once (SSM state slots; also the largest decode batch).
    pub max_seqs: usize,
    /// Longest sequence in tokens; `None` takes the model's `max_position_embeddings`, capped at 32768.
    pub max_model_len: Option<usize>,
    /// Tokens per prefill chunk.
    pub prefill_chunk: usize,
    /// Storage type of activations and state (`--dtype`).
    pub dtype: GpuDtype,
    /// Input-ring capacity `L` of the replay form (`--buffer-len`).
    pub buffer_len: usize,
    /// The most tokens one verify takes (`T`): sizes the conv ring (`K − 1 + T` rows) and the kv-only ring.
    pub max_verify: usize,
    /// Context length below which a kv-only or auto sequence keeps no state; `None`: the memory model's default
    /// (the state's key dim).
    pub kv_only_threshold: Option<usize>,
    /// Capture decode and verify steps as CUDA graphs and replay them (`--no-cuda-graphs` turns it off).
    pub cuda_graphs: bool,
    /// Time every stage of every step on the device (embedding, each layer, the head) with CUDA events, reported in
    /// the rank's health ([`crate::rank::StageTimes`]; `rewind bench --stage-profile`). A profiling aid: it waits for
    /// each step's events, and needs `cuda_graphs` off (a captured graph replays as one launch).
    pub stage_profile: bool,
    /// Time the MTP layer's work of each step (the catch-up and the draft loop, `gpu/mtp.rs`) between two CUDA events,
    /// with CUDA graphs on or off, reported as the stage `mtp draft` of the rank's health (`rewind bench
    /// --mtp-draft`). It waits for nothing the step does not wait for already.
    pub time_mtp: bool,
    /// Keep the recurrent form's per-draft state snapshots (`max_verify` states per slot and SSM layer, taken from
    /// the KV blocks' memory): only a rank whose sequences verify drafts in the recurrent form needs them
    /// (`--decode recurrent` with speculation); replay, kv-only and auto roll back by pointer moves.
    pub recurrent_verify: bool,
    /// Load the checkpoint's MTP layer and draft with it on the ranks (`Batch::mtp`, `gpu/mtp.rs`): its weights, its
    /// KV (one more attention layer of the paged pool) and its buffers count in the memory plan. A checkpoint without
    /// one fails the load with a clear error.
    pub mtp: bool,
    /// Bytes of each GPU set aside for the prefix cache's stored states (`gpu/store.rs`), taken off the KV pool's
    /// share of the memory budget; 0 stores nothing (the cache off).
    pub prefix_store: u64,
}

/// Storage type of activations, conv state and KV cache on the GPU (weights of GEMMs are bf16 either way; SSM
/// states and accumulation are f32 either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GpuDtype {
    /// bf16 activations: the serving default.
    #[default]
    Bf16,
    /// f32 activations: only GEMM inputs are rounded to bf16 (for accuracy checks).
    F32,
}

impl std::str::FromStr for GpuDtype {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "bf16" | "bfloat16" => Ok(GpuDtype::Bf16),
            "f32" | "float32" => Ok(GpuDtype::F32),
            other => Err(EngineError::InvalidInput(format!(
                "unknown GPU dtype `{other}`: expected bf16 or f32"
            ))),
        }
    }
}

impl std::fmt::Display for GpuDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GpuDtype::Bf16 => "bf16",
            GpuDtype::F32 => "f32",
        })
    }
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            devices: vec![0],
            gpu_memory_fraction: 0.9,
            max_seqs: 64,
            max_model_len: None,
            prefill_chunk: 512,
            dtype: GpuDtype::Bf16,
            buffer_len: crate::state::DEFAULT_BUFFER_LEN,
            max_verify: 1,
            kv_only_threshold: None,
            cuda_graphs: true,
            stage_profile: false,
            time_mtp: false,
            recurrent_verify: false,
            mtp: false,
            prefix_store: 0,
        }
    }
}
