"""Constrained JSON holds the declared properties only, unless the schema asks for more.

``closed_schema`` on nested objects, ``$defs``/``$ref``, ``anyOf``, ``allOf``, arrays and the
explicit ways to allow more keys (checked with jsonschema: what the closed schema admits, and that
it still admits every instance made of declared keys); whitespace that a schema's ``x-guidance``
asks to be free is bounded; and on a real server with the bundled model, the schemas instructor and
OpenAI's client send (Pydantic's, without ``additionalProperties``) give only the declared keys
and end with "stop", on both endpoints, while ``additionalProperties: true`` and
``x-kvcache`` keep the open default."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
from pydantic import BaseModel

from kvcache.engine.grammar import Constraint, closed_schema
from kvcache.engine.nesting import MAX_DEPTH
from kvcache.engine.schema import WHITESPACE, bounded_whitespace
from kvcache.errors import InvalidParams
from test_server import Server, _model


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    age: int
    address: Address
    previous: Address | None = None


class User(BaseModel):
    name: str
    age: int


def _valid(schema: dict, instance: object) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_pydantic_schemas_are_closed_through_defs_refs_and_anyof():
    schema = Person.model_json_schema()
    before = copy.deepcopy(schema)
    closed = closed_schema(schema)
    assert schema == before  # the input is left as it is
    assert closed["additionalProperties"] is False and closed["$defs"]["Address"]["additionalProperties"] is False
    ok = {"name": "a", "age": 1, "address": {"street": "s", "city": "c"}, "previous": {"street": "t", "city": "d"}}
    assert _valid(schema, ok) and _valid(closed, ok)
    assert _valid(schema, {**ok, "zip": 1}) and not _valid(closed, {**ok, "zip": 1})
    assert not _valid(closed, {**ok, "address": {"street": "s", "city": "c", "zip": 1}})
    assert not _valid(closed, {**ok, "previous": {"street": "s", "city": "c", "zip": 1}})  # via anyOf and $ref


def test_nested_objects_items_and_tuples_are_closed():
    schema = {"type": "object", "properties": {
        "rows": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "pair": {"type": "array", "prefixItems": [{"type": "object", "properties": {"y": {}}}]},
        "old": {"type": "array", "items": [{"type": "object", "properties": {"z": {}}}]},
        "inner": {"type": "object", "properties": {"deeper": {"type": "object", "properties": {"w": {}}}}}}}
    closed = closed_schema(schema)
    good = {"rows": [{"x": 1}], "pair": [{"y": 1}], "inner": {"deeper": {"w": 0}}}
    assert _valid(closed, good)
    for bad in ({"rows": [{"x": 1, "q": 2}]}, {"pair": [{"y": 1, "q": 2}]}, {"inner": {"deeper": {"q": 1}}},
                {"inner": {"q": 1}}, {"q": 1}):
        assert _valid(schema, bad) and not _valid(closed, bad), bad
    assert closed["properties"]["old"]["items"][0]["additionalProperties"] is False  # draft 4-7 tuples


@pytest.mark.parametrize("opener", [{"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
                                    {"patternProperties": {"^x": {}}}, {"additionalProperties": False}])
def test_a_schema_that_says_how_other_keys_go_is_left_as_it_says(opener):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, **opener}
    assert closed_schema(schema) == schema


def test_free_form_objects_stay_free_and_required_names_are_declared():
    assert closed_schema({"type": "object"}) == {"type": "object"}  # dict / json_object: any keys
    closed = closed_schema({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]})
    assert _valid(closed, {"a": 1, "b": 2}) and not _valid(closed, {"a": 1, "b": 2, "c": 3})


def test_allof_parts_stay_open_so_their_keys_can_meet():
    schema = {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
              "allOf": [{"$ref": "#/$defs/Base"}, {"type": "object", "properties": {
                  "extra": {"type": "object", "properties": {"k": {}}}}, "required": ["extra"]}]}
    closed = closed_schema(schema)
    assert _valid(closed, {"id": 1, "extra": {"k": 1}})  # closing either part would refuse this
    assert not _valid(closed, {"id": 1, "extra": {"k": 1, "q": 2}})  # what nests inside is still closed
    single = closed_schema({"allOf": [{"type": "object", "properties": {"a": {}}}]})
    assert single["allOf"][0]["additionalProperties"] is False
    beside = {"$defs": schema["$defs"], "$ref": "#/$defs/Base", "properties": {"more": {}}}  # 2019-09: both apply
    assert _valid(closed_schema(beside), {"id": 1, "more": 2})


def test_never_inside_not():
    schema = {"not": {"type": "object", "properties": {"a": {}}}}
    assert closed_schema(schema) == schema


def test_x_kvcache_keeps_the_open_default_and_is_checked():
    schema = {"type": "object", "properties": {"a": {}}, "x-kvcache": {"additionalProperties": True}}
    assert closed_schema(schema) == {"type": "object", "properties": {"a": {}}}
    assert closed_schema({**schema, "x-kvcache": {"additionalProperties": False}})["additionalProperties"] is False
    for bad in ({"open": True}, {"additionalProperties": "yes"}, True):
        with pytest.raises(InvalidParams, match="x-kvcache must be"):
            closed_schema({**schema, "x-kvcache": bad})


def test_deep_schemas_are_refused_without_recursion():
    s: dict = {}
    for _ in range(5000):
        s = {"type": "object", "properties": {"a": s}}
    for make in (lambda: closed_schema(s), lambda: Constraint.json_schema(s),
                 lambda: Constraint.json_schema("[" * 100_000 + "]" * 100_000)):
        with pytest.raises(InvalidParams, match=f"nested deeper than {MAX_DEPTH} levels"):
            make()


def test_free_whitespace_asked_in_x_guidance_is_bounded():
    free = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    assert bounded_whitespace(free)["x-guidance"] == {"whitespace_flexible": True, "whitespace_pattern": WHITESPACE}
    own = {"type": "object", "x-guidance": {"whitespace_flexible": True, "whitespace_pattern": "[ ]?"}}
    assert bounded_whitespace(own) == own
    assert json.loads(Constraint.json_schema(free).text)["x-guidance"]["whitespace_pattern"] == WHITESPACE


def test_whitespace_is_bounded_in_the_compiled_grammar(smollm_q):
    """The matcher itself: a pretty-printed object passes, 30 blanks in a row do not."""
    tok = smollm_q.tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "x-guidance": {"whitespace_flexible": True}}

    def accepts(text: str) -> bool:
        m = smollm_q.grammars.compile(Constraint.json_schema(schema)).matcher()
        ids = tok.encode(text, add_special_tokens=False)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    assert accepts('{"a": 1}') and accepts('{\n  "a": 1\n}')
    assert not accepts('{' + " " * 30 + '"a": 1}') and not accepts('{"a": 1,\n  "b": 2}')


@pytest.fixture(scope="module")
def server():
    from kvcache.models.bundled import default_gguf

    s = Server(str(default_gguf()), "--max-running", "8")
    yield s
    s.close()


ASKS = [(User, "Extract the user: John is 30 years old and lives in Paris with his dog Rex."),
        (Person, "Extract: Maria, 41, lives at 5 Rue Cler in Paris. She likes tea and cats.")]


def _keys(value: object, out: set[str], at: str = "") -> set[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(at + k)
            _keys(v, out, at + k + ".")
    return out


@pytest.mark.parametrize("model,question", ASKS, ids=["User", "Person"])
def test_pydantic_schemas_without_additional_properties_give_declared_keys_only(server, model, question):
    """What instructor's JSON_SCHEMA mode sends: Pydantic's schema as it is (it rambled on with
    "location", "occupation", "family"... before)."""
    client, name = server.client(), _model(server)
    declared = {"name", "age", "address", "address.street", "address.city", "previous", "previous.street",
                "previous.city"}
    schema = model.model_json_schema()
    for temperature in (0.0, 0.7):
        done = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": question}], max_tokens=200, temperature=temperature,
            seed=1, response_format={"type": "json_schema", "json_schema": {"name": model.__name__, "schema": schema}})
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert _keys(model.model_validate_json(choice.message.content).model_dump(exclude_unset=True), set()) \
            <= declared and _keys(json.loads(choice.message.content), set()) <= declared, choice.message.content
    comp = client.completions.create(model=name, prompt=question + "\nJSON:", max_tokens=200, temperature=0,
                                     extra_body={"guided_json": schema}).choices[0]
    assert comp.finish_reason == "stop" and _keys(json.loads(comp.text), set()) <= declared, comp.text


def test_additional_properties_true_and_x_kvcache_keep_the_open_default(server):
    client, name = server.client(), _model(server)
    schema = User.model_json_schema()
    for open_schema in ({**schema, "additionalProperties": True},
                        {**schema, "x-kvcache": {"additionalProperties": True}}):
        done = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": ASKS[0][1]}], max_tokens=200, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "User", "schema": open_schema}})
        keys = set(json.loads(done.choices[0].message.content))
        assert {"name", "age"} <= keys and keys - {"name", "age"}, keys  # the model adds its own, as it may
