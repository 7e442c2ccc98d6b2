//! `rewind serve`: one process serving a model over gRPC sessions and the OpenAI-compatible HTTP API. The steps are
//! public because `rewind-launch` (GPU discovery and the TP plan on top) and `rewind chat --model` (an in-process
//! server on a loopback port) serve through the same ones: [`prepare`] checks the flags and reads the model,
//! [`start`] starts the engine, [`crate::serve::run::serve`] runs the servers until a signal drains them.

use rewind_engine::spec::DrafterKind;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use rewind_actors::EngineConfig;
use rewind_engine::spec::SpecConfig;

use super::backend::{self, Backend, Needs};

use crate::cli::{Device, ReasoningParserArg, ServeArgs, ToolCallParserArg};
use crate::output::errln;
use crate::serve::run::{self, ServeOptions};
use crate::serve::{ServeState, ServedModel};

pub(crate) use super::generate::model_dir;

/// Sequences a CPU server keeps alive at once unless `--max-seqs` says otherwise: the GPU default (64) would reserve
/// CPU memory for 64 full contexts.
const CPU_DEFAULT_SLOTS: usize = 8;
/// The longest context a server reserves per sequence unless `--max-model-len` says otherwise (the model's limit if
/// shorter), as on GPUs.
const DEFAULT_CONTEXT_CAP: usize = 32768;

/// A server ready to start: the model read, the flags checked, nothing loaded yet.
pub struct Prepared {
    pub model: ServedModel,
    /// The id both APIs serve the model under.
    pub name: String,
    /// `--api-key`s (none: no key required).
    pub api_keys: Vec<String>,
    /// `max_tokens` of a request that sets none (`--default-max-tokens`), before the room cap.
    pub default_max_tokens: usize,
    /// `--strict-fields`: unknown HTTP request fields are refused.
    pub strict_fields: bool,
    /// `--reasoning-parser`: `None` leaves it to the chat template (`auto`).
    pub reasoning: Option<bool>,
    /// `--tool-call-parser`.
    pub tool_call_parser: ToolCallParserArg,
    pub backend: Backend,
    pub engine_config: EngineConfig,
    pub options: ServeOptions,
    /// Sequences alive at once and the context each may reach, as the pools are sized.
    pub slots: usize,
    pub context: usize,
    pub device: Device,
}

