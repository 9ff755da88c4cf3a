"""``kvcache bench structured``: a short run in this process writes its rows, every constrained output
validates against the schema; the engines' child processes and the suite's refusals."""

from __future__ import annotations

import json
import sys

from kvcache.bench import structured as sb
from kvcache.cli import main
from kvcache.peers import grammar_engines


def test_a_short_run_writes_positive_rows_and_valid_outputs(tmp_path, capsys):
    path = tmp_path / "structured.json"
    assert main(["bench", "structured", "--requests", "2", "--repeats", "1", "--peers", "llguidance",
                 "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["meta"]["torch"] and data["meta"]["schema"] == sb.SCHEMA
    rows = {r["batch"]: r for r in data["results"]}
    assert set(rows) == {2, 1} and rows[2]["requests"] == 2 and rows[1]["requests"] == 2
    for r in rows.values():
        assert r["tokens"] > 0 and r["free_tokens"] == r["constrained_tokens"] == r["tokens"]
        for key in ("free_tok_s", "constrained_tok_s", "ratio", "free_step_ms", "constrained_step_ms",
                    "mask_us_per_token", "mask_ms_per_step", "mask_share"):
            assert r[key] > 0, key
        assert r["outputs"] == 2 * r["requests"] and r["valid"] == r["outputs"]  # warm-up and timed run
        assert r["finish"] == ["stop"] and sb.valid(r["sample_output"])
    comp = data["compile"]
    assert 0 < comp["lookup_s"] <= comp["cached_s"] < comp["cold_s"]
    (eng,) = data["engines"]
    assert eng["engine"] == "llguidance" and eng["accepted"] is True and eng["note"] == ""
    assert eng["tokens"] > 20 and eng["version"]
    for key in ("tokenizer_s", "compile_s", "first_mask_us", "cold_mean_us", "mask_mean_us", "mask_max_us",
                "advance_us"):
        assert eng[key] > 0, key
    assert "compared: output tokens / wall time" in printed and "llguidance" in printed
    assert "4/4" in printed  # every constrained output valid, in the table


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
