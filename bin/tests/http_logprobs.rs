//! Log-probabilities over the OpenAI-compatible HTTP API, against the oracle: a full softmax of the same model's whole
//! logits (the `rewind logits` path: a CPU rank group asked for every position's logits). Completions' legacy object
//! with `logprobs: 5`, streamed and not; `echo` with `max_tokens: 0` scoring a prompt (lm-eval's loglikelihood);
//! vLLM's `prompt_logprobs`; chat's `logprobs` / `top_logprobs`, streamed and not.

use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::rank::{cpu_group, CpuOptions, GroupSequence, Rows, SeqKind};
use serde_json::{json, Value};

mod http_fixture;
use http_fixture::*;

const PROMPT: [u32; 6] = [11, 12, 13, 40, 7, 99];

/// The oracle: the log-softmax of every position's whole logits for `tokens` (prefilled in one pass), and the greedy
/// continuation of `tokens` by `extra` tokens with their rows.
fn oracle(tokens: &[u32], extra: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut g = cpu_group(
        &model_dir(),
        &CpuOptions {
            tp: 1,
            decoder: DecoderConfig::new(1, 128),
        },
    )
    .expect("oracle group");
    let vocab = g.vocab_size();
    let mut seq = GroupSequence::open(&mut g, FormChoice::Recurrent, tokens.len() + extra + 1).expect("open");
    let out = seq.run(SeqKind::Prefill, tokens, Rows::All, true).expect("prefill");
    let mut rows: Vec<Vec<f32>> = out
        .logits
        .expect("logits")
        .chunks_exact(vocab)
        .map(log_softmax)
        .collect();
    let mut ids = tokens.to_vec();
    for _ in 0..extra {
        let next = argmax(rows.last().expect("a row"));
        ids.push(next);
        let out = seq.run(SeqKind::Decode, &[next], Rows::Last, true).expect("decode");
        rows.push(log_softmax(&out.logits.expect("logits")));
    }
    (ids, rows)
}

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f32>().ln();
    row.iter().map(|v| v - lse).collect()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// The ids of a row's `k` best entries, best first, ties to the lower id.
fn top_ids(row: &[f32], k: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..row.len() as u32).collect();
    order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

fn piece(id: u32) -> String {
    shared().model.tokenizer.decode(&[id], false).expect("decode")
}

fn close(got: &Value, want: f32, what: &str) {
    let g = got.as_f64().unwrap_or_else(|| panic!("{what}: {got} is no number")) as f32;
    assert!((g - want).abs() < 1e-4, "{what}: {g} vs {want}");
}

/// Checks a legacy completions object's position `i` (token `ids[i]`, predicted by oracle row `i - 1`) with `k`
/// alternatives.
fn check_legacy(lp: &Value, i: usize, id: u32, row: &[f32], k: usize) {
    assert_eq!(lp["tokens"][i], piece(id), "position {i}");
    close(&lp["token_logprobs"][i], row[id as usize], &format!("position {i}"));
    let top = lp["top_logprobs"][i].as_object().expect("a dict");
    let ids = top_ids(row, k);
    let mut seen = std::collections::HashSet::new();
    for t in ids {
        // A dict keeps the best of ids sharing a string.
        if seen.insert(piece(t)) {
            close(
                &top[&piece(t)],
                row[t as usize],
                &format!("position {i} alternative {t}"),
            );
        }
    }
    assert_eq!(top.len(), seen.len(), "position {i}: {top:?}");
}

