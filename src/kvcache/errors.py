"""User-facing errors: each carries one line that names the problem.

The CLI prints ``kvcache: <message>`` and exits with status 2 for any of these; the Python API
raises them as they are. Every class derives from ``ValueError`` so callers that already catch bad
input keep working.
"""

from __future__ import annotations


class KVCacheError(ValueError):
    """Base class for errors caused by input the user can fix."""


class ModelLoadError(KVCacheError):
    """The model path, file or id cannot be loaded (missing, not a model, corrupt, unsupported)."""


class UnsupportedArchitecture(ModelLoadError):
    """The model's architecture has no native implementation."""


class ContextOverflow(KVCacheError):
    """A prompt (plus requested tokens) does not fit the model context or the cache capacity."""


class CacheFull(ContextOverflow):
    """The KV pool has no free page left and nothing evictable (every page is referenced)."""


class InvalidParams(KVCacheError):
    """A sampling or cache parameter is out of range."""


class ConstraintFault(KVCacheError):
    """The grammar refused a token the engine chose under its own mask: a fault of the server
    (the grammar and the tokens it was built for disagree), never of the request."""
