//! What a served request produced, collected from its event stream (shared by the serving tests).

use rewind_actors::{EngineHandle, Event, EventStream, GenerateRequest};
use rewind_engine::sched::FinishReason;

/// What one request produced: its tokens and how it ended (or its error).
#[derive(Debug, PartialEq)]
pub enum Outcome {
    Done(Vec<u32>, FinishReason),
    Failed(String),
}

pub async fn collect(mut s: EventStream) -> Outcome {
    let mut tokens = Vec::new();
    while let Some(e) = s.next().await {
        match e {
            Event::Token { token, index, .. } => {
                assert_eq!(index, tokens.len(), "tokens arrive in order, none repeated or dropped");
                tokens.push(token);
            }
            Event::PromptLogprobs { .. } => panic!("no prompt log-probabilities were asked for"),
            Event::Finished { reason, usage, .. } => {
                assert_eq!(usage.completion_tokens, tokens.len());
                return Outcome::Done(tokens, reason);
            }
            Event::Failed { error, .. } => return Outcome::Failed(error),
        }
    }
    panic!("the stream ended without a final event")
}

/// Submits every request at once and collects each outcome, in request order.
pub async fn serve_all(e: &EngineHandle, reqs: &[GenerateRequest]) -> Vec<Outcome> {
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).expect("submit")).collect();
    let tasks: Vec<_> = streams.into_iter().map(|s| tokio::spawn(collect(s))).collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}
