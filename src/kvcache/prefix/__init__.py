"""Prefix caching: a radix index over shared pages and its persistent tiers.

- radix.py   RadixIndex: token ids -> pages, page by page (tensor-free), LRU/LFU eviction
- cache.py   PrefixCache: the index bound to a PagedKVCache; lookup, release, reclaim, tiers
- config.py  PrefixConfig: budget, policy, disk/Redis tiers, tenant salt
- keys.py, entry.py, tiers.py   chained keys, page entries, the disk and Redis stores
"""

from kvcache.prefix.config import PrefixConfig

__all__ = ["PrefixConfig"]
