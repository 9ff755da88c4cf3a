"""instructor (``instructor.from_openai``) in the modes a local server is used with. TOOLS,
TOOLS_STRICT and JSON_SCHEMA constrain the answer on the server (a forced tool or a json_schema
response_format), so every answer must parse into the response model on the first attempt
(``max_retries=0``: a retry would hide what the server sent). JSON (json_object plus the schema in
a system message) and MD_JSON (no constraint at all, a fenced block asked for in the prompt) leave
the shape to the model: their success is a rate that is recorded, not asserted."""

from __future__ import annotations

import pytest
from client_server import need
from client_shapes import CITY_QUESTION, MAX_TOKENS, RATE_MAX_TOKENS, RATE_PROMPTS, SHAPES, City, Person
from pydantic import ValidationError

PROMPTS = {City: CITY_QUESTION, **{m: p for m, p in SHAPES}}
MODELS = [City, Person]


def _client(openai_client, mode: str):
    instructor = need("instructor")
    return instructor.from_openai(openai_client, mode=getattr(instructor.Mode, mode))


@pytest.mark.parametrize("model", MODELS, ids=[m.__name__ for m in MODELS])
@pytest.mark.parametrize("mode", ["TOOLS", "TOOLS_STRICT", "JSON_SCHEMA"])
def test_constrained_modes_parse_first_time(server, openai_client, wire, mode, model):
    client = _client(openai_client, mode)
    with wire.explains():
        got = client.chat.completions.create(model=server.model, response_model=model, max_retries=0,
                                             messages=[{"role": "user", "content": PROMPTS[model]}],
                                             max_tokens=MAX_TOKENS, temperature=0)
    assert isinstance(got, model)
    (sent,) = wire.chats()
    if mode == "JSON_SCHEMA":
        assert sent.request["response_format"]["type"] == "json_schema"
    else:
        assert sent.request["tool_choice"]["function"]["name"] == model.__name__
    wire.assert_owed()


@pytest.mark.parametrize("mode", ["JSON", "MD_JSON"])
def test_unconstrained_modes_rate(server, openai_client, wire, record_rate, mode):
    """The schema is only in the prompt: the server owes an accepted request and, for JSON
    (response_format json_object), a JSON object whenever the answer ended by itself."""
    errors = need("instructor.core")
    client, ok = _client(openai_client, mode), 0
    for prompt in RATE_PROMPTS:
        try:
            client.chat.completions.create(model=server.model, response_model=City, max_retries=0,
                                           messages=[{"role": "user", "content": prompt}],
                                           max_tokens=RATE_MAX_TOKENS, temperature=0)
            ok += 1
        except (errors.InstructorRetryException, errors.IncompleteOutputException, ValidationError, ValueError):
            pass
    sent = [e.request for e in wire.chats()]
    assert len(sent) == len(RATE_PROMPTS)
    if mode == "JSON":
        assert all(b["response_format"] == {"type": "json_object"} for b in sent)
    else:
        assert all("response_format" not in b for b in sent)
    wire.assert_owed(min_chats=len(RATE_PROMPTS))
    record_rate(ok, len(RATE_PROMPTS), f"instructor {mode} answers parsed into City "
                                       "(model quality: the schema is only in the prompt)")
