"""The KV substrate: page pool, allocator, page tables, read planning, memory accounting."""

from kvcache.cache.allocator import PageAllocator
from kvcache.cache.paged import CacheStats, PagedKVCache
from kvcache.cache.plan import ForwardPlan, ReadPlan
from kvcache.cache.pool import PagePool
from kvcache.cache.sequence import SeqKV

__all__ = ["CacheStats", "ForwardPlan", "PageAllocator", "PagedKVCache", "PagePool", "ReadPlan", "SeqKV"]
