//! A model's output split into text and tool calls, in one of the [`ToolFormat`]s.
//!
//! Output comes in pieces as it is generated ([`ToolCallParser::push`]); text streams out as it comes, except what may
//! be the start of a call marker (held until the next piece decides) and whitespace that may turn out to precede a
//! call (a call block's surrounding whitespace is not content). A call block is held whole until it closes, then
//! parsed: a block that parses gives its calls, one that does not is given back as text (so a malformed call is
//! content, never lost). Streaming and whole answers ([`ToolCallParser::parse_all`]) go through the same parser, so
//! the calls and the content of a streamed answer are exactly those of the whole one.

use serde_json::{Map, Value};

use super::{ToolCall, ToolFormat, ToolSpec};

/// What a piece of output turned out to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text of the answer (outside the calls).
    Content(String),
    /// A complete call.
    Call(ToolCall),
}

/// A whole answer, split.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    /// The text outside the calls.
    pub content: String,
    pub calls: Vec<ToolCall>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// Outside a call block.
    Text,
    /// Inside one (after its start marker); `held` is its body so far.
    Call,
}

/// Splits one answer's text, fed piece by piece, into content and tool calls.
#[derive(Clone, Debug)]
pub struct ToolCallParser {
    format: ToolFormat,
    /// The request's tools: the XML format types parameter values by their schemas.
    tools: Vec<ToolSpec>,
    state: State,
    /// Text not yet given out.
    held: String,
    /// The whitespace before the open call block: dropped if the block parses, given back with it if not.
    before_call: String,
    /// A call just ended: the whitespace after it is not content.
    after_call: bool,
}

impl ToolCallParser {
    /// A parser of `format` for a request with `tools`.
    pub fn new(format: ToolFormat, tools: Vec<ToolSpec>) -> Self {
        Self {
            format,
            tools,
            state: State::Text,
            held: String::new(),
            before_call: String::new(),
            after_call: false,
        }
    }

    /// The format parsed.
    pub fn format(&self) -> ToolFormat {
        self.format
    }

    /// The request's tools.
    pub fn tools(&self) -> &[ToolSpec] {
        &self.tools
    }

    /// The next piece of the answer: what of it (and of what was held back) is now known to be text or calls.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        self.held.push_str(text);
        let (start, end) = (self.format.start_marker(), self.format.end_marker());
        loop {
            match self.state {
                State::Text => {
                    if self.after_call {
                        let rest = self.held.trim_start();
                        if rest.is_empty() {
                            self.held.clear();
                            return out;
                        }
                        self.held = rest.to_string();
                        self.after_call = false;
                    }
                    if let Some(at) = self.held.find(start) {
                        let text = self.held[..at].trim_end();
                        content(&mut out, text);
                        self.before_call = self.held[text.len()..at].to_string();
                        self.held.drain(..at + start.len());
                        self.state = State::Call;
                        continue;
                    }
                    // Hold what may start a marker, and the whitespace before it, which a call would drop.
                    let keep = partial_marker_len(&self.held, start);
                    let give = self.held[..self.held.len() - keep].trim_end().len();
                    content(&mut out, &self.held[..give]);
                    self.held.drain(..give);
                    return out;
                }
                State::Call => {
                    let Some(at) = self.held.find(end) else {
                        return out;
                    };
                    let body = self.held[..at].to_string();
                    self.held.drain(..at + end.len());
                    self.close(&body, true, &mut out);
                    self.state = State::Text;
                }
            }
        }
    }

    /// The end of the answer: what was held back. A call block left open is parsed as it stands (a model may stop
    /// right after its call's arguments); if it does not parse, it is text.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Text => content(&mut out, &held),
            State::Call => self.close(&held, false, &mut out),
        }
        self.state = State::Text;
        out
    }

    /// Parses a call block's `body` (`closed`: its end marker followed it): its calls, or the block as text.
    fn close(&mut self, body: &str, closed: bool, out: &mut Vec<ToolEvent>) {
        let before = std::mem::take(&mut self.before_call);
        match parse_block(self.format, &self.tools, body) {
            Some(calls) => {
                out.extend(calls.into_iter().map(ToolEvent::Call));
                self.after_call = true;
            }
            None => {
                let end = if closed { self.format.end_marker() } else { "" };
                let text = format!("{before}{}{body}{end}", self.format.start_marker());
                content(out, &text);
            }
        }
    }

    /// A whole answer split at once (the same as pushing it in pieces and finishing).
    pub fn parse_all(format: ToolFormat, tools: Vec<ToolSpec>, text: &str) -> ParsedOutput {
        let mut p = Self::new(format, tools);
        let mut events = p.push(text);
        events.extend(p.finish());
        let mut parsed = ParsedOutput::default();
        for e in events {
            match e {
                ToolEvent::Content(t) => parsed.content.push_str(&t),
                ToolEvent::Call(c) => parsed.calls.push(c),
            }
        }
        parsed
    }
}

