"""Attention over what the cache returns.

- interface.py  AttentionContext: the one call a model's attention layer makes
- dense.py      dense attention on gathered K/V, masks
- recompute.py  RecomputeContext (the ``none`` strategy): the cache's kernels over a scratch pool
- backends.py   PagedContext: attention over the paged cache, choosing the fused kernels, the
                native cattn/qattn kernels or dense attention (import it from there: it pulls in
                the cache, which model code never needs)

Owns the attention math and the choice of backend. May not plan reads or allocate pages (the
cache's plan.py and paged.py do); it writes a forward's K/V where the plan says.
"""

from kvcache.attention.dense import attend_dense
from kvcache.cache.visibility import visibility_mask
from kvcache.attention.recompute import RecomputeContext
from kvcache.attention.interface import AttentionContext

__all__ = ["AttentionContext", "RecomputeContext", "attend_dense", "visibility_mask"]
