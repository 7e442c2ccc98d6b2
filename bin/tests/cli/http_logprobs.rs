//! Log-probabilities over the OpenAI-compatible HTTP API, against the oracle: a full softmax of the same model's whole
//! logits (the `rewind logits` path: a CPU rank group asked for every position's logits). Completions' legacy object
//! with `logprobs: 5`, streamed and not; `echo` with `max_tokens: 0` scoring a prompt (lm-eval's loglikelihood);
//! vLLM's `prompt_logprobs`; chat's `logprobs` / `top_logprobs`, streamed and not; `n` choices, each with its own
//! tokens' entries and the prompt's computed once.

use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::rank::{cpu_group, CpuOptions, GroupSequence, Rows, SeqKind};
use serde_json::{json, Value};

use crate::http_fixture;
use http_fixture::*;

const PROMPT: [u32; 6] = [11, 12, 13, 40, 7, 99];

/// The oracle: the log-softmax of every position's whole logits for `tokens` (prefilled in one pass), and the greedy
/// continuation of `tokens` by `extra` tokens with their rows.
fn oracle(tokens: &[u32], extra: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    oracle_of(tokens, extra, false)
}

/// The oracle of a request's `n > 1` choices: as [`oracle`], but the prompt prefilled as its choices compute it,
/// all but the last token (the shared fork prefill), then the last token alone (each choice, from the forked state).
/// The chunk boundary changes the rounding, which the tiny random model's decodes carry on (by some 1e-4 after a
/// few tokens): each computation is checked against its own oracle.
fn forked_oracle(tokens: &[u32], extra: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    oracle_of(tokens, extra, true)
}

fn oracle_of(tokens: &[u32], extra: usize, forked: bool) -> (Vec<u32>, Vec<Vec<f32>>) {
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
    let chunks = if forked {
        let (shared, last) = tokens.split_at(tokens.len() - 1);
        vec![shared, last]
    } else {
        vec![tokens]
    };
    let mut rows: Vec<Vec<f32>> = Vec::new();
    for chunk in chunks {
        let out = seq.run(SeqKind::Prefill, chunk, Rows::All, true).expect("prefill");
        rows.extend(out.logits.expect("logits").chunks_exact(vocab).map(log_softmax));
    }
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
    // Other tests' requests share the server: a step's batch changes the CPU's rounding in the last bits.
    let streamed = json!({"token_logprobs": values});
    assert_close_all(&self::values(&streamed), &self::values(lp), "streamed");

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
    same_chat_entries(&streamed, &content, "streamed");
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
    ] {
        let (status, v) = post(url, &body.to_string(), &[]);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        assert!(message(&v).contains(want), "{body}: {v}");
    }
}

/// The values of a legacy completions object (`token_logprobs`), `null` as NaN.
fn values(lp: &Value) -> Vec<f32> {
    lp["token_logprobs"]
        .as_array()
        .expect("token_logprobs")
        .iter()
        .map(|v| v.as_f64().map_or(f32::NAN, |v| v as f32))
        .collect()
}

/// Chat entries of the same tokens with values within 1e-4 (another request in a step's batch changes the CPU's
/// rounding in the last bits).
fn same_chat_entries(got: &[Value], want: &[Value], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g["token"], w["token"], "{what}");
        close(&g["logprob"], w["logprob"].as_f64().expect("a value") as f32, what);
        let (gt, wt) = (
            g["top_logprobs"].as_array().expect("top"),
            w["top_logprobs"].as_array().expect("top"),
        );
        assert_eq!(gt.len(), wt.len(), "{what}");
        for (a, b) in gt.iter().zip(wt) {
            assert_eq!(a["token"], b["token"], "{what}");
            close(&a["logprob"], b["logprob"].as_f64().expect("a value") as f32, what);
        }
    }
}

fn assert_close_all(got: &[f32], want: &[f32], what: &str) {
    assert_close_all_within(got, want, 1e-4, what)
}

fn assert_close_all_within(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g.is_nan() && w.is_nan()) || (g - w).abs() < tolerance,
            "{what} position {i}: {g} vs {w}"
        );
    }
}

/// Follows a choice's legacy object (`tokens` strings and their values, `k` alternatives each) through the forked
/// oracle from `prompt`: at each position the id is the one whose string and full-softmax value the entry names, and its
/// alternatives are the row's best. Returns the ids.
fn follow(prompt: &[u32], lp: &Value, from: usize, k: usize) -> Vec<u32> {
    let mut g = cpu_group(
        &model_dir(),
        &CpuOptions {
            tp: 1,
            decoder: DecoderConfig::new(1, 128),
        },
    )
    .expect("oracle group");
    let vocab = g.vocab_size();
    let tokens = lp["tokens"].as_array().expect("tokens").len();
    let mut seq = GroupSequence::open(&mut g, FormChoice::Recurrent, prompt.len() + tokens + 1).expect("open");
    let (shared, last) = prompt.split_at(prompt.len() - 1);
    seq.run(SeqKind::Prefill, shared, Rows::None, false).expect("prefill");
    let out = seq.run(SeqKind::Prefill, last, Rows::Last, true).expect("prefill");
    let mut row = log_softmax(&out.logits.expect("logits")[..vocab]);
    let mut ids = Vec::new();
    for i in from..tokens {
        let s = lp["tokens"][i].as_str().expect("a token");
        let v = lp["token_logprobs"][i].as_f64().expect("a value") as f32;
        let id = (0..vocab as u32)
            .find(|&t| piece(t) == s && (row[t as usize] - v).abs() < 1e-4)
            .unwrap_or_else(|| panic!("position {i}: no id of {s:?} has log-probability {v}"));
        check_legacy(lp, i, id, &row, k);
        ids.push(id);
        let out = seq.run(SeqKind::Decode, &[id], Rows::Last, true).expect("decode");
        row = log_softmax(&out.logits.expect("logits"));
    }
    ids
}