/// Checks `args`, reads the metadata of the model in `dir` (resolved by the caller with [`model_dir`], so that a note
/// about it is printed once) and plans its backend (nothing is loaded yet).
pub fn prepare(args: &ServeArgs, dir: &Path) -> Result<Prepared> {
    let device = args.run.device.device()?;
    anyhow::ensure!(
        !args.rank_processes || device == Device::Cpu,
        "--rank-processes runs CPU ranks (--device cpu) only so far: GPU ranks in worker processes, with the NCCL \
         unique id handed out through the cluster, are not built yet"
    );
    if device == Device::Cpu {
        // --max-seqs and --max-model-len size a CPU server's pools too; the other GPU flags do nothing here.
        for flag in args.run.device.gpu_only_flags_set() {
            if !matches!(flag, "--max-seqs" | "--max-model-len") {
                errln!("note: {flag} does not apply to --device cpu");
            }
        }
    }
    let options = ServeOptions::from_args(&args.listen)?;
    let spec = super::spec::config(&args.run.spec, &args.run.decode)?;
    let model = ServedModel::load(dir)?;
    let limit = model.config.max_position_embeddings;
    let context = match args.run.device.max_model_len {
        Some(n) => {
            anyhow::ensure!(
                n <= limit,
                "--max-model-len {n} exceeds the model's context limit of {limit} tokens (max_position_embeddings)"
            );
            n
        }
        None => limit.min(DEFAULT_CONTEXT_CAP),
    };
    let slots = match args.run.device.max_seqs {
        Some(n) => n,
        None if device == Device::Cpu => CPU_DEFAULT_SLOTS,
        None => args.run.device.max_seqs(),
    };
    let needs = Needs {
        mtp: spec.as_ref().is_some_and(|s| s.drafter == DrafterKind::Mtp),
        time_mtp: false,
        slots,
        context,
        verify: spec.as_ref().map_or(1, SpecConfig::max_verify),
        prefix_store: backend::prefix_store(&args.run.engine)?,
    };
    let backend = backend::backend(dir, &args.run.device, Some(&args.run.decode), needs)?;
    let mut engine_config = backend::engine_config(&args.run.engine, backend.form)?;
    engine_config.eos_token_ids = model.eos_token_ids.clone();
    engine_config.tokenizer = Some(model.tokenizer.clone());
    engine_config.session_idle_timeout = options.session_idle_timeout;
    engine_config.session_memory = options.session_memory;
    if args.rank_processes {
        engine_config.rank_processes = Some(Arc::new(backend.rank_processes()?));
    }
    if let Some(s) = &spec {
        engine_config.spec = Some(super::spec::engine_spec(
            s,
            dir,
            model.config.vocab_size,
            slots,
            context,
            backend.mtp_on_ranks,
        )?);
    }
    let name = match &args.listen.served_model_name {
        Some(n) => {
            anyhow::ensure!(!n.trim().is_empty(), "--served-model-name must not be empty");
            n.clone()
        }
        None => model.default_name(),
    };
    // An empty key would quietly serve without one: refused, since whoever set it meant to require a key.
    anyhow::ensure!(
        args.listen.api_key.iter().all(|k| !k.trim().is_empty()),
        "--api-key is empty: give a key, or leave it out to serve without one"
    );
    Ok(Prepared {
        model,
        name,
        api_keys: args.listen.api_key.clone(),
        default_max_tokens: args.listen.default_max_tokens as usize,
        strict_fields: args.listen.strict_fields,
        reasoning: match args.listen.reasoning_parser {
            ReasoningParserArg::Auto => None,
            ReasoningParserArg::Qwen3 => Some(true),
            ReasoningParserArg::None => Some(false),
        },
        tool_call_parser: args.listen.tool_call_parser,
        backend,
        engine_config,
        options,
        slots,
        context,
        device,
    })
}

/// Starts the engine of `p` (loading the model); returns the state both servers share and the device in words.
pub async fn start(p: Prepared) -> Result<(Arc<ServeState>, ServeOptions, String)> {
    let (engine, device) = backend::start_engine(&p.backend, p.engine_config).await?;
    let state = ServeState::new(Arc::new(engine), p.model, p.name, p.api_keys)
        .with_default_max_tokens(p.default_max_tokens)
        .with_strict_fields(p.strict_fields)
        .with_reasoning(p.reasoning)
        .with_tool_call_parser(p.tool_call_parser)
        .with_limits(p.options.request.clone());
    Ok((Arc::new(state), p.options, device))
}

/// One line on what is served, before the servers announce their ports.
pub fn summary(state: &ServeState, device: &str, dir: &Path) -> String {
    let info = state.engine.info();
    format!(
        "rewind: serving {} ({}) as `{}` on {} | tp {} | {} sequences x {} tokens | api key {}",
        dir.display(),
        state.model.config.summary(),
        state.model_name,
        device,
        info.tp,
        info.slots,
        info.max_context,
        if state.api_keys.required() { "required" } else { "off" }
    )
}

/// `rewind serve`.
pub fn run(args: ServeArgs) -> Result<()> {
    let dir = model_dir(&args.model)?;
    let prepared = prepare(&args, &dir)?;
    run::runtime()?.block_on(async move {
        let listeners = run::Listeners::bind(&prepared.options).await?;
        let (state, options, device) = start(prepared).await.context("starting the engine")?;
        errln!("{}", summary(&state, &device, &dir));
        // The state goes to the servers whole: the engine stops once they let go of it.
        run::serve(state, listeners, &options).await
    })
}
