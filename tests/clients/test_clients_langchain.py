"""langchain-openai's ChatOpenAI pointed at `kvcache serve`: ``with_structured_output`` by
json_schema, function_calling and json_mode, ``bind_tools`` with each tool_choice a user writes
(any, a tool's name, required, auto), and ``.stream()`` of each. json_mode sends no schema (only
the prompt says what to write), so its success is a recorded rate."""

from __future__ import annotations

import json

import pytest
from client_shapes import (CITY_QUESTION, MAX_TOKENS, RATE_MAX_TOKENS, RATE_PROMPTS, WEATHER_QUESTION, City, GetTime,
                           GetWeather)
from client_server import need
from client_wire import KEY

TOOLS = [GetWeather, GetTime]


def _chat(server, wire, max_tokens: int = MAX_TOKENS):
    return need("langchain_openai").ChatOpenAI(model=server.model, base_url=server.url, api_key=KEY,
                                               max_tokens=max_tokens, temperature=0, max_retries=0, timeout=120,
                                               http_client=wire.http_client())


@pytest.fixture
def llm(server, wire):
    return _chat(server, wire)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output(llm, wire, method):
    with wire.explains():
        out = llm.with_structured_output(City, method=method, include_raw=True).invoke(CITY_QUESTION)
    assert out["parsing_error"] is None and isinstance(out["parsed"], City), out
    assert out["raw"].response_metadata["finish_reason"] == ("stop" if method == "json_schema" else "tool_calls")
    wire.assert_owed()


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_stream(llm, wire, method):
    with wire.explains():
        out = list(llm.with_structured_output(City, method=method).stream(CITY_QUESTION))
    assert out and isinstance(out[-1], City), out
    assert wire.chats()[0].request["stream"] is True
    wire.assert_owed()


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_json_mode_rate(server, wire, record_rate, stream):
    """The server owes a JSON object whenever the answer ends by itself; that it is a City is up to the model."""
    structured, ok = _chat(server, wire, RATE_MAX_TOKENS).with_structured_output(None, method="json_mode"), 0
    for prompt in RATE_PROMPTS:
        ask = f"{prompt} Answer as a JSON object with keys name, country and population_millions."
        try:
            out = list(structured.stream(ask))[-1] if stream else structured.invoke(ask)
            City.model_validate(out)
            ok += 1
        except Exception:  # the model's shape, or its answer cut by max_tokens (the wire checks the server)
            pass
    assert all(e.request["response_format"] == {"type": "json_object"} for e in wire.chats())
    wire.assert_owed(min_chats=len(RATE_PROMPTS))
    how = "stream" if stream else "invoke"
    record_rate(ok, len(RATE_PROMPTS), f"langchain json_mode {how} answers that are a City "
                                       "(model quality: no schema is sent)")


CHOICES = {"any": "required", "GetTime": {"type": "function", "function": {"name": "GetTime"}},
           "required": "required", "auto": "auto"}


def _check_calls(msg, choice: str) -> None:
    calls = msg.tool_calls
    assert not msg.invalid_tool_calls, msg.invalid_tool_calls
    keys = [(c["name"], json.dumps(c["args"], sort_keys=True)) for c in calls]
    assert len(keys) == len(set(keys)), f"repeated calls: {keys}"
    for c in calls:
        {"GetWeather": GetWeather, "GetTime": GetTime}[c["name"]].model_validate(c["args"])
    if choice != "auto":
        assert calls and msg.response_metadata["finish_reason"] == "tool_calls", msg
    if choice == "GetTime":
        assert {c["name"] for c in calls} == {"GetTime"}


@pytest.mark.parametrize("choice", list(CHOICES))
def test_bind_tools(llm, wire, choice):
    with wire.explains():
        msg = llm.bind_tools(TOOLS, tool_choice=choice).invoke(WEATHER_QUESTION)
    assert wire.chats()[0].request["tool_choice"] == CHOICES[choice]
    _check_calls(msg, choice)
    wire.assert_owed()


@pytest.mark.parametrize("choice", list(CHOICES))
def test_bind_tools_stream(llm, wire, choice):
    whole = None
    with wire.explains():
        for chunk in llm.bind_tools(TOOLS, tool_choice=choice).stream(WEATHER_QUESTION):
            assert isinstance(chunk, need("langchain_core.messages").AIMessageChunk)
            whole = chunk if whole is None else whole + chunk
    assert whole is not None
    _check_calls(whole, choice)
    wire.assert_owed()
