//! Chat template tests. Expected strings were produced by Python's jinja2 configured as transformers configures it
//! (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, transformers' `tojson`).

use super::*;

/// A template in the style of Qwen3's: reversed loop with `namespace`, `is string`, `loop.last`/`loop.first`,
/// `split`/`strip`/`lstrip`/`rstrip`/`startswith`/`endswith`, `in`, negative indexing, `tojson`, `is defined`.
const QWEN_LIKE: &str = r##"
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"##;

fn m(role: &str, content: &str) -> ChatMessage {
    ChatMessage::new(role, content)
}

fn qwen() -> ChatTemplate {
    ChatTemplate::new(QWEN_LIKE, None, Some("<|im_end|>".into())).unwrap()
}

#[test]
fn qwen_like_multi_turn_drops_old_reasoning() {
    let msgs = [
        m("system", "You are helpful."),
        m("user", "Hi"),
        m("assistant", "<think>\nreasoning\n</think>\n\nHello!"),
        m("user", "How are you?"),
    ];
    assert_eq!(
        qwen().render(&msgs, true).unwrap(),
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n\
         Hello!<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn qwen_like_keeps_reasoning_after_last_query() {
    let msgs = [m("user", "Q"), m("assistant", "<think>\nr1\n</think>\n\nA1")];
    assert_eq!(
        qwen().render(&msgs, false).unwrap(),
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nr1\n</think>\n\nA1<|im_end|>\n"
    );
}

#[test]
fn qwen_like_tool_turns_and_extra_variables() {
    let msgs = [
        m("user", "  spaced  "),
        m("tool", "42"),
        m("tool", "43"),
        m("user", "<tool_response>x</tool_response>"),
    ];
    let mut extra = serde_json::Map::new();
    extra.insert("enable_thinking".into(), serde_json::Value::Bool(false));
    assert_eq!(
        qwen().render_with(&msgs, true, &extra).unwrap(),
        "<|im_start|>user\n  spaced  <|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n\
         <tool_response>\n43\n</tool_response><|im_end|>\n<|im_start|>user\n<tool_response>x</tool_response>\
         <|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
}

#[test]
fn chatml_template_with_and_without_bos() {
    use super::super::bpe_builder::CHATML_TEMPLATE;
    let t = ChatTemplate::new(CHATML_TEMPLATE, None, Some("<|im_end|>".into())).unwrap();
    assert_eq!(
        t.render(&[m("system", "S"), m("user", "hi\nthere")], true).unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi\nthere<|im_end|>\n<|im_start|>assistant\n"
    );
    let t = ChatTemplate::new(CHATML_TEMPLATE, Some("<|endoftext|>".into()), None).unwrap();
    assert_eq!(
        t.render(&[m("user", "x")], false).unwrap(),
        "<|endoftext|><|im_start|>user\nx<|im_end|>\n"
    );
}

#[test]
fn tojson_matches_python_json_dumps() {
    let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}", None, None).unwrap();
    let x = serde_json::json!({"a": null, "b": [1, 2.5, "é\n\"q\""], "c": {}, "d": []});
    let mut extra = serde_json::Map::new();
    extra.insert("x".into(), x);
    assert_eq!(
        t.render_with(&[], false, &extra).unwrap(),
        "{\"a\": null, \"b\": [1, 2.5, \"é\\n\\\"q\\\"\"], \"c\": {}, \"d\": []}|{\n  \"a\": null,\n  \"b\": [\n    1,\n    \
         2.5,\n    \"é\\n\\\"q\\\"\"\n  ],\n  \"c\": {},\n  \"d\": []\n}"
    );
    let t = ChatTemplate::new("{{ 'é<' | tojson(ensure_ascii=true) }}", None, None).unwrap();
    assert_eq!(t.render(&[], false).unwrap(), "\"\\u00e9<\"");
}

#[test]
fn raise_exception_and_syntax_errors_are_reported() {
    let t = ChatTemplate::new(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok",
        None,
        None,
    )
    .unwrap();
    assert_eq!(t.render(&[m("user", "a")], false).unwrap(), "ok");
    let e = t.render(&[m("assistant", "a")], false).unwrap_err().to_string();
    assert!(e.contains("first message must be from the user"), "{e}");

    let e = ChatTemplate::new("{% for m in messages %}", None, None)
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("tokenizer: chat template: syntax error"), "{e}");
}

#[test]
fn python_string_and_dict_methods_work() {
    let src = "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}\
               {{ messages[0].content.strip().upper() }}|{% if messages[0].content.startswith('  hi') %}yes{% endif %}|\
               {{ messages[0].content[2:4] }}|{{ messages | length }}";
    let t = ChatTemplate::new(src, None, None).unwrap();
    assert_eq!(
        t.render(&[m("user", "  hi there ")], false).unwrap(),
        "a=1;b=2;HI THERE|yes|hi|1"
    );
}

#[test]
fn strftime_formats_known_dates() {
    // 2024-02-29 13:05:09 UTC, a Thursday.
    let ts = 1_709_211_909;
    assert_eq!(
        strftime("%Y-%m-%d %H:%M:%S %a %A %b %B %j %y %e %I%p %%", ts).unwrap(),
        "2024-02-29 13:05:09 Thu Thursday Feb February 060 24 29 01PM %"
    );
    assert_eq!(strftime("%d %b %Y", 0).unwrap(), "01 Jan 1970");
    assert!(strftime("%Q", 0).is_err());
    let t = ChatTemplate::new("{{ strftime_now('%Y') | length }}", None, None).unwrap();
    assert_eq!(t.render(&[], false).unwrap(), "4");
}

/// The published templates of the target models (tests/fixtures/chat_templates, sources in its README) render every
/// conversation of `scripts/reference/chat_templates.py` exactly as transformers' renderer does: plain, system,
/// multi-turn with reasoning, tool calls and results, thinking on and off through the template's variables.
#[test]
fn published_templates_render_like_transformers() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat_templates");
    let mut checked = 0;
    for model in ["qwen3", "nemotron-nano-v2", "nemotron-3-nano"] {
        let source = std::fs::read_to_string(dir.join(format!("{model}.jinja"))).unwrap();
        let text = std::fs::read_to_string(dir.join(format!("{model}.expected.json"))).unwrap();
        let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
        let special = &expected["special_tokens"];
        let token = |k: &str| special[k].as_str().map(str::to_string);
        let t = ChatTemplate::new(source, token("bos_token"), token("eos_token")).unwrap();
        for case in expected["cases"].as_array().unwrap() {
            let name = case["name"].as_str().unwrap();
            // Messages (tool calls, tool results and reasoning included) as the server holds them, and the tools
            // as the server passes them: a template variable, the JSON as the client sent it.
            let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone())
                .unwrap_or_else(|e| panic!("{model}/{name}: messages: {e}"));
            let mut extra = case["chat_template_kwargs"].as_object().cloned().unwrap_or_default();
            if !case["tools"].is_null() {
                extra.insert("tools".into(), case["tools"].clone());
            }
            let add_generation_prompt = case["add_generation_prompt"].as_bool().unwrap();
            let got = t
                .render_with(&messages, add_generation_prompt, &extra)
                .unwrap_or_else(|e| panic!("{model}/{name}: {e}"));
            assert_eq!(got, case["expected"].as_str().unwrap(), "{model}/{name}");
            checked += 1;
        }
    }
    assert!(checked >= 39, "only {checked} cases");
}

