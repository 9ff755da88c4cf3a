"""Chat templates render as transformers renders them, on the 71 real templates llama.cpp ships
(``make llama-src`` unpacks them): a fixed set of conversations (system, tools, tool calls and
their results) gives the same text, hence the same token ids, through kvcache's renderer and
transformers' ``apply_chat_template`` for every template both can render; a template that one
refuses the other refuses too. Qwen2.5's template is checked to the token with its real tokenizer.

And the tool-call format kvcache reads from each template (server/tool_formats.py) is pinned in a
table, so that a change of detection shows up here."""

from __future__ import annotations

import copy
import glob
import os
import re
from pathlib import Path

import pytest

from kvcache.errors import InvalidParams
from kvcache.server.tool_formats import format_name

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = sorted(glob.glob(str(ROOT / ".venv/llama.cpp/src/llama_cpp_python-*/vendor/llama.cpp/models/templates/*.jinja")))

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Température actuelle à <ville> & 'pays'.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "la ville"},
                                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": {"city": "Paris", "unit": "celsius"}}}
CONVERSATIONS = {
    "plain": ([{"role": "user", "content": "Bonjour, ça va ?"}], None),
    "system": ([{"role": "system", "content": "Tu es concis."}, {"role": "user", "content": "Deux et deux ?"},
                {"role": "assistant", "content": "Quatre."}, {"role": "user", "content": "Et trois ?"}], None),
    "tools": ([{"role": "system", "content": "Use tools when they help."},
               {"role": "user", "content": "Quel temps fait-il à Paris ?"}], [WEATHER]),
    "tool round trip": ([{"role": "user", "content": "Quel temps fait-il à Paris ?"},
                         {"role": "assistant", "content": None, "tool_calls": [CALL]},
                         {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
                          "content": '{"temp": 21, "sky": "clair"}'}], [WEATHER]),
}


def _names() -> list[str]:
    return [Path(t).stem for t in TEMPLATES]


def _backend():
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return backend


def _ours(template: str):
    """kvcache's tokenizer with ``template`` (compiled on its first render, once, as a model's is).
    The render deadline is widened: this compares texts, and under a loaded test run one large
    template's first render with tools (compile included) took over the default second once."""
    from kvcache.models.tokenizer import Tokenizer

    return Tokenizer(_backend(), {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}, {},
                     template_timeout=30.0)


def _render_both(template: str, messages: list[dict], tools: list[dict] | None, ours=None):
    """(kvcache's text or its error, transformers' text or its error); ``ours``: kvcache's tokenizer
    with ``template`` (a new one by default)."""
    from transformers import PreTrainedTokenizerFast

    extra = {"tools": copy.deepcopy(tools)} if tools else {}
    ours = ours if ours is not None else _ours(template)
    theirs = PreTrainedTokenizerFast(tokenizer_object=_backend(), bos_token="<s>", eos_token="</s>")
    out = []
    for render in (lambda: ours.apply_chat_template(copy.deepcopy(messages), **extra),
                   lambda: theirs.apply_chat_template(copy.deepcopy(messages), chat_template=template,
                                                      tokenize=False, add_generation_prompt=True, **extra)):
        try:
            out.append(render())
        except Exception as e:  # a template's own refusal (raise_exception) or a render error
            out.append(e)
    return out


@pytest.fixture(scope="module")
def templates():
    if not TEMPLATES:
        pytest.skip("llama.cpp's templates are not unpacked (make llama-src; make setup-test does it)")
    return {Path(t).stem: Path(t).read_text() for t in TEMPLATES}


def test_every_template_renders_as_transformers_renders_it(templates):
    rendered, refused, differ = 0, 0, []
    for name, template in templates.items():
        tok = _ours(template)  # one tokenizer a template, rendering every conversation (transformers caches too)
        for what, (messages, tools) in CONVERSATIONS.items():
            ours, theirs = _render_both(template, messages, tools, tok)
            if isinstance(theirs, Exception):  # not a render both can do (kvcache may: it passes no
                refused += 1                     # tools=None to a template that iterates tools)
                continue
            if isinstance(ours, Exception) or ours != theirs:
                differ.append(f"{name} / {what}: {ours if isinstance(ours, Exception) else 'text differs'}")
                continue
            rendered += 1
    print(f"{len(templates)} templates x {len(CONVERSATIONS)} conversations: {rendered} rendered the same, "
          f"{refused} refused by transformers")
    assert not differ, "\n".join(differ)
    assert rendered >= 3 * len(templates)


def test_template_errors_are_one_line_invalid_params(templates):
    bad = "{{ raise_exception('tool calls need ids of 9 characters') }}"
    ours, theirs = _render_both(bad, [{"role": "user", "content": "x"}], None)
    assert isinstance(ours, InvalidParams) and "9 characters" in str(ours) and "\n" not in str(ours)
    assert isinstance(theirs, Exception)


