//! The grammar that makes a model call a tool (`tool_choice: "required"` or a named function): llguidance's Lark
//! syntax for "one call (or, with `parallel_tool_calls`, several) of these tools, in the model's own format, with
//! arguments that validate against the tool's schema". The arguments' JSON is an inline `%json {schema}`, so the
//! grammar engine enforces the schema token by token; [`super::parse`] then reads the output back as calls.
//!
//! The grammar allows, before the calls, a reasoning block (as the template opens it or the model writes it) and
//! whitespace; nothing else: a required call is the answer. Markers that are special tokens of the tokenizer are
//! written as Lark's `<token>` references, text markers as strings.

use serde_json::{json, Map, Value};

use super::parse::is_string_schema;
use super::{ToolChoice, ToolFormat, ToolSpec};
use crate::error::{EngineError, Result};
use crate::tokenizer::reasoning::{THINK_END, THINK_START};

/// How the answer may start with reasoning before its calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningPrefix {
    /// No reasoning block (a model that does not reason, or with the reasoning parser off).
    None,
    /// The answer may open with a `<think>...</think>` block (a template that mentions `<think>` but whose prompt
    /// left none open).
    Optional,
    /// The prompt left a block open: the answer starts inside it and must close it first.
    Open,
}

/// The Lark grammar (llguidance syntax) for a call of `tools` in `format` as `choice` requires (`Required`: any of
/// them; `Named`: that one), one call or, with `parallel_tool_calls`, one or more. `special_tokens` are the
/// tokenizer's special token strings (markers among them are written as token references). An error for a choice
/// that forces no call (`none`, `auto`), a named tool not among `tools`, or a schema the format cannot enforce (a
/// string parameter with `pattern`, `format` or length bounds in the `qwen3_xml` format, whose values are raw text).
pub fn tool_call_grammar(
    tools: &[ToolSpec],
    choice: &ToolChoice,
    parallel_tool_calls: bool,
    format: ToolFormat,
    special_tokens: &[String],
    reasoning: ReasoningPrefix,
) -> Result<String> {
    let chosen: Vec<&ToolSpec> = match choice {
        ToolChoice::None | ToolChoice::Auto => {
            return Err(EngineError::InvalidInput(
                "a tool-call grammar is only for tool_choice \"required\" or a named function".into(),
            ))
        }
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Named(name) => tools.iter().filter(|t| &t.name == name).collect(),
    };
    if chosen.is_empty() {
        return Err(EngineError::InvalidInput(match choice {
            ToolChoice::Named(name) => format!("tool_choice names `{name}`, which is not one of the tools"),
            _ => "tool_choice requires a call, but there are no tools".into(),
        }));
    }
    let mut g = Lark {
        special: special_tokens,
        rules: Vec::new(),
    };
    let prefix = match reasoning {
        ReasoningPrefix::None => "",
        ReasoningPrefix::Optional => {
            let rule = g.until("reasoning", Some(THINK_START), THINK_END);
            g.rules.push(rule);
            "reasoning? "
        }
        ReasoningPrefix::Open => {
            let rule = g.until("reasoning", None, THINK_END);
            g.rules.push(rule);
            "reasoning "
        }
    };
    g.rules.push(format!("start: {prefix}WS? calls"));
    // A few blanks before the calls, as templates and models write them; unbounded, an untrained or wandering model
    // can spend its whole budget on newlines without ever calling.
    g.rules.push(r"WS: /[ \t\r\n]{1,8}/".into());
    let (start, end) = (g.marker(format.start_marker()), g.marker(format.end_marker()));
    match format {
        ToolFormat::Hermes => {
            let alternatives: Vec<Value> = chosen.iter().map(|t| named_call_schema(t)).collect();
            g.rules
                .push(format!("call_json: %json {}", python_json(any_of(alternatives))));
            g.rules.push(format!(r#"call: {start} "\n" call_json "\n" {end}"#));
            g.rules.push(repeated("calls", "call", r#""\n""#, parallel_tool_calls));
        }
        ToolFormat::NemotronJson => {
            let alternatives: Vec<Value> = chosen.iter().map(|t| named_call_schema(t)).collect();
            let mut list = json!({"type": "array", "items": any_of(alternatives), "minItems": 1});
            if !parallel_tool_calls {
                list["maxItems"] = json!(1);
            }
            g.rules.push(format!("call_list: %json {}", python_json(list)));
            g.rules.push(format!("calls: {start} call_list {end}"));
        }
        ToolFormat::Qwen3Xml => {
            let mut names = Vec::new();
            for (i, tool) in chosen.iter().enumerate() {
                names.push(format!("fn_{i}"));
                g.xml_function(i, tool)?;
            }
            g.rules
                .push(format!(r#"call: {start} "\n" ({}) "\n" {end}"#, names.join(" | ")));
            g.rules.push(repeated("calls", "call", r#""\n""#, parallel_tool_calls));
        }
    }
    Ok(g.rules.join("\n") + "\n")
}

/// `name: item` or, repeated, `name: item (sep item)*`.
fn repeated(name: &str, item: &str, sep: &str, many: bool) -> String {
    if many {
        format!("{name}: {item} ({sep} {item})*")
    } else {
        format!("{name}: {item}")
    }
}

/// One schema or the choice of several.
fn any_of(mut alternatives: Vec<Value>) -> Value {
    if alternatives.len() == 1 {
        alternatives.remove(0)
    } else {
        json!({ "anyOf": alternatives })
    }
}

/// `schema` generating JSON as the chat templates write it (`tojson`, Python's `json.dumps`: `", "` between items,
/// `": "` after keys, no other whitespace) unless it sets llguidance's own `x-guidance` options: free whitespace would
/// let a model spend its budget on blanks inside a call and never close it.
fn python_json(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

/// `{"name": NAME, "arguments": {...}}` for one tool, its arguments validated by its schema.
fn named_call_schema(tool: &ToolSpec) -> Value {
    json!({
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": false,
    })
}

/// A grammar under construction.
struct Lark<'a> {
    special: &'a [String],
    rules: Vec<String>,
}

impl Lark<'_> {
    /// A marker: a special token reference when the tokenizer has it as one, else a string.
    fn marker(&self, text: &str) -> String {
        if self.special.iter().any(|s| s == text) {
            text.to_string()
        } else {
            lark_string(text)
        }
    }

    /// A rule `name` for any text (after `open`, when given) up to and including `close`, ending at the first
    /// `close`.
    fn until(&self, name: &str, open: Option<&str>, close: &str) -> String {
        let open = open.map(|o| format!("{} ", self.marker(o))).unwrap_or_default();
        if self.special.iter().any(|s| s == close) {
            // A special token is not text: free text cannot run into it, so it ends the text by itself.
            format!("{name}: {open}{name}_text {close}\n{name}_text: /(?s:.*)/")
        } else {
            format!(
                "{name}: {open}{name}_text\n{name}_text[lazy]: /(?s:.*){}/",
                regex_literal(close)
            )
        }
    }

    /// The rules of tool `i` in the XML format: `<function=NAME>\n`, its parameters in the schema's order (the
    /// required ones always, the others optionally), `</function>`.
    fn xml_function(&mut self, i: usize, tool: &ToolSpec) -> Result<()> {
        let empty = Map::new();
        let props = tool
            .parameters
            .get("properties")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        let required: Vec<&str> = tool
            .parameters
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let any = json!({});
        // Required names the schema does not describe take any JSON value.
        let params = props
            .iter()
            .map(|(k, v)| (k.as_str(), v))
            .chain(required.iter().filter(|r| !props.contains_key(**r)).map(|r| (*r, &any)));
        let mut body = Vec::new();
        for (j, (name, schema)) in params.enumerate() {
            let rule = format!("p_{i}_{j}");
            if name.contains(['>', '<', '\n']) {
                return Err(EngineError::InvalidInput(format!(
                    "tool `{}`: parameter name {name:?} cannot be written in the qwen3_xml format",
                    tool.name
                )));
            }
            let open = lark_string(&format!("<parameter={name}>\n"));
            let close = lark_string("\n</parameter>\n");
            let value = if is_string_schema(schema) {
                self.xml_string(tool, name, schema, &rule)?
            } else {
                self.rules.push(format!("{rule}_json: %json {schema}"));
                format!("{rule}_json {close}")
            };
            self.rules.push(format!("{rule}: {open} {value}"));
            body.push(if required.contains(&name) {
                rule
            } else {
                format!("{rule}?")
            });
        }
        let open = lark_string(&format!("<function={}>\n", tool.name));
        self.rules.push(format!(
            "fn_{i}: {open} {} {}",
            body.join(" "),
            lark_string("</function>")
        ));
        Ok(())
    }

    /// A string parameter's value and the `\n</parameter>\n` after it: one of its `enum` / `const` strings, or any
    /// text up to the first `\n</parameter>`.
    fn xml_string(&mut self, tool: &ToolSpec, name: &str, schema: &Value, rule: &str) -> Result<String> {
        let close = lark_string("\n</parameter>\n");
        let choices: Option<Vec<&str>> = match (schema.get("enum"), schema.get("const")) {
            (Some(Value::Array(e)), _) => e.iter().map(Value::as_str).collect(),
            (_, Some(Value::String(c))) => Some(vec![c.as_str()]),
            _ => None,
        };
        if let Some(choices) = choices {
            let alts: Vec<String> = choices.iter().map(|c| lark_string(c)).collect();
            return Ok(format!("({}) {close}", alts.join(" | ")));
        }
        if let Some(k) = ["pattern", "format", "minLength", "maxLength"]
            .into_iter()
            .find(|k| schema.get(k).is_some())
        {
            return Err(EngineError::InvalidInput(format!(
                "tool `{}`: parameter `{name}` has `{k}`, which the qwen3_xml format (values as raw text) cannot \
                 enforce",
                tool.name
            )));
        }
        self.rules.push(format!(
            r"{rule}_text[lazy]: /(?s:.*){}/",
            regex_literal("\n</parameter>")
        ));
        Ok(format!(r#"{rule}_text "\n""#))
    }
}

/// `text` as a Lark string literal (JSON's escapes, which Lark reads alike).
fn lark_string(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}

/// `text` matched literally inside a Lark `/regex/`: regex metacharacters escaped, `/` too (it ends the regex), a
/// newline as `\n`.
fn regex_literal(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        match c {
            '\n' => out.push_str(r"\n"),
            '/' => out.push_str(r"\/"),
            c if r"\.+*?()|[]{}^$#&-~".contains(c) => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
#[path = "grammar_tests.rs"]
mod tests;
