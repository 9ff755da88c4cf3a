"""Structured outputs and tool calls through `kvcache serve` on the bundled model, with the real
`openai` client: ``.parse()`` with a Pydantic model, json_object and the guided_* parameters on
both endpoints, a tool round trip (call -> tool message -> answer), ``required`` and a named
function forced by the grammar, streamed tool-call deltas that reassemble into the non-streamed
call, and bad constraints refused with a 400 naming them beside healthy streams. A forced call ends
the turn (one call, "tool_calls") with parallel calls allowed or not, streamed or not; the openai
package's ``chat.completions.stream`` helper parses a pydantic tool; a tool message must answer an
earlier call."""

from __future__ import annotations

import json
import threading

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from test_server import Server, _model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


class City(BaseModel):
    name: str
    country: str
    population_millions: int = Field(ge=0, le=100)  # bounded: a 135M model left free writes digits on and on


@pytest.fixture(scope="module")
def server():
    from kvcache.models.bundled import default_gguf

    s = Server(str(default_gguf()), "--max-running", "16")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_parse_with_a_pydantic_model(server, client):
    done = client.chat.completions.parse(
        model=_model(server), messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
        response_format=City, max_tokens=120, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City) and choice.message.parsed.name


def test_json_object_and_guided_parameters_on_both_endpoints(server, client):
    model = _model(server)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A JSON object about dogs."}],
                                          response_format={"type": "json_object"}, max_tokens=150, temperature=0)
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    else:
        assert chat.choices[0].finish_reason == "length"
    comp = client.completions.create(model=model, prompt="Is water wet? Answer:", max_tokens=5,
                                     extra_body={"guided_choice": ["yes", "no"]})
    assert comp.choices[0].text in ("yes", "no")
    regex = client.completions.create(model=model, prompt="A date:", max_tokens=20,
                                      extra_body={"guided_regex": r"20\d\d-[01]\d-[0-3]\d"})
    assert len(regex.choices[0].text) == 10 and regex.choices[0].text.startswith("20")
    gram = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Pick a colour."}], max_tokens=10,
        extra_body={"guided_grammar": 'root ::= "colour: " ("red" | "blue")'})
    assert gram.choices[0].message.content in ("colour: red", "colour: blue")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["n"], "additionalProperties": False}
    js = client.completions.create(model=model, prompt="Give a number as JSON:", max_tokens=20, temperature=0.7,
                                   seed=3, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(js.choices[0].text), schema)


def _ask(client, model, **kw):
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=model, temperature=0, **kw)


def test_required_and_named_tool_calls_validate(server, client):
    model = _model(server)
    msgs = [{"role": "user", "content": "What is the weather like in Lyon?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        done = _ask(client, model, messages=msgs, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
        c = done.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_") and not c.message.content
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
    # parallel calls allowed: a small model may go on calling until max_tokens; every call it
    # completed is returned and valid
    done = _ask(client, model, messages=msgs, tools=[WEATHER, TIME], tool_choice="required")
    calls = done.choices[0].message.tool_calls
    assert calls and done.choices[0].finish_reason in ("tool_calls", "length")
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_tool_round_trip(server, client):
    model = _model(server)
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Oslo, in celsius?"}]
    first = _ask(client, model, messages=msgs, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    (call,) = first.choices[0].message.tool_calls
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 4, "sky": "rain"})}]
    answer = _ask(client, model, messages=msgs, tools=[WEATHER], tool_choice="none", max_tokens=40)
    c = answer.choices[0]
    assert c.message.content and not c.message.tool_calls and c.finish_reason in ("stop", "length")


def test_streamed_tool_calls_reassemble_into_the_non_streamed_call(server, client):
    model = _model(server)
    kw = dict(messages=[{"role": "user", "content": "Weather and time in Rome, please."}], tools=[WEATHER, TIME],
              tool_choice="required", max_tokens=200)
    whole = _ask(client, model, **kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in _ask(client, model, stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = d.id or entry["id"]
                if d.function is not None:
                    entry["name"] = d.function.name or entry["name"]
                    entry["arguments"] += d.function.arguments or ""
    assert finish == whole.finish_reason and finish in ("tool_calls", "length")
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert all(c["id"] for c in calls.values())


@pytest.mark.parametrize("extra,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "not a valid JSON Schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 5, "maximum": 3}}}}, "response_format", "JSON schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"guided_json": {"type": "string", "pattern": "a" * 70000}}, "guided_json", "over the limit"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "give one of them"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", "nope"),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "outside the vocabulary"),
])
def test_bad_constraints_get_400_beside_healthy_streams(server, client, extra, param, words):
    model = _model(server)
    results: list = []

    def healthy():
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=24, stream=True,
            temperature=0) if c.choices)
        results.append(text)

    threads = [threading.Thread(target=healthy) for _ in range(2)]
    for t in threads:
        t.start()
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}
    code, err = server.post("/v1/chat/completions", json.dumps(body).encode())
    for t in threads:
        t.join()
    assert code == 400, err
    assert err["error"]["param"] == param and words in err["error"]["message"], err
    assert "\n" not in err["error"]["message"]
    assert len(results) == 2 and all(results)


