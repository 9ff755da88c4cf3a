"""Tool calling: request checks, rendering for templates with and without tools, the forcing grammar
(checked with llguidance on a real tokenizer), and output parsing, whole and streamed in random chunks."""

from __future__ import annotations

import json
import random
import re
import warnings
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvcache.server.protocol import ApiError
from kvcache.server.tool_messages import check_messages
from kvcache.server.tools import (
    CLOSE,
    OPEN,
    ToolCall,
    ToolSpec,
    ToolStream,
    assemble,
    calls_text,
    check_tools,
    parse_output,
    render,
    tool_grammar,
    tools_prompt,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
ROUTE = {"type": "function", "function": {  # local $refs, which the grammar must rebase
    "name": "route",
    "parameters": {"type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}}, "required": ["to"],
                   "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}},
                                       "required": ["city"], "additionalProperties": False}}}}}
TOOLS = [WEATHER, TIME, ROUTE]

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
GEMMA = ("{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
         "{% set ns.system = m['content'] + '\n\n' %}{% else %}"
         "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}<start_of_turn>{{ role }}\n"
         "{% if loop.index0 == 1 or (loop.first and m['role'] != 'system') %}{{ ns.system }}{% endif %}"
         "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# a Hermes-style template that renders tools itself (the shape of Qwen2.5's)
HERMES = ("{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
          "\n</tools><|im_end|>\n{% endif %}{% for m in messages %}"
          "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
          "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
          "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
          "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
          "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def spec_of(tools: list[dict] = TOOLS, choice: object = None, parallel: object = None) -> ToolSpec:
    spec = check_tools(tools, choice, parallel)
    assert spec is not None
    return spec


def apply(template: str, messages: list[dict], **kwargs: object) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token="<bos>",
                                            **kwargs)


def api_error(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    err = info.value
    assert err.status == 400
    assert "\n" not in err.body["error"]["message"]
    return err


# --- check_tools ---------------------------------------------------------------------------------

def fn_tool(**function: object) -> dict:
    return {"type": "function", "function": {"name": "f", **function}}


BIG = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(700)}}


@pytest.mark.parametrize("tools, choice, parallel, param, words", [
    ("get_weather", None, None, "tools", "must be a list"),
    ([WEATHER] * 129, None, None, "tools", "at most 128"),
    ([1], None, None, "tools.0", "must be an object"),
    ([{"type": "fn", "function": {"name": "f"}}], None, None, "tools.0.type", "'function'"),
    ([{"type": "function"}], None, None, "tools.0.function", "must be an object"),
    ([fn_tool(name="bad name")], None, None, "tools.0.function.name", "must match"),
    ([fn_tool(name="x" * 65)], None, None, "tools.0.function.name", "must match"),
    ([fn_tool(name=7)], None, None, "tools.0.function.name", "must match"),
    ([fn_tool(description=3)], None, None, "tools.0.function.description", "must be a string"),
    ([fn_tool(parameters=[])], None, None, "tools.0.function.parameters", "JSON Schema object"),
    ([fn_tool(parameters={"type": "string"})], None, None, "tools.0.function.parameters", "describe an object"),
    ([fn_tool(parameters={"type": "object", "properties": {"a": {"type": 12}}})], None, None,
     "tools.0.function.parameters", "not a valid JSON Schema"),
    ([fn_tool(parameters={"type": "object", "required": "a"})], None, None,
     "tools.0.function.parameters", "not a valid JSON Schema"),
    ([fn_tool(parameters=BIG)], None, None, "tools.0.function.parameters", "at most 65536"),
    ([fn_tool(strict="yes")], None, None, "tools.0.function.strict", "boolean"),
    ([WEATHER, TIME, WEATHER], None, None, "tools.2.function.name", "earlier tool"),
    ([WEATHER], "sometimes", None, "tool_choice", "'none', 'auto', 'required'"),
    ([WEATHER], 3, None, "tool_choice", "must be a string or"),
    ([WEATHER], {"type": "function"}, None, "tool_choice", "must be a string or"),
    ([WEATHER], {"type": "function", "function": {"name": 3}}, None, "tool_choice.function.name", "string"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice.function.name",
     "not one of the tools"),
    (None, "required", None, "tool_choice", "needs tools"),
    ([], {"type": "function", "function": {"name": "f"}}, None, "tool_choice", "no tools"),
    ([WEATHER], None, "yes", "parallel_tool_calls", "boolean"),
])
def test_check_tools_refuses_with_400_naming_the_field(tools, choice, parallel, param, words):
    err = api_error(check_tools, tools, choice, parallel)
    assert err.body["error"]["param"] == param
    assert words in err.body["error"]["message"]


