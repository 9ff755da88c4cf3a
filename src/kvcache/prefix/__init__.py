"""Prefix caching: a radix index over shared pages and its persistent tiers.

- radix.py      RadixIndex: token ids -> pages, page by page (tensor-free), LRU/LFU eviction
- cache.py      PrefixCache: the index bound to a PagedKVCache (its Evictor); lookup, release, reclaim
- pages.py      page entries <-> pool pages; holding index pages in a sequence's tables
- restore.py    TierLink: chained tier keys, restore from the tiers, write-through
- tier_base.py  the Tier protocol, TierUnavailable, TierStats
- tiers.py      TierChain (tiers in order, a writer thread); tier_disk.py, tier_redis.py the stores
- config.py     PrefixConfig: budget, policy, disk/Redis tiers, tenant salt
- keys.py, entry.py   chained keys, page entries as bytes with a digest or MAC

Owns what is shared between requests and processes; touches the KV cache only through its
public API (its page manager ``cache.pages``: take, share, drop; the Evictor contract).
"""

from kvcache.prefix.config import PrefixConfig

__all__ = ["PrefixConfig"]
