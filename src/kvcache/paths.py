"""Where kvcache keeps converted models and other per-user state."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
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


OWNER = "owner.pid"  # in a scratch folder: the process writing it
STALE_S = 3600.0  # a scratch folder with no readable owner is left alone this long


def scratch(parent: Path, prefix: str) -> Path:
    """A new temporary folder ``parent/<prefix>*`` to be renamed into place when complete, marked
    with this process's id, after removing the ones of that prefix a killed process left behind
    (their owner no longer runs; an unmarked one once it is STALE_S old)."""
    _sweep(parent, prefix)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    (tmp / OWNER).write_text(str(os.getpid()))
    return tmp


def _sweep(parent: Path, prefix: str) -> None:
    for old in parent.glob(f"{prefix}*"):
        try:
            pid = int((old / OWNER).read_text())
        except (OSError, ValueError):
            pid = None
        try:
            if pid is not None:
                os.kill(pid, 0)
                continue  # its owner still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        try:
            if pid is None and time.time() - old.stat().st_mtime < STALE_S:
                continue  # being made right now by a process that has not written its mark yet
        except OSError:
            continue
        shutil.rmtree(old, ignore_errors=True)


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
