"""PageEntries: the tensors one prefix page is stored as in a tier entry, for one cache layout.

- ``fits(tensors)``: whether a decoded entry holds exactly this layout's tensors and shapes (each
  layer group's all or none: a windowed group may have dropped the page);
- ``tensors(pages)``: copies of one index node's pages (per group, or HOLE), named
  ``layer{i}.kv`` (float pools: [2, Hkv, 1, page_size, D]) or ``layer{i}.{part}`` (quantized
  pools: each part with one page), ready to encode;
- ``load(entries)``: fresh pool pages holding the entries, as many as the pool has room for, each
  layer written with one copy.

``hold`` and ``unhold`` put index nodes' pages into a sequence's page tables (one reference more
each) and take the last one off again.

Locking: none; called on the engine thread (the tensors it returns may go to the writer thread).
"""

from __future__ import annotations

import torch

from kvcache.cache.paged import PagedKVCache
from kvcache.cache.pool import PagePool
from kvcache.cache.sequence import HOLE, SeqKV
from kvcache.errors import CacheFull
from kvcache.prefix.radix import Node


class PageEntries:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.shapes: dict[str, tuple[int, ...]] = {}  # tensor name -> shape
        self.dtypes: dict[str, torch.dtype] = {}  # tensor name -> dtype
        self.group_names: list[list[str]] = []  # per group, its tensors' names
        for g in cache.groups:
            pool, names = cache.pools[g.index], []
            for j, layer in enumerate(g.layers):
                if isinstance(pool, PagePool):  # [2, Hkv, 1, ps, D]
                    named = {"kv": ((2, pool.num_kv_heads, 1, pool.page_size, pool.head_dim), pool.dtype)}
                else:  # each part [*, pages, ...] with one page
                    named = {n: ((t.shape[0], 1, *t.shape[2:]), t.dtype) for n, t in pool.parts[j].items()}
                for n, (shape, dtype) in named.items():
                    self.shapes[f"layer{layer}.{n}"] = tuple(shape)
                    self.dtypes[f"layer{layer}.{n}"] = dtype
                    names.append(f"layer{layer}.{n}")
            self.group_names.append(names)

    def fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether an entry holds this layout's tensors with the pool's shapes and dtypes, each
        group's all or none (a page of a windowed group may be out of its window)."""
        if any(n not in self.shapes or tuple(t.shape) != self.shapes[n] or t.dtype != self.dtypes[n]
               for n, t in tensors.items()):
            return False
        return all(sum(n in tensors for n in names) in (0, len(names)) for names in self.group_names)

    def tensors(self, pages: list[int]) -> dict[str, torch.Tensor]:
        """Copies of one page per group (``pages[g]``, HOLE: none), by tensor name."""
        out: dict[str, torch.Tensor] = {}
        for g in self.cache.groups:
            p = pages[g.index]
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

    def load(self, entries: list[dict[str, torch.Tensor]]) -> list[list[int]]:
        """Pool pages (per group, or HOLE) for each entry, in order, as many as the pool has room
        for; each layer's pages are written with one copy."""
        cache, out = self.cache, []
        for tensors in entries:
            pages: list[int] = []
            try:
                for g in cache.groups:
                    has = self.group_names[g.index][0] in tensors  # all of the group's, or none (fits)
                    pages.append(cache.pages.take(g.index, 1)[0] if has else HOLE)
            except CacheFull:  # no room to restore more: the rest is recomputed
                for gi, p in enumerate(pages):
                    if p != HOLE:
                        cache.pages.drop(gi, [p])
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


def hold(cache: PagedKVCache, seq: SeqKV, nodes: list[Node]) -> None:
    """Append the nodes' pages to the sequence's tables (one more reference each)."""
    for g in range(len(cache.groups)):
        pages = [n.pages[g] for n in nodes]
        cache.pages.share(g, [p for p in pages if p != HOLE])
        seq.tables[g].extend(pages)


def unhold(cache: PagedKVCache, seq: SeqKV, node: Node) -> None:
    """Take the last node appended by ``hold`` off the sequence's tables again."""
    for g in range(len(cache.groups)):
        p = seq.tables[g].pop()
        assert p == node.pages[g]
        if p != HOLE:
            cache.pages.drop(g, [p])
