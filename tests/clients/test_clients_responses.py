"""The Responses API on `kvcache serve`: the official `openai` client's ``responses.create``,
``responses.parse`` (Pydantic text formats and strict function tools) and ``responses.stream``,
and the OpenAI Agents SDK with its default model class (``OpenAIResponsesModel``, which speaks
/v1/responses), its call forced and then, as the SDK resets ``tool_choice`` after a tool ran, not.

The bundled model has 135M parameters: the tests assert that the protocol works (the run ends,
the call and its output are in the run's items, every reply is one the client's types accept), not
what the model answers."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from client_server import need
from client_shapes import MAX_TOKENS, SHAPES, WEATHER_QUESTION, GetTime, GetWeather, Node
from openai.types.responses import Response
from pydantic import ValidationError

TOOLS = [openai.pydantic_responses_function_tool(GetWeather), openai.pydantic_responses_function_tool(GetTime)]


def _responses(wire) -> list:
    return [e for e in wire.exchanges if e.path.endswith("/responses")]


def _no_problems(wire, at_least: int = 1) -> None:
    """At least ``at_least`` Responses requests, each answered as the server owes any client."""
    assert len(_responses(wire)) >= at_least, wire.summary()
    assert not wire.problems(), "\n".join(wire.problems()) + "\n" + wire.summary()
    for ex in _responses(wire):
        if ex.status == 200 and not ex.streamed:
            Response.model_validate(json.loads(ex.body()))


def _real(server) -> bool:
    """Whether the server runs a trained model (its answers end by themselves), not one of random weights."""
    return getattr(server, "name", "smollm2") == "smollm2"


def test_create_and_stream_give_the_same_text(server, openai_client, wire):
    kw = dict(model=server.model, input="Say hello.", instructions="Be brief.", max_output_tokens=MAX_TOKENS,
              temperature=0)
    whole = openai_client.responses.create(**kw)
    assert whole.output_text and whole.status == ("completed" if _real(server) else whole.status)
    events = list(openai_client.responses.create(**kw, stream=True))
    assert events[-1].type == f"response.{whole.status}" and events[-1].response.output_text == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    if whole.status == "completed":  # the helper's final response needs response.completed
        with openai_client.responses.stream(**kw) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert "".join(deltas) == final.output_text == whole.output_text
        assert final.id != whole.id and openai_client.responses.retrieve(final.id).output_text == final.output_text
    _no_problems(wire, 2)


@pytest.mark.parametrize("model,prompt", [s for s in SHAPES if s[0] is not Node],
                         ids=lambda v: getattr(v, "__name__", ""))
def test_parse_with_pydantic_text_formats(server, openai_client, wire, model, prompt):
    try:
        done = openai_client.responses.parse(model=server.model, input=prompt, text_format=model,
                                             max_output_tokens=MAX_TOKENS, temperature=0)
    except ValidationError:  # the JSON was cut by max_output_tokens: a random model's digits go on and on
        assert not _real(server) and json.loads(_responses(wire)[0].body())["status"] == "incomplete"
        done = None
    if done is not None:
        assert done.status == "completed" and isinstance(done.output_parsed, model), done.output_text
    sent = _responses(wire)[0].request["text"]["format"]
    assert sent["type"] == "json_schema" and sent["strict"] is True
    _no_problems(wire)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_strict_function_tools_forced(server, openai_client, wire, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "name": "GetTime"}
    done = openai_client.responses.parse(model=server.model, input=WEATHER_QUESTION, tools=TOOLS,
                                         tool_choice=tool_choice, parallel_tool_calls=False,
                                         max_output_tokens=MAX_TOKENS, temperature=0)
    calls = [o for o in done.output if o.type == "function_call"]
    assert len(calls) == 1, done.output
    want = {"GetWeather": GetWeather, "GetTime": GetTime}[calls[0].name]
    assert isinstance(calls[0].parsed_arguments, want) and (choice == "required" or want is GetTime)
    _no_problems(wire)


def test_a_streamed_forced_call(server, openai_client, wire):
    with openai_client.responses.stream(model=server.model, input=WEATHER_QUESTION, tools=TOOLS,
                                        tool_choice="required", max_output_tokens=MAX_TOKENS, temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    call = next(o for o in final.output if o.type == "function_call")
    assert call.parsed_arguments is not None and call.call_id
    _no_problems(wire)


# --- the OpenAI Agents SDK, its default model class ------------------------------------------------


@pytest.fixture
def sdk(server):
    if not _real(server):
        pytest.skip("the SDK takes a response cut by max_output_tokens as a failure, and a random model's "
                    "answers need not end (its forced calls are checked above)")
    agents = need("agents")
    agents.set_tracing_disabled(True)
    return agents


def _agent(sdk, server, runs: list, **settings):
    @sdk.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        runs.append(city)
        return json.dumps({"temperature": 4, "sky": "rain"})

    return sdk.Agent(name="helper", instructions="You are a helpful assistant.", model=server.model,
                     tools=[get_weather], model_settings=sdk.ModelSettings(max_tokens=MAX_TOKENS, temperature=0,
                                                                           **settings))


def _config(sdk, client):
    """The SDK's own provider with the client pointed at the server: model names resolve to its
    default model class."""
    provider = sdk.OpenAIProvider(openai_client=client)
    assert isinstance(provider.get_model("any"), sdk.OpenAIResponsesModel)
    return sdk.RunConfig(model_provider=provider, tracing_disabled=True)


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
def test_an_agent_on_the_default_model_calls_its_tool_then_answers(sdk, server, async_openai_client, wire, stream):
    runs: list = []
    agent = _agent(sdk, server, runs, tool_choice="required")

    async def go():
        if not stream:
            return await sdk.Runner.run(agent, "What is the weather in Oslo?", max_turns=4,
                                        run_config=_config(sdk, async_openai_client))
        result = sdk.Runner.run_streamed(agent, "What is the weather in Oslo?", max_turns=4,
                                         run_config=_config(sdk, async_openai_client))
        async for _ in result.stream_events():
            pass
        return result

    with wire.explains():
        result = asyncio.run(go())
    kinds = [type(item).__name__ for item in result.new_items]
    assert "ToolCallItem" in kinds and "ToolCallOutputItem" in kinds and kinds[-1] == "MessageOutputItem", kinds
    assert runs and isinstance(result.final_output, str) and result.final_output.strip()
    sent = [e.request for e in _responses(wire)]
    assert len(sent) >= 2 and sent[0]["tool_choice"] == "required"
    assert sent[-1].get("tool_choice") in (None, "auto")  # the SDK no longer forces a call after one ran
    call = next(i.raw_item for i in result.new_items if type(i).__name__ == "ToolCallItem")
    outputs = [i for i in sent[1]["input"] if i.get("type") == "function_call_output"]
    assert [o["call_id"] for o in outputs] == [call.call_id]
    assert all(e.streamed == stream for e in _responses(wire))
    _no_problems(wire, 2)


def test_an_agent_goes_on_from_its_previous_response(sdk, server, async_openai_client, wire):
    """The SDK's server-side conversation state: the second run sends only its new input and
    ``previous_response_id``; the stored conversation is the prompt, warm in the prefix cache."""
    agent = _agent(sdk, server, []).clone(model_settings=sdk.ModelSettings(max_tokens=200, temperature=0))

    async def go():
        config = _config(sdk, async_openai_client)
        first = await sdk.Runner.run(agent, "Say hello.", run_config=config, max_turns=2)
        second = await sdk.Runner.run(agent, "Now say goodbye.", run_config=config, max_turns=2,
                                      previous_response_id=first.last_response_id)
        return first, second

    with wire.explains():
        first, second = asyncio.run(go())
    assert second.final_output and first.last_response_id != second.last_response_id
    last = _responses(wire)[-1]
    assert last.request["previous_response_id"] == first.last_response_id
    assert [i.get("content") for i in last.request["input"]] == ["Now say goodbye."]
    before, usage = json.loads(_responses(wire)[0].body())["usage"], json.loads(last.body())["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= before["total_tokens"] - 1, (before, usage)
    _no_problems(wire, 2)
