"""The OpenAI-compatible API through the official `openai` SDK, as agent frameworks and evaluation harnesses call it.

Run by `bin/tests/cli/openai_sdk.rs` against a CPU server of the embedded default model: REWIND_BASE_URL is the server's
`/v1` address (REWIND_REASONING_URL: a second one whose reasoning parser is on), REWIND_MODEL_NAME its served model
name, REWIND_BIN the `rewind` binary (for `rewind logits`).
"""

import json
import math
import os
import subprocess
import tempfile
import unittest

import jsonschema

import urllib.request

import openai

BASE = os.environ["REWIND_BASE_URL"]
MODEL = os.environ["REWIND_MODEL_NAME"]
ROOT = BASE.removesuffix("/v1")


def post(path: str, body: dict) -> dict:
    """POSTs `body` as JSON to the server's `path` (outside `/v1`, which the SDK does not cover)."""
    req = urllib.request.Request(
        ROOT + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def client(base: str = BASE) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)


class Completions(unittest.TestCase):
    def test_a_completion_has_text_usage_and_a_finish_reason(self):
        r = client().completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0)
        self.assertEqual(len(r.choices), 1)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 8)
        self.assertGreater(r.usage.prompt_tokens, 0)
        self.assertTrue(r.choices[0].text)

    def test_streaming_gives_the_same_text_as_one_answer(self):
        c = client()
        whole = c.completions.create(model=MODEL, prompt="In the beginning", max_tokens=12, temperature=0)
        pieces = c.completions.create(
            model=MODEL,
            prompt="In the beginning",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        for chunk in pieces:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        self.assertEqual(text, whole.choices[0].text)
        self.assertEqual(usage.completion_tokens, 12)

    def test_seeded_sampling_repeats_and_penalties_are_taken(self):
        c = client()
        ask = dict(
            model=MODEL,
            prompt="It is a truth",
            max_tokens=10,
            temperature=1.0,
            top_p=0.9,
            seed=7,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            extra_body={"min_tokens": 10, "top_k": 40, "repetition_penalty": 1.1},
        )
        a = c.completions.create(**ask)
        b = c.completions.create(**ask)
        self.assertEqual(a.choices[0].text, b.choices[0].text)
        self.assertEqual(a.usage.completion_tokens, 10)

    def test_bad_parameters_are_a_400_naming_the_field(self):
        with self.assertRaises(openai.BadRequestError) as e:
            client().completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1)
        self.assertIn("temperature", str(e.exception))
        with self.assertRaises(openai.BadRequestError) as e:
            client().completions.create(model=MODEL, prompt="x", max_tokens=4, logit_bias={"99999999": 5})
        self.assertIn("logit_bias", str(e.exception))


class Chat(unittest.TestCase):
    MESSAGES = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me about the sea."},
    ]

    def test_a_chat_answer_and_its_stream_agree(self):
        c = client()
        whole = c.chat.completions.create(model=MODEL, messages=self.MESSAGES, max_tokens=10, temperature=0)
        self.assertEqual(whole.choices[0].message.role, "assistant")
        stream = c.chat.completions.create(
            model=MODEL, messages=self.MESSAGES, max_tokens=10, temperature=0, stream=True
        )
        text, roles = "", set()
        for chunk in stream:
            for ch in chunk.choices:
                if ch.delta.role:
                    roles.add(ch.delta.role)
                text += ch.delta.content or ""
        self.assertEqual(roles, {"assistant"})
        self.assertEqual(text, whole.choices[0].message.content or "")

    def test_max_completion_tokens_and_stop_are_taken(self):
        r = client().chat.completions.create(
            model=MODEL, messages=self.MESSAGES, max_completion_tokens=5, temperature=0, stop=["zzzz"]
        )
        self.assertEqual(r.usage.completion_tokens, 5)
        self.assertEqual(r.choices[0].finish_reason, "length")