def test_check_tools_accepts_the_openai_forms():
    assert check_tools(None, None, None) is None
    assert check_tools([], "auto", None) is None
    assert check_tools(TOOLS, "none", False) is None
    auto = spec_of()
    assert (auto.choice, auto.name, auto.parallel) == ("auto", None, True)
    assert [f["name"] for f in auto.tools] == ["get_weather", "get_time", "route"]
    assert auto.tools[0] == WEATHER["function"]
    assert spec_of(choice="required", parallel=False) == ToolSpec(auto.tools, "required", None, False)
    named = spec_of(choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.choice, named.name) == ("named", "get_time")


def test_check_tools_keeps_only_function_fields_and_takes_any_known_schema_dialect():
    tool = fn_tool(description="d", strict=True, extra="dropped",
                   parameters={"$schema": "http://json-schema.org/draft-07/schema#", "type": "object"})
    unknown = fn_tool(parameters={"$schema": "https://example.com/my-dialect", "type": "object"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert spec_of([tool]).tools[0] == {k: v for k, v in tool["function"].items() if k != "extra"}
        spec_of([unknown])


# --- check_messages ------------------------------------------------------------------------------

def call(id_: str = "call_1", name: str = "get_weather", arguments: str = '{"city": "Paris"}') -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [call(), call("call_2", "get_time", "{}")]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "assistant", "content": "Sunny, 21C, and it is noon."},
    {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "Rome?"}]},
]


def test_check_messages_accepts_a_tool_conversation():
    check_messages(CONVERSATION)
    check_messages([{"role": "assistant", "content": "hi", "tool_calls": None}])


def with_message(i: int, message: dict) -> list[dict]:
    messages = [dict(m) for m in CONVERSATION]
    messages[i] = message
    return messages


@pytest.mark.parametrize("messages, param, words", [
    ({"role": "user"}, "messages", "must be a list"),
    (with_message(1, "hi"), "messages.1", "must be an object"),
    (with_message(1, {"role": "robot", "content": "hi"}), "messages.1.role", "must be one of"),
    (with_message(1, {"role": "user", "content": 3}), "messages.1.content", "string, null"),
    (with_message(1, {"role": "user", "content": "x", "tool_calls": [call()]}), "messages.1.tool_calls",
     "assistant messages only"),
    (with_message(2, {"role": "assistant", "tool_calls": call()}), "messages.2.tool_calls", "must be a list"),
    (with_message(2, {"role": "assistant", "tool_calls": ["x"]}), "messages.2.tool_calls.0", "must be an object"),
    (with_message(2, {"role": "assistant", "tool_calls": [{**call(), "id": ""}]}), "messages.2.tool_calls.0.id",
     "non-empty string"),
    (with_message(2, {"role": "assistant", "tool_calls": [call(), {**call(), "type": "code"}]}),
     "messages.2.tool_calls.1.type", "'function'"),
    (with_message(2, {"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]}),
     "messages.2.tool_calls.0.function", "must be an object"),
    (with_message(2, {"role": "assistant", "tool_calls": [call(name="")]}), "messages.2.tool_calls.0.function.name",
     "non-empty string"),
    (with_message(2, {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                           "function": {"name": "f", "arguments": {"a": 1}}}]}),
     "messages.2.tool_calls.0.function.arguments", "string of JSON"),
    (with_message(2, {"role": "assistant", "tool_calls": [call(arguments="{city: Paris}")]}),
     "messages.2.tool_calls.0.function.arguments", "not a JSON object"),
    (with_message(2, {"role": "assistant", "tool_calls": [call(arguments="[1, 2]")]}),
     "messages.2.tool_calls.0.function.arguments", "not a JSON object"),
    (with_message(3, {"role": "tool", "content": "sunny"}), "messages.3.tool_call_id", "non-empty string"),
    (with_message(1, {"role": "user", "content": "x", "tool_call_id": "call_1"}), "messages.1.tool_call_id",
     "tool messages only"),
    # a tool message answers a call of an earlier assistant message (OpenAI answers 400 otherwise)
    (with_message(4, {"role": "tool", "tool_call_id": "call_x", "content": "12:00"}), "messages.4.tool_call_id",
     "'call_x' matches no tool call of an earlier assistant message"),
    ([CONVERSATION[1], CONVERSATION[3], CONVERSATION[2]], "messages.1.tool_call_id", "'call_1' matches no tool call"),
    ([CONVERSATION[1], {"role": "assistant", "content": "Let me look."}, CONVERSATION[3]], "messages.2.tool_call_id",
     "'call_1' matches no tool call"),
])
def test_check_messages_refuses_with_400_naming_the_field(messages, param, words):
    err = api_error(check_messages, messages)
    assert err.body["error"]["param"] == param
    assert words in err.body["error"]["message"]