#[test]
fn tojson_keeps_key_order_unless_sorted_and_none_is_not_iterable() {
    let t = ChatTemplate::new(
        "{{ x | tojson }}|{{ x | tojson(sort_keys=true) }}|{{ tools is iterable }}|{{ x.b is iterable }}",
        None,
        None,
    )
    .unwrap();
    let mut extra = serde_json::Map::new();
    extra.insert(
        "x".into(),
        serde_json::from_str(r#"{"z": 1, "a": {"y": 2, "b": []}, "b": "s"}"#).unwrap(),
    );
    assert_eq!(
        t.render_with(&[], false, &extra).unwrap(),
        r#"{"z": 1, "a": {"y": 2, "b": []}, "b": "s"}|{"a": {"b": [], "y": 2}, "b": "s", "z": 1}|False|True"#
    );
}

#[test]
fn booleans_and_none_print_as_python_prints_them() {
    // Templates write argument values with `| string` and `~` (Nemotron-3's XML tool calls): Python's str().
    let t = ChatTemplate::new(
        "{{ x | string }}|{{ y | string }}|{{ z | string }}|{{ x ~ '' }}|{{ x }}|{{ 'a' | string }}|{{ 3 | string }}",
        None,
        None,
    )
    .unwrap();
    let mut extra = serde_json::Map::new();
    extra.insert("x".into(), serde_json::Value::Bool(true));
    extra.insert("y".into(), serde_json::Value::Bool(false));
    extra.insert("z".into(), serde_json::Value::Null);
    assert_eq!(
        t.render_with(&[], false, &extra).unwrap(),
        "True|False|None|True|True|a|3"
    );
}
