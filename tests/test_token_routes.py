"""The small endpoints clients probe: ``GET /v1/models/{id}`` (``client.models.retrieve``),
``POST /tokenize`` and ``/detokenize`` in vLLM's shapes, and ``response_format`` read whole:
``json_object`` with a ``schema`` (instructor's JSON_SCHEMA mode, llama.cpp's extension) constrains
to that schema, and a key kvcache does not read is a 400 naming it, never dropped. On a real
`kvcache serve` of the tiny model that carries Qwen2.5's real tokenizer and template."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"}]


@pytest.fixture(scope="module")
def served():
    from qwen_tiny import tiny_qwen
    from test_server import Server

    s = Server(str(tiny_qwen()))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def model_of(client) -> str:
    return client.models.list().data[0].id


def test_models_retrieve(served, client):
    name = model_of(client)
    m = client.models.retrieve(name)
    assert m.id == name and m.object == "model"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4o")


def test_tokenize_gives_the_ids_a_request_prefills(served, client):
    name = model_of(client)
    status, body = served.post("/tokenize", json.dumps({"model": name, "messages": CHAT, "tools": [TOOL]}).encode())
    assert status == 200 and body["count"] == len(body["tokens"]) and body["max_model_len"] > body["count"]
    r = client.chat.completions.create(model=name, messages=CHAT, tools=[TOOL], max_tokens=1)
    assert r.usage.prompt_tokens == body["count"]
    assert 151644 in body["tokens"]  # <|im_start|>: the template's own special tokens
    status, text = served.post("/tokenize", json.dumps({"prompt": "Grüße, <tool_call>", "return_token_strs": True}).encode())
    assert status == 200 and text["tokens"][-1] == 151657 and text["token_strs"][-1] == "<tool_call>"
    status, back = served.post("/detokenize", json.dumps({"tokens": text["tokens"]}).encode())
    assert status == 200 and back == {"prompt": "Grüße, <tool_call>"}
    status, bare = served.post("/tokenize", json.dumps({"messages": CHAT, "add_generation_prompt": False}).encode())
    status2, gen = served.post("/tokenize", json.dumps({"messages": CHAT}).encode())
    assert gen["tokens"][:bare["count"]] == bare["tokens"] and gen["count"] > bare["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "truncate": 3}, "truncate"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_token_routes_refuse_bad_bodies_naming_the_field(served, path, body, param):
    status, reply = served.post(path, json.dumps(body).encode())
    assert status in (400, 404) and reply["error"]["param"] == param, reply
    assert "\n" not in reply["error"]["message"]


SCHEMA = {"type": "object", "properties": {"digit": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "word": {"enum": ["yes", "no"]}},
          "required": ["digit", "word"], "additionalProperties": False}


def test_json_object_with_a_schema_follows_the_schema(client):
    name = model_of(client)
    for seed in range(3):
        r = client.chat.completions.create(model=name, messages=CHAT, max_tokens=40, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object", "schema": SCHEMA})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_object", "strict": True}, "response_format.strict"),
    ({"type": "text", "schema": SCHEMA}, "response_format.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "examples": []}},
     "response_format.json_schema.examples"),
    ({"type": "json_object", "schema": {"type": "nonsense"}}, "response_format.schema"),
])
def test_response_format_keys_not_read_are_refused_by_name(client, fmt, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_of(client), messages=CHAT, max_tokens=4, response_format=fmt)
    assert e.value.body["param"] == param, e.value.body