/// Appends text to `out`, merged with text just before it.
fn content(out: &mut Vec<ToolEvent>, text: &str) {
    if text.is_empty() {
        return;
    }
    if let Some(ToolEvent::Content(last)) = out.last_mut() {
        last.push_str(text);
    } else {
        out.push(ToolEvent::Content(text.to_string()));
    }
}

/// The length of the longest end of `text` that is a proper start of `marker`, at a character boundary.
fn partial_marker_len(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && text.ends_with(&marker[..n]))
        .unwrap_or(0)
}

/// The calls of one block's body, or `None` when it is not a well-formed block of `format`.
fn parse_block(format: ToolFormat, tools: &[ToolSpec], body: &str) -> Option<Vec<ToolCall>> {
    match format {
        ToolFormat::Hermes => {
            let v: Value = serde_json::from_str(body.trim()).ok()?;
            Some(vec![json_call(&v)?])
        }
        ToolFormat::NemotronJson => {
            let v: Value = serde_json::from_str(body.trim()).ok()?;
            let calls = match &v {
                Value::Array(items) if !items.is_empty() => items.iter().map(json_call).collect::<Option<Vec<_>>>()?,
                Value::Object(_) => vec![json_call(&v)?],
                _ => return None,
            };
            Some(calls)
        }
        ToolFormat::Qwen3Xml => xml_call(tools, body).map(|c| vec![c]),
    }
}

/// `{"name": NAME, "arguments": {...}}` (also `"parameters"`, as some Hermes-style models write it; the arguments
/// may be a JSON object's text; absent ones are no arguments).
fn json_call(v: &Value) -> Option<ToolCall> {
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let args = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(o @ Value::Object(_)) => o.clone(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s).ok()? {
            o @ Value::Object(_) => o,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(ToolCall {
        name: name.to_string(),
        arguments: args.to_string(),
    })
}

const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAMETER_OPEN: &str = "<parameter=";
const PARAMETER_CLOSE: &str = "</parameter>";

/// `<function=NAME>` then `<parameter=P>\nVALUE\n</parameter>` blocks then `</function>`, with only whitespace
/// between them. A value loses one newline on each side (the template writes them); it is typed by the tool's schema.
fn xml_call(tools: &[ToolSpec], body: &str) -> Option<ToolCall> {
    let rest = body.trim().strip_prefix(FUNCTION_OPEN)?;
    let close = rest.find('>')?;
    let name = &rest[..close];
    if name.is_empty() || name.contains(char::is_whitespace) {
        return None;
    }
    let tool = tools.iter().find(|t| t.name == name);
    let mut rest = &rest[close + 1..];
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix(FUNCTION_CLOSE) {
            if !after.trim().is_empty() {
                return None;
            }
            break;
        }
        let after = rest.strip_prefix(PARAMETER_OPEN)?;
        let close = after.find('>')?;
        let param = &after[..close];
        if param.is_empty() || param.contains(['<', '\n']) {
            return None;
        }
        let after = &after[close + 1..];
        let end = after.find(PARAMETER_CLOSE)?;
        let raw = &after[..end];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let value = typed_value(tool.and_then(|t| t.parameter(param)), raw);
        args.insert(param.to_string(), value);
        rest = &after[end + PARAMETER_CLOSE.len()..];
    }
    Some(ToolCall {
        name: name.to_string(),
        arguments: Value::Object(args).to_string(),
    })
}

/// Whether a parameter's schema makes its value a string: `type: "string"`, or an enum or const of strings only.
pub(crate) fn is_string_schema(schema: &Value) -> bool {
    match schema.get("type") {
        Some(Value::String(t)) => t == "string",
        Some(_) => false,
        None => {
            let all_strings = |v: &Value| {
                v.as_array()
                    .is_some_and(|a| !a.is_empty() && a.iter().all(Value::is_string))
            };
            schema.get("enum").is_some_and(all_strings) || schema.get("const").is_some_and(Value::is_string)
        }
    }
}