# --- render --------------------------------------------------------------------------------------

def only_role_and_content(messages: list[dict]) -> bool:
    return all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in messages)


def test_render_default_prepends_a_system_turn_listing_the_tools():
    spec = spec_of()
    messages, kwargs = render([{"role": "user", "content": "Weather in Paris?"}], spec, CHATML)
    assert kwargs == {}
    assert only_role_and_content(messages)
    assert [m["role"] for m in messages] == ["system", "user"]
    system = messages[0]["content"]
    assert system == tools_prompt(spec)
    assert system.startswith("# Tools\n")
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in system
    assert f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}' in system
    assert "Call a function only when it helps" in system and "one <tool_call> block after another" in system
    prompt = apply(CHATML, messages)
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and "SmolLM" not in prompt


def test_render_default_merges_the_tools_into_the_system_message():
    messages, _ = render(CONVERSATION, spec_of(), CHATML)
    assert messages[0] == {"role": "system", "content": "Be brief.\n\n" + tools_prompt(spec_of())}
    assert sum(m["role"] == "system" for m in messages) == 1


def test_render_default_writes_calls_and_results_as_text():
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "Checking.", "tool_calls": [call(arguments='{"city":"Zürich"}')]},
               *CONVERSATION[3:]]
    messages, _ = render(history, None, CHATML)
    assert only_role_and_content(messages)
    assert messages[1] == {"role": "assistant", "content": f'Checking.\n{OPEN}\n{{"name": "get_weather", '
                                                           f'"arguments": {{"city": "Zürich"}}}}\n{CLOSE}'}
    # consecutive tool results: one user turn
    assert messages[2] == {"role": "user",
                           "content": "<tool_response>\nsunny, 21C\n</tool_response>\n"
                                      "<tool_response>\n12:00\n</tool_response>"}
    assert messages[3:] == [{"role": "assistant", "content": "Sunny, 21C, and it is noon."},
                            {"role": "user", "content": "And Rome?"}]
    assert "<|im_start|>tool" not in apply(CHATML, messages)


def test_render_default_calls_parse_back_to_the_same_calls():
    spec = spec_of()
    messages, _ = render(CONVERSATION, spec, CHATML)
    content, calls = parse_output(messages[2]["content"], spec)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_render_default_on_gemma_names_the_roles_it_knows():
    messages, _ = render(CONVERSATION, spec_of(), GEMMA)
    prompt = apply(GEMMA, messages)
    assert prompt.startswith("<bos><start_of_turn>user\nBe brief.\n\n# Tools\n")
    assert "<start_of_turn>model\n<tool_call>" in prompt and "<start_of_turn>tool" not in prompt


@pytest.mark.parametrize("choice, parallel, line", [
    ("required", True, "You must call at least one function."),
    ("required", False, "You must call exactly one function."),
    ({"type": "function", "function": {"name": "route"}}, True, 'You must call the function "route".'),
])
def test_tools_prompt_says_what_the_choice_asks(choice, parallel, line):
    text = tools_prompt(spec_of(choice=choice, parallel=parallel))
    assert line in text
    assert ("one <tool_call> block after another" in text) == parallel
    assert ("Call at most one function at a time." in text) != parallel


