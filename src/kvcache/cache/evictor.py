"""Evictor: the contract between a PagedKVCache and whatever else holds its pages (the prefix index).

A cache is given at most one evictor, at construction or attached once afterwards
(``PagedKVCache.attach_evictor``: an evictor built on the cache, as ``PrefixCache`` is). The cache
calls it; it never reaches into the cache except through the cache's public methods (``room``,
the page manager ``cache.pages``: take, share, drop, reference counts).

- ``reclaim(group, short)``: a pool of ``group`` lacks ``short`` pages; free what the evictor's
  policy allows (it may free nothing: the pool then grows, or the allocation fails).
- ``held_pages()``: per group, the pages the evictor holds one reference to, for accounting
  (cached pages) and the integrity check (every reference has a holder).
- ``remap(group, moves)``: ``shrink`` renumbered pages of ``group`` (old -> new); the evictor
  updates what it holds.
"""

from __future__ import annotations

from typing import Protocol


class Evictor(Protocol):
    def reclaim(self, group: int, short: int) -> None: ...

    def held_pages(self) -> dict[int, list[int]]: ...

    def remap(self, group: int, moves: dict[int, int]) -> None: ...