#[test]
fn n_choices_carry_their_own_logprobs_and_the_prompt_is_computed_once() {
    let f = shared();
    let url = format!("{}/v1/completions", f.url);
    let n = 4;
    let (ids, rows) = forked_oracle(&PROMPT, n);
    // Greedy: three equal choices, each with the echoed prompt's entries then its tokens', as the full softmax of
    // the forked computation says; the request with one choice answers the same tokens and (up to the rounding of
    // its one prefill chunk, see `forked_oracle`) the same values.
    let body = json!({"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": true, "logprobs": 5,
                      "echo": true, "n": 3});
    let v = ok(&url, body.clone());
    let one = ok(
        &url,
        json!({"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": true,
                              "logprobs": 5, "echo": true}),
    );
    let want = values(&one["choices"][0]["logprobs"]);
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{v}");
    for (c, choice) in choices.iter().enumerate() {
        let lp = &choice["logprobs"];
        assert_eq!(choice["text"], choices[0]["text"], "greedy choices are equal");
        assert_eq!(lp["tokens"], one["choices"][0]["logprobs"]["tokens"], "choice {c}");
        assert_eq!(
            lp["text_offset"], one["choices"][0]["logprobs"]["text_offset"],
            "choice {c}"
        );
        assert_close_all(
            &values(lp),
            &values(&choices[0]["logprobs"]),
            "greedy choices' entries are equal",
        );
        assert_close_all(
            &values(lp)[..PROMPT.len()],
            &want[..PROMPT.len()],
            "the prompt's entries",
        );
        assert_close_all_within(&values(lp), &want, 1e-3, &format!("choice {c}"));
        assert!(lp["token_logprobs"][0].is_null());
        for i in 1..PROMPT.len() + n {
            check_legacy(lp, i, ids[i], &rows[i - 1], 5);
        }
    }
    // Streamed: each choice gets the prompt's chunk and its tokens' entries, the same as answered.
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let (status, events) = stream(&url, &streaming);
    assert_eq!(status, 200);
    for (c, choice) in choices.iter().enumerate() {
        let mut got = Vec::new();
        for e in events.iter().filter(|e| e["choices"][0]["index"] == c) {
            let l = &e["choices"][0]["logprobs"];
            if !l.is_null() {
                got.extend(values(l));
            }
        }
        assert_close_all(&got, &values(&choice["logprobs"]), &format!("streamed choice {c}"));
    }
    // vLLM's `prompt_logprobs` come with every choice.
    let v = ok(
        &url,
        json!({"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1, "n": 2}),
    );
    let p = &v["choices"][0]["prompt_logprobs"];
    assert_eq!(p.as_array().map(Vec::len), Some(PROMPT.len()), "{v}");
    assert_eq!(&v["choices"][1]["prompt_logprobs"], p);
    for i in 1..PROMPT.len() {
        close(
            &p[i][PROMPT[i].to_string()]["logprob"],
            rows[i - 1][PROMPT[i] as usize],
            "prompt_logprobs",
        );
    }

    // Seeded: each choice's entries are the full softmax of the rows along its own tokens.
    let seeded = json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": true,
                        "logprobs": 2, "n": 3});
    let v = ok(&url, seeded);
    let paths: Vec<Vec<u32>> = v["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| follow(&PROMPT, &c["logprobs"], 0, 2))
        .collect();
    assert!(paths.iter().all(|p| p.len() == 6));
    assert!(
        paths[0] != paths[1] || paths[1] != paths[2],
        "three seeds, one continuation: {paths:?}"
    );
}

#[test]
fn chat_choices_carry_their_own_logprobs() {
    let f = shared();
    let url = format!("{}/v1/chat/completions", f.url);
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0,
                      "ignore_eos": true, "logprobs": true, "top_logprobs": 2});
    let one = ok(&url, body.clone());
    let want = &one["choices"][0]["logprobs"]["content"];
    let mut many = body;
    many["n"] = json!(2);
    let v = ok(&url, many.clone());
    for c in 0..2 {
        let got = v["choices"][c]["logprobs"]["content"].as_array().expect("content");
        assert_eq!(got.len(), 4, "{v}");
        assert!(got
            .iter()
            .all(|e| e["top_logprobs"].as_array().map(Vec::len) == Some(2)));
        // The forked prompt's rounding differs from one prefill's in the last bits (see `forked_oracle`).
        for (g, w) in got.iter().zip(want.as_array().expect("content")) {
            assert_eq!(g["token"], w["token"], "choice {c}");
            let d = g["logprob"].as_f64().expect("a value") - w["logprob"].as_f64().expect("a value");
            assert!(d.abs() < 1e-3, "choice {c}: {g} vs {w}");
        }
    }
    many["stream"] = json!(true);
    let (status, events) = stream(&url, &many);
    assert_eq!(status, 200);
    for c in 0..2 {
        let streamed: Vec<Value> = events
            .iter()
            .filter(|e| e["choices"][0]["index"] == c)
            .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array())
            .flatten()
            .cloned()
            .collect();
        let answered = v["choices"][c]["logprobs"]["content"].as_array().expect("content");
        same_chat_entries(&streamed, answered, &format!("streamed choice {c}"));
    }
}
