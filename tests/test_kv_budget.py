"""A memory budget for the dynamic pool: it never grows past it (requests wait or are preempted and
resumed, cached pages are evicted first), a request that could never fit is refused naming the
budget, and an idle pool gives its spare pages back (pages in use are moved, holders follow)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvcache import LLM, SamplingParams
from kvcache.cache.budget import parse_budget, ram_bytes
from kvcache.cache.config import CacheConfig, parse_kv_spec
from kvcache.engine.scheduler import Request, Scheduler, SchedulerConfig
from kvcache.errors import ContextOverflow, InvalidParams
from kvcache.prefix.config import PrefixConfig

from test_prefix import _recompute
from test_server import Server, _model

PAGE = 3 * 2 * 2 * 16 * 4 * 4  # tiny Llama: 3 layers x K,V x 2 heads x 16 dims x fp32 x 4 tokens = 3 KiB
BUDGET = 40 * PAGE  # 160 tokens


def test_budgets_parse_and_are_checked():
    assert parse_budget("2") == 2 << 30 and parse_budget("512MiB") == 512 << 20 and parse_budget("1.5GB") == 1_500_000_000
    assert parse_budget("4096B") == 4096 and abs(parse_budget("25%") - ram_bytes() // 4) <= 1
    for bad in ("", "two", "-1", "0", "0%", "150%", "5 parsecs"):
        with pytest.raises(InvalidParams):
            parse_budget(bad)
    cfg = parse_kv_spec("dynamic,page_size=4,budget=96KiB")
    assert cfg.budget == 96 << 10 and parse_kv_spec(cfg.spec()) == cfg
    with pytest.raises(InvalidParams, match="dynamic capacity only"):
        CacheConfig(capacity="static", budget=1 << 20)


@pytest.fixture(scope="module")
def tiny_path(tiny_dir):
    return str(tiny_dir("llama")[0])


def _prompts(k: int, length: int = 30) -> list[list[int]]:
    return [[(7 * i + 3 * j + 5) % 150 for j in range(length)] for i in range(k)]


def test_the_pool_never_passes_its_budget_and_every_request_finishes(tiny_path):
    budget = 24 * PAGE  # 96 tokens
    spec = f"dynamic,page_size=4,initial_tokens=16,budget={budget}B"
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    free = LLM(tiny_path, kv="dynamic,page_size=4", prefix=False)
    want = free.generate(_prompts(6, 20), params)
    llm = LLM(tiny_path, kv=spec)  # with the prefix cache: its pages are evicted at the budget
    sched = Scheduler(llm.runner, llm.tokenizer, SchedulerConfig(max_running=6, max_batch_tokens=64))
    reqs = [Request(str(i), p, params) for i, p in enumerate(_prompts(6, 20))]  # 40 tokens each: 6 x 10 pages
    for r in reqs:
        sched.add(r)
    worst = 0
    while sched.has_work:
        sched.step()
        worst = max(worst, sum(p.nbytes for p in llm.runner.cache.pools))
    assert [r.samples[0].tokens for r in reqs] == [w.token_ids for w in want] and not any(r.error for r in reqs)
    assert budget // 2 < worst <= budget
    assert sched.preemptions > 0
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0


def test_a_request_that_could_never_fit_is_refused_naming_the_budget(tiny_path):
    llm = LLM(tiny_path, kv=f"dynamic,page_size=4,initial_tokens=16,budget={BUDGET}B")
    assert llm.runner.capacity == 160 and "KV budget" in llm.runner.cache.capacity_reason()
    with pytest.raises(ContextOverflow, match="160 tokens"):
        llm.generate([_prompts(1, 170)[0]], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidParams, match="smaller than one page of every layer"):
        LLM(tiny_path, kv="dynamic,page_size=4,budget=1KiB")


def test_an_idle_pool_gives_pages_back_and_hits_survive_the_move(tiny_path):
    llm = LLM(tiny_path, kv="dynamic,page_size=4,initial_tokens=8", prefix=PrefixConfig(max_cached_tokens=44))
    a, b = _prompts(2, 44)
    llm.generate([a, b], SamplingParams(max_tokens=1))  # together: A's pages low, B's above them
    cache = llm.runner.cache
    grown = cache.pools[0].num_pages
    held = sorted(llm.runner.prefix.index.held_pages()[0])
    assert len(held) == 11 and min(held) >= 11 and grown > 11  # only B's pages stay cached, above A's freed ones
    given = cache.shrink()
    assert given == (grown - cache.pools[0].num_pages) * cache.pools[0].page_bytes > 0
    assert cache.pools[0].num_pages == len(held) and max(llm.runner.prefix.index.held_pages()[0]) < len(held)
    llm.check_integrity()
    seq = llm.runner.lookup(b[:-1] + [9])
    assert len(seq.tokens) == 43
    logits = llm.runner.step([seq], [[9]])[0]
    torch.testing.assert_close(logits, _recompute(llm, b[:-1] + [9]), atol=1e-4, rtol=1e-4)
    llm.runner.release(seq)
    llm.clear_prefix_cache()
    assert cache.shrink() > 0 and cache.pools[0].num_pages == 2  # back to its initial size
    llm.check_integrity()


@pytest.fixture(scope="module")
def budget_server(tiny_path):
    s = Server(tiny_path, "--kv", "dynamic,page_size=4,initial_tokens=16", "--kv-budget", f"{BUDGET}B",
               "--max-batch-tokens", "64")
    yield s
    s.close()


def test_a_server_at_its_budget_serves_everyone_in_turn(budget_server):
    s = budget_server
    c = s.client()

    def one(p: list[int]) -> tuple[int, str]:
        r = c.completions.create(model=_model(s), prompt=p, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens, r.choices[0].finish_reason

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, _prompts(12)))
    assert results == [(40, "length")] * 12
    stats = s.stats()
    assert stats["kv"]["bytes_allocated"] <= BUDGET and stats["integrity"] == "ok"
    assert stats["kv"]["pages_in_use"] == 0
    code, err = s.post("/v1/completions", json.dumps({"model": _model(s), "prompt": _prompts(1, 170)[0]}).encode())
    assert code == 400 and "--kv-budget" in err["error"]["message"] and err["error"]["param"] == "prompt"
