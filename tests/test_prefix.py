"""Automatic prefix caching: the radix index alone, then bound to a real cache and model.

Recompute from scratch is the oracle: a prefix hit must give its logits (fp32, 1e-4); a windowed
strategy must give what the same strategy gives without the hit.
"""

from __future__ import annotations

import time

import forkserve
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvcache import LLM, SamplingParams
from kvcache.cache.config import parse_kv_spec
from kvcache.engine.runner import ModelRunner
from kvcache.errors import ContextOverflow
from kvcache.prefix.config import PrefixConfig
from kvcache.prefix.radix import HOLE, RadixIndex

SYSTEM = [5, 17, 42, 8, 99, 23, 4, 61, 77, 12, 30, 3, 44, 45]  # 3 full pages of 4 + 2 tokens


# -- the index alone -------------------------------------------------------------------------
def test_index_matches_full_and_partial_pages():
    idx = RadixIndex(page_size=4, num_groups=1)
    path, taken = idx.insert([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [[10, 11, 12]])
    assert [n.tokens for n in path] == [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10)]
    assert taken == [(0, 10), (0, 11), (0, 12)]
    assert idx.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]).length == 10
    m = idx.match([1, 2, 3, 4, 5, 6, 99])  # ends inside the second page
    assert m.length == 6 and m.tables(1) == [[10, 11]]
    assert idx.match([2, 2, 3]).length == 0
    # a second sequence with the same first page: the index keeps its own page, takes the new ones
    _, taken = idx.insert([1, 2, 3, 4, 0, 0, 0, 0], [[20, 21]])
    assert taken == [(0, 21)]
    assert sorted(idx.held_pages()[0]) == [10, 11, 12, 21]


def test_index_separates_salts_and_refuses_partial_pages_when_told():
    idx = RadixIndex(page_size=4, num_groups=1, partial=False)
    idx.insert([1, 2, 3, 4, 5, 6], [[0, 1]], salt="tenant-a")
    assert idx.match([1, 2, 3, 4, 5, 6, 7], salt="tenant-a").length == 4  # the partial page is not kept
    assert idx.match([1, 2, 3, 4, 5, 6, 7], salt="tenant-b").length == 0
    assert idx.held_pages()[0] == [0]


def test_index_holes_adopted_from_a_later_sequence():
    idx = RadixIndex(page_size=2, num_groups=2)
    idx.insert([1, 2, 3, 4], [[HOLE, 7], [0, 1]])
    _, taken = idx.insert([1, 2, 3, 4], [[5, 9], [2, 3]])
    assert taken == [(0, 5)]  # only the page the index lacked
    assert sorted(idx.held_pages()[0]) == [5, 7]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_order_and_live_pages(policy):
    """Page 0 is used often but long ago, page 2 once but last: LRU evicts 0 first, LFU 2 first."""
    idx = RadixIndex(page_size=2, num_groups=1, policy=policy)
    idx.insert([1, 2], [[0]])
    idx.insert([3, 4], [[1]])
    idx.insert([5, 6], [[2]])
    for _ in range(3):
        idx.match([1, 2, 9])  # used often, early
    idx.match([5, 6, 9])  # used once, last
    live = {1}
    dropped = idx.evict(5, None, lambda g, p: p in live)
    assert [n.pages[0] for n in dropped] == ([0, 2] if policy == "lru" else [2, 0])
    assert idx.held_pages()[0] == [1]  # a page a running sequence holds is never evicted


def test_eviction_walks_up_to_parents_that_become_leaves():
    idx = RadixIndex(page_size=2, num_groups=1)
    idx.insert([1, 2, 3, 4, 5, 6], [[0, 1, 2]])
    dropped = idx.evict(3, 0, lambda g, p: False)
    assert [n.pages[0] for n in dropped] == [2, 1, 0] and idx.num_nodes == 0


# -- bound to a model ------------------------------------------------------------------------
def _recompute(llm: LLM, tokens: list[int]) -> torch.Tensor:
    ref = ModelRunner(llm.model, parse_kv_spec("none"))
    return ref.step([ref.new_sequence()], [tokens])[0]


@pytest.fixture(scope="module")
def tiny_path(tiny_dir):
    return str(tiny_dir("llama")[0])


EXACT = ["dynamic,page_size=4", "static,max_tokens=64,max_seqs=2,page_size=4", "host,page_size=4",
         "disk,page_size=4", "dynamic,page_size=1"]


