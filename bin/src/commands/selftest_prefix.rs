//! The self-test's row for prefix caching on the GPU: a request whose prompt starts with a finished request's tokens
//! restores that request's state (copied into the ranks' device stores when it finished, `engine/src/gpu/store.rs`)
//! into its slot and prefills only the rest. Its tokens, greedy and seeded, must equal those of the same requests on an engine without the
//! cache, and its usage must count the restored tokens. The two engines chunk the prompt differently (the hit prefills
//! only the rest), so they differ in rounding only: f32 rows, where that moves no pick of these models.

use std::path::Path;
use std::sync::Arc;

use rewind_actors::{EngineConfig, EngineHandle, Event, GenerateRequest, PrefixCacheConfig};
use rewind_engine::decode::FormChoice;
use rewind_engine::gpu::{GpuLauncher, GpuOptions};
use rewind_engine::sample::SamplingParams;
use serde_json::{json, Value};

/// Tokens per request, and the seeded requests' seed and temperature.
const TOKENS: usize = 8;
const SEED: u64 = 4321;
const TEMPERATURE: f32 = 0.8;

/// A request's tokens and the prompt tokens it restored.
async fn run(e: &EngineHandle, prompt: &[u32], params: &SamplingParams) -> Result<(Vec<u32>, usize), String> {
    let mut s = e
        .submit(GenerateRequest::new(prompt.to_vec(), params.clone()))
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        match ev {
            Event::Token { token, .. } => out.push(token),
            Event::Finished { usage, .. } => return Ok((out, usage.cached_tokens)),
            Event::PromptLogprobs { .. } => {}
            Event::Failed { error, .. } => return Err(error),
        }
    }
    Err("the stream ended without a final event".into())
}

/// On one engine, per prompt: the prompt, then its extension by the first reply and two more tokens, greedy and
/// seeded. Returns every request's tokens and restored count.
async fn stream(e: &EngineHandle, prompts: &[Vec<u32>]) -> Result<Vec<(Vec<u32>, usize)>, String> {
    let greedy = SamplingParams {
        max_tokens: Some(TOKENS),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let sampled = SamplingParams {
        temperature: TEMPERATURE,
        seed: Some(SEED),
        ..greedy.clone()
    };
    let mut out = Vec::new();
    for prompt in prompts {
        let first = run(e, prompt, &greedy).await?;
        let mut longer = prompt.clone();
        longer.extend_from_slice(&first.0);
        longer.extend_from_slice(&prompt[..2.min(prompt.len())]);
        out.push(first);
        out.push(run(e, &longer, &greedy).await?);
        out.push(run(e, &longer, &sampled).await?);
    }
    Ok(out)
}

async fn engine(dir: &Path, opts: &GpuOptions, prefix: Option<PrefixCacheConfig>) -> Result<EngineHandle, String> {
    let launcher = Arc::new(GpuLauncher::new(dir, opts).map_err(|e| e.to_string())?);
    let mut config = EngineConfig::new(FormChoice::Auto);
    config.prefix_cache = prefix;
    EngineHandle::start(launcher, config).await.map_err(|e| e.to_string())
}

/// One row: the same request stream on the GPUs without and with the cache; `Err` names the first difference.
pub(super) fn rows(case: &str, dir: &Path, prompts: &[Vec<u32>], opts: &GpuOptions, tp: usize) -> (Value, bool) {
    let result = (|| -> Result<(), String> {
        let rt = super::backend::runtime().map_err(|e| e.to_string())?;
        rt.block_on(async {
            let cold = engine(dir, opts, None).await?;
            let want = stream(&cold, prompts).await;
            cold.shutdown().await;
            let cache = PrefixCacheConfig {
                min_tokens: 1,
                // The budget the ranks' stores were given.
                memory: usize::try_from(opts.prefix_store).map_err(|e| e.to_string())?.max(1),
            };
            let warm = engine(dir, opts, Some(cache)).await?;
            let got = stream(&warm, prompts).await;
            warm.shutdown().await;
            let (want, got) = (want?, got?);
            for (i, ((w, _), (g, restored))) in want.iter().zip(&got).enumerate() {
                let (p, k) = (i / 3, i % 3);
                if g != w {
                    return Err(format!("prompt {p} request {k}: {g:?} with the cache, {w:?} without"));
                }
                // The first request runs cold; its extensions restore its prompt and every reply token but the last.
                let expect = if k == 0 { 0 } else { prompts[p].len() + TOKENS - 1 };
                if *restored != expect {
                    return Err(format!(
                        "prompt {p} request {k}: restored {restored} tokens, expected {expect}"
                    ));
                }
            }
            Ok(())
        })
    })();
    let ok = result.is_ok();
    match &result {
        Ok(()) => println!("{case:<20} tp {tp}  prefix cache hits (restored)    pass"),
        Err(e) => println!("{case:<20} tp {tp}  prefix cache hits (restored)    FAIL: {e}"),
    }
    (
        json!({
            "case": case,
            "tp": tp,
            "check": "prefix_cache",
            "status": if ok { "pass" } else { "fail" },
            "error": result.err(),
        }),
        ok,
    )
}