def test_a_constrained_request_cut_by_max_tokens_says_length(server, client):
    done = client.chat.completions.create(
        model=_model(server), messages=[{"role": "user", "content": "Paris as JSON."}], max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": City.model_json_schema()}})
    assert done.choices[0].finish_reason == "length"


def test_sampling_parameters_are_taken(server, client):
    model = _model(server)
    prompt = "la la la la la la la la"

    def text(**kw):
        kw.setdefault("max_tokens", 12)
        return client.completions.create(model=model, prompt=prompt, temperature=0, **kw).choices[0].text

    plain = text()
    assert text(presence_penalty=2.0) != plain and text(frequency_penalty=1.0) != plain
    assert text(extra_body={"repetition_penalty": 1.5}) != plain
    first = text(max_tokens=1)
    assert text(max_tokens=1, logit_bias={str(_token_id(first)): -100}) != first
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=3, temperature=0)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=model, prompt="x", max_tokens=2, presence_penalty=3.0)


def _token_id(text: str) -> int:
    """The id of ``text`` (one token) in the served model's vocabulary."""
    from kvcache.models.loading import resolve_model
    from kvcache.models.tokenizer import Tokenizer

    (tid,) = Tokenizer.from_dir(resolve_model(None).path).encode(text, add_special_tokens=False)
    return tid


# --- forced calls end; the openai package's stream helper; tool messages answer earlier calls -------

class User(BaseModel):
    """A person (the shape instructor's examples extract)."""

    name: str
    age: int


USER_TOOL = {"type": "function", "function": {
    "name": "User", "description": "Correctly extracted `User` with all the required parameters with correct types",
    "parameters": User.model_json_schema()}}
EXTRACT = [{"role": "user", "content": "Extract: Jason is 25 years old"}]


def _calls_of(client, model, stream: bool, **kw) -> tuple[str | None, list[tuple[str, str]]]:
    """finish_reason and (name, arguments) of each call, from a whole reply or reassembled from a stream."""
    if not stream:
        c = client.chat.completions.create(model=model, **kw).choices[0]
        return c.finish_reason, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        for ch in chunk.choices:
            assert not (ch.delta.content or "").strip(), ch.delta  # a forced turn has no content
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", ""])
                if d.function is not None:
                    entry[0] += d.function.name or ""
                    entry[1] += d.function.arguments or ""
    return finish, [(n, a) for _, (n, a) in sorted(calls.items())]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("parallel", [None, False], ids=["parallel-default", "parallel-false"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "User"}}],
                         ids=["required", "named"])
def test_a_forced_call_ends_the_turn_after_the_call(server, client, choice, parallel, stream):
    """After a complete call the turn may end; the model ends it rather than writing the same call again
    (it prefers prose to another call, and prose is not allowed): one call, finish_reason "tool_calls"."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    finish, calls = _calls_of(client, _model(server), stream, messages=EXTRACT, tools=[USER_TOOL],
                              tool_choice=choice, max_tokens=200, temperature=0, **extra)
    assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
    assert calls[0][0] == "User"
    User.model_validate_json(calls[0][1])


def test_sampled_forced_calls_end_with_tool_calls(server, client):
    """Sampled at temperature 1: no reply runs to max_tokens for the grammar's sake, every call is valid,
    and most replies hold one call (a second one only where the model sampled ``<`` after a newline)."""
    model = _model(server)
    counts = []
    for seed in range(6):
        finish, calls = _calls_of(client, model, seed % 2 == 1, messages=EXTRACT, tools=[USER_TOOL],
                                  tool_choice="required", max_tokens=200, temperature=1.0, seed=seed)
        assert finish == "tool_calls" and calls, (seed, finish, calls)
        for _, arguments in calls:
            User.model_validate_json(arguments)
        counts.append(len(calls))
    assert counts.count(1) >= 4, counts


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "User"}}],
                         ids=["required", "named"])
def test_the_openai_stream_helper_parses_a_pydantic_tool(server, client, choice):
    """``client.chat.completions.stream`` with ``openai.pydantic_function_tool``: argument delta and done
    events, and the final completion's ``parsed_arguments`` is the model instance."""
    events = []
    with client.chat.completions.stream(model=_model(server), messages=EXTRACT, max_tokens=200, temperature=0,
                                        tools=[openai.pydantic_function_tool(User)], tool_choice=choice) as stream:
        for event in stream:
            events.append(event)
        final = stream.get_final_completion()
    kinds = [e.type for e in events]
    assert "tool_calls.function.arguments.delta" in kinds and kinds.count("tool_calls.function.arguments.done") == 1
    done = next(e for e in events if e.type == "tool_calls.function.arguments.done")
    assert done.name == "User" and done.index == 0 and isinstance(done.parsed_arguments, User)
    deltas = "".join(e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta")
    assert deltas == done.arguments
    c = final.choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    (call,) = c.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "User"
    assert isinstance(call.function.parsed_arguments, User) and call.function.parsed_arguments.name
    assert json.loads(call.function.arguments) == call.function.parsed_arguments.model_dump()


def test_a_tool_message_must_answer_an_earlier_call(server, client):
    """A tool message whose tool_call_id names no earlier call gets 400 naming it, as from OpenAI."""
    model = _model(server)
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "4 C, rain"},
            {"role": "tool", "tool_call_id": "call_x", "content": "sunny"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER], max_tokens=4)
    err = info.value.body
    assert err["param"] == "messages.3.tool_call_id" and "'call_x'" in err["message"], err
    answered = client.chat.completions.create(model=model, messages=msgs[:3], tools=[WEATHER], max_tokens=4)
    assert answered.choices[0].finish_reason in ("stop", "length", "tool_calls")


