"""PrefixCache: the radix index bound to a PagedKVCache's pools and allocators, and its tiers.

- ``lookup(tokens, salt)``: a new sequence holding the longest reusable cached prefix of
  ``tokens`` (never all of them: the last token is recomputed for its logits). RAM first; then,
  page by page, the disk and Redis tiers (their entries are loaded into fresh pool pages).
- ``release(seq, tokens, salt)``: a finished sequence's pages go into the index (one reference
  each, held by the index), then the sequence lets go of its own references.
- ``reclaim(group, short)``: called by the cache when a pool lacks pages: evicts unreferenced
  cached pages (LRU/LFU). A static pool evicts as much as it needs; a dynamic pool evicts only
  what exceeds ``max_cached_tokens`` and otherwise grows.

With tiers, every full page the index takes is written through (on a background thread) under a
chained key of (model fingerprint, cache layout, tenant salt, the token ids up to that page), so
other processes and later runs find it. A tier entry that is missing, corrupt or for another
layout is a miss; the tokens are recomputed.

Locking: none; the engine calls it from one thread (the tier writer thread only sees bytes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from kvcache.cache.paged import PagedKVCache
from kvcache.cache.pool import PagePool
from kvcache.cache.sequence import HOLE, SeqKV
from kvcache.errors import CacheFull
from kvcache.prefix.config import PrefixConfig
from kvcache.prefix.radix import Match, Node, RadixIndex


RESTORE_BATCH = 16  # pages asked of the tiers at once


@dataclass
class PrefixStats:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0  # prompt tokens whose K/V came from the index or a tier
    tier_tokens: int = 0  # of those, restored from disk or Redis
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
        self.layout = _layout_text(cache)
        self.tiers = _open_tiers(config) if config.tiers else None
        self._shapes, self._group_names = self._entry_layout()  # what a page entry must hold
        cache.reclaim = self.reclaim
        cache.index_pages = self.index.held_pages

    # -- lookup -----------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], salt: str | None = None, whole: bool = False) -> tuple[SeqKV, int]:
        """A new sequence holding the K/V of the longest reusable prefix of ``tokens[:-1]`` (of all
        of ``tokens`` when ``whole``)."""
        salt = self.config.salt if salt is None else salt
        want = tokens if whole else tokens[:-1]
        m = self.index.match(want, salt)
        seq = self.cache.new_sequence()
        self._hold(seq, m.nodes)  # held first: restoring from a tier may evict, never these
        if self.tiers is not None and m.length % self.cache.page_size == 0:
            self._restore(want, m, salt, seq)
        length = self._usable(m)
        keep = -(-length // self.cache.page_size)
        for g in range(len(self.cache.groups)):
            dropped = seq.tables[g][keep:]
            self.cache.allocators[g].release([p for p in dropped if p != HOLE])
            del seq.tables[g][keep:]
        seq.length = length
        self.stats_.requests += 1
        self.stats_.prompt_tokens += len(tokens)
        self.stats_.hit_tokens += length
        return seq, length

    def _hold(self, seq: SeqKV, nodes: list[Node]) -> None:
        """Append the nodes' pages to the sequence's tables (one more reference each)."""
        for g in range(len(self.cache.groups)):
            pages = [n.pages[g] for n in nodes]
            self.cache.allocators[g].incref([p for p in pages if p != HOLE])
            seq.tables[g].extend(pages)

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

    def _restore(self, tokens: list[int], m: Match, salt: str, seq: SeqKV) -> None:
        """Extend a page-aligned RAM match with full pages found in the tiers, asking for up to
        RESTORE_BATCH chained keys at once (one Redis round trip) and loading each layer's pages
        with one copy."""
        from kvcache.prefix.entry import decode_entry

        ps = self.cache.page_size
        parent = m.nodes[-1] if m.nodes else self.index.root(salt)
        key = self._key(parent, salt)
        while m.length + ps <= len(tokens):
            keys, chunks = [], []
            at = m.length
            while at + ps <= len(tokens) and len(keys) < RESTORE_BATCH:
                chunks.append(tuple(tokens[at : at + ps]))
                key = _page_key(key, chunks[-1])
                keys.append(key)
                at += ps
            found = []
            for k, blob in zip(keys, self.tiers.get_many(keys)):  # type: ignore[union-attr]
                tensors = None if blob is None else decode_entry(blob, k)
                if tensors is not None and not self._fits(tensors):
                    tensors = None  # readable, but shaped for another layout
                if tensors is None:
                    if blob is not None:  # corrupt or not this prefix's: drop it, recompute the tokens
                        self.tiers.discard(k)  # type: ignore[union-attr]
                        self.stats_.rejected += 1
                    break
                found.append(tensors)
            loaded = self._load_entries(found)  # fewer when the pool has no room for all
            for chunk, k, pages in zip(chunks, keys, loaded):
                node = self.index.add_child(parent, chunk, pages)
                node.key = k
                self._hold(seq, [node])
                m.nodes.append(node)
                m.length += ps
                self.stats_.tier_tokens += ps
                parent = node
            if len(loaded) < len(keys):
                break

    def _entry_layout(self) -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
        """The shape of every tensor a page entry of this layout holds (by name), and each
        group's names."""
        shapes: dict[str, tuple[int, ...]] = {}
        groups: list[list[str]] = []
        for g in self.cache.groups:
            pool, names = self.cache.pools[g.index], []
            for j, layer in enumerate(g.layers):
                if isinstance(pool, PagePool):  # [2, Hkv, 1, ps, D]
                    named = {"kv": (2, pool.num_kv_heads, 1, pool.page_size, pool.head_dim)}
                else:  # each part [*, pages, ...] with one page
                    named = {n: (t.shape[0], 1, *t.shape[2:]) for n, t in pool.parts[j].items()}
                for n, shape in named.items():
                    shapes[f"layer{layer}.{n}"] = tuple(shape)
                    names.append(f"layer{layer}.{n}")
            groups.append(names)
        return shapes, groups

    def _fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether an entry holds this layout's tensors with the pool's shapes, each group's all or
        none (a page of a windowed group may be out of its window)."""
        if any(n not in self._shapes or tuple(t.shape) != self._shapes[n] for n, t in tensors.items()):
            return False
        return all(sum(n in tensors for n in names) in (0, len(names)) for names in self._group_names)

    def _load_entries(self, entries: list[dict]) -> list[list[int]]:
        """Pool pages (per group, or HOLE) for each entry, in order, as many as the pool has room
        for; each layer's pages are written with one copy."""
        cache, out = self.cache, []
        for tensors in entries:
            pages = []
            try:
                for g in cache.groups:
                    has = self._group_names[g.index][0] in tensors  # all of the group's, or none (_fits)
                    pages.append(cache._take_pages(g.index, 1)[0] if has else HOLE)
            except CacheFull:  # no room to restore more: the rest is recomputed
                for gi, p in enumerate(pages):
                    if p != HOLE:
                        cache.allocators[gi].release([p])
                break
            out.append(pages)
        for g in cache.groups:
            rows = [(i, pages[g.index]) for i, pages in enumerate(out) if pages[g.index] != HOLE]
            if not rows:
                continue
            pool, ids = cache.pools[g.index], [p for _, p in rows]
            for j, layer in enumerate(g.layers):
                if isinstance(pool, PagePool):
                    pool.load_pages(j, ids, torch.cat([entries[i][f"layer{layer}.kv"] for i, _ in rows], 2))
                else:
                    pool.load_pages(j, ids, {n: torch.cat([entries[i][f"layer{layer}.{n}"] for i, _ in rows], 1)
                                             for n in pool.parts[j]})
        return out

    # -- insertion --------------------------------------------------------------------------------
    def release(self, seq: SeqKV, tokens: list[int], salt: str | None = None) -> None:
        """Put a finished sequence's pages into the index, then free the sequence."""
        salt = self.config.salt if salt is None else salt
        n = seq.length
        if self.cache.quantized:  # only sealed pages; the fp32 tail stays with the sequence
            n = min(n, min(len(t) for t in seq.tables) * self.cache.page_size)
        if n and len(tokens) >= n:
            path, taken = self.index.insert(tokens[:n], seq.tables, salt)
            for g, p in taken:
                self.cache.allocators[g].incref([p])
            if self.tiers is not None:
                self._write_through(path, salt)
        self.cache.free(seq)
        self._trim()

    def _write_through(self, path: list[Node], salt: str) -> None:
        from kvcache.prefix.entry import encode_entry

        key = self._key(None, salt)
        for node in path:
            if len(node.tokens) < self.cache.page_size:
                break
            if node.key is not None:
                key = node.key
                continue
            key = node.key = _page_key(key, node.tokens)
            tensors = self._page_tensors(node)  # copies: the page may be evicted and reused later
            self.tiers.put_async(key, lambda k=key, t=tensors: encode_entry(k, t))  # type: ignore[union-attr]

    def _page_tensors(self, node: Node) -> dict:
        out = {}
        for g in self.cache.groups:
            p = node.pages[g.index]
            if p == HOLE:
                continue
            pool = self.cache.pools[g.index]
            for j, layer in enumerate(g.layers):
                state = pool.page_state(j, [p])
                if isinstance(state, dict):
                    out.update({f"layer{layer}.{n}": t.contiguous() for n, t in state.items()})
                else:
                    out[f"layer{layer}.kv"] = state.contiguous()
        return out

    def _key(self, node: Node | None, salt: str) -> bytes:
        """The chained tier key of ``node`` (the root's when None), computed along its path."""
        from kvcache.prefix.keys import root_key

        path = []
        while node is not None and node.parent is not None:
            if node.key is not None:
                break
            path.append(node)
            node = node.parent
        key = node.key if node is not None and node.key is not None else root_key(self.fingerprint, self.layout, salt)
        for n in reversed(path):
            key = n.key = _page_key(key, n.tokens)
        return key

    # -- eviction ---------------------------------------------------------------------------------
    def _in_use(self, g: int, p: int) -> bool:
        return self.cache.allocators[g].refcount(p) > 1  # someone besides the index holds it

    def _drop(self, nodes: list[Node]) -> None:
        for n in nodes:
            for g, p in n.live_pages():
                self.cache.allocators[g].release([p])
        self.stats_.evicted_pages += sum(len(list(n.live_pages())) for n in nodes)

    def reclaim(self, group: int, short: int) -> None:
        """Free at least ``short`` pages of ``group`` if the policy allows (see the module doc)."""
        if self.cache.config.capacity == "static":
            self._drop(self.index.evict(short, group, self._in_use))
        else:
            self._trim()

    def _trim(self) -> None:
        """Dynamic pools: evict cached pages beyond ``max_cached_tokens``."""
        limit = -(-self.config.max_cached_tokens // self.cache.page_size)
        for g in range(len(self.cache.groups)):
            over = self.cached_pages(g) - limit
            if over > 0:
                self._drop(self.index.evict(over, g, self._in_use))

    def cached_pages(self, group: int | None = None) -> int:
        held = self.index.held_pages()
        groups = held if group is None else {group: held[group]}
        return sum(1 for g, pages in groups.items() for p in pages if not self._in_use(g, p))

    def clear(self) -> None:
        """Drop the RAM index (tiers keep their entries)."""
        self._drop(self.index.clear())

    def stats(self) -> PrefixStats:
        s = self.stats_
        s.cached_pages, s.nodes = self.cached_pages(), self.index.num_nodes
        if self.tiers is not None:
            s.tiers = self.tiers.stats_dict()
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


def _page_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    from kvcache.prefix.keys import page_key

    return page_key(parent, tokens)


def _layout_text(cache: PagedKVCache) -> str:
    c, m = cache.config, cache.model
    return json.dumps({"encoding": c.encoding, "page_size": cache.page_size, "group_size": c.group_size,
                       "layers": m.num_layers, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
                       "groups": [[list(g.layers), g.window, g.sinks] for g in cache.groups]}, sort_keys=True)


def _open_tiers(config: PrefixConfig):
    from kvcache.prefix.tiers import DiskTier, RedisTier, TierChain

    tiers = []
    if config.disk is not None:
        tiers.append(DiskTier(config.disk, config.disk_bytes))
    if config.redis is not None:
        tiers.append(RedisTier(config.redis))
    return TierChain(tiers)
