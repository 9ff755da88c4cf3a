"""Structures nested too deeply are refused up front, on a real server: a JSON schema (both
endpoints, response_format and guided_json, as an object or as JSON text), a grammar or regex of
nested parentheses, a tool's parameters, content parts and tool-call arguments each get a 400 of
one line naming the field, while streams beside them finish; the server's log holds no
traceback. The depth measures themselves, and the handler that turns a RecursionError raised
anyway into a 400 naming the body's deepest field."""

from __future__ import annotations

import json
import logging
import threading

import pytest
from fastapi import FastAPI, Request as HttpRequest
from fastapi.testclient import TestClient

from kvcache.engine.nesting import MAX_DEPTH, text_depth, value_depth
from kvcache.errors import InvalidParams
from kvcache.server.depth import check_depth, recursion_reply
from kvcache.server.intake import Limits, read_json
from kvcache.server.protocol import ApiError
from test_server import Server, _model


def _schema(levels: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def _nest(levels: int) -> object:
    x: object = "x"
    for _ in range(levels):
        x = [x]
    return x


def _rf(schema: object) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}}


USER = [{"role": "user", "content": "hi"}]
DEEP = [  # route, body fields, the field named
    ("chat", {"messages": USER, **_rf(_schema(200))}, "response_format.json_schema.schema"),
    ("completions", _rf(_schema(100)), "response_format.json_schema.schema"),
    ("completions", _rf(json.dumps(_schema(100))), "response_format.json_schema.schema"),
    ("completions", {"guided_json": _schema(200)}, "guided_json"),
    ("chat", {"messages": USER, "guided_json": json.dumps(_schema(100))}, "guided_json"),
    ("completions", {"guided_grammar": "root ::= " + "(" * 100 + '"a"' + ")" * 100}, "guided_grammar"),
    ("chat", {"messages": USER, "guided_grammar": "start: " + "(" * 100 + '"a"' + ")" * 100}, "guided_grammar"),
    ("completions", {"guided_regex": "(a|" * 100 + "b" + ")" * 100}, "guided_regex"),
    ("chat", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": _schema(70)}}]},
     "tools.0.function.parameters"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "meta": _nest(100)}]}]},
     "messages.0.content"),
    ("chat", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": json.dumps({"a": _nest(100)})}}]}, *USER]},
     "messages.0.tool_calls.0.function.arguments"),
    ("completions", {"metadata": {"k": _nest(100)}}, "metadata"),
]


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = Server(str(tiny_dir("llama")[0]), "--kv", "dynamic,page_size=4", "--max-batch-tokens", "32")
    s.log = []  # everything the server writes, read as it comes (a full pipe would stall it)
    threading.Thread(target=lambda: s.log.extend(s.proc.stdout), daemon=True).start()
    yield s
    s.close()