END = re.compile(r"(?:<\|[^<>|]*\|>|</s>|\s)+$")
FORMATS = {  # what kvcache reads from the templates people run most (server/tool_formats.py)
    "Qwen-Qwen2.5-7B-Instruct": "hermes", "Qwen-Qwen3-0.6B": "hermes", "Qwen-QwQ-32B": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes", "ibm-granite-granite-4.0": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3", "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3", "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral-args", "unsloth-mistral-Devstral-Small-2507": "mistral-args",
    "ibm-granite-granite-3.3-2B-Instruct": "granite", "openai-gpt-oss-120b": "harmony",
    # formats kvcache does not read: the tools go in a system turn in the default format
    "Qwen3-Coder": "default", "moonshotai-Kimi-K2": "default",
    "microsoft-Phi-3.5-mini-instruct": "default", "google-gemma-2-2b-it": "default",
}


def test_the_tool_format_of_each_template(templates):
    got = {name: format_name(templates[name]) for name in FORMATS}
    assert got == FORMATS
    counts: dict[str, int] = {}
    for template in templates.values():
        counts[format_name(template)] = counts.get(format_name(template), 0) + 1
    print("formats of the shipped templates:", dict(sorted(counts.items())))


def test_the_parser_reads_the_calls_each_template_writes(templates):
    """For every template whose format kvcache reads: the assistant turn the template writes for a
    call (with transformers' renderer) parses back into that call."""
    from kvcache.server.tool_formats import tool_format
    from kvcache.server.tools import ToolSpec, parse_output

    user = [{"role": "user", "content": "Quel temps fait-il à Paris ?"}]
    call_turn = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    checked, wrong = [], []
    for name, template in templates.items():
        fmt = tool_format(template)
        if not fmt.native:
            continue
        head, _ = _render_both(template, user, [WEATHER])
        whole, _ = _render_both(template.replace("add_generation_prompt", "false"), user + [call_turn], [WEATHER])
        if isinstance(head, Exception) or isinstance(whole, Exception) or not whole.startswith(head):
            continue  # a template that re-renders earlier turns differently: no turn to cut out
        turn = END.sub("", whole[len(head):])  # the end-of-turn token: EOS ends a sample, never in its text
        if "get_weather" not in turn:
            continue  # a template that does not write earlier calls back
        spec = ToolSpec(tools=(WEATHER["function"],), choice="auto", name=None, parallel=True, fmt=fmt)
        _, calls = parse_output(turn, spec)
        if [(c.name, c.arguments) for c in calls] != [("get_weather", '{"city": "Paris", "unit": "celsius"}')]:
            wrong.append(f"{name} ({fmt.name}) wrote {turn!r}")
        checked.append(name)
    print(f"{len(checked)} templates' own calls parsed back:", ", ".join(checked))
    assert not wrong, "\n".join(wrong)
    assert {"Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "meta-llama-Llama-3.1-8B-Instruct",
            "mistralai-Mistral-Nemo-Instruct-2407", "unsloth-mistral-Devstral-Small-2507",
            "Mistral-Small-3.2-24B-Instruct-2506", "unsloth-Apriel-1.5", "openai-gpt-oss-120b"} <= set(checked)


def test_mistral_templates_get_call_ids_of_nine_characters(templates):
    """Mistral's templates refuse a call id that is not 9 letters or digits; kvcache's are
    ``call_`` and 24 hex digits, so the history's ids are written as 9 of them (the same for the call
    and its result), and the conversation renders."""
    from kvcache.server.tool_formats import tool_format
    from kvcache.server.tools import ToolSpec, render

    call_id = "call_" + "ab12" * 6
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "get_weather",
                                                                    "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": call_id, "content": "21 C"}]
    for name in ("mistralai-Mistral-Nemo-Instruct-2407", "Mistral-Small-3.2-24B-Instruct-2506"):
        fmt = tool_format(templates[name])
        msgs, extra = render(messages, ToolSpec((WEATHER["function"],), "auto", None, True, fmt=fmt),
                             templates[name], fmt)
        short = msgs[1]["tool_calls"][0]["id"]
        assert len(short) == 9 and short.isalnum() and msgs[2]["tool_call_id"] == short
        ours, theirs = _render_both(templates[name], msgs, extra["tools"])
        assert isinstance(ours, str) and ours == theirs and short in ours, (name, ours)
        raw, _ = _render_both(templates[name], [dict(m) for m in msgs[:1]] + [
            {**msgs[1], "tool_calls": [{**msgs[1]["tool_calls"][0], "id": call_id}]}], extra["tools"])
        assert isinstance(raw, Exception) and "9" in str(raw)  # what the ids as they came would give
