"""The OpenAI-compatible API through the official `openai` SDK, as agent frameworks and evaluation harnesses call it.

Run by `bin/tests/openai_sdk.rs` against a CPU server of the embedded default model: REWIND_BASE_URL is the server's
`/v1` address, REWIND_MODEL_NAME its served model name, REWIND_BIN the `rewind` binary (for `rewind logits`).
"""

import json
import os
import unittest

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


def client() -> openai.OpenAI:
    return openai.OpenAI(base_url=BASE, api_key="unused", max_retries=0, timeout=120)


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


if __name__ == "__main__":
    unittest.main()
