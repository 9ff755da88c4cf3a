"""Where kvcache keeps converted models and other per-user state."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """$KVCACHE_HOME, else $XDG_CACHE_HOME/kvcache, else ~/.cache/kvcache (created on demand)."""
    env = os.environ.get("KVCACHE_HOME")
    if env:
        base = Path(env)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvcache"
    base.mkdir(parents=True, exist_ok=True)
    return base
