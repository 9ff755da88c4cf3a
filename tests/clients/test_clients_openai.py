"""The official `openai` client's structured-output helpers against `kvcache serve`: ``parse`` with
Pydantic models of every shape, the streaming parse helper, and strict function tools made by
``openai.pydantic_function_tool``."""

from __future__ import annotations

import json

import openai
import pytest
from client_shapes import CITY_QUESTION, MAX_TOKENS, SHAPES, WEATHER_QUESTION, City, GetTime, GetWeather, Node, Person

TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
QUESTION = [{"role": "user", "content": WEATHER_QUESTION}]


@pytest.mark.parametrize("model,prompt", SHAPES, ids=[m.__name__ for m, _ in SHAPES])
def test_parse_every_shape(server, openai_client, wire, model, prompt):
    try:
        done = openai_client.chat.completions.parse(
            model=server.model, messages=[{"role": "user", "content": prompt}], response_format=model,
            max_tokens=MAX_TOKENS, temperature=0)
    except openai.LengthFinishReasonError:
        wire.assert_owed()
        assert model is Node, f"{model.__name__} has bounded answers and was cut by max_tokens"
        return
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model), choice.message.content
    sent = wire.chats()[0].request["response_format"]
    assert sent["type"] == "json_schema" and sent["json_schema"]["strict"] is True
    wire.assert_owed()


def test_streaming_parse_helper_equals_parse(server, openai_client, wire):
    kw = dict(model=server.model, messages=[{"role": "user", "content": SHAPES[0][1]}], response_format=Person,
              max_tokens=MAX_TOKENS, temperature=0)
    whole = openai_client.chat.completions.parse(**kw)
    kinds, parsed = set(), None
    with openai_client.chat.completions.stream(**kw) as stream:
        for event in stream:
            kinds.add(event.type)
            if event.type == "content.done":
                parsed = event.parsed
        final = stream.get_final_completion()
    assert {"content.delta", "content.done"} <= kinds
    assert isinstance(parsed, Person) and parsed == whole.choices[0].message.parsed
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == whole.choices[0].message.content
    wire.assert_owed(min_chats=2)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_strict_tools_forced_one_call(server, openai_client, wire, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "GetTime"}}
    done = openai_client.chat.completions.parse(
        model=server.model, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
        max_tokens=MAX_TOKENS, temperature=0)
    c = done.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
    fn = c.message.tool_calls[0].function
    assert isinstance(fn.parsed_arguments, {"GetWeather": GetWeather, "GetTime": GetTime}[fn.name])
    if choice == "named":
        assert fn.name == "GetTime"
    assert all(t["function"]["strict"] is True for t in wire.chats()[0].request["tools"])
    wire.assert_owed()


@pytest.mark.parametrize("choice", ["required", "named"])
def test_strict_tools_forced_with_parallel_calls_allowed_end(server, openai_client, wire, choice):
    """parallel_tool_calls left out (true): the calls come back parsed and the answer ends, no call repeated."""
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "GetTime"}}
    with wire.explains():
        done = openai_client.chat.completions.parse(model=server.model, messages=QUESTION, tools=TOOLS,
                                                    tool_choice=tool_choice, max_tokens=MAX_TOKENS, temperature=0)
    c = done.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    assert all(t.function.parsed_arguments is not None for t in c.message.tool_calls)
    wire.assert_owed()


def test_strict_tools_auto(server, openai_client, wire):
    """tool_choice auto: whether the model calls is its own choice; what it calls is parsed and valid."""
    try:
        done = openai_client.chat.completions.parse(model=server.model, messages=QUESTION, tools=TOOLS,
                                                    max_tokens=MAX_TOKENS, temperature=0)
        c = done.choices[0]
        assert c.finish_reason in ("stop", "tool_calls")
        for call in c.message.tool_calls or []:
            assert call.function.parsed_arguments is not None
    except openai.LengthFinishReasonError:
        pass  # a free-text answer may run to max_tokens
    wire.assert_owed()


def test_streamed_strict_tool_call(server, openai_client, wire):
    done_events = []
    with openai_client.chat.completions.stream(model=server.model, messages=QUESTION, tools=TOOLS,
                                               tool_choice="required", parallel_tool_calls=False,
                                               max_tokens=MAX_TOKENS, temperature=0) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.done":
                done_events.append(event)
        final = stream.get_final_completion()
    assert len(done_events) == 1 and isinstance(done_events[0].parsed_arguments, (GetWeather, GetTime))
    assert final.choices[0].finish_reason == "tool_calls"
    wire.assert_owed()


def test_a_strict_tool_round_trip(server, openai_client, wire):
    """call -> tool result -> answer, as an application drives it with the parse helpers."""
    msgs = [{"role": "system", "content": "You are a helpful assistant."}, *QUESTION]
    first = openai_client.chat.completions.parse(model=server.model, messages=msgs, tools=TOOLS[:1],
                                                 tool_choice="required", parallel_tool_calls=False,
                                                 max_tokens=MAX_TOKENS, temperature=0)
    (call,) = first.choices[0].message.tool_calls
    msgs += [first.choices[0].message.model_dump(exclude_none=True, exclude={"parsed"}, mode="json"),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 4, "sky": "rain"})}]
    for m in msgs:
        for t in m.get("tool_calls") or []:
            t["function"].pop("parsed_arguments", None)
    answer = openai_client.chat.completions.create(model=server.model, messages=msgs, tools=TOOLS[:1],
                                                   max_tokens=40, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    wire.assert_owed(min_chats=2)


def test_json_schema_without_additional_properties_ends(server, openai_client, wire):
    """A schema as Pydantic writes it (no additionalProperties), sent through create(): the answer
    ends by itself, within max_tokens, and validates."""
    done = openai_client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": CITY_QUESTION}], max_tokens=MAX_TOKENS,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "City",
                                                                               "schema": City.model_json_schema()}})
    assert done.choices[0].finish_reason == "stop", done.choices[0].message.content
    City.model_validate_json(done.choices[0].message.content)
    wire.assert_owed()
