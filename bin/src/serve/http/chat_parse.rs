//! A chat answer read as it is generated: its reasoning split from the rest (`--reasoning-parser`), then tool calls
//! read out of the rest (`--tool-call-parser`, for a request with tools and `tool_choice` `auto`), so a call written
//! inside the reasoning is never taken for one. Streamed and whole answers go through the same [`ChatParser`], so a
//! stream's deltas add up to the whole answer's message.

use rewind_engine::tokenizer::reasoning::{ReasoningSplitter, Split};
use rewind_engine::tools::{call_id, ToolCall, ToolCallParser, ToolEvent};
use serde_json::{json, Value};

/// A call the model made, numbered in the answer and given its id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumberedCall {
    /// Its place among the answer's calls (a stream's `tool_calls[].index`).
    pub index: usize,
    pub id: String,
    pub call: ToolCall,
}

impl NumberedCall {
    /// The call as a message's `tool_calls` entry.
    pub fn json(&self) -> Value {
        json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.call.name, "arguments": self.call.arguments},
        })
    }
}

/// What a piece of an answer turned out to be.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatDelta {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<NumberedCall>,
}

impl ChatDelta {
    /// The reasoning and content parts.
    pub fn text(&self) -> Split {
        Split {
            reasoning: self.reasoning.clone(),
            content: self.content.clone(),
        }
    }

    fn append(&mut self, other: ChatDelta) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
        self.calls.extend(other.calls);
    }
}

/// Reads one chat answer, piece by piece.
#[derive(Clone, Debug)]
pub struct ChatParser {
    reasoning: Option<ReasoningSplitter>,
    tools: Option<ToolCallParser>,
    /// Calls given out so far.
    calls: usize,
}

impl ChatParser {
    /// A parser splitting reasoning when `reasoning` is given and reading calls when `tools` is; `None` when neither
    /// (the answer is all content).
    pub fn new(reasoning: Option<ReasoningSplitter>, tools: Option<ToolCallParser>) -> Option<Self> {
        (reasoning.is_some() || tools.is_some()).then_some(Self {
            reasoning,
            tools,
            calls: 0,
        })
    }

    /// Whether any call has been read.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// The next piece of the answer: what of it (and of what was held back) is now known.
    pub fn push(&mut self, text: &str) -> ChatDelta {
        let split = match &mut self.reasoning {
            Some(r) => r.push(text),
            None => Split {
                reasoning: String::new(),
                content: text.to_string(),
            },
        };
        let mut out = ChatDelta {
            reasoning: split.reasoning,
            ..ChatDelta::default()
        };
        self.content(&split.content, false, &mut out);
        out
    }

    /// The end of the answer: what was held back.
    pub fn finish(&mut self) -> ChatDelta {
        let split = self
            .reasoning
            .as_mut()
            .map(ReasoningSplitter::finish)
            .unwrap_or_default();
        let mut out = ChatDelta {
            reasoning: split.reasoning,
            ..ChatDelta::default()
        };
        self.content(&split.content, true, &mut out);
        out
    }

    /// A whole answer read at once.
    pub fn parse_all(mut self, text: &str) -> ChatDelta {
        let mut out = self.push(text);
        out.append(self.finish());
        out
    }

    /// Runs content through the tool-call reader (when there is one).
    fn content(&mut self, text: &str, finish: bool, out: &mut ChatDelta) {
        let Some(tools) = &mut self.tools else {
            out.content.push_str(text);
            return;
        };
        let mut events = tools.push(text);
        if finish {
            events.extend(tools.finish());
        }
        for e in events {
            match e {
                ToolEvent::Content(t) => out.content.push_str(&t),
                ToolEvent::Call(call) => {
                    out.calls.push(NumberedCall {
                        index: self.calls,
                        id: call_id(),
                        call,
                    });
                    self.calls += 1;
                }
            }
        }
    }
}

/// A whole answer's `message`: `content` (`null` when empty beside reasoning or calls, as vLLM says it),
/// `reasoning_content` when the server splits reasoning, `tool_calls` when the model called any.
pub fn message(answer: &ChatDelta, splits_reasoning: bool) -> Value {
    let reasoning = (!answer.reasoning.is_empty()).then_some(answer.reasoning.as_str());
    let content = (!answer.content.is_empty() || (reasoning.is_none() && answer.calls.is_empty()))
        .then_some(answer.content.as_str());
    let mut m = json!({"role": "assistant", "content": content});
    if splits_reasoning {
        m["reasoning_content"] = json!(reasoning);
    }
    if !answer.calls.is_empty() {
        m["tool_calls"] = answer.calls.iter().map(NumberedCall::json).collect();
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use rewind_engine::tools::{parse_tools, ToolFormat};

    fn tools() -> ToolCallParser {
        let tools = parse_tools(
            &json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]),
        )
        .expect("tools");
        ToolCallParser::new(ToolFormat::Qwen3Xml, tools)
    }

    const ANSWER: &str = "The user wants the weather. <tool_call>not this one</tool_call>\n</think>\n\nLet me check.\n\
                          <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n\
                          <parameter=days>\n2\n</parameter>\n</function>\n</tool_call>";

    #[test]
    fn calls_are_read_from_the_content_not_the_reasoning() {
        let parser = ChatParser::new(Some(ReasoningSplitter::new(true)), Some(tools())).expect("parser");
        let whole = parser.clone().parse_all(ANSWER);
        assert_eq!(
            whole.reasoning,
            "The user wants the weather. <tool_call>not this one</tool_call>\n"
        );
        assert_eq!(whole.content, "\n\nLet me check.");
        assert_eq!(whole.calls.len(), 1);
        assert_eq!(whole.calls[0].index, 0);
        assert!(whole.calls[0].id.starts_with("call_"));
        assert_eq!(
            whole.calls[0].call,
            ToolCall {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris","days":2}"#.into()
            }
        );
        let m = message(&whole, true);
        assert_eq!(m["content"], "\n\nLet me check.");
        assert_eq!(m["tool_calls"][0]["type"], "function");
        assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(
            m["tool_calls"][0]["function"]["arguments"],
            r#"{"city":"Paris","days":2}"#
        );

        // Streamed a character at a time: the same parts, the same call.
        let mut p = parser;
        let mut streamed = ChatDelta::default();
        for c in ANSWER.chars() {
            streamed.append(p.push(&c.to_string()));
        }
        streamed.append(p.finish());
        assert!(p.called());
        assert_eq!(
            (streamed.reasoning.as_str(), streamed.content.as_str()),
            (whole.reasoning.as_str(), whole.content.as_str())
        );
        assert_eq!(streamed.calls[0].call, whole.calls[0].call);
    }

    #[test]
    fn messages_say_null_for_empty_content_beside_calls_or_reasoning() {
        let only_call = ChatParser::new(None, Some(tools()))
            .expect("parser")
            .parse_all("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>");
        let m = message(&only_call, false);
        assert!(m["content"].is_null(), "{m}");
        assert!(m.get("reasoning_content").is_none(), "{m}");
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], "{}");
        // No calls: the text as it came, even empty; no tool_calls field.
        let plain = ChatParser::new(None, Some(tools())).expect("parser").parse_all("");
        let m = message(&plain, false);
        assert_eq!(m["content"], "");
        assert!(m.get("tool_calls").is_none());
        let thought = ChatParser::new(Some(ReasoningSplitter::new(true)), None)
            .expect("parser")
            .parse_all("hmm");
        let m = message(&thought, true);
        assert!(m["content"].is_null() && m["reasoning_content"] == "hmm", "{m}");
        assert!(ChatParser::new(None, None).is_none());
    }
}
