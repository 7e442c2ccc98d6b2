//! `n` choices over the OpenAI-compatible HTTP API (the tiny model of `http_api.rs`, driven with curl): completions and
//! chat answer `n` choices, streamed (their chunks interleaved, each naming its `index`) and not, with the prompt
//! counted once in `usage`; greedy choices are equal, seeded ones differ and repeat; `n` past `--max-seqs` and a
//! `best_of` that asks for more are 400s naming the field; a client that disconnects cancels every choice.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::http_fixture;
use http_fixture::*;

/// Each choice's text of a streamed answer (chat deltas' `content`, or completions' `text`) and its finish reason,
/// by index, checking that every chunk but the usage one names a choice and the stream ends with `[DONE]`.
fn streamed_choices(events: &[Value], chat: bool) -> BTreeMap<u64, (String, String)> {
    assert_eq!(events.last(), Some(&Value::String("[DONE]".into())), "{events:?}");
    let mut out: BTreeMap<u64, (String, String)> = BTreeMap::new();
    for e in events.iter().filter(|e| e.is_object()) {
        let choices = e["choices"].as_array().expect("choices");
        if choices.is_empty() {
            continue; // the usage chunk
        }
        assert_eq!(choices.len(), 1, "one choice a chunk: {e}");
        let c = &choices[0];
        let index = c["index"].as_u64().expect("index");
        let entry = out.entry(index).or_default();
        let piece = if chat { &c["delta"]["content"] } else { &c["text"] };
        entry.0.push_str(piece.as_str().unwrap_or_default());
        if let Some(reason) = c["finish_reason"].as_str() {
            assert!(entry.1.is_empty(), "choice {index} finished twice");
            entry.1 = reason.to_string();
        }
    }
    out
}

/// Whether chunks of different choices interleave (a choice's chunk after another's, before its own last).
fn interleaved(events: &[Value]) -> bool {
    let order: Vec<u64> = events
        .iter()
        .filter_map(|e| e["choices"].get(0).and_then(|c| c["index"].as_u64()))
        .collect();
    order.windows(3).any(|w| w[0] == w[2] && w[0] != w[1])
}

#[test]
fn completions_answer_n_choices_streamed_and_not() {
    let f = shared();
    let url = format!("{}/v1/completions", f.url);
    let prompt = "the quick brown fox";
    let prompt_tokens = f.model.tokenizer.encode(prompt, true).expect("encode").len();
    let greedy = json!({"prompt": prompt, "max_tokens": 6, "ignore_eos": true, "temperature": 0, "n": 3});
    let v = ok(&url, greedy.clone());
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["finish_reason"], "length");
        assert_eq!(c["text"], choices[0]["text"], "greedy choices are equal: {v}");
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens, "the prompt counts once");
    assert_eq!(v["usage"]["completion_tokens"], 18);
    assert_eq!(v["usage"]["total_tokens"], prompt_tokens + 18);

    let seeded = json!({"prompt": prompt, "max_tokens": 12, "ignore_eos": true, "temperature": 1.0, "top_p": 1.0,
                        "seed": 9, "n": 3, "best_of": 3});
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .expect("choices")
            .iter()
            .map(|c| c["text"].as_str().expect("text").to_string())
            .collect()
    };
    let first = texts(&ok(&url, seeded.clone()));
    assert_eq!(first, texts(&ok(&url, seeded.clone())), "a seed repeats its choices");
    assert!(
        first[0] != first[1] || first[1] != first[2],
        "three seeds, one text: {first:?}"
    );

    let mut streamed = seeded.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, events) = stream(&url, &streamed);
    assert_eq!(status, 200);
    let got = streamed_choices(&events, false);
    assert_eq!(got.keys().copied().collect::<Vec<_>>(), vec![0, 1, 2]);
    for (i, (text, reason)) in &got {
        assert_eq!(text, &first[*i as usize], "choice {i} streamed as answered");
        assert_eq!(reason, "length");
    }
    assert!(interleaved(&events), "the choices run side by side");
    let usage = &events[events.len() - 2];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(usage["usage"]["completion_tokens"], 36);
}

#[test]
fn chat_answers_n_choices_streamed_and_not() {
    let f = shared();
    let url = format!("{}/v1/chat/completions", f.url);
    let request = json!({"messages": [{"role": "user", "content": "hello there"}], "max_completion_tokens": 8,
                         "temperature": 1.0, "seed": 3, "ignore_eos": true, "n": 2});
    let v = ok(&url, request.clone());
    assert_eq!(v["object"], "chat.completion");
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 2, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["role"], "assistant");
        assert_eq!(c["finish_reason"], "length");
    }
    assert_eq!(v["usage"]["completion_tokens"], 16);

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let (status, events) = stream(&url, &streamed);
    assert_eq!(status, 200);
    // Each choice opens with the assistant's role.
    let roles: Vec<u64> = events
        .iter()
        .filter(|e| e["choices"][0]["delta"]["role"] == "assistant")
        .filter_map(|e| e["choices"][0]["index"].as_u64())
        .collect();
    assert_eq!(roles, vec![0, 1]);
    let got = streamed_choices(&events, true);
    assert_eq!(got.len(), 2);
    for (i, (content, reason)) in &got {
        assert_eq!(
            Some(content.as_str()),
            choices[*i as usize]["message"]["content"].as_str(),
            "choice {i}"
        );
        assert_eq!(reason, "length");
    }
}

#[test]
fn n_past_max_seqs_and_best_of_asking_for_more_are_refused() {
    let f = shared();
    for endpoint in ["completions", "chat/completions"] {
        let url = format!("{}/v1/{endpoint}", f.url);
        for (extra, param, words) in [
            (json!({"n": 5}), "n", "between 1 and 4"),
            (json!({"n": 0}), "n", "between 1 and 4"),
            (json!({"n": "2"}), "n", "integer"),
            (json!({"n": 2, "best_of": 4}), "best_of", "best_of 4"),
        ] {
            let mut body = json!({"prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2});
            for (k, v) in extra.as_object().expect("object") {
                body[k] = v.clone();
            }
            let (status, v) = post(&url, &body.to_string(), &[]);
            assert_eq!(status, 400, "{endpoint} {extra}: {v}");
            assert_eq!(v["error"]["param"], param, "{endpoint} {extra}: {v}");
            assert!(message(&v).contains(words), "{endpoint} {extra}: {v}");
        }
    }
}

#[test]
fn a_client_disconnecting_cancels_every_choice() {
    // An engine of its own, so its counts are this test's alone.
    let f = Fixture::start(4, 4096);
    let body = json!({"prompt": "keep going", "max_tokens": 4000, "ignore_eos": true, "stream": true, "n": 3});
    let (mut live, first) = Live::start(&format!("{}/v1/completions", f.url), &body);
    assert!(first.contains("text_completion"), "{first}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while f.rt.block_on(f.engine.health()).expect("health").running < 3 {
        assert!(Instant::now() < deadline, "the choices never ran together");
        std::thread::sleep(Duration::from_millis(10));
    }
    live.child.kill().expect("kill curl");
    let _ = live.child.wait();
    drop(live);
    loop {
        let h = f.rt.block_on(f.engine.health()).expect("health");
        if h.running == 0 && h.waiting == 0 {
            assert_eq!(h.free_slots, 4, "{h:?}");
            break;
        }
        assert!(Instant::now() < deadline, "choices still run: {h:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let m = f.engine.metrics().snapshot();
    assert_eq!((m.requests_cancelled, m.requests_finished), (1, 0), "{m:?}");
    assert!(m.generated_tokens < 3 * 4000, "{m:?}");
}
