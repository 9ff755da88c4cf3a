"""Anthropic's Messages API on `kvcache serve`: the body's translation into the chat pipeline and the
reply's back (pure functions, quick), then the real ``anthropic`` SDK against a real server on the
bundled model (slow: create, stream, tools, count_tokens, keys, refusals)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from kvcache.server.anthropic_api import (EventStream, anthropic_words, error_reply, message_reply, stream_error,
                                          tool_use_id)
from kvcache.server.anthropic_request import chat_body
from kvcache.server.auth import Auth
from kvcache.server.protocol import ApiError

WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}}


def body(**fields) -> dict:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}


def refused(b: dict, count: bool = False) -> str:
    with pytest.raises(ApiError) as e:
        chat_body(b, count)
    assert e.value.status == 400
    return e.value.body["error"]["message"]


# --- the body's translation ---------------------------------------------------------------------


def test_a_plain_body_becomes_the_chat_body_of_the_same_request():
    out = chat_body(body(system="Be brief.", temperature=0, top_p=0.9, top_k=5, stop_sequences=["END"],
                         metadata={"user_id": "u1"}, cache_control={"type": "ephemeral"}))
    assert out == {"model": "m", "max_tokens": 8, "temperature": 0, "top_p": 0.9, "top_k": 5, "stop": ["END"],
                   "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}
    streamed = chat_body(body(stream=True))
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}


def test_system_blocks_and_text_blocks_become_text_parts():
    out = chat_body(body(system=[{"type": "text", "text": "You are "}, {"type": "text", "text": "terse.",
                                                                          "cache_control": {"type": "ephemeral"}}],
                         messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]))
    assert out["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]


def test_tool_use_and_tool_result_blocks_become_tool_calls_and_tool_messages():
    msgs = [{"role": "user", "content": "Weather in Oslo and the time?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Oslo"}},
                                              {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                                         {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                          "content": [{"type": "text", "text": "no clock"}]},
                                         {"type": "text", "text": "Thanks."}]}]
    out = chat_body(body(messages=msgs, tools=[WEATHER, TIME]))
    assert out["messages"][1:] == [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no clock"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}]}]
    assert out["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"],
                                          "description": "The weather of a city"}},
        {"type": "function", "function": {"name": "get_time", "parameters": TIME["input_schema"]}}]


@pytest.mark.parametrize("choice, want", [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
     {"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "parallel_tool_calls": False}),
    ({"type": "any", "disable_parallel_tool_use": False}, {"tool_choice": "required", "parallel_tool_calls": True}),
])
def test_tool_choice_becomes_openais(choice, want):
    out = chat_body(body(tools=[WEATHER, TIME], tool_choice=choice))
    assert {k: out[k] for k in ("tool_choice", "parallel_tool_calls") if k in out} == want


def test_output_config_format_is_a_json_schema_response_format_and_effort_is_ignored():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    out = chat_body(body(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"}))
    assert out["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def test_count_tokens_bodies_take_no_sampling_fields():
    out = chat_body({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}, count=True)
    assert out["max_tokens"] == 1 and out["tools"][0]["function"]["name"] == "get_weather"
    assert "max_tokens: unknown field for count_tokens" in refused(body(), count=True)


@pytest.mark.parametrize("fields, named", [
    ({"max_tokens": None}, "max_tokens: field required"),
    ({"max_tokens": 0}, "max_tokens: must be at least 1"),
    ({"max_tokens": True}, "max_tokens: must be an integer"),
    ({"temperature": 1.5}, "temperature: must be between 0 and 1"),
    ({"top_p": 0}, "top_p: must be greater than 0"),
    ({"stop_sequences": ["ok", ""]}, "stop_sequences.1: must be a non-empty string"),
    ({"stream": "yes"}, "stream: must be a boolean"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking: "),
    ({"service_tier": "priority"}, "service_tier: "),
    ({"container": "c1"}, "container: "),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers: "),
    ({"speed": "fast"}, "speed: "),
    ({"frobnicate": 1}, "frobnicate: unknown field"),
    ({"model": ""}, "model: "),
    ({"messages": []}, "messages: must be a non-empty list"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type: 'image'"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "x"}]}, {"role": "user", "content": "b"}]},
     "messages.1.content.0.type: 'redacted_thinking'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": 3, "signature": "s"}]}, {"role": "user", "content": "b"}]},
     "messages.1.content.0.thinking: must be a string"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "The answer is"}]},
     "messages.1: a final assistant turn"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]},
     "messages.0.content.0.tool_use_id: 'toolu_9' matches no tool_use"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0.content.0.type: a user turn holds text and tool_result blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": [{"x": 1}]}]}]},
     "messages.0.content.0.citations"),
    ({"messages": [{"role": "tool", "content": "a"}]}, "messages.0.role"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type: 'web_search_20250305' is a server tool"),
    ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema: a JSON Schema object is required"),
    ({"tools": [dict(WEATHER, input_examples=[{}])]}, "tools.0.input_examples"),
    ({"tool_choice": {"type": "any"}}, "tool_choice: type 'any' needs tools"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice: "),
    ({"tools": [WEATHER], "tool_choice": {"type": "auto", "disable_parallel_tool_use": "no"}},
     "tool_choice.disable_parallel_tool_use: must be a boolean"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format: "),
])
def test_what_kvcache_cannot_honour_is_a_400_naming_the_field(fields, named):
    b = body()
    for k, v in fields.items():
        if v is None:
            b.pop(k)
        else:
            b[k] = v
    assert named in refused(b)


def test_openai_field_names_in_refusals_are_put_in_anthropic_words():
    assert anthropic_words("tools.1.function.parameters is not valid") == "tools.1.input_schema is not valid"
    assert anthropic_words("tool_choice.function.name 'x' is not one of the tools") == \
        "tool_choice.name 'x' is not one of the tools"
    assert anthropic_words("stop has 17 strings, over the limit of 16") == "stop_sequences has 17 strings, over the limit of 16"


# --- the reply's translation --------------------------------------------------------------------


def openai_reply(content, calls=None, finish="stop", prompt=10, completion=4, cached=0) -> dict:
    msg = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}}}


def test_a_text_reply_is_a_message_with_anthropics_usage():
    out = message_reply(openai_reply("Hello.", cached=6), "msg_1", None)
    assert out == {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                   "content": [{"type": "text", "text": "Hello."}], "stop_reason": "end_turn", "stop_sequence": None,
                   "usage": {"input_tokens": 4, "output_tokens": 4, "cache_read_input_tokens": 6,
                             "cache_creation_input_tokens": 0}}
    assert message_reply(openai_reply("Hel", finish="length"), "m", None)["stop_reason"] == "max_tokens"
    stopped = message_reply(openai_reply("Hel"), "m", "lo")
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "lo"
    assert message_reply(openai_reply(""), "m", None)["content"] == [{"type": "text", "text": ""}]


def test_tool_calls_become_tool_use_blocks_after_the_text():
    calls = [{"id": "call_ab12", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "call_cd34", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "U'}}]
    out = message_reply(openai_reply(None, calls, "tool_calls"), "m", None)
    assert out["content"] == [{"type": "tool_use", "id": "toolu_ab12", "name": "get_weather", "input": {"city": "Oslo"}},
                              {"type": "tool_use", "id": "toolu_cd34", "name": "get_time", "input": {}}]
    assert out["stop_reason"] == "tool_use"
    assert [b["type"] for b in message_reply(openai_reply("Sure.", calls[:1], "tool_calls"), "m", None)["content"]] == \
        ["text", "tool_use"]


def chunk(content=None, calls=None, finish=None, role=False) -> dict:
    delta = {**({"content": content} if content is not None else {}), **({"tool_calls": calls} if calls else {}),
             **({"role": "assistant"} if role else {})}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


class _Req:  # what EventStream reads of the engine request before the first event
    prompt_ids = list(range(12))
    cached_tokens = 4


def events_of(chunks: list[dict], stop: str | None = None) -> list[tuple[str, dict]]:
    es = EventStream("msg_1", "m", _Req())  # type: ignore[arg-type]
    out = [e for c in chunks for e in es.feed(c)]
    return out + es.end(stop)


USAGE = {"object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}}


def test_chunks_become_anthropics_events_in_order():
    evs = events_of([chunk("", role=True), chunk("Hel"), chunk("lo"), chunk(None, finish="stop"), USAGE])
    assert [n for n, _ in evs] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                   "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(d["type"] == n for n, d in evs)
    start = evs[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] == 8 and start["usage"]["cache_read_input_tokens"] == 4
    assert [d["delta"] for n, d in evs if n == "content_block_delta"] == [{"type": "text_delta", "text": "Hel"},
                                                                         {"type": "text_delta", "text": "lo"}]
    assert evs[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert evs[-2][1]["usage"] == {"input_tokens": 8, "output_tokens": 3, "cache_read_input_tokens": 4,
                                   "cache_creation_input_tokens": 0}


def test_streamed_calls_become_tool_use_blocks_with_input_json_deltas():
    head = {"index": 0, "id": "call_77", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    evs = events_of([chunk("", role=True), chunk(calls=[head]),
                     chunk(calls=[{"index": 0, "function": {"arguments": '{"city": '}}]),
                     chunk(calls=[{"index": 0, "function": {"arguments": '"Oslo"}'}}]),
                     chunk(None, finish="tool_calls"), USAGE])
    starts = [d for n, d in evs if n == "content_block_start"]
    assert starts == [{"type": "content_block_start", "index": 0, "content_block": {
        "type": "tool_use", "id": "toolu_77", "name": "get_weather", "input": {}}}]
    pieces = [d["delta"]["partial_json"] for n, d in evs if n == "content_block_delta"]
    assert json.loads("".join(pieces)) == {"city": "Oslo"}
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_stream_with_no_text_still_has_one_text_block_and_a_stop_sequence():
    evs = events_of([chunk("", role=True), chunk(None, finish="stop"), USAGE], stop="END")
    assert [n for n, _ in evs][2:5] == ["content_block_start", "content_block_stop", "message_delta"]
    assert evs[4][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_an_error_mid_stream_is_an_error_event_of_anthropics_type():
    full = {"error": {"message": "the KV pool is full", "type": "server_error", "param": None, "code": "kv_cache_full"}}
    assert stream_error(full) == {"type": "error", "error": {"type": "overloaded_error", "message": "the KV pool is full"}}
    es = EventStream("msg_1", "m", _Req())  # type: ignore[arg-type]
    assert es.feed(full) == [("error", stream_error(full))]
    fault = {"error": {"message": "internal error: X", "type": "server_error", "param": None, "code": None}}
    assert stream_error(fault)["error"]["type"] == "api_error"


def test_http_errors_get_anthropics_types_and_a_full_pool_is_529_overloaded():
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
                         (404, "not_found_error"), (413, "request_too_large"), (500, "api_error")):
        reply = error_reply(status, "x")
        assert reply.status_code == status and json.loads(reply.body)["error"]["type"] == kind
    full = error_reply(503, "the KV pool is full")
    assert full.status_code == 529 and json.loads(full.body) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "the KV pool is full"}}
    assert tool_use_id("call_abc") == "toolu_abc"


def test_x_api_key_names_the_same_tenant_as_bearer():
    auth = Auth(["alpha", "beta"], ["root"])
    assert auth.caller(None, "alpha") == auth.caller("Bearer alpha") and auth.caller(None, "alpha").salt
    assert auth.caller(None, "beta").salt != auth.caller(None, "alpha").salt
    assert auth.caller(None, "root").admin and not auth.caller(None, "alpha").admin
    assert auth.caller("Bearer alpha", "alpha") == auth.caller("Bearer alpha")
    for bad in (("Bearer alpha", "beta"), (None, "gamma"), (None, ""), ("Bearer gamma", "alpha"), (None, None)):
        assert auth.caller(*bad) is None, bad
    assert Auth().caller(None, None).admin


# --- the real SDK on a real server (slow) -------------------------------------------------------

KEY, OTHER = "alpha-key", "beta-key"
T0 = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    from test_server import Server

    from kvcache.models.bundled import default_gguf

    s = Server(str(default_gguf()), "--api-key", KEY, "--api-key", OTHER)
    s.model = s.client(KEY).models.list().data[0].id
    yield s
    s.close()


@pytest.fixture(scope="module")
def anthropic():
    return pytest.importorskip("anthropic", reason="the Messages API tests need the anthropic SDK (kvcache[clients])")


def client(anthropic, server, key: str | None = KEY, token: str | None = None):
    return anthropic.Anthropic(base_url=server.base, api_key=key, auth_token=token, max_retries=0, timeout=120)


def raw_post(server, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    req = urllib.request.Request(server.base + path, data=data, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def check_input(tool_input: dict) -> None:
    import jsonschema

    jsonschema.validate(tool_input, WEATHER["input_schema"])


FRUITS = [{"role": "user", "content": "Name three fruits."}]


class TestSDK:
    """The real `anthropic` SDK against `kvcache serve` (one server for the module)."""

    def test_create_gives_text_and_usage_that_count_tokens_agrees_with(self, anthropic, server):
        c = client(anthropic, server)
        msg = c.messages.create(model=server.model, max_tokens=24, messages=FRUITS, extra_body=T0)
        assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
        assert [b.type for b in msg.content] == ["text"] and msg.content[0].text.strip()
        assert msg.stop_reason in ("end_turn", "max_tokens") and 1 <= msg.usage.output_tokens <= 24
        counted = c.messages.count_tokens(model=server.model, messages=FRUITS).input_tokens
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == counted > 10

    def test_system_blocks_mean_the_system_string(self, anthropic, server):
        c = client(anthropic, server)
        blocks = [{"type": "text", "text": "You answer in "}, {"type": "text", "text": "one word."}]
        by_blocks = c.messages.create(model=server.model, max_tokens=12, system=blocks, messages=FRUITS, extra_body=T0)
        by_text = c.messages.create(model=server.model, max_tokens=12, system="You answer in one word.", messages=FRUITS,
                                    extra_body=T0)
        plain = c.messages.create(model=server.model, max_tokens=12, messages=FRUITS, extra_body=T0)
        assert by_blocks.content[0].text == by_text.content[0].text
        counts = [c.messages.count_tokens(model=server.model, messages=FRUITS, **kw).input_tokens
                  for kw in ({"system": blocks}, {"system": "You answer in one word."}, {})]
        assert counts[0] == counts[1] != counts[2]
        assert by_text.usage.input_tokens + by_text.usage.cache_read_input_tokens == counts[1]
        assert plain.usage.input_tokens + plain.usage.cache_read_input_tokens == counts[2]

    def test_stop_sequences_cut_the_text_and_say_which_stopped_it(self, anthropic, server):
        c = client(anthropic, server)
        whole = c.messages.create(model=server.model, max_tokens=24, messages=FRUITS, extra_body=T0).content[0].text
        words = whole.split()
        assert len(words) >= 3, whole
        stop = words[len(words) // 2]
        cut = c.messages.create(model=server.model, max_tokens=24, messages=FRUITS, extra_body=T0,
                                stop_sequences=["zzqx", stop])
        assert cut.content[0].text == whole[:whole.index(stop)]
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        with c.messages.stream(model=server.model, max_tokens=24, messages=FRUITS, extra_body=T0,
                               stop_sequences=[stop]) as s:
            final = s.get_final_message()
        assert final.content[0].text == cut.content[0].text
        assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop

    def test_a_stream_gives_the_text_of_create_and_anthropics_events(self, anthropic, server):
        c = client(anthropic, server)
        kw = dict(model=server.model, max_tokens=20, messages=FRUITS, extra_body=T0)
        plain = c.messages.create(**kw)
        with c.messages.stream(**kw) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        assert text == plain.content[0].text == final.content[0].text
        assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
            plain.usage.input_tokens + plain.usage.cache_read_input_tokens
        status, raw = raw_post(server, "/v1/messages", json.dumps({**kw.pop("extra_body"), **kw, "stream": True}).encode(),
                               {"x-api-key": KEY})
        assert status == 200
        frames = [f for f in raw.decode().split("\n\n") if f.strip()]
        names = []
        for f in frames:
            event, data = f.split("\n")
            assert event.startswith("event: ") and data.startswith("data: ")
            names.append(event[7:])
            assert json.loads(data[6:])["type"] == names[-1]
        assert names[:3] == ["message_start", "ping", "content_block_start"]
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]

    def test_a_forced_tool_call_and_its_result_sent_back(self, anthropic, server):
        c = client(anthropic, server)
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        msg = c.messages.create(model=server.model, max_tokens=48, tools=[WEATHER, TIME], messages=ask, extra_body=T0,
                                tool_choice={"type": "tool", "name": "get_weather"})
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and len(uses) >= 1 and uses[0].name == "get_weather"
        assert uses[0].id.startswith("toolu_")
        check_input(uses[0].input)
        counted = c.messages.count_tokens(model=server.model, messages=ask, tools=[WEATHER, TIME],
                                          tool_choice={"type": "tool", "name": "get_weather"}).input_tokens
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == counted
        assert counted > c.messages.count_tokens(model=server.model, messages=ask).input_tokens
        results = [{"type": "tool_result", "tool_use_id": u.id, "content": "Sunny, 21 C"} for u in uses]
        answer = c.messages.create(model=server.model, max_tokens=24, tools=[WEATHER, TIME], extra_body=T0,
                                   messages=[*ask, {"role": "assistant", "content": msg.content},
                                             {"role": "user", "content": results}])
        assert answer.content[0].type == "text" and answer.content[0].text.strip()
        assert answer.stop_reason in ("end_turn", "max_tokens")
        failed = [dict(r, is_error=True, content=[{"type": "text", "text": "service down"}]) for r in results]
        again = c.messages.create(model=server.model, max_tokens=8, tools=[WEATHER, TIME], extra_body=T0,
                                  messages=[*ask, {"role": "assistant", "content": msg.content},
                                            {"role": "user", "content": failed}])
        assert again.content[0].type == "text"

    def test_a_streamed_tool_call_assembles_to_valid_json(self, anthropic, server):
        c = client(anthropic, server)
        pieces: list[str] = []
        with c.messages.stream(model=server.model, max_tokens=48, tools=[WEATHER, TIME], extra_body=T0,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               messages=[{"role": "user", "content": "Weather in Lyon?"}]) as s:
            for ev in s:
                if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                    pieces.append(ev.delta.partial_json)
            final = s.get_final_message()
        uses = [b for b in final.content if b.type == "tool_use"]
        assert final.stop_reason == "tool_use" and len(uses) == 1 and len(pieces) >= 1
        assert json.loads("".join(pieces)) == uses[0].input
        if uses[0].name == "get_weather":
            check_input(uses[0].input)

    def test_x_api_key_and_bearer_are_one_tenant_and_no_key_is_a_401(self, anthropic, server):
        for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": KEY, "Authorization": f"Bearer {OTHER}"}):
            status, raw = raw_post(server, "/v1/messages", json.dumps(body(model=server.model)).encode(), headers)
            assert status == 401, headers
            err = json.loads(raw)
            assert err["type"] == "error" and err["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            client(anthropic, server, key="wrong").messages.create(model=server.model, max_tokens=4, messages=FRUITS)
        ask = [{"role": "user", "content": "Count from one to five in French, then in German, then in Spanish."}]
        first = client(anthropic, server).messages.create(model=server.model, max_tokens=2, messages=ask, extra_body=T0)
        bearer = client(anthropic, server, key=None, token=KEY).messages.create(model=server.model, max_tokens=2,
                                                                                messages=ask, extra_body=T0)
        other = client(anthropic, server, key=OTHER).messages.create(model=server.model, max_tokens=2, messages=ask,
                                                                     extra_body=T0)
        total = first.usage.input_tokens + first.usage.cache_read_input_tokens
        reused = bearer.usage.cache_read_input_tokens  # the same tenant: its own prompt's pages reused
        assert reused > max(first.usage.cache_read_input_tokens, total // 2), (reused, first.usage, total)
        assert other.usage.cache_read_input_tokens == 0 and other.usage.input_tokens == total  # salted apart

    def test_refusals_over_http_are_in_anthropics_shape(self, anthropic, server):
        c = client(anthropic, server)
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model=server.model, max_tokens=8, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert "messages.0.content.0.type" in e.value.body["error"]["message"]
        with pytest.raises(anthropic.BadRequestError, match="thinking"):
            c.messages.create(model=server.model, max_tokens=8, messages=FRUITS, thinking={"type": "adaptive"})
        with pytest.raises(anthropic.NotFoundError) as e:
            c.messages.create(model="no-such-model", max_tokens=8, messages=FRUITS)
        assert e.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
            c.messages.create(model=server.model, max_tokens=10_000_000, messages=FRUITS)
        with pytest.raises(anthropic.BadRequestError, match=r"tools\.0\.input_schema"):
            c.messages.create(model=server.model, max_tokens=8, messages=FRUITS,
                              tools=[{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": 5}}}}])
        status, raw = raw_post(server, "/v1/messages", b"{not json", {"x-api-key": KEY})
        assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"

    def test_a_bad_request_beside_a_running_one_leaves_it_alone(self, anthropic, server):
        c = client(anthropic, server)
        kw = dict(model=server.model, max_tokens=32, messages=[{"role": "user", "content": "Describe the sea."}],
                  extra_body=T0)
        alone = c.messages.create(**kw).content[0].text
        got: dict[str, object] = {}
        flowing = threading.Event()

        def healthy() -> None:
            pieces = []
            with c.messages.stream(**kw) as s:
                for piece in s.text_stream:
                    pieces.append(piece)
                    flowing.set()
                got["text"] = "".join(pieces)
                got["final"] = s.get_final_message()
            flowing.set()

        t = threading.Thread(target=healthy)
        t.start()
        assert flowing.wait(60)
        bad = [json.dumps(body(model=server.model, thinking={"type": "enabled", "budget_tokens": 2000})).encode(),
               json.dumps(body(model=server.model, max_tokens=10_000_000)).encode(), b"[1, 2", b"{}"]
        for i in range(8):
            status, raw = raw_post(server, "/v1/messages", bad[i % len(bad)], {"x-api-key": KEY})
            assert status == 400 and json.loads(raw)["type"] == "error"
        t.join(120)
        assert not t.is_alive() and got["text"] == alone and got["final"].stop_reason in ("end_turn", "max_tokens")  # type: ignore[union-attr]

    def test_parse_with_an_output_format_gives_the_pydantic_object(self, anthropic, server):
        from pydantic import BaseModel

        class City(BaseModel):
            name: str
            country: str

        c = client(anthropic, server)
        msg = c.messages.parse(model=server.model, max_tokens=40, output_format=City, extra_body=T0,
                               messages=[{"role": "user", "content": "Give the capital of France as JSON."}])
        assert msg.stop_reason == "end_turn" and isinstance(msg.parsed_output, City), msg