@pytest.mark.parametrize("spec", EXACT)
def test_prefix_hit_gives_recompute_logits(tiny_path, spec):
    llm = LLM(tiny_path, kv=spec)
    r = llm.runner
    first = SYSTEM + [60, 61, 62]
    seq = r.lookup(first)
    assert seq.tokens == []
    r.step([seq], [first])
    r.release(seq)
    for second in (SYSTEM + [70, 71], SYSTEM[:13] + [80], first[:-1] + [90]):  # page end, inside a page
        seq = r.lookup(second)
        hit = len(seq.tokens)
        assert hit == min(len(second) - 1, _common(first, second))
        logits = r.step([seq], [second[hit:]])[0]
        torch.testing.assert_close(logits, _recompute(llm, second), atol=1e-4, rtol=1e-4)
        r.release(seq)
        llm.check_integrity()
    stats = llm.prefix_stats()
    assert stats.hit_tokens > 0 and 0 < stats.hit_rate < 1
    assert llm.kv_stats().pages_in_use == 0 and llm.kv_stats().pages_cached > 0


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_hit_never_covers_the_whole_prompt(tiny_path):
    llm = LLM(tiny_path, kv="dynamic,page_size=4")
    out1 = llm.generate([SYSTEM], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    out2 = llm.generate([SYSTEM], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out1.cached_tokens == 0 and out2.cached_tokens == len(SYSTEM) - 1
    assert out2.token_ids == out1.token_ids


@pytest.mark.parametrize("family,spec", [("mistral", "dynamic,page_size=2"), ("gemma3", "dynamic,page_size=2"),
                                         ("llama", "dynamic,page_size=2,window=6"),
                                         ("llama", "dynamic,page_size=2,sinks=2,window=6")])
def test_windowed_hits_equal_the_same_strategy_without_them(tiny_dir, family, spec):
    path = str(tiny_dir(family)[0])
    cached, fresh = LLM(path, kv=spec), LLM(path, kv=spec, prefix=False)
    long = SYSTEM + [60, 61, 62, 63, 64, 65]  # 20 tokens, past the windows of 6 and 8
    seq = cached.runner.lookup(long)
    cached.runner.step([seq], [long])
    cached.runner.release(seq)
    for prompt in (long[:-1] + [7, 8], long[:9] + [9]):
        seq = cached.runner.lookup(prompt)
        got = cached.runner.step([seq], [prompt[len(seq.tokens):]])[0]
        ref = fresh.runner.new_sequence()
        want = fresh.runner.step([ref], [prompt])[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        cached.runner.release(seq)
        fresh.runner.free(ref)
        cached.check_integrity()


@pytest.mark.parametrize("family,spec", [("gemma3", "dynamic,page_size=2"), ("llama", "dynamic,page_size=2,window=6")])
def test_windowed_pages_restore_from_disk_with_their_holes(tiny_dir, tmp_path, family, spec):
    """Decoding past a window drops its early pages; they are written without that group. In a new
    cache those pages come back as holes in the windowed group (the other group's K/V restored),
    the conversation continues from all 40 tokens, and the logits equal recomputation."""
    from kvcache.cache.sequence import HOLE

    path = str(tiny_dir(family)[0])
    long = [(i * 5 + 2) % 50 + 5 for i in range(40)]
    first = LLM(path, kv=spec, prefix=PrefixConfig(disk=str(tmp_path)))
    seq = first.runner.lookup(long)
    first.runner.step([seq], [long[:10]])
    for tok in long[10:]:  # one token a step, as decoding: pages leave the window between steps
        first.runner.step([seq], [[tok]])
    first.runner.release(seq)
    first.flush()
    later = LLM(path, kv=spec, prefix=PrefixConfig(disk=str(tmp_path)))
    fresh = LLM(path, kv=spec, prefix=False)
    prompt = long + [7]
    seq = later.runner.lookup(prompt)
    stats = later.prefix_stats()
    assert len(seq.tokens) == stats.tier_tokens == 40 and stats.rejected == 0
    assert any(HOLE in table[:20] for table in seq.kv.tables)  # restored without the dropped group
    got = later.runner.step([seq], [prompt[len(seq.tokens):]])[0]
    ref = fresh.runner.new_sequence()
    torch.testing.assert_close(got, fresh.runner.step([ref], [prompt])[0], atol=1e-4, rtol=1e-4)
    later.runner.release(seq)
    later.check_integrity()


def test_quantized_hits_reuse_sealed_pages_only(tiny_path):
    llm = LLM(tiny_path, kv="int8,page_size=8,group_size=8,residual=0")
    prompt = SYSTEM + list(range(60, 80))  # 34 tokens: 4 sealed pages
    r = llm.runner
    seq = r.lookup(prompt)
    r.step([seq], [prompt])
    r.release(seq)
    seq = r.lookup(prompt[:-2] + [7, 8])
    assert len(seq.tokens) == 32  # whole pages only; the fp32 tail was not cached
    got = r.step([seq], [(prompt[:-2] + [7, 8])[32:]])[0]
    want = _recompute(llm, prompt[:-2] + [7, 8])
    assert float((got - want).abs().max()) < 0.05  # int8 pages: close, not exact
    r.release(seq)
    llm.check_integrity()


def test_eviction_under_pressure_stays_exact(tiny_path):
    llm = LLM(tiny_path, kv="static,max_tokens=32,max_seqs=1,page_size=4")  # 8 pages in all
    r = llm.runner
    prompts = [[i, i + 1, i + 2] + SYSTEM[:12] for i in range(30, 90, 6)]
    for p in prompts + prompts[:2]:
        seq = r.lookup(p)
        logits = r.step([seq], [p[len(seq.tokens):]])[0]
        torch.testing.assert_close(logits, _recompute(llm, p), atol=1e-4, rtol=1e-4)
        r.release(seq)
        llm.check_integrity()
    assert llm.prefix_stats().evicted_pages > 0


def test_pool_exhaustion_with_every_page_referenced_is_refused_cleanly(tiny_path):
    llm = LLM(tiny_path, kv="static,max_tokens=32,max_seqs=1,page_size=4")
    r = llm.runner
    holder = r.new_sequence()
    r.step([holder], [list(range(10, 38))])  # 7 of 8 pages held by a running sequence
    with pytest.raises(ContextOverflow, match="KV cache is full"):
        llm.generate([list(range(40, 52))], SamplingParams(max_tokens=2))
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 7  # nothing leaked by the refused request
    r.free(holder)
    out = llm.generate([list(range(40, 52))], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert len(out.token_ids) == 2


def test_tenant_salts_never_share(tiny_path):
    llm = LLM(tiny_path, kv="dynamic,page_size=4")
    p = SamplingParams(max_tokens=2, ignore_eos=True)
    assert llm.generate([SYSTEM], p, salt="a")[0].cached_tokens == 0
    assert llm.generate([SYSTEM], p, salt="b")[0].cached_tokens == 0
    assert llm.generate([SYSTEM], p, salt="a")[0].cached_tokens == len(SYSTEM) - 1


def test_dynamic_pool_keeps_at_most_the_budget(tiny_path):
    llm = LLM(tiny_path, kv="dynamic,page_size=4", prefix=PrefixConfig(max_cached_tokens=16))
    for i in range(6):
        llm.generate([[i + 60] + SYSTEM], SamplingParams(max_tokens=3, ignore_eos=True))
        assert llm.kv_stats().pages_cached <= 4
        llm.check_integrity()
    assert llm.prefix_stats().evicted_pages > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(5, 8), min_size=1, max_size=14),
                              st.integers(0, 3)), min_size=1, max_size=12),
       spec=st.sampled_from(["static,max_tokens=24,max_seqs=2,page_size=4", "dynamic,page_size=3",
                             "dynamic,page_size=2,window=5", "int4,page_size=8,group_size=8,residual=0"]))
