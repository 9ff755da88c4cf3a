"""Attention over what the cache returns.

- interface.py  AttentionContext: the one call a model's attention layer makes
- dense.py      dense attention on gathered K/V, masks, RecomputeContext (the ``none`` strategy)
- backends.py   PagedContext: attention over the paged cache, choosing fused decode, the native
                pattn/xattn/qattn kernels or dense attention (import it from there: it pulls in
                the cache, which model code never needs)
"""

from kvcache.attention.dense import RecomputeContext, attend_dense, visibility_mask
from kvcache.attention.interface import AttentionContext

__all__ = ["AttentionContext", "RecomputeContext", "attend_dense", "visibility_mask"]
