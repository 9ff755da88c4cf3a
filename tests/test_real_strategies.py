"""Cache strategies on the bundled SmolLM2-135M-Instruct: exact ones give recompute's logits,
lossy ones are measured against the full cache."""

from __future__ import annotations

import pydoc_data.topics

import pytest
import torch
from conftest import run_kvcache

from kvcache.cache.config import parse_kv_spec
from kvcache.engine.runner import ModelRunner

TEXT = " ".join(list(pydoc_data.topics.topics.values())[:6])


@pytest.fixture(scope="module")
def ids(smollm):
    return smollm.encode(TEXT)[:320]


@pytest.fixture(scope="module")
def reference(smollm, ids):
    """Recompute-from-scratch logits after the prompt and after each of 4 forced tokens."""
    runner = ModelRunner(smollm.model, parse_kv_spec("none"))
    seq = runner.new_sequence()
    out = [runner.step([seq], [ids[:-4]])[0]]
    for t in ids[-4:]:
        out.append(runner.step([seq], [[t]])[0])
    return out


def run(smollm, spec, ids):
    runner = ModelRunner(smollm.model, parse_kv_spec(spec))
    seq = runner.new_sequence()
    out = [runner.step([seq], [ids[:-4]])[0]]
    for t in ids[-4:]:
        out.append(runner.step([seq], [[t]])[0])
    stats = runner.stats()
    runner.free(seq)
    runner.check_integrity()
    return out, stats


@pytest.mark.parametrize("spec", ["dynamic", "static,max_tokens=512", "offloaded", "offloaded_static,max_tokens=512",
                                  "disk", "dynamic,page_size=7"])
def test_exact_strategies_equal_recompute(smollm, ids, reference, spec, tmp_path):
    spec = spec + (f",dir={tmp_path}" if spec == "disk" else "")
    got, _ = run(smollm, spec, ids)
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_quantized_fidelity_and_bytes(smollm, ids, reference):
    """Errors grow as bits shrink; int4 holds at most 0.3x the bytes of fp32, scales and the
    fp32 window included (measured at this prompt's length)."""
    worst, agree, used = {}, {}, {}
    _, full = run(smollm, "dynamic", ids)
    for bits in (8, 4, 2):
        got, stats = run(smollm, f"int{bits},residual=32", ids)
        worst[bits] = max(float((a - b).abs().max()) for a, b in zip(got, reference))
        agree[bits] = sum(int(a.argmax() == b.argmax()) for a, b in zip(got, reference))
        used[bits] = stats.bytes_used / full.bytes_used
    assert worst[8] < worst[4] < worst[2]
    assert worst[8] < 0.5 and agree[8] == 5 and agree[4] >= 4
    assert used[8] < 0.4 and used[4] < 0.3 and used[2] < used[4]


def test_sink_and_window_logits_equal_full_while_everything_fits(smollm, ids, reference):
    got, stats = run(smollm, "sinks=4,window=1024", ids)
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    narrow, stats = run(smollm, "sinks=4,window=64", ids)
    assert stats.pages_used <= 1 + 64 // 16 + 1  # a sink page and the window's pages, not 20
    assert max(float((a - b).abs().max()) for a, b in zip(narrow, reference)) > 1e-3  # it did drop tokens


kvcache = run_kvcache


def test_cli_prompt_cache_and_stats(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("The lighthouse keeper climbed the stairs at dusk. He found a bottle with a note that said")
    out = tmp_path / "p.kv"
    # fp32 weights: the text must be the same token for token (with int8 activations, a different
    # attention path may round one activation the other way; tests/test_qweights.py bounds that)
    r = kvcache("cache-prompt", "--prompt-file", str(prompt), "--out", str(out), "--weights", "fp32")
    assert r.returncode == 0, r.stderr
    assert "cached" in r.stderr and out.stat().st_size > 0
    direct = kvcache("generate", prompt.read_text() + " hello", "-n", "12", "--weights", "fp32")
    resumed = kvcache("generate", "--prompt-cache", str(out), " hello", "-n", "12", "--stats", "--weights", "fp32")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout == direct.stdout
    assert "B/token" in resumed.stderr and resumed.stderr.count("\n") > 30  # a row per layer
    bad = kvcache("generate", "--prompt-cache", str(out), "x", "--kv", "int8", "--weights", "fp32")
    assert bad.returncode == 2 and "does not fit this cache: encoding='fp32' (here 'int8')" in bad.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    r = kvcache("cache-prompt", "--prompt-file", str(empty), "--out", str(tmp_path / "e.kv"))
    assert r.returncode == 2 and "is empty" in r.stderr


@pytest.mark.parametrize("spec,message", [
    ("sinks=8,window=8", "window (8) must be larger than sinks (8)"),
    ("int3", "unknown --kv item 'int3'"),
    ("bits=3", "bits must be 8, 4 or 2"),
    ("int4,residual=-1", "residual (the fp32 window of recent tokens) must be 0 or more"),
    ("none,int4", "'none' strategy keeps no cache"),
    ("sinks=4", "sinks=4 needs a window"),
    ("int4,page_size=20,group_size=8", "must be a multiple of group_size"),
])
def test_impossible_specs_are_refused_on_the_command_line(spec, message):
    r = kvcache("generate", "hi", "--kv", spec)
    assert r.returncode == 2
    assert message in r.stderr and r.stderr.count("\n") == 1
