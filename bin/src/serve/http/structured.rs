//! Structured outputs over HTTP: the constraint a body asks for, in any of the forms clients send — OpenAI's
//! `response_format` (`json_object`, `json_schema`), vLLM's `guided_json` / `guided_regex` / `guided_choice` /
//! `guided_grammar` and its newer `structured_outputs` object — compiled on the blocking pool. A malformed or
//! uncompilable constraint is a 400 naming its field.

use rewind_engine::grammar::{Constraint, ConstraintSpec};
use serde_json::Value;

use super::errors::{echo, ApiError};
use super::generation::blocking;
use super::openai::{type_name, Fields};
use super::Api;

/// The values of `guided_decoding_backend` this server accepts: llguidance is the one backend.
const BACKENDS: &[&str] = &["guidance", "llguidance", "auto"];

/// The keys of vLLM's `structured_outputs` this server reads (one constraint each).
const STRUCTURED_KEYS: &[&str] = &["json", "regex", "choice", "grammar", "json_object"];

/// The constraint `f` asks for, compiled; `None` when it asks for none.
pub async fn constraint(api: &Api, f: &Fields) -> Result<Option<Constraint>, ApiError> {
    let Some((field, spec)) = spec(f)? else {
        return Ok(None);
    };
    let compiled = blocking(api, move |state| {
        state
            .compile_constraint(spec)
            .map_err(|m| ApiError::invalid(field.clone(), format!("{field}: {m}")))
    })
    .await?;
    Ok(Some(compiled))
}

fn wrong(field: &str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(field, format!("{field} must be {want}, got {}", type_name(got)))
}

