"""Chat templates render as transformers renders them: its tojson (keys in the order given, no
ASCII or HTML escaping), loop controls, raise_exception and strftime_now."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from kvcache.errors import InvalidParams
from kvcache.models.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "météo", "description": "Température à <ville> & 'pays'",
                                           "parameters": {"type": "object", "required": ["ville"],
                                                          "properties": {"ville": {"type": "string"}}}}}]


def tokenizer(template: str) -> Tokenizer:
    backend = Backend(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    return Tokenizer(backend, {"chat_template": template}, {})


def test_tojson_keeps_the_order_and_the_characters_as_transformers_does():
    tok = tokenizer("{% for t in tools %}{{ t | tojson }}\n{% endfor %}")
    text = tok.apply_chat_template([], tools=TOOLS)
    assert text == json.dumps(TOOLS[0], ensure_ascii=False) + "\n"
    assert "météo" in text and "<ville> & 'pays'" in text  # not \\u00e9, not &lt;
    indented = tokenizer("{{ tools[0] | tojson(indent=2) }}").apply_chat_template([], tools=TOOLS)
    assert indented == json.dumps(TOOLS[0], ensure_ascii=False, indent=2)


def test_loop_controls_and_raise_exception():
    tok = tokenizer("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                    "{{ m.content }};{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}")
    msgs = [{"role": "system", "content": "s"}] + [{"role": "user", "content": str(i)} for i in range(5)]
    assert tok.apply_chat_template(msgs) == "0;1;"
    with pytest.raises(InvalidParams, match="chat template: no tools here"):
        tokenizer("{{ raise_exception('no tools here') }}").apply_chat_template([])
