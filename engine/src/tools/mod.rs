//! Tool calling (OpenAI's `tools` / `tool_choice`): the request's tools read and checked ([`parse_tools`],
//! [`parse_tool_choice`]), the tool-call formats the served families' chat templates teach their models
//! ([`ToolFormat`], told from the template's text), the model's output split into text and calls ([`parse`]), and the
//! llguidance grammar that makes a model call a tool when the request requires it ([`grammar`]).
//!
//! The formats are those of vLLM's parsers of the same names: `hermes` (Qwen3: JSON in `<tool_call>` tags),
//! `qwen3_xml` (Nemotron-3, Qwen3.5, Qwen3-Coder: `<function=NAME>` with `<parameter=P>` blocks in `<tool_call>` tags)
//! and `nemotron_json` (Nemotron-Nano-v2: a JSON list in `<TOOLCALL>` tags).

pub mod grammar;
pub mod parse;

use rand::Rng;
use serde_json::{Map, Value};

use crate::tokenizer::{MessageFunctionCall, MessageToolCall};

pub use parse::{ParsedOutput, ToolCallParser, ToolEvent};

/// A tool-call format of a model family's chat template.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Qwen3, Hermes).
    Hermes,
    /// `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>` (Nemotron-3,
    /// Qwen3.5, Qwen3-Coder); a value is text, typed by the tool's schema.
    Qwen3Xml,
    /// `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>` (Nemotron-Nano-v2).
    NemotronJson,
}

impl ToolFormat {
    /// Every format, in the order [`ToolFormat::detect`] tries them.
    pub const ALL: [ToolFormat; 3] = [ToolFormat::NemotronJson, ToolFormat::Qwen3Xml, ToolFormat::Hermes];

    /// The format's name (vLLM's `--tool-call-parser` name).
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Qwen3Xml => "qwen3_xml",
            ToolFormat::NemotronJson => "nemotron_json",
        }
    }

    /// The format a chat template teaches, from its text: the markers it writes for an assistant's calls. `None`
    /// when it writes none of them (the template has no tool format).
    pub fn detect(template: &str) -> Option<ToolFormat> {
        if template.contains("<TOOLCALL>") {
            Some(ToolFormat::NemotronJson)
        } else if template.contains("<tool_call>") && template.contains("<function=") {
            Some(ToolFormat::Qwen3Xml)
        } else if template.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else {
            None
        }
    }

    /// The text that opens a call block.
    pub fn start_marker(self) -> &'static str {
        match self {
            ToolFormat::Hermes | ToolFormat::Qwen3Xml => "<tool_call>",
            ToolFormat::NemotronJson => "<TOOLCALL>",
        }
    }

    /// The text that closes a call block.
    pub fn end_marker(self) -> &'static str {
        match self {
            ToolFormat::Hermes | ToolFormat::Qwen3Xml => "</tool_call>",
            ToolFormat::NemotronJson => "</TOOLCALL>",
        }
    }
}

/// A function the model may call, as the request described it.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON schema: an object schema (`{"type": "object", "properties": {}}` when the request gave
    /// none).
    pub parameters: Value,
}

impl ToolSpec {
    /// The schema of parameter `name`, when the tool's schema lists it.
    pub fn parameter(&self, name: &str) -> Option<&Value> {
        self.parameters.get("properties")?.get(name)
    }
}

/// A call the model made: the function's name and its arguments as a JSON object's text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// A JSON object, serialized compactly (keys in the model's order).
    pub arguments: String,
}

/// Which calls the request allows or requires (`tool_choice`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// No call: the tools are still shown to the model (the template renders them), its output is not parsed.
    None,
    /// The model decides; its calls are parsed out of its output.
    Auto,
    /// At least one call, of any of the tools.
    Required,
    /// A call of this function.
    Named(String),
}

impl ToolChoice {
    /// Whether the model must call a tool (which only a grammar can guarantee).
    pub fn forces_call(&self) -> bool {
        matches!(self, ToolChoice::Required | ToolChoice::Named(_))
    }
}

/// A bad `tools` or `tool_choice`: the field at fault (`tools[2].function.name`) and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ToolsError {
    pub field: String,
    pub message: String,
}

