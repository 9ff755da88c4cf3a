"""Restores and prefill: a tier restore when the RAM match ends inside a page, and windowed chunked
prefill that is all or nothing when the pool runs out in a later chunk."""

from __future__ import annotations

import pytest
import torch

from kvcache import LLM, SamplingParams
from kvcache.cache.config import parse_kv_spec
from kvcache.engine.runner import WINDOW_CHUNK, ModelRunner
from kvcache.errors import CacheFull
from kvcache.prefix.config import PrefixConfig

from test_prefix import _recompute

A = [5 + (i * 7) % 140 for i in range(40)]  # a long conversation: 10 pages of 4
B = A[:6] + [150, 151, 152, 153, 154, 155]  # another one sharing its first page and a half


@pytest.fixture(scope="module")
def tiny_path(tiny_dir):
    return str(tiny_dir("llama")[0])


def test_a_ram_match_ending_inside_a_page_goes_on_in_the_tiers(tiny_path, tmp_path):
    """After a restart, an unrelated chat puts a page into RAM that shares half of A's second page;
    A's lookup then matches 6 tokens in RAM and must still get its 36 from disk."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = LLM(tiny_path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path)))
    first.generate([A], params)
    first.flush()
    later = LLM(tiny_path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path)))
    assert later.generate([B], params)[0].cached_tokens == 4  # the shared first page, from disk
    assert later.runner.prefix.index.match(A).length == 6  # RAM now ends inside A's second page
    seq = later.runner.lookup(A)
    assert len(seq.tokens) == 36 and later.prefix_stats().tier_tokens == 4 + 32
    logits = later.runner.step([seq], [A[36:]])[0]
    torch.testing.assert_close(logits, _recompute(later, A), atol=1e-4, rtol=1e-4)
    later.runner.release(seq)
    later.check_integrity()
    assert later.kv_stats().pages_in_use == 0


def test_a_partial_ram_page_stays_when_the_tiers_have_nothing_more(tiny_path, tmp_path):
    llm = LLM(tiny_path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path)))
    llm.generate([B], SamplingParams(max_tokens=1))
    llm.flush()
    seq = llm.runner.lookup(A)  # 6 tokens in RAM, nothing of A's on disk past them
    assert len(seq.tokens) == 6
    logits = llm.runner.step([seq], [A[6:]])[0]
    torch.testing.assert_close(logits, _recompute(llm, A), atol=1e-4, rtol=1e-4)
    llm.runner.release(seq)
    llm.check_integrity()


WINDOWED = "static,window=32,page_size=16,max_tokens=600,max_seqs=1"  # 38 pages
LONG = [(i * 13 + 5) % 150 for i in range(2 * WINDOW_CHUNK + 76)]  # three chunks


def test_windowed_chunked_prefill_is_all_or_nothing(tiny_dir):
    """Another sequence holds 5 of 38 pages: the long prompt's first chunk fits (32 pages), its
    second does not (2 kept in the window + 32 new). The failed step leaves the sequence as it
    was, every page back, and the same step succeeds once there is room."""
    model = LLM(str(tiny_dir("llama")[0]), kv="none").model
    runner = ModelRunner(model, parse_kv_spec(WINDOWED))
    other = runner.new_sequence()
    runner.step([other], [list(range(10, 90))])  # 80 tokens: 5 pages
    seq = runner.new_sequence()
    with pytest.raises(CacheFull):
        runner.step([seq], [LONG])
    assert seq.tokens == [] and seq.kv.length == 0
    runner.check_integrity()
    assert runner.stats().pages_used == 5
    runner.free(other)
    got = runner.step([seq], [LONG])[0]
    fresh = ModelRunner(model, parse_kv_spec(WINDOWED))
    want = fresh.step([fresh.new_sequence()], [LONG])[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
