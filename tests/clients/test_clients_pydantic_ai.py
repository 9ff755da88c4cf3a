"""pydantic-ai's Agent on `kvcache serve` through its OpenAI provider (``OpenAIChatModel`` with
``OpenAIProvider(base_url=...)``, the way its docs point it at Ollama, vLLM or LM Studio). It
builds its own request bodies: structured output as a forced ``final_result`` tool (strict, with
tool_choice "required"), as a json_schema response_format (``NativeOutput``) or as json_object
with the schema in the prompt (``PromptedOutput``, a recorded rate); tools run by the agent;
``run_stream``."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from client_server import need
from client_shapes import CITY_QUESTION, MAX_TOKENS, RATE_MAX_TOKENS, RATE_PROMPTS, City, Person
from client_wire import KEY

SETTINGS = {"max_tokens": MAX_TOKENS, "temperature": 0}  # pydantic_ai.settings.ModelSettings is a TypedDict


@pytest.fixture(scope="module")
def pai():
    return need("pydantic_ai")


@pytest.fixture
def model(pai, server, wire):
    provider = need("pydantic_ai.providers.openai").OpenAIProvider(base_url=server.url, api_key=KEY,
                                                                    http_client=wire.async_http_client())
    return need("pydantic_ai.models.openai").OpenAIChatModel(server.model, provider=provider)


@pytest.mark.parametrize("shape", [City, Person], ids=["City", "Person"])
def test_tool_output(pai, model, wire, shape):
    """The default output: a forced, strict final_result tool call."""
    agent = pai.Agent(model, output_type=shape, model_settings=SETTINGS, retries=0)
    prompt = CITY_QUESTION if shape is City else "Describe a person who lives in Rome."
    with wire.explains():
        result = asyncio.run(agent.run(prompt))
    assert isinstance(result.output, shape)
    sent = wire.chats()[0].request
    assert sent["tool_choice"] == "required" and sent["tools"][0]["function"]["strict"] is True
    wire.assert_owed()


def test_native_output(pai, model, wire):
    agent = pai.Agent(model, output_type=pai.NativeOutput(City), model_settings=SETTINGS, retries=0)
    with wire.explains():
        result = asyncio.run(agent.run(CITY_QUESTION))
    assert isinstance(result.output, City)
    assert wire.chats()[0].request["response_format"]["type"] == "json_schema"
    wire.assert_owed()


def test_prompted_output_rate(pai, model, wire, record_rate):
    agent = pai.Agent(model, output_type=pai.PromptedOutput(City), retries=0,
                      model_settings={"max_tokens": RATE_MAX_TOKENS, "temperature": 0})

    async def go() -> int:
        ok = 0
        for prompt in RATE_PROMPTS:
            try:
                await agent.run(prompt)
                ok += 1
            except pai.UnexpectedModelBehavior:
                pass
        return ok

    ok = asyncio.run(go())
    assert all(e.request["response_format"] == {"type": "json_object"} for e in wire.chats())
    wire.assert_owed(min_chats=len(RATE_PROMPTS))
    record_rate(ok, len(RATE_PROMPTS), "pydantic-ai PromptedOutput answers that are a City (model quality: "
                                       "json_object with the schema only in the prompt)")


def test_a_tool_then_output(pai, model, wire):
    """A function tool beside the output tool, every call forced (tool_choice "required" on each
    turn): each tool runs once per distinct arguments and the run ends in a City."""
    runs: list = []
    agent = pai.Agent(model, output_type=City, model_settings=SETTINGS, retries=0,
                      system_prompt="Look up the time first, then describe the city.")

    @agent.tool_plain
    def get_time(city: str) -> str:
        """The local time in a city."""
        runs.append(("get_time", city))
        return "10:42"

    with wire.explains():
        result = asyncio.run(agent.run("What time is it in Paris? Then tell me about Paris."))
    assert isinstance(result.output, City)
    assert len(runs) == len(set(runs)), runs
    wire.assert_owed()


def test_tools_auto_rate(pai, model, wire, record_rate):
    """Text output with a tool on offer (tool_choice auto): calling it is the model's choice."""
    runs: list = []
    agent = pai.Agent(model, model_settings=SETTINGS, system_prompt="You are a helpful assistant.")

    @agent.tool_plain
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The current weather in a city."""
        runs.append(("get_weather", city, unit))
        return json.dumps({"temperature": 4, "sky": "rain"})

    with wire.explains():
        result = asyncio.run(agent.run("What is the weather in Oslo, in celsius?"))
    assert isinstance(result.output, str)
    assert wire.chats()[0].request["tool_choice"] == "auto"
    assert len(runs) == len(set(runs)), runs
    wire.assert_owed()
    record_rate(int(bool(runs)), 1, "pydantic-ai tool_choice auto: the model called get_weather (model quality)")


def test_run_stream(pai, model, wire):
    agent = pai.Agent(model, output_type=City, model_settings=SETTINGS, retries=0)

    async def go():
        async with agent.run_stream(CITY_QUESTION) as stream:
            return [o async for o in stream.stream_output()]

    with wire.explains():
        outs = asyncio.run(go())
    assert outs and isinstance(outs[-1], City) and outs[-1].name
    assert wire.chats()[0].request["stream"] is True
    wire.assert_owed()
