"""Memory accounting and the page-integrity check of a PagedKVCache (read through CacheParts).

Owns CacheStats and LayerStats (bytes and pages per layer) and ``check_integrity``: free +
referenced + cached == total, every reference with a holder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.cache.parts import CacheParts
from kvcache.cache.sequence import HOLE


@dataclass(frozen=True)
class LayerStats:
    layer: int
    group: int
    window: int | None
    sinks: int
    bytes_per_token: float  # stored form, scales included
    pages_total: int
    pages_used: int
    bytes_allocated: int  # the layer's share of its pool, plus fp32 tails
    bytes_used: int  # tokens held in pages x bytes per token, plus fp32 tails


@dataclass(frozen=True)
class CacheStats:
    strategy: str  # the spec
    page_size: int
    bytes_per_token: int  # all layers, the stored form (quantized: scales included, tails not)
    pages_total: int
    pages_used: int  # referenced: by running sequences or by the prefix index
    tokens_stored: int  # sum of the sequences' lengths
    bytes_allocated: int
    bytes_used: int
    encoding: str = "fp32"  # the pages' encoding, with ",rotate" where K/V are rotated before quantizing
    pages_cached: int = 0  # held only by the prefix index (evictable); part of pages_used
    per_layer: tuple[LayerStats, ...] = field(default=())

    @property
    def pages_in_use(self) -> int:
        """Pages held by running sequences (referenced, not merely cached)."""
        return self.pages_used - self.pages_cached

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "per_layer"}
        out["pages_in_use"] = self.pages_in_use
        out["per_layer"] = [s.__dict__ for s in self.per_layer]
        return out


def _tail_bytes(cache: CacheParts, group: int, j: int) -> int:
    total = 0
    for s in cache.sequences.values():
        tails = s.tails[group] if s.tails else None
        if tails:
            total += tails[j].numel() * tails[j].element_size()
    return total


def cache_stats(cache: CacheParts) -> CacheStats:
    ps = cache.page_size
    layers: list[LayerStats] = []
    for g in cache.groups:
        pool, pages = cache.pools[g.index], cache.pages
        tokens_in_pages = 0
        for s in cache.sequences.values():
            table = s.tables[g.index]
            for i, p in enumerate(table):
                if p != HOLE:
                    tokens_in_pages += min(ps, s.held(g.index) - i * ps) if not cache.config.quantized else ps
        per_tok = pool.token_bytes
        share = pool.nbytes // len(g.layers)
        # a press's record of the token each slot holds, per layer and head (cache/retention.py)
        slots = sum(int(s.press.pos[g.index][0].numel() * s.press.pos[g.index].element_size())
                    + (0 if s.press.acc[g.index] is None else s.press.acc[g.index][0].numel() * 4)  # type: ignore[union-attr]
                    for s in cache.sequences.values() if s.press is not None)
        for j, layer in enumerate(g.layers):
            tail = _tail_bytes(cache, g.index, j) + slots
            layers.append(LayerStats(layer, g.index, g.window, g.sinks, per_tok, pages.total(g.index),
                                     pages.used(g.index), share + tail, int(tokens_in_pages * per_tok) + tail))
    layers.sort(key=lambda s: s.layer)
    return CacheStats(
        strategy=cache.config.spec(),
        page_size=ps,
        bytes_per_token=int(round(sum(s.bytes_per_token for s in layers))),
        pages_total=sum(cache.pages.total(g.index) for g in cache.groups),
        pages_used=sum(cache.pages.used(g.index) for g in cache.groups),
        tokens_stored=sum(s.length for s in cache.sequences.values()),
        bytes_allocated=sum(s.bytes_allocated for s in layers),
        bytes_used=sum(s.bytes_used for s in layers),
        encoding=cache.config.encoding + (",rotate" if cache.config.rotate else ""),  # what the pages hold
        pages_cached=sum(cached_pages(cache).values()),
        per_layer=tuple(layers),
    )


def cached_pages(cache: CacheParts) -> dict[int, int]:
    """Per group, pages only the prefix index holds (cached, evictable)."""
    held = cache.evictor.held_pages() if cache.evictor is not None else {}
    return {g: sum(1 for p in pages if cache.pages.refcount(g, p) == 1) for g, pages in held.items()}


def check_integrity(cache: CacheParts) -> None:
    """Each group's allocator is consistent; every page's ref count equals the number of holders
    (page tables of live sequences, plus the prefix index); every table covers its sequence's
    length; free + referenced by sequences + cached only by the index == total."""
    ps = cache.page_size
    held = cache.evictor.held_pages() if cache.evictor is not None else {}
    for g in cache.groups:
        cache.pages.check(g.index)
        counts: dict[int, int] = {}
        index_pages = held.get(g.index, [])
        if len(set(index_pages)) != len(index_pages):
            raise AssertionError(f"group {g.index}: the prefix index holds a page twice")
        for p in index_pages:
            counts[p] = counts.get(p, 0) + 1
        for s in cache.sequences.values():
            table = s.tables[g.index]
            slots = s.held(g.index)
            quantized = cache.config.quantized
            covered = len(table) * ps + s.tail_len(g.index) if quantized else -(-slots // ps)
            if (quantized and covered != slots) or (not quantized and len(table) != covered):
                raise AssertionError(f"sequence {s.seq_id}, group {g.index}: {len(table)} pages for {slots} tokens")
            if s.press is not None and s.press.n[g.index] != slots:
                raise AssertionError(f"sequence {s.seq_id}, group {g.index}: {s.press.n[g.index]} slot positions "
                                     f"for {slots} slots")
            for p in table:
                if p != HOLE:
                    counts[p] = counts.get(p, 0) + 1
        gi, pages = g.index, cache.pages
        total = pages.total(gi)
        for p in range(total):
            if pages.refcount(gi, p) != counts.get(p, 0):
                raise AssertionError(
                    f"group {gi} page {p}: ref count {pages.refcount(gi, p)} but {counts.get(p, 0)} holders")
        cached = sum(1 for p in index_pages if pages.refcount(gi, p) == 1)
        in_use = sum(1 for p in range(total) if pages.refcount(gi, p) > 0) - cached
        if pages.free(gi) + in_use + cached != total:
            raise AssertionError(f"group {gi}: free {pages.free(gi)} + referenced {in_use} + cached "
                                 f"{cached} != total {total}")
