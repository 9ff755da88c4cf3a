"""Fair prefill: a long prompt shares each step's token budget with the prompts that come after it.

Counted in steps, never seconds: a short request that arrives while a long prompt is prefilled gets
its first token within a bounded number of steps, the long prompt still advances every step, and
nobody's tokens change (greedy text equal to the text alone, token for token)."""

from __future__ import annotations

import time

import pytest

from kvcache import LLM, SamplingParams
from kvcache.engine.scheduler import Request, Scheduler, SchedulerConfig, fair_shares

LONG = [20 + (i * 37) % 130 for i in range(150)]  # 150 prompt tokens of the tiny vocabulary


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    return LLM(str(tiny_dir("llama")[0]), kv="dynamic,page_size=4", prefix=False)


def test_fair_shares_split_the_budget_max_min():
    assert fair_shares([28000, 60], 256) == [196, 60]  # the short prompt whole, the long one the rest
    assert fair_shares([28000, 60, 300], 256) == [98, 60, 98]  # the rest split equally
    assert fair_shares([100, 100, 100], 256) == [86, 85, 85]  # the spare token to the earliest admitted
    assert fair_shares([5, 5, 5, 5, 5], 4) == [1, 1, 1, 1, 0]  # fewer tokens than prompts
    assert fair_shares([1, 2, 3], 100) == [1, 2, 3] and fair_shares([], 10) == []
    assert fair_shares([7, 300], 0) == [0, 0]
    for remaining in ([9, 1, 400, 33, 2], [256, 256], [1000], [3, 3, 3, 250]):
        for budget in (1, 4, 64, 256, 2000):
            got = fair_shares(remaining, budget)
            assert sum(got) == min(budget, sum(remaining))
            assert all(0 <= g <= r for g, r in zip(got, remaining))


def _step_until_first_token(sched: Scheduler, req: Request, limit: int) -> int:
    for steps in range(1, limit + 1):
        sched.step()
        if req.samples[0].tokens:
            return steps
    return limit + 1


