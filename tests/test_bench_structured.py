"""``kvcache bench structured``: a short run in this process writes its rows, every constrained output
validates against the schema; the engines' child processes and the suite's refusals."""

from __future__ import annotations

import json
import sys

from kvcache.bench import structured as sb
from kvcache.cli import main
from kvcache.peers import grammar_engines


def test_the_schema_the_sample_and_fresh_schemas():
    assert sb.valid(json.dumps(sb.SAMPLE)) and not sb.valid(json.dumps({**sb.SAMPLE, "rating": 11}))
    assert not sb.valid("{\"name\": ") and not sb.valid(json.dumps({**sb.SAMPLE, "extra": 1}))
    a, b = sb.fresh_schema(), sb.fresh_schema()
    assert a != b and json.dumps(sb.SCHEMA) not in (json.dumps(a), json.dumps(b))
    assert not sb.valid(json.dumps(sb.SAMPLE), a)  # the fresh property is required


def test_an_engine_that_is_missing_or_unknown_is_a_skipped_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    row = grammar_engines._engine_child({"engine": "xgrammar"})
    assert row["mask_mean_us"] is None and "pip install 'kvcache[xgrammar]'" in row["note"]
    row = grammar_engines.engine_row("nothing", "/nonexistent/tokenizer.json", 32, [0], [1, 2], 1, "{}", {}, 1)  # a child
    assert row["engine"] == "nothing" and row["compile_s"] is None and "unknown grammar engine" in row["note"]


def test_structured_refusals(capsys):
    assert main(["bench", "structured", "--peers", "outlines"]) == 2
    assert "unknown grammar engine 'outlines'" in capsys.readouterr().err
    assert main(["bench", "structured", "--kv", "int8"]) == 2
    assert "--kv does not apply to the structured suite" in capsys.readouterr().err
    assert main(["bench", "structured", "--new-tokens", "4"]) == 2
    assert "at least 16" in capsys.readouterr().err
