"""A reasoning model's thinking apart from its answer (server/reasoning.py): the split itself, in
any chunks, on the texts such models write; which of llama.cpp's 71 real templates think; and a
real server on the tiny Qwen model with real thinking templates (QwQ's opens the block in the
generation prompt, Qwen3's can be asked not to think), through the openai and anthropic SDKs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcache.server.reasoning import ReasoningStream, ThinkFormat, split, think_format

FMT = ThinkFormat()
TEXTS = [
    ("<think>\nThe user wants 2+2.\nThat is 4.\n</think>\n\nThe answer is **4**.", False,
     ("The user wants 2+2.\nThat is 4.", "The answer is **4**.")),
    ("  <think>a < b and </thin is not the end</think>ok", False, ("a < b and </thin is not the end", "ok")),
    ("no block here, <think> later is text", False, (None, "no block here, <think> later is text")),
    ("\nreasoning that the prompt opened\n</think>\n\nanswer", True, ("reasoning that the prompt opened", "answer")),
    ("<think>\n\n</think>\n\nan empty block", False, (None, "an empty block")),
    ("<think>cut off by max_tokens   ", False, ("cut off by max_tokens", "")),
    ("<thi", False, (None, "<thi")),
    ("   ", False, (None, "   ")),
    ("opened, never closed", True, ("opened, never closed", "")),
]


@pytest.mark.parametrize("text, started, want", TEXTS)
def test_the_split_of_a_whole_reply(text, started, want):
    assert split(text, FMT, started) == want


@pytest.mark.parametrize("text, started, want", TEXTS)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
def test_streamed_in_any_chunks_the_pieces_add_up_to_the_split(text, started, want, size):
    stream = ReasoningStream(FMT, started)
    events = []
    for i in range(0, len(text), size):
        events += stream.feed(text[i:i + size])
    events += stream.finish()
    assert all(kind in ("reasoning", "content") and piece for kind, piece in events)
    reasoning = "".join(p for k, p in events if k == "reasoning") or None
    assert (reasoning, "".join(p for k, p in events if k == "content")) == want
    kinds = [k for k, _ in events]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # all the reasoning comes before any content
    with pytest.raises(RuntimeError):
        stream.feed("more")


TEMPLATES = sorted(Path(__file__).resolve().parent.parent.glob(
    ".venv/llama.cpp/src/llama_cpp_python-*/vendor/llama.cpp/models/templates"))


def template(name: str) -> str:
    for folder in TEMPLATES:
        path = folder / f"{name}.jinja"
        if path.is_file():
            return path.read_text()
    pytest.skip("llama.cpp's templates are not unpacked (make llama-src)")


@pytest.mark.parametrize("name, thinks", [
    ("Qwen-Qwen3-0.6B", True), ("Qwen-QwQ-32B", True), ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", True),
    ("HuggingFaceTB-SmolLM3-3B", True), ("Qwen-Qwen2.5-7B-Instruct", False), ("meta-llama-Llama-3.1-8B-Instruct", False),
    ("google-gemma-2-2b-it", False), ("mistralai-Mistral-Nemo-Instruct-2407", False),
])
def test_templates_that_think_are_told_from_the_others(name, thinks):
    assert (think_format(template(name)) is not None) is thinks


# --- a real server on the tiny Qwen model with real thinking templates ---------------------------


def _with_template(name: str, tmp: Path) -> Path:
    from convert_matrix import rewrite_gguf
    from qwen_tiny import tiny_qwen

    return rewrite_gguf(tiny_qwen(), tmp / f"tiny-qwen-{name}.gguf", drop=("tokenizer.chat_template",),
                        add={"tokenizer.chat_template": template(name)})


@pytest.fixture(scope="module")
def qwq(tmp_path_factory):
    """QwQ's template (llama.cpp's copy): asked to think (``enable_thinking``), its generation prompt
    opens the think block, so the reply starts in reasoning; otherwise it writes the block closed."""
    from test_server import Server

    s = Server(str(_with_template("Qwen-QwQ-32B", tmp_path_factory.mktemp("qwq"))))
    yield s
    s.close()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from test_server import Server

    path = _with_template("Qwen-Qwen3-0.6B", tmp_path_factory.mktemp("qwen3"))
    s = Server(str(path))
    s.path = path  # type: ignore[attr-defined]
    yield s
    s.close()


ASK = [{"role": "user", "content": "What is two plus two?"}]
THINK = {"chat_template_kwargs": {"enable_thinking": True}}


def _chat(server, **kw):
    client = server.client()
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK,
                                          **{"max_tokens": 12, "temperature": 0.0, **kw})


def test_a_reply_started_inside_the_block_is_reasoning_whole_and_streams_the_same(qwq):
    """The tiny model never writes ``</think>``: everything it says is reasoning, none of it content."""
    whole = _chat(qwq, extra_body=THINK)
    m = whole.choices[0].message
    raw = _chat(qwq, extra_body={**THINK, "reasoning_format": "none"}).choices[0].message
    assert raw.content and not getattr(raw, "reasoning_content", None)  # asked for the raw text
    assert m.reasoning_content == raw.content.strip() and m.content == ""
    closed = _chat(qwq).choices[0].message  # not asked to think: the template closes the block itself
    assert closed.content and not getattr(closed, "reasoning_content", None)
    client = qwq.client()
    pieces = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(model=whole.model, messages=ASK, max_tokens=12, temperature=0.0,
                                                stream=True, extra_body=THINK):
        delta = chunk.choices[0].delta.model_dump()
        for key in pieces:
            pieces[key] += delta.get(key) or ""
    assert pieces == {"reasoning_content": m.reasoning_content, "content": ""}


def test_the_responses_and_messages_apis_give_the_reasoning_as_their_own_items(qwq):
    import anthropic

    whole = _chat(qwq, extra_body=THINK)
    chat, model = whole.choices[0].message, whole.model
    client = qwq.client()
    r = client.responses.create(model=model, input="What is two plus two?", max_output_tokens=12, temperature=0.0,
                                extra_body=THINK)
    kinds = [it.type for it in r.output]
    assert kinds == ["reasoning", "message"] and r.output[0].content[0].text == chat.reasoning_content
    events = list(client.responses.create(model=model, input="What is two plus two?", max_output_tokens=12,
                                          temperature=0.0, stream=True, extra_body=THINK))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == chat.reasoning_content and done and done[0].text == deltas
    assert [it.type for it in events[-1].response.output] == ["reasoning", "message"]
    # the reasoning item given back as input renders as the earlier turn's reasoning: accepted
    again = client.responses.create(model=model, input=[{"role": "user", "content": "What is two plus two?"},
                                                      r.output[0].model_dump(exclude_none=True),
                                                      {"role": "assistant", "content": "4"},
                                                      {"role": "user", "content": "And three?"}],
                                    max_output_tokens=4, temperature=0.0, extra_body=THINK)
    assert again.status in ("completed", "incomplete")
    a = anthropic.Anthropic(base_url=qwq.base, api_key="none", max_retries=0, timeout=120)
    greedy = {**THINK, "temperature": 0.0}
    msg = a.messages.create(model=model, max_tokens=12, messages=ASK, extra_body=greedy)
    assert [b.type for b in msg.content] == ["thinking", "text"] and msg.content[0].thinking == chat.reasoning_content
    with a.messages.stream(model=model, max_tokens=12, messages=ASK, extra_body=greedy) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == chat.reasoning_content
    follow = a.messages.create(model=model, max_tokens=4, extra_body=greedy, messages=ASK + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "2+2", "signature": ""},
                                          {"type": "text", "text": "4"}]},
        {"role": "user", "content": "And three?"}])
    assert follow.content[-1].type == "text"


def test_enable_thinking_false_reaches_the_template_and_the_reply_is_all_answer(qwen3):
    from kvcache.engine.llm import LLM

    thinking, plain = _chat(qwen3), _chat(qwen3, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking.usage.prompt_tokens < plain.usage.prompt_tokens  # the empty block was written
    m = plain.choices[0].message
    assert m.content and not getattr(m, "reasoning_content", None)
    status, counted = qwen3.post("/tokenize", json.dumps({"messages": ASK, "chat_template_kwargs": {
        "enable_thinking": False}}).encode())
    assert status == 200 and counted["count"] == plain.usage.prompt_tokens  # /tokenize renders the same prompt
    tok = LLM(str(qwen3.path)).tokenizer
    text = tok.apply_chat_template(ASK, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.apply_chat_template(ASK).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("kwargs, words", [
    ({"messages": []}, "'messages' is set by kvcache itself"),
    ({"a-b": 1}, "'a-b' is not a template variable name"),
    ({"flags": [1, 2]}, "'flags' must be a string, number, boolean or null"),
])
def test_template_kwargs_that_would_override_or_are_not_plain_are_refused(qwen3, kwargs, words):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _chat(qwen3, extra_body={"chat_template_kwargs": kwargs})
    assert words in json.dumps(e.value.body)


# --- gpt-oss's harmony channels -------------------------------------------------------------------

HARMONY = [
    ('<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}', "The user wants the weather.", None,
     [("get_weather", '{"city": "Paris"}')]),
    ("<|channel|>analysis<|message|>2+2 is 4.<|end|><|start|>assistant<|channel|>final<|message|>It is **4**.",
     "2+2 is 4.", "It is **4**.", []),
    # the call turn gpt-oss's template writes back: the recipient before the channel
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}', None, None,
     [("get_weather", '{"city": "Paris"}')]),
    ("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     None, "Let me check.Done.", []),  # a preamble to no one is shown
    ("<|channel|>commentary to=functions.unknown <|constrain|>json<|message|>{}", None, "{}", []),
    ("a model that ignores the format", None, "a model that ignores the format", []),
    ("<|channel|>analysis<|message|>cut off by max_tok", "cut off by max_tok", "", []),
]


@pytest.mark.parametrize("text, reasoning, content, calls", HARMONY)
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_harmony_replies_in_any_chunks(text, reasoning, content, calls, size):
    from kvcache.server.harmony import HarmonyStream
    from kvcache.server.tools import assemble

    stream = HarmonyStream(frozenset({"get_weather"}))
    events = []
    for i in range(0, len(text), size):
        events += stream.feed(text[i:i + size])
    events += stream.finish()
    got_content, got_calls = assemble([e for e in events if e[0] != "reasoning"])
    assert ("".join(e[1] for e in events if e[0] == "reasoning") or None) == reasoning
    assert got_content == content and [(c.name, c.arguments) for c in got_calls] == calls


def test_a_forced_harmony_call_is_the_channel_the_model_was_trained_on():
    from kvcache.server.tool_formats import FORMATS, HARMONY_MARKERS
    from kvcache.server.tools import ToolSpec, tool_grammar

    ids = tuple((m, 200000 + i) for i, m in enumerate(HARMONY_MARKERS))
    fmt = FORMATS["harmony"].__class__(**{**FORMATS["harmony"].__dict__, "ids": ids})
    tool = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    grammar = tool_grammar(ToolSpec((tool,), "required", None, True, fmt=fmt))
    # the markers as their tokens, the text between them as text; one call (<|call|> ends the turn)
    assert 'start: <[200001]> "commentary to=functions." fcall' in grammar
    assert 'fn0: "get_weather" " " <[200006]> "json" <[200002]> args0' in grammar


def _harmony_model(tmp: Path) -> Path:
    """The tiny Qwen model speaking gpt-oss's format: seven of its unused special tokens renamed to
    harmony's markers, gpt-oss's template (llama.cpp's copy)."""
    import gguf

    from convert_matrix import read_gguf, rewrite_gguf
    from qwen_tiny import tiny_qwen
    from kvcache.server.tool_formats import HARMONY_MARKERS

    reader = read_gguf(tiny_qwen())
    tokens = [str(t) for t in reader.fields["tokenizer.ggml.tokens"].contents()]
    for i, marker in enumerate(HARMONY_MARKERS):  # <|object_ref_start|> .. <|vision_start|>: control tokens
        tokens[151646 + i] = marker
    return rewrite_gguf(tiny_qwen(), tmp / "tiny-harmony.gguf", drop=("tokenizer.chat_template", "tokenizer.ggml.tokens"),
                        add={"tokenizer.chat_template": template("openai-gpt-oss-120b"),
                             "tokenizer.ggml.tokens": (tokens, gguf.GGUFValueType.ARRAY)})


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    from test_server import Server

    path = _harmony_model(tmp_path_factory.mktemp("harmony"))
    s = Server(str(path))
    s.path = path  # type: ignore[attr-defined]
    yield s
    s.close()


def test_harmony_replies_end_at_return_or_call_and_not_at_end(harmony):
    from kvcache.engine.llm import LLM

    tok = LLM(str(harmony.path)).tokenizer
    ids = {m: tok.encode(m, add_special_tokens=False) for m in ("<|end|>", "<|return|>", "<|call|>")}
    assert all(len(v) == 1 for v in ids.values())
    assert ids["<|return|>"][0] in tok.eos_token_ids and ids["<|call|>"][0] in tok.eos_token_ids
    assert ids["<|end|>"][0] not in tok.eos_token_ids  # it only ends the analysis before the answer
    assert tok.apply_chat_template(ASK).endswith("<|start|>assistant")


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_served_harmony_channels_and_forced_calls(harmony):
    from kvcache.engine.llm import LLM

    tok = LLM(str(harmony.path)).tokenizer
    t = {m: f"<[{tok.encode(m, add_special_tokens=False)[0]}]>" for m in
         ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")}
    grammar = (f'start: {t["<|channel|>"]} "analysis" {t["<|message|>"]} "two and two" {t["<|end|>"]} '
               f'{t["<|start|>"]} "assistant" {t["<|channel|>"]} "final" {t["<|message|>"]} "four"')
    r = _chat(harmony, max_tokens=40, extra_body={"guided_grammar": grammar})
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == ("two and two", "four")
    raw = _chat(harmony, max_tokens=40, extra_body={"guided_grammar": grammar, "reasoning_format": "none"})
    assert raw.choices[0].message.content.startswith("<|channel|>analysis<|message|>two and two<|end|>")
    client = harmony.client()
    forced = client.chat.completions.create(model=r.model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                            max_tokens=40, temperature=0.0)
    (call,) = forced.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and forced.choices[0].finish_reason in ("tool_calls", "length")
    if forced.choices[0].finish_reason == "tool_calls":
        assert isinstance(json.loads(call.function.arguments)["city"], str)
    name, args = "", ""
    for chunk in client.chat.completions.create(model=r.model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                                max_tokens=40, temperature=0.0, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            name += (d.function.name or "") if d.function else ""
            args += (d.function.arguments or "") if d.function else ""
    assert (name, args) == (call.function.name, call.function.arguments)
    # the call and its result given back render in gpt-oss's own way, and the next turn is served
    follow = client.chat.completions.create(model=r.model, max_tokens=8, temperature=0.0, tools=[WEATHER], messages=ASK + [
        forced.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
