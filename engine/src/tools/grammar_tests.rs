//! The tool-call grammars: their structure, and llguidance compiling them and accepting exactly the calls they are
//! for (a single-byte tokenizer, so every output is a token sequence).

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::json;

use super::*;
use crate::tools::{parse_tools, ToolCall, ToolCallParser};

fn tools() -> Vec<ToolSpec> {
    parse_tools(&json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
         "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
         "required": ["city", "days"]}}},
        {"type": "function", "function": {"name": "now"}}
    ]))
    .expect("tools")
}

fn grammar(choice: &ToolChoice, parallel: bool, format: ToolFormat, reasoning: ReasoningPrefix) -> String {
    tool_call_grammar(&tools(), choice, parallel, format, &[], reasoning).expect("grammar")
}

fn env() -> TokEnv {
    static ENV: std::sync::OnceLock<TokEnv> = std::sync::OnceLock::new();
    ENV.get_or_init(ApproximateTokEnv::single_byte_env).clone()
}

/// Whether llguidance, constrained by `grammar`, lets a model write `output` and then end.
fn accepts(grammar: &str, output: &str) -> bool {
    let env = env();
    let factory = ParserFactory::new_simple(&env).expect("factory");
    let parser = factory.create_parser(TopLevelGrammar::from_lark(grammar.to_string()));
    let mut m = Matcher::new(parser);
    assert!(
        !m.is_error(),
        "the grammar does not compile: {:?}\n{grammar}",
        m.get_error()
    );
    let tokens = env.tokenize_bytes(output.as_bytes());
    match m.try_consume_tokens(&tokens) {
        Ok(n) if n == tokens.len() => m.is_accepting().unwrap_or(false),
        _ => false,
    }
}