class Endpoints(unittest.TestCase):
    def test_models_lists_the_served_name_with_its_context(self):
        models = client().models.list().data
        self.assertEqual([m.id for m in models], [MODEL])
        self.assertGreater(models[0].model_extra["max_model_len"], 0)

    def test_tokenize_and_detokenize_round_trip(self):
        t = post("/tokenize", {"model": MODEL, "prompt": "hello world"})
        self.assertEqual(t["count"], len(t["tokens"]))
        d = post("/detokenize", {"model": MODEL, "tokens": t["tokens"]})
        self.assertEqual(d["prompt"], "hello world")


class Choices(unittest.TestCase):
    def test_n_greedy_choices_are_equal_and_seeded_ones_differ_and_repeat(self):
        c = client()
        r = c.completions.create(model=MODEL, prompt="The sea", max_tokens=8, temperature=0, n=3)
        self.assertEqual(sorted(ch.index for ch in r.choices), [0, 1, 2])
        self.assertEqual(len({ch.text for ch in r.choices}), 1)
        self.assertEqual(r.usage.completion_tokens, 24)
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=12,
                   temperature=1.0, n=3, seed=11)
        a = c.chat.completions.create(**ask)
        b = c.chat.completions.create(**ask)
        texts = [ch.message.content for ch in sorted(a.choices, key=lambda ch: ch.index)]
        self.assertGreater(len(set(texts)), 1, texts)
        self.assertEqual(texts, [ch.message.content for ch in sorted(b.choices, key=lambda ch: ch.index)])


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["king", "prophet", "scribe"]},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "years": {"type": "integer", "minimum": 1,
                                                                               "maximum": 99}},
            "required": ["city", "years"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "home"],
    "additionalProperties": False,
}


class StructuredOutputs(unittest.TestCase):
    def test_a_json_schema_always_yields_output_that_validates(self):
        c = client()
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        for seed in range(4):
            r = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], max_tokens=300,
                temperature=1.0, seed=seed, response_format=fmt,
            )
            self.assertEqual(r.choices[0].finish_reason, "stop")
            jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)

    def test_guided_choice_and_regex_hold(self):
        c = client()
        r = c.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=1.0, seed=3,
                                 extra_body={"guided_choice": ["sun", "moon", "stars"]})
        self.assertIn(r.choices[0].text, ["sun", "moon", "stars"])
        r = c.completions.create(model=MODEL, prompt="Number:", max_tokens=20, temperature=1.0, seed=3,
                                 extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
        self.assertRegex(r.choices[0].text, r"^[0-9]{3}-[a-z]{2}$")

    def test_a_schema_that_does_not_compile_is_a_400_naming_the_field(self):
        with self.assertRaises(openai.BadRequestError) as e:
            client().completions.create(model=MODEL, prompt="x", max_tokens=4,
                                        extra_body={"guided_regex": "([a-z"})
        self.assertIn("guided_regex", str(e.exception))


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


class Tools(unittest.TestCase):
    MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

    def test_tool_choice_required_always_yields_arguments_that_validate(self):
        c = client()
        for seed in range(3):
            r = c.chat.completions.create(model=MODEL, messages=self.MESSAGES, tools=[WEATHER],
                                          tool_choice="required", max_tokens=200, temperature=1.0, seed=seed)
            self.assertEqual(r.choices[0].finish_reason, "tool_calls")
            calls = r.choices[0].message.tool_calls
            self.assertTrue(calls)
            for call in calls:
                self.assertEqual(call.function.name, "get_weather")
                jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    def test_streamed_tool_call_deltas_reassemble_to_the_same_call(self):
        c = client()
        ask = dict(model=MODEL, messages=self.MESSAGES, tools=[WEATHER], max_tokens=200, temperature=1.0, seed=5,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
        whole = c.chat.completions.create(**ask).choices[0].message.tool_calls
        calls = {}
        finish = None
        for chunk in c.chat.completions.create(stream=True, **ask):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for d in ch.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    call["id"] = d.id or call["id"]
                    if d.function and d.function.name:
                        call["name"] += d.function.name
                    if d.function and d.function.arguments:
                        call["arguments"] += d.function.arguments
        self.assertEqual(finish, "tool_calls")
        self.assertEqual(len(whole), 1)
        self.assertEqual(list(calls), [0])
        self.assertEqual(calls[0]["name"], whole[0].function.name)
        self.assertEqual(calls[0]["arguments"], whole[0].function.arguments)
        self.assertTrue(calls[0]["id"].startswith("call_"))


class Reasoning(unittest.TestCase):
    def test_reasoning_is_split_out_of_the_content(self):
        # The grammar makes the tiny model write a reasoning block, which the server's reasoning parser splits off.
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "Think first."}], max_tokens=60,
                   temperature=1.0, seed=2, extra_body={"guided_regex": "<think>[a-z ]{1,12}</think>[a-z]{1,8}"})
        c = client(os.environ["REWIND_REASONING_URL"])
        m = c.chat.completions.create(**ask).choices[0].message
        self.assertRegex(m.model_extra["reasoning_content"], r"^[a-z ]{1,12}$")
        self.assertRegex(m.content, r"^[a-z]{1,8}$")
        reasoning, content = "", ""
        for chunk in c.chat.completions.create(stream=True, **ask):
            for ch in chunk.choices:
                reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
                content += ch.delta.content or ""
        self.assertEqual((reasoning, content), (m.model_extra["reasoning_content"], m.content))