/// The field that names the constraint and what it asks for; at most one of the forms may be given.
pub fn spec(f: &Fields) -> Result<Option<(String, ConstraintSpec)>, ApiError> {
    if let Some(v) = f.get("guided_decoding_backend") {
        match v {
            Value::String(s) if BACKENDS.contains(&s.as_str()) => {}
            Value::String(s) => {
                return Err(ApiError::invalid(
                    "guided_decoding_backend",
                    format!(
                        "guided_decoding_backend \"{}\" is not available: this server constrains with llguidance \
                         (\"guidance\", \"llguidance\" or \"auto\")",
                        echo(s)
                    ),
                ))
            }
            v => return Err(wrong("guided_decoding_backend", "a string", v)),
        }
    }
    let mut found: Vec<(String, ConstraintSpec)> = Vec::new();
    if let Some(v) = f.get("response_format") {
        if let Some(spec) = response_format(v)? {
            found.push(spec);
        }
    }
    if let Some(v) = f.get("guided_json") {
        found.push(("guided_json".into(), schema("guided_json", v)?));
    }
    if let Some(v) = f.get("guided_regex") {
        found.push(("guided_regex".into(), ConstraintSpec::Regex(string("guided_regex", v)?)));
    }
    if let Some(v) = f.get("guided_choice") {
        found.push((
            "guided_choice".into(),
            ConstraintSpec::Choice(choices("guided_choice", v)?),
        ));
    }
    if let Some(v) = f.get("guided_grammar") {
        found.push((
            "guided_grammar".into(),
            ConstraintSpec::Lark(string("guided_grammar", v)?),
        ));
    }
    if let Some(v) = f.get("structured_outputs") {
        found.extend(structured_outputs(v)?);
    }
    if found.len() > 1 {
        return Err(ApiError::invalid(
            found[1].0.clone(),
            format!(
                "{} and {} both constrain the output: give one of them",
                found[0].0, found[1].0
            ),
        ));
    }
    Ok(found.pop())
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema` with its `schema`.
fn response_format(v: &Value) -> Result<Option<(String, ConstraintSpec)>, ApiError> {
    const NAME: &str = "response_format";
    let Value::Object(o) = v else {
        return Err(wrong(NAME, "an object", v));
    };
    let kind = match o.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(t) => return Err(wrong("response_format.type", "a string", t)),
        None => {
            return Err(ApiError::invalid(
                "response_format.type",
                "response_format.type is required (\"text\", \"json_object\" or \"json_schema\")",
            ))
        }
    };
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some((NAME.into(), ConstraintSpec::JsonObject))),
        "json_schema" => {
            const INNER: &str = "response_format.json_schema";
            let inner = match o.get("json_schema") {
                Some(Value::Object(inner)) => inner,
                Some(v) => return Err(wrong(INNER, "an object", v)),
                None => {
                    return Err(ApiError::invalid(
                        INNER,
                        "response_format.json_schema is required with type \"json_schema\"",
                    ))
                }
            };
            if let Some(strict) = inner.get("strict").filter(|s| !s.is_null() && !s.is_boolean()) {
                return Err(wrong("response_format.json_schema.strict", "a boolean", strict));
            }
            if let Some(name) = inner.get("name").filter(|s| !s.is_null() && !s.is_string()) {
                return Err(wrong("response_format.json_schema.name", "a string", name));
            }
            // Strict or not, the schema is enforced: the grammar admits only outputs that validate.
            let field = "response_format.json_schema.schema";
            match inner.get("schema").filter(|s| !s.is_null()) {
                Some(s) => Ok(Some((field.into(), schema(field, s)?))),
                None => Err(ApiError::invalid(
                    field,
                    "response_format.json_schema.schema is required",
                )),
            }
        }
        other => Err(ApiError::invalid(
            "response_format.type",
            format!(
                "response_format.type \"{}\" is not one of \"text\", \"json_object\", \"json_schema\"",
                echo(other)
            ),
        )),
    }
}

/// vLLM's `structured_outputs`: exactly one of [`STRUCTURED_KEYS`] (others, like `structural_tag`, are refused).
fn structured_outputs(v: &Value) -> Result<Vec<(String, ConstraintSpec)>, ApiError> {
    const NAME: &str = "structured_outputs";
    let Value::Object(o) = v else {
        return Err(wrong(NAME, "an object", v));
    };
    let mut out = Vec::new();
    for (key, value) in o.iter().filter(|(_, v)| !v.is_null()) {
        let field = format!("{NAME}.{key}");
        let spec = match key.as_str() {
            "json" => schema(&field, value)?,
            "regex" => ConstraintSpec::Regex(string(&field, value)?),
            "choice" => ConstraintSpec::Choice(choices(&field, value)?),
            "grammar" => ConstraintSpec::Lark(string(&field, value)?),
            "json_object" => match value {
                Value::Bool(true) => ConstraintSpec::JsonObject,
                Value::Bool(false) => continue,
                v => return Err(wrong(&field, "a boolean", v)),
            },
            other => {
                return Err(ApiError::invalid(
                    field.clone(),
                    format!(
                        "{NAME}.{} is not supported (one of {} is)",
                        echo(other),
                        STRUCTURED_KEYS.join(", ")
                    ),
                )
                .with_code("unsupported_parameter"))
            }
        };
        out.push((field, spec));
    }
    Ok(out)
}

/// A JSON schema: an object or a boolean, or a string holding one (vLLM takes either).
fn schema(field: &str, v: &Value) -> Result<ConstraintSpec, ApiError> {
    let schema = match v {
        Value::String(s) => serde_json::from_str::<Value>(s)
            .map_err(|e| ApiError::invalid(field, format!("{field} is not a JSON schema: {e}")))?,
        v => v.clone(),
    };
    match schema {
        Value::Object(_) | Value::Bool(_) => Ok(ConstraintSpec::JsonSchema(schema)),
        other => Err(wrong(field, "a JSON schema (an object)", &other)),
    }
}

fn string(field: &str, v: &Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) if s.is_empty() => Err(ApiError::invalid(field, format!("{field} must not be empty"))),
        Value::String(s) => Ok(s.clone()),
        v => Err(wrong(field, "a string", v)),
    }
}

fn choices(field: &str, v: &Value) -> Result<Vec<String>, ApiError> {
    let Value::Array(items) = v else {
        return Err(wrong(field, "an array of strings", v));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::String(s) => Ok(s.clone()),
            v => Err(wrong(&format!("{field}[{i}]"), "a string", v)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<Option<(String, ConstraintSpec)>, ApiError> {
        spec(&Fields::parse(body.as_bytes()).expect("object"))
    }

    #[test]
    fn every_form_reads_to_its_constraint() {
        let schema = serde_json::json!({"type": "object"});
        for (body, field, want) in [
            (
                r#"{"response_format": {"type": "json_object"}}"#,
                "response_format",
                ConstraintSpec::JsonObject,
            ),
            (
                r#"{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": {"type": "object"}}}}"#,
                "response_format.json_schema.schema",
                ConstraintSpec::JsonSchema(schema.clone()),
            ),
            (
                r#"{"guided_json": {"type": "object"}}"#,
                "guided_json",
                ConstraintSpec::JsonSchema(schema.clone()),
            ),
            (
                r#"{"guided_json": "{\"type\": \"object\"}"}"#,
                "guided_json",
                ConstraintSpec::JsonSchema(schema.clone()),
            ),
            (
                r#"{"guided_regex": "a+", "guided_decoding_backend": "guidance"}"#,
                "guided_regex",
                ConstraintSpec::Regex("a+".into()),
            ),
            (
                r#"{"guided_choice": ["a", "b"]}"#,
                "guided_choice",
                ConstraintSpec::Choice(vec!["a".into(), "b".into()]),
            ),
            (
                r#"{"guided_grammar": "start: \"x\""}"#,
                "guided_grammar",
                ConstraintSpec::Lark("start: \"x\"".into()),
            ),
            (
                r#"{"structured_outputs": {"regex": "b+"}}"#,
                "structured_outputs.regex",
                ConstraintSpec::Regex("b+".into()),
            ),
            (
                r#"{"structured_outputs": {"json_object": true}}"#,
                "structured_outputs.json_object",
                ConstraintSpec::JsonObject,
            ),
            (
                r#"{"structured_outputs": {"json": {"type": "object"}}}"#,
                "structured_outputs.json",
                ConstraintSpec::JsonSchema(schema.clone()),
            ),
        ] {
            assert_eq!(parse(body).expect(body), Some((field.to_string(), want)), "{body}");
        }
        assert_eq!(parse(r#"{"response_format": {"type": "text"}}"#).expect("text"), None);
        assert_eq!(
            parse(r#"{"guided_json": null, "guided_decoding_backend": "auto"}"#).expect("null"),
            None
        );
    }

    #[test]
    fn malformed_forms_are_400s_naming_their_field() {
        for (body, field) in [
            (r#"{"guided_decoding_backend": "xgrammar"}"#, "guided_decoding_backend"),
            (r#"{"response_format": {"type": "yaml"}}"#, "response_format.type"),
            (
                r#"{"response_format": {"type": "json_schema"}}"#,
                "response_format.json_schema",
            ),
            (
                r#"{"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}"#,
                "response_format.json_schema.schema",
            ),
            (r#"{"guided_json": "{not json"}"#, "guided_json"),
            (r#"{"guided_json": 3}"#, "guided_json"),
            (r#"{"guided_regex": 3}"#, "guided_regex"),
            (r#"{"guided_regex": ""}"#, "guided_regex"),
            (r#"{"guided_choice": ["a", 1]}"#, "guided_choice[1]"),
            (
                r#"{"structured_outputs": {"structural_tag": "x"}}"#,
                "structured_outputs.structural_tag",
            ),
            (r#"{"guided_regex": "a", "guided_choice": ["a"]}"#, "guided_choice"),
        ] {
            let e = parse(body).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
        }
    }
}