#[test]
fn completion_logprobs_equal_a_full_softmax_of_the_logits() {
    let f = shared();
    let url = format!("{}/v1/completions", f.url);
    let n = 4;
    let (ids, rows) = oracle(&PROMPT, n);
    let body = json!({"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": true, "logprobs": 5});
    let v = ok(&url, body.clone());
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(n), "{v}");
    for j in 0..n {
        let at = PROMPT.len() + j;
        check_legacy(lp, j, ids[at], &rows[at - 1], 5);
    }
    // Offsets: each token's string starts where the previous one's ended.
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .expect("offsets")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert_eq!(offsets[0], 0);
    for j in 1..n {
        assert_eq!(
            offsets[j] - offsets[j - 1],
            piece(ids[PROMPT.len() + j - 1]).chars().count() as u64
        );
    }

    // Streamed: each chunk carries its tokens' entries, the same as the answer's.
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let (status, events) = stream(&url, &streaming);
    assert_eq!(status, 200);
    let mut tokens = Vec::new();
    let mut values = Vec::new();
    for e in events.iter().filter(|e| !e["choices"][0]["logprobs"].is_null()) {
        let l = &e["choices"][0]["logprobs"];
        tokens.extend(l["tokens"].as_array().expect("tokens").iter().cloned());
        values.extend(l["token_logprobs"].as_array().expect("values").iter().cloned());
    }
    assert_eq!(Value::Array(tokens), lp["tokens"]);
    assert_eq!(Value::Array(values), lp["token_logprobs"]);

    // `logprobs: 0`: the token's own entry, no alternatives.
    let v = ok(
        &url,
        json!({"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "logprobs": 0}),
    );
    let lp = &v["choices"][0]["logprobs"];
    close(
        &lp["token_logprobs"][0],
        rows[PROMPT.len() - 1][ids[PROMPT.len()] as usize],
        "k 0",
    );
    assert_eq!(lp["top_logprobs"][0], json!({}));

    // Sampled tokens report their raw log-probabilities (not the tempered distribution's).
    let v = ok(
        &url,
        json!({"prompt": PROMPT, "max_tokens": 1, "temperature": 1.7, "seed": 5, "logprobs": 2}),
    );
    let lp = &v["choices"][0]["logprobs"];
    let row = &rows[PROMPT.len() - 1];
    let token = lp["tokens"][0].as_str().expect("a token");
    let want = (0..row.len() as u32)
        .filter(|&t| piece(t) == token)
        .map(|t| row[t as usize]);
    let got = lp["token_logprobs"][0].as_f64().expect("value") as f32;
    assert!(want.into_iter().any(|w| (w - got).abs() < 1e-4), "{token}: {got}");
}

#[test]
fn echo_with_no_tokens_scores_the_prompt() {
    let f = shared();
    let url = format!("{}/v1/completions", f.url);
    let (_, rows) = oracle(&PROMPT, 0);
    let v = ok(
        &url,
        json!({"prompt": PROMPT, "max_tokens": 0, "echo": true, "logprobs": 1, "prompt_logprobs": 1}),
    );
    let choice = &v["choices"][0];
    assert_eq!(
        choice["text"],
        f.model.tokenizer.decode(&PROMPT, false).expect("decode")
    );
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 0);
    assert_eq!(v["usage"]["prompt_tokens"], PROMPT.len());
    let lp = &choice["logprobs"];
    assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(PROMPT.len()), "{v}");
    assert_eq!(lp["tokens"][0], piece(PROMPT[0]));
    assert!(
        lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(),
        "{lp}"
    );
    for i in 1..PROMPT.len() {
        check_legacy(lp, i, PROMPT[i], &rows[i - 1], 1);
    }
    // vLLM's list: null first, then the prompt token's entry (and the best one) by id.
    let p = choice["prompt_logprobs"].as_array().expect("prompt_logprobs");
    assert_eq!(p.len(), PROMPT.len());
    assert!(p[0].is_null());
    for i in 1..PROMPT.len() {
        let e = &p[i][PROMPT[i].to_string()];
        close(
            &e["logprob"],
            rows[i - 1][PROMPT[i] as usize],
            &format!("prompt_logprobs {i}"),
        );
        assert_eq!(e["decoded_token"], piece(PROMPT[i]));
        let best = top_ids(&rows[i - 1], 1)[0];
        assert_eq!(p[i][best.to_string()]["rank"], 1);
    }
    // The same scored streaming: the echoed text, then one chunk with the prompt's entries.
    let (status, events) = stream(
        &url,
        &json!({"prompt": PROMPT, "max_tokens": 0, "echo": true, "logprobs": 1, "stream": true}),
    );
    assert_eq!(status, 200);
    let with: Vec<&Value> = events
        .iter()
        .filter(|e| !e["choices"][0]["logprobs"].is_null())
        .collect();
    assert_eq!(with.len(), 1, "{events:?}");
    assert_eq!(
        with[0]["choices"][0]["logprobs"]["token_logprobs"],
        lp["token_logprobs"]
    );
    // Without log-probabilities there is nothing to score: max_tokens 0 is refused as before.
    let (status, v) = post(
        &url,
        &json!({"prompt": PROMPT, "max_tokens": 0, "echo": true}).to_string(),
        &[],
    );
    assert_eq!(status, 400);
    assert!(message(&v).contains("at least 1"), "{v}");
}

