"""Prompts that share their start with a request running now take its K/V (engine/inflight.py):
the same tokens as each computed alone, far fewer prompt tokens computed, never across tenants or
without the prefix cache, and a follower whose donor goes away computes its prompt itself."""

from __future__ import annotations

import pytest

from kvcache import LLM, SamplingParams
from kvcache.engine.scheduler import Request, Scheduler, SchedulerConfig

COMMON = [(i * 7 + 3) % 90 + 5 for i in range(40)]  # a shared start of 40 tokens: 10 pages of 4
TAILS = [[7, 8, 9], [11, 12], [13, 14, 15, 16, 17], [18], [19, 20, 21, 22]]
PROMPTS = [COMMON + t for t in TAILS]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tiny_dir):
    return str(tiny_dir("llama")[0])


def alone(path: str, spec: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(path, kv=spec, prefix=False)
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def run(sched: Scheduler, reqs: list[Request]) -> None:
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()


@pytest.mark.parametrize("spec", ["dynamic,page_size=4", "static,max_tokens=64,max_seqs=5,page_size=4",
                                  "dynamic,page_size=4,window=12", "dynamic,page_size=4,sinks=4,window=12"])
@pytest.mark.parametrize("step_tokens", [512, 8])  # the whole batch in one step; the donor's prompt over five
def test_a_batch_sharing_its_start_computes_it_once(tiny_path, spec, step_tokens):
    llm = LLM(tiny_path, kv=spec)
    outs = llm.generate_batch(PROMPTS, GREEDY, scheduler=SchedulerConfig(max_batch_tokens=step_tokens))
    assert [o.token_ids for o in outs] == alone(tiny_path, spec, PROMPTS)
    cached = [o.cached_tokens for o in outs]
    if "window" in spec:  # a window's dropped pages are not reusable: whatever is taken is exact
        assert cached[0] == 0
    else:
        assert cached == [0] + [len(COMMON)] * 4
        assert llm.prefix_stats().running_tokens == 4 * len(COMMON)
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0


def test_quantized_pages_are_shared_once_sealed(tiny_path):
    spec = "int8,page_size=8,group_size=8,residual=0"
    llm = LLM(tiny_path, kv=spec)
    outs = llm.generate_batch(PROMPTS, GREEDY, scheduler=SchedulerConfig(max_batch_tokens=8))
    assert [o.token_ids for o in outs] == [o.token_ids for o in LLM(tiny_path, kv=spec).generate_batch(
        PROMPTS, GREEDY, scheduler=SchedulerConfig(max_batch_tokens=8, max_running=1))]
    assert all(o.cached_tokens == len(COMMON) for o in outs[1:])
    llm.check_integrity()


def test_a_decoding_request_shares_its_prompt_and_output(tiny_path):
    """A newcomer whose prompt is a running request's prompt and part of its output takes both."""
    llm = LLM(tiny_path, kv="dynamic,page_size=4")
    sched = Scheduler(llm.runner, llm.tokenizer, SchedulerConfig())
    first = Request("first", PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add(first)
    for _ in range(10):
        sched.step()
    made = first.samples[0].tokens
    assert len(made) == 10
    prompt = PROMPTS[0] + made[:9] + [42, 43]  # 43 prompt tokens + 9 generated: 13 whole pages
    later = Request("later", prompt, GREEDY)
    run(sched, [later])
    assert later.cached_tokens == 52 and llm.prefix_stats().running_tokens == 52
    assert later.output().token_ids == alone(tiny_path, "dynamic,page_size=4", [prompt])[0]
    assert first.output().token_ids[:10] == made[:10]
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0


def test_tenants_and_a_disabled_prefix_cache_share_nothing(tiny_path):
    llm = LLM(tiny_path, kv="dynamic,page_size=4")
    sched = Scheduler(llm.runner, llm.tokenizer, SchedulerConfig(max_batch_tokens=8))
    reqs = [Request(str(i), p, GREEDY, salt=f"tenant-{i % 2}") for i, p in enumerate(PROMPTS[:4])]
    run(sched, reqs)
    assert [r.cached_tokens for r in reqs] == [0, 0, len(COMMON), len(COMMON)]  # each from its own tenant's
    assert [r.output().token_ids for r in reqs] == alone(tiny_path, "dynamic,page_size=4", PROMPTS[:4])
    off = LLM(tiny_path, kv="dynamic,page_size=4", prefix=False).generate_batch(PROMPTS, GREEDY)
    assert [o.cached_tokens for o in off] == [0] * len(PROMPTS)


@pytest.mark.parametrize("how", ["abort", "finish"])
def test_a_follower_whose_donor_leaves_computes_its_prompt(tiny_path, how):
    llm = LLM(tiny_path, kv="dynamic,page_size=4")
    sched = Scheduler(llm.runner, llm.tokenizer, SchedulerConfig(max_batch_tokens=8))
    donor = Request("donor", PROMPTS[0], SamplingParams(max_tokens=1 if how == "finish" else 8, ignore_eos=True))
    follower = Request("follower", PROMPTS[1], GREEDY)
    sched.add(donor)
    sched.add(follower)
    sched.step()  # the donor computes 8 of 43 tokens; the follower waits for the 40 they share
    assert len(donor.samples[0].seq.tokens) == 8 and follower.samples[0].feed == PROMPTS[1]
    if how == "abort":
        assert sched.abort("donor")
    while sched.has_work:
        sched.step()
    assert follower.output().token_ids == alone(tiny_path, "dynamic,page_size=4", [PROMPTS[1]])[0]
    # aborted: the follower computes it all; finished: the donor's pages went to the index first
    assert follower.cached_tokens == (0 if how == "abort" else len(COMMON))
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0


def test_an_identical_running_prompt_never_covers_the_whole_prompt(tiny_path):
    """Two copies of one prompt of 40 tokens (ten whole pages): the second takes 36, so that it
    computes its last page itself, its last token's logits among them (as an index hit would)."""
    llm = LLM(tiny_path, kv="dynamic,page_size=4")
    outs = llm.generate_batch([COMMON, COMMON], GREEDY)
    assert [o.cached_tokens for o in outs] == [0, 36]
    assert outs[0].token_ids == outs[1].token_ids == alone(tiny_path, "dynamic,page_size=4", [COMMON])[0]
    llm.check_integrity()
