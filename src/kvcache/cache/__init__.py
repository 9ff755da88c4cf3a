"""The KV substrate: page pool, allocator, page tables, memory accounting."""

from kvcache.cache.allocator import PageAllocator
from kvcache.cache.context import PagedContext
from kvcache.cache.paged import CacheStats, PagedKVCache
from kvcache.cache.pool import PagePool
from kvcache.cache.sequence import SeqKV

__all__ = ["CacheStats", "PageAllocator", "PagedContext", "PagedKVCache", "PagePool", "SeqKV"]