/// A parameter's text as the value its schema says: a string parameter (or one the schema does not list) is the text
/// itself; any other is the text read as JSON (`42`, `true`, `{"a": 1}`), or the text when it is not JSON.
fn typed_value(schema: Option<&Value>, raw: &str) -> Value {
    match schema {
        Some(s) if !is_string_schema(s) => {
            serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string()))
        }
        _ => Value::String(raw.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn tools() -> Vec<ToolSpec> {
        let tools = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
             "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                            "where": {"type": "object"}, "code": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "now"}}
        ]);
        super::super::parse_tools(&tools).expect("tools")
    }

    fn call(name: &str, args: Value) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: args.to_string(),
        }
    }

    fn parse(format: ToolFormat, text: &str) -> ParsedOutput {
        ToolCallParser::parse_all(format, tools(), text)
    }

    /// `text` fed in pieces cut at `cuts` (byte offsets at character boundaries), the events merged.
    fn pieces(format: ToolFormat, text: &str, cuts: &[usize]) -> ParsedOutput {
        let mut p = ToolCallParser::new(format, tools());
        let mut events = Vec::new();
        let mut from = 0;
        for &c in cuts.iter().chain([&text.len()]) {
            events.extend(p.push(&text[from..c]));
            from = c;
        }
        events.extend(p.finish());
        let mut out = ParsedOutput::default();
        for e in events {
            match e {
                ToolEvent::Content(t) => {
                    assert!(!t.is_empty(), "no empty content events");
                    out.content.push_str(&t)
                }
                ToolEvent::Call(c) => out.calls.push(c),
            }
        }
        out
    }

    #[test]
    fn hermes_calls_and_the_text_around_them() {
        let text =
            "I'll check both.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n\
                    </tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let p = parse(ToolFormat::Hermes, text);
        assert_eq!(p.content, "I'll check both.");
        assert_eq!(
            p.calls,
            vec![call("get_weather", json!({"city": "Paris"})), call("now", json!({}))]
        );
        // Arguments given as a JSON string, or missing; a call with no closing tag at the end of the output.
        let p = parse(
            ToolFormat::Hermes,
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}</tool_call>\
             <tool_call>\n{\"name\": \"now\"}\n",
        );
        assert_eq!(p.content, "");
        assert_eq!(
            p.calls,
            vec![call("get_weather", json!({"city": "Rome"})), call("now", json!({}))]
        );
    }

    #[test]
    fn malformed_calls_are_left_as_content() {
        for text in [
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>",
            "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
            "<tool_call>\n[1, 2]\n</tool_call>",
            "<tool_call>\n{\"name\": \"now\", \"arguments\": 3}\n</tool_call>",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa",
            "text then <tool_call",
            "",
            "  plain text with a < and <tool and </tool_call>  ",
        ] {
            let p = parse(ToolFormat::Hermes, text);
            assert_eq!(p.content, text, "{text:?}");
            assert!(p.calls.is_empty(), "{text:?}");
        }
        // A bad call among good ones keeps its place in the text, with the whitespace before it.
        let text = "a\n<tool_call>{\"name\": \"now\"}</tool_call>\n<tool_call>oops</tool_call> b";
        let p = parse(ToolFormat::Hermes, text);
        assert_eq!(p.content, "a<tool_call>oops</tool_call> b");
        assert_eq!(p.calls, vec![call("now", json!({}))]);
    }

    #[test]
    fn nemotron_json_lists_of_calls() {
        let text =
            "Let me look.<TOOLCALL>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}}, \
                    {\"name\": \"now\", \"arguments\": {}}]</TOOLCALL>";
        let p = parse(ToolFormat::NemotronJson, text);
        assert_eq!(p.content, "Let me look.");
        assert_eq!(
            p.calls,
            vec![
                call("get_weather", json!({"city": "Oslo", "days": 2})),
                call("now", json!({}))
            ]
        );
        for bad in [
            "<TOOLCALL>[]</TOOLCALL>",
            "<TOOLCALL>[{\"name\": \"now\"}, 3]</TOOLCALL>",
            "<TOOLCALL>[{\"name\": \"now\"</TOOLCALL>",
            "<tool_call>{\"name\": \"now\"}</tool_call>",
        ] {
            let p = parse(ToolFormat::NemotronJson, bad);
            assert_eq!((p.content.as_str(), p.calls.len()), (bad, 0), "{bad}");
        }
    }

    #[test]
    fn xml_calls_type_values_by_the_schema() {
        let text = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n\
                    <parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n\
                    <parameter=where>\n{\"lat\": 1.5}\n</parameter>\n<parameter=code>\n42\n</parameter>\n\
                    <parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>\n\
                    <tool_call>\n<function=now>\n</function>\n</tool_call>";
        let p = parse(ToolFormat::Qwen3Xml, text);
        assert_eq!(p.content, "Checking.");
        assert_eq!(
            p.calls,
            vec![
                call(
                    "get_weather",
                    json!({"city": "New York", "days": 3, "metric": true, "where": {"lat": 1.5}, "code": "42",
                           "extra": "7"})
                ),
                call("now", json!({}))
            ]
        );
        // A multi-line string keeps its inner newlines; a number that is not JSON stays text.
        let p = parse(
            ToolFormat::Qwen3Xml,
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nline 1\nline 2\n</parameter>\n\
             <parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>",
        );
        assert_eq!(
            p.calls,
            vec![call("get_weather", json!({"city": "line 1\nline 2", "days": "three"}))]
        );
        for bad in [
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
            "<tool_call>\n{\"name\": \"now\"}\n</tool_call>",
            "<tool_call>\n<function=>\n</function>\n</tool_call>",
            "<tool_call>\n<function=now>\n</function>\ntrailing\n</tool_call>",
        ] {
            let p = parse(ToolFormat::Qwen3Xml, bad);
            assert_eq!((p.content.as_str(), p.calls.len()), (bad, 0), "{bad}");
        }
    }

    /// Texts of every format with calls, text around them, malformed blocks and non-ASCII text.
    fn samples() -> Vec<(ToolFormat, &'static str)> {
        vec![
            (
                ToolFormat::Hermes,
                "Sure — é.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n \
                 <tool_call>bad</tool_call> <tool_call>{\"name\": \"get_weather\"}</tool_call>\nafter ",
            ),
            (ToolFormat::Hermes, "<tool<tool_call>{\"name\": \"now\"}"),
            (
                ToolFormat::NemotronJson,
                " x <TOOLCALL>[{\"name\": \"now\", \"arguments\": {}}]</TOOLCALL><TOOLCALL>[x]</TOOLCALL>",
            ),
            (
                ToolFormat::Qwen3Xml,
                "ok\n<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n\
                 </tool_call>\n\n<tool_call>\n<function=now>\n",
            ),
        ]
    }

    #[test]
    fn every_split_gives_the_whole_answers_calls_and_content() {
        for (format, text) in samples() {
            let whole = parse(format, text);
            assert!(!whole.calls.is_empty(), "{text:?}");
            let bounds: Vec<usize> = (1..text.len()).filter(|&i| text.is_char_boundary(i)).collect();
            for &a in &bounds {
                assert_eq!(pieces(format, text, &[a]), whole, "{text:?} cut at {a}");
                for &b in bounds.iter().filter(|&&b| b > a) {
                    assert_eq!(pieces(format, text, &[a, b]), whole, "{text:?} cut at {a}, {b}");
                }
            }
            // One character at a time.
            let all: Vec<usize> = bounds.clone();
            assert_eq!(pieces(format, text, &all), whole, "{text:?} by characters");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, .. ProptestConfig::default() })]

        /// Arbitrary texts built from the formats' pieces, cut anywhere: the pieces add up to the whole answer.
        #[test]
        fn random_cuts_reassemble(
            parts in proptest::collection::vec(0usize..12, 0..14),
            cuts in proptest::collection::vec(0usize..200, 0..6),
            format in 0usize..3,
        ) {
            const PARTS: [&str; 12] = ["<tool_call>", "</tool_call>", "<TOOLCALL>", "</TOOLCALL>", "\n",
                "{\"name\": \"now\"}", "[{\"name\": \"now\"}]", "<function=now>\n</function>", "text", " é ", "<",
                "<parameter=city>\nx\n</parameter>"];
            let format = ToolFormat::ALL[format];
            let text: String = parts.iter().map(|&i| PARTS[i]).collect();
            let mut at: Vec<usize> = cuts.into_iter().map(|c| c % (text.len() + 1))
                .filter(|&c| text.is_char_boundary(c)).collect();
            at.sort_unstable();
            prop_assert_eq!(pieces(format, &text, &at), parse(format, &text));
        }
    }

    #[test]
    fn string_schemas_are_told() {
        assert!(is_string_schema(&json!({"type": "string"})));
        assert!(is_string_schema(&json!({"enum": ["a", "b"]})));
        assert!(!is_string_schema(&json!({"enum": ["a", 1]})));
        assert!(!is_string_schema(&json!({"type": ["string", "null"]})));
        assert!(!is_string_schema(&json!({})));
    }
}
