//! Chat templates: HF's Jinja templates rendered with minijinja, configured to behave like `transformers`'
//! `apply_chat_template` (trim_blocks + lstrip_blocks, Python string methods, `raise_exception`, a Python-style
//! `tojson`, `strftime_now`).

use std::collections::BTreeMap;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

const TEMPLATE_NAME: &str = "chat_template";

/// One chat message. Serialized as `{"role": ..., "content": ...}` plus the optional fields that are set, which is
/// what HF templates index (a field left out is undefined to the template, as in a message dict without it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant turn's tool calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<MessageToolCall>>,
    /// A tool result's call id (role `tool`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result's function name (role `tool`), as some clients send it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's reasoning, given apart from its content (templates such as Nemotron-3's render it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// A tool call in an assistant message, as templates read it: `{"id", "type": "function", "function": {"name",
/// "arguments"}}` with the arguments an object (as transformers documents and vLLM passes them; the API's arguments
/// are a JSON string, parsed before rendering).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: MessageFunctionCall,
}

/// The function part of a [`MessageToolCall`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageFunctionCall {
    pub name: String,
    /// The arguments as a JSON value (an object).
    pub arguments: serde_json::Value,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }
}

/// A compiled chat template plus the special tokens it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

fn render_err(e: minijinja::Error) -> EngineError {
    // minijinja's Display carries the detail and the template line, which is what a user needs to see.
    EngineError::Tokenizer(format!("chat template: {e}"))
}

impl ChatTemplate {
    /// Compiles `source`. A syntax error is reported with the template's line.
    pub fn new(source: impl Into<String>, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let source = source.into();
        let mut env = Environment::new();
        // transformers compiles templates with trim_blocks=True, lstrip_blocks=True.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        // Python's `is iterable`: `None` (how transformers passes absent tools) is not, where minijinja's test says
        // it is, and `tools is iterable and tools | length > 0` would fail on it.
        env.add_test("iterable", |v: Value| {
            !v.is_none() && !v.is_undefined() && v.try_iter().is_ok()
        });
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(render_err)?;
        Ok(Self {
            env,
            source,
            bos_token,
            eos_token,
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; `add_generation_prompt` appends the assistant-turn opener.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// Like [`ChatTemplate::render`] with extra template variables (e.g. `enable_thinking`); `extra` overrides the
    /// standard variables of the same name, which is how a request's `tools` (transformers' `tools` argument: the
    /// list of `{"type": "function", "function": {...}}` as the client sent it) reach the template.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        // transformers passes tools=None and documents=None when the caller gives none: defined, but falsy.
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        // Special tokens are only passed when set, as in transformers' special_tokens_map.
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token".into(), Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token".into(), Value::from(eos.as_str()));
        }
        for (k, v) in extra {
            ctx.insert(k.clone(), Value::from_serialize(v));
        }
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(render_err)?;
        tmpl.render(Value::from(ctx)).map_err(render_err)
    }
}

/// `raise_exception(msg)`: templates use it to reject unsupported conversations.
fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("template raised an exception: {msg}"),
    ))
}

/// `tojson` as transformers defines it: Python's `json.dumps(x, ensure_ascii=False, indent=None)`, so separators are
/// `", "` and `": "` (`","` with an indent) and non-ASCII text is kept. Keys keep their order (minijinja's and
/// serde_json's `preserve_order`), as Python's dicts do.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_usize() {
            Some(n) => Some(" ".repeat(n)),
            None => match v.as_str() {
                Some(s) => Some(s.to_string()),
                None => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or a string",
                    ))
                }
            },
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: bad separators"))?;
            match parts.as_slice() {
                [a, b] => (a.clone(), b.clone()),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::BadSerialization, format!("tojson: {e}")))?;
    let fmt = PyJson {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    fmt.write(&json, 0, &mut out);
    // Safe: the output is JSON, not HTML, and must not be auto-escaped.
    Ok(Value::from_safe_string(out))
}

struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl PyJson {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, v: &serde_json::Value, level: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => out.push_str(&n.to_string()),
            J::String(s) => self.write_str(s, out),
            J::Array(items) if items.is_empty() => out.push_str("[]"),
            J::Object(map) if map.is_empty() => out.push_str("{}"),
            J::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            J::Object(map) => {
                out.push('{');
                let mut entries: Vec<_> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write_str(k, out);
                    out.push_str(&self.key_sep);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
        }
    }

    fn write_str(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// `strftime_now(format)`: the current UTC time formatted with the common `strftime` codes
/// (`%Y %y %m %d %e %H %M %S %j %b %B %a %A %p %I %%`). transformers uses local time; a server has no better one.
fn strftime_now(format: String) -> std::result::Result<Value, minijinja::Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, secs)
        .map(Value::from)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats a Unix timestamp (UTC).
pub(crate) fn strftime(format: &str, unix_secs: i64) -> std::result::Result<String, String> {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(code) = chars.next() else {
            return Err("strftime_now: format ends with a lone `%`".into());
        };
        let piece = match code {
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'd' => format!("{day:02}"),
            'e' => format!("{day:>2}"),
            'H' => format!("{hour:02}"),
            'I' => format!("{:02}", if hour % 12 == 0 { 12 } else { hour % 12 }),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            'M' => format!("{minute:02}"),
            'S' => format!("{second:02}"),
            'j' => format!("{day_of_year:03}"),
            'B' => MONTHS[month as usize - 1].to_string(),
            'b' => MONTHS[month as usize - 1][..3].to_string(),
            'A' => WEEKDAYS[weekday].to_string(),
            'a' => WEEKDAYS[weekday][..3].to_string(),
            '%' => "%".to_string(),
            other => return Err(format!("strftime_now: unsupported format code `%{other}`")),
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// Days since 1970-01-01 → (year, month 1..=12, day 1..=31), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
#[path = "chat_tests.rs"]
mod tests;