def test_render_for_a_template_that_knows_tools_passes_them_and_keeps_the_messages():
    messages, kwargs = render(CONVERSATION, spec_of(), HERMES)
    assert kwargs == {"tools": TOOLS}
    assert [m["role"] for m in messages] == [m["role"] for m in CONVERSATION]
    assert messages[2] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]}
    assert messages[3] == {"role": "tool", "content": "sunny, 21C", "tool_call_id": "call_1", "name": "get_weather"}
    assert messages[6] == {"role": "user", "content": "And Rome?"}
    prompt = apply(HERMES, messages, **kwargs)
    assert '"name": "get_weather"' in prompt and '{"name": "get_time", "arguments": {}}' in prompt


def test_render_for_a_template_that_knows_tools_without_a_spec_passes_no_tools():
    messages, kwargs = render(CONVERSATION, None, HERMES)
    assert kwargs == {}
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert "<tools>" not in apply(HERMES, messages, **kwargs)


# --- the grammar ---------------------------------------------------------------------------------

llguidance = pytest.importorskip("llguidance")


def find_tokenizer() -> Path | None:
    found = sorted(Path.home().glob(".cache/kvcache/models/*/tokenizer.json"))
    smol = [p for p in found if "SmolLM2" in p.parent.name]
    return (smol or found or [None])[0]


@pytest.fixture(scope="module")
def lltok():
    path = find_tokenizer()
    if path is None:
        pytest.skip("no tokenizer.json under ~/.cache/kvcache/models")
    return llguidance.LLTokenizer(path.read_text())


def accepts(tok, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tok.tokenize_str(text)) and matcher.is_accepting()


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False), (NAMED, True), (NAMED, False)])
def test_grammar_is_valid_lark_for_llguidance(choice, parallel):
    grammar = tool_grammar(spec_of(choice=choice, parallel=parallel))
    assert grammar is not None
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


def test_no_grammar_for_auto():
    assert tool_grammar(spec_of()) is None


