"""Continuous batching: batched, chunked and preempted runs give what one-at-a-time runs give."""

from __future__ import annotations

import threading

import pytest

from kvcache import LLM, SamplingParams
from kvcache.engine.loop import EngineLoop
from kvcache.engine.scheduler import Request, Scheduler, SchedulerConfig
from kvcache.errors import CacheFull, ContextOverflow, InvalidParams

PROMPTS = [[5, 17, 42, 8, 99, 23, 4, 61, 77, 12, 30, 3], [7, 8, 9], [5, 17, 42, 8, 11, 12, 13, 14, 15],
           list(range(20, 45)), [100, 101, 102, 103, 104, 105, 106]]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tiny_dir):
    return str(tiny_dir("llama")[0])


def one_by_one(path: str, spec: str) -> list[list[int]]:
    llm = LLM(path, kv=spec, prefix=False)
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(tiny_path):
    return one_by_one(tiny_path, "dynamic,page_size=4")


@pytest.mark.parametrize("spec,config", [
    ("dynamic,page_size=4", SchedulerConfig()),
    ("dynamic,page_size=4", SchedulerConfig(max_batch_tokens=4)),  # prompts prefill in chunks of 4
    ("dynamic,page_size=4", SchedulerConfig(max_running=2)),  # the rest wait their turn
    ("static,max_tokens=64,max_seqs=5,page_size=4", SchedulerConfig(max_batch_tokens=16)),
])
def test_batched_runs_equal_one_at_a_time(tiny_path, reference, spec, config):
    llm = LLM(tiny_path, kv=spec)
    outs = llm.generate_batch(PROMPTS, GREEDY, scheduler=config)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0


def test_decoding_goes_on_while_a_long_prompt_prefills(tiny_path):
    llm = LLM(tiny_path, kv="dynamic,page_size=4", prefix=False)
    sched = Scheduler(llm.runner, llm.tokenizer, SchedulerConfig(max_batch_tokens=6))
    short = Request("short", [7, 8, 9], SamplingParams(max_tokens=100, ignore_eos=True))  # outlasts the prefill
    sched.add(short)
    sched.step()  # short is prefilled and has its first token
    long = Request("long", list(range(20, 80)), SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add(long)
    progress = []
    while long.samples[0].feed or long.cached_tokens < 0:
        sched.step()
        progress.append(len(short.samples[0].tokens))
    assert len(progress) >= 10  # 60 prompt tokens in chunks of at most 5 beside the decode
    assert progress == sorted(progress) and progress[-1] - progress[0] == len(progress) - 1  # a token every step


def test_preemption_under_a_small_pool_completes_every_request(tiny_path, reference):
    llm = LLM(tiny_path, kv="static,max_tokens=24,max_seqs=2,page_size=4")  # 12 pages for 5 requests
    sched = Scheduler(llm.runner, llm.tokenizer, SchedulerConfig(max_batch_tokens=64))
    reqs = [Request(str(i), p, GREEDY) for i, p in enumerate(PROMPTS[:3] + PROMPTS[4:])]
    for r in reqs:
        sched.add(r)
    finished = []
    while sched.has_work:
        finished += sched.step()
        llm.check_integrity()
    assert sched.preemptions > 0
    assert sorted(r.request_id for r in finished) == ["0", "1", "2", "3"]
    assert [r.output().token_ids for r in reqs] == reference[:3] + reference[4:]
    assert llm.kv_stats().pages_in_use == 0


def test_a_request_larger_than_the_pool_fails_alone(tiny_path):
    llm = LLM(tiny_path, kv="static,max_tokens=64,max_seqs=1,page_size=4")  # 16 pages
    sched = Scheduler(llm.runner, llm.tokenizer)
    big = Request("big", list(range(10, 40)), SamplingParams(max_tokens=30, n=4, temperature=1.0, seed=1))
    sched.add(big)
    while sched.has_work:
        sched.step()
    assert big.error is not None and "KV cache is full" in big.error
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0
    with pytest.raises(ContextOverflow, match="does not fit the context"):
        sched.add(Request("huge", list(range(0, 100)), GREEDY))
    with pytest.raises(CacheFull, match="needs more KV pages than the pool holds"):
        llm.generate_batch([list(range(10, 40))] * 2, SamplingParams(max_tokens=30, n=4, temperature=1.0))
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0


def test_n_samples_share_the_prompt_and_are_reproducible(tiny_path):
    llm = LLM(tiny_path, kv="dynamic,page_size=4")
    p = SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate_batch([PROMPTS[0], PROMPTS[1]], p)
    b = llm.generate_batch([PROMPTS[0], PROMPTS[1]], p)
    assert [[o.token_ids for o in r.outputs] for r in a] == [[o.token_ids for o in r.outputs] for r in b]
    assert len({tuple(o.token_ids) for o in a[0].outputs}) > 1  # samples differ
    single = llm.generate([PROMPTS[0]], p)[0]
    assert [o.token_ids for o in single.outputs] == [o.token_ids for o in a[0].outputs]
    llm.check_integrity()


def test_abort_frees_pages_at_once(tiny_path):
    llm = LLM(tiny_path, kv="dynamic,page_size=4", prefix=False)
    sched = Scheduler(llm.runner, llm.tokenizer)
    req = Request("x", PROMPTS[3], SamplingParams(max_tokens=50, ignore_eos=True))
    sched.add(req)
    for _ in range(3):
        sched.step()
    assert llm.kv_stats().pages_in_use > 0
    assert sched.abort("x") and not sched.abort("x")
    assert llm.kv_stats().pages_in_use == 0 and not sched.has_work
    llm.check_integrity()


def test_engine_loop_serves_concurrent_callers(tiny_path, reference):
    llm = LLM(tiny_path, kv="dynamic,page_size=4")
    loop = EngineLoop(Scheduler(llm.runner, llm.tokenizer, SchedulerConfig(max_batch_tokens=8)))
    results: dict[str, list[int]] = {}
    pieces: dict[str, int] = {}
    done = threading.Event()

    def finish(req: Request) -> None:
        results[req.request_id] = req.output().token_ids
        if len(results) == len(PROMPTS):
            done.set()

    def count(rid: str):
        def on_delta(d) -> None:
            pieces[rid] = pieces.get(rid, 0) + 1
        return on_delta

    threads = [threading.Thread(target=loop.submit, args=(Request(str(i), p, GREEDY, on_delta=count(str(i))), finish))
               for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    assert done.wait(120)
    assert [results[str(i)] for i in range(len(PROMPTS))] == reference
    assert all(pieces[str(i)] >= 1 for i in range(len(PROMPTS)))
    stats = loop.call(llm.kv_stats)
    loop.call(llm.check_integrity)
    assert stats.pages_in_use == 0
    loop.close()


def test_bad_scheduler_settings():
    with pytest.raises(InvalidParams, match="max_batch_tokens"):
        SchedulerConfig(max_batch_tokens=0)
    with pytest.raises(InvalidParams, match="policy"):
        SchedulerConfig(policy="lifo")


def test_priority_policy_admits_higher_first(tiny_path):
    llm = LLM(tiny_path, kv="dynamic,page_size=4", prefix=False)
    sched = Scheduler(llm.runner, llm.tokenizer, SchedulerConfig(max_running=1, policy="priority"))
    low = Request("low", PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True), priority=0)
    high = Request("high", PROMPTS[2], SamplingParams(max_tokens=2, ignore_eos=True), priority=5)
    sched.add(low)
    sched.add(high)
    order = []
    while sched.has_work:
        order += [r.request_id for r in sched.step()]
    assert order == ["high", "low"]
