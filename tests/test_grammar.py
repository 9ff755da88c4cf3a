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


def test_an_open_pydantic_schema_gives_its_declared_keys_only(smollm_q):
    """Pydantic's schema says nothing of additionalProperties (as instructor sends it); the model
    wrote "location" and more until the schema was closed (engine/schema.py)."""
    user = {"properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"}},
            "required": ["name", "age"], "title": "User", "type": "object"}
    prompt = "Extract the user: John is 30 years old and lives in Paris with his dog Rex.\nJSON:"
    outs = _gen(smollm_q, [prompt] * 3, Constraint.json_schema(user), max_tokens=120)
    outs += _gen(smollm_q, [prompt] * 3, Constraint.json_schema(user), max_tokens=120, temperature=0.8, seed=3)
    for out in outs:
        assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"name", "age"}, out.text
    (free,) = _gen(smollm_q, [prompt], Constraint.json_schema({**user, "additionalProperties": True}), max_tokens=120)
    assert set(json.loads(free.text)) > {"name", "age"}, free.text  # explicitly open: the model may add keys


def test_deep_constraints_are_refused_by_name():
    for make, noun in ((lambda: Constraint.grammar("root ::= " + "(" * 65 + '"a"' + ")" * 65), "grammar"),
                       (lambda: Constraint.grammar("start: " + "[" * 65 + '"a"' + "]" * 65), "grammar"),
                       (lambda: Constraint.regex("(" * 65 + "a" + ")" * 65), "regex"),
                       (lambda: Constraint.json_schema({"default": json.loads("[" * 65 + "]" * 65)}), "JSON schema")):
        with pytest.raises(InvalidParams, match=f"the {noun} is nested deeper than 64 levels"):
            make()
    assert Constraint.grammar("root ::= " + "(" * 64 + '"a"' + ")" * 64).kind == "gbnf"


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


def _schemas() -> list[dict]:
    """Bounded schemas of several shapes (strings, integers, numbers, enums, arrays, nesting, optional
    fields): every text valid under them is short, so none is cut by max_tokens."""
    s = lambda n: {"type": "string", "maxLength": n}  # noqa: E731
    obj = lambda props, req=None: {"type": "object", "properties": props,  # noqa: E731
                                   "required": list(props) if req is None else req, "additionalProperties": False}
    return [
        PERSON,
        obj({"title": s(30), "author": s(20), "year": {"type": "integer", "minimum": 1400, "maximum": 2030}}),
        obj({"city": s(20), "country": s(20), "coastal": {"type": "boolean"}}),
        obj({"product": s(20), "price": {"type": "number", "minimum": 0, "maximum": 1000},
             "colour": {"enum": ["red", "green", "blue", "black"]}}),
        obj({"name": s(16), "address": obj({"street": s(24), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
        obj({"items": {"type": "array", "items": s(12), "minItems": 1, "maxItems": 4}}),
        obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}),
        obj({"event": s(24), "day": {"type": "integer", "minimum": 1, "maximum": 31}, "note": s(20)},
            req=["event", "day"]),
    ]


SUBJECTS = ["a famous scientist", "a city in Asia", "a new phone", "a river", "a painting", "a mountain", "a novel",
            "a football team", "a planet", "a bird", "a recipe", "a festival", "a car", "a programming language",
            "a volcano", "a composer", "an island", "a museum", "a bridge", "a spice", "a desert", "a poet",
            "a holiday", "a tree", "a fish"]


def test_two_hundred_varied_strict_outputs_all_validate(smollm_q):
    """200 requests (25 subjects x 8 schemas, sampled with their own seeds) in batches of 16: every
    one ends by itself and validates."""
    schemas = _schemas()
    jobs = [(f"Describe {subject} as JSON.", schema) for subject in SUBJECTS for schema in schemas]
    assert len(jobs) == 200
    for at in range(0, len(jobs), 16):
        part = jobs[at : at + 16]
        outs = smollm_q.generate_batch(
            [[{"role": "user", "content": q}] for q, _ in part],
            [SamplingParams(constraint=Constraint.json_schema(sch), max_tokens=160, temperature=0.7, seed=at + i)
             for i, (_, sch) in enumerate(part)], chat=True)
        for (q, sch), out in zip(part, outs):
            assert out.finish_reason == "stop", (q, out.text)
            jsonschema.validate(json.loads(out.text), sch)


def test_forced_tool_calls_all_validate(smollm_q):
    """tool_choice required (and a named function) over 48 varied requests: every call parses and
    its arguments validate against the function's schema."""
    from kvcache.server.tools import check_tools, parse_output, render, tool_grammar

    tools = [{"type": "function", "function": {"name": f"lookup_{i}", "description": d, "parameters": sch}}
             for i, (d, sch) in enumerate(zip(["Find a person.", "Find a book.", "Find a city.", "Find a product."],
                                              _schemas()[:4]))]
    jobs = []
    for i, subject in enumerate(SUBJECTS[:24]):
        for choice in ("required", {"type": "function", "function": {"name": f"lookup_{i % 4}"}}):
            spec = check_tools(tools, choice, False)
            msgs, extra = render([{"role": "user", "content": f"Look up {subject}."}], spec,
                                 smollm_q.tokenizer.chat_template)
            jobs.append((spec, smollm_q.tokenizer.encode_chat(msgs) if not extra else None,
                         Constraint("lark", tool_grammar(spec))))
    outs = smollm_q.generate_batch([ids for _, ids, _ in jobs],
                                   [SamplingParams(constraint=c, max_tokens=200, temperature=0.7, seed=i)
                                    for i, (_, _, c) in enumerate(jobs)])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for (spec, _, _), out in zip(jobs, outs):
        assert out.finish_reason == "stop", out.text
        content, calls = parse_output(out.text, spec)
        assert len(calls) == 1 and not content, out.text
        if spec.choice == "named":
            assert calls[0].name == spec.name
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])


