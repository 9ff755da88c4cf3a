"""SpanIndex: compressed prompts shared between requests, for caches with a question-agnostic press.

A press (``knorm``, ``expected``) compresses a prompt once it is in; what it keeps depends on that
prompt alone, so the next request whose prompt starts with the same tokens can start from the same
compressed pages (a shared system prompt). One entry per compressed prompt: its token ids, per
layer group the pages holding its kept slots and the position each slot holds (per layer and KV
head), and, for quantized caches, the fp32 tail after its sealed pages. Entries are keyed by the
tenant salt and every token id, in an index of their own: a press cache never reads the radix
index's uncompressed pages, and those never see these.

The index holds one reference to each page it stores (pages shared by several entries, the
prompts of one chat for instance, are held once); an entry no running sequence uses is evictable,
least recently used first.

Locking: none; the engine calls it from one thread.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvcache.cache.paged import PagedKVCache
from kvcache.cache.sequence import SeqKV



class SpanStore(Protocol):
    """Where spans go beyond this process (kvcache.prefix.span_tiers.SpanLink is one)."""

    def find(self, tokens: list[int], salt: str, limit: int) -> "SpanEntry | None": ...

    def write(self, entry: "SpanEntry") -> None: ...


@dataclass
class SpanEntry:
    salt: str
    tokens: tuple[int, ...]
    pages: list[list[int]]  # per group
    slots: list[int]  # per group: slots in use
    pos: list[torch.Tensor]  # per group [n_layers, Hkv, slots] int32
    tails: list[list[torch.Tensor] | None]  # per group, per layer [2, Hkv, t, D] (quantized) or None
    last_used: int = 0
    key: bytes | None = field(default=None, repr=False)  # tier key, when written through


class SpanIndex:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.entries: dict[tuple[str, tuple[int, ...]], SpanEntry] = {}
        self.lengths: dict[str, set[int]] = {}  # per salt, the entries' lengths
        self.refs: list[dict[int, int]] = [{} for _ in cache.groups]  # page -> entries holding it
        self._clock = itertools.count(1)

    # -- lookup -----------------------------------------------------------------------------------
    def match(self, tokens: list[int], salt: str, limit: int) -> SpanEntry | None:
        """The longest entry whose tokens begin ``tokens``, at most ``limit`` long."""
        for n in sorted(self.lengths.get(salt, ()), reverse=True):
            if n <= limit:
                e = self.entries.get((salt, tuple(tokens[:n])))
                if e is not None:
                    e.last_used = next(self._clock)
                    return e
        return None

    def attach(self, entry: SpanEntry, seq: SeqKV) -> None:
        """Make the empty sequence ``seq`` hold the entry's tokens (pages shared, ref + 1)."""
        st = seq.press
        assert st is not None and seq.length == 0
        for g in range(len(self.cache.groups)):
            self.cache.pages.share(g, entry.pages[g])
            seq.tables[g] = list(entry.pages[g])
            seq.dropped[g] = len(entry.tokens) - entry.slots[g]
            st.append(g, 0, entry.slots[g])
            st.pos[g][:, :, : entry.slots[g]] = entry.pos[g]
            tails = entry.tails[g]
            if tails is not None:
                seq.tails[g] = [t.clone() for t in tails]
        seq.length = st.since = len(entry.tokens)
        st.points = [len(entry.tokens)]

    # -- insertion --------------------------------------------------------------------------------
    def insert(self, seq: SeqKV, tokens: list[int], salt: str, length: int, slots: list[int]) -> SpanEntry | None:
        """Index the sequence's first ``length`` tokens, held in its first ``slots[g]`` slots."""
        key = (salt, tuple(tokens[:length]))
        if key in self.entries:
            self.entries[key].last_used = next(self._clock)
            return None
        cache, ps, st = self.cache, self.cache.page_size, seq.press
        assert st is not None
        pages, tails = [], []
        for g, c in enumerate(slots):
            if cache.quantized:
                sealed = len(seq.tables[g]) * ps
                if c < sealed:
                    return None  # its last slots were sealed with later ones
                pages.append(list(seq.tables[g]))
                tails.append([t[:, :, : c - sealed].clone() for t in seq.tails[g]])  # type: ignore[union-attr]
            else:
                pages.append(list(seq.tables[g][: -(-c // ps)]))
                tails.append(None)
        pos = [st.pos[g][:, :, :c].clone() for g, c in enumerate(slots)]
        return self.adopt(SpanEntry(salt, key[1], pages, list(slots), pos, tails))

    def adopt(self, entry: SpanEntry) -> SpanEntry:
        """Index an entry: the index takes one reference to each of its pages it did not hold."""
        for g, pages in enumerate(entry.pages):
            for p in pages:
                n = self.refs[g].get(p, 0)
                if not n:
                    self.cache.pages.share(g, [p])
                self.refs[g][p] = n + 1
        entry.last_used = next(self._clock)
        self.entries[(entry.salt, entry.tokens)] = entry
        self.lengths.setdefault(entry.salt, set()).add(len(entry.tokens))
        return entry

    # -- eviction ---------------------------------------------------------------------------------
    def _in_use(self, e: SpanEntry) -> bool:
        return any(self.cache.pages.shared(g, p) for g, pages in enumerate(e.pages) for p in pages)

    def drop(self, e: SpanEntry) -> int:
        """Forget an entry; returns the pages given back to the pool."""
        del self.entries[(e.salt, e.tokens)]
        if not any(s == e.salt and len(t) == len(e.tokens) for s, t in self.entries):
            self.lengths[e.salt].discard(len(e.tokens))
        freed = 0
        for g, pages in enumerate(e.pages):
            for p in pages:
                self.refs[g][p] -= 1
                if not self.refs[g][p]:
                    del self.refs[g][p]
                    self.cache.pages.drop(g, [p])
                    freed += 1
        return freed

    def evict(self, need: int | None) -> int:
        """Drop least recently used entries no sequence uses until ``need`` pages are free (all
        such entries when None); returns the pages given back."""
        freed = 0
        for e in sorted(self.entries.values(), key=lambda x: x.last_used):
            if need is not None and freed >= need:
                break
            if not self._in_use(e):
                freed += self.drop(e)
        return freed

    def held_pages(self) -> dict[int, list[int]]:
        return {g: list(refs) for g, refs in enumerate(self.refs)}

    def remap(self, group: int, moves: dict[int, int]) -> None:
        self.refs[group] = {moves.get(p, p): n for p, n in self.refs[group].items()}
        for e in self.entries.values():
            e.pages[group] = [moves.get(p, p) for p in e.pages[group]]

    def cached_slots(self) -> int:
        """Slots held by entries (the first group's), for the index's size bound."""
        return sum(e.slots[0] for e in self.entries.values())

    def clear(self) -> None:
        for e in list(self.entries.values()):
            self.drop(e)


def span_lookup(index: SpanIndex, cache: PagedKVCache, tokens: list[int], salt: str, whole: bool,
                link: "SpanStore | None" = None) -> tuple[SeqKV, int]:
    """A new sequence holding the longest compressed prompt that begins ``tokens`` (never all of
    them unless ``whole``): from RAM, else from the tiers through ``link``; or an empty one."""
    limit = len(tokens) if whole else len(tokens) - 1
    entry = index.match(tokens, salt, limit)
    if link is not None:
        longer = link.find(tokens, salt, limit) if entry is None or len(entry.tokens) < limit else None
        entry = longer if longer is not None and (entry is None or len(longer.tokens) > len(entry.tokens)) else entry
    seq = cache.new_sequence()
    if entry is None:
        return seq, 0
    index.attach(entry, seq)
    return seq, len(entry.tokens)


def span_release(index: SpanIndex, cache: PagedKVCache, seq: SeqKV, tokens: list[int], salt: str,
                 link: "SpanStore | None" = None) -> None:
    """Index every prompt the finished sequence compressed (the tokens before each compression
    point still sit in its first slots), then free it."""
    from kvcache.cache.retention import cut_point

    st = seq.press
    if st is not None:
        for length in st.points:
            if 0 < length <= min(len(tokens), seq.length):
                cuts = cut_point(cache, seq, length)
                entry = index.insert(seq, tokens, salt, length, cuts) if cuts is not None else None
                if entry is not None and link is not None:
                    link.write(entry)
    cache.free(seq)