class Ticket(BaseModel):  # Pydantic's schema as instructor's TOOLS mode sends it: no additionalProperties
    title: str = Field(max_length=40)
    priority: int = Field(ge=1, le=5)


def test_tool_parameters_hold_only_their_declared_properties(server, client):
    """A forced call of a tool whose parameters do not say additionalProperties: only the declared keys
    (as response_format's schemas), so the model cannot fill max_tokens with invented ones."""
    tool = {"type": "function", "function": {"name": "Ticket", "parameters": Ticket.model_json_schema()}}
    for seed in range(4):
        finish, calls = _calls_of(client, _model(server), seed % 2 == 1, tools=[tool], tool_choice="required",
                                  messages=[{"role": "user", "content": "File a ticket: the printer on floor 3 "
                                             "is jammed again, fairly urgent."}],
                                  max_tokens=120, temperature=0.8, seed=seed)
        assert finish == "tool_calls" and calls, (seed, finish, calls)
        for _, arguments in calls:
            assert set(json.loads(arguments)) <= {"title", "priority"}, arguments
            Ticket.model_validate_json(arguments)


TIME_PARAMS = TIME["function"]["parameters"]
ANSWER = {"type": "json_schema", "json_schema": {"name": "final_output", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"type": "string", "maxLength": 60}},
    "required": ["answer"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_forced_call_beside_a_response_format_is_a_call(server, client, stream):
    """What the Agents SDK sends for an agent with tools, tool_choice="required" and an output_type:
    accepted; the turn is the call (the response format is for a text answer, which a forced turn has none of)."""
    finish, calls = _calls_of(client, _model(server), stream, tools=[TIME], tool_choice="required",
                              response_format=ANSWER, max_tokens=120, temperature=0,
                              messages=[{"role": "user", "content": "What time is it in Lima?"}])
    assert finish == "tool_calls" and [n for n, _ in calls] == ["get_time"] * len(calls) and calls
    jsonschema.validate(json.loads(calls[0][1]), TIME_PARAMS)


def test_auto_tools_beside_a_response_format_call_or_answer_in_it(server, client):
    """tool_choice auto with a JSON response_format: each reply is calls (valid) or an answer valid under
    the format, never free text; a regex beside auto tools is a 400 naming it."""
    model = _model(server)
    prompts = ["What time is it in Lima?", "Say hello in French.", "Get the time in Oslo, please.",
               "What is the capital of Peru?"]
    for i, text in enumerate(prompts):
        c = client.chat.completions.create(model=model, tools=[TIME], response_format=ANSWER, max_tokens=80,
                                           temperature=0.7, seed=i, messages=[{"role": "user", "content": text}]
                                           ).choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and not (c.message.content or "").strip()
            for t in c.message.tool_calls:
                assert t.function.name == "get_time"
                jsonschema.validate(json.loads(t.function.arguments), TIME_PARAMS)
        elif c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), ANSWER["json_schema"]["schema"])
        else:
            assert c.finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, tools=[TIME], max_tokens=4, extra_body={"guided_regex": "a+"},
                                       messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["param"] == "guided_regex" and "tool_choice 'auto'" in info.value.body["message"]


def test_a_turn_after_tool_results_answers_in_the_response_format(server, client):
    """An agent's last step (tools offered under auto, the conversation ending with their results, a JSON
    response_format): the answer, in the format, whole or streamed; no call of the same tool again, and
    an answer whose "name" is a function's name is still the answer, not a call."""
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Lima"}'}}]
    msgs = [{"role": "user", "content": "What time is it in Lima?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "10:42"}]
    named = {"type": "json_schema", "json_schema": {"name": "final", "schema": {
        "type": "object", "properties": {"name": {"const": "get_time"}, "time": {"type": "string", "maxLength": 8}},
        "required": ["name", "time"]}}}
    for fmt in (ANSWER, named):
        kw = dict(model=_model(server), tools=[TIME], response_format=fmt, max_tokens=60, temperature=0, messages=msgs)
        c = client.chat.completions.create(**kw).choices[0]
        assert not c.message.tool_calls and c.finish_reason in ("stop", "length"), c
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), fmt["json_schema"]["schema"])
        text, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                assert not ch.delta.tool_calls
                text, finish = text + (ch.delta.content or ""), ch.finish_reason or finish
        assert (text, finish) == (c.message.content, c.finish_reason)
