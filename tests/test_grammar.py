"""Structured outputs in the engine, on the bundled model: every constrained text is valid under its
constraint (jsonschema checks the JSON ones), a constraint is compiled once and cached by its hash,
bad or unsatisfiable ones are refused before any work, a cut text ends with "length", and the
matcher lives with the sample: forks (n > 1), preemption and prefix hits give the same text as a
run without them."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvcache.engine.grammar import MAX_CONSTRAINT_BYTES, Constraint
from kvcache.engine.params import SamplingParams
from kvcache.errors import InvalidParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def _gen(llm, prompts, constraint, **kw):
    kw.setdefault("max_tokens", 80)
    return llm.generate_batch(prompts, SamplingParams(constraint=constraint, **kw))


def test_json_schema_outputs_validate_in_a_batch_beside_free_requests(smollm_q):
    prompts = [f"Describe person number {i} as JSON:" for i in range(6)]
    c = Constraint.json_schema(PERSON)
    free = smollm_q.generate_batch(prompts[:2], SamplingParams(max_tokens=20))
    mixed = smollm_q.generate_batch(prompts + prompts[:2], [SamplingParams(constraint=c, max_tokens=80)] * 6
                                    + [SamplingParams(max_tokens=20)] * 2)
    for out in mixed[:6]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    # the free requests in the mixed batch get what they get alone
    assert [o.token_ids for o in mixed[6:]] == [o.token_ids for o in free]


def test_regex_choice_gbnf_and_lark(smollm_q):
    (phone,) = _gen(smollm_q, ["Call me at"], Constraint.regex(r"\(\d{3}\) \d{3}-\d{4}"))
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone.text) and phone.finish_reason == "stop"
    (pick,) = _gen(smollm_q, ["Is the sky blue?"], Constraint.choice(["yes", "no", "maybe"]))
    assert pick.text in ("yes", "no", "maybe")
    gbnf = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'
    (num,) = _gen(smollm_q, ["What is 2+2?"], Constraint.grammar(gbnf))
    assert re.fullmatch(r"The answer is \d\d?\.", num.text), num.text
    (lark,) = _gen(smollm_q, ["Colour:"], Constraint.grammar('start: ("red" | "green") " " NUM\nNUM: /[0-9]+/'),
                   max_tokens=12)
    assert re.fullmatch(r"(red|green) \d+", lark.text), lark.text


def test_any_json_object(smollm_q):
    (out,) = _gen(smollm_q, ["A JSON object about cats:"], Constraint.json_object(), max_tokens=120)
    assert out.finish_reason in ("stop", "length")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


def test_a_constraint_is_compiled_once(smollm_q):
    g = smollm_q.grammars
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"],
              "additionalProperties": False}
    before = g.stats()["compiled"]
    for _ in range(3):
        _gen(smollm_q, ["k:"], Constraint.json_schema(json.dumps(schema)), max_tokens=12)
    assert g.stats()["compiled"] == before + 1
    assert g.compile(Constraint.json_schema(schema)) is g.compile(Constraint.json_schema(json.dumps(schema)))


@pytest.mark.parametrize("make,words", [
    (lambda: Constraint.json_schema('{"type": '), "not valid JSON"),
    (lambda: Constraint.json_schema([1, 2]), "must be an object"),
    (lambda: Constraint.regex("(unclosed"), "regex cannot be used"),
    (lambda: Constraint.grammar("root ::= \"a\" undefined_rule"), "grammar"),
    (lambda: Constraint.grammar("start: foo"), "grammar cannot be used"),
    (lambda: Constraint.json_schema({"type": "integer", "minimum": 5, "maximum": 3}), "JSON schema"),
    (lambda: Constraint.json_schema({"type": "string", "pattern": "x" * (MAX_CONSTRAINT_BYTES + 1)}), "over the limit"),
    (lambda: Constraint.choice([]), "non-empty list"),
])
def test_bad_constraints_are_refused_before_any_work(smollm_q, make, words):
    with pytest.raises(InvalidParams, match=words) as e:
        smollm_q.grammars.compile(make())
    assert "\n" not in str(e.value)
    with pytest.raises(InvalidParams):  # through the Python API: refused at submission, nothing runs
        _gen(smollm_q, ["x"], make())


def test_a_cut_text_ends_with_length(smollm_q):
    (out,) = _gen(smollm_q, ["Describe a person as JSON:"], Constraint.json_schema(PERSON), max_tokens=5)
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_forked_samples_each_follow_the_constraint(smollm_q):
    (out,) = _gen(smollm_q, ["Describe a person as JSON:"], Constraint.json_schema(PERSON), n=4,
                  temperature=1.0, seed=7)
    texts = [o.text for o in out.outputs]
    for o in out.outputs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    assert len(set(texts)) > 1  # the forks sampled apart, each with its own matcher


def test_prefix_hit_and_preemption_give_the_same_constrained_text(tmp_path):
    from kvcache import LLM
    from kvcache.engine.scheduler import SchedulerConfig

    c = Constraint.json_schema(PERSON)
    prompts = [f"Describe person {i} of a long list of people, as JSON:" for i in range(4)]
    alone = LLM(prefix=False).generate_batch(prompts, SamplingParams(constraint=c, max_tokens=80))
    # a pool too small for all four at once: requests are preempted mid-text and resumed
    tight = LLM(kv="dynamic,page_size=4,budget=4MiB")
    runs = [tight.generate_batch(prompts, SamplingParams(constraint=c, max_tokens=80),
                                 scheduler=SchedulerConfig(max_batch_tokens=64, max_running=4)) for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in alone]
    assert [o.token_ids for o in runs[1]] == [o.token_ids for o in alone]
    assert all(o.cached_tokens > 0 for o in runs[1])  # the second run hit the prefix cache
    assert sum(o.metrics["preemptions"] for o in runs[0] + runs[1]) > 0
