//! Structured outputs over HTTP with the tiny random model: whatever it would say, the grammar keeps the output valid
//! (JSON schemas with nested objects, enums, bounded integers and required fields, across seeds at temperature 1;
//! choices; regexes; any JSON object), a constraint that does not compile is a 400 naming its field, and a
//! constrained request beside an unconstrained one leaves the other's output as it was.

use serde_json::{json, Value};

use crate::http_fixture;
use http_fixture::*;

/// The schema of the tests: nested objects, enums, bounded integers, required fields, a bounded array.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "pet": {"type": "string", "enum": ["cat", "dog", "fish"]},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 5},
                    "floor": {"type": "integer", "minimum": -1, "maximum": 3}
                },
                "required": ["city", "floor"],
                "additionalProperties": false
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}
        },
        "required": ["name", "age", "pet", "address"],
        "additionalProperties": false
    })
}

/// Checks `v` against [`schema`] by hand.
fn validates(v: &Value) -> Result<(), String> {
    let o = v.as_object().ok_or("not an object")?;
    let allowed = ["name", "age", "pet", "address", "tags"];
    if let Some(k) = o.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(format!("extra key {k}"));
    }
    let name = o.get("name").and_then(Value::as_str).ok_or("name")?;
    if name.chars().count() > 6 {
        return Err("name too long".into());
    }
    let age = o.get("age").and_then(Value::as_i64).ok_or("age")?;
    if !(18..=99).contains(&age) {
        return Err(format!("age {age}"));
    }
    let pet = o.get("pet").and_then(Value::as_str).ok_or("pet")?;
    if !["cat", "dog", "fish"].contains(&pet) {
        return Err(format!("pet {pet}"));
    }
    let a = o.get("address").and_then(Value::as_object).ok_or("address")?;
    if a.len() != 2
        || a.get("city")
            .and_then(Value::as_str)
            .is_none_or(|c| c.chars().count() > 5)
    {
        return Err("address.city".into());
    }
    if !a
        .get("floor")
        .and_then(Value::as_i64)
        .is_some_and(|f| (-1..=3).contains(&f))
    {
        return Err("address.floor".into());
    }
    if let Some(tags) = o.get("tags") {
        let tags = tags.as_array().ok_or("tags")?;
        if tags.len() > 2 || tags.iter().any(|t| t != "a" && t != "b") {
            return Err("tags".into());
        }
    }
    Ok(())
}

fn completion(url: &str, mut body: Value) -> (String, String) {
    body["prompt"] = json!("Describe a person as JSON:");
    if body["max_tokens"].is_null() {
        body["max_tokens"] = json!(300);
    }
    let v = ok(&format!("{url}/v1/completions"), body);
    (
        v["choices"][0]["text"].as_str().expect("text").to_string(),
        v["choices"][0]["finish_reason"].as_str().expect("finish").to_string(),
    )
}

#[test]
fn json_schemas_hold_across_seeds_at_temperature_one() {
    let f = shared();
    for seed in 0..4 {
        let (text, finish) = completion(&f.url, json!({"temperature": 1, "seed": seed, "guided_json": schema()}));
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?}: {e}"));
        validates(&v).unwrap_or_else(|e| panic!("seed {seed}: {text}: {e}"));
        assert_eq!(finish, "stop", "seed {seed}: the grammar ends the output with EOS");
    }
    // OpenAI's form on chat, streamed: the same guarantee.
    for seed in 10..12 {
        let body = json!({
            "messages": [{"role": "user", "content": "a person please"}],
            "temperature": 1, "seed": seed, "max_tokens": 300, "stream": true,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "strict": true, "schema": schema()}}
        });
        let (status, events) = stream(&format!("{}/v1/chat/completions", f.url), &body);
        assert_eq!(status, 200);
        let (content, _) = chat_stream_content(&events);
        let v: Value = serde_json::from_str(&content).unwrap_or_else(|e| panic!("seed {seed}: {content:?}: {e}"));
        validates(&v).unwrap_or_else(|e| panic!("seed {seed}: {content}: {e}"));
    }
}