fn bad(field: impl Into<String>, message: impl Into<String>) -> ToolsError {
    ToolsError {
        field: field.into(),
        message: message.into(),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The longest function name accepted (OpenAI's limit).
pub const MAX_NAME_LEN: usize = 64;

/// Whether `name` can name a function: 1 to [`MAX_NAME_LEN`] letters, digits, `_`, `-` or `.` (OpenAI's rule, plus
/// the dots MCP tool names use). The formats write names bare inside their markup, so nothing else may appear.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// A request's `tools`: an array of `{"type": "function", "function": {"name", "description"?, "parameters"?}}`.
/// Every error names the field at fault (`tools[1].function.parameters`). An empty array is no tools.
pub fn parse_tools(v: &Value) -> Result<Vec<ToolSpec>, ToolsError> {
    let Value::Array(items) = v else {
        return Err(bad("tools", format!("tools must be an array, got {}", kind(v))));
    };
    let mut tools: Vec<ToolSpec> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Value::Object(tool) = item else {
            return Err(bad(&at, format!("{at} must be an object, got {}", kind(item))));
        };
        match tool.get("type") {
            Some(Value::String(t)) if t == "function" => {}
            Some(Value::String(t)) => {
                return Err(bad(
                    format!("{at}.type"),
                    format!("{at}.type `{}` is not supported (only `function`)", cut(t)),
                ))
            }
            _ => return Err(bad(format!("{at}.type"), format!("{at}.type must be \"function\""))),
        }
        let function = match tool.get("function") {
            Some(Value::Object(f)) => f,
            Some(other) => {
                return Err(bad(
                    format!("{at}.function"),
                    format!("{at}.function must be an object, got {}", kind(other)),
                ))
            }
            None => return Err(bad(format!("{at}.function"), format!("{at}.function is required"))),
        };
        let name = match function.get("name") {
            Some(Value::String(n)) if valid_name(n) => n.clone(),
            Some(Value::String(n)) => {
                return Err(bad(
                    format!("{at}.function.name"),
                    format!(
                        "{at}.function.name `{}` is not a function name: 1 to {MAX_NAME_LEN} letters, digits, `_`, \
                         `-` or `.`",
                        cut(n)
                    ),
                ))
            }
            _ => {
                return Err(bad(
                    format!("{at}.function.name"),
                    format!("{at}.function.name is required (a string)"),
                ))
            }
        };
        if tools.iter().any(|t| t.name == name) {
            return Err(bad(
                format!("{at}.function.name"),
                format!("{at}.function.name: another tool is already named `{name}`"),
            ));
        }
        let description = match function.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d.clone()),
            Some(other) => {
                return Err(bad(
                    format!("{at}.function.description"),
                    format!("{at}.function.description must be a string, got {}", kind(other)),
                ))
            }
        };
        let parameters = match function.get("parameters") {
            None | Some(Value::Null) => {
                let mut empty = Map::new();
                empty.insert("type".into(), Value::String("object".into()));
                empty.insert("properties".into(), Value::Object(Map::new()));
                Value::Object(empty)
            }
            Some(Value::Object(schema)) => {
                check_object_schema(schema, &format!("{at}.function.parameters"))?;
                Value::Object(schema.clone())
            }
            Some(other) => {
                return Err(bad(
                    format!("{at}.function.parameters"),
                    format!(
                        "{at}.function.parameters must be a JSON schema object, got {}",
                        kind(other)
                    ),
                ))
            }
        };
        tools.push(ToolSpec {
            name,
            description,
            parameters,
        });
    }
    Ok(tools)
}

