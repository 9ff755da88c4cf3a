"""PagedKVCache: per layer group a pool; per sequence a page table per group; its page manager.

dynamic: every pool starts with room for ``initial_tokens`` and doubles when it runs out, within
its ``budget`` when it has one (cache/capacity.py), and gives pages back when ``shrink`` is called.
static: room for ``max_seqs`` x ``max_tokens`` preallocated; a request beyond it is refused
(ContextOverflow) before anything is written.
Windows: pages whose tokens no query can see again go back to their group's pool (sink pages stay).
Quantized encodings: a group's pool holds whole quantized pages; each sequence keeps its latest
tokens (at most ``residual + page_size - 1``) in fp32 until whole pages can be sealed.
A press (``config.press``): each sequence holds its kept tokens in slots, fewer than its length;
cache/retention.py evicts, packs and follows which token each slot holds (page math here counts
slots: ``seq.held(g)``).
Pages held beside the sequences (a prefix index) belong to the cache's one ``Evictor``
(cache/evictor.py), which the page manager (cache/pages.py, ``cache.pages``: the only code that
takes, shares, gives back or counts pages) asks to reclaim pages before a pool grows.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from kvcache.cache import capacity, retention
from kvcache.cache.accounting import CacheStats, cache_stats, check_integrity
from kvcache.cache.evictor import Evictor
from kvcache.cache.groups import LayerGroup, plan_groups
from kvcache.cache.pages import PageManager
from kvcache.cache.placement import Placement
from kvcache.cache.pool import PagePool
from kvcache.cache.qpool import QuantPool
from kvcache.cache.sequence import HOLE, SeqKV
from kvcache.cache.config import CacheConfig
from kvcache.errors import InvalidParams

if TYPE_CHECKING:  # the model's shape comes in; the cache imports nothing of models/
    from kvcache.models.config import ModelConfig

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

__all__ = ["CacheStats", "PagedKVCache"]


class PagedKVCache:
    def __init__(self, model: ModelConfig, config: CacheConfig, device: torch.device | str = "cpu",
                 evictor: Evictor | None = None) -> None:
        if not config.uses_cache:
            raise ValueError("PagedKVCache needs a caching strategy, not 'none'")
        config = config.with_capacity(model.max_position)
        self.model, self.config = model, config
        self.page_size = ps = config.pages_of
        self.groups: list[LayerGroup] = plan_groups(model, config)
        if config.capacity == "static":
            assert config.max_tokens is not None
            for g in self.groups:
                if g.window is not None and config.max_tokens < g.window + ps:
                    raise InvalidParams(
                        f"static max_tokens={config.max_tokens} is smaller than the window ({g.window}) "
                        f"plus one page ({ps}); raise max_tokens or shrink the window")
            pages = config.max_seqs * -(-config.max_tokens // ps)
        else:
            pages = -(-config.initial_tokens // ps)
        capacity.check_preallocation(config, model, model.num_layers, pages)
        self.placement = Placement(config.placement, torch.device(device), config.dir)
        self.where: list[tuple[int, int]] = [(0, 0)] * model.num_layers  # layer -> (group, index)
        self.pools: list[PagePool | QuantPool] = []
        sparse = config.capacity == "dynamic"  # the first pool is room to grow into: resident where written
        for g in self.groups:
            for j, layer in enumerate(g.layers):
                self.where[layer] = (g.index, j)
            n, hkv, d = len(g.layers), model.num_kv_heads, model.head_dim
            if config.quantized:
                pool: PagePool | QuantPool = QuantPool(n, hkv, d, ps, pages, config.bits, config.group_size,
                                                       self.placement, rotate=config.rotate, sparse_start=sparse)
            else:
                pool = PagePool(n, hkv, d, ps, pages, _DTYPES[config.encoding], self.placement, sparse_start=sparse)
            self.pools.append(pool)
        self.pages = PageManager(self, pages)  # the only owner of the pools' pages
        if config.capacity == "dynamic" and config.budget is not None:
            fit = capacity.initial_pages(config, self.pools, pages)
            if fit < pages:
                self.pages.fit(fit)
        self.initial_pages = self.pools[0].num_pages
        self._ids = itertools.count()
        self.sequences: dict[int, SeqKV] = {}
        self.cow_copies = 0  # pages copied because a branch wrote into a shared one
        self.evictor: Evictor | None = evictor  # holds pages beside the sequences (cache/evictor.py)

    def attach_evictor(self, evictor: Evictor) -> None:
        """Give the cache its evictor after construction (one built on the cache, as a prefix
        index is); a cache has at most one."""
        if self.evictor is not None:
            raise InvalidParams("this cache already has an evictor (one prefix cache per KV cache)")
        self.evictor = evictor

    @property
    def quantized(self) -> bool:
        return self.config.quantized

    # -- sequences ---------------------------------------------------------------------------
    def new_sequence(self) -> SeqKV:
        seq = SeqKV(next(self._ids), [[] for _ in self.groups],
                    tails=[[] if self.quantized else None for _ in self.groups])
        if self.config.press is not None:
            from kvcache.press import make_press
            from kvcache.press.state import PressState

            seq.dropped = [0] * len(self.groups)
            seq.press = PressState(make_press(self.config.press), [len(g.layers) for g in self.groups],
                                   self.model.num_layers, self.model.num_kv_heads)
        if self.quantized:
            hkv, d = self.model.num_kv_heads, self.model.head_dim
            for g in self.groups:
                seq.tails[g.index] = [torch.empty(2, hkv, 0, d) for _ in g.layers]
        self.sequences[seq.seq_id] = seq
        return seq

    def capacity_per_sequence(self) -> int | None:
        """Most tokens one sequence can hold (None: unbounded, every group has a window)."""
        return capacity.capacity_per_sequence(self.config, self.groups, self.pools)

    def capacity_reason(self) -> str | None:
        """What bounds a sequence besides the model's context, in words (None: nothing)."""
        if self.capacity_per_sequence() is None:
            return None
        if self.config.capacity == "static":
            return f"the static cache's max_tokens={self.config.max_tokens}"
        from kvcache.fmt import human_bytes

        return f"what the KV budget of {human_bytes(self.config.budget or 0)} holds (--kv-budget)"

    def room(self, group: int) -> int | None:
        """Pages the group's pool may still grow by (None: unbounded; static: 0)."""
        return capacity.room(self.config, self.pools, group)

    def shrink(self) -> int:
        """Give back the pages of dynamic pools beyond those in use (never below their initial
        size); returns the bytes given back. Pages in use above the cut move below it first."""
        if self.config.capacity != "dynamic":
            return 0
        before = capacity.pool_bytes(self.pools)
        self.pages.shrink(self.initial_pages)
        return before - capacity.pool_bytes(self.pools)

    def pages_after(self, seq: SeqKV, group: int, length: int) -> int:
        """Logical pages the group's table holds once the sequence has ``length`` tokens (slots,
        with a press). A quantized press sequence reading a prompt seals nothing until the press
        has chosen (evict, then quantize what stays)."""
        return capacity.pages_after(self.config, seq, group, length)

    def reserve(self, seq: SeqKV, new_tokens: int) -> None:
        """Give ``seq`` the pages for ``new_tokens`` more tokens (the page manager's ``reserve``)."""
        self.pages.reserve(seq, new_tokens)

    def slots(self, seq: SeqKV, group: int, start: int, n: int) -> torch.Tensor:
        """Pool slots (page * page_size + offset) of positions start .. start + n - 1: [n] int64.
        Only the touched pages are looked up."""
        ps, first = self.page_size, start // self.page_size
        if n <= 16:  # a decode's few: in Python, one tensor made instead of eight small operations
            t = seq.tables[group]
            return torch.tensor([t[p // ps] * ps + p % ps for p in range(start, start + n)], dtype=torch.long)
        table = torch.tensor(seq.tables[group][first : (start + n - 1) // ps + 1], dtype=torch.long)
        idx = torch.arange(start, start + n) - first * ps
        return table[idx // ps] * ps + idx % ps

    def can_truncate(self, seq: SeqKV, length: int) -> bool:
        """Whether a query at ``length`` would find every token it may see still stored."""
        if seq.press is not None:
            return length == seq.length or (not seq.press.released and retention.cut_point(self, seq, length) is not None)
        ps = self.page_size
        for g in self.groups:
            lo, table = max(g.sinks, g.dead_before(length)), seq.tables[g.index]
            if any(table[i] == HOLE for i in range(lo // ps, min(-(-length // ps), len(table)))):
                return False
        return True

    def fork(self, seq: SeqKV) -> SeqKV:
        """A new sequence with the same tokens sharing every page (ref + 1): nothing is copied
        until a branch writes into a shared partly filled page (copy-on-write, in reserve);
        quantized groups copy their small fp32 tails."""
        child = self.new_sequence()
        self.pages.share_tables(seq, child)
        if self.quantized:
            for g in self.groups:
                child.tails[g.index] = [t.clone() for t in seq.tails[g.index]]  # type: ignore[union-attr]
        child.length = seq.length
        if seq.press is not None:
            child.dropped, child.press = list(seq.dropped), seq.press.clone()
        return child

    def truncate(self, seq: SeqKV, length: int) -> None:
        """Forget tokens from ``length`` on (the page manager's ``truncate``)."""
        self.pages.truncate(seq, length)

    def end_prompt(self, seq: SeqKV) -> None:
        """A prompt is in: a press scores the tokens read since its last compression and evicts
        its share (no-op without a press, or while generating)."""
        retention.end_prompt(self, seq)

    def pass_span(self, seq: SeqKV) -> None:
        """The tokens read since the last compression stay as they are (scored text, not a prompt)."""
        if seq.press is not None:
            seq.press.since, seq.press.observing = seq.length, False
            seq.press.reset_observations()

    def free(self, seq: SeqKV) -> None:
        self.pages.release(seq)
        if self.quantized:
            seq.tails = [[] for _ in self.groups]
        seq.length = 0
        if seq.press is not None:
            seq.dropped = [0] * len(self.groups)
            seq.press = None
        self.sequences.pop(seq.seq_id, None)

    def write(self, layer: int, seq: SeqKV, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store n tokens' K/V (k, v: [n, Hkv, D]) at positions start.. of a float-encoded cache
        whose pages were reserved."""
        if self.quantized:
            raise ValueError("write() stores float encodings; quantized pages are written by a forward")
        gi, j = self.where[layer]
        pool = self.pools[gi]
        assert isinstance(pool, PagePool)
        pool.write(j, self.slots(seq, gi, start, k.shape[0]), k, v)

    # -- accounting ----------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        return cache_stats(self)

    def check_integrity(self) -> None:
        check_integrity(self)
