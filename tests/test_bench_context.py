"""``kvcache bench context`` and ``kvcache bench growth`` through the console command."""

from __future__ import annotations

import json

import pytest

from conftest import run_kvcache

from kvcache.bench.context_lengths import parse_contexts
from kvcache.bench.growth import bucket_label, buckets
from kvcache.cliargs import split_specs
from kvcache.errors import InvalidParams

FP32_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V x layers x KV heads x head_dim x fp32


kvcache = run_kvcache


def test_context_quick_writes_a_row_per_spec_and_context(tmp_path):
    out = tmp_path / "context.json"
    p = kvcache("bench", "context", "--quick", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "context 256 tokens" in p.stdout and "context 1024 tokens" in p.stdout
    data = json.loads(out.read_text())
    rows = {(r["spec"], r["context"]): r for r in data["results"]}
    assert set(rows) == {(s, c) for s in ("dynamic", "static") for c in (256, 1024)}
    for (spec, context), r in rows.items():
        assert r["tok_s"] > 0 and r["prefill_s"] > 0 and r["gb_s"] > 0
        assert r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"]
        assert r["tokens_stored"] == context + 16 - 1  # the prompt and every new token but the last
        assert r["kv_bytes_per_token"] == FP32_BYTES_PER_TOKEN  # both are fp32, full context
        assert r["bytes_vs_ref"] == 1.0
    assert all(rows[("dynamic", c)]["tok_s_vs_ref"] == 1.0 for c in (256, 1024))
    assert data["meta"]["reference"] == "dynamic" and data["meta"]["new_tokens"] == 16


def test_context_repeats_reuse_the_prompt_unless_a_window_dropped_it(tmp_path):
    out = tmp_path / "context.json"
    p = kvcache("bench", "context", "--contexts", "64", "--new-tokens", "40", "--repeats", "2",
                "--kv", "dynamic;window=32", "--json", str(out))
    assert p.returncode == 0, p.stderr
    rows = {r["spec"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["dynamic"]["full_prefills"] == 1 and rows["window=32"]["full_prefills"] == 2
    assert all(r["tok_s_min"] > 0 for r in rows.values())
    # a window holds its last 32 tokens and the pages being filled, not all 103
    assert rows["window=32"]["kv_bytes_per_token"] < FP32_BYTES_PER_TOKEN


def test_growth_quick_reports_buckets(tmp_path):
    out = tmp_path / "growth.json"
    p = kvcache("bench", "growth", "--quick", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "0-1k" in p.stdout and "1k-2k" in p.stdout and "total s" in p.stdout
    data = json.loads(out.read_text())
    assert [b["bucket"] for b in data["buckets"]] == ["0-1k", "1k-2k"]
    for b in data["buckets"]:
        assert b["kvcache_us"] > 0 and b["transformers_us"] > 0 and b["ratio"] > 0
    assert data["total"]["kvcache_s"] > 0 and data["total"]["transformers_s"] > 0
    assert data["meta"]["max_context"] == 2048


@pytest.mark.parametrize("value, message", [
    ("512,abc", "'abc' is not an integer"),
    ("1", "1 is too short"),
    ("8190", "8190 + 64 new tokens exceeds the model's context of 8192"),
    (",", "at least one context"),
])
def test_bad_contexts_exit_2_naming_the_value(value, message):
    p = kvcache("bench", "context", "--contexts", value)
    assert p.returncode == 2
    assert p.stderr.startswith("kvcache: --contexts") and message in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, flag", [
    (("growth", "--contexts", "512"), "--contexts"),
    (("growth", "--kv", "dynamic"), "--kv"),
    (("context", "--peers", "dynamic"), "--peers"),
    (("decode", "--max-context", "64"), "--max-context"),
])
def test_options_of_another_suite_are_refused(args, flag):
    p = kvcache("bench", *args)
    assert p.returncode == 2
    assert p.stderr.startswith(f"kvcache: {flag} does not apply to the {args[0]} suite")


def test_spec_and_context_parsing():
    assert split_specs("dynamic,fp16,int8,int4,sink") == ["dynamic", "fp16", "int8", "int4", "sink"]
    assert split_specs("dynamic,int8,sinks=4,window=1024") == ["dynamic", "int8,sinks=4,window=1024"]
    assert split_specs("static,int4;dynamic") == ["static,int4", "dynamic"]
    assert parse_contexts("2048, 512,512") == [512, 2048]
    with pytest.raises(InvalidParams, match="--contexts"):
        parse_contexts("0")


def test_growth_buckets():
    assert [bucket_label(a, b) for a, b in buckets(8192)] == ["0-1k", "1k-2k", "2k-4k", "4k-8k"]
    assert buckets(3000) == [(0, 1024), (1024, 2048), (2048, 3000)]
    assert buckets(100) == [(0, 100)]
    with pytest.raises(InvalidParams, match="--max-context"):
        buckets(1)