def test_named_grammar_accepts_a_valid_call_and_refuses_others(lltok):
    grammar = tool_grammar(spec_of(choice=NAMED, parallel=False))
    assert accepts(lltok, grammar, calls_text([("get_weather", {"city": "Paris", "days": 2})]))
    assert accepts(lltok, grammar, calls_text([("get_weather", {"city": "Zürich \"centre\"\n"})]))
    assert not accepts(lltok, grammar, calls_text([("get_time", {})]))  # another tool
    assert not accepts(lltok, grammar, calls_text([("get_weather", {"days": 2})]))  # required city missing
    assert not accepts(lltok, grammar, calls_text([("get_weather", {"city": 3})]))  # wrong type
    assert not accepts(lltok, grammar, calls_text([("get_weather", {"city": "P", "x": 1})]))  # no such property
    assert not accepts(lltok, grammar, "Sure! " + calls_text([("get_weather", {"city": "Paris"})]))  # text first
    assert not accepts(lltok, grammar, f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "P"}}}}')  # unclosed
    # the JSON is written as the prompt shows it (json.dumps's separators), so no run of whitespace can grow
    assert not accepts(lltok, grammar, f'{OPEN}\n{{"name":"get_weather","arguments":{{"city":"P"}}}}\n{CLOSE}')
    assert not accepts(lltok, grammar, f'{OPEN}\n{{ "name": "get_weather", "arguments": {{"city": "P"}}}}\n{CLOSE}')
    two = calls_text([("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})])
    assert not accepts(lltok, grammar, two)  # parallel_tool_calls false: one call only


def test_required_grammar_takes_any_tool_and_parallel_blocks(lltok):
    grammar = tool_grammar(spec_of(choice="required"))
    for name, args in [("get_weather", {"city": "Paris"}), ("get_time", {}), ("get_time", {"tz": ["UTC", 1]}),
                       ("route", {"to": {"city": "Rome"}})]:
        assert accepts(lltok, grammar, calls_text([(name, args)])), name
    calls = [("get_weather", {"city": "Paris"}), ("route", {"to": {"city": "Rome"}}), ("get_time", {})]
    assert accepts(lltok, grammar, calls_text(calls))
    content, parsed = parse_output(calls_text(calls), spec_of(choice="required"))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    assert not accepts(lltok, grammar, calls_text([("nope", {})]))
    assert not accepts(lltok, grammar, calls_text([("route", {"to": {"town": "Rome"}})]))  # through the $ref
    assert not accepts(lltok, grammar, calls_text([("route", {"to": "Rome"})]))
    assert not accepts(lltok, grammar, calls_text([("get_time", {})]) + "\nand then some more words")


def allowed_after(tok, grammar: str, text: str) -> set[int]:
    """The token ids the grammar admits after ``text``."""
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert matcher.consume_tokens(tok.tokenize_str(text)), text
    return {t for t, ok in enumerate(matcher.compute_logit_bias()) if ok}


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_turn_may_end_after_each_call(lltok, choice):
    """After ``</tool_call>`` the end of the turn, and any text but ``\n<`` (two tokens at most, the tail),
    are allowed beside another block, so a model that would go on in prose ends the turn instead of being
    led through ``\n`` to ``<`` and another call; ``\n<`` is a block."""
    grammar = tool_grammar(spec_of(choice=choice))
    one = calls_text([("get_weather", {"city": "Paris"})])
    eos, you, lt = lltok.eos_token, *lltok.tokenize_str("You"), *lltok.tokenize_str("<")
    for text in (one, one + "\n"):
        assert {eos, you, lt} <= allowed_after(lltok, grammar, text), repr(text)
    for tail in ("\n", "\n\n", "You", "\nYou", " Done"):
        assert accepts(lltok, grammar, one + tail), repr(tail)
    assert allowed_after(lltok, grammar, one + "\nYou") == {eos}  # two tokens: only the end is left
    assert eos not in allowed_after(lltok, grammar, one + "\n<")  # a newline and "<" open a block
    assert accepts(lltok, grammar, one + "\n" + calls_text([("get_weather", {"city": "Rome"})]) + "\nOK")
    content, calls = parse_output(one + "\nYou", spec_of(choice=choice))
    assert content is None and [c.name for c in calls] == ["get_weather"]
    # without parallel calls nothing follows the one call
    assert allowed_after(lltok, tool_grammar(spec_of(choice=choice, parallel=False)), one) == {eos}


# --- parsing -------------------------------------------------------------------------------------

def blk(name: str, args: object, key: str = "arguments", pad: str = "\n") -> str:
    return f"{OPEN}{pad}{json.dumps({'name': name, key: args})}{pad}{CLOSE}"


def summary(result: tuple[str | None, list[ToolCall]]) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = result
    return content, [(c.name, c.arguments) for c in calls]


def test_parse_a_tagged_call_between_text():
    spec = spec_of()
    text = "Let me check.\n" + blk("get_weather", {"city": "Paris"}) + "\nOne moment."
    content, calls = parse_output(text, spec)
    assert content == "Let me check.\n\nOne moment."
    assert len(calls) == 1 and re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)
    assert calls[0].as_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_parse_parallel_calls_drops_the_whitespace_between_them():
    text = "\n" + blk("get_weather", {"city": "Paris"}) + "\n\n" + blk("get_time", {}, pad=" ") + "\n"
    content, calls = parse_output(text, spec_of())
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize("text, expected", [
    # arguments re-serialized: "parameters" alias, arguments as a JSON string, no \u escapes
    (blk("get_weather", {"city": "Zürich"}, key="parameters"), [("get_weather", '{"city": "Zürich"}')]),
    (blk("get_weather", '{"city":"Rome","days":3}'), [("get_weather", '{"city": "Rome", "days": 3}')]),
    (f'{OPEN}{{"name":"get_time"}}{CLOSE}', [("get_time", "{}")]),
    # Llama 3 style: the whole output is bare JSON
    ('  {"name": "get_weather", "parameters": {"city": "Paris"}}\n', [("get_weather", '{"city": "Paris"}')]),
    ('[{"name": "get_time", "arguments": {}}, {"name": "route", "arguments": {"to": {"city": "Oslo"}}}]',
     [("get_time", "{}"), ("route", '{"to": {"city": "Oslo"}}')]),
])
def test_parse_call_forms(text, expected):
    content, calls = summary(parse_output(text, spec_of()))
    assert content is None and calls == expected


@pytest.mark.parametrize("text", [
    f"{OPEN}\n{{not json}}\n{CLOSE}",
    blk("launch_missiles", {}),
    blk("get_weather", [1, 2]),
    blk("get_weather", "not an object"),
    f'{OPEN}{{"name": "get_weather", "arguments": {{"x": NaN}}}}{CLOSE}',
    f'{OPEN}{{"name": "get_weather", "arguments": {{}}}} trailing{CLOSE}',
    '{"name": "launch_missiles", "arguments": {}}',
    '{"name": "get_time", "arguments": {}} and then some text',
    '[{"name": "get_time", "arguments": {}}, 3]',
    "[]",
    '{"answer": 42}',
    "<tool_ca",
    "   ",
    "",
    "Plain answer with <b>tags</b> and a {brace}.",
])
def test_parse_leaves_what_is_not_a_call_untouched(text):
    assert summary(parse_output(text, spec_of())) == (text, [])


def test_parse_mixed_malformed_and_valid_blocks():
    bad = f"{OPEN}\n{{oops\n{CLOSE}"
    text = "A " + bad + "\n" + blk("get_time", {}) + " B " + blk("nope", {}) + blk("get_weather", {"city": "X"})
    content, calls = summary(parse_output(text, spec_of()))
    assert content == "A " + bad + "\n B " + blk("nope", {})
    assert calls == [("get_time", "{}"), ("get_weather", '{"city": "X"}')]


def test_parse_an_unclosed_block_at_the_end():
    spec = spec_of()
    assert summary(parse_output("Hi " + f'{OPEN}\n{{"name": "get_time", "arguments": {{}}}}\n', spec)) == \
        ("Hi ", [("get_time", "{}")])
    cut = f'{OPEN}\n{{"name": "get_time", "argu'
    assert summary(parse_output("Hi " + cut, spec)) == ("Hi " + cut, [])


def test_bare_json_wins_over_tags_only_when_it_is_the_whole_output():
    spec = spec_of()
    text = '{"a": 1}\n' + blk("get_time", {})
    assert summary(parse_output(text, spec)) == ('{"a": 1}\n', [("get_time", "{}")])


def test_stream_gives_content_early_and_holds_only_a_possible_tag():
    stream = ToolStream(spec_of())
    assert stream.feed("Hello wor") == [("content", "Hello wor")]
    assert stream.feed("ld <tool") == [("content", "ld ")]
    assert stream.feed("s>") == [("content", "<tools>")]
    assert stream.feed(" <tool_call>\n{\"name\": \"get_time\", ") == [("content", " ")]
    assert stream.feed('"arguments": {}}\n</tool_c') == []
    events = stream.feed("all>!")
    assert [e[0] for e in events] == ["call", "args", "content"]
    assert events[0][1:2] == (0,) and events[0][3] == "get_time" and events[1] == ("args", 0, "{}")
    assert events[2] == ("content", "!")
    assert stream.finish() == [] and stream.finish() == []
    with pytest.raises(RuntimeError):
        stream.feed("more")


def test_stream_holds_output_that_may_be_bare_json_until_the_end():
    stream = ToolStream(spec_of())
    assert stream.feed("\n ") == []
    assert stream.feed('{"name": "get_time", ') == []
    assert stream.feed('"arguments": {}}') == []
    events = stream.finish()
    assert [e[0] for e in events] == ["call", "args"]
    stream = ToolStream(spec_of())
    assert stream.feed(" [1, 2]") == []
    assert stream.finish() == [("content", " [1, 2]")]


OUTPUTS = [
    "Just an answer, no tools at all.",
    "Let me check.\n" + blk("get_weather", {"city": "Paris"}) + "\nDone.",
    "\n" + blk("get_weather", {"city": "Paris"}) + "\n" + blk("route", {"to": {"city": "Rome"}}) + "\n",
    '  {"name": "get_weather", "parameters": {"city": "Zürich", "days": 2}}  ',
    '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]',
    '{"name": "unknown", "arguments": {}}',
    "A <tool_cal> B <tool_call>{broken</tool_call> C " + blk("get_time", {}, pad=" ") + " <tool_call",
    "<<tool_call>" + blk("get_time", {})[len(OPEN):] + "<</tool_call>>",
    '{"a": 1} then ' + blk("get_time", {}) + "\n\n",
    "x" + blk("get_weather", {"city": "</tool_call>"}) + "y",
    "  \n ",
    f'{OPEN}\n{{"name": "get_time", "arguments": {{}}}}',
    "emoji 🌧️ and ünïcödé " + blk("get_weather", {"city": "東京"}),
]


def random_chunks(text: str, rng: random.Random) -> list[str]:
    chunks, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 13])
        chunks.append(text[i:i + n])
        i += n
    return chunks


