"""CacheParts: what a PagedKVCache is made of, as the modules below paged.py read it.

The page manager (pages.py), retention (retention.py) and accounting (accounting.py) work on a
cache's pools, groups and sequences, but paged.py builds on them: they name the cache by these
protocols instead of importing it, so the folder stays a stack. ``PagedKVCache`` is the one
implementation; ``PageOps`` is the part of its page manager (``cache.pages``) they call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from kvcache.cache.config import CacheConfig
from kvcache.cache.evictor import Evictor
from kvcache.cache.groups import LayerGroup
from kvcache.cache.pool import PagePool
from kvcache.cache.qpool import QuantPool
from kvcache.cache.sequence import SeqKV

if TYPE_CHECKING:  # the model's shape comes in; the cache imports nothing of models/
    from kvcache.models.config import ModelConfig


class PageOps(Protocol):
    """The page manager's counts and the page moves retention makes (cache/pages.py has them all)."""

    def free(self, group: int) -> int: ...

    def total(self, group: int) -> int: ...

    def used(self, group: int) -> int: ...

    def refcount(self, group: int, page: int) -> int: ...

    def check(self, group: int) -> None: ...

    def drop(self, group: int, pages: Iterable[int]) -> None: ...

    def own_pages(self, seq: SeqKV, group: int, first: int, stop: int) -> None: ...


class CacheParts(Protocol):
    """A paged cache's parts: its shape and configuration, per layer group a pool, the live
    sequences, the evictor beside them and its page manager."""

    model: "ModelConfig"
    config: CacheConfig  # capacity already filled in (CacheConfig.with_capacity)
    page_size: int  # config.pages_of
    groups: list[LayerGroup]
    pools: list[PagePool | QuantPool]  # one per group, in group order
    sequences: dict[int, SeqKV]
    evictor: Evictor | None
    cow_copies: int  # pages copied because a branch wrote into a shared one

    @property
    def pages(self) -> PageOps: ...
