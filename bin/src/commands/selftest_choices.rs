//! The self-test's rows for a request's `n` choices on the GPU: the serving engine prefills the prompt once, copies the
//! slot's device state (SSM checkpoint, rings, KV rows) to the host and restores it into each choice's slot. Greedy,
//! the three choices must equal each other and the same request with `n = 1`; seeded, choice `i` must equal a lone
//! request with the derived seed `seed + i` (`rewind_actors::choice_seed`). The lone requests prefill the prompt in
//! one piece where the choices prefill its last token apart, so the two differ in rounding only: f32 rows, where that
//! moves no pick of these models.

use std::path::Path;
use std::sync::Arc;

use rewind_actors::{choice_seed, EngineConfig, EngineHandle, Event, GenerateRequest};
use rewind_engine::decode::FormChoice;
use rewind_engine::gpu::{GpuLauncher, GpuOptions};
use rewind_engine::sample::SamplingParams;
use serde_json::{json, Value};

/// Choices per request, tokens per choice, and the seeded requests' seed and temperature.
const N: usize = 3;
const TOKENS: usize = 12;
const SEED: u64 = 1234;
const TEMPERATURE: f32 = 0.8;

/// Every choice's tokens of `prompt` asked with `n` choices.
async fn run(e: &EngineHandle, prompt: &[u32], params: &SamplingParams, n: usize) -> Result<Vec<Vec<u32>>, String> {
    let mut s = e
        .submit(GenerateRequest {
            n,
            ..GenerateRequest::new(prompt.to_vec(), params.clone())
        })
        .map_err(|e| e.to_string())?;
    let mut out = vec![Vec::new(); n];
    while let Some(ev) = s.next().await {
        match ev {
            Event::Token { token, choice, .. } => out
                .get_mut(choice)
                .ok_or_else(|| format!("an event of choice {choice} of {n}"))?
                .push(token),
            // Nothing here asks for log-probabilities.
            Event::Finished { .. } | Event::PromptLogprobs { .. } => {}
            Event::Failed { error, .. } => return Err(error),
        }
    }
    Ok(out)
}

/// The check on one prompt; `Err` names the first difference.
async fn check(e: &EngineHandle, prompt: &[u32]) -> Result<(), String> {
    let greedy = SamplingParams {
        max_tokens: Some(TOKENS),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let lone = run(e, prompt, &greedy, 1).await?.remove(0);
    for (i, c) in run(e, prompt, &greedy, N).await?.iter().enumerate() {
        if c != &lone {
            return Err(format!("greedy choice {i} {c:?} != the unforked request's {lone:?}"));
        }
    }
    let sampled = SamplingParams {
        temperature: TEMPERATURE,
        seed: Some(SEED),
        ..greedy
    };
    let choices = run(e, prompt, &sampled, N).await?;
    for (i, c) in choices.iter().enumerate() {
        let seeded = SamplingParams {
            seed: Some(choice_seed(SEED, i)),
            ..sampled.clone()
        };
        let want = run(e, prompt, &seeded, 1).await?.remove(0);
        if c != &want {
            return Err(format!(
                "sampled choice {i} {c:?} != a lone request with seed {}: {want:?}",
                choice_seed(SEED, i)
            ));
        }
    }
    Ok(())
}

/// One row: the serving engine on `opts`'s GPUs runs the check on every prompt.
pub(super) fn rows(case: &str, dir: &Path, prompts: &[Vec<u32>], opts: &GpuOptions, tp: usize) -> (Value, bool) {
    let result = (|| -> Result<(), String> {
        let rt = super::backend::runtime().map_err(|e| e.to_string())?;
        let launcher = Arc::new(GpuLauncher::new(dir, opts).map_err(|e| e.to_string())?);
        rt.block_on(async {
            let e = EngineHandle::start(launcher, EngineConfig::new(FormChoice::Auto))
                .await
                .map_err(|e| e.to_string())?;
            let mut r = Ok(());
            for (p, prompt) in prompts.iter().enumerate() {
                if let Err(why) = check(&e, prompt).await {
                    r = Err(format!("prompt {p}: {why}"));
                    break;
                }
            }
            e.shutdown().await;
            r
        })
    })();
    let ok = result.is_ok();
    match &result {
        Ok(()) => println!("{case:<20} tp {tp}  n = {N} choices (forked state)   pass"),
        Err(e) => println!("{case:<20} tp {tp}  n = {N} choices (forked state)   FAIL: {e}"),
    }
    (
        json!({
            "case": case,
            "tp": tp,
            "check": "n_choices",
            "status": if ok { "pass" } else { "fail" },
            "error": result.err(),
        }),
        ok,
    )
}
