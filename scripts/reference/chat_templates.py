#!/usr/bin/env python3
"""Renders the published chat templates in tests/fixtures/chat_templates/ over a fixed set of conversations and
writes what each renders to as JSON next to them (`<model>.expected.json`), for the Rust test
`engine/src/tokenizer/chat_tests.rs::published_templates_render_like_transformers` to compare against exactly.

With transformers installed it renders through transformers' own `render_jinja_template` / the tokenizer's
`apply_chat_template` machinery; without it, through jinja2 configured as transformers configures it
(ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols extension, transformers'
`tojson` filter, `raise_exception` and `strftime_now` globals). Every JSON file records which one produced it.

    python3 scripts/reference/chat_templates.py            # rewrite the expectations
    python3 scripts/reference/chat_templates.py --check    # fail if they are out of date
"""

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "tests" / "fixtures" / "chat_templates"

# Special tokens as transformers passes them (its special_tokens_map): the templates here use none, but a template
# that did would see these.
SPECIAL = {
    "qwen3": {"eos_token": "<|im_end|>"},
    "nemotron-nano-v2": {"bos_token": "<s>", "eos_token": "<SPECIAL_12>"},
    "nemotron-3-nano": {"bos_token": "<s>", "eos_token": "<|im_end|>"},
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
}

CLOCK_TOOL = {"type": "function", "function": {"name": "now"}}

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1},
                "filters": {"type": "object", "properties": {"site": {"type": "string"}}},
                "exact": {"type": "boolean"},
            },
            "required": ["query"],
        },
    },
}

# Two calls in one turn, with arguments of every JSON kind the templates write differently (a string, an integer, an
# object, an empty argument list), as a front end passes them: arguments parsed from the API's JSON strings.
PARALLEL_CALLS = [
    {
        "id": "call_a",
        "type": "function",
        "function": {"name": "search", "arguments": {"query": "rust \"minijinja\"", "limit": 3, "filters": {"site": "docs.rs"}, "exact": True}},
    },
    {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": {}}},
]

# Each case: name, messages, tools (or None), add_generation_prompt, extra template variables (chat_template_kwargs).
CASES = [
    ("plain", [{"role": "user", "content": "Hello!"}], None, True, {}),
    (
        "system",
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
        None,
        True,
        {},
    ),
    (
        "multi_turn_with_reasoning",
        [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        None,
        True,
        {},
    ),
    (
        "ends_with_assistant",
        [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "<think>\nAny colour.\n</think>\n\nBlue."},
        ],
        None,
        False,
        {},
    ),
    (
        "tools_calls_and_results",
        [
            {"role": "system", "content": "Use tools when useful."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"},
            {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
        ],
        [WEATHER_TOOL],
        True,
        {},
    ),
    (
        "tools_then_answer",
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
            {"role": "assistant", "content": "It is 21 degrees in Paris."},
            {"role": "user", "content": "Thanks, and Rome?"},
        ],
        [WEATHER_TOOL],
        True,
        {},
    ),
    (
        "tools_offered_no_calls_yet",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What time is it?"}],
        [WEATHER_TOOL, CLOCK_TOOL, SEARCH_TOOL],
        True,
        {},
    ),
    (
        "parallel_calls_and_results",
        [
            {"role": "user", "content": "Find minijinja docs and tell me the time."},
            {"role": "assistant", "content": "Doing both.", "tool_calls": PARALLEL_CALLS},
            {"role": "tool", "tool_call_id": "call_a", "content": "[\"https://docs.rs/minijinja\"]"},
            {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
        ],
        [SEARCH_TOOL, CLOCK_TOOL],
        True,
        {},
    ),
    (
        "tool_call_with_reasoning_then_thinking_off",
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "The user wants the weather.",
                "tool_calls": [
                    {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_9", "content": "-3 degrees"},
        ],
        [WEATHER_TOOL],
        True,
        {"enable_thinking": False},
    ),
    ("thinking_on", [{"role": "user", "content": "Think about it."}], None, True, {"enable_thinking": True}),
    ("thinking_off", [{"role": "user", "content": "Answer fast."}], None, True, {"enable_thinking": False}),
    (
        "thinking_off_by_system_flag",
        [{"role": "system", "content": "/no_think"}, {"role": "user", "content": "Answer fast."}],
        None,
        True,
        {},
    ),
    (
        "history_thinking_kept",
        [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\nr1\n</think>\nA1"},
            {"role": "user", "content": "Q2"},
        ],
        None,
        True,
        {"truncate_history_thinking": False},
    ),
]


def transformers_renderer():
    """transformers' own renderer, or None when it is not installed."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return None
    import transformers

    def render(source, messages, tools, add_generation_prompt, extra, special):
        rendered, _ = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=source,
            add_generation_prompt=add_generation_prompt,
            **special,
            **extra,
        )
        return rendered[0]

    return render, f"transformers {transformers.__version__} (render_jinja_template, as apply_chat_template)"


def jinja2_renderer():
    """jinja2 configured as transformers' `_compile_jinja_template` configures it."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now

    def render(source, messages, tools, add_generation_prompt, extra, special):
        template = env.from_string(source)
        return template.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special,
            **extra,
        )

    return render, f"jinja2 {jinja2.__version__} configured as transformers configures it (transformers not installed)"


def expectations(render, renderer_name, model):
    source = (TEMPLATES / f"{model}.jinja").read_text()
    cases = []
    for name, messages, tools, add_generation_prompt, extra in CASES:
        cases.append(
            {
                "name": name,
                "messages": messages,
                "tools": tools,
                "add_generation_prompt": add_generation_prompt,
                "chat_template_kwargs": extra,
                "expected": render(source, messages, tools, add_generation_prompt, extra, SPECIAL[model]),
            }
        )
    return {
        "generated_by": "scripts/reference/chat_templates.py",
        "renderer": renderer_name,
        "template": f"{model}.jinja",
        "special_tokens": SPECIAL[model],
        "cases": cases,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail when a written expectation differs")
    args = parser.parse_args()
    render, renderer_name = transformers_renderer() or jinja2_renderer()
    print(f"rendering with {renderer_name}")
    stale = []
    for model in SPECIAL:
        text = json.dumps(expectations(render, renderer_name, model), indent=1, ensure_ascii=False) + "\n"
        out = TEMPLATES / f"{model}.expected.json"
        if args.check:
            if not out.exists() or out.read_text() != text:
                stale.append(out.name)
        else:
            out.write_text(text)
            print(f"wrote {out.relative_to(ROOT)}")
    if stale:
        sys.exit(f"out of date: {', '.join(stale)} (rerun without --check)")


if __name__ == "__main__":
    main()