def log_softmax(row):
    top = max(row)
    lse = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - lse for x in row]


class Logprobs(unittest.TestCase):
    def test_prompt_and_generated_logprobs_equal_a_full_softmax_of_rewind_logits(self):
        ids = post("/tokenize", {"model": MODEL, "prompt": "In the beginning God created"})["tokens"]
        r = client().completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=5)
        lp = r.choices[0].logprobs
        self.assertEqual(len(lp.token_logprobs), len(ids) + 1)
        self.assertIsNone(lp.token_logprobs[0])
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "logits.json")
            subprocess.run([os.environ["REWIND_BIN"], "logits", "--tokens", ",".join(map(str, ids)), "--prefill",
                            str(len(ids)), "--out", out], check=True, capture_output=True)
            with open(out) as f:
                rows = [log_softmax(row) for row in json.load(f)["logits"]]
        # Position i's token is predicted by row i - 1; the generated (greedy) token by the last row.
        for i in range(1, len(ids)):
            self.assertAlmostEqual(lp.token_logprobs[i], rows[i - 1][ids[i]], delta=1e-4)
        last = rows[-1]
        self.assertAlmostEqual(lp.token_logprobs[-1], max(last), delta=1e-4)
        best = sorted(last, reverse=True)[:5]
        for i, top in enumerate(lp.top_logprobs[1:], start=1):
            want = sorted(rows[i - 1], reverse=True)[:5]
            for value in top.values():
                self.assertTrue(any(abs(value - w) <= 1e-4 for w in want), (i, top, want))
        self.assertAlmostEqual(max(lp.top_logprobs[-1].values()), best[0], delta=1e-4)

    def test_chat_logprobs_come_with_their_top_alternatives(self):
        r = client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                             max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), 4)
        for entry in content:
            self.assertEqual(len(entry.top_logprobs), 3)
            self.assertAlmostEqual(entry.logprob, max(t.logprob for t in entry.top_logprobs), delta=1e-6)
        with self.assertRaises(openai.BadRequestError) as e:
            client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                             logprobs=True, top_logprobs=21)
        self.assertIn("top_logprobs", str(e.exception))

    def test_n_greedy_choices_each_carry_the_logprobs_of_one(self):
        args = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0,
                    logprobs=True, top_logprobs=2)
        one = client().chat.completions.create(**args).choices[0].logprobs.content
        r = client().chat.completions.create(n=3, **args)
        self.assertEqual(len(r.choices), 3)
        for choice in r.choices:
            content = choice.logprobs.content
            self.assertEqual([e.token for e in content], [e.token for e in one])
            for got, want in zip(content, one):
                # The choices' forked prompt rounds differently from one prefill in the last bits.
                self.assertAlmostEqual(got.logprob, want.logprob, delta=1e-3)
                self.assertEqual(len(got.top_logprobs), 2)


if __name__ == "__main__":
    unittest.main()
