"""The KV substrate: where K/V live and who holds which page.

- paged.py       PagedKVCache: per layer group a pool, per sequence page tables, its page manager
- pages.py       PageManager (``cache.pages``): the only code that takes, shares, gives back, moves
                 or counts pages: ask (a step's pages, or a typed Refusal), reserve, truncate,
                 release, copy-on-write, windows' dead pages, shrink
- evictor.py     Evictor: the contract with whatever else holds pages (the prefix index)
- plan.py        ForwardPlan / ReadPlan: what a forward writes where and what each sequence reads
- pool.py, qpool.py, quant.py   float pages; quantized pages (KIVI) and their codes
- allocator.py, groups.py, sequence.py, placement.py, prefetch.py, budget.py, capacity.py,
  accounting.py, persist.py, config.py   free lists, layer groups, page tables, device/host/disk,
  layer-ahead fetching, a budget's text, room and capacity, stats and the integrity check, cache
  files, CacheConfig
- parts.py       CacheParts / PageOps: the protocols through which the modules below paged.py read it

The folder is a stack: each module imports only modules below it. Bottom to top: budget, prefetch,
sequence, allocator, evictor, placement, quant, visibility; config, pool, qpool; groups;
capacity, parts; retention, accounting; pages; paged; plan, persist.

Owns pages (through its page manager alone), page tables, lengths and the cache's configuration. May not compute attention
(attention/) or know what a prefix index keeps beyond the Evictor contract (prefix/).
"""

from __future__ import annotations

import importlib
from typing import Any

# imported on first use, so that the pure modules (config.py, budget.py, ...) load without torch
_EXPORTS = {"PageAllocator": "allocator", "CacheStats": "paged", "PagedKVCache": "paged", "ForwardPlan": "plan",
            "ReadPlan": "plan", "PagePool": "pool", "SeqKV": "sequence"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"kvcache.cache.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kvcache.cache' has no attribute {name!r}")
