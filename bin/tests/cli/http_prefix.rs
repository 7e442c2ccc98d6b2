//! Prefix caching over the OpenAI-compatible HTTP API (on by default): a completion whose prompt starts with a finished
//! request's tokens reports them as `usage.prompt_tokens_details.cached_tokens` (plain and streamed usage) with the
//! cold run's text; a chat turn whose rendered conversation starts with the previous turn's does too; `/metrics` has
//! the cache's counters and gauges.

use rewind_engine::tokenizer::chat::ChatMessage;
use serde_json::{json, Value};

use crate::http_fixture;
use http_fixture::*;

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {v}"))
}

/// The value of metric `name` in Prometheus text.
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

#[test]
fn completions_and_chat_report_cached_tokens_and_metrics_count_them() {
    // An engine of its own: the shared one's cache holds the other tests' states.
    let f = Fixture::start(2, 1024);
    let url = format!("{}/v1/completions", f.url);
    // 24 tokens, more than the default fewest a cached prefix holds (16).
    let first: Vec<u32> = (0..24).map(|i| 11 + (i * 7) % 50).collect();
    let v = ok(
        &url,
        json!({"prompt": first, "max_tokens": 1, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(cached(&v), 0, "nothing cached yet");
    // The state of the first request holds its prompt: a longer prompt starting with it restores all 24 tokens.
    let mut second = first.clone();
    second.extend([30, 31, 32]);
    let body = json!({"prompt": second, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let hit = ok(&url, body.clone());
    assert_eq!(cached(&hit), 24);
    assert_eq!(hit["usage"]["prompt_tokens"], 27);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, events) = stream(&url, &streamed);
    assert_eq!(status, 200);
    let usage = &events[events.len() - 2];
    assert_eq!(cached(usage), 24, "streamed usage");
    let text: String = events.iter().filter_map(|e| e["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, hit["choices"][0]["text"].as_str().expect("text"));

    // The same prompt on a server without the cache gives the same text.
    let mut cold_text = None;
    {
        let mut config = rewind_actors::EngineConfig::new(rewind_engine::decode::FormChoice::Auto);
        config.prefix_cache = None;
        let cold = Fixture::start_with(2, 1024, config);
        let v = ok(&format!("{}/v1/completions", cold.url), body);
        assert_eq!(cached(&v), 0, "the cache is off");
        cold_text.get_or_insert(v["choices"][0]["text"].as_str().expect("text").to_string());
    }
    assert_eq!(cold_text.as_deref(), hit["choices"][0]["text"].as_str());

    // Chat: the second turn's rendered conversation starts with the first turn's prompt.
    let chat = format!("{}/v1/chat/completions", f.url);
    let turn1 = json!([{"role": "system", "content": "you answer in one short sentence"},
                       {"role": "user", "content": "what colour is the sky on a clear day"}]);
    let v = ok(
        &chat,
        json!({"messages": turn1, "max_completion_tokens": 1, "temperature": 0, "ignore_eos": true}),
    );
    // The first request generated one token: its state holds exactly its prompt. The client's next turn carries an
    // answer of its own.
    assert_eq!(v["usage"]["completion_tokens"], 1);
    let reply = "it is blue";
    let tok = &f.model.tokenizer;
    let mut turns = vec![
        ChatMessage::new("system", "you answer in one short sentence"),
        ChatMessage::new("user", "what colour is the sky on a clear day"),
    ];
    let p1 = tok
        .encode(&tok.render(&turns, true).expect("render"), false)
        .expect("encode");
    turns.push(ChatMessage::new("assistant", reply));
    turns.push(ChatMessage::new("user", "and at night"));
    let p2 = tok
        .encode(&tok.render(&turns, true).expect("render"), false)
        .expect("encode");
    assert!(
        p1.len() >= 16 && p2.starts_with(&p1),
        "the template keeps the first turn's prompt as a prefix: {:?} / {:?}",
        tok.render(&turns[..2], true),
        tok.render(&turns, true)
    );
    let turn2 = json!([{"role": "system", "content": "you answer in one short sentence"},
                       {"role": "user", "content": "what colour is the sky on a clear day"},
                       {"role": "assistant", "content": reply},
                       {"role": "user", "content": "and at night"}]);
    let v = ok(
        &chat,
        json!({"messages": turn2, "max_completion_tokens": 4, "temperature": 0, "ignore_eos": true,
               "stream": false}),
    );
    assert_eq!(cached(&v), p1.len() as u64, "the first turn's prompt is restored");

    // The last request's state is copied into the cache after its client hears it finished; a health query waits
    // behind that step.
    f.rt.block_on(f.engine.health()).expect("health");
    let (status, text) = curl(&format!("{}/metrics", f.url), &[]);
    assert_eq!(status, 200);
    let hits = 24 * 2 + p1.len() as u64;
    assert_eq!(metric(&text, "rewind_prefix_cache_hit_tokens"), hits, "{text}");
    assert!(metric(&text, "rewind_prefix_cache_query_tokens") >= hits);
    assert!(metric(&text, "rewind_prefix_cache_states") >= 3);
    assert!(metric(&text, "rewind_prefix_cache_bytes") > 0);
    assert_eq!(
        metric(&text, "rewind_prefix_cache_memory_budget"),
        rewind_actors::DEFAULT_PREFIX_CACHE_MEMORY as u64
    );
}
