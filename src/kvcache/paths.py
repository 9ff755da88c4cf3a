"""Where kvcache keeps converted models and other per-user state."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def one_at_a_time(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file ``lock`` (made 0600 if missing, never through a link)
    for the block. Processes that would make the same thing (a kernel library, a converted model)
    take turns: the later one finds the first one's result when it checks again inside the block,
    instead of making it a second time beside it. The file is removed as the block ends (nothing is
    left beside the results; a process that opened it meanwhile still takes its turn, and at worst
    a third one makes the thing beside it, each written atomically). Where locks are unavailable it
    just runs."""
    try:
        import fcntl

        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # a file system without locks: as before, each makes its own
        yield
    finally:
        try:
            os.unlink(lock)
        except OSError:
            pass
        os.close(fd)