#[test]
fn choices_that_force_no_call_or_name_no_tool_are_errors() {
    let t = tools();
    for choice in [ToolChoice::None, ToolChoice::Auto, ToolChoice::Named("nope".into())] {
        assert!(
            tool_call_grammar(&t, &choice, false, ToolFormat::Hermes, &[], ReasoningPrefix::None).is_err(),
            "{choice:?}"
        );
    }
    assert!(tool_call_grammar(
        &[],
        &ToolChoice::Required,
        false,
        ToolFormat::Hermes,
        &[],
        ReasoningPrefix::None
    )
    .is_err());
    let patterned = parse_tools(&json!([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$"}}}}}]))
    .expect("tools");
    let e = tool_call_grammar(
        &patterned,
        &ToolChoice::Required,
        false,
        ToolFormat::Qwen3Xml,
        &[],
        ReasoningPrefix::None,
    )
    .expect_err("pattern in xml");
    assert!(e.to_string().contains("`pattern`"), "{e}");
    // The JSON formats carry the schema whole, so the same tool is fine there.
    assert!(tool_call_grammar(
        &patterned,
        &ToolChoice::Required,
        false,
        ToolFormat::Hermes,
        &[],
        ReasoningPrefix::None
    )
    .is_ok());
}

#[test]
fn grammars_have_the_formats_structure() {
    let g = grammar(&ToolChoice::Required, false, ToolFormat::Hermes, ReasoningPrefix::None);
    assert!(g.contains("start: WS? calls\n"), "{g}");
    assert!(
        g.contains(r#"call: "<tool_call>" "\n" call_json "\n" "</tool_call>""#),
        "{g}"
    );
    assert!(g.contains("calls: call\n"), "one call without parallel_tool_calls: {g}");
    assert!(g.contains(r#""anyOf""#) && g.contains(r#"{"const":"now"}"#), "{g}");
    let g = grammar(
        &ToolChoice::Named("now".into()),
        true,
        ToolFormat::Hermes,
        ReasoningPrefix::Open,
    );
    assert!(g.contains("start: reasoning WS? calls"), "{g}");
    assert!(g.contains(r#"calls: call ("\n" call)*"#), "{g}");
    assert!(
        !g.contains("get_weather") && !g.contains("anyOf"),
        "only the named tool: {g}"
    );
    let g = grammar(
        &ToolChoice::Required,
        false,
        ToolFormat::NemotronJson,
        ReasoningPrefix::Optional,
    );
    assert!(g.contains(r#"calls: "<TOOLCALL>" call_list "</TOOLCALL>""#), "{g}");
    assert!(g.contains(r#""maxItems":1"#) && g.contains(r#""minItems":1"#), "{g}");
    assert!(g.contains(r#"reasoning: "<think>" reasoning_text"#), "{g}");
    let g = grammar(&ToolChoice::Required, true, ToolFormat::Qwen3Xml, ReasoningPrefix::None);
    assert!(
        g.contains(r#"fn_0: "<function=get_weather>\n" p_0_0 p_0_1 p_0_2? "</function>""#),
        "{g}"
    );
    assert!(g.contains(r#"fn_1: "<function=now>\n"  "</function>""#), "{g}");
    assert!(
        g.contains(r#"p_0_2: "<parameter=unit>\n" ("celsius" | "fahrenheit") "\n</parameter>\n""#),
        "{g}"
    );
    assert!(
        g.contains(r#"p_0_1_json: %json {"type":"integer","minimum":1,"maximum":7}"#),
        "{g}"
    );
    // Markers that are special tokens become token references.
    let special = vec!["<tool_call>".to_string(), "</tool_call>".to_string()];
    let g = tool_call_grammar(
        &tools(),
        &ToolChoice::Required,
        false,
        ToolFormat::Hermes,
        &special,
        ReasoningPrefix::None,
    )
    .expect("grammar");
    assert!(
        g.contains(r#"call: <tool_call> "\n" call_json "\n" </tool_call>"#),
        "{g}"
    );
}

const HERMES_CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>";
const HERMES_NOW: &str = "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";

#[test]
fn hermes_grammars_accept_valid_calls_only() {
    let one = grammar(&ToolChoice::Required, false, ToolFormat::Hermes, ReasoningPrefix::None);
    assert!(accepts(&one, HERMES_CALL));
    assert!(accepts(&one, &format!("\n\n{HERMES_NOW}")));
    for bad in [
        "Sure, let me check.",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 9}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"delete_all\", \"arguments\": {}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n",
    ] {
        assert!(!accepts(&one, bad), "{bad}");
    }
    assert!(
        !accepts(&one, &format!("{HERMES_CALL}\n{HERMES_NOW}")),
        "two calls without parallel_tool_calls"
    );
    let many = grammar(&ToolChoice::Required, true, ToolFormat::Hermes, ReasoningPrefix::None);
    assert!(accepts(&many, &format!("{HERMES_CALL}\n{HERMES_NOW}")));
    let named = grammar(
        &ToolChoice::Named("now".into()),
        false,
        ToolFormat::Hermes,
        ReasoningPrefix::None,
    );
    assert!(accepts(&named, HERMES_NOW) && !accepts(&named, HERMES_CALL));
    let open = grammar(&ToolChoice::Required, false, ToolFormat::Hermes, ReasoningPrefix::Open);
    assert!(accepts(
        &open,
        &format!("I need the weather.\n</think>\n\n{HERMES_CALL}")
    ));
    assert!(!accepts(&open, HERMES_CALL), "the open block must close first");
    let optional = grammar(
        &ToolChoice::Required,
        false,
        ToolFormat::Hermes,
        ReasoningPrefix::Optional,
    );
    assert!(accepts(&optional, &format!("<think>\nhmm\n</think>\n\n{HERMES_CALL}")));
    assert!(accepts(&optional, HERMES_CALL));
}

#[test]
fn nemotron_and_xml_grammars_accept_valid_calls_only() {
    let g = grammar(
        &ToolChoice::Required,
        true,
        ToolFormat::NemotronJson,
        ReasoningPrefix::None,
    );
    let two = "<TOOLCALL>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 1}}, \
               {\"name\": \"now\", \"arguments\": {}}]</TOOLCALL>";
    assert!(accepts(&g, two));
    assert!(!accepts(&g, "<TOOLCALL>[]</TOOLCALL>"));
    assert!(!accepts(
        &g,
        "<TOOLCALL>[{\"name\": \"get_weather\", \"arguments\": {\"city\": 3, \"days\": 1}}]</TOOLCALL>"
    ));
    let one = grammar(
        &ToolChoice::Required,
        false,
        ToolFormat::NemotronJson,
        ReasoningPrefix::None,
    );
    assert!(!accepts(&one, two), "one call without parallel_tool_calls");

    let g = grammar(&ToolChoice::Required, true, ToolFormat::Qwen3Xml, ReasoningPrefix::None);
    let call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n\
                </parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>";
    let now = "<tool_call>\n<function=now>\n</function>\n</tool_call>";
    assert!(accepts(&g, call));
    assert!(accepts(&g, &format!("{now}\n{call}")));
    for bad in [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\nten\n\
         </parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n3\n\
         </parameter>\n<parameter=unit>\nkelvin\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=other>\n</function>\n</tool_call>",
    ] {
        assert!(!accepts(&g, bad), "{bad}");
    }
}

/// What a grammar accepts, the parser reads back as the calls that were written.
#[test]
fn accepted_outputs_parse_back_into_their_calls() {
    let cases = [
        (ToolFormat::Hermes, HERMES_CALL.to_string()),
        (
            ToolFormat::NemotronJson,
            "<TOOLCALL>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}]</TOOLCALL>"
                .into(),
        ),
        (
            ToolFormat::Qwen3Xml,
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n\
             </parameter>\n</function>\n</tool_call>"
                .into(),
        ),
    ];
    for (format, output) in cases {
        let g = grammar(&ToolChoice::Required, false, format, ReasoningPrefix::None);
        assert!(accepts(&g, &output), "{format:?}");
        let parsed = ToolCallParser::parse_all(format, tools(), &output);
        assert_eq!(
            parsed.calls,
            vec![ToolCall {
                name: "get_weather".into(),
                arguments: json!({"city": "Paris", "days": 2}).to_string()
            }],
            "{format:?}"
        );
        assert_eq!(parsed.content, "");
    }
}
