"""Fidelity metrics on a tiny model where the answers are known, and the eval command's bad input."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import run_kvcache

from kvcache import LLM
from kvcache.errors import InvalidParams
from kvcache.eval.fidelity import builtin_text, compare

IDS = [(7 * i * i + 3 * i + 5) % 150 for i in range(120)]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    path, hf = tiny_dir("llama")
    return LLM(str(path)), hf


def test_full_cache_perplexity_equals_transformers(tiny):
    llm, hf = tiny
    with torch.no_grad():
        logits = hf(torch.tensor([IDS])).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(IDS[1:]))
    f = compare(llm.model, IDS, "dynamic", chunk=16)
    assert f.ppl == pytest.approx(f.ppl_full) and f.agreement == 1.0 and abs(f.kl) < 1e-9
    assert f.ppl_full == pytest.approx(math.exp(float(nll)), rel=1e-4)
    assert f.tokens == len(IDS) - 1


def test_lossless_settings_are_measured_lossless_and_lossy_ones_are_not(tiny):
    llm, _ = tiny
    wide = compare(llm.model, IDS, "window=512", chunk=16)  # the window holds the whole text
    assert wide.agreement == 1.0 and wide.kl < 1e-8
    narrow = compare(llm.model, IDS, "window=8", chunk=16)
    sinks = compare(llm.model, IDS, "sinks=2,window=8", chunk=16)
    int2 = compare(llm.model, IDS, "int2,group_size=8,page_size=8,residual=0", chunk=16)
    for f in (narrow, sinks, int2):
        assert f.kl > 1e-4 and f.ppl != f.ppl_full
    assert narrow.bytes_per_token < wide.bytes_per_token


def test_bad_input(tiny, tmp_path):
    llm, _ = tiny
    with pytest.raises(InvalidParams, match="at least 2 tokens"):
        compare(llm.model, [5], "int8")
    with pytest.raises(InvalidParams, match="chunk must be at least 1"):
        compare(llm.model, IDS, "int8", chunk=0)
    assert len(builtin_text()) > 100_000
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    r = run_kvcache("eval", "--text", str(empty), timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == f"kvcache: {empty} is empty: nothing to evaluate"
    r = run_kvcache("eval", "--tokens", "1", timeout=300)
    assert r.returncode == 2 and "--tokens must be at least 2" in r.stderr
    r = run_kvcache("eval", "--kv", "none", timeout=300)
    assert r.returncode == 2 and "'none' recomputes exactly" in r.stderr


def test_eval_command_on_the_default_model(tmp_path):
    out = tmp_path / "e.json"
    r = run_kvcache("eval", "--tokens", "200", "--kv", "int8;sinks=4,window=64", "--passkey-tokens", "300",
                    "--passkey-depths", "0.1", "--greedy-tokens", "16", "--json", str(out), timeout=600)
    assert r.returncode == 0, r.stderr
    assert "dynamic,int8" in r.stdout and "window=64,sinks=4" in r.stdout
    import json

    rows = json.loads(out.read_text())["results"]
    assert rows[0]["agreement"] > 0.95 and rows[1]["kl"] > rows[0]["kl"]
    # the key at a tenth of 300 tokens: int8 holds it, a window of 64 (and 4 sinks) lost it long ago
    assert rows[0]["passkey"]["found"] == [True] and rows[1]["passkey"]["found"] == [False]


def test_passkey_prompt_and_retrieval(smollm, tmp_path):
    from kvcache.eval.passkey import passkey, passkey_prompt

    ids = passkey_prompt(smollm.tokenizer, 400, 0.25, 51234)
    text = smollm.tokenizer.decode(ids)
    unit = len(smollm.tokenizer.encode("The grass is green. The sky is blue. The sun is yellow. Here we go. "
                                       "There and back again. "))
    assert 400 - unit <= len(ids) <= 405 and text.endswith("The pass key is")
    assert 0.15 < text.index("51234") / len(text) < 0.35
    full = passkey(smollm, "dynamic", 400, (0.1, 0.5))
    blind = passkey(smollm, "window=32", 400, (0.1, 0.5))  # the key left the window long ago
    assert full.accuracy == 1.0 and blind.accuracy == 0.0
    r = run_kvcache("eval", "--tokens", "64", "--kv", "int8", "--passkey-depths", "0.5,2", timeout=300)
    assert r.returncode == 2 and "--passkey-depths takes numbers between 0 and 1" in r.stderr
    plot = tmp_path / "f.png"
    r = run_kvcache("eval", "--tokens", "64", "--kv", "int8", "--passkey-tokens", "0", "--plot", str(plot),
                    timeout=300)
    assert r.returncode == 0, r.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_greedy_agreement(smollm):
    from kvcache.eval.passkey import greedy_agreement

    ids = smollm.encode(builtin_text())[:120]
    assert greedy_agreement(smollm, "window=512", ids, 16) == 1.0  # the window holds everything
    assert greedy_agreement(smollm, "window=8", ids, 16) < 1.0
    r = run_kvcache("eval", "--tokens", "64", "--greedy-tokens", "-1", timeout=300)
    assert r.returncode == 2 and "--greedy-tokens must be 0 (skip) or more" in r.stderr
