//! Helpers shared by the speculative-decoding tests: an engine on CPU ranks with speculation on, reading request
//! streams, random checkpoints. Each test file uses a part of them.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use rewind_actors::{EngineConfig, EngineHandle, EngineSpec, Event, GenerateRequest};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::model::Family;
use rewind_engine::rank::{CpuLauncher, CpuOptions};
use rewind_engine::sample::SamplingParams;
use rewind_engine::spec::factory::{build, Target};
use rewind_engine::spec::{DrafterFactory, DrafterKind, SpecConfig, SpecPolicy, SpecStats};
use rewind_tests::name;

/// Ring length for windows up to T = 8 (a verify of 9 tokens needs L ≥ 18).
pub const RING: usize = 18;

/// The context every test engine's slots hold.
pub const CONTEXT: usize = 96;

pub fn spec_config(drafter: DrafterKind, window: usize) -> SpecConfig {
    SpecConfig {
        drafter,
        window,
        policy: SpecPolicy::Fixed,
        profile: None,
    }
}

/// The factory `spec` names, for the checkpoint in `dir` with `slots` slots.
pub fn factory(dir: &Path, slots: usize, spec: &SpecConfig) -> Arc<dyn DrafterFactory> {
    factory_for(dir, slots, spec, false)
}

/// [`factory`], with MTP drafting on the ranks when `mtp_on_ranks` (the ranks must load the layer:
/// [`engine_on_ranks`]).
pub fn factory_for(dir: &Path, slots: usize, spec: &SpecConfig, mtp_on_ranks: bool) -> Arc<dyn DrafterFactory> {
    let vocab = rewind_engine::model::ModelConfig::from_dir(dir)
        .expect("config")
        .vocab_size;
    build(
        &spec.drafter,
        &Target {
            dir,
            vocab,
            slots,
            max_context: CONTEXT,
            window: spec.window,
            mtp_on_ranks,
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", name(dir)))
}

pub async fn engine(dir: &Path, tp: usize, form: FormChoice, slots: usize, spec: &SpecConfig) -> EngineHandle {
    let factory = factory(dir, slots, spec);
    engine_with(dir, tp, form, slots, spec, factory, None).await
}

/// An engine whose drafters come from `factory`, with a step budget of `max_batch_tokens` when given (a small one
/// splits prompts into chunks).
pub async fn engine_with(
    dir: &Path,
    tp: usize,
    form: FormChoice,
    slots: usize,
    spec: &SpecConfig,
    factory: Arc<dyn DrafterFactory>,
    max_batch_tokens: Option<usize>,
) -> EngineHandle {
    start(dir, tp, form, slots, spec, factory, max_batch_tokens, false).await
}

/// An engine whose ranks load the MTP layer and draft with it (`--spec mtp` on CPU ranks).
pub async fn engine_on_ranks(
    dir: &Path,
    tp: usize,
    form: FormChoice,
    slots: usize,
    spec: &SpecConfig,
    max_batch_tokens: Option<usize>,
) -> EngineHandle {
    let factory = factory_for(dir, slots, spec, true);
    start(dir, tp, form, slots, spec, factory, max_batch_tokens, true).await
}

#[allow(clippy::too_many_arguments)]
async fn start(
    dir: &Path,
    tp: usize,
    form: FormChoice,
    slots: usize,
    spec: &SpecConfig,
    factory: Arc<dyn DrafterFactory>,
    max_batch_tokens: Option<usize>,
    mtp_on_ranks: bool,
) -> EngineHandle {
    let mut decoder = DecoderConfig::new(slots, CONTEXT);
    decoder.buffer_len = RING;
    decoder.max_verify = spec.max_verify();
    let launcher = CpuLauncher::new(dir, CpuOptions { tp, decoder })
        .expect("launcher")
        .with_mtp(mtp_on_ranks);
    let mut config = EngineConfig::new(form);
    if let Some(m) = max_batch_tokens {
        config.max_batch_tokens = m;
    }
    config.spec = Some(EngineSpec {
        config: spec.clone(),
        factory,
    });
    EngineHandle::start(Arc::new(launcher), config)
        .await
        .unwrap_or_else(|e| panic!("{} at tp {tp}: {e}", name(dir)))
}

/// Reads a request's stream to its end: its tokens and speculation counters.
pub async fn run(mut s: rewind_actors::EventStream) -> (Vec<u32>, Option<SpecStats>) {
    let mut tokens = Vec::new();
    while let Some(ev) = s.next().await {
        match ev {
            Event::Token { token, index, .. } => {
                assert_eq!(index, tokens.len(), "tokens arrive in order, none repeated or dropped");
                tokens.push(token);
            }
            Event::PromptLogprobs { .. } => panic!("no prompt log-probabilities were asked for"),
            Event::Finished { spec, .. } => return (tokens, spec),
            Event::Failed { error, .. } => panic!("request failed: {error}"),
        }
    }
    panic!("the stream ended without a final event")
}

pub async fn run_all(e: &EngineHandle, requests: Vec<GenerateRequest>) -> Vec<(Vec<u32>, Option<SpecStats>)> {
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|r| tokio::spawn(run(e.submit(r).expect("submit"))))
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}

pub fn params(max_tokens: usize, temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

/// A random `tiny` Qwen3.5 checkpoint (with an MTP layer when `mtp`) in a fresh temporary directory.
pub fn tiny_qwen(seed: u64, mtp: bool) -> tempfile::TempDir {
    tiny(Family::Qwen35, "tiny", seed, mtp)
}

/// A random checkpoint of `preset` (with an MTP layer when `mtp`) in a fresh temporary directory.
pub fn tiny(family: Family, preset: &str, seed: u64, mtp: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    rewind_engine::init::init_model(&rewind_engine::init::InitOptions {
        family,
        preset: preset.into(),
        layers: None,
        seed,
        out: dir.path().to_path_buf(),
        dtype: None,
        mtp,
    })
    .expect("init-model");
    dir
}