@example(ops=[(0, [5], 0)] * 8 + [(3, [5], 0), (0, [5] * 5, 0), (0, [5] * 5, 0), (0, [5, 5], 0)],
         spec="static,max_tokens=24,max_seqs=2,page_size=4")  # a full pool refuses a looked-up sequence
def test_integrity_under_random_workloads(tiny_path, ops, spec):
    """Requests over a 4-token alphabet (many shared prefixes) start, fork, grow and finish in
    random order; after every step free + referenced + cached == total and ref counts match. A
    sequence whose first step is refused still holds its matched prefix pages until it is
    released, as the engine does."""
    llm = LLM(tiny_path, kv=spec, prefix=PrefixConfig(max_cached_tokens=12))
    r, live = llm.runner, []
    for kind, toks, which in ops:
        try:
            if kind == 0 or not live:
                seq = r.lookup(toks)
                live.append(seq)
                r.step([seq], [toks[len(seq.tokens):]])
            elif kind == 1:
                live.append(r.fork(live[which % len(live)]))
            elif kind == 2:
                r.step([live[which % len(live)]], [toks[:3]])
            else:
                r.release(live.pop(which % len(live)))
        except ContextOverflow:
            pass  # a full static pool refuses; accounting must still hold
        llm.check_integrity()
    for seq in live:
        r.release(seq)
    llm.check_integrity()
    stats = llm.kv_stats()
    assert stats.pages_in_use == 0 and stats.pages_used == stats.pages_cached


