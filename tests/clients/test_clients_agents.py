"""The OpenAI Agents SDK (``openai-agents``) on `kvcache serve` through its Chat Completions model:
an agent with two function tools and tool_choice "required" (the call parsed, each tool run once,
its result sent back, a final answer), an agent with ``output_type``, and ``Runner.run_streamed``.
Tracing is off (``set_tracing_disabled`` and OPENAI_AGENTS_DISABLE_TRACING): nothing leaves the
machine."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from client_server import need
from client_shapes import CITY_QUESTION, MAX_TOKENS, City

QUESTION = "What is the weather in Oslo, in celsius?"


@pytest.fixture(scope="module")
def sdk():
    agents = need("agents")
    agents.set_tracing_disabled(True)
    return agents


def _tools(sdk, runs: list):
    @sdk.function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The current weather in a city."""
        runs.append(("get_weather", city, unit))
        return json.dumps({"temperature": 4, "sky": "rain"})

    @sdk.function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        runs.append(("get_time", city))
        return "10:42"

    return [get_weather, get_time]


def _model(sdk, server, async_openai_client):
    return sdk.OpenAIChatCompletionsModel(model=server.model, openai_client=async_openai_client)


def _tool_agent(sdk, server, async_openai_client, runs):
    return sdk.Agent(name="helper", instructions="You are a helpful assistant.",
                     model=_model(sdk, server, async_openai_client), tools=_tools(sdk, runs),
                     model_settings=sdk.ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS, temperature=0))


def _check_tool_run(wire, runs, final_output) -> None:
    """The forced call was parsed and run once, its result went back, and the run ended in an answer."""
    assert runs, "no tool ran"
    assert len(runs) == len(set(runs)), f"a tool ran more than once with the same arguments: {runs}"
    chats = wire.chats()
    assert chats[0].request["tool_choice"] == "required"
    first = chats[0].reply()["choices"][0]["message"]
    ids = {c["id"] for c in first.get("tool_calls") or []}
    sent_back = [m for m in chats[1].request["messages"] if m.get("role") == "tool"]
    assert ids and {m["tool_call_id"] for m in sent_back} == ids, (ids, sent_back)
    assert isinstance(final_output, str) and final_output.strip()
    assert chats[-1].reply()["choices"][0]["finish_reason"] in ("stop", "length")


def test_two_tools_required(sdk, server, async_openai_client, wire):
    runs: list = []
    agent = _tool_agent(sdk, server, async_openai_client, runs)
    with wire.explains():
        result = asyncio.run(sdk.Runner.run(agent, QUESTION, max_turns=4))
    _check_tool_run(wire, runs, result.final_output)
    assert all(t["function"]["strict"] is True for t in wire.chats()[0].request["tools"])
    wire.assert_owed(min_chats=2)


def test_output_type(sdk, server, async_openai_client, wire):
    agent = sdk.Agent(name="facts", instructions="Answer with facts.", model=_model(sdk, server, async_openai_client),
                      output_type=City, model_settings=sdk.ModelSettings(max_tokens=MAX_TOKENS, temperature=0))
    with wire.explains():
        result = asyncio.run(sdk.Runner.run(agent, CITY_QUESTION, max_turns=2))
    assert isinstance(result.final_output, City)
    assert wire.chats()[0].request["response_format"]["type"] == "json_schema"
    wire.assert_owed()


def test_run_streamed(sdk, server, async_openai_client, wire):
    runs: list = []
    agent = _tool_agent(sdk, server, async_openai_client, runs)

    async def go():
        result = sdk.Runner.run_streamed(agent, QUESTION, max_turns=4)
        kinds = [ev.type async for ev in result.stream_events()]
        return result, kinds

    with wire.explains():
        result, kinds = asyncio.run(go())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert all(e.streamed for e in wire.chats())
    _check_tool_run(wire, runs, result.final_output)
    wire.assert_owed(min_chats=2)


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
def test_output_type_after_a_tool(sdk, server, async_openai_client, wire, stream):
    """Tools and an output type together: the tool's call is forced, then the answer is a City."""
    runs: list = []
    agent = sdk.Agent(name="facts", instructions="Answer with facts.", model=_model(sdk, server, async_openai_client),
                      tools=_tools(sdk, runs)[1:], output_type=City,
                      model_settings=sdk.ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS, temperature=0))
    question = "What time is it in Paris? Then tell me about Paris."

    async def go():
        if not stream:
            return await sdk.Runner.run(agent, question, max_turns=4)
        result = sdk.Runner.run_streamed(agent, question, max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    with wire.explains():
        result = asyncio.run(go())
    assert runs and len(runs) == len(set(runs)), runs
    assert isinstance(result.final_output, City)
    wire.assert_owed(min_chats=2)