def streamed(text: str, chunks: list[str], spec: ToolSpec) -> list:
    assert "".join(chunks) == text
    stream = ToolStream(spec)
    events = [e for c in chunks for e in stream.feed(c)]
    return events + stream.finish()


def check_events(events: list) -> None:
    """Calls in index order, each announced once with a well-formed id before its arguments."""
    ids: dict[int, str] = {}
    for e in events:
        if e[0] == "call":
            assert e[1] == len(ids) and re.fullmatch(r"call_[0-9a-f]{24}", e[2])
            ids[e[1]] = e[2]
        elif e[0] == "args":
            assert e[1] in ids and e[2]
        else:
            assert e[0] == "content" and e[1]
    assert len(set(ids.values())) == len(ids)


@pytest.mark.parametrize("choice", [None, "required"], ids=["auto", "forced"])
@pytest.mark.parametrize("text", OUTPUTS)
def test_streaming_in_any_chunks_adds_up_to_parse_output(text, choice):
    spec = spec_of(choice=choice)
    whole = summary(parse_output(text, spec))
    rng = random.Random(text)
    chunkings = [[text], list(text)] + [random_chunks(text, rng) for _ in range(25)]
    for chunks in chunkings:
        events = streamed(text, chunks, spec)
        check_events(events)
        assert summary(assemble(events)) == whole, chunks


