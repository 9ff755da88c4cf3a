"""kvcache: LLM inference with the KV cache at its centre.

Public API: LLM, SamplingParams, CacheConfig, PrefixConfig, SchedulerConfig, ChatSession (imported lazily, so that
``import kvcache.cache`` does not load the model stack).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "kvcache.engine.llm",
    "SamplingParams": "kvcache.engine.params",
    "RequestOutput": "kvcache.engine.params",
    "CompletionOutput": "kvcache.engine.params",
    "ChatSession": "kvcache.engine.session",
    "CacheConfig": "kvcache.cache.config",
    "PrefixConfig": "kvcache.prefix.config",
    "SchedulerConfig": "kvcache.engine.scheduler",
    "parse_kv_spec": "kvcache.cache.config",
    "KVCacheError": "kvcache.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvcache' has no attribute {name!r}")
