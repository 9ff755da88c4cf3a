"""Attention over what the cache returns."""

from kvcache.attention.context import AttentionContext, RecomputeContext
from kvcache.attention.dense import attend_dense, visibility_mask

__all__ = ["AttentionContext", "RecomputeContext", "attend_dense", "visibility_mask"]