# -- chat sessions -----------------------------------------------------------------------------
def test_sessions_share_the_system_prompt_and_resume_in_another_process(tiny_path, tmp_path):
    import json
    import subprocess
    import sys

    llm = LLM(tiny_path, kv="dynamic,page_size=4")
    system = " ".join(f"t{i}" for i in range(10, 40))
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    a = llm.chat_session(system=system)
    a.send("t5 t6 t7", greedy)
    b = llm.chat_session(system=system)
    rb = b.send("t8 t9", greedy)
    assert rb.cached_tokens >= 31  # "<system> t10 .. t39" came from session a's pages
    assert a.cached_tokens > rb.cached_tokens  # a's whole conversation is still cached
    path = tmp_path / "session.kv"
    assert a.save(str(path)) > 0
    code = (
        "import json, sys; from kvcache import LLM, SamplingParams\n"
        f"llm = LLM({tiny_path!r}, kv='dynamic,page_size=4')\n"
        f"s = llm.chat_session(resume={str(path)!r})\n"
        "r = s.send('t11 t12', SamplingParams(max_tokens=6, ignore_eos=True))\n"
        "print(json.dumps([r.cached_tokens, len(r.prompt_token_ids), r.token_ids, len(s.messages)]))\n"
    )
    out = subprocess.run(forkserve.python_command("-c", code), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    cached, prompt_len, tokens, n_messages = json.loads(out.stdout.strip().splitlines()[-1])
    here = a.send("t11 t12", greedy)
    assert tokens == here.token_ids and n_messages == len(a.messages) == 5
    assert cached >= prompt_len - 12  # the saved conversation was loaded, not recomputed
    llm.check_integrity()


def test_resuming_a_prompt_cache_file_as_a_session_is_refused(tiny_path, tmp_path):
    from kvcache.errors import InvalidParams

    llm = LLM(tiny_path, kv="dynamic,page_size=4")
    llm.save_cache(str(tmp_path / "p.kv"), SYSTEM)
    with pytest.raises(InvalidParams, match="prompt cache, not a saved chat session"):
        llm.chat_session(resume=str(tmp_path / "p.kv"))
    with pytest.raises(InvalidParams, match="nothing to save"):
        llm.chat_session().save(str(tmp_path / "empty.kv"))


# -- tiers: disk and Redis ---------------------------------------------------------------------
def _hit_then_check(llm: LLM, prompt: list[int]) -> int:
    seq = llm.runner.lookup(prompt)
    hit = len(seq.tokens)
    logits = llm.runner.step([seq], [prompt[hit:]])[0]
    torch.testing.assert_close(logits, _recompute(llm, prompt), atol=1e-4, rtol=1e-4)
    llm.runner.release(seq)
    llm.check_integrity()
    return hit


LONG = SYSTEM + list(range(60, 90))  # 44 tokens: 11 full pages of 4


@pytest.mark.parametrize("spec", ["dynamic,page_size=4", "int8,page_size=8,group_size=8,residual=0"])
def test_disk_tier_restores_pages_in_a_new_cache(tiny_path, tmp_path, spec):
    first = LLM(tiny_path, kv=spec, prefix=PrefixConfig(disk=str(tmp_path)))
    seq = first.runner.lookup(LONG)
    first.runner.step([seq], [LONG])
    first.runner.release(seq)
    first.flush()
    assert any(tmp_path.rglob("*.kv"))
    later = LLM(tiny_path, kv=spec, prefix=PrefixConfig(disk=str(tmp_path)))  # an empty RAM index
    prompt = LONG[:-1] + [7]
    if "int8" in spec:  # quantized pages: the restored ones must be the very pages written
        seq = later.runner.lookup(prompt)
        assert len(seq.tokens) == 40 and later.prefix_stats().tier_tokens == 40
        got = later.runner.step([seq], [prompt[40:]])[0]
        same = first.runner.lookup(prompt)  # the same pages, still in the first cache's RAM
        assert len(same.tokens) == 40
        want = first.runner.step([same], [prompt[40:]])[0]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        assert float((got - _recompute(later, prompt)).abs().max()) < 4e-3  # int8's bound (test_cache_matrix)
        later.runner.release(seq)
        first.runner.release(same)
    else:
        assert _hit_then_check(later, prompt) == 40  # 10 whole pages from disk; the rest recomputed
        assert later.prefix_stats().tier_tokens == 40


@pytest.mark.parametrize("spec,restored", [("dynamic,page_size=4", 160),
                                           ("static,page_size=4,max_tokens=128,max_seqs=1", 124)])
def test_restore_across_batches_of_pages(tiny_path, tmp_path, spec, restored):
    """Whole pages come back from disk in batches of RESTORE_BATCH (40 and 31 pages here) into a
    new cache, dynamic or static, and the logits equal recomputation."""
    from kvcache.prefix.restore import RESTORE_BATCH

    prompt = [(i * 7 + 3) % 97 for i in range(163)]
    assert 160 // 4 > 2 * RESTORE_BATCH
    first = LLM(tiny_path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path)))
    seq = first.runner.lookup(prompt)
    first.runner.step([seq], [prompt])
    first.runner.release(seq)
    first.flush()
    later = LLM(tiny_path, kv=spec, prefix=PrefixConfig(disk=str(tmp_path)))
    short = prompt[:127] if "static" in spec else prompt  # a static sequence holds at most 128 tokens
    hit = _hit_then_check(later, short)
    assert hit == restored and later.prefix_stats().tier_tokens == hit
    assert later.prefix_stats().rejected == 0