def test_generate_flags(tmp_path):
    from conftest import run_kvcache

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
                                  "required": ["name"], "additionalProperties": False}))
    done = run_kvcache("generate", "A person as JSON:", "--json-schema", f"@{schema}", "--repetition-penalty", "1.1")
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout.strip().splitlines()[0])) == {"name"}
    bad = run_kvcache("generate", "x", "--regex", "(bad")
    assert bad.returncode != 0 and "regex cannot be used" in bad.stderr and "Traceback" not in bad.stderr
    both = run_kvcache("generate", "x", "--regex", "a", "--choice", "b")
    assert both.returncode != 0 and "not allowed with" in both.stderr


@pytest.mark.parametrize("constraint", [Constraint.json_schema(PERSON), Constraint.regex(r"[A-Z][a-z]+ \d{2,4}"),
                                        Constraint.grammar('root ::= "Answer: " ("yes" | "no") "."')],
                         ids=["schema", "regex", "gbnf"])
def test_masks_beside_the_forward_and_masks_on_refusal_give_the_same_text(smollm_q, constraint):
    """With a core to spare every step's masks are computed beside the forward; without one each
    choice is checked against its grammar and a mask is computed only where it is refused. The two
    give the same greedy tokens (where the grammar forces bytes, only the canonical first token
    passes the check), and the check spares most masks."""
    prompts = [f"Entry {i}: describe item {i} in the format asked." for i in range(8)]
    worker = smollm_q.grammars.worker()
    was = worker.spare_core
    outs, masks = {}, {}
    try:
        for spare in (True, False):
            worker.spare_core = spare
            before = worker.masks
            outs[spare] = smollm_q.generate_batch(prompts, SamplingParams(constraint=constraint, max_tokens=60))
            masks[spare] = worker.masks - before
    finally:
        worker.spare_core = was
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    tokens = sum(len(o.token_ids) for o in outs[True])
    assert masks[True] >= tokens and masks[False] < masks[True]


def test_sampling_on_refusal_keeps_the_masked_distribution(smollm_q):
    """Sampled rows without a spare core: a draw the grammar allows is kept, a refused one is drawn
    again under the mask (rejection sampling). The letters drawn match those drawn with every mask
    computed (two-sample chi-square over 1536 draws each); the bias makes both branches common (about 1200 refused, 350 kept)."""
    tok = smollm_q.tokenizer
    letters = "abcde"
    ids = {c: tok.encode(c, add_special_tokens=False)[0] for c in letters}
    bias = {ids["a"]: 12.0, ids["b"]: 11.0, ids["c"]: 9.0}
    worker = smollm_q.grammars.worker()
    was = worker.spare_core
    counts = {}
    try:
        for spare in (True, False):
            worker.spare_core = spare
            before = worker.masks
            outs = smollm_q.generate_batch(["Pick a letter:"] * 12, [
                SamplingParams(constraint=Constraint.regex("[a-e]"), temperature=1.5, seed=1000 * i + (7 if spare else 0),
                               n=128, max_tokens=2, logit_bias=bias) for i in range(12)])
            texts = [o.text for out in outs for o in out.outputs]
            assert set(texts) <= set(letters) and len(texts) == 1536
            counts[spare] = [texts.count(c) for c in letters]
            if not spare:
                refused = worker.masks - before
    finally:
        worker.spare_core = was
    assert 200 < refused < 1400, refused  # draws were kept and drawn again, both
    assert _chi2(counts[True], counts[False]) < 18.47, counts  # chi-square, 4 degrees of freedom: p > 0.001


def _chi2(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square statistic of two count vectors over the same categories."""
    na, nb = sum(a), sum(b)
    stat = 0.0
    for x, y in zip(a, b):
        col = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = col * n / (na + nb)
            stat += (obs - exp) ** 2 / exp if exp else 0.0
    return stat