#[test]
fn choices_regexes_and_json_objects_hold() {
    let f = shared();
    let choices = ["positive", "negative", "neutral"];
    for seed in 0..3 {
        let (text, finish) = completion(
            &f.url,
            json!({"temperature": 1, "seed": seed, "guided_choice": choices}),
        );
        assert!(choices.contains(&text.as_str()), "{text:?}");
        assert_eq!(finish, "stop");
        let (text, _) = completion(
            &f.url,
            json!({"temperature": 1, "seed": seed, "structured_outputs": {"regex": "[A-Z][a-z]{2,5} [0-9]{1,3}"}}),
        );
        let (word, number) = text.split_once(' ').unwrap_or_else(|| panic!("{text:?}"));
        let mut chars = word.chars();
        assert!(chars.next().is_some_and(|c| c.is_ascii_uppercase()), "{text:?}");
        assert!(
            (2..=5).contains(&chars.clone().count()) && chars.all(|c| c.is_ascii_lowercase()),
            "{text:?}"
        );
        assert!(
            (1..=3).contains(&number.len()) && number.bytes().all(|b| b.is_ascii_digit()),
            "{text:?}"
        );
        let (text, _) = completion(
            &f.url,
            json!({"temperature": 1, "seed": seed, "guided_regex": "(yes|no)!"}),
        );
        assert!(text == "yes!" || text == "no!", "{text:?}");
    }
    // Greedy rows take the masked argmax.
    let (text, _) = completion(&f.url, json!({"temperature": 0, "guided_choice": choices}));
    assert!(choices.contains(&text.as_str()), "{text:?}");
    for seed in 0..2 {
        let chat = ok(
            &format!("{}/v1/chat/completions", f.url),
            json!({"messages": [{"role": "user", "content": "json"}], "temperature": 1, "seed": seed,
                   "max_tokens": 300, "response_format": {"type": "json_object"}}),
        );
        let content = chat["choices"][0]["message"]["content"].as_str().expect("content");
        if chat["choices"][0]["finish_reason"] == "stop" {
            let v: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{content:?}: {e}"));
            assert!(v.is_object(), "{content}");
        } else {
            // An object the budget cut short is still a prefix of one.
            assert!(content.starts_with('{'), "{content:?}");
        }
    }
    let lark = r#"start: "call(" %json {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": false} ")""#;
    let (text, _) = completion(&f.url, json!({"temperature": 1, "seed": 3, "guided_grammar": lark}));
    let inner = text
        .strip_prefix("call(")
        .and_then(|t| t.strip_suffix(')'))
        .unwrap_or_else(|| panic!("{text:?}"));
    let v: Value = serde_json::from_str(inner).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(v["n"].as_i64().is_some_and(|n| (0..=9).contains(&n)), "{text}");
}

#[test]
fn constraints_that_do_not_compile_are_400s_naming_the_field() {
    let f = shared();
    let url = format!("{}/v1/completions", f.url);
    for (extra, field) in [
        (
            json!({"guided_json": {"type": "object", "properties": {"a": {"type": "bogus"}}}}),
            "guided_json",
        ),
        (json!({"guided_regex": "(unclosed"}), "guided_regex"),
        (json!({"guided_grammar": "start: missing_rule"}), "guided_grammar"),
        (
            json!({"structured_outputs": {"grammar": "not a grammar at all"}}),
            "structured_outputs.grammar",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}}),
            "response_format.json_schema.schema",
        ),
        (json!({"guided_choice": []}), "guided_choice"),
        (
            json!({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}),
            "guided_decoding_backend",
        ),
        (json!({"guided_regex": "a", "ignore_eos": true}), "ignore_eos"),
    ] {
        let mut body = json!({"prompt": "hi", "max_tokens": 4});
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        let (status, v) = post(&url, &body.to_string(), &[]);
        assert_eq!(status, 400, "{body}: {v}");
        if field == "ignore_eos" {
            assert!(message(&v).contains("ignore_eos"), "{v}");
        } else {
            assert_eq!(v["error"]["param"], field, "{body}: {v}");
        }
    }
    // The server still answers constrained requests after all of that.
    let (text, _) = completion(&f.url, json!({"guided_choice": ["ok"]}));
    assert_eq!(text, "ok");
}

#[test]
fn a_constrained_request_does_not_change_its_neighbours_output() {
    let f = shared();
    let free = json!({"prompt": "once upon a time", "max_tokens": 24, "temperature": 1, "seed": 7, "ignore_eos": true});
    let alone = ok(&format!("{}/v1/completions", f.url), free.clone());
    let url = f.url.clone();
    let constrained = std::thread::spawn(move || {
        (0..3)
            .map(|seed| completion(&url, json!({"temperature": 1, "seed": seed, "guided_json": schema()})).0)
            .collect::<Vec<_>>()
    });
    let beside = ok(&format!("{}/v1/completions", f.url), free);
    for text in constrained.join().expect("constrained requests") {
        validates(&serde_json::from_str(&text).expect("json")).expect("valid");
    }
    assert_eq!(alone["choices"][0]["text"], beside["choices"][0]["text"]);
}