/// Arguments are a JSON object: the schema must describe one (`type` absent or `"object"`), with `properties` (when
/// given) an object of schemas and `required` (when given) an array of names.
fn check_object_schema(schema: &Map<String, Value>, at: &str) -> Result<(), ToolsError> {
    match schema.get("type") {
        None => {}
        Some(Value::String(t)) if t == "object" => {}
        Some(other) => {
            return Err(bad(
                format!("{at}.type"),
                format!("{at} must describe a JSON object (type \"object\"), got type {other}"),
            ))
        }
    }
    match schema.get("properties") {
        None => {}
        Some(Value::Object(props)) => {
            if let Some((k, v)) = props.iter().find(|(_, v)| !v.is_object() && !v.is_boolean()) {
                return Err(bad(
                    format!("{at}.properties.{}", cut(k)),
                    format!(
                        "{at}.properties.{} must be a schema (an object), got {}",
                        cut(k),
                        kind(v)
                    ),
                ));
            }
        }
        Some(other) => {
            return Err(bad(
                format!("{at}.properties"),
                format!("{at}.properties must be an object, got {}", kind(other)),
            ))
        }
    }
    match schema.get("required") {
        None => Ok(()),
        Some(Value::Array(names)) if names.iter().all(Value::is_string) => Ok(()),
        Some(_) => Err(bad(
            format!("{at}.required"),
            format!("{at}.required must be an array of property names"),
        )),
    }
}

/// A client's text in a message, cut to a readable length.
fn cut(s: &str) -> String {
    const MAX: usize = 64;
    match s.char_indices().nth(MAX) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_string(),
    }
}

/// A request's `tool_choice` (absent: `auto` when there are tools, else `none`): `"none"`, `"auto"`, `"required"`
/// or `{"type": "function", "function": {"name": NAME}}` naming one of `tools`.
pub fn parse_tool_choice(v: Option<&Value>, tools: &[ToolSpec]) -> Result<ToolChoice, ToolsError> {
    const AT: &str = "tool_choice";
    let choice = match v {
        None | Some(Value::Null) => {
            return Ok(if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            })
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(
                    AT,
                    format!(
                        "{AT} `{}` is not one of \"none\", \"auto\", \"required\" or a function object",
                        cut(other)
                    ),
                ))
            }
        },
        Some(Value::Object(o)) => {
            if o.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad(format!("{AT}.type"), format!("{AT}.type must be \"function\"")));
            }
            match o.get("function").and_then(|f| f.get("name")) {
                Some(Value::String(n)) => ToolChoice::Named(n.clone()),
                _ => {
                    return Err(bad(
                        format!("{AT}.function.name"),
                        format!("{AT}.function.name is required (a string)"),
                    ))
                }
            }
        }
        Some(other) => {
            return Err(bad(
                AT,
                format!("{AT} must be a string or an object, got {}", kind(other)),
            ))
        }
    };
    match &choice {
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => Err(bad(
            format!("{AT}.function.name"),
            format!("{AT}.function.name `{}` is not one of the request's tools", cut(n)),
        )),
        ToolChoice::Required | ToolChoice::Named(_) if tools.is_empty() => Err(bad(
            AT,
            format!("{AT} requires a tool call, but the request has no tools"),
        )),
        _ => Ok(choice),
    }
}

/// An assistant message's `tool_calls` as the API sends them (`[{"id", "type": "function", "function": {"name",
/// "arguments": "<JSON object text>"}}]`), for the template: the arguments parsed into an object, as vLLM passes them
/// (templates index them or write them with `tojson`). `at` is the message's field (`messages[3]`).
pub fn parse_message_tool_calls(v: &Value, at: &str) -> Result<Vec<MessageToolCall>, ToolsError> {
    let Value::Array(items) = v else {
        return Err(bad(
            format!("{at}.tool_calls"),
            format!("{at}.tool_calls must be an array, got {}", kind(v)),
        ));
    };
    items
        .iter()
        .enumerate()
        .map(|(j, call)| {
            let at = format!("{at}.tool_calls[{j}]");
            let Value::Object(call) = call else {
                return Err(bad(&at, format!("{at} must be an object, got {}", kind(call))));
            };
            let id = match call.get("id") {
                None | Some(Value::Null) => None,
                Some(Value::String(id)) => Some(id.clone()),
                Some(other) => {
                    return Err(bad(
                        format!("{at}.id"),
                        format!("{at}.id must be a string, got {}", kind(other)),
                    ))
                }
            };
            match call.get("type") {
                None | Some(Value::Null) => {}
                Some(Value::String(t)) if t == "function" => {}
                Some(_) => return Err(bad(format!("{at}.type"), format!("{at}.type must be \"function\""))),
            }
            let Some(Value::Object(function)) = call.get("function") else {
                return Err(bad(
                    format!("{at}.function"),
                    format!("{at}.function is required (an object with name and arguments)"),
                ));
            };
            let name = match function.get("name") {
                Some(Value::String(n)) if !n.is_empty() => n.clone(),
                _ => {
                    return Err(bad(
                        format!("{at}.function.name"),
                        format!("{at}.function.name is required (a string)"),
                    ))
                }
            };
            let arguments = match function.get("arguments") {
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
                    Ok(obj @ Value::Object(_)) => obj,
                    Ok(other) => {
                        return Err(bad(
                            format!("{at}.function.arguments"),
                            format!(
                                "{at}.function.arguments must be a JSON object's text, got {}",
                                kind(&other)
                            ),
                        ))
                    }
                    Err(e) => {
                        return Err(bad(
                            format!("{at}.function.arguments"),
                            format!("{at}.function.arguments is not valid JSON: {e}"),
                        ))
                    }
                },
                // Some clients send the object itself; templates want it so.
                Some(obj @ Value::Object(_)) => obj.clone(),
                Some(other) => {
                    return Err(bad(
                        format!("{at}.function.arguments"),
                        format!("{at}.function.arguments must be a string of JSON, got {}", kind(other)),
                    ))
                }
            };
            Ok(MessageToolCall {
                id,
                kind: "function".into(),
                function: MessageFunctionCall { name, arguments },
            })
        })
        .collect()
}

