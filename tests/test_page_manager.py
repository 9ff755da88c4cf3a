"""The page manager (cache/pages.py) is the one owner of pages: a step's pages are asked for before
the forward (a typed refusal, nothing taken), the forward takes nothing more, and ``truncate``
leaves a sequence exactly as if the tokens it forgets had never come, in every strategy."""

from __future__ import annotations

import pytest
import torch

from kvcache import LLM, SamplingParams
from kvcache.cache.config import parse_kv_spec
from kvcache.cache.pages import Refusal, Reservation
from kvcache.engine.runner import ModelRunner
from kvcache.errors import CacheFull, ContextOverflow

PROMPT = [5, 17, 42, 8, 99, 23, 4, 61, 77, 12, 30, 3, 9, 14, 22, 41, 2]
TENTATIVE = [7, 21, 33, 2, 50, 6]
NEXT = 19
# spec -> whether the next logits are the very same bits. Not for quantized encodings (a page
# unsealed again comes back to the fp32 tail as it was dequantized) nor windows (a window's
# attention over a chunk of several tokens rounds in another order than over one: the kept
# token's K/V differ in the last bit from those of a sequence that took it alone)
STRATEGIES = {
    "dynamic": True, "static,max_tokens=64": True, "fp16": True, "bf16": True,
    "int8,group_size=8,residual=4": False, "int4,group_size=8,residual=4": False,
    "int2,group_size=8,residual=4": False, "window=16": False, "sinks=2,window=16": False,
    "host": True, "disk": True, "press=knorm,ratio=0.5,protect=4": True,
    "static,max_tokens=64,int8,group_size=8,residual=8,sinks=2,window=16": False,
}


@pytest.fixture(scope="module")
def tiny_path(tiny_dir):
    return str(tiny_dir("llama")[0])


@pytest.fixture(scope="module")
def tiny_llm(tiny_path):
    return LLM(tiny_path, kv="none", weights="fp32")


def _runner(llm, spec, tmp_path):
    page = 8 if "int" in spec else 4
    return ModelRunner(llm.model, parse_kv_spec(f"{spec},page_size={page}" + (f",dir={tmp_path}" if "disk" in spec else "")))


def _footprint(runner):
    s = runner.stats()
    return (s.pages_used, s.tokens_stored, s.bytes_used, [(L.pages_used, L.bytes_used) for L in s.per_layer])


@pytest.mark.parametrize("spec", list(STRATEGIES))
@pytest.mark.parametrize("keep", [0, 1, 4])
def test_truncate_is_as_if_the_tokens_never_came(tiny_llm, spec, keep, tmp_path):
    """k tentative tokens in, only the first ``keep`` kept: the pages, bytes and tokens the cache
    accounts for, and the next step's logits, are those of a sequence that only ever saw the kept
    ones."""
    a, b = _runner(tiny_llm, spec, tmp_path / "a"), _runner(tiny_llm, spec, tmp_path / "b")
    sa, sb = a.new_sequence(), b.new_sequence()
    a.step([sa], [PROMPT])
    b.step([sb], [PROMPT])
    a.step([sa], [TENTATIVE])  # the proposals, verified in one forward
    cut = len(PROMPT) + keep
    if not a.reusable(sa, cut):  # a press that mixed later tokens in, or a window past them
        pytest.skip(f"{spec}: the cache cannot go back to {cut} tokens (refused, not faked)")
    a.truncate(sa, cut)
    if keep:
        b.step([sb], [TENTATIVE[:keep]])
    a.check_integrity()
    assert sa.kv.length == sb.kv.length == cut and sa.tokens == sb.tokens
    if "press" not in spec:  # a press keeps what it chose when it saw the longer sequence
        assert _footprint(a) == _footprint(b)
    la, lb = a.step([sa], [[NEXT]])[0], b.step([sb], [[NEXT]])[0]
    if STRATEGIES[spec] and "press" not in spec:
        assert torch.equal(la, lb), f"{spec}: {float((la - lb).abs().max()):.2e}"
    else:
        bound = 0.25 if "int" in spec or "press" in spec else 1e-5  # int2 moves logits by 0.1-0.2
        torch.testing.assert_close(la, lb, atol=bound, rtol=0.0)
    for r, s in ((a, sa), (b, sb)):
        r.free(s)
        r.check_integrity()
        assert r.stats().pages_used == 0


