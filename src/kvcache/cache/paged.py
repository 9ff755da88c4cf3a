"""PagedKVCache: per layer group a pool and an allocator; per sequence a page table per group.

dynamic: every pool starts with room for ``initial_tokens`` and doubles when it runs out, within
its ``budget`` when it has one (cache/budget.py), and gives pages back when ``shrink`` is called.
static: room for ``max_seqs`` x ``max_tokens`` preallocated; a request beyond it is refused
(ContextOverflow) before anything is written.
Windows: pages whose tokens no query can see again go back to their group's pool (sink pages stay).
Quantized encodings: a group's pool holds whole quantized pages; each sequence keeps its latest
tokens (at most ``residual + page_size - 1``) in fp32 until whole pages can be sealed.
A press (``config.press``): each sequence holds its kept tokens in slots, fewer than its length;
cache/retention.py evicts, packs and follows which token each slot holds (page math here counts
slots: ``seq.held(g)``).
Pages held beside the sequences (a prefix index) belong to the cache's one ``Evictor``
(cache/evictor.py), which ``take_pages`` asks to reclaim pages before a pool grows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvcache.cache import budget as _budget
from kvcache.cache import retention
from kvcache.cache.accounting import CacheStats, cache_stats, check_integrity
from kvcache.cache.allocator import PageAllocator
from kvcache.cache.evictor import Evictor
from kvcache.cache.groups import LayerGroup, plan_groups
from kvcache.cache.placement import Placement
from kvcache.cache.pool import PagePool
from kvcache.cache.qpool import QuantPool
from kvcache.cache.sequence import HOLE, SeqKV
from kvcache.cache.config import CacheConfig
from kvcache.errors import CacheFull, ContextOverflow, InvalidParams
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
        _budget.check_preallocation(config, model, model.num_layers, pages)
        self.placement = Placement(config.placement, torch.device(device), config.dir)
        self.where: list[tuple[int, int]] = [(0, 0)] * model.num_layers  # layer -> (group, index)
        self.pools: list[PagePool | QuantPool] = []
        self.allocators: list[PageAllocator] = []
        for g in self.groups:
            for j, layer in enumerate(g.layers):
                self.where[layer] = (g.index, j)
            n, hkv, d = len(g.layers), model.num_kv_heads, model.head_dim
            if config.quantized:
                pool: PagePool | QuantPool = QuantPool(n, hkv, d, ps, pages, config.bits, config.group_size,
                                                       self.placement)
            else:
                pool = PagePool(n, hkv, d, ps, pages, _DTYPES[config.encoding], self.placement)
            self.pools.append(pool)
            self.allocators.append(PageAllocator(pages))
        if config.capacity == "dynamic" and config.budget is not None:
            fit = _budget.initial_pages(self, pages)
            if fit < pages:
                for pool, alloc in zip(self.pools, self.allocators):
                    pool.resize(fit)
                    alloc.truncate(fit)
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
        if self.config.capacity == "dynamic":
            return _budget.tokens_per_sequence(self)
        if all(g.window is not None for g in self.groups):
            return None
        return self.config.max_tokens

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
        return _budget.room(self, group)

    def shrink(self) -> int:
        """Give back the pages of dynamic pools beyond those in use (never below their initial
        size); returns the bytes given back."""
        return _budget.shrink(self, self.initial_pages)

    def pages_after(self, seq: SeqKV, group: int, length: int) -> int:
        """Logical pages the group's table holds once the sequence has ``length`` tokens (slots,
        with a press). A quantized press sequence reading a prompt seals nothing until the press
        has chosen (evict, then quantize what stays)."""
        ps = self.page_size
        if not self.quantized:
            return -(-length // ps)
        if seq.press is not None and seq.press.observing:
            return len(seq.tables[group])
        sealed = len(seq.tables[group]) * ps
        return len(seq.tables[group]) + max(0, (length - sealed - self.config.residual) // ps)

    def reserve(self, seq: SeqKV, new_tokens: int) -> None:
        """Give ``seq`` the pages for ``new_tokens`` more tokens (all groups, or none on overflow)."""
        total = seq.length + new_tokens
        cap = self.capacity_per_sequence()
        if cap is not None and total > cap:
            raise ContextOverflow(
                f"sequence of {total} tokens exceeds the static cache capacity of {cap} tokens "
                "(raise it with --kv static,max_tokens=N)")
        if seq.press is not None:
            if new_tokens > 1:
                seq.press.observing = True  # a prompt (or a chat turn) is being read
            retention.settle(self, seq)
        self.release_dead(seq)
        self._own_last_page(seq)
        before = [len(t) for t in seq.tables]
        try:
            for g in self.groups:
                need = self.pages_after(seq, g.index, seq.held(g.index) + new_tokens) - len(seq.tables[g.index])
                if need > 0:
                    seq.tables[g.index].extend(self.take_pages(g.index, need))
        except ContextOverflow:
            self.unreserve(seq, before)
            raise

    def reserve_all(self, seqs: Sequence[SeqKV], new_tokens: Sequence[int]) -> list[list[int]]:
        """``reserve`` for every sequence, or for none: if one fails, what the others got is given
        back. Returns each sequence's table lengths from before (per group)."""
        before = [[len(t) for t in seq.tables] for seq in seqs]
        try:
            for seq, n in zip(seqs, new_tokens):
                self.reserve(seq, n)
        except Exception:
            for seq, lens in zip(seqs, before):
                self.unreserve(seq, lens)
            raise
        return before

    def unreserve(self, seq: SeqKV, table_lens: list[int]) -> None:
        """Give back the pages reserved after each group's table had ``table_lens[g]`` entries."""
        for gi, n in enumerate(table_lens):
            table = seq.tables[gi]
            self.allocators[gi].release([p for p in table[n:] if p != HOLE])
            del table[n:]

    def slots(self, seq: SeqKV, group: int, start: int, n: int) -> torch.Tensor:
        """Pool slots (page * page_size + offset) of positions start .. start + n - 1: [n] int64.
        Only the touched pages are looked up."""
        ps, first = self.page_size, start // self.page_size
        table = torch.tensor(seq.tables[group][first : (start + n - 1) // ps + 1], dtype=torch.long)
        idx = torch.arange(start, start + n) - first * ps
        return table[idx // ps] * ps + idx % ps

    def release_dead(self, seq: SeqKV) -> None:
        """Windowed groups: give back pages no query at ``seq.length`` or later can see."""
        if seq.press is not None:
            retention.release_dead(self, seq)
            return
        ps = self.page_size
        for g in self.groups:
            dead = g.dead_before(seq.length)
            table = seq.tables[g.index]
            first = -(-g.sinks // ps)  # pages holding a sink token stay
            for i in range(first, min(dead // ps, len(table))):
                if table[i] != HOLE:
                    self.allocators[g.index].release([table[i]])
                    table[i] = HOLE

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
        for g in self.groups:
            table = seq.tables[g.index]
            self.allocators[g.index].incref([p for p in table if p != HOLE])
            child.tables[g.index] = list(table)
            if self.quantized:
                child.tails[g.index] = [t.clone() for t in seq.tails[g.index]]  # type: ignore[union-attr]
        child.length = seq.length
        if seq.press is not None:
            child.dropped, child.press = list(seq.dropped), seq.press.clone()
        return child

    def _own_last_page(self, seq: SeqKV) -> None:
        """Copy-on-write: before new tokens go into a partly filled page that another sequence
        also holds, give this sequence its own copy."""
        if self.quantized:
            return
        for g in self.groups:
            held = seq.held(g.index)
            if held % self.page_size:
                self.own_pages(seq, g.index, (held - 1) // self.page_size, (held - 1) // self.page_size + 1)

    def own_pages(self, seq: SeqKV, group: int, first: int, stop: int) -> None:
        """Copy-on-write: pages ``first .. stop - 1`` of the group's table that another holder
        shares become the sequence's own copies."""
        table, alloc = seq.tables[group], self.allocators[group]
        for i in range(first, min(stop, len(table))):
            if table[i] != HOLE and alloc.refcount(table[i]) > 1:
                (new,) = self.take_pages(group, 1)
                self.pools[group].copy_page(table[i], new)
                alloc.release([table[i]])
                table[i] = new
                self.cow_copies += 1

    def truncate(self, seq: SeqKV, length: int) -> None:
        """Forget tokens from ``length`` on; pages no longer needed go back to the pool (a shared
        partial page stays shared until written). Quantized: a cut inside the quantized pages
        moves the kept part of the last page back to the fp32 tail (as it was dequantized)."""
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot truncate a sequence of {seq.length} tokens to {length}")
        if seq.press is not None:
            retention.truncate(self, seq, length)
            return
        ps = self.page_size
        for g in self.groups:
            table, alloc, pool = seq.tables[g.index], self.allocators[g.index], self.pools[g.index]
            if self.quantized:
                tails = seq.tails[g.index]
                assert tails is not None
                sealed = len(table) * ps
                if length >= sealed:
                    seq.tails[g.index] = [t[:, :, : length - sealed] for t in tails]
                    continue
                keep, rest = length // ps, length % ps
                new_tails = []
                for j, t in enumerate(tails):
                    part = torch.empty(2, self.model.num_kv_heads, ps, self.model.head_dim)
                    if rest and table[keep] != HOLE:
                        assert isinstance(pool, QuantPool)
                        pool.read_into(j, None, table[keep], 1, part)
                    new_tails.append(part[:, :, :rest].clone())
                seq.tails[g.index] = new_tails
            else:
                keep = -(-length // ps)  # a kept shared partial page is copied when next written
            alloc.release([p for p in table[keep:] if p != HOLE])
            del table[keep:]
        seq.length = length

    def take_pages(self, group: int, n: int) -> list[int]:
        """``n`` fresh pages of ``group``'s pool, each with one reference the caller now holds
        (put them in a page table, or give them back with ``allocators[group].release``).

        When the free pages do not cover ``n``, the evictor reclaims first; then a dynamic pool
        grows (at least doubling, within its budget). Raises CacheFull when the pages cannot be
        had (a static pool full, a budgeted one at its budget). Used by reservations, by restoring
        prefix pages from a tier and by loading a saved sequence."""
        alloc = self.allocators[group]
        if n > alloc.num_free and self.evictor is not None:
            self.evictor.reclaim(group, n - alloc.num_free)
        if n > alloc.num_free and self.config.capacity == "dynamic":
            short, room = n - alloc.num_free, self.room(group)
            extra = max(alloc.total, short)
            if room is not None:
                if room < short:
                    from kvcache.fmt import human_bytes

                    raise CacheFull(f"KV cache budget of {human_bytes(self.config.budget or 0)} is used up "
                                    f"(--kv-budget): need {short} more pages, room for {room}")
                extra = min(extra, room)
            self.pools[group].resize(self.pools[group].num_pages + extra)
            alloc.grow(extra)
        return alloc.allocate(n)

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
        for g in self.groups:
            self.allocators[g.index].release([p for p in seq.tables[g.index] if p != HOLE])
            seq.tables[g.index] = []
            if self.quantized:
                seq.tails[g.index] = []
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