def test_restore_stops_where_a_static_pool_runs_out_of_pages(tiny_path, tmp_path):
    """31 pages on disk, room for 12: the batch restores what fits, gives back what it took for the
    rest, and the pages balance (free + referenced + cached == total) before and after release."""
    prompt = [(i * 7 + 3) % 97 for i in range(125)]
    first = LLM(tiny_path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path)))
    seq = first.runner.lookup(prompt)
    first.runner.step([seq], [prompt])
    first.runner.release(seq)
    first.flush()
    later = LLM(tiny_path, kv="static,page_size=4,max_tokens=128,max_seqs=1", prefix=PrefixConfig(disk=str(tmp_path)))
    other = later.runner.lookup([1, 2, 3] * 27)
    later.runner.step([other], [[1, 2, 3] * 27])  # 81 tokens: 21 of the 32 pages
    seq = later.runner.lookup(prompt)
    stats = later.prefix_stats()
    assert len(seq.tokens) == stats.tier_tokens == 11 * 4 and stats.rejected == 0
    later.check_integrity()
    later.runner.release(seq)
    later.runner.release(other)
    later.check_integrity()
    assert later.kv_stats().pages_in_use == 0


@pytest.mark.parametrize("spec", ["dynamic,page_size=4,initial_tokens=8",
                                  "int8,page_size=8,group_size=8,residual=0,initial_tokens=8"])
def test_tier_restores_into_a_pool_that_grew_inside_a_forward(tiny_path, tmp_path, spec):
    """The pool doubles during a forward (under torch.inference_mode); restoring pages into it
    afterwards, outside one, must still work (and not be taken for a corrupt entry)."""
    llm = LLM(tiny_path, kv=spec, prefix=PrefixConfig(disk=str(tmp_path)))
    seq = llm.runner.lookup(LONG)
    llm.runner.step([seq], [LONG])
    llm.runner.release(seq)
    llm.flush()
    llm.clear_prefix_cache()  # RAM forgets; the pages must come back from disk
    seq = llm.runner.lookup(LONG[:-1] + [7])
    stats = llm.prefix_stats()
    assert stats.rejected == 0 and stats.tier_tokens == len(seq.tokens) == 40
    llm.runner.release(seq)
    llm.check_integrity()


def test_corrupt_tier_entries_are_rejected_and_recomputed(tiny_path, tmp_path):
    a = LLM(tiny_path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path)))
    seq = a.runner.lookup(LONG)
    a.runner.step([seq], [LONG])
    a.runner.release(seq)
    a.flush()
    files = sorted(tmp_path.rglob("*.kv"), key=lambda f: f.stat().st_mtime)
    blob = bytearray(files[3].read_bytes())
    blob[-10] ^= 0xFF  # one flipped byte in the tensor data
    files[3].write_bytes(bytes(blob))
    files[5].write_bytes(files[5].read_bytes()[:100])  # a truncated entry
    b = LLM(tiny_path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path)))
    hit = _hit_then_check(b, LONG)  # exact: the corrupt page and everything after it recomputed
    stats = b.prefix_stats()
    assert stats.rejected >= 1 and hit < 43


