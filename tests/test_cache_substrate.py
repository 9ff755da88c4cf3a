"""Page allocator, pool and page tables, without a model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.attention.backends import PagedContext
from kvcache.cache import PageAllocator, PagedKVCache
from kvcache.cache.config import CacheConfig, parse_kv_spec
from kvcache.errors import ContextOverflow, InvalidParams
from kvcache.models.config import ModelConfig

TINY = ModelConfig(
    model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=4, max_position=512, layer_windows=(None, None),
)


def test_allocator_lowest_first_and_release():
    a = PageAllocator(4)
    assert a.allocate(2) == [0, 1]
    a.incref([1])
    a.release([0, 1])
    assert a.num_free == 3 and a.refcount(1) == 1
    assert a.allocate(1) == [0]
    with pytest.raises(ContextOverflow, match="KV cache is full"):
        a.allocate(5)
    a.check_integrity()
    with pytest.raises(RuntimeError):
        a.release([3])


def test_pool_grows_and_keeps_contents():
    cache = PagedKVCache(TINY, CacheConfig("dynamic", page_size=4, initial_tokens=4))
    s = cache.new_sequence()
    k = torch.randn(3, 2, 4)
    ctx = PagedContext(cache, [s], [3], torch.arange(3))
    cache.pools[0].write(0, ctx.plan.write_slots[0], k, k)
    assert cache.pages.total(0) == 1
    s2 = cache.new_sequence()
    PagedContext(cache, [s2], [9], torch.arange(9))  # forces growth
    assert cache.pages.total(0) >= 4
    kk, _ = cache.pools[0].read(0, s.first_page_if_contiguous(), None, 3)
    torch.testing.assert_close(kk, k.transpose(0, 1))
    cache.check_integrity()


def test_static_refuses_past_capacity():
    cache = PagedKVCache(TINY, parse_kv_spec("static,max_tokens=8,page_size=4"))
    s = cache.new_sequence()
    PagedContext(cache, [s], [8], torch.arange(8))
    with pytest.raises(ContextOverflow, match="static cache capacity of 8"):
        PagedContext(cache, [s], [1], torch.tensor([8]))
    assert s.length == 8
    assert cache.pages.total(0) == 2


def test_gather_path_equals_written_values():
    cache = PagedKVCache(TINY, CacheConfig("dynamic", page_size=2, initial_tokens=16))
    a, b = cache.new_sequence(), cache.new_sequence()
    written = {a.seq_id: [], b.seq_id: []}
    for step in range(5):  # interleaved growth: page tables are not contiguous
        for s in (a, b):
            kv = torch.randn(1, 2, 4)
            ctx = PagedContext(cache, [s], [1], torch.tensor([s.length]))
            cache.pools[0].write(1, ctx.plan.write_slots[0], kv, -kv)
            written[s.seq_id].append(kv)
    assert a.first_page_if_contiguous() is None
    plan = PagedContext(cache, [a], [1], torch.tensor([5])).plan.reads[0][0]
    kk, vv = cache.pools[0].read(1, plan.first_slot, plan.slots[:5], 5)
    torch.testing.assert_close(kk, torch.cat(written[a.seq_id]).transpose(0, 1))
    torch.testing.assert_close(vv, -kk)


def test_positions_must_continue_the_sequence():
    cache = PagedKVCache(TINY, CacheConfig())
    s = cache.new_sequence()
    with pytest.raises(ValueError, match="do not continue"):
        PagedContext(cache, [s], [2], torch.tensor([3, 4]))


def test_kv_spec_parsing_and_errors():
    assert parse_kv_spec("static,max_tokens=64").max_tokens == 64
    assert parse_kv_spec("dynamic,page_size=32").spec() == "dynamic,page_size=32"
    with pytest.raises(InvalidParams, match="unknown --kv item 'int9'"):
        parse_kv_spec("dynamic,int9")
    with pytest.raises(InvalidParams, match="max_tokens applies to the static"):
        parse_kv_spec("dynamic,max_tokens=5")
    with pytest.raises(InvalidParams, match="needs an integer"):
        parse_kv_spec("static,max_tokens=lots")
    with pytest.raises(InvalidParams, match="both set capacity"):  # never the last one silently
        parse_kv_spec("static,dynamic")


def test_stats_accounting():
    cache = PagedKVCache(TINY, CacheConfig(page_size=4, initial_tokens=32))
    s = cache.new_sequence()
    PagedContext(cache, [s], [6], torch.arange(6))
    st_ = cache.stats()
    assert st_.bytes_per_token == 2 * 2 * 2 * 4 * 4 == TINY.kv_bytes_per_token()
    assert (st_.pages_total, st_.pages_used, st_.tokens_stored) == (8, 2, 6)
    assert st_.bytes_used == 6 * st_.bytes_per_token
    assert st_.bytes_allocated == 8 * 4 * st_.bytes_per_token


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "grow", "fork", "trunc", "free"]), st.integers(0, 40)),
                max_size=40))
def test_random_workload_keeps_page_accounting(ops):
    cache = PagedKVCache(TINY, CacheConfig(page_size=4, initial_tokens=8))
    live = []
    for op, n in ops:
        if op == "new" or not live:
            live.append(cache.new_sequence())
        s = live[n % len(live)]
        if op == "grow":
            PagedContext(cache, [s], [n % 9 + 1], torch.arange(s.length, s.length + n % 9 + 1))
        elif op == "fork":
            live.append(cache.fork(s))
        elif op == "trunc":
            cache.truncate(s, n % (s.length + 1))
        elif op == "free":
            cache.free(s)
            live.remove(s)
        cache.check_integrity()
    for s in live:
        cache.free(s)
    cache.check_integrity()
    assert cache.pages.free(0) == cache.pages.total(0)


def test_batch_reservation_is_all_or_nothing():
    cache = PagedKVCache(TINY, parse_kv_spec("static,max_tokens=8,max_seqs=2,page_size=4"))
    a, b = cache.new_sequence(), cache.new_sequence()
    PagedContext(cache, [a, b], [4, 4], torch.arange(4).repeat(2))
    used = cache.pages.used(0)
    with pytest.raises(ContextOverflow):  # a's extra page is taken, then b overflows
        PagedContext(cache, [a, b], [4, 5], torch.cat((torch.arange(4, 8), torch.arange(4, 9))))
    assert (a.length, b.length) == (4, 4) and cache.pages.used(0) == used
    cache.check_integrity()


class Keeper:
    """An evictor that keeps pages it was handed (one reference each) and gives back the oldest."""

    def __init__(self) -> None:
        self.cache: PagedKVCache | None = None
        self.kept: list[int] = []
        self.asked: list[tuple[int, int]] = []

    def keep(self, pages: list[int]) -> None:
        assert self.cache is not None
        self.cache.pages.share(0, pages)
        self.kept += pages

    def reclaim(self, group: int, short: int) -> None:
        assert self.cache is not None
        self.asked.append((group, short))
        gone, self.kept = self.kept[:short], self.kept[short:]
        self.cache.pages.drop(group, gone)

    def held_pages(self) -> dict[int, list[int]]:
        return {0: list(self.kept)}

    def remap(self, group: int, moves: dict[int, int]) -> None:
        self.kept = [moves.get(p, p) for p in self.kept]


def test_evictor_given_at_construction_is_asked_before_the_pool_fails():
    keeper = Keeper()
    cache = PagedKVCache(TINY, parse_kv_spec("static,max_tokens=16,max_seqs=1,page_size=4"), evictor=keeper)
    keeper.cache = cache
    s = cache.new_sequence()
    cache.reserve(s, 16)
    keeper.keep(s.tables[0])
    cache.free(s)
    assert cache.stats().pages_cached == 4  # held by the evictor alone: cached, counted as holders
    cache.check_integrity()
    t = cache.new_sequence()
    cache.reserve(t, 6)  # the pool is all cached: two pages reclaimed
    t.length = 6
    assert keeper.asked == [(0, 2)] and len(keeper.kept) == 2
    assert cache.stats().pages_cached == 2
    cache.check_integrity()
    with pytest.raises(InvalidParams, match="already has an evictor"):
        cache.attach_evictor(Keeper())
    keeper.kept.clear()  # an evictor that drops pages without releasing them breaks the count
    with pytest.raises(AssertionError, match="holders"):
        cache.check_integrity()