/// A fresh id for a call the model made: `call_` and 24 random letters and digits (OpenAI's shape).
pub fn call_id() -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let tail: String = (0..24)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect();
    format!("call_{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn formats_are_told_from_the_published_templates() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat_templates");
        let read = |m: &str| std::fs::read_to_string(dir.join(format!("{m}.jinja"))).expect("template");
        assert_eq!(ToolFormat::detect(&read("qwen3")), Some(ToolFormat::Hermes));
        assert_eq!(
            ToolFormat::detect(&read("nemotron-nano-v2")),
            Some(ToolFormat::NemotronJson)
        );
        assert_eq!(ToolFormat::detect(&read("nemotron-3-nano")), Some(ToolFormat::Qwen3Xml));
        assert_eq!(ToolFormat::detect(crate::tokenizer::bpe_builder::CHATML_TEMPLATE), None);
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    #[test]
    fn tools_are_read_and_checked_naming_the_field() {
        let tools = parse_tools(&json!([weather(), {"type": "function", "function": {"name": "now"}}])).expect("ok");
        assert_eq!(tools.len(), 2);
        assert_eq!(tools[0].name, "get_weather");
        assert_eq!(tools[0].description.as_deref(), Some("Weather."));
        assert_eq!(tools[0].parameter("city"), Some(&json!({"type": "string"})));
        assert_eq!(tools[1].parameters, json!({"type": "object", "properties": {}}));
        for (tools, field, want) in [
            (json!({}), "tools", "must be an array"),
            (json!([3]), "tools[0]", "must be an object"),
            (
                json!([{"function": {"name": "a"}}]),
                "tools[0].type",
                "must be \"function\"",
            ),
            (
                json!([{"type": "retrieval"}]),
                "tools[0].type",
                "`retrieval` is not supported",
            ),
            (json!([{"type": "function"}]), "tools[0].function", "is required"),
            (
                json!([weather(), weather(), {"type": "function", "function": {}}]),
                "tools[1].function.name",
                "already named",
            ),
            (
                json!([weather(), {"type": "function", "function": {"description": "x"}}]),
                "tools[1].function.name",
                "is required",
            ),
            (
                json!([{"type": "function", "function": {"name": "a b"}}]),
                "tools[0].function.name",
                "not a function name",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "parameters": "x"}}]),
                "tools[0].function.parameters",
                "must be a JSON schema object",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}]),
                "tools[0].function.parameters.type",
                "must describe a JSON object",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "parameters": {"properties": {"x": 1}}}}]),
                "tools[0].function.parameters.properties.x",
                "must be a schema",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "parameters": {"required": "x"}}}]),
                "tools[0].function.parameters.required",
                "array of property names",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "description": 3}}]),
                "tools[0].function.description",
                "must be a string",
            ),
        ] {
            let e = parse_tools(&tools).expect_err(&tools.to_string());
            assert_eq!(e.field, field, "{tools}");
            assert!(e.message.contains(want), "{tools}: {}", e.message);
        }
    }

    #[test]
    fn tool_choice_defaults_and_names_must_be_tools() {
        let tools = parse_tools(&json!([weather()])).expect("ok");
        assert_eq!(parse_tool_choice(None, &tools), Ok(ToolChoice::Auto));
        assert_eq!(parse_tool_choice(None, &[]), Ok(ToolChoice::None));
        assert_eq!(parse_tool_choice(Some(&json!("none")), &tools), Ok(ToolChoice::None));
        assert_eq!(
            parse_tool_choice(Some(&json!("required")), &tools),
            Ok(ToolChoice::Required)
        );
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        assert_eq!(
            parse_tool_choice(Some(&named), &tools),
            Ok(ToolChoice::Named("get_weather".into()))
        );
        assert!(ToolChoice::Required.forces_call() && !ToolChoice::Auto.forces_call());
        for (choice, tools, field, want) in [
            (json!("sometimes"), &tools[..], "tool_choice", "is not one of"),
            (json!(3), &tools[..], "tool_choice", "got a number"),
            (
                json!({"type": "function", "function": {"name": "nope"}}),
                &tools[..],
                "tool_choice.function.name",
                "`nope` is not one of the request's tools",
            ),
            (
                json!({"type": "function", "function": {}}),
                &tools[..],
                "tool_choice.function.name",
                "is required",
            ),
            (
                json!({"type": "x"}),
                &tools[..],
                "tool_choice.type",
                "must be \"function\"",
            ),
            (json!("required"), &[][..], "tool_choice", "no tools"),
        ] {
            let e = parse_tool_choice(Some(&choice), tools).expect_err(&choice.to_string());
            assert_eq!(e.field, field, "{choice}");
            assert!(e.message.contains(want), "{choice}: {}", e.message);
        }
    }

    #[test]
    fn message_tool_calls_get_their_arguments_parsed() {
        let calls = parse_message_tool_calls(
            &json!([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": [1]}"}},
                    {"function": {"name": "g", "arguments": {"b": true}}}]),
            "messages[2]",
        )
        .expect("ok");
        assert_eq!(calls[0].id.as_deref(), Some("call_1"));
        assert_eq!(calls[0].function.arguments, json!({"a": [1]}));
        assert_eq!(calls[1].function.arguments, json!({"b": true}));
        let as_template_sees_it = serde_json::to_value(&calls[0]).expect("json");
        assert_eq!(
            as_template_sees_it,
            json!({"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": [1]}}})
        );
        for (v, field) in [
            (json!({}), "messages[2].tool_calls"),
            (json!([1]), "messages[2].tool_calls[0]"),
            (
                json!([{"type": "x", "function": {"name": "f"}}]),
                "messages[2].tool_calls[0].type",
            ),
            (
                json!([{"id": 1, "function": {"name": "f"}}]),
                "messages[2].tool_calls[0].id",
            ),
            (json!([{}]), "messages[2].tool_calls[0].function"),
            (
                json!([{"function": {"arguments": "{}"}}]),
                "messages[2].tool_calls[0].function.name",
            ),
            (
                json!([{"function": {"name": "f", "arguments": "{"}}]),
                "messages[2].tool_calls[0].function.arguments",
            ),
            (
                json!([{"function": {"name": "f", "arguments": "[1]"}}]),
                "messages[2].tool_calls[0].function.arguments",
            ),
            (
                json!([{"function": {"name": "f", "arguments": 3}}]),
                "messages[2].tool_calls[0].function.arguments",
            ),
        ] {
            assert_eq!(
                parse_message_tool_calls(&v, "messages[2]")
                    .expect_err(&v.to_string())
                    .field,
                field,
                "{v}"
            );
        }
    }

    #[test]
    fn call_ids_look_like_openai_ones_and_differ() {
        let (a, b) = (call_id(), call_id());
        assert!(a.starts_with("call_") && a.len() == 29, "{a}");
        assert!(a[5..].chars().all(|c| c.is_ascii_alphanumeric()));
        assert_ne!(a, b);
    }
}
