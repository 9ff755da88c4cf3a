"""The Hugging Face bridge: kvcache's cache strategies as ``transformers`` caches.

    from kvcache.hf import make_cache
    cache = make_cache(model, "int4,sinks=4,window=1024")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=200)

``PromptCache`` prefills a shared prefix once and forks it per request (shared pages). Importing
this module checks that the installed transformers is in the supported range.
"""

from __future__ import annotations

from kvcache.hf.version import SUPPORTED, UnsupportedTransformers, check_transformers_version

TRANSFORMERS_VERSION = check_transformers_version()

from kvcache.hf.cache import KVCache, make_cache  # noqa: E402
from kvcache.hf.prompt import PromptCache  # noqa: E402

__all__ = ["KVCache", "PromptCache", "SUPPORTED", "TRANSFORMERS_VERSION", "UnsupportedTransformers",
           "check_transformers_version", "make_cache"]
