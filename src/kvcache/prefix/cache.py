"""PrefixCache: the radix index bound to a PagedKVCache's pools and page manager, and its tiers.

- ``lookup(tokens, salt)``: a new sequence holding the longest reusable cached prefix of
  ``tokens`` (never all of them: the last token is recomputed for its logits). RAM first; then,
  page by page, the disk and Redis tiers (their entries are loaded into fresh pool pages).
- ``release(seq, tokens, salt)``: a finished sequence's pages go into the index (one reference
  each, held by the index), then the sequence lets go of its own references.
- ``reclaim(group, short)``: called by the cache when a pool lacks pages: evicts unreferenced
  cached pages (LRU/LFU). A static pool, or a dynamic one at its budget, evicts as much as it
  needs; a dynamic pool with room evicts only what exceeds ``max_cached_tokens`` and otherwise grows.

With tiers, every full page the index takes is written through (on a background thread) under a
chained key of (model fingerprint, cache layout, tenant salt, the token ids up to that page), so
other processes and later runs find it. A tier entry that is missing, corrupt, forged (without
the right MAC when a secret is set) or for another layout is a miss, removed from its tier before
anything could promote it; the tokens are recomputed. A RAM match that ends inside a page goes on
in the tiers from that page's start, so a shorter shared prefix in RAM never hides a longer one
on disk or in Redis. Restore and write-through are restore.py's (TierLink).

Owns the index's policy: what a lookup holds, what a release inserts, what is evicted and when. It
is the cache's Evictor (cache/evictor.py), attached at construction; it takes, shares and gives
back pool pages only through the cache's page manager (``cache.pages``: take, share, drop, shared).

A cache with a press keeps no uncompressed pages here: with a question-agnostic press
(``knorm``, ``expected``) its compressed prompts are shared through spans.py's SpanIndex, keyed
apart from these pages; with any other press nothing is shared.

Locking: none; the engine calls it from one thread (the tier writer thread only sees bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.cache.paged import PagedKVCache
from kvcache.cache.sequence import HOLE, SeqKV
from kvcache.prefix.config import PrefixConfig
from kvcache.prefix.pages import PageEntries, hold
from kvcache.prefix.radix import Match, Node, RadixIndex
from kvcache.prefix.restore import TierLink, layout_text, open_tiers
from kvcache.prefix.span_tiers import SpanLink
from kvcache.prefix.spans import SpanIndex, span_lookup, span_release
from kvcache.press import QUESTION_AGNOSTIC


@dataclass
class PrefixStats:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0  # prompt tokens whose K/V came from the index or a tier
    tier_tokens: int = 0  # of those, restored from disk or Redis
    running_tokens: int = 0  # of those, taken from a request still running (engine/inflight.py)
    evicted_pages: int = 0
    rejected: int = 0  # tier entries found corrupt or mismatched (recomputed)
    cached_pages: int = 0  # pages only the index holds (evictable)
    nodes: int = 0
    tiers: dict[str, object] = field(default_factory=dict)  # the tier chain's counters

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        out = dict(self.__dict__)
        out["hit_rate"] = round(self.hit_rate, 4)
        return out


class PrefixCache:
    def __init__(self, cache: PagedKVCache, config: PrefixConfig, fingerprint: str) -> None:
        self.cache, self.config, self.fingerprint = cache, config, fingerprint
        self.index = RadixIndex(cache.page_size, len(cache.groups), config.policy, partial=not cache.quantized)
        self.stats_ = PrefixStats()
        self.layout = layout_text(cache)
        self.pages = PageEntries(cache)  # what a page entry must hold; entries <-> pool pages
        self.tiers = open_tiers(config) if config.tiers else None
        secret = config.mac_secret() if self.tiers is not None else None
        self.link = (TierLink(cache, self.index, self.pages, self.tiers, fingerprint, self.layout, secret)
                     if self.tiers is not None else None)
        self.spans: SpanIndex | None = None  # compressed prompts (a question-agnostic press)
        self.span_link: SpanLink | None = None
        if cache.config.press in QUESTION_AGNOSTIC:
            self.spans = SpanIndex(cache)
            if self.tiers is not None:
                self.span_link = SpanLink(cache, self.spans, self.tiers, fingerprint, self.layout, secret)
        cache.attach_evictor(self)  # the cache's Evictor: reclaim, held_pages, remap

    # -- lookup -----------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], salt: str | None = None, whole: bool = False) -> tuple[SeqKV, int]:
        """A new sequence holding the K/V of the longest reusable prefix of ``tokens[:-1]`` (of all
        of ``tokens`` when ``whole``)."""
        salt = self.config.salt if salt is None else salt
        if self.cache.config.press is not None:
            if self.spans is None:
                return self.cache.new_sequence(), 0
            seq, length = span_lookup(self.spans, self.cache, tokens, salt, whole, self.span_link)
            self.stats_.requests += 1
            self.stats_.prompt_tokens += len(tokens)
            self.stats_.hit_tokens += length
            return seq, length
        want = tokens if whole else tokens[:-1]
        m = self.index.match(want, salt)
        seq = self.cache.new_sequence()
        hold(self.cache, seq, m.nodes)  # held first: restoring from a tier may evict, never these
        if self.link is not None:
            self.link.restore(want, m, salt, seq)
        length = self._usable(m)
        keep = -(-length // self.cache.page_size)
        for g in range(len(self.cache.groups)):
            dropped = seq.tables[g][keep:]
            self.cache.pages.drop(g, [p for p in dropped if p != HOLE])
            del seq.tables[g][keep:]
        seq.length = length
        self.stats_.requests += 1
        self.stats_.prompt_tokens += len(tokens)
        self.stats_.hit_tokens += length
        return seq, length

    def _usable(self, m: Match) -> int:
        """The longest prefix of the match a query could continue from: every token its windowed
        layers may see must still be stored (a window may have dropped early pages)."""
        ps, length = self.cache.page_size, m.length
        while length > 0:
            ok = True
            for g in self.cache.groups:
                lo = max(g.sinks, g.dead_before(length))
                if any(m.nodes[i].pages[g.index] == HOLE for i in range(lo // ps, -(-length // ps))):
                    ok = False
                    break
            if ok:
                return length
            length = (length - 1) // ps * ps  # the previous page boundary
        return 0

    # -- insertion --------------------------------------------------------------------------------
    def release(self, seq: SeqKV, tokens: list[int], salt: str | None = None) -> None:
        """Put a finished sequence's pages into the index, then free the sequence."""
        salt = self.config.salt if salt is None else salt
        if self.cache.config.press is not None:
            if self.spans is None:
                self.cache.free(seq)
            else:
                span_release(self.spans, self.cache, seq, tokens, salt, self.span_link)
                self._trim()
            return
        n, ps = seq.length, self.cache.page_size
        if self.cache.quantized:  # only sealed pages; the fp32 tail stays with the sequence
            n = min(n, min(len(t) for t in seq.tables) * ps)
        elif n % ps and self._shared(seq, n // ps):
            n -= n % ps  # a partial last page someone else holds (a cached page the sequence never wrote into)
        if n and len(tokens) >= n:
            path, taken = self.index.insert(tokens[:n], seq.tables, salt)
            for g, p in taken:
                self.cache.pages.share(g, [p])
            if self.link is not None:
                self.link.write_through(path, salt)
        self.cache.free(seq)
        self._trim()

    def _shared(self, seq: SeqKV, i: int) -> bool:
        """Whether page ``i`` of the sequence is also held elsewhere (in any group)."""
        return any(i < len(t) and t[i] != HOLE and self.cache.pages.shared(g, t[i])
                   for g, t in enumerate(seq.tables))

    # -- eviction ---------------------------------------------------------------------------------
    def _in_use(self, g: int, p: int) -> bool:
        return self.cache.pages.shared(g, p)  # someone besides the index holds it

    def _drop(self, nodes: list[Node]) -> None:
        for n in nodes:
            for g, p in n.live_pages():
                self.cache.pages.drop(g, [p])
        self.stats_.evicted_pages += sum(len(list(n.live_pages())) for n in nodes)

    def reclaim(self, group: int, short: int) -> None:
        """Free at least ``short`` pages of ``group`` if the policy allows: what the pool cannot
        grow by (all of it when static, beyond the budget when dynamic) is evicted; otherwise only
        what exceeds ``max_cached_tokens`` (see the module doc)."""
        room = self.cache.room(group)
        if room is not None and room < short:
            if self.spans is not None:
                self.stats_.evicted_pages += self.spans.evict(short - room)
            self._drop(self.index.evict(short - room, group, self._in_use))
        else:
            self._trim()

    def _trim(self) -> None:
        """Dynamic pools: evict cached pages beyond ``max_cached_tokens``."""
        limit = -(-self.config.max_cached_tokens // self.cache.page_size)
        if self.spans is not None:
            while self.spans.cached_slots() > self.config.max_cached_tokens and self.spans.evict(1):
                pass
        for g in range(len(self.cache.groups)):
            over = self.cached_pages(g) - limit
            if over > 0:
                self._drop(self.index.evict(over, g, self._in_use))

    def held_pages(self) -> dict[int, list[int]]:
        """Per group, the pages the index holds (each once): the Evictor contract."""
        if self.spans is not None:
            return self.spans.held_pages()  # a press cache's radix index stays empty
        return self.index.held_pages()

    def remap(self, group: int, moves: dict[int, int]) -> None:
        """The cache's shrink moved pages of ``group`` (old -> new): renumber the index's."""
        self.index.remap(group, moves)
        if self.spans is not None:
            self.spans.remap(group, moves)

    def cached_pages(self, group: int | None = None) -> int:
        held = self.held_pages()
        groups = held if group is None else {group: held[group]}
        return sum(1 for g, pages in groups.items() for p in pages if not self._in_use(g, p))

    def clear(self) -> None:
        """Drop the RAM index (tiers keep their entries)."""
        self._drop(self.index.clear())
        if self.spans is not None:
            self.spans.clear()

    def stats(self) -> PrefixStats:
        s = self.stats_
        s.cached_pages, s.nodes = self.cached_pages(), self.index.num_nodes
        if self.spans is not None:
            s.nodes = len(self.spans.entries)
        if self.link is not None:
            s.tier_tokens, s.rejected = self.link.restored_tokens, self.link.rejected
            s.tiers = self.link.tiers.stats_dict()
        if self.span_link is not None:
            s.tier_tokens = self.span_link.restored_tokens
        return s

    def tenant_stats(self, salt: str | None) -> dict[str, int]:
        """What the index holds for one tenant: its nodes, tokens and pages (held once per group)."""
        salt = self.config.salt if salt is None else salt
        nodes = list(self.index.nodes(salt))
        return {"nodes": len(nodes), "cached_tokens": sum(len(n.tokens) for n in nodes),
                "pages": sum(1 for n in nodes for _ in n.live_pages())}

    def flush(self) -> None:
        if self.tiers is not None:
            self.tiers.flush()

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()
