"""litellm (``litellm.completion`` with ``api_base``, the way its docs point it at vLLM or a local
OpenAI-compatible server) on `kvcache serve`: plain text, a forced and a named tool call, the tool
round trip, a streamed forced call reassembled by ``litellm.stream_chunk_builder``, and a JSON
schema answer. litellm builds its own requests on top of the openai package; the transport it is
given records each exchange (client_wire.Wire)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from client_server import need
from client_shapes import MAX_TOKENS, City
from client_wire import KEY

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
QUESTION = [{"role": "user", "content": "What is the weather in Oslo, in celsius?"}]


@pytest.fixture(scope="module")
def litellm():
    mod = need("litellm")
    mod.telemetry = False
    return mod


def complete(litellm, server, openai_client, **kw):
    return litellm.completion(model=f"openai/{server.model}", api_base=server.url, api_key=KEY,
                              client=openai_client, max_tokens=MAX_TOKENS, temperature=0, **kw)


def _calls(response) -> list:
    return response.choices[0].message.tool_calls or []


def test_plain_text(litellm, server, openai_client, wire):
    with wire.explains():
        r = complete(litellm, server, openai_client, messages=[{"role": "user", "content": "Say hello."}])
    assert isinstance(r.choices[0].message.content, str) and r.usage.prompt_tokens > 0
    wire.assert_owed()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_call_and_round_trip(litellm, server, openai_client, wire, choice):
    with wire.explains():
        r = complete(litellm, server, openai_client, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=choice)
    calls = _calls(r)
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    if isinstance(choice, dict):
        assert {c.function.name for c in calls} == {"get_time"}
    history = QUESTION + [r.choices[0].message.model_dump()] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature": 4, "time": "10:42"})} for c in calls]
    with wire.explains():
        answer = complete(litellm, server, openai_client, messages=history, tools=[WEATHER, TIME])
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    wire.assert_owed(min_chats=2)


def test_streamed_forced_call_rebuilds(litellm, server, openai_client, wire):
    with wire.explains():
        chunks = list(complete(litellm, server, openai_client, messages=QUESTION, tools=[WEATHER],
                               tool_choice="required", stream=True))
        whole = litellm.stream_chunk_builder(chunks, messages=QUESTION)
    calls = _calls(whole)
    assert calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["get_weather"])
    assert wire.chats()[0].streamed
    wire.assert_owed()


def test_json_schema_answer(litellm, server, openai_client, wire):
    with wire.explains():
        r = complete(litellm, server, openai_client, response_format=City,
                     messages=[{"role": "user", "content": "Tell me about Paris."}])
    City.model_validate_json(r.choices[0].message.content)
    assert wire.chats()[0].request["response_format"]["type"] == "json_schema"
    wire.assert_owed()
