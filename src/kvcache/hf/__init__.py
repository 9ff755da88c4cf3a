"""The Hugging Face bridge: kvcache's cache strategies as ``transformers`` caches.

    from kvcache.hf import make_cache
    cache = make_cache(model, "int4,sinks=4,window=1024")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=200)

``PromptCache`` prefills a shared prefix once and forks it per request (shared pages). Importing
this module checks that the installed transformers is in the supported range.

- cache.py    KVCache / make_cache: the ``transformers.Cache`` face, one BridgeLayer per layer
- store.py    PageStore: the rows' sequences in a PagedKVCache; writes and reads per layer, planned
              by cache/plan.py (the engine's planner) with ``reads="window"``
- layout.py, prompt.py, version.py   the model's layer types, PromptCache, the supported versions

Owns the translation between transformers' cache calls and kvcache's pages. May not plan reads
itself or change the cache except through PagedKVCache's API; transformers computes attention.
"""

from __future__ import annotations

from kvcache.hf.version import SUPPORTED, UnsupportedTransformers, check_transformers_version

TRANSFORMERS_VERSION = check_transformers_version()

from kvcache.hf.cache import KVCache, make_cache  # noqa: E402
from kvcache.hf.prompt import PromptCache  # noqa: E402

__all__ = ["KVCache", "PromptCache", "SUPPORTED", "TRANSFORMERS_VERSION", "UnsupportedTransformers",
           "check_transformers_version", "make_cache"]