def test_a_short_request_beside_a_long_prefill_gets_its_first_token_at_once(tiny_llm):
    sched = Scheduler(tiny_llm.runner, tiny_llm.tokenizer, SchedulerConfig(max_batch_tokens=16, count_work=False))
    long = Request("long", LONG, SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add(long)
    sched.step()
    sched.step()  # the long prompt is prefilling: 32 of its 150 tokens are in
    assert long.samples[0].feed and not long.samples[0].tokens
    fed = []
    for k in range(3):  # short requests arrive one after the other while it prefills
        short = Request(f"short{k}", [7 + k, 8, 9, 10, 11], SamplingParams(max_tokens=3, ignore_eos=True))
        sched.add(short)
        before = len(long.samples[0].feed)
        assert _step_until_first_token(sched, short, 20) == 1  # admitted and prefilled in the next step
        fed.append(before - len(long.samples[0].feed))
    # the step that finishes a short prompt leaves the long one out, but never two steps in a row
    assert fed[0] == 0 and fed[1] > 0 and fed[2] == 0
    before = len(long.samples[0].feed)
    sched.step()  # no newcomer: the long prompt shares the step with the shorts' decodes
    assert before - len(long.samples[0].feed) == 16 - 2
    assert long.samples[0].feed and not long.samples[0].tokens  # and is still prefilling
    while sched.has_work:
        sched.step()
    tiny_llm.check_integrity()


def test_a_flow_of_short_prompts_does_not_starve_a_long_one(tiny_llm):
    """A new short request every step: the long prompt still feeds a share at least every other
    step and finishes its prefill."""
    sched = Scheduler(tiny_llm.runner, tiny_llm.tokenizer, SchedulerConfig(max_batch_tokens=12, max_running=64))
    long = Request("long", LONG, SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add(long)
    steps, idle = 0, 0
    while long.samples[0].feed and not long.samples[0].tokens:
        size = 4 if steps % 3 else 10  # some fit their equal share at once, some take two steps
        sched.add(Request(f"s{steps}", [30 + steps % 50] * size, SamplingParams(max_tokens=1, ignore_eos=True)))
        before = len(long.samples[0].feed)
        sched.step()
        steps += 1
        idle = 0 if len(long.samples[0].feed) < before or long.samples[0].tokens else idle + 1
        assert idle < 2
    assert steps < len(LONG)  # it got more than one token a step
    while sched.has_work:
        sched.step()
    tiny_llm.check_integrity()


def test_under_the_priority_policy_a_higher_prompt_takes_the_budget_first(tiny_llm):
    sched = Scheduler(tiny_llm.runner, tiny_llm.tokenizer, SchedulerConfig(max_batch_tokens=16, policy="priority",
                                                                                  count_work=False))
    low = Request("low", LONG, SamplingParams(max_tokens=2, ignore_eos=True), priority=0)
    sched.add(low)
    sched.step()
    high = Request("high", LONG[:40], SamplingParams(max_tokens=2, ignore_eos=True), priority=3)
    sched.add(high)
    low_before = len(low.samples[0].feed)
    sched.step()
    assert len(high.samples[0].feed) == 40 - 16  # the whole step's budget went to the higher level
    assert len(low.samples[0].feed) == low_before
    while sched.has_work:
        sched.step()
    assert high.t_end < low.t_end
    tiny_llm.check_integrity()


def test_the_long_prompts_greedy_text_is_its_text_alone_with_short_requests_interleaved():
    """On the bundled SmolLM2 (its own quantized weights, where any other reduction order would
    round some activation the other way): a long prompt's greedy tokens are its tokens alone,
    whatever prompts and decodes shared its steps and however its chunks were cut."""
    llm = LLM(kv="dynamic", prefix=False)
    text = ("The history of the printing press begins in the fifteenth century, when movable type "
            "changed how books were made and read across Europe. ")
    long_ids = (llm.encode(text) * 12)[:300]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = llm.generate([long_ids], greedy)[0].token_ids

    sched = Scheduler(llm.runner, llm.tokenizer, SchedulerConfig(max_batch_tokens=48))
    long = Request("long", long_ids, greedy)
    sched.add(long)
    shorts = [llm.encode(t) for t in ("Water boils at", "The capital of Australia is", "def fibonacci(n):",
                                      "Once upon a time there was a", "A recipe for bread needs flour,")]
    added: list[Request] = []
    steps = 0
    while sched.has_work:
        if steps % 2 == 1 and len(added) < len(shorts):  # short requests arrive during prefill and decode
            added.append(Request(f"s{len(added)}", shorts[len(added)], SamplingParams(max_tokens=6, ignore_eos=True)))
            sched.add(added[-1])
        sched.step()
        steps += 1
    assert long.output().token_ids == alone
    for r, ids in zip(added, shorts):
        assert r.output().token_ids == llm.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    llm.check_integrity()


# -- the budget counts work -----------------------------------------------------------------------

def _config(**kw):
    from kvcache.models.config import ModelConfig

    base = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                num_heads=9, num_kv_heads=3, head_dim=64, max_position=32768)
    return ModelConfig(**{**base, **kw})


def test_a_tokens_work_grows_with_its_depth_and_stops_at_a_window():
    from kvcache.engine.step_work import token_work

    work = token_work(_config())
    assert work(0) == 1.0
    assert 1.0 < work(1000) < work(8000) < work(28000)
    assert work(28000) - 1 == pytest.approx(28 * (work(1000) - 1))  # linear in the keys attended
    assert 15 < work(28000) < 40  # SmolLM2's shape: attention at 28k is tens of times the weights
    # Gemma 3's pattern: five windowed layers of six; past the window only the global layers grow
    windows = tuple(None if i % 6 == 5 else 512 for i in range(30))
    gemma = token_work(_config(layer_windows=windows))
    assert gemma(512) == pytest.approx(work(512))
    assert gemma(8512) - gemma(512) == pytest.approx((work(8512) - work(512)) * 5 / 30)
    # a mixture reads its routed experts only: attention weighs more against its smaller step
    moe = token_work(_config(raw={"num_experts_per_tok": 2, "moe_intermediate_size": 256}))
    assert moe(8000) > work(8000)


def test_work_shares_give_a_deep_prompt_fewer_tokens_and_keep_the_step_within_budget():
    # the short prompt whole, the deep one what is left of the work
    assert fair_shares([28000, 60], 256, [8.0, 1.0]) == [24, 60]
    assert fair_shares([28000, 60], 256, [1.0, 1.0]) == fair_shares([28000, 60], 256)
    assert fair_shares([500, 500], 100, [3.0, 1.0]) == [16, 52]  # about equal work; the rounding's rest where it pays
    assert fair_shares([300, 5], 4, [9.0, 1.0]) == [0, 4]  # a prompt whose token costs more than its share waits
    assert fair_shares([300], 4, [9.0]) == [1]  # but some prompt always advances
    for remaining, cost in (([9, 1, 400, 33, 2], [1.0, 2.5, 7.0, 1.2, 30.0]), ([1000, 1000], [11.0, 1.0])):
        for budget in (1, 4, 64, 256, 2000):
            got = fair_shares(remaining, budget, cost)
            work = sum(g * c for g, c in zip(got, cost))
            assert all(0 <= g <= r for g, r in zip(got, remaining)) and any(got)
            assert work <= budget + 1e-9 or sum(got) == 1
            # nothing left over that would pay for another token of an unfinished prompt
            assert all(g == r or budget - work < c for g, r, c in zip(got, remaining, cost))


def test_a_prompt_is_counted_with_the_shared_attention_cost_only_while_others_are_about(tiny_llm):
    """Alone, a prompt's tokens are counted with ``ALONE_ATTENTION_WEIGHT`` (longer steps deep in
    it, its keys read fewer times); beside a running request, with ``ATTENTION_WEIGHT`` (the
    measured cost): at the same depth it then feeds fewer tokens a step, each step within budget."""
    from kvcache.engine.step_work import ALONE_ATTENTION_WEIGHT, ATTENTION_WEIGHT, token_work

    assert ATTENTION_WEIGHT > ALONE_ATTENTION_WEIGHT
    shared_w, alone_w = token_work(tiny_llm.runner.config), token_work(tiny_llm.runner.config, ALONE_ATTENTION_WEIGHT)
    chunks = {}
    for beside in (False, True):
        sched = Scheduler(tiny_llm.runner, tiny_llm.tokenizer, SchedulerConfig(max_batch_tokens=32))
        if beside:  # a request that decodes through the whole prompt: one token of each step's budget
            sched.add(Request("chat", [7, 8, 9], SamplingParams(max_tokens=200, ignore_eos=True)))
            sched.step()
        long = Request("long", LONG, SamplingParams(max_tokens=1, ignore_eos=True))
        sched.add(long)
        def depth():
            return len(long.samples[0].seq.tokens) if long.samples and long.samples[0].seq is not None else 0

        fed = []
        while not (long.samples and long.samples[0].tokens):
            before = depth()
            sched.step()
            fed.append((before, depth() - before))
        chunks[beside] = [(d, n) for d, n in fed[:-1] if n]  # the last chunk is whatever was left
    for d, n in chunks[False]:
        assert n == min(32, int(32 / alone_w(d) + 1e-9)) or n >= 1 > int(32 / alone_w(d))
    for d, n in chunks[True]:
        assert n * shared_w(d) <= 31 + 1e-9 or n == 1  # the decode took one token of the budget
    deep = [(d, n) for d, n in chunks[True] if d >= 64]
    assert deep and all(n < int(32 / alone_w(d)) for d, n in deep), (chunks, deep)


def test_a_long_prompts_chunks_shrink_with_depth_and_its_text_is_unchanged(tiny_llm):
    """Alone, a long prompt feeds fewer tokens a step as it goes deeper (each step about the same
    work), and its greedy tokens are those of a run that counts tokens."""
    from kvcache.engine.step_work import ALONE_ATTENTION_WEIGHT, token_work

    work = token_work(tiny_llm.runner.config, ALONE_ATTENTION_WEIGHT)  # alone: counted as a prompt alone is
    assert work(len(LONG)) > 1.2  # the tiny model's attention is heavy beside its weights: chunks do shrink
    outs = {}
    for count_work in (True, False):
        sched = Scheduler(tiny_llm.runner, tiny_llm.tokenizer, SchedulerConfig(max_batch_tokens=32, count_work=count_work))
        req = Request("long", LONG, SamplingParams(max_tokens=5, ignore_eos=True))
        sched.add(req)
        chunks = []
        def depth():
            return len(req.samples[0].seq.tokens) if req.samples and req.samples[0].seq is not None else 0

        while not (req.samples and req.samples[0].tokens):
            before = depth()
            sched.step()
            chunks.append((before, depth() - before))
        while sched.has_work:
            sched.step()
        outs[count_work] = req.output().token_ids
        if count_work:
            assert chunks[0][1] == 32 and chunks[-2][1] < 32  # whole at depth 0, fewer tokens deeper
            assert all(n * work(d) <= 32 + 1e-9 for d, n in chunks[:-1])
        else:
            assert [n for _, n in chunks[:-1]] == [32] * (len(chunks) - 1)
    assert outs[True] == outs[False]
    tiny_llm.check_integrity()


def test_a_documents_share_of_a_step_is_capped_while_shared_and_short_prompts_still_go_whole(tiny_llm, monkeypatch):
    """With ``document_work``, a document (a prompt of more than ``DOCUMENT_STEPS`` steps) feeds at
    most that much work a step (fewer tokens as it goes deeper) while another request is in flight
    or was less than ``SHARED_S`` ago; alone, it takes whole steps; a prompt of a few steps is never
    capped. A short prompt beside it still goes in whole; the text is the text without the cap."""
    from kvcache.engine import scheduler as scheduler_mod
    from kvcache.engine.step_work import token_work

    monkeypatch.setattr(scheduler_mod, "SHARED_S", 0.5)
    monkeypatch.setattr(scheduler_mod, "DOCUMENT_STEPS", 4)  # LONG (150 tokens) is a document at 32 a step
    work = token_work(tiny_llm.runner.config)
    outs = {}
    for cap in (None, 8):
        sched = Scheduler(tiny_llm.runner, tiny_llm.tokenizer,
                          SchedulerConfig(max_batch_tokens=32, document_work=cap))
        long = Request("long", LONG, SamplingParams(max_tokens=4, ignore_eos=True))
        sched.add(long)

        def depth():
            return len(long.samples[0].seq.tokens) if long.samples and long.samples[0].seq is not None else 0

        fed = []
        for step in range(8):
            if step == 2:
                short = Request("short", [7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=2, ignore_eos=True))
                sched.add(short)
            if step == 7:
                time.sleep(0.6)  # the short request is long gone: the document is alone again
            before = depth()
            sched.step()
            fed.append((before, depth() - before))
            if step == 2:
                assert short.samples[0].tokens  # the short prompt whole, in the step after it came
        assert fed[0][1] == 32 and fed[1][1] > 8  # alone: whole steps
        if cap is not None:
            assert short.finished and all(n * work(d) <= cap + work(d) for d, n in fed[2:7]), fed
            assert 0 < max(n for _, n in fed[2:7]) <= cap  # capped beside it and for a while after it
        assert fed[7][1] > 8, fed  # alone again: whole steps
        while sched.has_work:
            sched.step()
        outs[cap] = long.output().token_ids
    assert outs[None] == outs[8]
    monkeypatch.setattr(scheduler_mod, "DOCUMENT_STEPS", 8)  # LONG is now a prompt of a few steps: never capped
    sched = Scheduler(tiny_llm.runner, tiny_llm.tokenizer, SchedulerConfig(max_batch_tokens=32, document_work=8))
    few = Request("few", LONG, SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add(few)
    sched.add(Request("beside", [7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True)))
    sched.step()  # the short one goes whole; the longer prompt sits this step out
    sched.step()
    assert few.samples[0].seq is not None and len(few.samples[0].seq.tokens) > 8  # shared, and not capped
    while sched.has_work:
        sched.step()
    with pytest.raises(Exception, match="document-step-work"):
        SchedulerConfig(document_work=0)
    tiny_llm.check_integrity()


def test_serve_help_states_the_schedulers_document_limits():
    """`serve --document-step-work`'s help names what makes a prompt a document and how long the
    engine counts as shared: the scheduler's own constants, so the text cannot drift from them."""
    import argparse

    from kvcache.engine import scheduler as scheduler_mod
    from kvcache.server.cli import DOCUMENT_STEP_WORK, add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    serve = next(a for a in parser._subparsers._group_actions[0].choices.values())  # type: ignore[union-attr]
    text = next(a.help for a in serve._actions if "--document-step-work" in a.option_strings)
    assert f"more than {scheduler_mod.DOCUMENT_STEPS} x --max-batch-tokens" in text
    assert f"in the last {scheduler_mod.SHARED_S:g} s" in text
    assert f"default {DOCUMENT_STEP_WORK};" in text


def test_a_single_run_feeds_a_long_prompt_in_chunks_with_the_same_tokens(tiny_llm, monkeypatch):
    """LLM.generate of one prompt longer than PREFILL_CHUNK feeds it in forwards of at most that
    many tokens (activations bounded by a chunk's), with the greedy tokens of the prompt fed whole."""
    from kvcache.engine import generate

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    whole = tiny_llm.generate([LONG], params)[0].outputs[0].token_ids
    fed: list[int] = []
    real = tiny_llm.runner.step

    def counted(seqs, new_tokens, *a, **k):
        fed.extend(len(t) for t in new_tokens)
        return real(seqs, new_tokens, *a, **k)

    monkeypatch.setattr(tiny_llm.runner, "step", counted)
    monkeypatch.setattr(generate, "PREFILL_CHUNK", 40)
    chunked = tiny_llm.generate([LONG], params)[0].outputs[0].token_ids
    assert chunked == whole
    assert fed[:4] == [40, 40, 40, 30] and max(fed) == 40  # 150 prompt tokens in four forwards, then decodes
