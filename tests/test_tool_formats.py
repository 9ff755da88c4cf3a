"""Tool calls in the model's own format and tokens (server/tool_formats.py, server/tools.py).

For each format kvcache reads: the forcing grammar admits exactly the calls the format writes
(allowed functions, schema-valid arguments, parallel or one), and the parser reads back what the
grammar admits. On Qwen2.5's real tokenizer (a tiny random model carrying it, tests/qwen_tiny.py),
``<tool_call>`` and ``</tool_call>`` are single added tokens: the grammar names them by id, so the
model's own token is what it takes (a literal ``"<tool_call>"`` refused token 151657 on every forced
request), and the served model's forced, named, parallel and streamed calls all come back as calls;
the prompt with tools is transformers' to the token. A marker the tokenizer counts as special is
kept in the decoded text only where a parser needs it."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import llguidance
import pytest

from kvcache.server.tool_formats import DEFAULT, FORMATS, ToolFormat, tool_format
from kvcache.server.tools import ToolSpec, parse_output, tool_grammar

sys.path.insert(0, str(Path(__file__).parent))
from test_tools import lltok  # noqa: E402,F401 (a fixture)

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}
PARIS, ROME = ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_weather", {"city": "Rome"})


def written(fmt: ToolFormat, calls: list[tuple[str, dict]]) -> str:
    """Calls as a model trained on ``fmt`` writes them (json.dumps's separators, as the grammar does)."""
    objs = [json.dumps({"name": n, fmt.args_key: a}, ensure_ascii=False) for n, a in calls]
    if fmt.body == "named":
        return "".join(f"{fmt.open}{n}{fmt.args}{json.dumps(a, ensure_ascii=False)}" for n, a in calls)
    if fmt.body == "list":
        return f"{fmt.open}[{', '.join(objs)}]" + (fmt.close or "")
    if fmt.open is None:
        return objs[0]
    return "\n".join(f"{fmt.open}\n{o}\n{fmt.close}" for o in objs)


def spec(fmt: ToolFormat, choice: str = "required", parallel: bool = True, name: str | None = None) -> ToolSpec:
    return ToolSpec(tools=(WEATHER, TIME), choice=choice, name=name, parallel=parallel, fmt=fmt)


@pytest.fixture(scope="module")
def smol(lltok):
    return lltok  # llguidance's view of a cached vocabulary (SmolLM2's), as test_tools.py builds it


def accepts(tok, grammar: str, text: str | list[int]) -> bool:
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tok.tokenize_str(text) if isinstance(text, str) else text
    return matcher.consume_tokens(ids) and matcher.is_accepting()


ALL = [DEFAULT, *FORMATS.values()]


@pytest.mark.parametrize("fmt", ALL, ids=[f.name for f in ALL])
def test_each_format_grammar_admits_its_calls_and_nothing_else(smol, fmt):
    one = written(fmt, [PARIS])
    grammar = tool_grammar(spec(fmt))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    assert accepts(smol, grammar, one)
    assert not accepts(smol, grammar, written(fmt, [("get_date", {})]))  # no such function
    assert not accepts(smol, grammar, written(fmt, [("get_weather", {"unit": "celsius"})]))  # city is required
    assert not accepts(smol, grammar, written(fmt, [("get_weather", {"city": "P", "extra": 1})]))  # closed schema
    assert not accepts(smol, grammar, "Sure. " + one)  # a forced turn is calls only
    named = tool_grammar(spec(fmt, choice="named", name="get_time"))
    assert accepts(smol, named, written(fmt, [("get_time", {"tz": "UTC"})]))
    assert not accepts(smol, named, one)
    two = written(fmt, [PARIS, ROME])
    single = tool_grammar(spec(fmt, parallel=False))
    one_a_turn = fmt.name in ("llama3", "harmony")  # Llama 3's format and gpt-oss's hold one call a turn
    if not one_a_turn:
        assert accepts(smol, grammar, two) and not accepts(smol, single, two)
    elif fmt.name == "harmony":  # <|call|> ends the turn: a second call is not admitted
        assert not accepts(smol, grammar, two)
    # what the grammar admits, the parser reads back as those calls
    for text, calls in ((one, [PARIS]), (two, [PARIS, ROME])):
        if one_a_turn and len(calls) > 1:
            continue
        content, got = parse_output(text, spec(fmt))
        assert content is None and [(c.name, json.loads(c.arguments)) for c in got] == calls, text


@pytest.mark.parametrize("fmt", ALL, ids=[f.name for f in ALL])
def test_each_format_streamed_in_any_chunks_adds_up_to_the_whole(fmt):
    from kvcache.server.tools import assemble, call_stream

    # gpt-oss writes one call a turn, a channel's header first (a reply opening with text is all text)
    several = fmt.open and fmt.name != "harmony"
    text = "Let me check. " + written(fmt, [PARIS, ROME]) if several else written(fmt, [PARIS])
    whole = parse_output(text, spec(fmt, choice="auto"))
    for size in (1, 2, 3, 7, 50):
        stream = call_stream(spec(fmt, choice="auto"))
        events = [e for i in range(0, len(text), size) for e in stream.feed(text[i:i + size])] + stream.finish()
        content, calls = assemble(events)
        assert (content, [(c.name, c.arguments) for c in calls]) == (whole[0], [(c.name, c.arguments) for c in whole[1]])
    assert len(whole[1]) == (2 if several else 1)


def test_a_forced_call_cut_by_max_tokens_comes_back_as_it_stands():
    for fmt in ALL:
        text = written(fmt, [PARIS])
        cut = text[: text.index("Paris") + 3]
        content, calls = parse_output(cut, spec(fmt))
        assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", cut[cut.index('{"city'):])], fmt.name


def test_llama3_calls_may_open_with_the_python_tag():
    fmt = FORMATS["llama3"]
    content, calls = parse_output("<|python_tag|>" + written(fmt, [PARIS]), spec(fmt, choice="auto"))
    assert content is None and [c.name for c in calls] == ["get_weather"]
    content, calls = parse_output('{"name": "nope", "parameters": {}}', spec(fmt, choice="auto"))
    assert calls == [] and content == '{"name": "nope", "parameters": {}}'  # not a call: the text stays


def test_markers_that_are_added_tokens_are_named_by_id_and_kept_in_text():
    """A tokenizer where ``[TOOL_CALLS]`` is a special added token (as in Mistral's): the format knows
    its id, the grammar names it so, and decoding keeps it only when asked."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from kvcache.models.tokenizer import Tokenizer

    vocab = {c: i for i, c in enumerate(["<unk>", "</s>", "hello", "[", "]", "{", "}"])}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True), AddedToken("[ARGS]", special=True)])
    tok = Tokenizer(backend, {"chat_template": "{% for m in messages %}[TOOL_CALLS][ARGS]{% endfor %} tools"}, {})
    fmt = tool_format(tok.chat_template, tok)
    tc, args = backend.token_to_id("[TOOL_CALLS]"), backend.token_to_id("[ARGS]")
    assert fmt.name == "mistral-args" and fmt.token("[TOOL_CALLS]") == tc and set(fmt.keep_ids()) == {tc, args}
    grammar = tool_grammar(spec(fmt))
    assert f"<[{tc}]>" in grammar and f"<[{args}]>" in grammar and '"[TOOL_CALLS]"' not in grammar
    ids = [vocab["hello"], tc, vocab["hello"]]
    assert tok.decode(ids) == "hello hello"  # special: left out of ordinary text
    assert tok.decode(ids, keep=frozenset(fmt.keep_ids())).replace(" ", "") == "hello[TOOL_CALLS]hello"
    assert tool_format(tok.chat_template).ids == ()  # without the vocabulary: markers as text


# --- Qwen2.5's real tokenizer and template ------------------------------------------------------


@pytest.fixture(scope="module")
def qwen():
    from qwen_tiny import tiny_qwen

    from kvcache.engine.llm import LLM

    return LLM(str(tiny_qwen()))


def test_qwen_markers_are_its_tool_tokens(qwen):
    fmt = tool_format(qwen.tokenizer.chat_template, qwen.tokenizer)
    assert fmt.name == "hermes" and dict(fmt.ids) == {"<tool_call>": 151657, "</tool_call>": 151658}
    grammar = tool_grammar(replace(spec(fmt), fmt=fmt))
    assert "<[151657]>" in grammar and "<[151658]>" in grammar
    tok = qwen.grammars.tokenizer()
    ids = qwen.tokenizer.encode(written(fmt, [PARIS]), add_special_tokens=False)
    assert ids[0] == 151657 and ids[-1] == 151658  # the model writes its tool tokens
    assert accepts(tok, grammar, ids)
    # the literal text the grammar used to force is refused by llguidance's view of the same tokens
    literal = grammar.replace("<[151657]>", '"<tool_call>"')
    assert not accepts(tok, literal, ids)


def test_qwen_prompt_with_tools_is_transformers_to_the_token(qwen):
    from transformers import PreTrainedTokenizerFast

    from kvcache.server.tools import render

    # transformers' tokenizer of the same vocabulary (the file's, as transformers converted it at
    # load) with its own renderer: the template, the tools' JSON and the special tokens in the text
    # go through transformers' code, not kvcache's
    theirs = PreTrainedTokenizerFast(tokenizer_object=type(qwen.tokenizer.backend).from_str(qwen.tokenizer.backend.to_str()))
    theirs.chat_template = qwen.tokenizer.chat_template
    messages = [{"role": "system", "content": "Tu es un assistant météo."},
                {"role": "user", "content": "Quel temps à Paris ?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    fmt = tool_format(qwen.tokenizer.chat_template, qwen.tokenizer)
    tools = ({"name": "get_weather", "description": "Température à <ville> & 'pays'", "parameters": WEATHER["parameters"]},)
    msgs, extra = render(messages, ToolSpec(tools, "auto", None, True, fmt=fmt), qwen.tokenizer.chat_template, fmt)
    ours = qwen.tokenizer.encode(qwen.tokenizer.apply_chat_template(msgs, **extra), add_special_tokens=False)
    want = theirs.apply_chat_template(msgs, tools=extra["tools"], add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert ours == list(want)
    assert 151657 in ours  # the earlier call, written back with the tool token


# --- served: a real `kvcache serve` on the tiny Qwen model, the openai client -------------------

TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]


@pytest.fixture(scope="module")
def served(qwen):
    from test_server import Server
    from qwen_tiny import tiny_qwen

    s = Server(str(tiny_qwen()), "--max-running", "8")
    yield s
    s.close()


def ask(served, **kw):
    client = served.client()
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=[{"role": "user", "content": "Weather in Paris?"}],
                                          tools=TOOLS, max_tokens=48, **kw)


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False),
                                              ({"type": "function", "function": {"name": "get_time"}}, True)])
def test_served_forced_calls_in_qwen_tokens_are_calls(served, choice, parallel):
    """What failed with a 400 naming ``messages`` on every request: now calls, for several seeds."""
    import jsonschema

    for seed in range(3):
        r = ask(served, tool_choice=choice, parallel_tool_calls=parallel, temperature=1.0, seed=seed)
        choice0 = r.choices[0]
        assert choice0.message.tool_calls, choice0
        for call in choice0.message.tool_calls:
            if isinstance(choice, dict):
                assert call.function.name == "get_time"
            if choice0.finish_reason == "tool_calls":  # cut by max_tokens, the arguments stand as they are
                schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["parameters"]
                jsonschema.validate(json.loads(call.function.arguments), schema)
        assert choice0.finish_reason in ("tool_calls", "length")
        assert parallel or len(choice0.message.tool_calls) == 1


def test_served_streamed_forced_call_is_the_non_streamed_one(served):
    whole = ask(served, tool_choice="required", temperature=0.0)
    client = served.client()
    stream = client.chat.completions.create(model=whole.model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                            tools=TOOLS, max_tokens=48, tool_choice="required", temperature=0.0,
                                            stream=True)
    names, args, reasons = {}, {}, []
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.function and d.function.name:
                names[d.index] = d.function.name
            args[d.index] = args.get(d.index, "") + ((d.function.arguments or "") if d.function else "")
        reasons.append(chunk.choices[0].finish_reason)
    want = whole.choices[0].message.tool_calls
    assert [names[i] for i in sorted(names)] == [c.function.name for c in want]
    assert [args[i] for i in sorted(args)] == [c.function.arguments for c in want]
    assert reasons[-1] == whole.choices[0].finish_reason


def test_served_auto_beside_a_json_answer_takes_the_tool_token_branch(served):
    """``auto`` tools beside a JSON response_format: the grammar's call branch opens with token 151657."""
    for seed in range(4):
        r = ask(served, tool_choice="auto", temperature=1.0, seed=seed,
                response_format={"type": "json_object"})
        m = r.choices[0].message
        assert m.tool_calls or m.content is not None
        if not m.tool_calls and r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(m.content), dict)


def test_a_token_the_grammar_refuses_is_the_servers_fault():
    """Not a 400 naming ``messages``: a 500 (server_error, no param); the scheduler logs it with the
    request id."""
    from kvcache.engine.request import error_kind
    from kvcache.errors import ConstraintFault
    from kvcache.server.streams import exception_reply

    e = ConstraintFault("the constraint refused token 151657: forced bytes")
    assert error_kind(e) == "internal"
    reply = exception_reply(e, "messages")
    assert reply.status == 500 and reply.body["error"]["param"] is None
    assert reply.body["error"]["type"] == "server_error"