#[test]
fn chat_logprobs_come_with_top_alternatives_streamed_and_not() {
    let f = shared();
    let url = format!("{}/v1/chat/completions", f.url);
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0,
                      "ignore_eos": true, "logprobs": true, "top_logprobs": 3});
    let v = ok(&url, body.clone());
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("content")
        .clone();
    assert_eq!(content.len(), 5, "{v}");
    for e in &content {
        let token = e["token"].as_str().expect("token");
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .expect("bytes")
            .iter()
            .filter_map(|b| b.as_u64())
            .map(|b| b as u8)
            .collect();
        assert_eq!(bytes, token.as_bytes());
        let top = e["top_logprobs"].as_array().expect("top");
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the best alternative, and the alternatives are in order.
        assert_eq!(top[0]["logprob"], e["logprob"], "{e}");
        assert!(top
            .windows(2)
            .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
        assert!(e["logprob"].as_f64().is_some_and(|l| l <= 0.0));
    }
    let mut streaming = body;
    streaming["stream"] = json!(true);
    let (status, events) = stream(&url, &streaming);
    assert_eq!(status, 200);
    let streamed: Vec<Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(streamed, content);
    // Without logprobs the field is null.
    let v = ok(
        &url,
        json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}),
    );
    assert!(v["choices"][0]["logprobs"].is_null());
}

#[test]
fn bad_logprob_fields_are_400s_naming_them() {
    let f = shared();
    let cmpl = format!("{}/v1/completions", f.url);
    let chat = format!("{}/v1/chat/completions", f.url);
    let hi = json!([{"role": "user", "content": "hi"}]);
    for (url, body, param, want) in [
        (
            &cmpl,
            json!({"prompt": "x", "logprobs": 21}),
            "logprobs",
            "between 0 and 20",
        ),
        (
            &cmpl,
            json!({"prompt": "x", "logprobs": -1}),
            "logprobs",
            "between 0 and 20",
        ),
        (
            &cmpl,
            json!({"prompt": "x", "prompt_logprobs": 30}),
            "prompt_logprobs",
            "between 0 and 20",
        ),
        (
            &chat,
            json!({"messages": hi, "top_logprobs": 2}),
            "top_logprobs",
            "requires logprobs",
        ),
        (
            &chat,
            json!({"messages": hi, "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
            "between 0 and 20",
        ),
        (
            &chat,
            json!({"messages": hi, "logprobs": true, "top_logprobs": -1}),
            "top_logprobs",
            "between 0 and 20",
        ),
        (&chat, json!({"messages": hi, "logprobs": 3}), "logprobs", "boolean"),
        // Log-probabilities are reported for one choice.
        (
            &cmpl,
            json!({"prompt": "x", "n": 2, "logprobs": 1}),
            "n",
            "log-probabilities of n > 1 choices",
        ),
        (
            &cmpl,
            json!({"prompt": "x", "n": 2, "prompt_logprobs": 0}),
            "n",
            "log-probabilities of n > 1 choices",
        ),
        (
            &chat,
            json!({"messages": hi, "n": 3, "logprobs": true, "top_logprobs": 2}),
            "n",
            "log-probabilities of n > 1 choices",
        ),
    ] {
        let (status, v) = post(url, &body.to_string(), &[]);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        assert!(message(&v).contains(want), "{body}: {v}");
    }
}