def test_parse_output_of_the_sample_outputs():
    """Pins what the streaming test compares against."""
    spec = spec_of()
    got = [summary(parse_output(t, spec)) for t in OUTPUTS]
    assert got[1] == ("Let me check.\n\nDone.", [("get_weather", '{"city": "Paris"}')])
    assert got[2] == (None, [("get_weather", '{"city": "Paris"}'), ("route", '{"to": {"city": "Rome"}}')])
    assert got[4] == (None, [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')])
    assert got[6] == ("A <tool_cal> B <tool_call>{broken</tool_call> C  <tool_call", [("get_time", "{}")])
    assert got[7] == ("<<</tool_call>>", [("get_time", "{}")])
    assert got[9] == ("x" + blk("get_weather", {"city": "</tool_call>"}) + "y", [])
    assert got[10] == ("  \n ", [])
    assert got[12] == ("emoji 🌧️ and ünïcödé ", [("get_weather", '{"city": "東京"}')])
    forced = spec_of(choice="required")  # after the first call, what is not a call is dropped
    assert summary(parse_output(OUTPUTS[1], forced)) == ("Let me check.\n", [("get_weather", '{"city": "Paris"}')])
    assert summary(parse_output(OUTPUTS[6], forced)) == ("A <tool_cal> B <tool_call>{broken</tool_call> C ",
                                                         [("get_time", "{}")])
    # max_tokens cut the forced call: the call as far as it got (OpenAI's way), never markup as text
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert summary(parse_output(cut, forced)) == (None, [("get_weather", '{"city": "Par')])
    assert summary(parse_output(cut, spec)) == (cut, [])  # a call the model chose to write stays its text
    assert summary(parse_output('<tool_call>\n{"na', forced)) == ('', [])