def test_another_model_layout_or_salt_never_hits_a_tier(tiny_path, tmp_path, tiny_dir):
    a = LLM(tiny_path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path)))
    seq = a.runner.lookup(LONG)
    a.runner.step([seq], [LONG])
    a.runner.release(seq)
    a.flush()
    for llm in (LLM(tiny_path, kv="fp16,page_size=4", prefix=PrefixConfig(disk=str(tmp_path))),
                LLM(tiny_path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path), salt="other")),
                LLM(str(tiny_dir("qwen2")[0]), kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path)))):
        seq = llm.runner.lookup(LONG)
        assert seq.tokens == [] and llm.prefix_stats().rejected == 0
        llm.runner.release(seq)


def test_two_processes_share_pages_through_redis(tiny_path, redis_url):
    import subprocess
    import sys

    code = (
        "import json, sys; from kvcache import LLM, PrefixConfig\n"
        f"llm = LLM({tiny_path!r}, kv='dynamic,page_size=4', prefix=PrefixConfig(redis={redis_url!r}))\n"
        f"seq = llm.runner.lookup({LONG!r})\n"
        f"llm.runner.step([seq], [{LONG!r}[len(seq.tokens):]])\n"
        "llm.runner.release(seq); llm.flush()\n"
        "print(json.dumps(llm.prefix_stats().as_dict()))\n"
    )
    out = subprocess.run(forkserve.python_command("-c", code), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    here = LLM(tiny_path, kv="dynamic,page_size=4", prefix=PrefixConfig(redis=redis_url))
    assert _hit_then_check(here, LONG[:-1] + [9]) == 40  # whole pages written by the other process
    assert here.prefix_stats().tiers["hits"]["redis"] == 10


def test_a_redis_that_does_not_answer_is_a_miss_with_one_warning(tiny_path):
    from kvcache.peers.process import free_port

    llm = LLM(tiny_path, kv="dynamic,page_size=4", prefix=PrefixConfig(redis=f"redis://127.0.0.1:{free_port()}/0"))
    with pytest.warns(UserWarning, match="did not answer") as record:
        t0 = time.perf_counter()
        for p in (LONG, LONG[:-2] + [5, 6]):
            out = llm.generate([p], SamplingParams(max_tokens=3, ignore_eos=True))[0]
            assert len(out.token_ids) == 3
        llm.flush()
        assert time.perf_counter() - t0 < 10
    assert len([w for w in record if "did not answer" in str(w.message)]) == 1
    llm.check_integrity()


def test_bad_tier_settings_are_clear_errors(tiny_path, tmp_path):
    from kvcache.errors import KVCacheError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(KVCacheError, match="is not writable"):
        LLM(tiny_path, prefix=PrefixConfig(disk=str(blocker / "sub")))
    with pytest.raises(KVCacheError, match="must start with redis://"):
        LLM(tiny_path, prefix=PrefixConfig(redis="http://localhost:6379"))


def test_a_sequence_given_back_before_it_wrote_into_a_shared_partial_page(tiny_path):
    """A lookup may end inside a cached page whose later tokens differ; if the sequence is given
    back before it writes there (preempted, aborted, failed), that page must not be indexed a
    second time under the shorter tokens."""
    llm = LLM(tiny_path, kv="dynamic,page_size=4")
    r = llm.runner
    first = SYSTEM[:8]  # two full pages
    seq = r.lookup(first, whole=True)
    r.step([seq], [first])
    r.release(seq)
    other = SYSTEM[:6] + [150, 151]  # shares the first page and half of the second
    seq = r.lookup(other)
    assert len(seq.tokens) == 6 and seq.kv.tables[0][1] == r.prefix.index.match(first).nodes[1].pages[0]
    r.release(seq)  # given back before writing its own tokens into that page
    llm.check_integrity()
    seq = r.lookup(other)
    logits = r.step([seq], [other[len(seq.tokens):]])[0]
    torch.testing.assert_close(logits, _recompute(llm, other), atol=1e-4, rtol=1e-4)
    r.release(seq)
    llm.check_integrity()
