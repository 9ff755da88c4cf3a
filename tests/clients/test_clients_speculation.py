"""Speculation does not change what a client gets: the same greedy requests (structured output,
a schema without additionalProperties as instructor and pydantic-ai send it, a forced tool call)
against `kvcache serve --prompt-lookup 4` give the text of the plain server, and the speculating
server owes each client what the plain one does."""

from __future__ import annotations

import openai
import pytest
from client_server import LoggedServer
from client_shapes import CITY_QUESTION, MAX_TOKENS, SHAPES, WEATHER_QUESTION, City, GetTime, GetWeather, Person
from client_wire import KEY, Wire


@pytest.fixture(scope="module")
def spec_server(server):
    s = LoggedServer("--prompt-lookup", "4", model=server.model_path)
    yield s
    s.close()


TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
REQUESTS = {  # name -> (helper, its arguments): what the client does, as in the other modules
    "parse_person": ("parse", dict(messages=[{"role": "user", "content": SHAPES[0][1]}], response_format=Person)),
    "schema_without_additional_properties": ("create", dict(
        messages=[{"role": "user", "content": CITY_QUESTION}],
        response_format={"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema()}})),
    "forced_tool_call": ("parse", dict(messages=[{"role": "user", "content": WEATHER_QUESTION}], tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False)),
}


def _ask(url: str, model: str, wire: Wire, name: str):
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120, http_client=wire.http_client())
    helper, kw = REQUESTS[name]
    try:
        done = getattr(client.chat.completions, helper)(model=model, max_tokens=MAX_TOKENS, temperature=0, **kw)
    except openai.LengthFinishReasonError as e:  # compared all the same
        done = e.completion
    c = done.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    return c.message.content, calls, c.finish_reason


@pytest.mark.parametrize("name", list(REQUESTS))
def test_speculation_gives_the_plain_text(server, spec_server, wire, name):
    plain = _ask(server.url, server.model, wire, name)
    spec = _ask(spec_server.url, spec_server.model, wire, name)
    assert spec == plain, f"--prompt-lookup 4 answered {spec}; the plain server {plain}"
    wire.assert_owed(min_chats=2)