def test_deep_structures_get_400_naming_the_field_beside_healthy_streams(server):
    model, client = _model(server), server.client()
    texts: list[tuple[str, str | None]] = []

    def stream() -> None:
        text, finish = "", None
        for chunk in client.completions.create(model=model, prompt="t5 t6 t7", max_tokens=24, stream=True,
                                               temperature=0, extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        texts.append((text, finish))

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    for route, extra, field in DEEP:
        body = {"model": model, "max_tokens": 4, **({"prompt": "t5"} if route == "completions" else {}), **extra}
        code, err = server.post(f"/v1/{'chat/' if route == 'chat' else ''}completions", json.dumps(body).encode())
        assert code == 400, (field, err)
        assert err["error"] == {"message": f"{field} is nested deeper than {MAX_DEPTH} levels",
                                "type": "invalid_request_error", "param": field, "code": None}
    for t in threads:
        t.join()
    plain = client.completions.create(model=model, prompt="t5 t6 t7", max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert texts == [(plain, "length")] * 4
    log = "".join(server.log)
    assert "Traceback" not in log and "RecursionError" not in log, log[-3000:]


def test_structures_within_the_bound_are_served(server):
    model = _model(server)
    body = {"model": model, "prompt": "t5", "max_tokens": 2, "metadata": {"k": _nest(MAX_DEPTH - 1)},
            "messages_note": _nest(MAX_DEPTH), "ignore_eos": True}  # sampled: EOS could end it sooner
    code, reply = server.post("/v1/completions", json.dumps(body).encode())
    assert code == 200 and reply["choices"][0]["finish_reason"] == "length", reply


def test_depth_measures():
    assert value_depth("x") == 0 and value_depth([]) == 1 and value_depth({"a": [1, {"b": {}}]}) == 4
    assert value_depth(_nest(10_000), limit=64) == 65  # stops counting past the limit, never recurses
    assert value_depth(_nest(10_000)) == 10_000
    assert text_depth('{"a": "{[[", "b": [[]]}', "json") == 3  # brackets in strings do not count
    assert text_depth('root ::= ("(" [(] (x)) # ((((', "gbnf") == 2  # nor in classes and comments
    assert text_depth('start: /[/(]+/ ( "(" [x] ) // (((', "lark") == 2  # nor in regexes; [x] nests in Lark
    assert text_depth(r"\((a[(])(b)", "regex") == 1
    assert text_depth("(" * 5000, "regex") == 5000


def test_check_depth_names_the_field_and_reports_the_deepest():
    assert check_depth({"model": "m", "tools": [{"function": {"parameters": _nest(MAX_DEPTH)}}]}) == \
        ("tools.0.function.parameters", MAX_DEPTH)
    with pytest.raises(ApiError) as e:
        check_depth({"model": "m", "prediction": {"content": _nest(MAX_DEPTH + 1)}})
    assert e.value.status == 400 and e.value.body["error"]["param"] == "prediction.content"
    with pytest.raises(ApiError, match="n_deep is nested deeper"):
        check_depth({"n_deep": _nest(MAX_DEPTH + 1)})
    assert check_depth(5) is None and check_depth({"a": 1}) == ("the request body", 1)


def test_a_recursion_error_while_handling_a_request_is_a_400_naming_the_deepest_field(caplog):
    """The handler an app registers for RecursionError (server/app.py): a real RecursionError from a
    route, after read_json has measured the body."""
    app = FastAPI()
    app.add_exception_handler(RecursionError, recursion_reply)

    def down(n: int) -> int:
        return down(n + 1) + 1

    @app.post("/v1/completions")
    async def route(http: HttpRequest) -> dict:
        await read_json(http, Limits())
        return {"depth": down(0)}

    body = {"model": "m", "prompt": "t5", "guided_json": {"type": "object", "properties": {"a": {"type": "string"}}}}
    with caplog.at_level(logging.INFO), TestClient(app, raise_server_exceptions=False) as client:
        reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"] == {"message": "guided_json is nested too deeply to be handled",
                                     "type": "invalid_request_error", "param": "guided_json", "code": None}
    assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)
    assert "guided_json nested too deeply" in caplog.text


def test_schemas_are_bounded_in_schema_levels_not_json_levels():
    """A schema 40 objects deep is 81 JSON levels (each object's ``properties`` map is one): its 41
    schema levels are within the bound, in every field that holds a schema, and it compiles; 65
    schema levels are refused by name."""
    from kvcache.engine.grammar import Constraint
    from kvcache.engine.nesting import schema_depth

    assert schema_depth(_schema(40)) == 41 and value_depth(_schema(40)) == 81
    assert schema_depth({"anyOf": [{"type": "object", "properties": {"a": {"enum": [[["x"]]]}}}]}) == 6
    tool = {"type": "function", "function": {"name": "f", "parameters": _schema(40)}}
    for body in ({"tools": [tool]}, _rf(_schema(40)), _rf(json.dumps(_schema(40))), {"guided_json": _schema(40)},
                 {"response_format": {"type": "json_object", "schema": _schema(40)}}):
        assert check_depth({"model": "m", **body}) is not None
    Constraint.json_schema(_schema(40)).source()
    with pytest.raises(InvalidParams, match="nested deeper than 64 levels"):
        Constraint.json_schema(_schema(64))