def test_ask_reserves_or_refuses_with_nothing_taken(tiny_llm, tmp_path):
    runner = _runner(tiny_llm, "static,max_tokens=32", tmp_path)
    pages = runner.cache.pages
    s1, s2 = runner.new_sequence(), runner.new_sequence()
    runner.step([s1], [PROMPT])
    before = _footprint(runner)
    got = pages.ask([s1.kv, s2.kv], [1, 40])  # the second would pass its static capacity
    assert isinstance(got, Refusal) and got.kind == "context" and isinstance(got.error(), ContextOverflow)
    assert "exceeds the static cache capacity of 32 tokens" in got.message
    assert _footprint(runner) == before and s1.kv.pending is None and s2.kv.pending is None
    got = pages.ask([s1.kv, s2.kv], [3, 8])
    assert isinstance(got, Reservation) and s2.kv.pending == [0]
    asked = runner.stats().pages_used
    assert asked > before[0]
    runner.step([s1, s2], [[1, 2, 3], list(range(8))])  # the forward takes nothing more
    assert runner.stats().pages_used == asked and s1.kv.pending is None and s2.kv.pending is None
    runner.check_integrity()
    child = runner.fork(s1)  # every page of s1 now has two holders
    (st,) = pages.stats()
    assert st["shared"] == len(s1.kv.tables[0]) and st["used"] + st["free"] == st["total"] == runner.stats().pages_total
    runner.free(child)
    assert pages.stats()[0]["shared"] == 0
    got = pages.ask([s2.kv], [4])
    used = runner.stats().pages_used
    got.cancel()  # the step did not run: its pages go back
    assert runner.stats().pages_used <= used and s2.kv.pending is None
    runner.check_integrity()


def test_a_full_pool_is_refused_before_the_forward(tiny_llm, tmp_path):
    runner = _runner(tiny_llm, "static,max_tokens=32,max_seqs=1", tmp_path)
    s1, s2 = runner.new_sequence(), runner.new_sequence()
    runner.step([s1], [PROMPT])
    got = runner.reserve([s2], [30])
    assert isinstance(got, Refusal) and got.kind == "full" and isinstance(got.error(), CacheFull)
    assert s2.kv.tables == [[]] and s2.kv.pending is None
    runner.check_integrity()


def test_no_page_is_taken_inside_a_scheduled_forward(tiny_path, monkeypatch):
    """Under a static pool too small for every request at once, every page a scheduled step writes
    was asked for before its forward: the manager's ``take`` never runs inside a forward."""
    llm = LLM(tiny_path, kv="static,max_tokens=64,page_size=4,max_seqs=3", weights="fp32", prefix=False)
    runner, pages = llm.runner, llm.runner.cache.pages
    real_take, real_forward, real_ask = pages.take, runner._forward, pages.ask
    inside, taken_inside, asks = [False], [], []

    def take(group, n):
        if inside[0]:
            taken_inside.append(n)
        return real_take(group, n)

    def forward(*a, **k):
        inside[0] = True
        try:
            return real_forward(*a, **k)
        finally:
            inside[0] = False

    def ask(seqs, counts):
        got = real_ask(seqs, counts)
        asks.append(type(got).__name__)
        return got

    monkeypatch.setattr(pages, "take", take)
    monkeypatch.setattr(pages, "ask", ask)
    monkeypatch.setattr(runner, "_forward", forward)
    prompts = [[(7 * i + j) % 90 + 3 for j in range(20 + 3 * i)] for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert "Reservation" in asks and "Refusal" in asks  # the pool ran out: refused before a forward
    assert taken_inside == []
    runner.check_integrity()
