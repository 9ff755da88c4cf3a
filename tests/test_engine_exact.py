"""Exact cache strategies give HF's logits, step by step, for every model family.

HF transformers (its own DynamicCache) is the oracle; recompute-from-scratch (the `none` strategy)
is the oracle for every cache strategy.
"""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES
from kvcache import LLM, SamplingParams
from kvcache.cache.config import parse_kv_spec
from kvcache.engine.runner import ModelRunner

STRATEGIES = ["none", "dynamic,page_size=4", "static,max_tokens=64,page_size=4"]
PROMPT = [5, 17, 42, 8, 99, 23, 4, 61, 77, 12, 30, 3]  # longer than the tiny sliding windows (8)
STEPS = 10


def hf_steps(hf, prompt: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """HF logits after the prompt and after each greedily chosen token (its DynamicCache)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    out = []
    ids = torch.tensor([prompt])
    tokens = []
    with torch.no_grad():
        pos = 0
        for _ in range(steps + 1):
            res = hf(input_ids=ids, past_key_values=cache, use_cache=True,
                     position_ids=torch.arange(pos, pos + ids.shape[1])[None])
            pos += ids.shape[1]
            logits = res.logits[0, -1].float()
            out.append(logits)
            nxt = int(logits.argmax())
            tokens.append(nxt)
            ids = torch.tensor([[nxt]])
    return out, tokens


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv", STRATEGIES)
def test_step_logits_match_hf(tiny_dir, family, kv):
    path, hf = tiny_dir(family)
    llm = LLM(str(path), kv=kv)
    expected, tokens = hf_steps(hf, PROMPT, STEPS)
    runner = llm.runner
    seq = runner.new_sequence()
    feed = list(PROMPT)
    for step in range(STEPS + 1):
        logits = runner.step([seq], [feed])[0]
        torch.testing.assert_close(logits, expected[step], atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"{family} {kv} step {step}: {m}")
        feed = [tokens[step]]
    runner.free(seq)
    llm.check_integrity()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_matches_hf_generate(tiny_dir, family):
    path, hf = tiny_dir(family)
    llm = LLM(str(path), kv="dynamic,page_size=8")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          pad_token_id=1)[0, len(PROMPT):].tolist()
    assert out.token_ids == ref
    assert out.finish_reason == "length"
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0  # the request's pages went back


def test_prefill_in_pieces_equals_one_prefill(tiny_dir):
    """Chunked prefill over a cached prefix (what a chat turn does) gives recompute's logits."""
    path, _ = tiny_dir("gemma3")
    llm = LLM(str(path), kv="dynamic,page_size=4")
    r = llm.runner
    whole = r.step([r.new_sequence()], [PROMPT + PROMPT[:5]])[0]
    seq = r.new_sequence()
    r.step([seq], [PROMPT[:7]])
    r.step([seq], [PROMPT[7:]])
    torch.testing.assert_close(r.step([seq], [PROMPT[:5]])[0], whole, atol=1e-4, rtol=1e-4)


def test_fork_shares_pages_and_stays_exact(tiny_dir):
    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv="dynamic,page_size=4")
    r = llm.runner
    parent = r.new_sequence()
    r.step([parent], [PROMPT[:10]])  # 2 full pages + a partial one
    child = r.fork(parent)
    assert child.kv.pages == parent.kv.pages  # everything shared: nothing copied at fork
    assert llm.kv_stats().pages_used == 3
    a = r.step([parent], [[7]])[0]  # the first writer into the shared partial page copies it
    assert child.kv.pages[:2] == parent.kv.pages[:2] and child.kv.pages[2] != parent.kv.pages[2]
    assert llm.kv_stats().pages_used == 4
    b = r.step([child], [[9]])[0]  # the other branch now owns the original alone: no copy
    assert llm.kv_stats().pages_used == 4 and r.cache.cow_copies == 1
    ref = ModelRunner(llm.model, parse_kv_spec("none"))
    torch.testing.assert_close(a, ref.step([ref.new_sequence()], [PROMPT[:10] + [7]])[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b, ref.step([ref.new_sequence()], [PROMPT[:10] + [9]])[0], atol=1e-4, rtol=1e-4)
    llm.check_integrity()


def test_n_samples_batched_decode(tiny_dir):
    """n greedy samples decode as one flat batch and each equals the single-sample output."""
    path, _ = tiny_dir("qwen3")
    llm = LLM(str(path))
    one = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    many = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, n=3))[0]
    assert [o.token_ids for o in many.outputs] == [one.token_ids] * 3
    s1 = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=2))[0]
    s2 = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=2))[0]
    assert [o.token_ids for o in s1.outputs] == [o.token_ids for o in s2.outputs]
    assert s1.outputs[0].token_ids != s1.outputs[1].token_ids  # different seeds per sample
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0


def test_chat_session_reuses_cache_and_equals_recompute(tiny_dir):
    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv="dynamic,page_size=4")
    fresh = LLM(str(path), kv="none")
    session = llm.chat_session(system="t5 t6 t7")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for turn, user in enumerate(["t10 t11 t12", "t20 t21", "t30 t31 t32 t33"]):
        r = session.send(user, params)
        # recompute: the whole conversation so far, from scratch
        ref = fresh.generate([session.messages[:-1]], params)[0]
        assert r.token_ids == ref.token_ids
        if turn:
            assert r.cached_tokens > 0 and r.cached_tokens < len(r.prompt_token_ids)
    llm.check_integrity()
    session.close()
    assert llm.kv_stats().pages_in_use == 0
